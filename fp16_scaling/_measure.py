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
  configurations of equal trees make equal plans), so that a loss-scale
  state's treedef holds its scale part (``LeafPaths.plan``, resolved once
  by ``tx.init``); the clip's groups join it where the step runs
  (:meth:`with_groups`).

  Attributes:
    treedef: the structure of the tree it was resolved on.
    specs: per leaf, its ``PartitionSpec`` (None: not split), from the
      ``partition_specs`` prefix tree; None where none were given.
    layout: the stacked layout resolved on the tree (a hashable
      ``_stacked.Layout``), or None without ``stacked_axes``.
    groups: per leaf, its clip group (``SHARED`` or ``EXPERT``, from the
      clip's ``expert_mask``); None where no clip reads the measurement.
  """

  treedef: Any
  specs: Optional[tuple] = None
  layout: Any = None
  groups: Optional[tuple] = None

  @property
  def layer_axes(self) -> Optional[tuple]:
    """Per leaf, its layer axis or None; None where no leaf is stacked."""
    return None if self.layout is None else self.layout.axes

  def leaf_axes(self, tree, what: str) -> tuple:
    """Per leaf of ``tree`` (of the plan's structure), the mesh axes its
    sum is reduced over, checked against the mesh of this trace.

    Raises:
      ValueError: a spec names an axis the mesh lacks, or a leaf varies
        over a manual axis its spec does not split it over.
    """
    given = self.specs is not None
    n = self.treedef.num_leaves
    specs = self.specs if given else (None,) * n
    return _sharding.leaf_axes(specs, given, tree, what)

  def with_groups(self, expert_mask, tree) -> "Plan":
    """This plan with the clip's groups of ``tree``'s leaves (from
    ``expert_mask``, as :func:`expert_groups`): its norm is then reduced
    per group too.

    Raises:
      ValueError: ``expert_mask`` does not fit ``tree``.
    """
    groups = expert_groups(expert_mask, tree)
    return dataclasses.replace(self, groups=tuple(groups))


def plan_of(
  tree,
  partition_specs=None,
  layout=None,
  *,
  what: str = "fp16_loss_scale",
) -> Plan:
  """The :class:`Plan` of ``tree`` (the params, or gradients of their
  tree), without clip groups (:meth:`Plan.with_groups` adds them).

  Args:
    tree: the gradients, or any tree of their structure (shapes only).
    partition_specs: their ``PartitionSpec``s (a prefix tree), or None.
    layout: the stacked layout resolved on ``tree``
      (``_stacked.Layout``), or None.
    what: the transformation named in error messages.

  Returns:
    The plan.

  Raises:
    TypeError, ValueError: ``partition_specs`` do not fit ``tree``.
  """
  specs = _sharding.leaf_specs(partition_specs, tree, what)
  return Plan(
    treedef=jax.tree.structure(tree),
    specs=None if partition_specs is None else tuple(specs),
    layout=layout,
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
  plan: Plan,
  *,
  in_float16_range: bool = False,
  what: str = "fp16_loss_scale",
) -> Measurement:
  """The one pass over ``grads``, made at loss scale ``scale``.

  Args:
    grads: the scaled gradients, any pytree of floating arrays.
    scale: the loss scale they were made with.
    plan: their :class:`Plan` (:func:`plan_of`; the step's is the one
      ``tx.init`` resolved). Under ``shard_map`` each leaf's sum is
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
  leaves = tuple(jax.tree.leaves(grads))
  _norm.check_float_leaves(leaves, f"{what} gradients", grads)
  leaf_axes = plan.leaf_axes(grads, what)
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
