#!/usr/bin/env python
"""Cost of an accumulating step: fp16_scaling against ``optax.MultiSteps``.

``accumulate_gradients(chain(fp16_loss_scale, clip,
adamw), K)`` against ``MultiSteps(chain(clip_by_global_norm, adamw), K)``
on the same float16 gradients, donated, timed on a window's last
microbatch and on the others (the counter set before every call), back to
back in alternating order; bytes counted on the branch each call takes
(``hlo_traffic.total_bytes``). benchmarks/README.md has the details.

  python benchmarks/accumulate_cost.py                 # 4M/100, K=4
  python benchmarks/accumulate_cost.py --tiny          # seconds; smoke test
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
import hlo_traffic  # noqa: E402
import recipes  # noqa: E402
import step_cost  # noqa: E402

TARGET_WALL, TARGET_BYTES = 1.03, 1.00


def build(k):
  """``{"base": (init, step), "ours": (init, step)}``, the steps jitted with
  parameters and state donated."""
  import jax
  import optax

  import fp16_scaling as fs

  base = optax.MultiSteps(recipes.clip_adamw(), k)
  ours = fs.accumulate_gradients(recipes.fp16_tx(0), k)
  steps = dict(
    base=recipes.stepping(base, recipes.to_f32), ours=recipes.stepping(ours)
  )
  return {
    name: (init, jax.jit(step, donate_argnums=(0, 1)))
    for name, (init, step) in steps.items()
  }


def with_counter(value):
  """A ``prepare`` for ``_common.stepper``: the state with its microbatch
  counter set, a fresh scalar each call (its buffer is donated)."""
  import jax.numpy as jnp

  return lambda s: s._replace(mini_step=jnp.asarray(value, jnp.int32))


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  shape = step_cost.parse_shape
  p.add_argument("--shape", default="4M/100", type=shape, help="PARAMS/LEAVES")
  p.add_argument("--k", type=int, default=4, help="microbatches per window")
  p.add_argument("--repeats", type=int, default=30)
  p.add_argument("--inner", type=int, default=5, help="calls per sample")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--tiny", action="store_true", help="4096/8, 3 repeats")
  p.add_argument("--json", help="write the results here")
  args = p.parse_args(argv)
  if args.tiny:
    args.shape, args.repeats, args.inner, args.warmup = shape("4096/8"), 3, 2, 1
  shape, (n, num_leaves) = args.shape

  params, grads, _ = recipes.make_inputs(n, num_leaves)
  phases = {"others": 0, "last": args.k - 1}
  hlo_bytes, xla_bytes, units = {}, {}, {phase: [] for phase in phases}
  for name, (init, fn) in build(args.k).items():
    p0 = recipes.copy_tree(params)
    state = recipes.copy_tree(init(p0))
    compiled, box = fn.lower(p0, state, grads).compile(), [p0, state]
    xla_bytes[name] = common.costs(compiled)["bytes_accessed"]
    for phase, counter in phases.items():
      # Branch 1 of the accumulation cond is the window's end (true).
      top = None if name == "base" else int(phase == "last")
      hlo_bytes[(name, phase)] = hlo_traffic.total_bytes(
        compiled.as_text(), top
      )
      sample = common.stepper(fn, box, grads, args.inner, with_counter(counter))
      units[phase].append(((name, phase), sample))
  samples = common.split(
    common.interleaved(list(units.values()), args.repeats, args.warmup)
  )[0]

  print(
    f"# accumulating step, {n:,} params in {num_leaves} leaves, K={args.k}; "
    f"{common.machine()}"
  )
  print(
    "| microbatch | base ms | ours ms | wall ours/base (median [IQR]) | "
    "base B/param | ours B/param | bytes ours/base |"
  )
  print("|---|---:|---:|---|---:|---:|---|")
  result = dict(shape=shape, k=args.k, xla_bytes=xla_bytes, phases={})
  for phase in phases:
    base, ours = samples[("base", phase)], samples[("ours", phase)]
    ratios = common.paired(ours, base)
    bb, ob = hlo_bytes[("base", phase)], hlo_bytes[("ours", phase)]
    print(
      f"| {phase} | {statistics.median(base) * 1e3:.3f} | "
      f"{statistics.median(ours) * 1e3:.3f} | "
      f"{common.verdict(ratios, TARGET_WALL)} | {bb / n:.2f} | {ob / n:.2f} | "
      f"{ob / bb:.3f}x {common.judged(ob / bb, TARGET_BYTES)} "
      f"(<= {TARGET_BYTES}x) |"
    )
    result["phases"][phase] = dict(
      base_s=base,
      ours_s=ours,
      wall_ratio=statistics.median(ratios),
      base_bytes=bb,
      ours_bytes=ob,
    )
  print(
    f"XLA bytes accessed (costliest branch of every conditional): base "
    f"{xla_bytes['base'] / n:.2f} B/param, ours {xla_bytes['ours'] / n:.2f} "
    "B/param"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
