"""Session-wide setup: 8 simulated CPU devices for the mesh tests in
tests/mesh/.

XLA reads XLA_FLAGS once, when jax is first imported, so this must run before
any test module imports jax. Tests that do not use a mesh are unaffected: they
run on the default device, cpu:0. This folder is on ``sys.path`` (pytest puts
a rootless conftest's folder there), so test modules can ``import helpers``.
"""

import importlib.util
import os
import pathlib

import helpers

os.environ["XLA_FLAGS"] = helpers.with_eight_devices(
  os.environ.get("XLA_FLAGS", "")
)

_PEERS = pathlib.Path(__file__).resolve().parent / "peers"


def pytest_ignore_collect(collection_path, config):
  """Leave tests/peers/ unimported when ``-m`` deselects every peers test, so
  that ``pytest -m "not peers"`` needs no PyTorch and does not pay for
  importing DeepSpeed."""
  if collection_path.resolve() != _PEERS or not config.option.markexpr:
    return None
  try:  # pytest's own evaluator is private: on any change, collect as usual
    from _pytest.mark.expression import Expression

    selected = Expression.compile(config.option.markexpr).evaluate(
      lambda name, **kwargs: name == "peers" and not kwargs
    )
  except Exception:
    return None
  return True if not selected else None


# Tests whose every step another test repeats: the docs pages' snippets run
# without their PyTorch side (for ``-m "not peers"``), and again with it
# under tests/peers. When both are selected and PyTorch is there, the one with
# the PyTorch blocks runs alone.
_SUPERSEDED = {
  "tests/test_docs_porting.py::"
  "test_porting_page_runs_alone[porting-torch.md]": (
    "tests/peers/test_porting_torch.py::test_the_page_runs"
  ),
  "tests/test_docs_checkpoints.py::test_checkpoint_snippets_run": (
    "tests/peers/test_peer_docs_checkpoints.py::"
    "test_checkpoint_snippets_run_with_torch"
  ),
}


def pytest_collection_modifyitems(config, items):
  selected = {item.nodeid for item in items}
  if not selected & set(_SUPERSEDED.values()):
    return
  if importlib.util.find_spec("torch") is None:
    return
  drop = [item for item in items if _SUPERSEDED.get(item.nodeid) in selected]
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = [item for item in items if item not in drop]
