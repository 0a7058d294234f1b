#!/usr/bin/env python
"""Cost of fp16_scaling in a whole train step, against plain optax.

The model is examples/train_lm.py's transformer (float32 masters, float16
forward and backward). Both steps are jitted with parameters and optimizer
state donated, and take the same batch:

  fp16_scaling  grads of ``loss * current_scale(opt_state)`` in float16, then
                ``skip_on_overflow(chain(fp16_loss_scale(deepspeed_scaler(
                init_scale=2**16)), clip_by_unscaled_norm(1.0), adamw))`` and
                the scale metrics, as train_lm.py runs it (minus its
                zero-gradient count).
  plain optax   grads of ``loss`` in float16, cast to float32, then
                ``chain(clip_by_global_norm(1.0), adamw)``: no scaling, no
                overflow check, no skip.

Rounds alternate the order (fp16_scaling first on even rounds, plain first on
odd ones); each round times ``--inner`` steps of each, blocked on the result,
and the ratio fp16_scaling / plain is taken within the round. It prints the
median and quartiles of those paired ratios, for wall time and for the
process's CPU time (all its threads), which other load on a shared machine
moves less, with a 95% bootstrap interval of the median. It also prints
what XLA's cost analysis of each compiled step counts (flops and bytes
accessed), which does not depend on the machine's load.

  python benchmarks/train_step_cost.py                 # train_lm's default size
  python benchmarks/train_step_cost.py --size medium --rounds 20
  python benchmarks/train_step_cost.py --size tiny --rounds 3   # smoke
"""

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "examples")):
  if path not in sys.path:
    sys.path.insert(0, path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_lm  # noqa: E402


def plain_update(cfg):
  """Plain optax's optimizer part: the float16 gradients cast to float32,
  then ``chain(clip_by_global_norm, adamw)``. Returns (tx, update)."""
  tx = optax.chain(
    optax.clip_by_global_norm(cfg.max_norm),
    optax.adamw(cfg.lr, weight_decay=1e-4),
  )

  def update(params, opt_state, grads):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, update


def scaled_update(cfg):
  """fp16_scaling's optimizer part, as train_lm.py builds it."""
  tx = train_lm.make_optimizer(cfg)

  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, update


def plain_step(cfg):
  """The same model's step with plain optax and no loss scaling."""
  model = train_lm.make_model(cfg)
  tx, update = plain_update(cfg)

  def step(params, opt_state, x, y):
    half = jax.tree.map(lambda p: p.astype(cfg.dtype), params)
    loss, grads = jax.value_and_grad(
      lambda p: train_lm.loss_fn(model, p, x, y)
    )(half)
    return *update(params, opt_state, grads), {"loss": loss}

  return tx, jax.jit(step, donate_argnums=(0, 1))


def scaled_step(cfg):
  """train_lm.py's own step with fp16_scaling (minus its zero-gradient
  count)."""
  tx = train_lm.make_optimizer(cfg)
  return tx, train_lm.make_train_step(cfg, tx, measure_zeros=False)


def make_config(size):
  """train_lm's Config of ``size`` as this benchmark runs it: float16,
  DeepSpeed's scaler from 2**16."""
  return train_lm.Config(
    **train_lm.SIZES[size],
    precision="fp16",
    scaler="deepspeed",
    init_scale=2.0**16,
  )


def make_batch(cfg):
  """The one batch (inputs, targets) that every step takes, on the
  device."""
  tokens, _ = train_lm.load_corpus(max_chars=200_000)
  x, y = train_lm.batches(tokens, cfg, np.random.default_rng(0))
  return jax.device_put(x), jax.device_put(y)


def interleaved(samplers, rounds, warmup):
  """Calls every sampler once per round, in the listed order on even rounds
  and reversed on odd ones. Returns {name: [sample of each timed round]}, so
  that item i of every list comes from the same round.
  """
  names = list(samplers)
  samples = {name: [] for name in names}
  for r in range(warmup + rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      sample = samplers[name]()
      if r >= warmup:
        samples[name].append(sample)
  return samples


def optimizer_parts(cfg, params, grads, rounds, inner=50):
  """Median seconds of the optimizer part alone (update and apply, jitted,
  donated, on fixed float16 gradients), fp16_scaling's against plain
  optax's, interleaved.
  """

  def sampler(build):
    tx, update = build(cfg)
    update = jax.jit(update, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    state = [(p, tx.init(p))]

    def sample():
      t0 = time.perf_counter()
      for _ in range(inner):
        state[0] = update(*state[0], grads)
      jax.block_until_ready(state[0])
      return (time.perf_counter() - t0) / inner

    return sample

  times = interleaved(
    {
      "fp16_scaling": sampler(scaled_update),
      "plain optax": sampler(plain_update),
    },
    rounds,
    warmup=2,
  )
  return {name: float(np.median(t)) for name, t in times.items()}


def quartiles(xs):
  q = np.percentile(xs, [25, 50, 75])
  return q[1], q[0], q[2]


def median_interval(xs, n=10_000, seed=0):
  """95% bootstrap interval of the median of ``xs`` (paired-round ratios)."""
  xs = np.asarray(xs)
  idx = np.random.default_rng(seed).integers(0, len(xs), (n, len(xs)))
  return tuple(np.percentile(np.median(xs[idx], axis=1), [2.5, 97.5]))


def ratio_summary(ratios) -> str:
  """Median [quartiles] of per-round ratios, and the median's 95% interval."""
  med, lo, hi = quartiles(ratios)
  ci = median_interval(ratios)
  return (
    f"{med:.3f}x [{lo:.3f}x, {hi:.3f}x] (median [quartiles]), 95% interval "
    f"of the median [{ci[0]:.3f}x, {ci[1]:.3f}x]"
  )


def compiled_cost(step, *args):
  """(flops, bytes accessed) of the compiled step, as XLA counts them."""
  cost = step.lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device
    cost = cost[0]
  return float(cost.get("flops", np.nan)), float(
    cost.get("bytes accessed", np.nan)
  )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--size", choices=sorted(train_lm.SIZES), default="small")
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--inner", type=int, default=5, help="steps per sample")
  p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
  p.add_argument(
    "--control",
    action="store_true",
    help="also time a second, identical plain optax step in the same rounds "
    "and print its ratio to the first: what the method reads for no "
    "difference",
  )
  args = p.parse_args(argv)
  if min(args.rounds, args.inner) < 1 or args.warmup < 0:
    p.error("--rounds and --inner must be >= 1, --warmup >= 0")

  cfg = make_config(args.size)
  x, y = make_batch(cfg)

  builds = {"fp16_scaling": scaled_step, "plain optax": plain_step}
  if args.control:
    builds["plain, again"] = plain_step

  def sampler(run, step, state):
    state = [state]

    def sample():
      t0, c0 = time.perf_counter(), time.process_time()
      for _ in range(args.inner):
        *state[0], run["last"] = step(*state[0], x, y)
      jax.block_until_ready(state[0])
      wall = (time.perf_counter() - t0) / args.inner
      return wall, (time.process_time() - c0) / args.inner

    return sample

  runs = {}
  for name, build in builds.items():
    tx, step = build(cfg)
    params = train_lm.init_params(cfg)
    state = (params, tx.init(params))
    runs[name] = run = {"cost": compiled_cost(step, *state, x, y)}
    run["sample"] = sampler(run, step, state)
  samples = interleaved(
    {name: run["sample"] for name, run in runs.items()},
    args.rounds,
    args.warmup,
  )
  for name, run in runs.items():
    run["t"] = [wall for wall, _ in samples[name]]
    run["cpu"] = [cpu for _, cpu in samples[name]]

  def per_round(name, key="t"):
    base = runs["plain optax"][key]
    return [a / b for a, b in zip(runs[name][key], base)]

  ratios = per_round("fp16_scaling")
  cpu_ratios = per_round("fp16_scaling", "cpu")
  control = per_round("plain, again") if args.control else []

  params = train_lm.init_params(cfg)
  n_params = sum(v.size for v in jax.tree.leaves(params))
  n_leaves = len(jax.tree.leaves(params))
  skipped = int(runs["fp16_scaling"]["last"]["skipped_steps"])
  print(
    f"train step of examples/train_lm.py --size {args.size}: "
    f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.batch}x{cfg.seq_len} "
    f"tokens, {n_params:,} params in {n_leaves} leaves; float16 compute, "
    f"float32 masters, donated"
  )
  print(
    f"{args.rounds} rounds x {args.inner} steps, order alternating; jax "
    f"{jax.__version__}, {platform.machine()}, "
    f"{os.cpu_count()} CPUs, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  for name, run in runs.items():
    med, lo, hi = quartiles(run["t"])
    cpu = np.median(run["cpu"])
    print(
      f"  {name:<13} {1e3 * med:9.2f} ms/step [{1e3 * lo:.2f}, {1e3 * hi:.2f}]"
      f"; process CPU time {1e3 * cpu:.2f} ms/step; XLA counts "
      f"{run['cost'][0] / 1e9:.4f} GFLOP, {run['cost'][1] / 1e6:.2f} MB "
      f"accessed"
    )
  (f1, b1), (f0, b0) = (
    runs[k]["cost"] for k in ("fp16_scaling", "plain optax")
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
  half = jax.tree.map(lambda p: p.astype(cfg.dtype), params)
  grads = jax.grad(
    lambda p: train_lm.loss_fn(train_lm.make_model(cfg), p, x, y)
  )(half)
  parts = optimizer_parts(cfg, params, grads, args.rounds)
  whole = np.median(runs["plain optax"]["t"])
  diff = parts["fp16_scaling"] - parts["plain optax"]
  print(
    f"optimizer part alone (update and apply on the same float16 gradients, "
    f"interleaved): fp16_scaling {1e3 * parts['fp16_scaling']:.3f} ms, plain "
    f"optax {1e3 * parts['plain optax']:.3f} ms; the difference, "
    f"{1e3 * diff:+.3f} ms, is {diff / whole:+.2%} of plain optax's whole step"
  )
  if control:
    print(
      f"control, plain optax again / plain optax, per round: "
      f"{ratio_summary(control)}"
    )
  return {
    "control": control,
    "optimizer_parts": parts,
    "ratios": ratios,
    "cpu_ratios": cpu_ratios,
    "times": {k: v["t"] for k, v in runs.items()},
    "cost": {k: v["cost"] for k, v in runs.items()},
  }


if __name__ == "__main__":
  main()
