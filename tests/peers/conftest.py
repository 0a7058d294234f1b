"""Tests against the PyTorch peers' own code: DeepSpeed, torch.amp, Megatron.

Every test in this folder gets the ``peers`` marker, so ``pytest -m "not
peers"`` is the fast loop that needs no PyTorch. The peers' environment is set
here, before any of them is imported: DeepSpeed picks its accelerator and
torch its compiler on first import.
"""

import os

import helpers
import pytest

os.environ["DS_ACCELERATOR"] = "cpu"
os.environ["TORCHDYNAMO_DISABLE"] = "1"

_HERE = os.path.dirname(__file__)


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if str(item.fspath).startswith(_HERE):
      item.add_marker(pytest.mark.peers)


@pytest.fixture(scope="session")
def seed() -> int:
  """The peer tests' random seed; set FP16_SCALING_PEER_SEED to draw others."""
  return helpers.SEED
