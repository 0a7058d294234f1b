#!/usr/bin/env python
"""Weight gradients of a float16 data-parallel model summed across devices.

An MLP of ``nnx.Linear(dtype=float16, param_dtype=float32)``, the batch split
by rows over N devices, the parameters replicated, gradients of ``loss * S``
(the input columns and the hidden units' outgoing weights are scaled over
2^0..2^-20, so the first kernel's gradient spans 46 octaves; S = 2^18 puts
the largest gradient at 2^14, below float16's largest finite value as a
dynamic scale keeps it). Each form's gradients against the float64 sum of
the same float16 products (the operands its backward's dots read, from the
same step), per leaf: the fraction of nonzero reference elements that come
out 0, and the worst error in bits over float16's normal range, log2 max
|g - g64| / sum|terms| (the bound a float sum's error is measured against:
-11 is one float16 rounding). Forms:

  jit f16        jax.jit; XLA all-reduces the float16 partial sums
  shard_map f32  each device's gradients (float16 parts, converted), psum'ed
                 in float32, as docs/porting.md's DDP port
  jit pref f32   jax.jit, nnx.Linear(..., preferred_element_type=float32)
  one device     the jit f16 step on one device, unsharded

Also the all-reduce's dtype and bytes in each compiled step's HLO.

  python benchmarks/cross_device_sum.py            # 8 devices, 4096 rows
  python benchmarks/cross_device_sum.py --tiny     # 512 rows; the mesh test
"""

import argparse
import json
import os
import re
import sys

N = 8
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # N simulated CPU devices
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + f" --xla_force_host_platform_device_count={N}"
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hlo_traffic  # noqa: E402
import numpy as np  # noqa: E402

FORMS = ("jit f16", "shard_map f32", "jit pref f32", "one device")
WIDTHS = (64, 64, 32, 1)
SPAN, SCALE = 20, 2.0**18
NORMAL = 2.0**-14  # float16's smallest normal


def model(pref, seed=0):
  """``(graphdef, params)`` of the MLP; ``pref``: ``preferred_element_type``
  of its dots (None: float16 out, as the layer's dtype)."""
  from flax import nnx
  import jax.numpy as jnp

  rngs, layers = nnx.Rngs(seed), []
  for i, o in zip(WIDTHS, WIDTHS[1:]):
    kw = dict(preferred_element_type=pref) if pref else {}
    layers.append(nnx.Linear(i, o, dtype=jnp.float16, rngs=rngs, **kw))
  # Hidden unit j's outgoing weights scaled by 2^-(SPAN * j / width): its
  # cotangent, and so column j of the first kernel's gradient, spans SPAN
  # octaves as the input columns do.
  units = 2.0 ** -np.linspace(0, SPAN, WIDTHS[1])[:, None]
  layers[1].kernel[...] = layers[1].kernel[...] * units
  return nnx.split(nnx.List(layers))


def loss_fn(graphdef, rows, scale):
  """``sum((mlp(x) - y)^2) / rows * scale``, reduced in float32, with zero
  ``taps`` added to each layer's output (their gradients are the cotangents
  the backward feeds to the weight-gradient dots) and, as aux, each layer's
  float16 input."""
  from flax import nnx
  import jax
  import jax.numpy as jnp

  def loss(params, taps, x, y):
    layers, h, acts = nnx.merge(graphdef, params), x, []
    for i, layer in enumerate(layers):
      acts.append(h.astype(jnp.float16))
      h = layer(h) + taps[i]
      h = jax.nn.relu(h) if i < len(layers) - 1 else h
    err = h.astype(jnp.float32) - y
    return jnp.sum(err * err) / rows * scale, acts

  return jax.grad(loss, argnums=(0, 1), has_aux=True)


def reference(acts, deltas):
  """Per layer ``((dW, sum|terms|), (db, sum|terms|))``: float64 sums of the
  exact products (two float16 factors) of what the backward reads."""
  out = []
  for a, d in zip(acts, deltas):
    a, d = np.float64(a), np.float64(d)
    out.append(((a.T @ d, abs(a).T @ abs(d)), (d.sum(0), abs(d).sum(0))))
  return out


def all_reduces(compiled):
  """``[(dtypes, bytes)]`` of the all-reduces in a compiled step."""
  out = []
  for line in compiled.as_text().splitlines():
    m = hlo_traffic._INSTR.match(line)
    if m and m.group(3) in ("all-reduce", "all-reduce-start"):
      dtypes = sorted(set(re.findall(r"\b(f16|f32|bf16)\[", m.group(2))))
      out.append(("/".join(dtypes), hlo_traffic.shape_bytes(m.group(2))))
  return out


