"""Two processes x 2 CPU devices, joined by jax.distributed over loopback.

Each process runs tests/multihost/worker.py in its own interpreter (so this
pytest process's 8-device XLA_FLAGS do not matter) and writes what it saw;
the test compares the two. See worker.py for the steps.
"""

import json
import os
import sys

import helpers
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
INJECT = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  port = helpers.free_port()
  worker = [sys.executable, os.path.join(HERE, "worker.py"), port]
  cmds = [
    [str(a) for a in worker + [i, tmp / f"out{i}.json", tmp]] for i in range(2)
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for i, (code, log) in enumerate(helpers.launch(cmds, env)):
    assert code == 0, f"process {i} failed:\n{log[-4000:]}"
  return [json.loads((tmp / f"out{i}.json").read_text()) for i in range(2)]


def test_only_process_1_holds_the_inf(results):
  assert [r["holds_inf"] for r in results] == [False, True]


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_every_process_skips_with_the_same_scale_counters_and_norms(
  results, mode
):
  a, b = results[0][mode], results[1][mode]
  assert json.dumps(a) == json.dumps(b)  # bit for bit
  overflow = [bool(r["overflow"]) for r in a]
  assert overflow == [t == INJECT for t in range(len(a))]
  assert [r["params_unchanged"] for r in a] == overflow
  assert a[-1]["skipped_steps"] == 1
  # By hand: window 2 from 256 (DeepSpeed's delay): grows on the 3rd clean
  # step (t=2), halves on the overflow (t=3).
  assert [r["loss_scale"] for r in a] == [256, 256, 512, 256, 256, 256]
  for r in a:
    if r["overflow"]:
      assert r["grad_norm"] == 0.0  # reported as 0.0, never NaN
    else:
      assert r["grad_norm"] == pytest.approx(r["numpy_norm"], rel=1e-6)


def test_jit_and_shard_map_agree(results):
  for r in results:
    for x, y in zip(r["jit"], r["shard_map"]):
      assert x["loss_scale"] == y["loss_scale"]
      assert x["overflow"] == y["overflow"]
      if not x["overflow"]:
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-6)


def test_orbax_checkpoint_from_both_processes_resumes_bitwise(results):
  assert [r["resume_bitwise"] for r in results] == [True, True]
  assert json.dumps(results[0]["resumed"]) == json.dumps(results[1]["resumed"])
