"""What ``stacked_axes`` costs: train_lm's scanned transformer (``--scan``),
its guarded optimizer step with ``stacked_axes=fs.stacked_under("blocks")``
against the same step without it, in one process, in interleaved rounds.

Two steps are timed: the optimizer update alone (``tx.update`` and the
parameter update on fixed float16 gradients, the part that differs) and the
whole train step (forward, backward and update). Both are jitted with their
state donated and the CPU copy option on. Prints one table row per size and
step: the median over rounds of each side's per-step wall time, their
ratio, and the bytes XLA's cost analysis counts for each compiled step.

    python benchmarks/stacked_cost.py                   # small and medium
    python benchmarks/stacked_cost.py --sizes tiny --rounds 3 --steps 5
    python benchmarks/stacked_cost.py --kinds update --rounds 15 --steps 50
"""

import argparse
import os
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

import fp16_scaling as fs  # noqa: E402

OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def make_tx(cfg, stacked: bool):
  scaler = fs.deepspeed_scaler(init_scale=2.0**8)
  axes = fs.stacked_under("blocks") if stacked else None
  return fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(scaler, stacked_axes=axes),
      fs.clip_by_unscaled_norm(cfg.max_norm),
      optax.adamw(cfg.lr, weight_decay=1e-4),
    )
  )


def sides(cfg, grads, x, y):
  """Per side: (update step, train step), and the state each starts from."""
  out = {}
  grad_fn = train_lm.make_grad_fn(cfg)
  for name, stacked in (("without", False), ("with", True)):
    tx = make_tx(cfg, stacked)

    def update(params, state, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    def train(params, state, tx=tx):
      half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
      _, g, _ = grad_fn(half, x, y, fs.current_scale(state))
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

    jit = lambda f: jax.jit(f, donate_argnums=(0, 1), compiler_options=OPTIONS)
    out[name] = (tx, {"update": jit(update), "train": jit(train)})
  return out


def bytes_of(step, params, state) -> float:
  cost = step.lower(params, state).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("bytes accessed", float("nan")))


def timed(step, params, state, steps):
  params, state = step(params, state)  # compiled and warm
  jax.block_until_ready(params)
  t0 = time.perf_counter()
  for _ in range(steps):
    params, state = step(params, state)
  jax.block_until_ready(params)
  return (time.perf_counter() - t0) / steps


def run(size, rounds, steps, kinds=("update", "train")):
  cfg = train_lm.Config(**dict(train_lm.SIZES[size]), scan=True)
  params = train_lm.init_params(cfg)
  rng = np.random.default_rng(0)
  x, y = train_lm.batches(np.arange(10_000, dtype=np.uint8) % 100, cfg, rng)
  half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  grads = jax.jit(train_lm.make_grad_fn(cfg))(half, x, y, 256.0)[1]
  both = sides(cfg, grads, x, y)
  for kind in kinds:
    times = {"without": [], "with": []}
    for _ in range(rounds):  # interleaved: both sides see the same load
      for name, (tx, steps_of) in both.items():
        fresh = jax.tree.map(jnp.copy, params)
        times[name].append(timed(steps_of[kind], fresh, tx.init(fresh), steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = [
      bytes_of(s[kind], params, tx.init(params)) for tx, s in both.values()
    ]
    yield (size, kind, med["without"], med["with"], *nbytes)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="small,medium")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--kinds", default="update,train")
  args = p.parse_args(argv)
  print(
    "| size | step | without (ms) | with stacked_axes (ms) | ratio | "
    "bytes without | bytes with |"
  )
  print("|---|---|---:|---:|---:|---:|---:|")
  for size in args.sizes.split(","):
    rows = run(size, args.rounds, args.steps, args.kinds.split(","))
    for _, kind, a, b, na, nb in rows:
      ms = f"{1e3 * a:.2f} | {1e3 * b:.2f} | {b / a:.3f}x"
      print(f"| {size} | {kind} | {ms} | {na:.4g} | {nb:.4g} |", flush=True)


if __name__ == "__main__":
  main()
