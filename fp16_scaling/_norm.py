"""The one global-norm routine: overflow and norm from a single pass.

``leaf_sums(leaves)`` reads every gradient element once and sums
``x * x`` where ``x`` is finite and NaN where it is not. So the total is

* NaN exactly when some element is inf or NaN: an *overflow*;
* +inf when every element is finite but a square or the sum overflowed
  float32: not an overflow, only too large to square. That rare case is
  recomputed with the squares taken relative to each group's largest
  magnitude, inside a ``lax.cond`` that a common step never enters;
* otherwise the squared norm.

A sum of non-negative finite numbers is never NaN, so the overflow test is
exact. Under ``shard_map``, each leaf's partial sum is summed with ``psum``
across exactly the mesh axes its ``PartitionSpec`` splits it over, so a leaf
replicated across an axis counts once and a sharded one counts every shard.
The psummed totals are the same on every device, so every device takes the
same overflow decision and the same branch of the ``lax.cond`` (whose rescue
branch holds collectives). Under plain ``jit`` the arrays are global and the
specs call for no collective.
"""

import contextlib
import contextvars
from typing import NamedTuple, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp

AxisNames = tuple  # tuple[str, ...], sorted; () for an unsharded leaf


class Norms(NamedTuple):
  """Norms of a gradient tree, as computed from its per-leaf sums.

  Attributes:
    norm: float32 global 2-norm; NaN when ``overflow``.
    group_norms: float32 vector, the 2-norm of each group of leaves.
    overflow: bool, whether any element was inf or NaN.
  """

  norm: jax.Array
  group_norms: jax.Array
  overflow: jax.Array


_FLOAT16_RANGE: contextvars.ContextVar = contextvars.ContextVar(
  "fp16_scaling_float16_range", default=False
)


@contextlib.contextmanager
def float16_range():
  """Trace-time promise, while open: every leaf given to :func:`reduce_norms`
  holds values within float16's range (a float32 mean of float16 gradients,
  as ``accumulate_gradients`` makes), so no finite square can overflow a
  float32 sum and the rescue is not traced."""
  token = _FLOAT16_RANGE.set(True)
  try:
    yield
  finally:
    _FLOAT16_RANGE.reset(token)


def check_float_leaves(leaves: Sequence[jax.Array], what: str) -> None:
  """Raises TypeError for a non-floating leaf (integer or bool gradients)."""
  for i, x in enumerate(leaves):
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"{what} must be floating point (float16, bfloat16, float32 or "
        f"float64); leaf {i} has dtype {dtype}"
      )


