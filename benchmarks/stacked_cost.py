#!/usr/bin/env python
"""Stacked layers against one leaf per layer: the optimizer step's cost.

A model of ``--layers`` identical layers, each a ``[D, D]`` weight and a
``[D]`` bias (``--width D``), laid out two ways:

  unstacked  ``{"layers": [{"W": [D, D], "b": [D]}, ...]}``, 2 L leaves;
  stacked    ``{"layers": {"W": [L, D, D], "b": [L, D]}}``, 2 leaves, as
             ``lax.scan``, Flax's ``nn.scan`` or ``nnx.vmap`` keep them.

and two steps, each jitted with params and state donated, on float16
gradients: ``floor``, plain optax (``chain(clip_by_global_norm(1.0),
adamw)`` on the gradients cast to float32), and ``fp16``, the guarded chain
of ``recipes.py`` (``skip_on_overflow(chain(fp16_loss_scale,
clip_by_unscaled_norm(1.0), adamw))``). No ``stacked_axes`` option: the
stacked leaves are plain leaves to the chain.

Printed for each step and layout: the fusions in XLA's compiled module
(entry computation), XLA's ``bytes accessed``, and the median step wall
time over interleaved rounds (the four rows in an order that rotates each
round), with the median [min, max] of the per-round ratio stacked /
unstacked. On XLA:CPU the steps are compiled with
``xla_cpu_copy_insertion_use_region_analysis=true`` (docs/design.md, "In
place") unless ``--default-flags`` is given.

  python benchmarks/stacked_cost.py                       # 12 layers of 256
  python benchmarks/stacked_cost.py --layers 24 --width 512 --rounds 40
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(HERE), HERE):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import recipes  # noqa: E402
import step_cost  # noqa: E402

COPY_OPTION = {"xla_cpu_copy_insertion_use_region_analysis": True}


def layouts(layers, width, seed=0):
  """``{layout: (params, grads)}``: float32 params, float16 gradients, the
  same values in both layouts."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  w = 0.02 * rng.standard_normal((layers, width, width), np.float32)
  b = np.zeros((layers, width), np.float32)
  gw = rng.standard_normal(w.shape, np.float32).astype(np.float16)
  gb = rng.standard_normal(b.shape, np.float32).astype(np.float16)

  def per_layer(x, y):
    return {"layers": [{"W": x[i], "b": y[i]} for i in range(layers)]}

  def stacked(x, y):
    return {"layers": {"W": x, "b": y}}

  out = {}
  for name, make in (("unstacked", per_layer), ("stacked", stacked)):
    tree = make(w, b), make(gw, gb)
    out[name] = tuple(jax.tree.map(jnp.asarray, t) for t in tree)
  return out


def steps():
  """``{key: (tx, prepare)}``: the floor and the guarded chain."""
  import jax
  import jax.numpy as jnp
  import optax

  floor = optax.chain(
    optax.clip_by_global_norm(recipes.MAX_NORM),
    optax.adamw(recipes.LR, weight_decay=recipes.WEIGHT_DECAY),
  )
  to_f32 = lambda g: jax.tree.map(lambda x: x.astype(jnp.float32), g)
  return {"floor": (floor, to_f32), "fp16": (recipes._fp16_tx(0), None)}


def compiled_row(tx, prepare, params, grads, options):
  """``[fn, params, state, grads, fusions, bytes]`` of one step."""
  import jax
  import optax

  def step(p, s, g):
    updates, s = tx.update(prepare(g) if prepare else g, s, p)
    return optax.apply_updates(p, updates), s

  fn = jax.jit(step, donate_argnums=(0, 1), compiler_options=options or None)
  params = recipes.copy_tree(params)
  state = recipes.copy_tree(tx.init(params))
  compiled = fn.lower(params, state, grads).compile()
  comps, entry = step_cost.computations(compiled.as_text())
  fusions = sum(" fusion(" in line for line in comps[entry])
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return [fn, params, state, grads, fusions, cost["bytes accessed"]]


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--rounds", type=int, default=30)
  p.add_argument("--inner", type=int, default=5, help="steps per sample")
  p.add_argument("--default-flags", action="store_true")
  args = p.parse_args(argv)
  import jax

  options = {} if args.default_flags else COPY_OPTION
  if jax.default_backend() != "cpu":
    options = {}
  data = layouts(args.layers, args.width)
  rows = {}
  for key, (tx, prepare) in steps().items():
    for name, (params, grads) in data.items():
      rows[key, name] = compiled_row(tx, prepare, params, grads, options)
  times = {k: [] for k in rows}
  order = list(rows)
  for rnd in range(args.rounds + 2):
    shift = rnd % len(order)
    for k in order[shift:] + order[:shift]:
      row = rows[k]
      fn, params, state, grads = row[:4]
      t0 = time.perf_counter()
      for _ in range(args.inner):
        params, state = fn(params, state, grads)
      jax.block_until_ready((params, state))
      row[1], row[2] = params, state
      if rnd >= 2:
        times[k].append((time.perf_counter() - t0) / args.inner)
  n = args.layers * (args.width**2 + args.width)
  print(f"Machine: {step_cost.machine()}")
  shown = " ".join(sys.argv[1:] if argv is None else argv)
  print(f"Command: python benchmarks/stacked_cost.py {shown}")
  print(step_cost.options_line(options))
  print(
    f"{args.layers} layers of W [{args.width}, {args.width}] and b "
    f"[{args.width}]: {n:,} float32 params; rounds={args.rounds} "
    f"inner={args.inner}\n"
  )
  print(
    "| step | layout | leaves | fusions | bytes accessed | B/param | "
    "step ms (median) | stacked / unstacked, per round |"
  )
  print("|---|---|---:|---:|---:|---:|---:|---|")
  for (key, name), row in rows.items():
    leaves = len(jax.tree.leaves(data[name][0]))
    ratio = ""
    if name == "stacked":
      r = step_cost._paired(times[key, name], times[key, "unstacked"])
      ratio = f"{statistics.median(r):.3f}x [{min(r):.3f}x, {max(r):.3f}x]"
    print(
      f"| {key} | {name} | {leaves} | {row[4]:,} | {row[5]:,.0f} | "
      f"{row[5] / n:.1f} | {statistics.median(times[key, name]) * 1e3:.3f} "
      f"| {ratio} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
