"""The state of :func:`accumulate_gradients`, apart so that ``_lookup`` can
find it without importing the transformation."""

from typing import Any, NamedTuple

import jax


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: int32, microbatches of the current window accumulated so far
      (0 right after a window ended).
    windows: int32, windows ended so far: optimizer steps taken or skipped.
    acc_grads: float32 pytree of the params' structure: the sum of the
      current window's microbatch gradients, each divided by the window's
      length (the clean ones only, under ``"drop_microbatch"``).
    clean_in_window: int32, microbatches of the current window that were
      accumulated (all of them under ``"skip_step"``).
    inner_state: the state of the wrapped guarded chain.
    microbatches: int32 total of microbatches seen.
    applied_steps: int32 total of windows whose optimizer step was applied.
    dropped_microbatches: int32 total of microbatches left out of a mean for
      an inf or NaN (``"drop_microbatch"`` only; 0 otherwise).
    window_ended: bool, whether the last call ended a window (ran the inner
      chain once on the window's mean).
    loss_sum: float32, the sum of the current window's losses passed as
      ``value=``, each divided by the window's length (the accumulated
      microbatches only, as ``acc_grads``); 0.0 without ``value=``.
    loss_nonfinite: bool, whether any microbatch of the current window,
      dropped ones included, was passed a ``value=`` that is not finite.
  """

  mini_step: jax.Array
  windows: jax.Array
  acc_grads: Any
  clean_in_window: jax.Array
  inner_state: Any
  microbatches: jax.Array
  applied_steps: jax.Array
  dropped_microbatches: jax.Array
  window_ended: jax.Array
  loss_sum: jax.Array
  loss_nonfinite: jax.Array
