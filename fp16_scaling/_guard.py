"""Trace-time context that :func:`skip_on_overflow` opens around its inner
chain.

It exists only while the inner ``init`` or ``update`` is being called
(traced, under jit), never in the compiled step. It serves three purposes:

* ``fp16_loss_scale`` refuses to run outside it, so that an unguarded chain,
  whose optimizer would move the parameters with its momentum on an overflow
  step, fails loudly at ``init`` instead of silently;
* it checks the order of the chain when the update is traced:
  ``skip_on_overflow`` records the gradients it received, and
  ``fp16_loss_scale`` must receive exactly those arrays (nothing before it
  changed them) and run once; ``clip_by_unscaled_norm`` must come after it;
* it carries the one norm pass from ``fp16_loss_scale`` to
  ``clip_by_unscaled_norm``. optax's chain hands each element only the
  previous one's updates, so ``fp16_loss_scale`` publishes here the
  :class:`~fp16_scaling._norm.NormPass` it made, together with the very
  arrays it returned (:meth:`Guard.publish`). The clip asks for the pass
  over the arrays it was given (:meth:`Guard.published_pass`): it gets one
  only when they are those arrays, object for object, so the sums it reduces
  are always of what it clips. A transformation in between (``optax.scale``,
  ``add_decayed_weights``) returns new arrays; the clip then finds nothing
  and measures them itself: never wrong, one more read of the gradients.
"""

import contextlib
import contextvars
from typing import Optional, Sequence

import jax

from fp16_scaling._norm import NormPass

_FIX = (
  "The order is skip_on_overflow(optax.chain(fp16_loss_scale(...), "
  "clip_by_unscaled_norm(...), optimizer))."
)
_TWICE = (
  "The chain inside skip_on_overflow runs fp16_loss_scale more than once: "
  "the second would unscale gradients that are already unscaled and step a "
  "second scale. Keep exactly one fp16_loss_scale, first in the chain. " + _FIX
)
_NOT_FIRST = (
  "fp16_loss_scale received gradients that a transformation before it in the "
  "chain had already changed (an optimizer or a clip placed first): it must "
  "see the raw scaled gradients to detect overflow and divide by the scale "
  "they were made with. Move fp16_loss_scale to the front. " + _FIX
)
_CLIP_FIRST = (
  "clip_by_unscaled_norm ran before fp16_loss_scale: it would clip by the "
  "norm of the gradients still multiplied by the loss scale. Put it right "
  "after fp16_loss_scale. " + _FIX
)


class Guard:
  """Per-call scratch space; see module docstring."""

  def __init__(self):
    self._passes = []
    self._received = None
    self.loss_scale_ran = False

  def receive(self, leaves: Sequence[jax.Array]) -> None:
    """Records the gradients ``skip_on_overflow`` was given."""
    self._received = tuple(leaves)

  def check_loss_scale_input(self, leaves: Sequence[jax.Array]) -> None:
    """Raises unless ``fp16_loss_scale`` runs once, on the raw gradients."""
    if self.loss_scale_ran:
      raise ValueError(_TWICE)
    self.loss_scale_ran = True
    received = self._received
    if received is not None and (
      len(received) != len(leaves)
      or any(a is not b for a, b in zip(received, leaves))
    ):
      raise ValueError(_NOT_FIRST)

  def check_clip_order(self) -> None:
    """Raises if the clip runs before ``fp16_loss_scale``."""
    if not self.loss_scale_ran:
      raise ValueError(_CLIP_FIRST)

  def publish(self, norm_pass: NormPass) -> None:
    """Offers ``norm_pass`` to whoever receives ``norm_pass.leaves``."""
    self._passes.append(norm_pass)

  def published_pass(self, leaves: Sequence[jax.Array]) -> Optional[NormPass]:
    """The published pass over exactly ``leaves`` (the same objects), or
    None."""
    for norm_pass in self._passes:
      if len(norm_pass.leaves) == len(leaves) and all(
        a is b for a, b in zip(norm_pass.leaves, leaves)
      ):
        return norm_pass
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