def _squares(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return lax.select(lax.is_finite(x), x * x, lax.full_like(x, jnp.nan))


@jax.custom_jvp
def _sqrt(x: jax.Array) -> jax.Array:
  """``jnp.sqrt`` whose derivative is 0 where it is not finite.

  On an overflow step the sum of squares is NaN and the norm's value is
  discarded; the plain derivative 0.5 / sqrt(NaN) would still turn the zero
  cotangent of that discarded value into NaN gradients.
  """
  return jnp.sqrt(x)


@_sqrt.defjvp
def _sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = jnp.sqrt(x)
  ok = jnp.isfinite(y) & (y > 0)
  return y, dx * jnp.where(ok, 0.5 / jnp.where(ok, y, 1), 0)


def leaf_sums(leaves: Sequence[jax.Array]) -> list:
  """Per-leaf local sums of squares, NaN for a leaf with a non-finite element.

  This is the one pass over the gradients; everything else works on scalars.
  Its derivative treats a non-finite element as 0 (see :func:`discard_if`).
  """
  return list(_leaf_sums(tuple(leaves)))


@jax.custom_jvp
def _leaf_sums(leaves):
  return tuple(jnp.sum(_squares(x), dtype=jnp.float32) for x in leaves)


@_leaf_sums.defjvp
def _leaf_sums_jvp(primals, tangents):
  (leaves,), (dleaves,) = primals, tangents
  out = []
  for x, dx in zip(leaves, dleaves):
    wide = jnp.promote_types(x.dtype, jnp.float32)
    x, dx = x.astype(wide), dx.astype(wide)
    safe = lax.select(lax.is_finite(x), x, lax.full_like(x, 0))
    out.append(jnp.sum(2 * safe * dx, dtype=jnp.float32))
  return _leaf_sums(leaves), tuple(out)


def discard_if(overflow: jax.Array, leaves: Sequence[jax.Array]) -> tuple:
  """``leaves``, or zeros when ``overflow`` (a step whose result is discarded).

  On an overflow step the gradients hold an inf, and everything computed
  from them is discarded by ``skip_on_overflow``. A derivative taken through
  the step (with respect to the parameters, or to a learning rate the update
  closes over) still multiplies the discarded values' zero cotangents by
  those infs: 0 * inf = NaN. Selected *before* the multiply, the optimizer
  sees zeros instead, and gradients through an overflow step are finite:
  zero through the discarded update. Elementwise, with the scalar flag: XLA
  fuses it into the optimizer's own pass.
  """
  # select_n takes the scalar flag as is; full_like keeps x's sharding.
  return tuple(lax.select_n(overflow, x, lax.full_like(x, 0)) for x in leaves)


def spec_axes(spec) -> AxisNames:
  """Mesh axes a ``PartitionSpec`` splits an array over."""
  if spec is None:
    return ()
  names = []
  for entry in spec:
    if entry is None:
      continue
    names.extend(entry if isinstance(entry, tuple) else (entry,))
  return tuple(sorted(set(names)))


def _grouped(values, leaf_groups, leaf_axes, num_groups, combine, collective):
  """Combines per-leaf scalars into one value per group, across the mesh."""
  buckets = {}
  for v, g, axes in zip(values, leaf_groups, leaf_axes):
    buckets.setdefault((g, axes), []).append(v)
  per_group = [[] for _ in range(num_groups)]
  for (g, axes), vs in buckets.items():
    v = combine(jnp.stack(vs)) if len(vs) > 1 else vs[0]
    per_group[g].append(collective(v, axes) if axes else v)
  return jnp.stack(
    [combine(jnp.stack(vs)) if vs else jnp.float32(0) for vs in per_group]
  )


def reduce_norms(
  sums: Sequence[jax.Array],
  leaves: Sequence[jax.Array],
  *,
  leaf_groups: Optional[Sequence[int]] = None,
  num_groups: int = 1,
  leaf_axes: Optional[Sequence[AxisNames]] = None,
) -> Norms:
  """Global and per-group norms from :func:`leaf_sums`.

  Args:
    sums: per-leaf local sums of squares, from :func:`leaf_sums`.
    leaves: the leaves they were computed from (read again only in the rare
      case where a finite square overflowed float32).
    leaf_groups: static group index of each leaf (default: all in group 0).
    num_groups: number of groups.
    leaf_axes: static mesh axes to ``psum`` each leaf's sum over, from
      :func:`leaf_axes_from_specs` (default: none).

  Returns:
    :class:`Norms`.
  """
  n = len(leaves)
  leaf_groups = tuple(leaf_groups) if leaf_groups is not None else (0,) * n
  leaf_axes = tuple(leaf_axes) if leaf_axes is not None else ((),) * n
  if n == 0:
    zero = jnp.float32(0)
    return Norms(zero, jnp.zeros([num_groups], jnp.float32), jnp.bool_(False))

  def group_sums(values):
    return _grouped(
      values,
      leaf_groups,
      leaf_axes,
      num_groups,
      jnp.sum,
      lambda v, axes: lax.psum(v, axes),
    )

  common = group_sums(sums)
  total = jnp.sum(common)

  needs_rescue = not _FLOAT16_RANGE.get() and any(
    jnp.result_type(x) != jnp.float16 for x in leaves
  )
  if needs_rescue:
    # float16 squares cannot overflow a float32 sum (65504**2 * 2**63 < max),
    # so the rescue is only traced when some leaf is wider than float16 (and
    # may hold values beyond its range).
    def rescue(_):
      # Each group relative to its own largest magnitude: relative to the
      # global one, a small group's squares would underflow float32.
      maxima = [
        jnp.max(jnp.abs(x), initial=0).astype(jnp.float32) for x in leaves
      ]
      peaks = _grouped(
        maxima,
        leaf_groups,
        leaf_axes,
        num_groups,
        jnp.max,
        lambda v, axes: lax.pmax(v, axes),
      )
      peaks = jnp.where(peaks > 0, peaks, jnp.float32(1))
      rel = group_sums(
        [
          jnp.sum(jnp.square(x.astype(jnp.float32) / peaks[g]))
          for x, g in zip(leaves, leaf_groups)
        ]
      )
      top = jnp.max(peaks)
      return (
        top * jnp.sqrt(jnp.sum(jnp.square(peaks / top) * rel)),
        peaks * jnp.sqrt(rel),
      )

    def keep(_):
      return _sqrt(total), _sqrt(common)

    norm, group_norms = lax.cond(jnp.isinf(total), rescue, keep, None)
  else:
    norm, group_norms = _sqrt(total), _sqrt(common)
  # NaN exactly when ``total`` is (the rescue runs only on +inf). Read off the
  # norm, behind a sqrt that XLA will not duplicate: a cheap function of every
  # leaf's sum is otherwise fused, with all L sums as operands, into each of
  # the L per-leaf selects of skip_on_overflow: O(L**2) HLO and compile time
  # (27x optax's at 200 leaves).
  return Norms(norm=norm, group_norms=group_norms, overflow=jnp.isnan(norm))


def _is_spec(s) -> bool:
  return s is None or isinstance(s, jax.sharding.PartitionSpec)


def _varying_axes(x) -> frozenset:
  """Manual mesh axes over which ``x`` may differ (or hold unreduced partial
  sums), as ``shard_map``'s ``check_vma`` types it; empty when unchecked."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9
  if mat is not None:
    return frozenset(mat.varying) | frozenset(mat.unreduced)
  return frozenset(getattr(aval, "vma", ()))


def _leaf_specs(partition_specs, tree, what: str) -> list:
  """The ``PartitionSpec`` (or None) of each leaf of ``tree``, in leaf order."""
  for spec in jax.tree.leaves(partition_specs, is_leaf=_is_spec):
    if not _is_spec(spec):
      raise TypeError(
        f"{what}: partition_specs must hold a jax.sharding.PartitionSpec or "
        f"None at each leaf, got {spec!r} ({type(spec).__name__})"
      )
  try:
    return list(
      broadcast_prefix(
        jax.tree.leaves(partition_specs, is_leaf=_is_spec),
        partition_specs,
        tree,
        is_leaf=_is_spec,
      )
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"{what}: partition_specs must have the structure of the gradients "
      f"(or a prefix of it), with a PartitionSpec or None at each leaf: "
      f"{e}"
    ) from None


class _Repeated:
  """``value`` for each of ``count`` leaves; a pytree leaf itself."""

  def __init__(self, value, count):
    self.value, self.count = value, count


def broadcast_prefix(values, prefix, tree, is_leaf=None) -> tuple:
  """One of ``values`` (given per leaf of ``prefix``) per leaf of ``tree``.

  ``prefix`` has the structure of ``tree`` or a prefix of it, as
  ``optax.masked``'s mask: a leaf of ``prefix`` stands for every leaf of the
  subtree of ``tree`` at its place.

  Raises:
    ValueError: ``prefix`` is not a prefix of ``tree``'s structure.
  """
  it = iter(values)
  repeated = jax.tree.map(
    lambda _, sub: _Repeated(next(it), len(jax.tree.leaves(sub))),
    prefix,
    tree,
    is_leaf=is_leaf,
  )
  return tuple(
    r.value
    for r in jax.tree.leaves(
      repeated, is_leaf=lambda x: isinstance(x, _Repeated)
    )
    for _ in range(r.count)
  )


def leaf_axes_from_specs(partition_specs, tree, what: str) -> tuple:
  """Static per-leaf mesh axes to sum each leaf's squares over, from specs.

  ``partition_specs`` is what the user gives ``shard_map`` for the gradients:
  the gradients' structure with a ``PartitionSpec`` (or None) per leaf, or a
  prefix of it (one spec for a whole subtree).

  Only the *manual* axes of the mesh being traced under are kept: inside
  ``shard_map`` each device holds a block and the blocks' sums are added
  with ``psum``; under plain ``jit`` (sharded or not) the arrays are global,
  their sums already are, and the same transformation needs no collective.

  Raises:
    TypeError: a leaf of ``partition_specs`` is not a PartitionSpec or None.
    ValueError: ``partition_specs`` does not match the structure of ``tree``;
      a spec names an axis the current mesh does not have; or (under
      ``shard_map`` with ``check_vma``) a leaf varies over a mesh axis its spec
      says it is replicated over, so its blocks would disagree across it.
  """
  leaves_with_paths = jax.tree_util.tree_leaves_with_path(tree)
  if partition_specs is None or not leaves_with_paths:
    # No leaves, nothing to sum (optax.tree_map_params, the usual way to build
    # the optimizer state's specs, calls init with such a placeholder).
    return ((),) * len(leaves_with_paths)
  specs = _leaf_specs(partition_specs, tree, what)
  mesh = jax.sharding.get_abstract_mesh()
  mesh_axes = tuple(mesh.axis_names)
  manual = frozenset(mesh.manual_axes) if mesh_axes else frozenset()
  axes = []
  for (path, x), spec in zip(leaves_with_paths, specs):
    named = spec_axes(spec)
    missing = [a for a in named if a not in mesh_axes]
    if mesh_axes and missing:
      raise ValueError(
        f"{what}: partition_specs give gradient leaf "
        f"{jax.tree_util.keystr(path)} the spec {spec}, which names mesh "
        f"axis {missing[0]!r}; the mesh has axes {mesh_axes}"
      )
    unnamed = sorted(_varying_axes(x) - set(named))
    if unnamed:
      raise ValueError(
        f"{what}: partition_specs give gradient leaf "
        f"{jax.tree_util.keystr(path)} the spec {spec}, replicated over "
        f"mesh axis {unnamed[0]!r}, but under shard_map it varies over that "
        f"axis: reduce it over {unnamed[0]!r} first (lax.psum or lax.pmean) "
        f"or name {unnamed[0]!r} in its PartitionSpec"
      )
    axes.append(tuple(a for a in named if a in manual))
  return tuple(axes)