def steps(rows, scale):
  """``{form: (step, params, taps dtype, sharded?)}``: each step returns
  ``((grads, tap grads), layer inputs)``."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((N,), ("data",))
  graphdef, params = model(None)
  fixdef, fixparams = model(jnp.float32)
  grad = loss_fn(graphdef, rows, scale)
  rows_spec = P("data")
  specs = dict(in_specs=(P(), rows_spec, rows_spec, rows_spec))

  @jax.shard_map(
    mesh=mesh, check_vma=False, out_specs=((P(), rows_spec), rows_spec), **specs
  )
  def summed_f32(params, taps, x, y):
    (g, tap_grads), acts = grad(params, taps, x, y)
    g = jax.tree.map(lambda g: g.astype(jnp.float32), g)
    return (jax.lax.psum(g, "data"), tap_grads), acts

  f16, f32 = jnp.float16, jnp.float32
  fix = jax.jit(loss_fn(fixdef, rows, scale))
  return mesh, {
    "jit f16": (jax.jit(grad), params, f16, True),
    "shard_map f32": (jax.jit(summed_f32), params, f16, True),
    "jit pref f32": (fix, fixparams, f32, True),
    "one device": (jax.jit(grad), params, f16, False),
  }


def measure(rows):
  """``{form: {"leaves": {leaf: (zero fraction, worst bits)}, "all_reduce":
  [(dtype, bytes)]}}``."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  rng = np.random.default_rng(0)
  cols = 2.0 ** -np.linspace(0, SPAN, WIDTHS[0])  # float16 normals
  x = np.float32(rng.standard_normal((rows, WIDTHS[0])) * cols)
  y = np.float32(rng.standard_normal((rows, 1)))
  mesh, forms = steps(rows, SCALE)
  shard = lambda t, s: jax.device_put(t, NamedSharding(mesh, s))
  out = {}
  for form, (fn, p, dtype, sharded) in forms.items():
    p = jax.tree.map(np.asarray, p)
    taps = [np.zeros((rows, w), dtype) for w in WIDTHS[1:]]
    args = (p, taps, x, y)
    if sharded:
      args = (shard(p, P()), *(shard(a, P("data")) for a in args[1:]))
    (grads, deltas), acts = jax.device_get(fn(*args))
    ref, leaves = reference(acts, deltas), {}
    for i, (layer, r) in enumerate(zip(params_list(grads), ref)):
      for name, g, (g64, bound) in zip(("kernel", "bias"), layer, r):
        g, nz, normal = np.float64(g), g64 != 0, abs(g64) >= NORMAL
        worst = np.max(abs(g - g64)[normal] / bound[normal])
        zeros = float(np.mean(g[nz] == 0))
        leaves[f"{i}.{name}"] = (zeros, float(np.log2(max(worst, 2.0**-60))))
    reduces = all_reduces(fn.lower(*args).compile()) if sharded else []
    out[form] = dict(leaves=leaves, all_reduce=reduces)
  return out


def params_list(params):
  """``[(kernel, bias)]`` per layer of an nnx state of the MLP."""
  return [(params[i]["kernel"], params[i]["bias"]) for i in range(len(params))]


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--rows", type=int, default=4096, help="global batch")
  p.add_argument("--tiny", action="store_true", help="512 rows")
  p.add_argument("--json", help="write the results here")
  args = p.parse_args(argv)
  rows = 512 if args.tiny else args.rows
  result = measure(rows)
  print(
    f"# {N} devices, {rows} rows, MLP {WIDTHS}, inputs and units 2^0..2^-{SPAN}"
    f", S = 2^{np.log2(SCALE):g}"
  )
  print("| leaf | " + " | ".join(f"{f}: zeros, bits" for f in FORMS) + " |")
  print("|---" * (len(FORMS) + 1) + "|")
  for leaf in result[FORMS[0]]["leaves"]:
    cells = [result[f]["leaves"][leaf] for f in FORMS]
    print(
      f"| {leaf} | " + " | ".join(f"{z:.3f}, {b:.1f}" for z, b in cells) + " |"
    )
  for form in FORMS[:3]:
    ar = result[form]["all_reduce"]
    kinds = ", ".join(f"{d} {b:,} B" for d, b in ar)
    print(f"{form}: all-reduce {kinds}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(rows=rows, forms=result), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
