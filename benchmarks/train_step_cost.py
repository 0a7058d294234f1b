#!/usr/bin/env python
"""Cost of fp16_scaling in a whole train step, against plain optax.

examples/train_lm.py's own step with fp16_scaling against the same model's
step with plain optax (float16 grads cast to float32, clip, adamw), donated,
on one batch, rounds alternating (``_common.interleaved``): the per-round
ratios of wall and CPU time with a 95% bootstrap interval of the median,
XLA's flops and bytes (``step_cost.py`` times the optimizer step alone).

  python benchmarks/train_step_cost.py                 # train_lm's default size
  python benchmarks/train_step_cost.py --size tiny --rounds 3   # smoke
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402  (puts examples/ on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_lm  # noqa: E402

import fp16_scaling as fs  # noqa: E402


def plain_step(cfg, scale=None):
  """The same model's step with plain optax and no loss scaling: float16
  gradients cast to float32, then ``chain(clip_by_global_norm, adamw)``.
  With a ``scale``, the loss is multiplied by it, the gradients divided,
  and the chain runs inside ``optax.apply_if_finite``. Returns ``(tx,
  step)``, the step jitted with params and state donated."""
  model = train_lm.make_model(cfg)
  tx = optax.chain(
    optax.clip_by_global_norm(cfg.max_norm),
    optax.adamw(cfg.lr, weight_decay=1e-4),
  )
  if scale is not None:
    tx = optax.apply_if_finite(tx, max_consecutive_errors=5)

  def step(params, opt_state, x, y):
    half = jax.tree.map(lambda p: p.astype(cfg.dtype), params)
    loss_fn = lambda p: train_lm.loss_fn(model, p, x, y)
    if scale is None:
      loss, grads = jax.value_and_grad(loss_fn)(half)
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    else:  # a static scale: the gradients of loss * scale, divided by it
      loss, grads = jax.value_and_grad(lambda p: loss_fn(p) * scale)(half)
      loss = loss / scale
      grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  return tx, jax.jit(step, donate_argnums=(0, 1))


def scaled_step(cfg):
  """train_lm.py's own step with fp16_scaling (minus its zero-gradient
  count)."""
  tx = train_lm.make_optimizer(cfg)
  return tx, train_lm.make_train_step(cfg, tx, measure_zeros=False)


def make_config(size):
  """train_lm's Config of ``size`` as this benchmark runs it: float16,
  DeepSpeed's scaler from 2**16."""
  fp16 = dict(precision="fp16", scaler="deepspeed", init_scale=2.0**16)
  return train_lm.Config(**train_lm.SIZES[size], **fp16)


def make_batch(cfg):
  """The one batch (inputs, targets) that every step takes, on the
  device."""
  tokens, _ = train_lm.load_corpus(max_chars=200_000)
  x, y = train_lm.batches(tokens, cfg, np.random.default_rng(0))
  return jax.device_put(x), jax.device_put(y)


def ratio_summary(ratios, n=10_000, seed=0) -> str:
  """Median [quartiles] of per-round ratios, and a 95% bootstrap interval
  of the median (``n`` resamples)."""
  xs = np.asarray(ratios)
  idx = np.random.default_rng(seed).integers(0, len(xs), (n, len(xs)))
  lo, hi = np.percentile(np.median(xs[idx], axis=1), [2.5, 97.5])
  return (
    f"{common.spread(ratios)} (median [quartiles]), 95% interval "
    f"of the median [{lo:.3f}x, {hi:.3f}x]"
  )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", choices=sorted(train_lm.SIZES), default="small")
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--inner", type=int, default=5, help="steps per sample")
  p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
  no_difference = "a second plain optax step: what reads as no difference"
  p.add_argument("--control", action="store_true", help=no_difference)
  args = p.parse_args(argv)
  if min(args.rounds, args.inner) < 1 or args.warmup < 0:
    p.error("--rounds and --inner must be >= 1, --warmup >= 0")

  cfg = make_config(args.size)
  x, y = make_batch(cfg)

  builds = {"fp16_scaling": scaled_step, "plain optax": plain_step}
  if args.control:
    builds["plain, again"] = plain_step

  runs, unit = {}, []
  for name, build in builds.items():
    tx, step = build(cfg)
    params = train_lm.init_params(cfg)
    box = [params, tx.init(params)]  # the training state, stepped in place
    runs[name] = dict(
      box=box, cost=common.costs(step.lower(*box, x, y).compile())
    )
    two = lambda p, s, batch, step=step: step(p, s, *batch)[:2]
    unit.append((name, common.stepper(two, box, (x, y), args.inner)))
  wall, cpu = common.split(common.interleaved([unit], args.rounds, args.warmup))

  ratios = common.paired(wall["fp16_scaling"], wall["plain optax"])
  cpu_ratios = common.paired(cpu["fp16_scaling"], cpu["plain optax"])
  control = []
  if args.control:
    control = common.paired(wall["plain, again"], wall["plain optax"])

  params = train_lm.init_params(cfg)
  n_params = sum(v.size for v in jax.tree.leaves(params))
  n_leaves = len(jax.tree.leaves(params))
  state = runs["fp16_scaling"]["box"][1]
  skipped = int(fs.scale_metrics(state)["skipped_steps"])
  print(
    f"train step of examples/train_lm.py --size {args.size}: "
    f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.batch}x{cfg.seq_len} "
    f"tokens, {n_params:,} params in {n_leaves} leaves; float16 compute, "
    f"float32 masters, donated"
  )
  print(
    f"{args.rounds} rounds x {args.inner} steps, order alternating; "
    f"{common.machine()}"
  )
  for name, run in runs.items():
    t, (f, b) = wall[name], run["cost"].values()
    lo, hi = (1e3 * common.quantile(t, q) for q in (0.25, 0.75))
    print(
      f"  {name:<13} {1e3 * np.median(t):9.2f} ms/step [{lo:.2f}, {hi:.2f}]; "
      f"process CPU time {1e3 * np.median(cpu[name]):.2f} ms/step; XLA counts "
      f"{f / 1e9:.4f} GFLOP, {b / 1e6:.2f} MB accessed"
    )
  (f1, b1), (f0, b0) = (
    runs[k]["cost"].values() for k in ("fp16_scaling", "plain optax")
  )
  print(
    f"XLA cost analysis, fp16_scaling / plain optax: flops {f1 / f0:.4f}x, "
    f"bytes accessed {b1 / b0:.4f}x"
  )
  print(
    f"fp16_scaling / plain optax, per round: {ratio_summary(ratios)}; min "
    f"{min(ratios):.3f}x, max {max(ratios):.3f}x, mean "
    f"{statistics.fmean(ratios):.3f}x; fp16_scaling skipped {skipped} of "
    f"its steps"
  )
  print(
    f"process CPU time, per round: {ratio_summary(cpu_ratios)} (less moved "
    f"by other load on the machine than wall time)"
  )
  if control:
    print(
      f"control, plain optax again / plain optax, per round: "
      f"{ratio_summary(control)}"
    )
  costs = {k: v["cost"] for k, v in runs.items()}
  out = dict(control=control, ratios=ratios)
  return out | dict(cpu_ratios=cpu_ratios, times=wall, cost=costs)


if __name__ == "__main__":
  main()
