"""Runs examples/compare_precision.py (and so train_lm.py) at a tiny size and
checks what its figure claims to show.
"""

import argparse
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs

pytest.importorskip("flax")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
# The tiny size with one transformer block, not two: every claim below holds
# at that depth, and each of the file's seven step compiles costs less.
LAYERS = 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  plot = tmp_path_factory.mktemp("plot") / "compare.png"
  # Not run as __main__: nothing trains until main() is called.
  main = runpy.run_path(str(EXAMPLES / "compare_precision.py"))["main"]
  # The figure's accum-128 setting at the tiny size. The tiny model's
  # gradients are larger per element than the default size's, so it takes a
  # loss divided by 512 (not 128) to lose as much of them in float16.
  args = "--settings accum-128 --accumulate 512 --runs fp32,none,deepspeed"
  args += f" --size tiny --layers {LAYERS} --steps 40 --eval-every 20"
  args += " --eval-batches 2"
  args += " --max-chars 200000"
  args += " --init-scale 65536"  # no skipped steps: runs stay comparable
  results = main(args.split() + ["--plot", str(plot)])
  runs = {
    f"{r['config'].precision} {r['config'].scaler}": r
    for r in results["accum-128"]
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
    assert len(r["loss"]) == 40
    assert r["eval_steps"].tolist() == [0, 20, 40]
    assert r["skipped_steps"] == int(r["overflow"].sum())
    assert (r["config"].accumulate, r["config"].micro) == (512, 1)


def test_unscaled_fp16_gradients_underflow(run):
  runs, _ = run
  zero = {k: float(np.mean(r["zero_frac"])) for k, r in runs.items()}
  # With the loss divided by 512 many true gradients are below float16's
  # smallest subnormal (6e-8): without scaling they flush to zero (28% of
  # the elements measured)...
  assert zero["fp16 none"] > 0.2, zero
  # ...a scale of 2**16 keeps all but a few, as float32 does.
  assert zero["fp16 deepspeed"] < 0.01, zero
  assert zero["fp32 none"] < 0.01, zero
  # The unscaled run never overflows and its loss scale stays 1.
  assert runs["fp16 none"]["skipped_steps"] == 0
  assert (runs["fp16 none"]["loss_scale"] == 1.0).all()


def test_scaled_fp16_tracks_fp32_and_unscaled_trains_worse(run):
  runs, _ = run
  ref = runs["fp32 none"]["val_loss"]
  assert ref[-1] < ref[0] - 0.5  # it learns
  # Measured: 3.558 for float32 and the scaled run, 3.935 without scaling.
  np.testing.assert_allclose(runs["fp16 deepspeed"]["val_loss"], ref, atol=0.02)
  assert runs["fp16 none"]["val_loss"][-1] > ref[-1] + 0.2


def _flat(tree) -> np.ndarray:
  """Every leaf of ``tree``, raveled into one vector."""
  return np.concatenate([np.ravel(p) for p in jax.tree.leaves(tree)])


def test_benchmark_compares_the_same_step():
  """benchmarks/train_step_cost.py times fp16_scaling against plain optax on
  the same model and batch; one step of each from the same parameters moves
  them alike (Adam's first update is lr * sign(grad); the unscaled float16
  gradients may flush a few elements to zero that the scaled ones keep).
  """
  bench = runpy.run_path(str(EXAMPLES.parent / "benchmarks/train_step_cost.py"))
  lm = bench["train_lm"]
  # The same model on a batch of one window, not 16: the comparison holds
  # at any batch, and the two float16 step compiles cost a fifth less.
  tiny = dict(lm.SIZES["tiny"], layers=LAYERS, batch=1)
  cfg = lm.Config(**tiny, init_scale=2.0**16)  # no overflow
  rng = np.random.default_rng(0)
  shape = (cfg.batch, cfg.seq_len)
  x = rng.integers(0, lm.VOCAB, shape).astype(np.int32)
  y = rng.integers(0, lm.VOCAB, shape).astype(np.int32)
  after = {}
  for name in ("scaled_step", "plain_step"):
    tx, step = bench[name](cfg)
    params = lm.init_params(cfg)
    params, _, metrics = step(params, tx.init(params), x, y)
    after[name] = _flat(params)
  before = _flat(lm.init_params(cfg))
  moved = np.abs(after["plain_step"] - before)
  assert np.median(moved) > 0.5 * cfg.lr  # the plain step did update
  same = np.isclose(after["scaled_step"], after["plain_step"], atol=1e-6)
  assert same.mean() > 0.95, same.mean()


def _lm():
  return runpy.run_path(str(EXAMPLES / "train_lm.py"))


def test_accumulation_sums_microbatch_gradients_of_the_divided_loss():
  """train_lm's accumulation recipe, in float32 against plain jax.grad: the
  sum over K microbatches of grad(loss_k / K) is the gradient of the mean loss
  over all K microbatches (the mean of their gradients: they are of equal
  size), and one microbatch run alone gives grad(loss_1) / K.
  """
  lm = _lm()
  k = 4
  base = dict(lm["SIZES"]["tiny"], layers=LAYERS)
  base.update(precision="fp32", scaler="none")
  full = lm["Config"](**base, accumulate=k)
  one = lm["Config"](**base, accumulate=k, microbatches=1)
  tokens, _ = lm["load_corpus"](max_chars=50_000)
  x, y = lm["batches"](tokens, full, np.random.default_rng(0))
  assert x.shape == (k, full.batch, full.seq_len)
  params = lm["init_params"](full)
  model = lm["make_model"](full)

  # One compile, one microbatch at a time.
  value_and_grad = jax.jit(
    jax.value_and_grad(lambda p, x, y: lm["loss_fn"](model, p, x, y))
  )
  per_microbatch = [value_and_grad(params, x[i], y[i]) for i in range(k)]
  losses, grads = zip(*per_microbatch)
  want = jax.tree.map(lambda *g: sum(g) / k, *grads)
  accumulated = jax.jit(lm["make_grad_fn"](full))
  loss, got, _ = accumulated(params, x, y, 1.0)
  np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-8)

  one_microbatch = jax.jit(lm["make_grad_fn"](one))
  _, got_one, _ = one_microbatch(params, x[0], y[0], 1.0)
  for g, w in zip(jax.tree.leaves(got_one), jax.tree.leaves(grads[0])):
    np.testing.assert_allclose(g, w / k, rtol=1e-6, atol=1e-12)


