#!/usr/bin/env python
"""What XLA makes of each step for a GPU and a TPU, on a machine without
either: deviceless ahead-of-time compilation.

Compiles ``recipes.py``'s steps (float16 gradients, float32 parameters,
donated) for an H100 and an A100 (XLA's GPU target descriptions, kept in
``benchmarks/gpu_specs/``) and a TPU v5e, with ``JAX_PLATFORMS=cpu``, and
prints per recipe and shape: the kernels of the compiled step (fusions,
copies, lone reductions, custom calls: ``hlo_traffic.work``) on a clean
step, kernels per leaf from two leaf counts, the reduction kernels, the
copies (and how many are larger than a scalar), the bytes its
instructions access (``hlo_traffic.py``'s count) and
whether every output aliases a donated input. Needs ``jax-cuda12-plugin``
and ``jax-cuda12-pjrt`` for the GPUs and ``jax[tpu]`` for the TPU, pinned
next to the pinned jax (``.ci/setup-aot`` builds ``.venv-aot`` with them).

  .venv-aot/bin/python benchmarks/gpu_kernels.py            # the README table
  .venv-aot/bin/python benchmarks/gpu_kernels.py --targets h100 \\
      --recipes floor,fp16 --shapes 1000000x50,1000000x200
"""

import argparse
import importlib.util
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402  (also puts the checkout on sys.path)
import hlo_traffic  # noqa: E402
import recipes  # noqa: E402

SPECS = os.path.join(common.HERE, "gpu_specs")
# name: (platform, the spec file or the TPU topology, the label)
TARGETS = {
  "h100": ("cuda", "h100_sxm.txtpb", "H100 SXM"),
  "a100": ("cuda", "a100_sxm_80.txtpb", "A100 SXM 80GB"),
  "tpu": ("tpu", "v5e:2x2", "TPU v5e"),
}
_DIMS = re.compile(r"\[\d[\d,]*\]")  # an array shape's dimensions: [3,4]
RECIPE_KEYS = ("adamw", "floor", "fp16", "fp16_noclip", "apply_if_finite")
RECIPE_KEYS += ("jmp", "flat_floor", "flat_fp16")
# SIZExLEAVES: the 1000x1000 leaves at two counts, and many small leaves.
SHAPES = ("1000000x50", "1000000x200", "16x500")


def devices(target, count=1):
  """``count`` devices of ``target`` (TARGETS' key), described, not present:
  a GPU of a ``1x1xcount`` topology, or the first of a TPU v5e's chips."""
  from jax.experimental import topologies

  platform, where, _ = TARGETS[target]
  if platform == "tpu":
    topo = topologies.get_topology_desc(topology_name=where, platform="tpu")
  else:
    with open(os.path.join(SPECS, where)) as f:
      spec = f.read()
    topo = topologies.get_topology_desc(
      platform="cuda", target_config=spec, topology=f"1x1x{count}"
    )
  found = list(topo.devices)
  if len(found) < count:
    raise ValueError(f"{target} has {len(found)} devices, not {count}")
  return found[:count]


def placed(tree, mesh, spec=None):
  """``tree``'s shapes as ``ShapeDtypeStruct``s on ``mesh``, replicated
  (or split as ``spec``, one ``PartitionSpec`` for every leaf)."""
  import jax

  sharding = jax.sharding.NamedSharding(
    mesh, spec or jax.sharding.PartitionSpec()
  )
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
  )


def one_device_mesh(target):
  """A one-device ``Mesh`` (axis ``"x"``) on ``target``."""
  import jax
  import numpy as np

  return jax.sharding.Mesh(np.array(devices(target)), ("x",))


def counts(compiled, tpu=False):
  """The figures of one compiled step: ``kernels`` (on a clean step: the
  false branch of each conditional; on a TPU, its fusions: its scalar
  instructions run unfused on the scalar unit), ``all_kernels`` (every
  branch), ``fusions``, ``reductions``, ``copies`` (the entry
  computation's ``copy`` and ``copy-start`` instructions, less a TPU's
  moves into another memory space, its prefetches), ``array_copies``
  (those larger than a scalar), ``bytes`` (``hlo_traffic.total_bytes`` on
  a clean step: a deviceless executable has no ``cost_analysis``),
  ``outputs`` and ``aliased`` (outputs that alias a donated input)."""
  text = compiled.as_text()
  fusions, clean = hlo_traffic.kernels(text, branch=0)
  comps, entry = hlo_traffic.computations(text)
  found = [hlo_traffic._INSTR.match(line) for line in comps[entry]]
  copies = [
    m.group(2)
    for m in found
    if m and m.group(3) in ("copy", "copy-start") and "S(" not in m.group(2)
  ]
  header = text.splitlines()[0]
  outputs = _result_layout(header)
  aliased = set(re.findall(r"\{(\d+)\}: \(\d+, \{\}", header))
  return dict(
    kernels=fusions if tpu else clean,
    all_kernels=hlo_traffic.kernels(text)[1],
    fusions=fusions,
    reductions=hlo_traffic.reductions(text, branch=0),
    copies=len(copies),
    # A copy of arrays: one whose result holds a shape with dimensions.
    array_copies=sum(bool(_DIMS.search(shape)) for shape in copies),
    bytes=hlo_traffic.total_bytes(text, branch=0),
    outputs=len(hlo_traffic._ARRAY.findall(outputs)),
    aliased=len(aliased),
  )


