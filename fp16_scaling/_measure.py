"""The one measurement of a step's gradients, from which :func:`chain`
unscales, clips and decides the skip (docs/design.md, "Data flow").
"""

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _norm
from fp16_scaling import _sharding
from fp16_scaling._states import EXPERT
from fp16_scaling._states import SHARED


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the one pass reads of a gradient tree besides its arrays,
  resolved from the tree's static structure and the configuration: the
  form the norm consumes. Frozen, hashable and compared by value (equal
  configurations of equal trees make equal plans).

  Attributes:
    treedef: the structure of the tree it was resolved on.
    specs: per leaf, its ``PartitionSpec`` (None: not split), from the
      ``partition_specs`` prefix tree; None where none were given.
    layer_axes: per leaf, its layer axis (the stacked layout) or None;
      None where no leaf is stacked.
    groups: per leaf, its clip group (``SHARED`` or ``EXPERT``, from the
      clip's ``expert_mask``); None where no clip reads the measurement.
  """

  treedef: Any
  specs: tuple
  layer_axes: Optional[tuple] = None
  groups: Optional[tuple] = None


def plan_of(
  tree,
  partition_specs=None,
  layout=None,
  expert_mask=None,
  *,
  clip: bool = True,
  what: str = "fp16_loss_scale",
) -> Plan:
  """The :class:`Plan` of ``tree`` (the params, or gradients of their
  tree).

  Args:
    tree: the gradients, or any tree of their structure (shapes only).
    partition_specs: their ``PartitionSpec``s (a prefix tree), or None.
    layout: the stacked layout resolved on ``tree``
      (``_stacked.Layout``), or None.
    expert_mask: the clip's expert mask (a bool pytree or a callable), or
      None.
    clip: whether a clip reads the measurement (its group norms are then
      reduced with the rest).
    what: the transformation named in error messages.

  Returns:
    The plan.

  Raises:
    TypeError, ValueError: ``partition_specs`` or ``expert_mask`` do not
      fit ``tree``.
  """
  specs = _sharding.leaf_specs(partition_specs, tree, what)
  groups = expert_groups(expert_mask, tree) if clip else None
  return Plan(
    treedef=jax.tree.structure(tree),
    specs=None if partition_specs is None else tuple(specs),
    layer_axes=None if layout is None else tuple(layout.axes),
    groups=None if groups is None else tuple(groups),
  )


def mask_leaves(mask) -> list:
  """The leaves of an expert mask, each checked to be a Python (or numpy)
  bool, known before tracing; TypeError naming the type otherwise."""
  leaves = jax.tree.leaves(mask)
  for m in leaves:
    if not isinstance(m, (bool, np.bool_)):
      raise TypeError(
        "expert_mask must be a pytree of Python bools known before tracing, "
        f"or a callable returning one; got a leaf of type {type(m).__name__}"
      )
  return leaves


def expert_groups(expert_mask, tree) -> tuple:
  """Static 0/1 group per leaf of ``tree`` (1 for an expert leaf) from
  ``expert_mask``: a bool pytree with ``tree``'s structure or a prefix of
  it (as in ``optax.masked``), or a callable that maps ``tree`` to one;
  None marks no leaf."""
  n = len(jax.tree.leaves(tree))
  if expert_mask is None or n == 0:
    # No leaves (optax.tree_map_params calls init with such a placeholder).
    return (SHARED,) * n
  mask = expert_mask(tree) if callable(expert_mask) else expert_mask
  groups = [EXPERT if bool(m) else SHARED for m in mask_leaves(mask)]
  try:
    return _sharding.broadcast_prefix(groups, mask, tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
      "expert_mask must have the structure of the gradients, or a prefix of "
      "it, with a bool at each leaf (a bool for a subtree marks all its "
      f"leaves); got {jax.tree.structure(mask)} for gradients "
      f"{jax.tree.structure(tree)}: {e}"
    ) from None


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
    clip_norms: the unscaled :class:`~fp16_scaling._norm.Norms` of the
      plan's clip groups (:meth:`grouped`), or None without them.
  """

  grads: tuple
  sums: tuple
  norms: _norm.Norms
  scale: jax.Array
  leaf_axes: tuple
  in_float16_range: bool = False
  layer_axes: Optional[tuple] = None
  clip_norms: Optional[_norm.Norms] = None

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
  plan: Optional[Plan] = None,
  *,
  in_float16_range: bool = False,
  what: str = "fp16_loss_scale",
) -> Measurement:
  """The one pass over ``grads``, made at loss scale ``scale``.

  Args:
    grads: the scaled gradients, any pytree of floating arrays.
    scale: the loss scale they were made with.
    plan: their :class:`Plan` (:func:`plan_of`), or None: no leaf split, none
      stacked, no clip. Under ``shard_map`` each leaf's sum is
      ``psum``-med over the mesh axes its spec splits it over; a leaf with
      a layer axis is measured per layer (docs/stacked.md); with clip
      groups, their norms are reduced too (``Measurement.clip_norms``).
    in_float16_range: see :class:`Measurement`.
    what: the transformation named in error messages.

  Returns:
    The :class:`Measurement`.

  Raises:
    TypeError: a leaf is not floating (integer or bool gradients).
    ValueError: the plan's specs do not fit ``grads`` under this mesh.
  """
  if plan is None:
    plan = plan_of(grads, clip=False, what=what)
  leaves = tuple(jax.tree.leaves(grads))
  _norm.check_float_leaves(leaves, f"{what} gradients", grads)
  given = plan.specs is not None
  specs = plan.specs if given else (None,) * len(leaves)
  leaf_axes = _sharding.leaf_axes(specs, given, grads, what)
  sums = tuple(_norm.leaf_sums(leaves, plan.layer_axes))
  norms = _norm.reduce_norms(
    sums, leaves, leaf_axes=leaf_axes, in_float16_range=in_float16_range
  )
  m = Measurement(
    grads=leaves,
    sums=sums,
    norms=norms,
    scale=jnp.asarray(scale, jnp.float32),
    leaf_axes=leaf_axes,
    in_float16_range=in_float16_range,
    layer_axes=plan.layer_axes,
  )
  if plan.groups is None:
    return m
  return m._replace(clip_norms=m.grouped(plan.groups, 2))
