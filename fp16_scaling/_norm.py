"""The one global-norm routine: overflow and norm from a single pass.

``leaf_sums(leaves)`` reads every gradient element once and sums
``x * x`` where ``x`` is finite and NaN where it is not. So the total is

* NaN exactly when some element is inf or NaN: an *overflow*;
* +inf when every element is finite but a square or the sum overflowed
  float32: not an overflow, only too large to square. That rare case is
  recomputed with the squares taken relative to the largest magnitude, inside
  a ``lax.cond`` that a common step never enters;
* otherwise the squared norm.

A sum of non-negative finite numbers is never NaN, so the overflow test is
exact. Under ``shard_map``, each leaf's partial sum is summed with ``psum``
across exactly the mesh axes its ``PartitionSpec`` splits it over, so a leaf
replicated across an axis counts once and a sharded one counts every shard.
"""

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


def check_float_leaves(leaves: Sequence[jax.Array], what: str) -> None:
  """Raises TypeError for a non-floating leaf (integer or bool gradients)."""
  for i, x in enumerate(leaves):
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{what} must be floating point (float16, bfloat16, float32 or "
          f"float64); leaf {i} has dtype {dtype}")


def _squares(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.where(jnp.isfinite(x), x * x, jnp.nan)


def leaf_sums(leaves: Sequence[jax.Array]) -> list:
  """Per-leaf local sums of squares, NaN for a leaf with a non-finite element.

  This is the one pass over the gradients; everything else works on scalars.
  """
  return [jnp.sum(_squares(x), dtype=jnp.float32) for x in leaves]


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
  return jnp.stack([combine(jnp.stack(vs)) if vs else jnp.float32(0)
                    for vs in per_group])


def reduce_norms(sums: Sequence[jax.Array],
                 leaves: Sequence[jax.Array],
                 *,
                 leaf_groups: Optional[Sequence[int]] = None,
                 num_groups: int = 1,
                 leaf_axes: Optional[Sequence[AxisNames]] = None) -> Norms:
  """Global and per-group norms from :func:`leaf_sums`.

  Args:
    sums: per-leaf local sums of squares, from :func:`leaf_sums`.
    leaves: the leaves they were computed from (read again only in the rare
      case where a finite square overflowed float32).
    leaf_groups: static group index of each leaf (default: all in group 0).
    num_groups: number of groups.
    leaf_axes: static mesh axes each leaf is split over (default: none).

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
    return _grouped(values, leaf_groups, leaf_axes, num_groups, jnp.sum,
                    lambda v, axes: lax.psum(v, axes))

  common = group_sums(sums)
  total = jnp.sum(common)
  overflow = jnp.isnan(total)

  needs_rescue = any(jnp.result_type(x) != jnp.float16 for x in leaves)
  if needs_rescue:
    # float16 squares cannot overflow a float32 sum (65504**2 * 2**63 < max),
    # so the rescue is only traced when some leaf is wider than float16.
    def rescue(_):
      maxima = [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in leaves]
      peak = jnp.max(_grouped(maxima, (0,) * n, leaf_axes, 1, jnp.max,
                              lambda v, axes: lax.pmax(v, axes)))
      rel = [jnp.sum(jnp.square(x.astype(jnp.float32) / peak)) for x in leaves]
      return peak, group_sums(rel)

    def keep(_):
      return jnp.float32(1), common

    magnitude, sums_rel = lax.cond(jnp.isinf(total), rescue, keep, None)
  else:
    magnitude, sums_rel = jnp.float32(1), common
  return Norms(
      norm=magnitude * jnp.sqrt(jnp.sum(sums_rel)),
      group_norms=magnitude * jnp.sqrt(sums_rel),
      overflow=overflow,
  )


def leaf_axes_from_specs(partition_specs, tree, what: str) -> tuple:
  """Static per-leaf mesh axes from a PartitionSpec pytree.

  ``partition_specs`` is what the user gives ``shard_map`` for the gradients:
  the gradients' structure with a ``PartitionSpec`` (or None) per leaf, or a
  prefix of it (one spec for a whole subtree).
  """
  n = len(jax.tree.leaves(tree))
  if partition_specs is None:
    return ((),) * n
  is_spec = lambda s: isinstance(s, jax.sharding.PartitionSpec) or s is None
  try:
    per_subtree = jax.tree.map(
        lambda spec, sub: [spec_axes(spec)] * len(jax.tree.leaves(sub)),
        partition_specs, tree, is_leaf=is_spec)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{what}: partition_specs must have the structure of the gradients "
        f"(or a prefix of it), with a PartitionSpec or None at each leaf: "
        f"{e}") from None
  axes = [a for group in jax.tree.leaves(per_subtree, is_leaf=lambda x: isinstance(x, list)) for a in group]
  if len(axes) != n:
    raise ValueError(f"{what}: partition_specs do not cover the gradients' "
                     f"{n} leaves (got {len(axes)})")
  return tuple(axes)
