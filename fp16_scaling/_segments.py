"""Per-unit reductions of many gradient leaves in a few kernels: the form
of the one pass that XLA:GPU fuses (docs/design.md, "The one pass on a
GPU").

A reduction per leaf is two kernels per leaf on XLA:GPU, about half of a
step's kernels. XLA:GPU fuses a concatenation into the reduction that reads
it, so that it is never written: the leaves, each unit (a leaf, or a layer
of a stacked leaf) flattened and padded with zeros into rows of one chunk
size, concatenated into one ``[rows, chunk]`` array per batch of leaves,
reduced along the rows, then the few partials of each unit summed: two
kernels per batch, whatever the leaves' sizes. Every partial lies within
one unit, so each unit's value is exact, in an order of its own. XLA:CPU
writes such a concatenation out (a pass over the gradients): the one pass
there stays a reduction per leaf (``_norm.leaf_sums``).
"""

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _sharding

# Leaves a concatenation takes: XLA:GPU fuses one of up to about 90
# operands into its reduction and writes out a larger one (jaxlib 0.10.2,
# H100 and A100 targets: 90 fused, 92 written).
BATCH = 64
# The most chunks a unit is cut into: a unit's partials are gathered into
# one row of this many, at most, before their sum.
MAX_CHUNKS = 256
# The chunk of a batch whose units are large: 4096 elements a row.
CHUNK = 4096


def _units(x, axis) -> jax.Array:
  """``x`` as ``[units, unit size]``: one row, or a row per layer."""
  if axis is None:
    return jnp.reshape(x, (1, -1))
  return jnp.reshape(jnp.moveaxis(x, axis, 0), (x.shape[axis], -1))


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def _chunk(size: int) -> int:
  """The chunk size of a batch whose largest unit holds ``size``."""
  return max(_pow2(-(-size // MAX_CHUNKS)), min(_pow2(size), CHUNK))


def batches(shapes, kinds, layer_axes) -> list:
  """Static: the leaves' indices in batches of at most ``BATCH``, each of
  one kind (a dtype, or with the mesh axes a leaf varies over under
  ``shard_map``: what one concatenation may hold), in order of unit size
  (so a batch's units are alike)."""

  def unit_size(i):
    units = 1 if layer_axes[i] is None else shapes[i][layer_axes[i]]
    return int(np.prod(shapes[i], dtype=np.int64)) // max(units, 1)

  order = sorted(
    range(len(shapes)), key=lambda i: (str(kinds[i]), unit_size(i), i)
  )
  out, current = [], []
  for i in order:
    if current and (len(current) == BATCH or kinds[current[0]] != kinds[i]):
      out.append(current)
      current = []
    current.append(i)
  return out + ([current] if current else [])


def _partials(units: list, fn, reduce) -> tuple:
  """``(partials, chunks)``: the ``reduce`` of ``fn`` over each chunk of
  ``units`` (arrays ``[u, size]`` of one dtype), from one concatenation,
  and how many chunks each unit has, in order."""
  chunk = _chunk(max(max(u.shape[1] for u in units), 1))
  rows = []
  chunks = []  # per unit
  for u in units:
    k = max(-(-u.shape[1] // chunk), 1)
    padded = jnp.pad(u, ((0, 0), (0, k * chunk - u.shape[1])))
    rows.append(jnp.reshape(padded, (u.shape[0] * k, chunk)))
    chunks += [k] * u.shape[0]
  return reduce(fn(jnp.concatenate(rows)), axis=1), chunks


def _per_unit(partials: jax.Array, chunks: list, reduce) -> jax.Array:
  """The ``reduce`` of each unit's consecutive ``chunks`` partials."""
  width = max(chunks)
  if min(chunks) < width:  # units of several sizes: gather each one's
    partials = jnp.concatenate([partials, jnp.zeros([1], partials.dtype)])
    starts = np.cumsum([0] + chunks[:-1])
    index = [
      list(range(a, a + k)) + [-1] * (width - k) for a, k in zip(starts, chunks)
    ]
    partials = partials[np.asarray(index, np.int32)]
  return reduce(jnp.reshape(partials, (-1, width)), axis=1)


def partitioned(x) -> bool:
  """Whether the compiler may split ``x`` over devices (jit over a mesh:
  an automatic mesh axis of more than one device, or an explicit axis its
  type names): a concatenation of such leaves would move them between
  devices, so each is reduced alone. Read from its type; a ``shard_map``
  block (manual axes) is this device's own."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.axis_names:
    return False
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  auto = [
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types)
    if t == jax.sharding.AxisType.Auto and sizes[n] > 1
  ]
  named = set(_sharding.spec_axes(sharding.spec)) - set(mesh.manual_axes)
  return bool(auto or named)


def per_platform(leaves: tuple, per_leaf: Callable, segmented: Callable):
  """``segmented(leaves)`` where the step is compiled for a GPU,
  ``per_leaf(leaves)`` elsewhere (``lax.platform_dependent``: chosen when
  the step is lowered, for the platform it is lowered for; only that form
  reaches the compiler)."""
  if not leaves:
    return per_leaf(leaves)
  return jax.lax.platform_dependent(
    leaves, default=per_leaf, cuda=segmented, rocm=segmented
  )


def unit_reduce(
  leaves: Sequence[jax.Array], layer_axes, fn: Callable, reduce: Callable
) -> tuple:
  """Per leaf, ``reduce`` (``jnp.sum`` or ``jnp.max``) of ``fn`` of its
  elements: a scalar, or per layer for a leaf with a layer axis.

  Args:
    leaves: the arrays.
    layer_axes: per leaf, its layer axis or None.
    fn: elementwise, to one dtype for all leaves; ``fn(0)`` must be
      ``reduce``'s identity (the rows are padded with zeros).
    reduce: ``jnp.sum`` or ``jnp.max``.

  Returns:
    A tuple, per leaf: a scalar, or a vector of its layers' values.
  """
  out = [None] * len(leaves)
  together = []
  for i, (x, a) in enumerate(zip(leaves, layer_axes)):
    if partitioned(x):
      out[i] = reduce(fn(x), tuple(d for d in range(np.ndim(x)) if d != a))
    else:
      together.append(i)
  for i, value in _segmented(leaves, layer_axes, together, fn, reduce):
    out[i] = value if layer_axes[i] is not None else jnp.reshape(value, ())
  return tuple(out)


def _segmented(leaves, layer_axes, together, fn, reduce) -> list:
  """``[(i, per-unit vector)]`` for the leaves ``together``, in batches."""
  units = {i: _units(leaves[i], layer_axes[i]) for i in together}
  kinds = {
    i: (
      jnp.result_type(leaves[i]),
      _sharding.varying_axes(jax.typeof(leaves[i])),
    )
    for i in together
  }
  order = batches(
    [np.shape(leaves[i]) for i in together],
    [kinds[i] for i in together],
    [layer_axes[i] for i in together],
  )
  by_kind = {}  # kind: (partials of its batches, chunks, leaves in order)
  for batch in ([together[j] for j in b] for b in order):
    p, k = _partials([units[i] for i in batch], fn, reduce)
    parts, chunks, held = by_kind.setdefault(kinds[batch[0]], ([], [], []))
    parts.append(p)
    chunks += k
    held += batch
  found = []
  for parts, chunks, held in by_kind.values():
    per_unit = _per_unit(jnp.concatenate(parts), chunks, reduce)
    starts = np.cumsum([0] + [units[i].shape[0] for i in held])
    found += [(i, per_unit[a:b]) for i, a, b in zip(held, starts, starts[1:])]
  return found
