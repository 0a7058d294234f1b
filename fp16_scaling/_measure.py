"""The one measurement of a step's gradients, from which :func:`chain`
unscales, clips and decides the skip (docs/design.md, "Data flow").
"""

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from fp16_scaling import _norm
from fp16_scaling import _sharding


class Measurement(NamedTuple):
  """One pass over a step's scaled gradients, made once per step.

  Attributes:
    grads: the scaled gradient leaves measured, in tree order.
    sums: per-leaf local sums of squares (``_norm.leaf_sums``); a leaf with
      a layer axis (``stacked_axes``) keeps that axis: a vector of its
      layers' sums.
    norms: the global :class:`~fp16_scaling._norm.Norms` of ``grads``
      (``norm`` still multiplied by ``scale``).
    scale: float32, the loss scale the gradients were made with.
    leaf_axes: static, the mesh axes each leaf's sum is reduced over.
    in_float16_range: static, every leaf holds float16-range values (the
      gradients are float16, or a mean of float16 microbatches), so no
      finite square can overflow float32 and the norm's float32 rescue is
      left out of the trace.
    layer_axes: static, per leaf its layer axis (the state's stacked
      layout) or None; None where no leaf is measured per layer.
  """

  grads: tuple
  sums: tuple
  norms: _norm.Norms
  scale: jax.Array
  leaf_axes: tuple
  in_float16_range: bool = False
  layer_axes: Optional[tuple] = None

  @property
  def overflow(self) -> jax.Array:
    """bool scalar: whether any measured element was inf or NaN."""
    return self.norms.overflow

  @property
  def inv_scale(self) -> jax.Array:
    """float32 ``1 / scale``, the factor that unscales the gradients."""
    return 1.0 / self.scale

  def unscaled(self, leaves: Sequence[jax.Array], factor=None) -> tuple:
    """``leaves`` over the scale, times ``factor`` if given (one multiply per
    element), in float32 or wider; zeros on overflow."""
    wide = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in leaves]
    inv = self.inv_scale if factor is None else self.inv_scale * factor
    return tuple(x * inv for x in _norm.discard_if(self.overflow, wide))

  def grouped(self, leaf_groups, num_groups: int) -> _norm.Norms:
    """The norms of :meth:`unscaled` gradients, per group of leaves.

    Args:
      leaf_groups: static group index of each leaf, in tree order.
      num_groups: number of groups.

    Returns:
      :class:`~fp16_scaling._norm.Norms` reduced from this measurement's
      sums (the gradients are not read again), ``norm`` and
      ``group_norms`` divided by the scale.
    """
    norms = _norm.reduce_norms(
      self.sums,
      self.grads,
      leaf_groups=leaf_groups,
      num_groups=num_groups,
      leaf_axes=self.leaf_axes,
      per_leaf=self.norms.leaf_sums,
      in_float16_range=self.in_float16_range,
    )
    inv = self.inv_scale
    return norms._replace(
      norm=norms.norm * inv, group_norms=norms.group_norms * inv
    )


def measure(
  grads: Any,
  scale: jax.Array,
  partition_specs: Optional[Any] = None,
  *,
  in_float16_range: bool = False,
  what: str = "fp16_loss_scale",
  layer_axes: Optional[tuple] = None,
) -> Measurement:
  """The one pass over ``grads``, made at loss scale ``scale``.

  Args:
    grads: the scaled gradients, any pytree of floating arrays.
    scale: the loss scale they were made with.
    partition_specs: ``PartitionSpec``s of ``grads`` under ``shard_map``
      (a prefix tree), or None: each leaf's sum is ``psum``-med over the
      mesh axes its spec splits it over.
    in_float16_range: see :class:`Measurement`.
    what: the transformation named in error messages.
    layer_axes: per leaf of ``grads`` in tree order (a layout resolved on
      their tree), its layer axis (an int) or None; a leaf with one is
      measured per layer (docs/stacked.md). None: no leaf is stacked.

  Returns:
    The :class:`Measurement`.

  Raises:
    TypeError: a leaf is not floating (integer or bool gradients).
    ValueError: ``partition_specs`` does not fit ``grads``.
  """
  leaves = tuple(jax.tree.leaves(grads))
  _norm.check_float_leaves(leaves, f"{what} gradients", grads)
  leaf_axes = _sharding.leaf_axes_from_specs(partition_specs, grads, what)
  sums = tuple(_norm.leaf_sums(leaves, layer_axes))
  norms = _norm.reduce_norms(
    sums, leaves, leaf_axes=leaf_axes, in_float16_range=in_float16_range
  )
  scale = jnp.asarray(scale, jnp.float32)
  return Measurement(
    grads=leaves,
    sums=sums,
    norms=norms,
    scale=scale,
    leaf_axes=leaf_axes,
    in_float16_range=in_float16_range,
    layer_axes=layer_axes,
  )
