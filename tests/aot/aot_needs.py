"""What tests/aot need, as a fixture their modules import (a conftest.py
here would be a second module named ``conftest`` beside tests/conftest.py,
which ``--doctest-modules`` collects): the step compiled for GPUs and a
TPU on this CPU, with no device (deviceless ahead-of-time compilation:
benchmarks/gpu_kernels.py).

They need ``.venv-aot`` (``.ci/setup-aot``: the CUDA 12 plugin, its PJRT
and libtpu, pinned next to the pinned jax) and ``JAX_PLATFORMS=cpu``,
which .ci/run's aot step gives them: elsewhere (the pinned venv, a real
GPU) they are skipped, and with ``FP16_SCALING_AOT=1`` (that step) a
missing compiler is an error, not a skip.
"""

import importlib.util
import os

import helpers
import pytest

NEEDS = {"jax_plugins.xla_cuda12": "jax-cuda12-plugin", "libtpu": "jax[tpu]"}


def _missing() -> list:
  found = []
  for module, package in NEEDS.items():
    try:
      spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
      spec = None
    if spec is None:
      found.append(package)
  if os.environ.get("JAX_PLATFORMS") != "cpu":
    found.append("JAX_PLATFORMS=cpu")
  return found


@pytest.fixture(scope="session")
def gpu_kernels():
  """benchmarks/gpu_kernels.py as a module, or a skip (a failure with
  ``FP16_SCALING_AOT=1``) naming what is missing."""
  missing = _missing()
  if missing:
    why = f"deviceless compilation needs {', '.join(missing)} (.ci/setup-aot)"
    if os.environ.get("FP16_SCALING_AOT") == "1":
      pytest.fail(why)
    pytest.skip(why)
  return helpers.load_script(helpers.ROOT / "benchmarks" / "gpu_kernels.py")
