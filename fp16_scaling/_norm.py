"""The one global-norm routine: overflow and norm from a single pass, each
leaf's sum ``-inf`` exactly when it held an inf or NaN, and ``psum``-med
over its mesh axes (docs/design.md, "The one pass", "What float16 holds").
"""

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _segments
from fp16_scaling._sharding import AxisNames
from fp16_scaling._sharding import leaf_vector
from fp16_scaling._stacked import summed_axes

# Cap on a wide element's square and on any leaf's sum: 2**31 of them still
# add up to a finite float32, so a -inf never meets a +inf.
CAP = 2.0**96
# The least magnitude float16 rounds to inf: 65504 plus half its last step of
# 32, a tie that rounds to the even 2**16, out of range.
FLOAT16_INF_FROM = 65520.0


class Norms(NamedTuple):
  """Norms of a gradient tree, as computed from its per-unit sums.

  A unit is a leaf, or one layer of a stacked leaf (``stacked_axes``).

  Attributes:
    norm: float32 global 2-norm; 0.0 when ``overflow`` (no norm exists).
    group_norms: float32 vector, the 2-norm of each group of leaves; 0.0 for
      a group that holds a non-finite leaf.
    overflow: bool, whether any element was inf or NaN.
    leaf_nonfinite: bool vector, one entry per unit in tree order, whether
      that unit held an inf or NaN (on any device, under ``shard_map``).
    leaf_sums: float32 vector, per unit the global sum of squares (``-inf``
      for a unit that held an inf or NaN), from which the rest was reduced.
  """

  norm: jax.Array
  group_norms: jax.Array
  overflow: jax.Array
  leaf_nonfinite: jax.Array
  leaf_sums: jax.Array


def check_float_leaves(
  leaves: Sequence[jax.Array], what: str, tree: Any = None
) -> None:
  """Raises TypeError for a non-floating leaf (integer or bool gradients),
  or one that is not an array at all (an Equinox module's functions);
  given the ``tree`` the leaves are of, the message names the leaf's path."""
  paths = [None] * len(leaves)
  if tree is not None:
    with_paths = jax.tree_util.tree_leaves_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
  for i, (x, path) in enumerate(zip(leaves, paths)):
    leaf = f"leaf {i} ({path})" if path else f"leaf {i}"
    is_number = isinstance(x, (int, float, complex))
    if not hasattr(x, "dtype") and not is_number:
      raise TypeError(
        f"{what} must be arrays of floating point; {leaf} is a "
        f"{type(x).__name__} ({_short(x)}), not an array. An Equinox "
        "module's activation functions and other non-array fields are "
        "leaves of its tree: pass eqx.filter(model, eqx.is_inexact_array) "
        "to tx.init, and gradients of that filtered tree to tx.update (as "
        "eqx.filter_grad makes them); elsewhere, keep only the arrays in "
        "the params tree"
      )
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"{what} must be floating point (float16, bfloat16, float32 or "
        f"float64); {leaf} has dtype {dtype}. Keep integer and bool "
        "arrays (step counters, masks) out of the tree the optimizer "
        "sees, e.g. eqx.filter(model, eqx.is_inexact_array) or an "
        "optax.masked optimizer"
      )


def _short(x) -> str:
  """``repr(x)``, cut to a line."""
  text = repr(x)
  return text if len(text) <= 60 else text[:57] + "..."


def _is_wide(x) -> bool:
  return jnp.result_type(x) != jnp.float16


def _wide_dtype(x: jax.Array) -> np.dtype:
  """float32, or the dtype of ``x`` where it is wider."""
  return jnp.promote_types(x.dtype, jnp.float32)


def widen(x: jax.Array) -> jax.Array:
  """``x`` in (at least) float32, a float16 value out of float16's range as
  ``+-inf`` (docs/design.md, "What float16 holds")."""
  wide = x.astype(_wide_dtype(x))
  if _is_wide(x):
    return wide
  out_of_range = lax.ge(lax.abs(wide), np.float32(FLOAT16_INF_FROM))
  as_inf = wide * np.float32(jnp.inf)
  return jnp.where(out_of_range, as_inf, wide)


