"""Reading the loss-scale state out of a nested optax state."""

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _lookup


class MinLossScaleError(RuntimeError):
  """An overflow wanted to lower a loss scale already at its minimum."""


def current_scale(opt_state) -> jax.Array:
  """The float32 scale to multiply the next loss by.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`, at any
      depth (inside ``skip_on_overflow``, ``optax.chain``, ...).

  Returns:
    A float32 scalar array (traceable: use it inside the jitted step).
  """
  return _lookup.loss_scale_state(opt_state).scaler.loss_scale


def scale_metrics(opt_state) -> dict:
  """Loss-scale and norm metrics of the last step, for logging.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState` and at
      most one :class:`ClipState`.

  Returns:
    A dict of scalar arrays: ``loss_scale`` (for the next step),
    ``prev_loss_scale`` (the last step's), ``overflow``, ``skipped_steps``,
    ``grad_norm`` (true, unscaled, before clipping), ``expert_grad_norm`` and
    ``shared_grad_norm`` (from ``clip_by_unscaled_norm``; without one, or
    without an expert mask, every leaf counts as shared).
  """
  ls = _lookup.loss_scale_state(opt_state)
  clip = _lookup.clip_state(opt_state)
  if clip is not None:
    expert, shared = clip.expert_grad_norm, clip.shared_grad_norm
    # On an overflow step the clip state is kept from the last clean step.
    nan = jnp.float32(jnp.nan)
    expert = jnp.where(ls.overflow, nan, expert)
    shared = jnp.where(ls.overflow, nan, shared)
  else:
    expert, shared = jnp.zeros_like(ls.grad_norm), ls.grad_norm
  return {
    "loss_scale": ls.scaler.loss_scale,
    "prev_loss_scale": ls.prev_loss_scale,
    "overflow": ls.overflow,
    "skipped_steps": ls.skipped_steps,
    "grad_norm": ls.grad_norm,
    "expert_grad_norm": expert,
    "shared_grad_norm": shared,
  }


def raise_if_min_scale_reached(opt_state) -> None:
  """Host-side check: raises where DeepSpeed's ``raise_error_at_min_scale``
  would.

  DeepSpeed raises inside its step when an overflow would lower a scale that
  already equals ``min_scale``. A jitted step cannot raise, so the state
  counts those overflows; call this on the host (for instance every N steps,
  or when logging) to fail the run the same way.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.

  Raises:
    MinLossScaleError: if any overflow hit the floor with
      ``raise_error_at_min_scale=True``.
  """
  ls = _lookup.loss_scale_state(opt_state)
  # Summed, so that a batched (vmapped) state raises if any member would.
  errors = int(np.sum(jax.device_get(ls.scaler.min_scale_errors)))
  if errors:
    raise MinLossScaleError(
      f"Current loss scale already at minimum "
      f"({float(np.min(jax.device_get(ls.scaler.loss_scale)))}) - cannot "
      f"decrease scale anymore: {errors} overflowing step(s) hit the floor "
      f"(DeepSpeed raises here; raise_error_at_min_scale=True)."
    )
