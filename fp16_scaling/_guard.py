"""Trace-time context that :func:`skip_on_overflow` opens around its inner
chain.

It exists only while the inner ``update`` is being called (traced, under
jit), never in the compiled step. It serves two purposes:

* ``fp16_loss_scale`` refuses to run outside it, so that an unguarded chain,
  whose optimizer would move the parameters with its momentum on an overflow
  step, fails loudly at trace time instead of silently;
* ``fp16_loss_scale`` leaves in it the per-leaf sums of squares it computed,
  keyed by the exact unscaled arrays it returned. When
  ``clip_by_unscaled_norm`` receives those very arrays it reuses the sums and
  folds unscale and clip into one multiply, so a step reads the gradients once
  for the norm. Anything else in between produces new arrays, the lookup
  misses and the clip computes its own norm: never wrong, only slower.
"""

import contextlib
import contextvars
from typing import NamedTuple, Optional, Sequence

import jax


class UnscaledGrads(NamedTuple):
  """What ``fp16_loss_scale`` computed, for the clip that follows it."""

  outputs: tuple  # the unscaled leaves it returned (matched by identity)
  scaled: tuple  # the gradients it was given, scaled by the loss scale
  inv_scale: jax.Array
  sums: tuple  # per-leaf local sums of squares of ``scaled``


class Guard:
  """Per-call scratch space; see module docstring."""

  def __init__(self):
    self._unscaled = []

  def record(self, entry: UnscaledGrads) -> None:
    self._unscaled.append(entry)

  def lookup(self, leaves: Sequence[jax.Array]) -> Optional[UnscaledGrads]:
    for entry in self._unscaled:
      if len(entry.outputs) == len(leaves) and all(
        a is b for a, b in zip(entry.outputs, leaves)
      ):
        return entry
    return None


_CURRENT: contextvars.ContextVar = contextvars.ContextVar(
  "fp16_scaling_guard", default=None
)


@contextlib.contextmanager
def guarded():
  token = _CURRENT.set(Guard())
  try:
    yield _CURRENT.get()
  finally:
    _CURRENT.reset(token)


def current() -> Optional[Guard]:
  return _CURRENT.get()
