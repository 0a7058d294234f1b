"""Mesh tests run on 8 simulated CPU devices; tests/conftest.py sets XLA_FLAGS
before jax loads.
"""

import helpers
import jax
import pytest


@pytest.fixture(autouse=True)
def _eight_devices():
  if jax.device_count() < 8:
    pytest.fail(
      f"mesh tests need 8 devices, jax has {jax.device_count()}: jax was "
      f"imported before tests/conftest.py could set "
      f"XLA_FLAGS={helpers.DEVICES_FLAG}"
    )