def _result_layout(header):
  """The result part of an HLO module's ``entry_computation_layout``."""
  text = header.split("entry_computation_layout={", 1)[1].split("->", 1)[1]
  depth = 0
  for i, ch in enumerate(text):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0 and ch in ")}":
      return text[: i + 1]
  return text


def compile_recipe(key, target, size, leaves):
  """``counts`` of recipe ``key`` compiled for ``target``, ``leaves``
  leaves of ``size`` elements, and the compile's seconds."""
  import jax

  init, step = recipes.jitted(key, leaves)
  params, grads = recipes.abstract_inputs(size * leaves, leaves)
  state = jax.eval_shape(init, params)
  mesh = one_device_mesh(target)
  args = [placed(t, mesh) for t in (params, state, grads)]
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  seconds = time.perf_counter() - t0
  tpu = TARGETS[target][0] == "tpu"
  return counts(compiled, tpu) | dict(compile_s=seconds)


# The programs compiled on a mesh: the step and accumulate_gradients under
# jit, their leaves split over the mesh (GSPMD places the collectives), and
# the step under shard_map with partition_specs (its own psums).
MESH_PROGRAMS = ("step", "accumulate", "sharded")
MESH_SHAPE = (8, 1024, 1024)  # leaves (half of them experts), their shape


def _mesh_tx(partition_specs=None):
  """``fs.chain(fp16_loss_scale, clip_by_unscaled_norm with the expert
  mask, adamw)`` of :func:`_mesh_params`'s tree."""
  import optax

  import fp16_scaling as fs

  mask = {"expert": True, "shared": False}
  return fs.chain(
    fs.fp16_loss_scale(fs.torch_scaler(), partition_specs=partition_specs),
    fs.clip_by_unscaled_norm(1.0, expert_mask=mask),
    optax.adamw(1e-3),
  )


