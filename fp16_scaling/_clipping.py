"""``clip_by_unscaled_norm``: clip by the true global norm, MoE-aware: the
unscaled gradients' norm, expert and shared leaves together, each part also
reported (DeepSpeed's unfused optimizer leaves the experts out; docs/peers.md).
"""

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp16_scaling import _donation
from fp16_scaling import _norm
from fp16_scaling import _sharding
from fp16_scaling import _stacked
from fp16_scaling import _validate
from fp16_scaling._measure import Handed
from fp16_scaling._measure import measure
from fp16_scaling._states import EXPERT
from fp16_scaling._states import SHARED
from fp16_scaling._states import ClipState


def _mask_leaves(mask) -> list:
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


def _expert_groups(expert_mask, tree) -> tuple:
  """Static 0/1 group per leaf of ``tree`` (1 for an expert leaf) from
  ``expert_mask``: a bool pytree with ``tree``'s structure or a prefix of
  it (as in ``optax.masked``), or a callable that maps ``tree`` to one;
  None marks no leaf."""
  n = len(jax.tree.leaves(tree))
  if expert_mask is None or n == 0:
    # No leaves (optax.tree_map_params calls init with such a placeholder).
    return (SHARED,) * n
  mask = expert_mask(tree) if callable(expert_mask) else expert_mask
  leaves = _mask_leaves(mask)
  try:
    return _sharding.broadcast_prefix(
      [EXPERT if bool(m) else SHARED for m in leaves], mask, tree
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
      "expert_mask must have the structure of the gradients, or a prefix of "
      "it, with a bool at each leaf (a bool for a subtree marks all its "
      f"leaves); got {jax.tree.structure(mask)} for gradients "
      f"{jax.tree.structure(tree)}: {e}"
    ) from None


def clip_by_unscaled_norm(
  max_norm: float,
  *,
  expert_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
  eps: float = 1e-6,
  partition_specs: Optional[Any] = None,
  stacked_axes: Optional[Any] = None,
) -> optax.GradientTransformation:
  """Clips gradients by their true global 2-norm.

  The gradients are multiplied by ``max_norm / (norm + eps)`` when that is
  below 1, as ``torch.nn.utils.clip_grad_norm_`` and DeepSpeed do.

  Args:
    max_norm: the largest global norm let through; positive.
    expert_mask: marks mixture-of-experts leaves, as in ``optax.masked``: a
      pytree of bools with the gradients' structure or a prefix of it, or a
      callable that maps the gradients to one. The state reports each part.
    eps: added to the norm in the denominator; >= 0.
    partition_specs: under ``shard_map``, the gradients' ``PartitionSpec``
      pytree.
    stacked_axes: as for :func:`fp16_loss_scale`, checked at ``init``
      against the params (the global norm it clips by does not depend on
      it), so that one value can be passed to every element.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`ClipState`.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(optax.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(64.0)),
    ...     fs.clip_by_unscaled_norm(1.0)))
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> grads = jnp.array([3.0, 4.0]) * 64.0  # true norm 5, made at scale 64
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates.round(6))  # norm 5 clipped to 1
    [0.6 0.8]
  """
  max_norm = _validate.positive("max_norm", max_norm)
  eps = _validate.non_negative("eps", eps)
  _stacked.check(stacked_axes, "clip_by_unscaled_norm")
  if expert_mask is not None and not callable(expert_mask):
    _mask_leaves(expert_mask)

  def init_fn(params):
    _norm.check_float_leaves(
      jax.tree.leaves(params), "clip_by_unscaled_norm params"
    )
    _expert_groups(expert_mask, params)
    _sharding.leaf_axes_from_specs(
      partition_specs, params, "clip_by_unscaled_norm"
    )
    _stacked.resolve(
      stacked_axes, params, partition_specs, "clip_by_unscaled_norm"
    )
    # Three buffers: a donating step reuses each for its own field.
    zero = lambda: jnp.zeros([], jnp.float32)
    return ClipState(zero(), zero(), zero())

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    groups = _expert_groups(expert_mask, updates)
    what = "clip_by_unscaled_norm"
    handed = isinstance(state, Handed)
    if handed:
      # Right after fp16_loss_scale: ``updates`` are the measured gradients,
      # unscaled; the one pass has their sums. This clip's own specs are
      # checked here (the measurement checked fp16_loss_scale's).
      _sharding.leaf_axes_from_specs(partition_specs, updates, what)
      state, measurement = state.state, state.measurement
      norms = measurement.grouped(groups, 2)
    else:
      own = measure(updates, 1.0, partition_specs, what=what)
      norms = own.grouped(groups, 2)
      leaves = _norm.discard_if(norms.overflow, leaves)
    factor = jnp.minimum(
      jnp.float32(1), jnp.float32(max_norm) / (norms.norm + jnp.float32(eps))
    )
    if handed:
      # ``updates`` are the measured gradients unscaled: unscale and clip
      # them in one multiply, by the scale's inverse times the factor.
      clipped = measurement.unscaled(measurement.grads, factor)
    else:
      clipped = [x * factor.astype(x.dtype) for x in leaves]
    new_state = ClipState(
      grad_norm=norms.norm,
      expert_grad_norm=norms.group_norms[EXPERT],
      shared_grad_norm=norms.group_norms[SHARED],
    )
    # Write-only: each field reads its old value to keep its donated buffer.
    return jax.tree.unflatten(treedef, clipped), _donation.written_over(
      state, new_state
    )

  return optax.GradientTransformation(init_fn, update_fn)
