#!/usr/bin/env python
"""Stacked layers: what stacking them saves the optimizer step
(``--compare layout``, the default) and what ``stacked_axes`` costs a
stacked step (``--compare stacked_axes``) and what applying stacked blocks
with ``nn.scan`` costs the forward and backward pass (``--compare scan``);
benchmarks/README.md has all three.

``layout``: ``--layers`` layers of a ``[D, D]`` weight and a ``[D]`` bias
(``--width D``), one leaf per layer (``unstacked``, 2 L leaves) against
stacked ``[L, ...]`` leaves (``stacked``, 2 leaves, as ``lax.scan``, Flax's
``nn.scan`` or ``nnx.vmap`` keep them), for ``floor`` (plain optax,
``chain(clip_by_global_norm(1.0), adamw)`` on float32 casts) and ``fp16``
(``recipes.py``'s guarded chain, no ``stacked_axes``) on float16 gradients:
fusions in XLA's entry computation, bytes accessed, the median step time
and the median [min, max] of the per-round ratio stacked / unstacked.

``stacked_axes``: train_lm's scanned transformer (``--scan``) at each of
``--sizes``, the guarded step with ``stacked_axes=fs.stacked_under(
"blocks")`` against the same step without; ``--kinds`` ``update`` (the
optimizer update alone on fixed float16 gradients) and ``train`` (forward,
backward, update): each side's median step time, their ratio and bytes.

``scan``: train_lm's transformer at each of ``--sizes``, its blocks
unrolled (one subtree per block) against stacked and applied by ``nn.scan``
(``--scan``), the same parameter values; ``grad`` (value_and_grad of the
scaled float16 loss) and ``train`` (that, then the guarded chain's update,
no ``stacked_axes``): fusions in the whole compiled module (a scan's body
counted once, though it runs once per block), bytes accessed, compile
seconds, the median step time, the per-round ratio scanned / unrolled
(median [min, max]) and the forward loss each ``grad`` step returned.

Every step is jitted with params and state donated, timed in interleaved
rounds (``_common.interleaved``), on XLA:CPU with the copy option
(docs/design.md, "In place") unless ``--default-flags``.

  python benchmarks/stacked_cost.py                       # 12 layers of 256
  python benchmarks/stacked_cost.py --layers 24 --width 512 --rounds 40
  python benchmarks/stacked_cost.py --compare stacked_axes  # small, medium
  python benchmarks/stacked_cost.py --compare stacked_axes --kinds update
  python benchmarks/stacked_cost.py --compare scan --sizes small --rounds 5
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402  (puts the checkout on sys.path)
import hlo_traffic  # noqa: E402
import recipes  # noqa: E402
from step_cost import options_line  # noqa: E402

COPY_OPTION = {"xla_cpu_copy_insertion_use_region_analysis": True}
DEFAULTS = {
  "layout": (30, 5),
  "stacked_axes": (7, 20),
  "scan": (5, 5),
}  # rounds, steps


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


def compiled(step, params, state, args, options):
  """``(executable, [params, state], fusions, bytes)`` of ``step(params,
  state, args)`` jitted with params and state donated; fresh buffers."""
  import jax

  fn = jax.jit(step, donate_argnums=(0, 1), compiler_options=options or None)
  box = [recipes.copy_tree(params), recipes.copy_tree(state)]
  exe = fn.lower(*box, args).compile()
  fusions = hlo_traffic.fused_ops(exe.as_text())[0]
  return exe, box, fusions, common.costs(exe)["bytes_accessed"]


def layout_table(args, options):
  """The ``layout`` comparison's table, as lines."""
  import jax

  data = layouts(args.layers, args.width)
  txs = {"floor": (recipes.clip_adamw(), recipes.to_f32)}
  txs["fp16"] = (recipes.fp16_tx(0), lambda g: g)
  rows, units = {}, []
  for key, (tx, prepare) in txs.items():
    unit = []
    for name, (params, grads) in data.items():
      init, step = recipes.stepping(tx, prepare)
      rows[key, name] = compiled(step, params, init(params), grads, options)
      exe, box = rows[key, name][:2]
      unit.append(((key, name), common.stepper(exe, box, grads, args.steps)))
    units.append(unit)
  wall, _ = common.split(common.interleaved(units, args.rounds, warmup=2))
  n = args.layers * (args.width**2 + args.width)
  lines = [
    f"{args.layers} layers of W [{args.width}, {args.width}] and b "
    f"[{args.width}]: {n:,} float32 params; rounds={args.rounds} "
    f"inner={args.steps}\n",
    "| step | layout | leaves | fusions | bytes accessed | B/param | "
    "step ms (median) | stacked / unstacked, per round |",
    "|---|---|---:|---:|---:|---:|---:|---|",
  ]
  for (key, name), (_, _, fusions, nbytes) in rows.items():
    leaves = len(jax.tree.leaves(data[name][0]))
    ratio = ""
    if name == "stacked":
      r = common.paired(wall[key, name], wall[key, "unstacked"])
      ratio = f"{statistics.median(r):.3f}x [{min(r):.3f}x, {max(r):.3f}x]"
    ms = f"{statistics.median(wall[key, name]) * 1e3:.3f}"
    bytes_ = f"{nbytes:,.0f}", f"{nbytes / n:.1f}"
    lines.append(
      hlo_traffic.row(key, name, leaves, f"{fusions:,}", *bytes_, ms, ratio)
    )
  return lines


