"""Mesh tests run on 8 simulated CPU devices; tests/conftest.py sets XLA_FLAGS
before jax loads.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get(
  "XLA_FLAGS", ""
):  # `pytest tests/mesh` from elsewhere
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _eight_devices():
  if jax.device_count() < 8:
    pytest.fail(
      f"mesh tests need 8 devices, jax has {jax.device_count()}: jax was "
      f"imported before "
      f"tests/conftest.py could set XLA_FLAGS={_FLAG}"
    )