def _squares(x: jax.Array) -> jax.Array:
  """Elementwise squares in float32: ``+inf`` or NaN where a float16 ``x`` is
  out of range (:func:`widen`), ``-inf`` where a wider one is not finite."""
  wide = lax.convert_element_type(x, _wide_dtype(x))
  sq = lax.mul(wide, wide)
  if not _is_wide(x):
    # float32 multiplication rounds correctly and monotonically, and
    # 65520**2 is a float32: sq >= 65520**2 exactly when |x| >= 65520, the
    # squares of widen(x) without its select. NaN stays NaN.
    out_of_range = lax.ge(sq, np.float32(FLOAT16_INF_FROM**2))
    return jnp.where(out_of_range, jnp.inf, sq)
  sq = jnp.minimum(sq, np.float32(CAP))
  return jnp.where(lax.is_finite(wide), sq, -jnp.inf)


@jax.custom_jvp
def safe_sqrt(x: jax.Array) -> jax.Array:
  """``jnp.sqrt`` whose derivative is 0 where it is not finite (the norm of
  an overflow step is discarded; its derivative must not be NaN)."""
  return jnp.sqrt(x)


@safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  y = jnp.sqrt(x)
  ok = jnp.isfinite(y) & (y > 0)
  slope = jnp.where(ok, 0.5 / jnp.where(ok, y, 1), 0)  # d sqrt(x) / dx
  return y, dx * slope


def leaf_sums(leaves: Sequence[jax.Array], layer_axes=None) -> list:
  """The one pass: per-leaf local sums of squares, not finite exactly for a
  leaf with a non-finite element (whose derivative counts as 0). A leaf with
  a layer axis in ``layer_axes`` keeps it: its sums are a vector, per layer.
  Compiled for a GPU, a few kernels for all the leaves (``_segments``);
  elsewhere a reduction per leaf."""
  layer_axes = tuple(layer_axes or (None,) * len(leaves))
  return list(_leaf_sums(tuple(leaves), layer_axes))


