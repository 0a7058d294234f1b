#!/usr/bin/env python
"""Accumulating K microbatches: in one step (``optax.microbatch`` around
``fs.value_and_grad``) against K steps (``fs.accumulate_gradients``), and
the whole batch in one step without accumulation.

A float16 MLP with float32 parameters, adamw behind the guarded chain.
Wall time per optimizer step (K calls for ``accumulate_gradients``), in
interleaved rounds, as ratios to the in-step form; memory from each compiled
executable's ``memory_analysis()`` (arguments: parameters, optimizer state,
the batch the call reads; temporaries: activations and the gradients'
sum). docs/accumulation.md has the table.

  python benchmarks/microbatch_cost.py            # 4096 rows, K=4
  python benchmarks/microbatch_cost.py --tiny     # seconds; smoke test
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402

FORMS = ("in-step", "accumulate_gradients", "whole batch")


def build(rows, width, k):
  """``{form: (jitted step, params, state, the batch one call reads)}``."""
  import jax
  import jax.numpy as jnp
  import optax

  import fp16_scaling as fs

  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = dict(
    w1=jax.random.normal(keys[0], (width, width)) / width**0.5,
    w2=jax.random.normal(keys[1], (width, width)) / width**0.5,
  )
  batch = (jax.random.normal(keys[2], (rows, width)),) * 2

  def loss(p, batch):
    x, y = (b.astype(jnp.float16) for b in batch)
    h = jax.nn.relu(x @ p["w1"].astype(jnp.float16))
    err = (h @ p["w2"].astype(jnp.float16) - y).astype(jnp.float32)
    return jnp.mean(err * err)

  def guarded():
    scale = fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=2.0**10))
    return fs.chain(scale, fs.clip_by_unscaled_norm(1.0), optax.adamw(1e-3))

  def stepping(tx, grad):
    def step(params, state, batch):
      value, grads = grad(state)(params, batch)
      updates, state = tx.update(grads, state, params, value=value)
      return optax.apply_updates(params, updates), state

    return jax.jit(step)

  mean = optax.microbatching.AccumulationType.MEAN
  in_step = lambda s: optax.microbatch(
    fs.value_and_grad(loss, s), 1, rows // k, accumulator=mean
  )
  plain = lambda s: fs.value_and_grad(loss, s)
  micro = jax.tree.map(lambda b: b[: rows // k], batch)
  txs = dict(zip(FORMS, (guarded(), fs.accumulate_gradients(guarded(), k))))
  txs["whole batch"] = guarded()
  grads = (in_step, plain, plain)
  batches = (batch, micro, batch)
  return {
    form: (stepping(txs[form], g), params, txs[form].init(params), b)
    for form, g, b in zip(FORMS, grads, batches)
  }


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--rows", type=int, default=4096, help="rows per step")
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--k", type=int, default=4, help="microbatches per step")
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--tiny", action="store_true", help="256 rows, width 64")
  p.add_argument("--json", help="write the results here")
  args = p.parse_args(argv)
  if args.tiny:
    args.rows, args.width, args.repeats = 256, 64, 3
  forms, units, memory = build(args.rows, args.width, args.k), [], {}
  for form, (fn, params, state, batch) in forms.items():
    mem = fn.lower(params, state, batch).compile().memory_analysis()
    memory[form] = (mem.argument_size_in_bytes, mem.temp_size_in_bytes)
    calls = args.k if form == "accumulate_gradients" else 1
    sample = common.stepper(fn, [params, state], batch, calls)
    units.append((form, lambda s=sample, c=calls: tuple(t * c for t in s())))
  wall = common.split(common.interleaved([units], args.repeats, 1))[0]
  print(
    f"# {args.rows} rows, width {args.width}, K={args.k}; {common.machine()}"
  )
  print("| form | ms/step | wall / in-step | argument MB | temp MB |")
  print("|---|---:|---|---:|---:|")
  for form in FORMS:
    ratio = common.spread(common.paired(wall[form], wall["in-step"]))
    arg, temp = (b / 2**20 for b in memory[form])
    print(
      f"| {form} | {statistics.median(wall[form]) * 1e3:.2f} | {ratio} | "
      f"{arg:.2f} | {temp:.2f} |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(vars(args), wall=wall, memory=memory), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
