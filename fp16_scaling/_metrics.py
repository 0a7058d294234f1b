"""Reading the loss-scale state out of a nested optax state."""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _diagnostics
from fp16_scaling import _lookup
from fp16_scaling import _validate


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

  Every value is finite on an overflow step (``jax_debug_nans`` stays
  quiet): no norm exists for a group that held an inf or NaN, and its norm
  is reported as 0.0 with ``overflow`` set. A group that stayed finite
  reports its true norm even on an overflow step.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState` and at
      most one :class:`ClipState`.

  Returns:
    A dict of scalar arrays: ``loss_scale`` (for the next step),
    ``prev_loss_scale`` (the last step's), ``overflow``, ``skipped_steps``,
    ``floor_overflows`` (overflows with the scale at its floor, every
    preset), ``overflow_kind`` (int code, ``fp16_scaling.OVERFLOW_KINDS``),
    ``nonfinite_leaves`` (how many gradient leaves overflowed on the last
    step), ``grad_norm`` (true, unscaled, before clipping; 0.0 on overflow),
    ``expert_grad_norm`` and ``shared_grad_norm`` (from
    ``clip_by_unscaled_norm``; without one, or without an expert mask, every
    leaf counts as shared). With ``grad_range=True`` also ``grad_max_abs``
    (largest finite unscaled ``|g|``), ``min_headroom_bits`` (least
    ``log2(65504 / (max|g| * prev_loss_scale))`` over the leaves; +inf for
    all-zero gradients) and ``zero_fraction`` (of all gradient elements).
  """
  ls = _lookup.loss_scale_state(opt_state)
  clip = _lookup.clip_state(opt_state)
  if clip is not None:
    expert, shared = clip.expert_grad_norm, clip.shared_grad_norm
  else:
    expert, shared = jnp.zeros([], jnp.float32), ls.grad_norm
  out = {
    "loss_scale": ls.scaler.loss_scale,
    "prev_loss_scale": ls.prev_loss_scale,
    "overflow": ls.overflow,
    "skipped_steps": ls.skipped_steps,
    "floor_overflows": ls.scaler.floor_overflows,
    "overflow_kind": ls.overflow_kind,
    "nonfinite_leaves": jnp.sum(ls.leaf_nonfinite, dtype=jnp.int32),
    "grad_norm": ls.grad_norm,
    "expert_grad_norm": expert,
    "shared_grad_norm": shared,
  }
  if ls.grad_range is not None:
    max_abs = ls.grad_range.max_abs
    sizes = jnp.asarray(ls.leaf_paths.sizes, jnp.float32)
    out["grad_max_abs"] = jnp.max(max_abs, initial=0.0)
    out["min_headroom_bits"] = jnp.min(
      _diagnostics.headroom_bits(max_abs, ls.prev_loss_scale), initial=jnp.inf
    )
    out["zero_fraction"] = jnp.sum(
      ls.grad_range.zero_fraction * sizes
    ) / jnp.maximum(jnp.sum(sizes), 1.0)
  return out


def raise_if_min_scale_reached(
  opt_state, *, max_floor_overflows: Optional[int] = None
) -> None:
  """Host-side check: raises where DeepSpeed's ``raise_error_at_min_scale``
  would, or for any preset once its scale keeps overflowing at its floor.

  DeepSpeed raises inside its step when an overflow would lower a scale that
  already equals ``min_scale``. A jitted step cannot raise, so the state
  counts those overflows; call this on the host (for instance every N steps,
  or when logging) to fail the run the same way. The message names the
  gradient leaves that overflowed most often and the kind of the last
  overflow (see :func:`overflow_report`).

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    max_floor_overflows: if set (an integer >= 1), also raise once this many
      overflows hit the floor, whatever the preset: torch, Megatron and Flax
      never raise there themselves.

  Raises:
    MinLossScaleError: if any overflow hit the floor with
      ``raise_error_at_min_scale=True``, or ``max_floor_overflows`` of them
      did.
  """
  if max_floor_overflows is not None:
    max_floor_overflows = _validate.count(
      "max_floor_overflows", max_floor_overflows
    )
  ls = _lookup.loss_scale_state(opt_state)
  errors = int(np.asarray(jax.device_get(ls.scaler.min_scale_errors)))
  at_floor = int(np.asarray(jax.device_get(ls.scaler.floor_overflows)))
  if errors:
    why = (
      f"{errors} overflowing step(s) hit the floor (DeepSpeed raises here; "
      "raise_error_at_min_scale=True)"
    )
  elif max_floor_overflows is not None and at_floor >= max_floor_overflows:
    why = (
      f"{at_floor} overflowing step(s) hit the floor "
      f"(max_floor_overflows={max_floor_overflows})"
    )
  else:
    return
  report = _diagnostics.overflow_report(opt_state, top=5)
  raise MinLossScaleError(
    f"Current loss scale already at minimum "
    f"({float(jax.device_get(ls.scaler.loss_scale))}) - cannot decrease "
    f"scale anymore: {why}. Last overflow: {report.kind}. Leaves that kept "
    f"overflowing: {report.top_leaves_text()}. {report.advice()}"
  )
