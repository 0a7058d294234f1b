"""``skip_on_overflow``: an exact skip of the whole chain on an overflow step.

An element of ``optax.chain`` cannot stop the elements after it, so the guard
wraps the chain. On an overflow step it returns zero updates and keeps every
leaf of the inner state bit for bit (Adam's moments, its count, a schedule's
step), except the bookkeeping that must move: the loss-scale state and the
clip's reported norms.

Unlike ``optax.apply_if_finite``, it does not look at the gradients again:
the overflow decision comes from ``fp16_loss_scale``'s one pass. Every select
is an elementwise ``where`` that XLA fuses into the optimizer's own update, so
a skip adds no pass over memory and no host round-trip, and an overflow step
costs what a clean one does.
"""

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _guard
from fp16_scaling._clipping import ClipState
from fp16_scaling._loss_scale import LossScaleState

_BOOKKEEPING = (LossScaleState, ClipState)


def _is_bookkeeping(x) -> bool:
  return isinstance(x, _BOOKKEEPING)


def find_loss_scale_states(tree) -> list:
  """Every :class:`LossScaleState` in a (nested) optax state."""
  nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LossScaleState))
  return [n for n in nodes if isinstance(n, LossScaleState)]


def skip_on_overflow(
    inner: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` and discards the step exactly when its gradients overflowed.

  Args:
    inner: a chain that contains exactly one :func:`fp16_loss_scale`,
      typically ``optax.chain(fp16_loss_scale(...),
      clip_by_unscaled_norm(...), optimizer)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s
    state. On an overflow step the updates are ``-0.0`` (so ``params +
    updates`` is bit-identical to ``params``, signed zeros included) and the
    inner state is unchanged except for :class:`LossScaleState` and
    :class:`ClipState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = inner.init(params)
    _single_loss_scale_state(state)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    with _guard.guarded():
      new_updates, new_state = inner.update(updates, state, params,
                                            **extra_args)
    overflow = _single_loss_scale_state(new_state).overflow

    def keep_old(new, old):
      if _is_bookkeeping(new):
        return new
      return jnp.where(overflow, old, new)

    new_state = jax.tree.map(keep_old, new_state, state,
                             is_leaf=_is_bookkeeping)
    new_updates = jax.tree.map(
        lambda u: jnp.where(overflow, jnp.array(-0.0, u.dtype), u),
        new_updates)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _single_loss_scale_state(state) -> LossScaleState:
  found = find_loss_scale_states(state)
  if len(found) != 1:
    raise ValueError(
        "skip_on_overflow must wrap a chain with exactly one fp16_loss_scale "
        f"(it decides the overflow); found {len(found)}")
  return found[0]
