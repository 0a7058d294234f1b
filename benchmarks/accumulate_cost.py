#!/usr/bin/env python
"""Cost of an accumulating step: fp16_scaling against ``optax.MultiSteps``.

Both accumulate K microbatches of the same float16 gradients into a float32
accumulator over float32 parameters, clip at a global norm of 1.0 and run
AdamW once per window, with parameters and state donated:

  base  ``optax.MultiSteps(optax.chain(clip_by_global_norm(1.0), adamw), K)``
        on the gradients cast to float32 (no loss scaling);
  ours  ``accumulate_gradients(skip_on_overflow(chain(fp16_loss_scale(
        deepspeed_scaler()), clip_by_unscaled_norm(1.0), adamw)), K)``.

Each is measured on a window's last microbatch (the optimizer step) and on
the others (accumulation only), with the state's microbatch counter set
before every call. Timing rounds interleave the two recipes back to back, in
alternating order, and the verdict is on per-round paired ratios (ours /
base). Bytes are counted on the optimized HLO as ``hlo_traffic.py`` counts
them (operands and result of every instruction that touches memory), on the
branch a call takes: optax 0.2.8's MultiSteps has no branch (it runs the
optimizer on every microbatch and keeps or drops the result with a select);
ours runs one branch of a ``lax.cond``, and a conditional nested in it (the
float32 rescue of ``_norm``, entered only when a finite square overflows
float32) is counted by its cheaper branch. XLA's own ``bytes accessed``,
which counts every conditional by its costliest branch, is printed too.

  python benchmarks/accumulate_cost.py                 # 4M/100, K=4
  python benchmarks/accumulate_cost.py --shape 20M/200 --repeats 40
  python benchmarks/accumulate_cost.py --tiny          # seconds; smoke test
"""

import argparse
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (ROOT, HERE):
  if path not in sys.path:
    sys.path.insert(0, path)

import hlo_traffic  # noqa: E402
import recipes  # noqa: E402

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 1e-4, 1.0
TARGET_WALL, TARGET_BYTES = 1.03, 1.00


def parse_shape(text):
  size, leaves = text.split("/")
  mult = {"K": 10**3, "M": 10**6}.get(size[-1:].upper(), 1)
  return int(float(size[:-1] if mult > 1 else size) * mult), int(leaves)


def build(k):
  import jax
  import jax.numpy as jnp
  import optax

  import fp16_scaling as fs

  adamw = lambda: optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  base = optax.MultiSteps(
    optax.chain(optax.clip_by_global_norm(MAX_NORM), adamw()), k
  )
  ours = fs.accumulate_gradients(
    fs.skip_on_overflow(
      optax.chain(
        fs.fp16_loss_scale(fs.deepspeed_scaler()),
        fs.clip_by_unscaled_norm(MAX_NORM),
        adamw(),
      )
    ),
    k,
  )

  def base_step(params, state, grads):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = base.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def ours_step(params, state, grads):
    updates, state = ours.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return {
    "base": (base.init, jax.jit(base_step, donate_argnums=(0, 1))),
    "ours": (ours.init, jax.jit(ours_step, donate_argnums=(0, 1))),
  }


def make_inputs(n, num_leaves):
  """float32 params and clean float16 gradients: step_cost.py's inputs."""
  params, grads, _ = recipes.make_inputs(n, num_leaves)
  return params, grads


# --------------------------------------------------------------------------
# Bytes on the branch taken.

_BRANCHES = re.compile(
  r"branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+), "
  r"false_computation=%([\w.\-]+)"
)


def taken_bytes(hlo, top_branch):
  """Bytes of the entry computation, entering branch ``top_branch`` (index
  in the HLO's order: 0 = false/first) of each top-level conditional and the
  cheaper branch of any nested one; a ``while`` body counts once."""
  comps, entry = hlo_traffic.computations(hlo)

  def walk(comp, branch):
    total, sizes = 0, {}
    for line in comps.get(comp, []):
      m = hlo_traffic._INSTR.match(line)
      if not m:
        continue
      name, shape, op, rest = m.groups()
      sizes[name] = hlo_traffic.shape_bytes(shape)
      if op in hlo_traffic._FREE:
        continue
      if op == "conditional":
        b = _BRANCHES.search(rest)
        names = (
          re.findall(r"[\w.\-]+", b.group(1))
          if b.group(1)
          else [b.group(3), b.group(2)]  # pred: false first, as branch 0
        )
        costs = [walk(c, None) for c in names]
        total += costs[branch] if branch is not None else min(costs)
        continue
      if op in ("while", "call"):
        called = re.findall(r"(?:body|to_apply)=%([\w.\-]+)", rest)
        total += sum(walk(c, None) for c in called)
        continue
      operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
      total += sizes[name] + sum(sizes.get(o, 0) for o in operands)
    return total

  return walk(entry, top_branch)