def _wide_squares(x: jax.Array) -> jax.Array:
  """:func:`_squares` in float32."""
  return _squares(x).astype(jnp.float32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _leaf_sums(leaves, layer_axes):
  """:func:`leaf_sums` on a tuple, with its derivative rule."""

  def per_leaf(leaves):
    return tuple(
      lax.reduce_sum(_wide_squares(x), summed_axes(x, a))
      for x, a in zip(leaves, layer_axes)
    )

  def segmented(leaves):
    return _segments.unit_reduce(leaves, layer_axes, _wide_squares, jnp.sum)

  return _segments.per_platform(leaves, per_leaf, segmented)


@_leaf_sums.defjvp
def _leaf_sums_jvp(layer_axes, primals, tangents):
  (leaves,), (dleaves,) = primals, tangents
  out = []
  for x, dx, a in zip(leaves, dleaves, layer_axes):
    dx = dx.astype(_wide_dtype(x))
    x = widen(x)
    safe = lax.select(lax.is_finite(x), x, lax.full_like(x, 0))
    d_squares = 2 * safe * dx
    out.append(jnp.sum(d_squares, summed_axes(x, a), dtype=jnp.float32))
  return _leaf_sums(leaves, layer_axes), tuple(out)


def discard_if(overflow: jax.Array, leaves: Sequence[jax.Array]) -> tuple:
  """``leaves``, or zeros when ``overflow``, selected before any multiply
  (docs/design.md, "Differentiating through an overflow step")."""
  return tuple(jnp.where(overflow, 0.0, x) for x in leaves)


def _grouped(
  values, leaf_groups, leaf_axes, num_groups, *, combine, collective
):
  """Combines per-leaf scalars into one value per group, across the mesh:
  each leaf's across its mesh axes, then each group's (0.0 for an empty
  group, the values being at least 0)."""
  per_leaf = leaf_vector(values, leaf_axes, collective)
  groups = np.asarray(leaf_groups, np.int32)
  return jnp.stack(
    [combine(jnp.where(groups == g, per_leaf, 0.0)) for g in range(num_groups)]
  )


def reduce_norms(
  sums: Sequence[jax.Array],
  leaves: Sequence[jax.Array],
  *,
  leaf_groups: Optional[Sequence[int]] = None,
  num_groups: int = 1,
  leaf_axes: Optional[Sequence[AxisNames]] = None,
  per_leaf: Optional[jax.Array] = None,
  in_float16_range: bool = False,
) -> Norms:
  """Global and per-group norms, and per-leaf overflow, from leaf sums.

  Args:
    sums: per-leaf local sums of squares, from :func:`leaf_sums`.
    leaves: the leaves they were computed from (read again only when finite
      squares were too large for float32: the total reached ``CAP``).
    leaf_groups: static group index of each leaf (default: all in group 0).
    num_groups: number of groups.
    leaf_axes: static mesh axes to ``psum`` each leaf's sum over, from
      the measurement's plan (``_measure.Plan.leaf_axes``; default: none).
    per_leaf: ``Norms.leaf_sums`` of an earlier reduction of the same
      ``sums`` over the same ``leaf_axes``: the vector is not built again.
    in_float16_range: static; every leaf holds values within float16's
      range, so no finite square can pass ``CAP`` and the float32 rescue
      (a ``lax.cond``) is not traced.

  Returns:
    :class:`Norms`; with no leaves, zeros and no overflow.
  """
  n = len(leaves)
  if leaf_groups is None:
    leaf_groups = (0,) * n
  if leaf_axes is None:
    leaf_axes = ((),) * n
  needs_rescue = any(_is_wide(x) for x in leaves)
  if per_leaf is None:
    mark = functools.partial(_marked, cap=needs_rescue)
    per_leaf = leaf_vector(sums, leaf_axes, lax.psum, prepare=mark)
  # Per unit (a leaf, or a layer of a stacked leaf), its leaf's group.
  units_per_leaf = [np.size(s) for s in sums]
  unit_groups = tuple(np.repeat(leaf_groups, units_per_leaf))
  common, total = _group_sums(per_leaf, unit_groups, num_groups)
  # The rescue reads the leaves again: their groups are the per-leaf ones.
  if needs_rescue and not in_float16_range:
    rescue = functools.partial(
      _rescued_roots, leaves, leaf_groups, leaf_axes, num_groups
    )
    keep = functools.partial(_roots, total, common)
    root, group_roots = lax.cond(total >= CAP, rescue, keep)
  else:
    root, group_roots = _roots(total, common)
  # -inf exactly for a leaf (and so a total) with a non-finite element.
  overflow = total < 0
  return Norms(
    norm=jnp.where(overflow, 0.0, root),
    group_norms=jnp.where(jnp.isinf(group_roots), 0.0, group_roots),
    overflow=overflow,
    leaf_nonfinite=per_leaf < 0,
    leaf_sums=per_leaf,
  )


def _group_sums(per_leaf, leaf_groups, num_groups) -> tuple:
  """``(per-group sums, total)`` of the per-leaf vector."""
  present = set(leaf_groups)
  zero = jnp.float32(0)
  if len(present) == 1:
    total = jnp.sum(per_leaf)
    sums = [total if g in present else zero for g in range(num_groups)]
    return jnp.stack(sums), total
  groups = np.asarray(leaf_groups, np.int32)
  sums = [
    jnp.sum(jnp.where(groups == g, per_leaf, 0.0)) if g in present else zero
    for g in range(num_groups)
  ]
  common = jnp.stack(sums)
  return common, jnp.sum(common)


def _marked(local: jax.Array, *, cap: bool) -> jax.Array:
  """Local sums with every non-finite one ``-inf``, and with ``cap`` each
  capped at ``CAP`` so that their total stays finite too."""
  local = jnp.where(lax.is_finite(local), local, -jnp.inf)
  if cap:
    local = jnp.minimum(local, jnp.float32(CAP))
  return local


def _roots(total, common) -> tuple:
  """``(norm, group norms)`` from the summed squares: sqrt(|sum|) is +inf,
  not NaN, for a sum that met a non-finite leaf (-inf)."""
  return safe_sqrt(jnp.abs(total)), safe_sqrt(jnp.abs(common))


def _rescued_roots(leaves, leaf_groups, leaf_axes, num_groups) -> tuple:
  """:func:`_roots` for finite squares too large for float32's sums: each
  group relative to its own largest magnitude (entered for a finite total)."""
  maxima = [jnp.max(jnp.abs(x), initial=0).astype(jnp.float32) for x in leaves]
  peaks = _grouped(
    maxima,
    leaf_groups,
    leaf_axes,
    num_groups,
    combine=jnp.max,
    collective=lax.pmax,
  )
  peaks = jnp.where(peaks > 0, peaks, jnp.float32(1))
  relative = []  # each leaf's sum of squares relative to its group's peak
  for x, g in zip(leaves, leaf_groups):
    scaled_down = x.astype(jnp.float32) / peaks[g]
    relative.append(jnp.sum(jnp.square(scaled_down)))
  relative = _grouped(
    relative,
    leaf_groups,
    leaf_axes,
    num_groups,
    combine=jnp.sum,
    collective=lax.psum,
  )
  top = jnp.max(peaks)
  total = jnp.sum(jnp.square(peaks / top) * relative)
  norm = top * jnp.sqrt(total)
  return norm, peaks * jnp.sqrt(relative)
