"""``clip_by_unscaled_norm``: clip by the true global norm, MoE-aware: the
unscaled gradients' norm, expert and shared leaves together, each part also
reported (DeepSpeed's unfused optimizer leaves the experts out; docs/peers.md).
"""

import dataclasses
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _donation
from fp16_scaling import _measure
from fp16_scaling import _norm
from fp16_scaling import _sharding
from fp16_scaling import _validate
from fp16_scaling._states import EXPERT
from fp16_scaling._states import SHARED
from fp16_scaling._states import ClipState

_WHAT = "clip_by_unscaled_norm"  # the name its messages give it


@dataclasses.dataclass(frozen=True)
class ClipConfig:
  """What :func:`clip_by_unscaled_norm` was given, checked.

  Attributes:
    max_norm: the largest global norm let through.
    expert_mask: the expert mask (pytree or callable), or None.
    eps: added to the norm in the denominator.
    partition_specs: the gradients' ``PartitionSpec`` pytree, or None.
  """

  max_norm: float
  expert_mask: Any = None
  eps: float = 1e-6
  partition_specs: Any = None

  def factor(self, norms: _norm.Norms) -> jax.Array:
    """float32 ``min(1, max_norm / (norm + eps))``."""
    bound = jnp.float32(self.max_norm) / (norms.norm + jnp.float32(self.eps))
    return jnp.minimum(jnp.float32(1), bound)

  def init(self, params) -> ClipState:
    """The :class:`ClipState` before the first step, this configuration
    checked on ``params``."""
    _norm.check_float_leaves(jax.tree.leaves(params), f"{_WHAT} params", params)
    _measure.expert_groups(self.expert_mask, params)
    _sharding.leaf_axes_from_specs(self.partition_specs, params, _WHAT)
    # Three buffers: a donating step reuses each for its own field.
    return ClipState(
      grad_norm=jnp.zeros([], jnp.float32),
      expert_grad_norm=jnp.zeros([], jnp.float32),
      shared_grad_norm=jnp.zeros([], jnp.float32),
    )

  def update(self, updates, state, params=None, **extra_args) -> tuple:
    """The clip anywhere but right after :func:`fp16_loss_scale`: of what
    reaches it, measured here; extra arguments are ignored."""
    del params, extra_args
    plan = _measure.plan_of(updates, self.partition_specs, what=_WHAT)
    plan = plan.with_groups(self.expert_mask, updates)
    own = _measure.measure(updates, 1.0, plan, what=_WHAT)
    norms = own.clip_norms
    factor = self.factor(norms)
    leaves = _norm.discard_if(norms.overflow, own.grads)
    clipped = [x * factor.astype(x.dtype) for x in leaves]
    # Write-only: each field reads its old value to keep its donated buffer.
    new_state = _donation.written_over(state, clip_state(norms))
    return jax.tree.unflatten(jax.tree.structure(updates), clipped), new_state


class UnscaledClip(optax.GradientTransformationExtraArgs):
  """What :func:`clip_by_unscaled_norm` returns: its ``init`` and ``update``
  are its :class:`ClipConfig`'s, which :attr:`config` reads back for
  :func:`chain` (``optax.with_extra_args_support`` returns it as it is)."""

  @property
  def config(self) -> ClipConfig:
    """The :class:`ClipConfig` this clip runs."""
    return self.init.__self__


def clip_state(norms: _norm.Norms) -> ClipState:
  """The :class:`ClipState` that records ``norms``."""
  groups = norms.group_norms
  return ClipState(
    grad_norm=norms.norm,
    expert_grad_norm=groups[EXPERT],
    shared_grad_norm=groups[SHARED],
  )


def clip_by_unscaled_norm(
  max_norm: float,
  *,
  expert_mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
  eps: float = 1e-6,
  partition_specs: Optional[Any] = None,
) -> UnscaledClip:
  """Clips gradients by their global 2-norm, MoE-aware.

  The gradients are multiplied by ``max_norm / (norm + eps)`` when that is
  below 1, as ``torch.nn.utils.clip_grad_norm_`` and DeepSpeed do; the
  norm is of expert and shared leaves together, and the state reports each
  part. Right after :func:`fp16_loss_scale` in :func:`chain`, the norm is
  the true (unscaled) one, taken from the step's one measurement, and the
  gradients are unscaled and clipped in one multiply. Anywhere else (in a
  plain ``optax.chain``, under ``optax.masked`` or
  ``optax.multi_transform``) it measures and clips what reaches it, as
  ``optax.clip_by_global_norm`` does, and an inf or NaN leaf gives zeros.

  Args:
    max_norm: the largest global norm let through; positive.
    expert_mask: marks mixture-of-experts leaves, as in ``optax.masked``: a
      pytree of bools with the gradients' structure or a prefix of it, or a
      callable that maps the gradients to one. The state reports each part.
    eps: added to the norm in the denominator; >= 0.
    partition_specs: under ``shard_map``, for a clip anywhere but right
      after :func:`fp16_loss_scale`: the gradients' ``PartitionSpec``
      pytree. Right after it, the clip uses ``fp16_loss_scale``'s, and
      :func:`chain` refuses a second value.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (extra arguments are
    ignored) whose state is a :class:`ClipState`.

  Raises:
    ValueError: ``max_norm`` not positive, ``eps`` negative.
    TypeError: an ``expert_mask`` leaf that is not a Python bool.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(64.0)),
    ...     fs.clip_by_unscaled_norm(1.0))
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> grads = jnp.array([3.0, 4.0]) * 64.0  # true norm 5, made at scale 64
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates.round(6))  # norm 5 clipped to 1
    [0.6 0.8]
  """
  max_norm = _validate.positive("max_norm", max_norm)
  eps = _validate.non_negative("eps", eps)
  config = ClipConfig(
    max_norm=max_norm,
    expert_mask=expert_mask,
    eps=eps,
    partition_specs=partition_specs,
  )
  if expert_mask is not None and not callable(expert_mask):
    _measure.mask_leaves(expert_mask)
  return UnscaledClip(config.init, config.update)