def hlo_and_cost(fn, params, state, grads):
  compiled = fn.lower(params, state, grads).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return compiled.as_text(), float(cost.get("bytes accessed", float("nan")))


# --------------------------------------------------------------------------
# Timing.


def with_counter(state, value):
  """``state`` with its microbatch counter set: a fresh scalar each call, as
  the counter's buffer is donated."""
  import jax.numpy as jnp

  return state._replace(mini_step=jnp.asarray(value, jnp.int32))


def time_pairs(rows, phases, repeats, inner, warmup):
  """Per phase, per round: ``inner`` calls of base then ours (or ours then
  base on odd rounds), blocking after each; returns {(recipe, phase): [s]}."""
  import jax

  samples = {(r, p): [] for r in rows for p in phases}
  for rnd in range(warmup + repeats):
    for phase, counter in phases.items():
      order = list(rows) if rnd % 2 == 0 else list(rows)[::-1]
      for recipe in order:
        fn, params, state, grads = rows[recipe]
        t0 = time.perf_counter()
        for _ in range(inner):
          params, state = fn(params, with_counter(state, counter), grads)
        jax.block_until_ready((params, state))
        dt = (time.perf_counter() - t0) / inner
        rows[recipe] = (fn, params, state, grads)
        if rnd >= warmup:
          samples[(recipe, phase)].append(dt)
  return samples


def quantile(values, q):
  v = sorted(values)
  return v[min(len(v) - 1, int(q * len(v)))]


def verdict(ratios, limit):
  med = statistics.median(ratios)
  lo, hi = quantile(ratios, 0.25), quantile(ratios, 0.75)
  ok = (
    "ok"
    if med <= limit + 5e-4
    else "MISS"
    if lo > limit + 5e-4
    else "within noise, above"
  )
  return med, f"{med:.3f}x [{lo:.3f}x, {hi:.3f}x] {ok} (<= {limit}x)"


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--shape", default="4M/100", help="PARAMS/LEAVES")
  p.add_argument("--k", type=int, default=4, help="microbatches per window")
  p.add_argument("--repeats", type=int, default=30)
  p.add_argument("--inner", type=int, default=5, help="calls per sample")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--tiny", action="store_true", help="4096/8, 3 repeats")
  p.add_argument("--json", help="write the results here")
  args = p.parse_args(argv)
  if args.tiny:
    args.shape, args.repeats, args.inner, args.warmup = "4096/8", 3, 2, 1
  n, num_leaves = parse_shape(args.shape)

  import jax

  params, grads = make_inputs(n, num_leaves)
  recipes = build(args.k)
  rows, hlo_bytes, xla_bytes = {}, {}, {}
  phases = {"others": 0, "last": args.k - 1}
  for name, (init, fn) in recipes.items():
    p0 = jax.tree.map(lambda x: x.copy(), params)
    # Distinct buffers: an init may return one array in two leaves, which
    # cannot be donated twice.
    state = jax.tree.map(lambda x: x.copy(), init(p0))
    hlo, xla_bytes[name] = hlo_and_cost(fn, p0, state, grads)
    for phase in phases:
      # Branch 1 of the accumulation cond is the window's end (true).
      top = None if name == "base" else int(phase == "last")
      hlo_bytes[(name, phase)] = taken_bytes(hlo, top)
    rows[name] = (fn, p0, state, grads)
  samples = time_pairs(rows, phases, args.repeats, args.inner, args.warmup)

  print(
    f"# accumulating step, {n:,} params in {num_leaves} leaves, K={args.k}; "
    f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
    f"{os.cpu_count()} CPUs; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  print(
    "| microbatch | base ms | ours ms | wall ours/base (median [IQR]) | "
    "base B/param | ours B/param | bytes ours/base |"
  )
  print("|---|---:|---:|---|---:|---:|---|")
  result = dict(shape=args.shape, k=args.k, xla_bytes=xla_bytes, phases={})
  for phase in phases:
    base, ours = samples[("base", phase)], samples[("ours", phase)]
    ratios = [o / b for o, b in zip(ours, base)]
    wall, wall_text = verdict(ratios, TARGET_WALL)
    bb, ob = hlo_bytes[("base", phase)], hlo_bytes[("ours", phase)]
    ok = "ok" if ob / bb <= TARGET_BYTES + 5e-4 else "MISS"
    print(
      f"| {phase} | {statistics.median(base) * 1e3:.3f} | "
      f"{statistics.median(ours) * 1e3:.3f} | {wall_text} | {bb / n:.2f} | "
      f"{ob / n:.2f} | {ob / bb:.3f}x {ok} (<= {TARGET_BYTES}x) |"
    )
    result["phases"][phase] = dict(
      base_s=base, ours_s=ours, wall_ratio=wall, base_bytes=bb, ours_bytes=ob
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
