"""One loss scale for several optimizers, with ``torch.amp.GradScaler``'s
semantics: each optimizer keeps, measures and skips on its own scale, and
``sync_loss_scales`` sets all of them to the one scale their overflows
decide together (docs/design.md, "One scale for several optimizers").
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from fp16_scaling import _lookup
from fp16_scaling import _provenance
from fp16_scaling._states import LossScaleState


def _member(opt_state: Any, i: int) -> LossScaleState:
  """The loss-scale state of the ``i``-th optimizer state to sync."""
  what = f"sync_loss_scales' optimizer state {i}"
  if _lookup.is_nnx_optimizer(opt_state):
    opt_state = opt_state.opt_state
  if _lookup.accumulation_state(opt_state) is not None:
    raise ValueError(
      f"{what} is under accumulate_gradients, which is not supported: "
      "between windows its state reports the last window's overflow"
    )
  ls = _lookup.loss_scale_state(opt_state, what)
  made = _provenance.made(ls)
  if made.consumed or made.stepped is False:
    why = (
      "was given to tx.update, which returned the state that follows it"
      if made.consumed
      else "has not stepped since tx.init or the last sync_loss_scales"
    )
    raise ValueError(
      f"sync_loss_scales: optimizer state {i} {why}: these are the states "
      "from before tx.update, and keeping their sync would freeze the "
      "scale and drop the step's skips. Sync the states tx.update "
      "returned, once per step: _, s0 = tx0.update(g0, s0, p0); _, s1 = "
      "tx1.update(g1, s1, p1); s0, s1 = fs.sync_loss_scales(s0, s1)"
    )
  return ls


def _set_in_place(opt: Any, new: LossScaleState) -> None:
  """Writes ``new``'s arrays into the Variables of ``opt``'s (an
  ``nnx.Optimizer``) loss-scale state, as NNX updates act in place."""
  held = _lookup.all_with_path(opt.opt_state, LossScaleState)[0][1]
  old = jax.tree.leaves(held, is_leaf=_lookup.is_nnx_variable)
  for var, value in zip(old, jax.tree.leaves(new), strict=True):
    if _lookup.is_nnx_variable(var):
      var.set_value(value)
    elif var is not value:
      raise TypeError(
        "sync_loss_scales: this nnx.Optimizer keeps its loss-scale state's "
        f"arrays outside nnx Variables ({type(var).__name__}), so it cannot "
        "be synced in place; pass opt.opt_state and assign the result back"
      )


def _check_scales_set(made: list) -> None:
  """Raises when the scale of some states was set since their last sync
  and that of others was not (``made``: their :class:`Made` records, in
  order): the sync would undo it."""
  marks = [m.scale_set for m in made]
  if True in marks and False in marks:
    i, j = marks.index(True), marks.index(False)
    raise ValueError(
      f"sync_loss_scales: the scale of optimizer state {i} was set "
      "(fs.set_loss_scale or fs.load_scaler_state_dict) since tx.init or "
      f"the last sync_loss_scales, and that of state {j} was not: the sync "
      "keeps the most cautious of their scales, and would undo the one "
      "set. Set it into every state that shares the scale, e.g. s0, s1 = "
      "(fs.load_scaler_state_dict(s, state_dict, scaler) for s in (s0, s1))"
    )


def sync_loss_scales(*opt_states: Any) -> tuple:
  """Sets the loss scales of several optimizers to one, as torch's one
  ``GradScaler`` for several optimizers steps once from all of them.

  Call it once every optimizer has stepped (``tx.update``), on the states
  ``tx.update`` returned, and keep what it returns. Each optimizer stepped
  its own scale on its own overflow; all of them are then set to the scale
  state of an optimizer that overflowed, the one with the lowest scale
  (the first of those), or when none did to the lowest scale of all. From
  equal states before the step (every step but the first, when each step
  ends with this call) that is ``Scaler.update(before, any overflow,
  largest gradient)``, torch's rule, for every preset: the overflowed ones
  all backed off alike, and a headroom scale falls with the largest
  gradient (with ``history``, its window keeps the largest). From unequal
  states (a call was left out) it is the most cautious of them, and from
  then on they are equal again.

  It reads each state's own record of the last step (its overflow flag and
  its scale after it), so a second call on its own results would change
  nothing. Where a state's history is known (made or given in this eager
  code, or in the same trace: docs/history.md), a state from before
  ``tx.update`` (given to it, or not stepped since ``tx.init`` or the last
  sync), whose sync would freeze the scale, is refused. Leaving the call
  out leaves every optimizer with its own scale, which still trains.

  ``nnx.Optimizer`` s are synced in place, as ``opt.update(model, grads)``
  acts (their loss-scale Variables are written), and returned too.

  Args:
    *opt_states: the optimizer states ``tx.update`` returned, or
      ``nnx.Optimizer`` s, at least one, each holding one
      :class:`LossScaleState` (at any depth), built with one and the same
      :class:`Scaler`.

  Returns:
    The states, in order, each with the one scale state (traceable; a few
    scalar selects, no host work); an ``nnx.Optimizer`` is itself, synced.

  Raises:
    ValueError: no state, a state without a loss-scale state or under
      :func:`accumulate_gradients`; where their history is known, states
      built with other scalers, a state given to ``tx.update`` or not
      stepped since ``tx.init`` or the last sync, or a state whose scale
      was set since the last sync beside one whose scale was not.

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
  made = [_provenance.made(ls) for ls in found]
  scalers = [None if m.by is None else m.by.scaler for m in made]
  for i, scaler in enumerate(scalers[1:], 1):
    if None not in (scaler, scalers[0]) and scaler != scalers[0]:
      raise ValueError(
        f"sync_loss_scales: optimizer state {i} was built with another "
        f"Scaler than state 0 ({scaler} against {scalers[0]}): one scale "
        "follows one scaler's rules. Build every optimizer that shares it "
        "with the same Scaler"
      )
  _check_scales_set(made)
  overflow, scaler = found[0].overflow, found[0].scaler
  for ls in found[1:]:
    lower = ls.scaler.loss_scale < scaler.loss_scale
    first = (ls.overflow & ~overflow) | ((ls.overflow == overflow) & lower)
    scaler = jax.tree.map(
      functools.partial(jnp.where, first), ls.scaler, scaler
    )
    overflow = overflow | ls.overflow
  if getattr(scaler, "grad_max_history", None) is not None:
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
  out = []
  for s, ls, m in zip(opt_states, found, made):
    new = ls._replace(scaler=scaler)
    # Synced: not stepped since, no scale set since.
    _provenance.record(new, m._replace(stepped=False, scale_set=False))
    if _lookup.is_nnx_optimizer(s):
      _set_in_place(s, new)
      out.append(s)
    else:
      out.append(_lookup.replace_loss_scale_state(s, new))
  return tuple(out)