def axes_rows(size, args, options):
  """The ``stacked_axes`` comparison's rows at one train_lm size."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import train_lm

  import fp16_scaling as fs

  cfg = train_lm.Config(**dict(train_lm.SIZES[size]), scan=True)
  params, grad_fn = train_lm.init_params(cfg), train_lm.make_grad_fn(cfg)
  rng = np.random.default_rng(0)
  x, y = train_lm.batches(np.arange(10_000, dtype=np.uint8) % 100, cfg, rng)
  to_half = lambda t: jax.tree.map(lambda p: p.astype(jnp.float16), t)
  grads = jax.jit(grad_fn)(to_half(params), x, y, 256.0)[1]

  def train(tx):
    def step(params, state, batch):
      scale = fs.current_scale(state)
      _, g, _ = grad_fn(to_half(params), *batch, scale)
      updates, state = tx.update(g, state, params)
      return optax.apply_updates(params, updates), state

    return step

  for kind in args.kinds.split(","):
    unit, nbytes = [], {}
    for name, axes in (("without", None), ("with", "blocks")):
      axes = axes and fs.stacked_under(axes)
      tx = recipes.fp16_tx(0, stacked_axes=axes)
      step = recipes.stepping(tx)[1] if kind == "update" else train(tx)
      data = grads if kind == "update" else (x, y)
      exe, box, _, nbytes[name] = compiled(
        step, params, tx.init(params), data, options
      )
      unit.append((name, common.stepper(exe, box, data, args.steps)))
    wall, _ = common.split(common.interleaved([unit], args.rounds, warmup=1))
    a, b = (statistics.median(wall[k]) for k in ("without", "with"))
    ms = f"{1e3 * a:.2f}", f"{1e3 * b:.2f}", f"{b / a:.3f}x"
    yield hlo_traffic.row(
      size, kind, *ms, *(f"{nbytes[k]:.4g}" for k in ("without", "with"))
    )


def unrolled(params):
  """train_lm's scanned params, ``blocks`` ``[L, ...]``, as the unrolled
  model's ``Block_0`` ... ``Block_{L-1}``: the same values."""
  import jax

  out = {k: v for k, v in params.items() if k != "blocks"}
  stack = params["blocks"]["Block_0"]
  for i in range(len(jax.tree.leaves(stack)[0])):
    out[f"Block_{i}"] = jax.tree.map(lambda a, i=i: a[i], stack)
  return out


def all_fusions(exe):
  """Fusion instructions in every computation of the compiled module."""
  comps, _ = hlo_traffic.computations(exe.as_text())
  return sum(
    bool(m and m.group(3) == "fusion")
    for lines in comps.values()
    for m in map(hlo_traffic._INSTR.match, lines)
  )


