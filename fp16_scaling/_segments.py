"""Per-unit reductions of many gradient leaves in a few kernels: the form
of the one pass that XLA:GPU fuses (docs/backends.md, "The one pass on a
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
from fp16_scaling._stacked import summed_axes

# Leaves a concatenation takes. XLA:GPU fuses at most 96 operands and
# outputs into a kernel (MaxOperandsAndOutputsPerFusion): a batch of up to
# 92 leaves is fused into its reduction, one of 93 written out whole
# (jaxlib 0.10.2, H100 target, tests/aot/test_fusion_budget.py); 64 keeps
# a margin below that edge.
BATCH = 64
# The most chunks a unit is cut into: a unit's partials are gathered into
# one row of this many, at most, before their sum.
MAX_CHUNKS = 256
# The chunk of a batch whose units are large: 4096 elements a row.
CHUNK = 4096


def _units(x, axis):
  """``x`` as ``[units, unit size]``: one row, or a row per layer."""
  if axis is None:
    return jnp.reshape(x, (1, -1))
  layers = x.shape[axis]
  first = jnp.moveaxis(x, axis, 0)
  return jnp.reshape(first, (layers, -1))


def _pow2(n):
  """The least power of two at least ``n`` (1 for ``n <= 1``)."""
  below = max(int(n) - 1, 0)
  return 1 << below.bit_length()


def _ceil(n, d):
  """``n / d`` rounded up."""
  return -(-n // d)


def _chunk(size):
  """The chunk size of a batch whose largest unit holds ``size``: at most
  ``MAX_CHUNKS`` chunks a unit, ``CHUNK`` elements where that is enough,
  and no more than the unit's own size rounded up."""
  fewest = _pow2(_ceil(size, MAX_CHUNKS))
  enough = min(_pow2(size), CHUNK)
  return max(fewest, enough)


def batches(kinds: dict, sizes: dict) -> list:
  """Static: the leaves (the keys of ``kinds`` and ``sizes``, their kind
  and unit size) in batches of at most ``BATCH``, each of one kind (a
  dtype, and the mesh axes a leaf varies over under ``shard_map``: what one
  concatenation may hold), in order of unit size (a batch's units alike)."""
  keys = [(str(kinds[i]), sizes[i], i) for i in kinds]
  out = []
  current = []
  for _, _, i in sorted(keys):
    full = len(current) == BATCH
    if current and (full or kinds[current[0]] != kinds[i]):
      out.append(current)
      current = []
    current.append(i)
  if current:
    out.append(current)
  return out


def _partials(units, fn, reduce):
  """``(partials, chunks)``: the ``reduce`` of ``fn`` over each chunk of
  ``units`` (arrays ``[u, size]`` of one dtype), from one concatenation,
  and how many chunks each unit has, in order."""
  largest = max(u.shape[1] for u in units)
  chunk = _chunk(max(largest, 1))
  rows = []
  chunks = []  # per unit
  for u in units:
    layers, size = u.shape
    k = max(_ceil(size, chunk), 1)
    padding = ((0, 0), (0, k * chunk - size))
    padded = jnp.pad(u, padding)
    shape = (layers * k, chunk)
    rows.append(jnp.reshape(padded, shape))
    chunks += [k] * layers
  values = fn(jnp.concatenate(rows))
  return reduce(values, axis=1), chunks


def _per_unit(partials, chunks, reduce):
  """The ``reduce`` of each unit's consecutive ``chunks`` partials: units
  of several sizes gather theirs into rows padded with a zero."""
  width = max(chunks)
  if min(chunks) < width:
    zero = jnp.zeros([1], partials.dtype)
    partials = jnp.concatenate([partials, zero])
    shape = (len(chunks), width)
    index = np.full(shape, -1, np.int32)
    start = 0
    for row, k in enumerate(chunks):
      index[row, :k] = np.arange(start, start + k)
      start += k
    partials = partials[index]
  rows = jnp.reshape(partials, (-1, width))
  return reduce(rows, axis=1)


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
  auto = jax.sharding.AxisType.Auto
  for kind, size in zip(mesh.axis_types, mesh.axis_sizes):
    if kind == auto and size > 1:
      return True
  named = _sharding.spec_axes(sharding.spec)
  explicit = set(named) - set(mesh.manual_axes)
  return bool(explicit)


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
      axes = summed_axes(x, a)
      out[i] = reduce(fn(x), axes)
    else:
      together.append(i)
  for i, value in _segmented(leaves, layer_axes, together, fn, reduce):
    if layer_axes[i] is None:
      value = jnp.reshape(value, ())
    out[i] = value
  return tuple(out)


def _kind(x):
  """What leaves one concatenation may hold share: the dtype, and the mesh
  axes the leaf varies over under ``shard_map``."""
  varying = _sharding.varying_axes(jax.typeof(x))
  dtype = jnp.result_type(x)
  return dtype, varying


def _segmented(leaves, layer_axes, together, fn, reduce):
  """``[(i, per-unit vector)]`` for the leaves ``together``, in batches;
  each kind's partials reduced to its units' values at once."""
  units = {}  # per leaf, [units, unit size]
  kinds = {}
  sizes = {}
  for i in together:
    units[i] = _units(leaves[i], layer_axes[i])
    kinds[i] = _kind(leaves[i])
    sizes[i] = units[i].shape[1]
  by_kind = {}  # kind: (partials of its batches, chunks, leaves in order)
  for batch in batches(kinds, sizes):
    p, k = _partials([units[i] for i in batch], fn, reduce)
    kind = kinds[batch[0]]
    parts, chunks, order = by_kind.setdefault(kind, ([], [], []))
    parts.append(p)
    chunks += k
    order += batch
  out = []
  for parts, chunks, order in by_kind.values():
    partials = jnp.concatenate(parts)
    per_unit = _per_unit(partials, chunks, reduce)
    start = 0
    for i in order:
      stop = start + units[i].shape[0]
      out.append((i, per_unit[start:stop]))
      start = stop
  return out
