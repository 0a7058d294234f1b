"""Reading the loss-scale state inside a step: ``current_scale`` and
``scale_metrics`` are traceable (the host-side reports are ``_diagnostics``).
"""

import contextlib
import threading
from typing import Iterator, TypedDict

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _lookup
from fp16_scaling import _stacked
from fp16_scaling._scaler import F16_MAX


class ScaleMetrics(TypedDict, total=False):
  """What :func:`scale_metrics` returns: scalar arrays (more keys may come).

  Attributes:
    loss_scale: the scale for the next backward pass.
    prev_loss_scale: the scale the last step's gradients were made with.
    overflow: bool, whether the last step overflowed (and was skipped).
    skipped_steps: int32 count of overflowing steps so far.
    consecutive_skipped_steps: int32 overflowing steps in a row, up to the
      last one (0 after a clean step).
    grad_norm: true (unscaled) global norm before clipping; 0.0 on overflow.
    expert_grad_norm: the expert leaves' part of ``grad_norm``.
    shared_grad_norm: the other leaves' part of ``grad_norm``.
    floor_overflows: int32 overflows with the scale at its floor.
    overflow_kind: int32 code into ``fp16_scaling.OVERFLOW_KINDS``.
    nonfinite_leaves: int32 gradient leaves that overflowed on the last step.
    nonfinite_layers: int32 layers (``stacked_axes``) whose gradient in any
      stacked leaf overflowed on the last step.
    grad_max_abs: largest finite unscaled ``|g|`` (``grad_range=True``).
    min_headroom_bits: least headroom below float16's maximum, in bits.
    zero_fraction: the fraction of zero elements (``grad_range=True``).
    microbatches: int32 microbatches so far (:func:`accumulate_gradients`).
    applied_steps: int32 windows whose step was applied.
    dropped_microbatches: int32 microbatches dropped.
    window_ended: bool, whether this call ended a window.
    suspect_unscaled_grads: bool, the scale reached ``UNMET_SCALE`` (2^24)
      with no overflow since the state was built, on gradients that were
      not all zero: float16 gradients made at that scale overflow from
      ``|g|`` of 2^-8 up, so the likely cause is gradients not made at the
      scale (the loss not multiplied by it: use :func:`value_and_grad`), or
      gradients that are not float16 (a float32 model needs no loss scale:
      :func:`no_scaler`). Read from the state's counters: no cost in the
      step.
  """

  loss_scale: jax.Array
  prev_loss_scale: jax.Array
  overflow: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array
  grad_norm: jax.Array
  expert_grad_norm: jax.Array
  shared_grad_norm: jax.Array
  floor_overflows: jax.Array
  overflow_kind: jax.Array
  nonfinite_leaves: jax.Array
  nonfinite_layers: jax.Array
  grad_max_abs: jax.Array
  min_headroom_bits: jax.Array
  zero_fraction: jax.Array
  microbatches: jax.Array
  applied_steps: jax.Array
  dropped_microbatches: jax.Array
  window_ended: jax.Array
  suspect_unscaled_grads: jax.Array


# A scale 2^8 above float16's range (65504 is about 2^16): float16
# gradients made at it overflow from |g| of 2^-8 up, so a dynamic scaler
# that reaches it with no overflow at all did not meet float16's range.
UNMET_SCALE = 2.0**24


def suspect_unscaled_grads(ls) -> jax.Array:
  """Whether the :class:`LossScaleState` ``ls`` reached ``UNMET_SCALE``
  with no overflow since it was built, after a step with nonzero
  gradients (``ScaleMetrics.suspect_unscaled_grads``); traceable."""
  scale = ls.scaler.loss_scale
  clean = (ls.skipped_steps == 0) & (ls.grad_norm > 0)
  return clean & (scale >= UNMET_SCALE)


# A per-call guard, not a table: the scales fs.value_and_grad multiplies by
# while the fun it differentiates runs, set and reset by
# differentiating_at within that one call, per thread (see its docstring).
_IN_FUN = threading.local()

_TWICE = (
  "fs.current_scale: read inside the fun that fs.value_and_grad "
  "differentiates with this state's scale. fs.value_and_grad multiplies "
  "fun's loss by the scale itself: a loss multiplied here is scaled twice "
  "(the update comes out S times too large, and the gradients overflow S "
  "times sooner). Return the unscaled loss from fun; to log the scale, "
  "read fs.current_scale(opt_state) outside it."
)


@contextlib.contextmanager
def differentiating_at(scale: jax.Array) -> Iterator[None]:
  """While ``fs.value_and_grad`` runs the ``fun`` it differentiates at
  ``scale``: :func:`current_scale` of the state that ``scale`` came from,
  read inside that ``fun``, raises (the loss would be scaled twice).

  Why a guard: the slip is a read inside one call, which no value, type or
  tree structure of the state can show. The guard is set on entry and
  reset on exit of that call (nested calls stack), per thread, so nothing
  outlives the call and two threads never see each other's; it holds the
  scale object itself (an array, or the tracer of this trace), which is
  the one ``current_scale`` reads from the same state eagerly and under
  ``jit`` alike.
  """
  outer = getattr(_IN_FUN, "scales", ())
  _IN_FUN.scales = outer + (scale,)
  try:
    yield
  finally:
    _IN_FUN.scales = outer


