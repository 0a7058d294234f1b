"""One loss scale for several optimizers, with ``torch.amp.GradScaler``'s
semantics: each optimizer skips on its own gradients, and the scale, a value
the caller holds, steps once from all their overflows (docs/design.md, "One
scale for several optimizers").
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from fp16_scaling import _lookup
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import ScalerState


@dataclasses.dataclass(frozen=True)
class SharedLossScale:
  """A loss scale shared by several optimizers; see :func:`shared_loss_scale`.

  Attributes:
    scaler: the :class:`Scaler` whose rules the shared scale follows.
  """

  scaler: Scaler

  def init(self) -> ScalerState:
    """The shared scale's first state."""
    return self.scaler.init()

  def update(self, scale_state: ScalerState, *opt_states: Any) -> ScalerState:
    """Steps the shared scale once, after every optimizer has stepped.

    Args:
      scale_state: the state every ``tx.update`` was given as ``loss_scale=``.
      *opt_states: the optimizer states those updates returned.

    Returns:
      The next :class:`ScalerState`: backed off once if any optimizer's
      gradients overflowed, else one clean step counted.

    Raises:
      ValueError: a state not built with this shared scale, or accumulating.
    """
    if not opt_states:
      raise ValueError("shared.update needs the optimizer states it steps")
    found = [self._member(s) for s in opt_states]
    overflow = jnp.any(jnp.stack([ls.overflow for ls in found]))
    grad_max = None
    if self.scaler.needs_grad_max:
      grad_max = jnp.max(
        jnp.stack([jnp.max(ls.grad_range.max_abs, initial=0.0) for ls in found])
      )
    return self.scaler.update(scale_state, overflow, grad_max)

  def _member(self, opt_state: Any):
    """The loss-scale state of one optimizer sharing this scale."""
    ls = _lookup.loss_scale_state(opt_state)
    paths = ls.leaf_paths
    if not paths.shared or paths.scaler != self.scaler:
      raise ValueError(
        "shared.update: an optimizer state was not built with this shared "
        "scale; build every optimizer that shares it with "
        "fs.fp16_loss_scale(shared)"
      )
    if _lookup.accumulation_state(opt_state) is not None:
      raise ValueError(
        "shared.update: a shared scale under accumulate_gradients is not "
        "supported: its optimizer states report the last window's overflow "
        "between windows"
      )
    return ls


def shared_loss_scale(scaler: Scaler) -> SharedLossScale:
  """One loss scale for several optimizers (GANs, actor-critic).

  Args:
    scaler: a :class:`Scaler` from a preset.

  Returns:
    A :class:`SharedLossScale`, to build each optimizer with
    ``fp16_loss_scale(shared)`` and step once with ``shared.update``.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> shared = fs.shared_loss_scale(fs.torch_scaler(init_scale=8.0))
    >>> def make():
    ...   return fs.skip_on_overflow(optax.chain(
    ...       fs.fp16_loss_scale(shared), optax.sgd(1.0)))
    >>> tx_a, tx_b = make(), make()
    >>> p = jnp.ones(2)
    >>> sa, sb, scale = tx_a.init(p), tx_b.init(p), shared.init()
    >>> ua, sa = tx_a.update(jnp.array([8.0, jnp.inf]), sa, p, loss_scale=scale)
    >>> ub, sb = tx_b.update(jnp.array([8.0, 16.0]), sb, p, loss_scale=scale)
    >>> print(ua, ub)  # a skips its step alone
    [-0. -0.] [-1. -2.]
    >>> print(float(shared.update(scale, sa, sb).loss_scale))  # backs off once
    4.0
  """
  if not isinstance(scaler, Scaler):
    raise TypeError(
      f"shared_loss_scale takes a Scaler from a preset such as "
      f"fs.torch_scaler(), got {type(scaler).__name__}"
    )
  return SharedLossScale(scaler)