def _mesh_params():
  """Half the leaves shared, half experts: float32 ``ShapeDtypeStruct``s."""
  import jax
  import jax.numpy as jnp

  n, *shape = MESH_SHAPE
  leaf = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
  return {"expert": [leaf] * (n // 2), "shared": [leaf] * (n - n // 2)}


def mesh_program(name, target, count):
  """``name`` (of ``MESH_PROGRAMS``) compiled for ``count`` devices of
  ``target``, params and state donated: the executable."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax

  import fp16_scaling as fs

  mesh = jax.sharding.Mesh(np.array(devices(target, count)), ("x",))
  params = _mesh_params()
  grads = jax.tree.map(lambda p: p.update(dtype=jnp.float16), params)
  specs = {
    "expert": [P("x")] * len(params["expert"]),
    "shared": [P()] * len(params["shared"]),
  }
  tx = _mesh_tx(specs if name == "sharded" else None)
  if name == "accumulate":
    tx = fs.accumulate_gradients(tx, 4)
  state = jax.eval_shape(tx.init, params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  if name != "sharded":  # every leaf split over the mesh, GSPMD's collectives
    big = lambda x: P("x") if np.ndim(x) == len(MESH_SHAPE) - 1 else P()
    place = lambda t: jax.tree.map(lambda x: placed(x, mesh, big(x)), t)
    args = [place(t) for t in (params, state, grads)]
    return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  st_specs = optax.tree_map_params(
    tx, lambda _, spec: spec, state, specs,
    transform_non_params=lambda _: P(), is_leaf=lambda s: isinstance(s, P),
  )  # fmt: skip
  at = lambda t, sp: jax.tree.map(lambda x, s: placed(x, mesh, s), t, sp)
  args = [at(params, specs), at(state, st_specs), at(grads, specs)]
  in_specs = (specs, st_specs, specs)
  mapped = jax.shard_map(
    step, mesh=mesh, in_specs=in_specs, out_specs=in_specs[:2]
  )
  return jax.jit(mapped, donate_argnums=(0, 1)).lower(*args).compile()


def collectives(compiled):
  """``{opcode: count}`` of the collectives in a compiled module (every
  computation: a collective may sit in a branch)."""
  text = compiled.as_text()
  found = {}
  for line in text.splitlines():
    m = hlo_traffic._INSTR.match(line)
    if m and m.group(3).split("-start")[0] in _COLLECTIVES:
      op = m.group(3).split("-start")[0]
      found[op] = found.get(op, 0) + 1
  return found


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_COLLECTIVES += ("collective-permute",)


def mesh_table(rows):
  """The markdown table of :func:`mesh_program`'s figures."""
  lines = [
    "| target | program | kernels | copies (arrays) | outputs aliased | "
    "collectives |",
    "|---|---|---:|---:|---:|---|",
  ]
  for (target, count, name), row in rows.items():
    ops = ", ".join(f"{n} {op}" for op, n in sorted(row["collectives"].items()))
    lines.append(
      f"| {TARGETS[target][2]} x{count} | {name} | {row['kernels']} | "
      f"{row['copies']} ({row['array_copies']}) | "
      f"{row['aliased']}/{row['outputs']} | {ops or 'none'} |"
    )
  return "\n".join(lines)


def slope(rows, key, shapes):
  """Kernels per leaf of recipe ``key`` between its two shapes of one leaf
  size (the difference over the difference in leaves), or None."""
  by_size = {}
  for size, leaves in shapes:
    row = rows.get((key, size, leaves))
    if row is not None:
      by_size.setdefault(size, []).append((leaves, row["kernels"]))
  for pairs in by_size.values():
    if len(pairs) >= 2:
      (l1, k1), (l2, k2) = sorted(pairs)[:2]
      return (k2 - k1) / (l2 - l1)
  return None


def table(target, keys, shapes, rows):
  """The markdown table of one target."""
  label = TARGETS[target][2]
  head = ["recipe"] + [f"kernels, {s:,}x{n}" for s, n in shapes]
  head += ["kernels per leaf", "reduction kernels", "copies (arrays)"]
  head += [f"bytes, {s:,}x{n}" for s, n in shapes[-1:]]
  lines = [f"{label}:", "", "| " + " | ".join(head) + " |"]
  lines.append("|---|" + "---:|" * (len(head) - 1))
  for key in keys:
    cells = [recipes.BY_KEY[key].label]
    found = [rows.get((key, s, n)) for s, n in shapes]
    cells += [f"{r['kernels']:,}" if r else "–" for r in found]
    per_leaf = slope(rows, key, shapes)
    cells.append("–" if per_leaf is None else f"{per_leaf:.2f}")
    cells.append(" / ".join(str(r["reductions"]) if r else "–" for r in found))
    cells.append(
      " / ".join(
        f"{r['copies']} ({r['array_copies']})" if r else "–" for r in found
      )
    )
    last = found[-1]
    cells.append(f"{last['bytes']:,.0f}" if last and last["bytes"] else "–")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add = parser.add_argument
  add("--targets", default=",".join(TARGETS), help=f"of {list(TARGETS)}")
  add("--recipes", default=",".join(RECIPE_KEYS), help="recipes.py's keys")
  add("--shapes", default=",".join(SHAPES), help="SIZExLEAVES, comma-separated")
  add(
    "--meshes",
    default="h100:8,tpu:4",
    help="TARGET:DEVICES, comma-"
    "separated: MESH_PROGRAMS compiled on that many devices ('' for none)",
  )
  args = parser.parse_args(argv)
  import jax

  targets = [t.strip() for t in args.targets.split(",")]
  keys = [k.strip() for k in args.recipes.split(",")]
  shapes = [
    tuple(map(int, s.lower().split("x"))) for s in args.shapes.split(",")
  ]
  for name in targets + keys:
    if name not in TARGETS and name not in recipes.BY_KEY:
      parser.error(f"unknown target or recipe {name!r}")
  print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, compiled on "
        f"{jax.default_backend()} for: {', '.join(targets)}")  # fmt: skip
  for target in targets:
    rows = {}
    for key in keys:
      module = recipes.BY_KEY[key].module
      if module and importlib.util.find_spec(module) is None:
        continue  # not installed
      for size, leaves in shapes:
        row = compile_recipe(key, target, size, leaves)
        rows[(key, size, leaves)] = row
        print(
          f"# {target} {key} {size}x{leaves}: {row['kernels']} kernels "
          f"({row['all_kernels']} all branches), {row['reductions']} "
          f"reductions, {row['copies']} copies ({row['array_copies']} "
          f"arrays), {row['aliased']}/{row['outputs']} outputs aliased, "
          f"{row['compile_s']:.1f} s",
          file=sys.stderr,
          flush=True,
        )
    print("\n" + table(target, keys, shapes, rows), flush=True)
  meshes = [m.split(":") for m in args.meshes.split(",") if m]
  rows = {}
  for target, count in meshes:
    for name in MESH_PROGRAMS:
      compiled = mesh_program(name, target, int(count))
      tpu = TARGETS[target][0] == "tpu"
      row = counts(compiled, tpu) | dict(collectives=collectives(compiled))
      rows[(target, int(count), name)] = row
  if rows:
    print("\n" + mesh_table(rows), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