def scan_rows(size, args, options):
  """The ``scan`` comparison's rows at one train_lm size."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import train_lm

  import fp16_scaling as fs

  base = dict(train_lm.SIZES[size])
  scanned = train_lm.init_params(train_lm.Config(**base, scan=True))
  rng = np.random.default_rng(0)
  cfg = train_lm.Config(**base)
  batch = train_lm.batches(np.arange(10_000, dtype=np.uint8) % 100, cfg, rng)
  to_half = lambda t: jax.tree.map(lambda p: p.astype(jnp.float16), t)
  tx = recipes.fp16_tx(0)
  rows, units = {}, []
  for kind in args.kinds.split(","):
    unit = []
    for name, params in (("unrolled", unrolled(scanned)), ("scanned", scanned)):
      model = train_lm.make_model(
        train_lm.Config(**base, scan=name == "scanned")
      )

      def grad(params, scale, batch, model=model):
        f = lambda p: train_lm.loss_fn(model, p, *batch) * scale
        return jax.value_and_grad(f)(to_half(params))

      def step(params, state, batch, grad=grad, kind=kind):
        if kind == "grad":
          return params, grad(params, 1.0, batch)
        g = grad(params, fs.current_scale(state), batch)[1]
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

      state = tx.init(params) if kind == "train" else grad(params, 1.0, batch)
      t0 = time.perf_counter()
      exe, box, _, nbytes = compiled(step, params, state, batch, options)
      seconds = time.perf_counter() - t0
      rows[kind, name] = [all_fusions(exe), nbytes, seconds, box]
      unit.append(((kind, name), common.stepper(exe, box, batch, args.steps)))
    units.append(unit)
  wall, _ = common.split(common.interleaved(units, args.rounds, warmup=1))
  for (kind, name), (fusions, nbytes, seconds, box) in rows.items():
    r = common.paired(wall[kind, name], wall[kind, "unrolled"])
    ratio = f"{statistics.median(r):.3f}x [{min(r):.3f}x, {max(r):.3f}x]"
    loss = f"{float(box[1][0]):.7g}" if kind == "grad" else ""
    ms = f"{statistics.median(wall[kind, name]) * 1e3:.2f}"
    yield hlo_traffic.row(
      size,
      kind,
      name,
      f"{fusions:,}",
      f"{nbytes:.4g}",
      f"{seconds:.2f}",
      ms,
      ratio if name == "scanned" else "",
      loss,
    )


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add = p.add_argument
  add("--compare", choices=tuple(DEFAULTS), default="layout")
  add("--rounds", type=int, help="timed rounds (default 30; 7)")
  add("--inner", "--steps", dest="steps", type=int, help="steps per sample")
  add("--default-flags", action="store_true")
  add("--layers", type=int, default=12, help="layout")
  add("--width", type=int, default=256, help="layout")
  add("--sizes", default="small,medium", help="stacked_axes, scan")
  add("--kinds", help="update,train (stacked_axes); grad,train (scan)")
  args = p.parse_args(argv)
  rounds, steps = DEFAULTS[args.compare]
  args.rounds, args.steps = args.rounds or rounds, args.steps or steps
  scan = args.compare == "scan"
  args.kinds = args.kinds or ("grad,train" if scan else "update,train")
  import jax

  default = args.default_flags or jax.default_backend() != "cpu"
  options = {} if default else COPY_OPTION
  print(f"Machine: {common.machine()}")
  shown = " ".join(sys.argv[1:] if argv is None else argv)
  print(f"Command: python benchmarks/stacked_cost.py {shown}")
  print(options_line(options))
  if args.compare == "layout":
    print("\n".join(layout_table(args, options)))
    return 0
  if scan:
    print(
      "| size | pass | blocks | fusions | bytes accessed | compile s | "
      "step ms (median) | scanned / unrolled, per round (median [min, max]) "
      "| forward loss |\n|---|---|---|---:|---:|---:|---:|---|---:|"
    )
    for size in args.sizes.split(","):
      for line in scan_rows(size, args, options):
        print(line, flush=True)
    return 0
  print(
    "| size | step | without (ms) | with stacked_axes (ms) | ratio | "
    "bytes without | bytes with |\n|---|---|---:|---:|---:|---:|---:|"
  )
  for size in args.sizes.split(","):
    for line in axes_rows(size, args, options):
      print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