def current_scale(opt_state: optax.OptState) -> jax.Array:
  """The float32 scale to multiply the next loss by.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`, at any
      depth.

  Returns:
    A float32 scalar array (traceable).

  Raises:
    ValueError: called inside the ``fun`` that :func:`value_and_grad`
      differentiates at this state's scale (it multiplies by it itself).

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.torch_scaler()), optax.sgd(0.1))
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> print(fs.current_scale(state))  # multiply the next loss by this
    65536.0
  """
  scale = _lookup.scaler_state(opt_state).loss_scale
  if any(scale is s for s in getattr(_IN_FUN, "scales", ())):
    raise ValueError(_TWICE)
  return scale


def scale_metrics(opt_state: optax.OptState) -> ScaleMetrics:
  """Loss-scale and norm metrics of the last step, for logging.

  Every value is finite: a norm over an inf or NaN is reported as 0.0.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState` and at
      most one :class:`ClipState`.

  Returns:
    A :class:`ScaleMetrics` dict of scalar arrays. Under
    :func:`accumulate_gradients` the step is the window; between windows
    ``overflow`` is False and ``prev_loss_scale`` is ``loss_scale``.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(8.0)),
    ...     fs.clip_by_unscaled_norm(1.0), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([0.6, 0.8]) * 8.0}  # made at scale 8
    >>> _, state = tx.update(grads, state, params)
    >>> m = fs.scale_metrics(state)
    >>> print(float(m["grad_norm"]), bool(m["overflow"]))
    1.0 False
  """
  ls = _lookup.loss_scale_state(opt_state)
  acc = _lookup.accumulation_state(opt_state)
  clip = _lookup.clip_state(opt_state)
  if clip is not None:
    expert, shared = clip.expert_grad_norm, clip.shared_grad_norm
  else:
    expert, shared = jnp.zeros_like(ls.grad_norm), ls.grad_norm
  scale = ls.scaler.loss_scale
  metrics = {
    "loss_scale": scale,
    "prev_loss_scale": ls.prev_loss_scale,
    "overflow": ls.overflow,
    "skipped_steps": ls.skipped_steps,
    "consecutive_skipped_steps": ls.consecutive_skipped_steps,
    "floor_overflows": ls.scaler.floor_overflows,
    "overflow_kind": ls.overflow_kind,
    # Per-leaf vectors hold the leaves on their last axis (a batched state
    # has its batch axes in front).
    "nonfinite_leaves": jnp.sum(ls.leaf_nonfinite, axis=-1, dtype=jnp.int32),
    "grad_norm": ls.grad_norm,
    "expert_grad_norm": expert,
    "shared_grad_norm": shared,
    "suspect_unscaled_grads": suspect_unscaled_grads(ls),
  }
  if ls.leaf_paths.layers is not None:
    leaves, layers = _stacked.count_nonfinite(ls.leaf_nonfinite, ls.leaf_paths)
    metrics.update(nonfinite_leaves=leaves, nonfinite_layers=layers)
  if ls.grad_range is not None:
    max_abs = ls.grad_range.max_abs
    sizes = jnp.asarray(ls.leaf_paths.sizes, jnp.float32)
    metrics["grad_max_abs"] = jnp.max(max_abs, axis=-1, initial=0.0)
    bits = headroom_bits(max_abs, ls.prev_loss_scale[..., None])
    metrics["min_headroom_bits"] = jnp.min(bits, axis=-1, initial=jnp.inf)
    zeros = jnp.sum(ls.grad_range.zero_fraction * sizes, axis=-1)
    metrics["zero_fraction"] = zeros / jnp.maximum(jnp.sum(sizes), 1.0)
  if acc is not None:
    ended = acc.window_ended
    metrics.update(
      # Between windows the last window's flag is not news.
      overflow=ls.overflow & ended,
      prev_loss_scale=jnp.where(ended, ls.prev_loss_scale, scale),
      microbatches=acc.microbatches,
      applied_steps=acc.applied_steps,
      dropped_microbatches=acc.dropped_microbatches,
      window_ended=ended,
    )
  return metrics


def headroom_bits(max_abs, scale):
  """``log2(65504 / (max_abs * scale))`` in float32: how many doublings of
  ``scale`` the largest gradient could still take; +inf where it is 0."""
  top = jnp.asarray(max_abs, jnp.float32) * jnp.asarray(scale, jnp.float32)
  safe = jnp.where(top > 0, top, 1.0)
  return jnp.where(top > 0, jnp.log2(jnp.float32(F16_MAX) / safe), jnp.inf)


def layer_grad_norms(opt_state: optax.OptState) -> dict:
  """Each stacked leaf's true (unscaled) gradient norm per layer, last step.

  Args:
    opt_state: an optax state whose :func:`fp16_loss_scale` was built with
      ``stacked_axes`` and ``grad_range=True``.

  Returns:
    ``{path: float32 [L] array}`` per stacked leaf (traceable; batch axes of
    a batched state first); 0.0 for a layer that held an inf or NaN.

  Raises:
    ValueError: the state was built without ``stacked_axes`` or
      ``grad_range=True``.
  """
  ls = _lookup.loss_scale_state(opt_state)
  norms = getattr(ls.grad_range, "unit_norm", None)
  if norms is None:
    raise ValueError(
      "layer_grad_norms: build fp16_loss_scale with stacked_axes= and "
      "grad_range=True to record each layer's norm (docs/stacked.md)"
    )
  return _stacked.per_leaf(norms, ls.leaf_paths)