def test_config_refuses_bad_accumulation():
  cfg = _lm()["Config"]
  with pytest.raises(ValueError, match="accumulate must be >= 1"):
    cfg(accumulate=0)
  with pytest.raises(ValueError, match=r"microbatches must be in \[0, acc"):
    cfg(accumulate=4, microbatches=5)


def test_scan_stacks_the_same_blocks_and_names_the_overflowing_layer():
  lm = _lm()
  p = argparse.ArgumentParser()
  lm["add_config_args"](p)
  cfg = lm["config_from_args"](
    p.parse_args("--size tiny --layers 2 --scan --init-scale 256".split())
  )
  flat = lm["Config"](**dict(lm["SIZES"]["tiny"], layers=2))
  assert cfg.scan and not flat.scan
  # The unrolled model's blocks, stacked, are the scanned model's params.
  unrolled = lm["init_params"](flat)
  stacked = {k: v for k, v in unrolled.items() if not k.startswith("Block_")}
  blocks = [unrolled[f"Block_{i}"] for i in range(2)]
  stacked["blocks"] = {
    "Block_0": jax.tree.map(lambda *b: jnp.stack(b), *blocks)
  }
  params = lm["init_params"](cfg)
  assert jax.tree.structure(stacked) == jax.tree.structure(params)
  x = jnp.arange(2 * cfg.seq_len).reshape(2, -1) % 100
  y = (x + 1) % 100

  def loss(config, params):
    model = lm["make_model"](config, jnp.float32)
    return lm["loss_fn"](model, params, x, y)

  np.testing.assert_allclose(
    loss(cfg, stacked), loss(flat, unrolled), rtol=1e-5
  )
  # An inf in block 1's gradients is named by layer.
  tx = lm["make_optimizer"](cfg)
  state = tx.init(params)
  half = jax.tree.map(lambda q: q.astype(jnp.float16), params)
  grad_fn = jax.jit(lm["make_grad_fn"](cfg))
  _, grads, _ = grad_fn(half, x, y, fs.current_scale(state))
  dense = grads["blocks"]["Block_0"]["Dense_0"]
  dense["kernel"] = dense["kernel"].at[1, 0, 0].set(jnp.inf)
  _, state = jax.jit(tx.update)(grads, state, params)
  report = fs.overflow_report(state)
  assert report.nonfinite_layers == (1,)
  path = "['blocks']['Block_0']['Dense_0']['kernel'][1]"
  assert report.nonfinite_leaves == (path,)
