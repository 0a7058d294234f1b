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
  return _lookup.loss_scale_state(opt_state, what)


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


def _check_built(found: list) -> None:
  """Raises when the loss-scale states ``found`` were not built with one
  :class:`Scaler` (their initial scales aside), as their treedefs record
  it: the same answer eager and under ``jit``."""
  scalers = [ls.leaf_paths.built.scaler for ls in found]
  for i, scaler in enumerate(scalers[1:], 1):
    if scaler != scalers[0]:
      raise ValueError(
        f"sync_loss_scales: optimizer state {i} was built with another "
        f"Scaler than state 0 ({scaler} against {scalers[0]}, initial "
        "scales aside): one scale follows one scaler's rules. Build every "
        "optimizer that shares it with the same Scaler"
      )


def _chosen(found: list) -> tuple:
  """``(scaler state, any overflow)``: the scale state of the first of the
  loss-scale states ``found`` whose scale was set (``scale_set``), or when
  none was of all of them, that overflowed with the lowest scale, or when
  none did with the lowest scale; and whether any overflowed. A few
  scalar selects: the same eager and under ``jit``."""
  scaler, over, chosen_set = (
    found[0].scaler,
    found[0].overflow,
    found[0].scale_set,
  )
  any_overflow = over
  for ls in found[1:]:
    lower = ls.scaler.loss_scale < scaler.loss_scale
    cautious = (ls.overflow & ~over) | ((ls.overflow == over) & lower)
    # A set scale wins: among the set ones (or all), the most cautious.
    same = ls.scale_set == chosen_set
    first = (ls.scale_set & ~chosen_set) | (same & cautious)
    scaler = jax.tree.map(
      functools.partial(jnp.where, first), ls.scaler, scaler
    )
    over = jnp.where(first, ls.overflow, over)
    chosen_set = chosen_set | ls.scale_set
    any_overflow = any_overflow | ls.overflow
  return scaler, any_overflow


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

  A scale set since ``tx.init`` or the last sync (:func:`set_loss_scale`,
  :func:`load_scaler_state_dict`: the state's ``scale_set`` flag, an
  array) wins: when some states had their scale set, the rule above picks
  among those alone, so a scale loaded into one of two states is kept for
  both. The flag is traced, so the same eager and under ``jit``, wherever
  the scale was set; the sync clears it.

  It reads each state's own record of the last step (its overflow flag and
  its scale after it), so a second call on its own results changes
  nothing. Leaving the call out leaves every optimizer with its own scale,
  which still trains.

  Not refused, since no value, type or tree structure tells them apart
  from the states ``tx.update`` returned: the states from *before* the
  update (the ones given to ``tx.update``). Keeping what their sync returns
  drops the step's record: the scale never moves (an overflowing scale
  overflows on every step, and a clean one never grows),
  ``skipped_steps`` stays where it was whatever overflows, and the
  optimizer's own state (Adam's moments and count) never advances, while
  the parameters still take the updates. The same eager and under ``jit``
  (``tests/test_refusals.py``). Sync what ``tx.update`` returned.

  ``nnx.Optimizer`` s are synced in place, as ``opt.update(model, grads)``
  acts (their loss-scale Variables are written), and returned too.

  Args:
    *opt_states: the optimizer states ``tx.update`` returned, or
      ``nnx.Optimizer`` s, at least one, each holding one
      :class:`LossScaleState` (at any depth), built with one and the same
      :class:`Scaler`.

  Returns:
    The states, in order, each with the one scale state and ``scale_set``
    False (traceable; a few scalar selects, no host work); an
    ``nnx.Optimizer`` is itself, synced.

  Raises:
    ValueError: no state, a state without a loss-scale state or under
      :func:`accumulate_gradients`; states built with other scalers (their
      initial scales aside, read from the states' treedefs: the same eager
      and under ``jit``).

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
  _check_built(found)
  scaler, overflow = _chosen(found)
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
  for s, ls in zip(opt_states, found):
    new = ls._replace(scaler=scaler, scale_set=jnp.zeros_like(ls.scale_set))
    if _lookup.is_nnx_optimizer(s):
      _set_in_place(s, new)
      out.append(s)
    else:
      out.append(_lookup.replace_loss_scale_state(s, new))
  return tuple(out)
