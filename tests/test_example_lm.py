"""Runs examples/compare_precision.py (and so train_lm.py) at a tiny size and
checks what its figure claims to show.
"""

import pathlib
import runpy

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  plot = tmp_path_factory.mktemp("plot") / "compare.png"
  # Not run as __main__: nothing trains until main() is called.
  main = runpy.run_path(str(EXAMPLES / "compare_precision.py"))["main"]
  args = "--settings small-init --runs fp32,none,deepspeed --size tiny"
  args += " --steps 40 --eval-every 20 --eval-batches 2 --max-chars 200000"
  args += " --init-scale 65536"  # no skipped steps: runs stay comparable
  results = main(args.split() + ["--plot", str(plot)])
  runs = {
    f"{r['config'].precision} {r['config'].scaler}": r
    for r in results["small-init"]
  }
  return runs, plot


def test_writes_the_figure(run):
  _, plot = run
  assert plot.stat().st_size > 20_000
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_share_model_data_and_steps(run):
  runs, _ = run
  assert list(runs) == ["fp32 none", "fp16 none", "fp16 deepspeed"]
  first = [r["val_loss"][0] for r in runs.values()]
  # Same init and validation data: the step-0 loss (float32 eval of the same
  # masters) is identical in every run.
  np.testing.assert_allclose(first, first[0], rtol=1e-6)
  for r in runs.values():
    assert len(r["loss"]) == 40 and r["eval_steps"].tolist() == [0, 20, 40]
    assert r["skipped_steps"] == int(r["overflow"].sum())


def test_unscaled_fp16_gradients_underflow(run):
  runs, _ = run
  zero = {k: float(np.mean(r["zero_frac"])) for k, r in runs.items()}
  # At init std 1e-5 many true gradients are below float16's smallest
  # subnormal (6e-8): without scaling they flush to zero...
  assert zero["fp16 none"] > 0.05, zero
  # ...a scale of 2**16 keeps most of them, and float32 all but a few.
  assert zero["fp16 deepspeed"] < zero["fp16 none"] / 3, zero
  assert zero["fp32 none"] < zero["fp16 deepspeed"] + 0.01, zero
  # The unscaled run never overflows and its loss scale stays 1.
  assert runs["fp16 none"]["skipped_steps"] == 0
  assert (runs["fp16 none"]["loss_scale"] == 1.0).all()


def test_scaled_fp16_tracks_fp32(run):
  runs, _ = run
  ref = runs["fp32 none"]["val_loss"]
  assert ref[-1] < ref[0] - 0.5  # it learns
  np.testing.assert_allclose(runs["fp16 deepspeed"]["val_loss"], ref, atol=0.05)


def test_benchmark_compares_the_same_step():
  """benchmarks/train_step_cost.py times fp16_scaling against plain optax on
  the same model and batch; one step of each from the same parameters moves
  them alike (Adam's first update is lr * sign(grad); the unscaled float16
  gradients may flush a few elements to zero that the scaled ones keep).
  """
  bench = runpy.run_path(
    str(EXAMPLES.parent / "benchmarks" / "train_step_cost.py")
  )
  lm = bench["train_lm"]
  cfg = lm.Config(**lm.SIZES["tiny"], init_scale=2.0**16)  # no overflow
  rng = np.random.default_rng(0)
  x = rng.integers(0, lm.VOCAB, (cfg.batch, cfg.seq_len)).astype(np.int32)
  y = rng.integers(0, lm.VOCAB, (cfg.batch, cfg.seq_len)).astype(np.int32)
  after = {}
  for name in ("scaled_step", "plain_step"):
    tx, step = bench[name](cfg)
    params = lm.init_params(cfg)
    params, _, metrics = step(params, tx.init(params), x, y)
    after[name] = np.concatenate([np.ravel(p) for p in jax.tree.leaves(params)])
  before = np.concatenate(
    [np.ravel(p) for p in jax.tree.leaves(lm.init_params(cfg))]
  )
  moved = np.abs(after["plain_step"] - before)
  assert np.median(moved) > 0.5 * cfg.lr  # the plain step did update
  same = np.isclose(after["scaled_step"], after["plain_step"], atol=1e-6)
  assert same.mean() > 0.95, same.mean()
