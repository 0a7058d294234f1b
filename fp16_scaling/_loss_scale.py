"""``fp16_loss_scale``: detect overflow, unscale, and step the loss scale.

The state keeps the scale the current gradients were made with
(``prev_loss_scale`` after the update) apart from the scale for the next
backward pass (``loss_scale``). Unscaling always divides by the former; a
growth or back-off decided on this step changes only the latter. DeepSpeed's
fp16 optimizers (0.19) update the scale before unscaling and so apply half
the gradient on every growth step; here that ordering cannot be written.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _guard
from fp16_scaling import _norm
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import ScalerState


class LossScaleState(NamedTuple):
  """State of :func:`fp16_loss_scale`.

  Attributes:
    scaler: the loss-scale machine's state; ``scaler.loss_scale`` is the scale
      for the next backward pass (also available as ``.loss_scale``).
    prev_loss_scale: float32 scale the last step's gradients were made with
      and divided by.
    overflow: bool, whether the last step's gradients had an inf or NaN (and
      so were skipped by :func:`skip_on_overflow`).
    skipped_steps: int32 total of overflowing steps so far.
    grad_norm: float32 true (unscaled) global 2-norm of the last step's
      gradients, before clipping; NaN on an overflow step.
  """

  scaler: ScalerState
  prev_loss_scale: jax.Array
  overflow: jax.Array
  skipped_steps: jax.Array
  grad_norm: jax.Array

  @property
  def loss_scale(self) -> jax.Array:
    return self.scaler.loss_scale


_UNGUARDED = (
  "fp16_loss_scale ran outside skip_on_overflow. In a bare optax.chain the "
  "optimizer after it still runs on an overflow step and its momentum moves "
  "the parameters. Wrap the whole chain: skip_on_overflow(optax.chain("
  "fp16_loss_scale(...), clip_by_unscaled_norm(...), optimizer))."
)


def fp16_loss_scale(
  scaler: Scaler, *, partition_specs: Optional[Any] = None
) -> optax.GradientTransformation:
  """Loss scaling for float16 training, as the first element of a chain.

  ``update`` receives the gradients of ``loss * current_scale(opt_state)``.
  In one pass over them it decides overflow (any inf or NaN anywhere) and
  computes the squared norm; it returns the gradients divided by the scale
  they were made with (promoted to at least float32) and steps ``scaler``.
  It must come first in a chain wrapped by :func:`skip_on_overflow`, which
  discards the step when it overflowed: ``init`` raises outside the wrapper,
  and ``update`` raises at trace time when something before it changed the
  gradients or a second ``fp16_loss_scale`` runs.

  Args:
    scaler: a :class:`Scaler` from a preset (``deepspeed_scaler``,
      ``torch_scaler``, ``megatron_scaler``, ``flax_scaler``,
      ``static_scaler``, ``no_scaler``).
    partition_specs: under ``shard_map``, the gradients' ``PartitionSpec``
      pytree (as given to ``shard_map``); each leaf's squared norm is summed
      across the mesh axes it is split over, so overflow and norm are global.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: if ``scaler`` is not a :class:`Scaler`.
    RuntimeError: from ``init`` or ``update`` outside
      :func:`skip_on_overflow`.
    ValueError: when the update is traced, if a transformation before it
      changed the gradients, or a second ``fp16_loss_scale`` runs.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(optax.chain(
    ...     fs.fp16_loss_scale(fs.torch_scaler(init_scale=1024.0)),
    ...     optax.sgd(1.0)))
    >>> params = jnp.array([1.0, 2.0])
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p**2)
    >>> grads = jax.grad(lambda p: loss(p) * fs.current_scale(state))(params)
    >>> print(grads)  # made at scale 1024
    [2048. 4096.]
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates)  # the true gradient, times -1 for sgd(1.0)
    [-2. -4.]

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018; the scale update is the
    one of the peer ``scaler`` mimics.
  """
  if not isinstance(scaler, Scaler):
    raise TypeError(
      f"scaler must be a Scaler from a preset such as deepspeed_scaler(), "
      f"got {type(scaler).__name__}"
    )

  def init_fn(params):
    _norm.check_float_leaves(jax.tree.leaves(params), "fp16_loss_scale params")
    _norm.leaf_axes_from_specs(partition_specs, params, "fp16_loss_scale")
    if _guard.current() is None:
      raise RuntimeError(_UNGUARDED)
    state = scaler.init()
    return LossScaleState(
      scaler=state,
      prev_loss_scale=state.loss_scale,
      overflow=jnp.bool_(False),
      skipped_steps=jnp.zeros([], jnp.int32),
      grad_norm=jnp.zeros([], jnp.float32),
    )

  def update_fn(updates, state, params=None):
    del params
    guard = _guard.current()
    if guard is None:
      raise RuntimeError(_UNGUARDED)
    leaves, treedef = jax.tree.flatten(updates)
    guard.check_loss_scale_input(leaves)
    _norm.check_float_leaves(leaves, "fp16_loss_scale gradients")
    leaf_axes = _norm.leaf_axes_from_specs(
      partition_specs, updates, "fp16_loss_scale"
    )
    scale = state.scaler.loss_scale
    inv_scale = 1.0 / scale
    sums = _norm.leaf_sums(leaves)
    norms = _norm.reduce_norms(sums, leaves, leaf_axes=leaf_axes)
    # Differentiated, an overflow step's gradients are zeros before the
    # multiply: gradients through the discarded step stay finite.
    safe = _norm.discard_if(
      norms.overflow,
      [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in leaves],
    )
    outputs = tuple(x * inv_scale for x in safe)
    guard.record(
      _guard.UnscaledGrads(outputs, tuple(leaves), inv_scale, tuple(sums))
    )
    overflow = norms.overflow
    new_state = LossScaleState(
      scaler=scaler.update(state.scaler, overflow),
      prev_loss_scale=scale,
      overflow=overflow,
      skipped_steps=state.skipped_steps + overflow.astype(jnp.int32),
      grad_norm=norms.norm * inv_scale,
    )
    return jax.tree.unflatten(treedef, outputs), new_state

  return optax.GradientTransformation(init_fn, update_fn)
