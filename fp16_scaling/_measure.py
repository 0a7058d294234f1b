"""The one measurement of a step's gradients, and :class:`Handed`, which
passes it to an element with its state (docs/design.md, "Data flow").
"""

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from fp16_scaling import _lookup
from fp16_scaling import _norm
from fp16_scaling import _sharding


class Measurement(NamedTuple):
  """One pass over a step's scaled gradient leaves ``grads``, made at
  ``scale``: their local ``sums`` of squares and global ``norms`` (a leaf
  with a layer axis in ``layer_axes`` keeps it in its sums)."""

  grads: tuple
  sums: tuple
  norms: _norm.Norms
  scale: jax.Array
  leaf_axes: tuple
  in_float16_range: bool = False
  layer_axes: Optional[tuple] = None

  @property
  def overflow(self) -> jax.Array:
    return self.norms.overflow

  @property
  def inv_scale(self) -> jax.Array:
    return 1.0 / self.scale

  def unscaled(self, leaves: Sequence[jax.Array]) -> tuple:
    """``leaves`` over the scale, in float32 or wider; zeros on overflow."""
    wide = [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in leaves]
    inv = self.inv_scale
    return tuple(x * inv for x in _norm.discard_if(self.overflow, wide))

  def grouped(self, leaf_groups, num_groups: int) -> _norm.Norms:
    """The norms of :meth:`unscaled` gradients, per group of leaves."""
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


class Handed(NamedTuple):
  """An element's ``state`` with the step's ``measurement`` (and a shared
  ``loss_scale``), as ``skip_on_overflow`` passes it to its own elements."""

  state: Any
  measurement: Measurement
  loss_scale: Any = None


def measure(
  grads: Any,
  scale: jax.Array,
  partition_specs: Optional[Any] = None,
  *,
  in_float16_range: bool = False,
  what: str = "fp16_loss_scale",
  layer_axes: Optional[tuple] = None,
) -> Measurement:
  """The one pass over ``grads``, made at loss scale ``scale``; per layer
  for the leaves ``layer_axes`` gives a layer axis (docs/stacked.md)."""
  leaves = jax.tree.leaves(grads)
  _norm.check_float_leaves(leaves, f"{what} gradients")
  leaf_axes = _sharding.leaf_axes_from_specs(partition_specs, grads, what)
  if layer_axes is not None and len(layer_axes) != len(leaves):
    layer_axes = None  # not the params' tree: _loss_scale._leaf_fitter warns
  sums = _norm.leaf_sums(leaves, layer_axes)
  norms = _norm.reduce_norms(
    sums, leaves, leaf_axes=leaf_axes, in_float16_range=in_float16_range
  )
  return Measurement(
    tuple(leaves),
    tuple(sums),
    norms,
    jnp.asarray(scale, jnp.float32),
    tuple(leaf_axes),
    in_float16_range,
    layer_axes,
  )


def measure_step(
  grads: Any,
  opt_state: Any,
  loss_scale: Optional[Any] = None,
  *,
  in_float16_range: bool = False,
) -> Measurement:
  """:func:`measure` of ``grads`` at the scale and with the partition specs
  of ``opt_state`` (the scale of a shared ``loss_scale`` when given)."""
  ls = _lookup.loss_scale_state(opt_state)
  scale = ls.scaler.loss_scale if loss_scale is None else loss_scale.loss_scale
  specs, stacked = ls.leaf_paths.partition_specs, ls.leaf_paths.stacked
  axes = stacked.axes if stacked is not None else None
  kw = dict(in_float16_range=in_float16_range, layer_axes=axes)
  return measure(grads, scale, specs, **kw)
