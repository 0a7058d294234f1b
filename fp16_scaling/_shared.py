"""One loss scale for several optimizers, with ``torch.amp.GradScaler``'s
semantics: each optimizer keeps, measures and skips on its own scale, and
``sync_loss_scales`` sets all of them to the one scale their overflows
decide together (docs/design.md, "One scale for several optimizers").
"""

from typing import Any

import jax
import jax.numpy as jnp

from fp16_scaling import _lookup


def _member(opt_state: Any, i: int):
  """The loss-scale state of the ``i``-th optimizer state to sync."""
  what = f"sync_loss_scales' optimizer state {i}"
  if _lookup.accumulation_state(opt_state) is not None:
    raise ValueError(
      f"{what} is under accumulate_gradients, which is not supported: "
      "between windows its state reports the last window's overflow"
    )
  return _lookup.loss_scale_state(opt_state, what)


def sync_loss_scales(*opt_states: Any) -> tuple:
  """Sets the loss scales of several optimizers to one, as torch's one
  ``GradScaler`` for several optimizers steps once from all of them.

  Call it once every optimizer has stepped (``tx.update``). Each optimizer
  stepped its own scale on its own overflow; all of them are then set to
  the scale state of an optimizer that overflowed, the one with the lowest
  scale (the first of those), or when none did to the lowest scale of all.
  From equal states before the step (every step but the first, when each
  step ends with this call) that is ``Scaler.update(before, any overflow,
  largest gradient)``, torch's rule, for every preset: the overflowed ones
  all backed off alike, and a headroom scale falls with the largest
  gradient (with ``history``, its window keeps the largest). From unequal
  states (a call was left out) it is the most cautious of them, and from
  then on they are equal again.

  Calling it twice changes nothing: it reads each state's own record of
  the last step (its overflow flag and its scale after it). Leaving it out
  leaves every optimizer with its own scale, which still trains.

  Args:
    *opt_states: the optimizer states ``tx.update`` returned, at least one,
      each holding one :class:`LossScaleState` (at any depth), built with
      one and the same :class:`Scaler`.

  Returns:
    The states, in order, each with the one scale state (traceable: a few
    scalar selects, no host work).

  Raises:
    ValueError: no state, a state without a loss-scale state or under
      :func:`accumulate_gradients`, or states built with other scalers.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> make = lambda: fs.chain(
    ...     fs.fp16_loss_scale(fs.torch_scaler(init_scale=8.0)),
    ...     optax.sgd(1.0))
    >>> tx_a, tx_b = make(), make()
    >>> p = jnp.ones(2)
    >>> sa, sb = tx_a.init(p), tx_b.init(p)
    >>> ua, sa = tx_a.update(jnp.array([8.0, jnp.inf]), sa, p)
    >>> ub, sb = tx_b.update(jnp.array([8.0, 16.0]), sb, p)
    >>> print(ua, ub)  # a skips its step alone
    [-0. -0.] [-1. -2.]
    >>> sa, sb = fs.sync_loss_scales(sa, sb)
    >>> print(fs.current_scale(sa), fs.current_scale(sb))  # backed off once
    4.0 4.0
  """
  if not opt_states:
    raise ValueError("sync_loss_scales needs the optimizer states it syncs")
  found = [_member(s, i) for i, s in enumerate(opt_states)]
  for i, ls in enumerate(found[1:], 1):
    if ls.leaf_paths.scaler != found[0].leaf_paths.scaler:
      raise ValueError(
        f"sync_loss_scales: optimizer state {i} was built with another "
        f"Scaler than state 0 ({ls.leaf_paths.scaler} against "
        f"{found[0].leaf_paths.scaler}): one scale follows one scaler's "
        "rules. Build every optimizer that shares it with the same Scaler"
      )
  overflow, scaler = found[0].overflow, found[0].scaler
  for ls in found[1:]:
    lower = ls.scaler.loss_scale < scaler.loss_scale
    first = (ls.overflow & ~overflow) | ((ls.overflow == overflow) & lower)
    pick = lambda a, b: jnp.where(first, a, b)  # noqa: B023
    scaler = jax.tree.map(pick, ls.scaler, scaler)
    overflow = overflow | ls.overflow
  if scaler.grad_max_history is not None:
    # headroom_scaler(history=W): on a clean step each state wrote its own
    # largest |g| into the same slot; the shared window keeps the largest,
    # as one scaler seeing every gradient would. On an overflow the picked
    # state's window is the one from before the step.
    rings = jnp.stack([ls.scaler.grad_max_history for ls in found])
    scaler = scaler._replace(
      grad_max_history=jnp.where(
        overflow[..., None], scaler.grad_max_history, jnp.max(rings, axis=0)
      )
    )
  return tuple(
    _lookup.replace_loss_scale_state(s, ls._replace(scaler=scaler))
    for s, ls in zip(opt_states, found)
  )
