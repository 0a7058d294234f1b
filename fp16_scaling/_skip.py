"""``skip_on_overflow``: an exact skip of the whole chain on an overflow step
(docs/design.md, "Data flow" and "The exact skip").
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _lookup
from fp16_scaling import _measure
from fp16_scaling._states import RECIPE
from fp16_scaling._states import AccumulationState
from fp16_scaling._states import ClipState
from fp16_scaling._states import LossScaleState

_BOOKKEEPING = (LossScaleState, ClipState)

FIX = f"The order is {RECIPE}."
_NOT_ONE = (
  "skip_on_overflow must wrap a chain with exactly one fp16_loss_scale (it "
  "decides the overflow); found {found}. A second one would unscale "
  "gradients that are already unscaled and step a second scale. " + FIX
)
_NOT_FIRST = (
  "fp16_loss_scale is not the first element of the chain: a transformation "
  "before it (an optimizer or a clip placed first) would change the "
  "gradients before it sees them, and it must see the raw scaled gradients "
  "to divide by the scale they were made with. Move fp16_loss_scale to the "
  "front. " + FIX
)
_CLIP_FIRST = (
  "clip_by_unscaled_norm comes before fp16_loss_scale: it would clip by the "
  "norm of the gradients still multiplied by the loss scale. Put it right "
  "after fp16_loss_scale. " + FIX
)
_INSIDE = (
  "accumulate_gradients runs inside skip_on_overflow: the guarded chain "
  "would see each microbatch, not the window's mean, and its skip would "
  "not cover the accumulator. Nest them the other way round: "
  f"accumulate_gradients({RECIPE}, every_k_schedule)."
)


def _is_bookkeeping(x) -> bool:
  """Whether ``x`` is a state that moves on an overflow step too."""
  return isinstance(x, _BOOKKEEPING)


def skip_on_overflow(
  inner: optax.GradientTransformation, **removed: Any
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` and discards the step exactly when its gradients overflowed.

  Args:
    inner: a chain whose first element is :func:`fp16_loss_scale`.
    **removed: nothing is accepted; ``early_select=`` (removed) is a
      TypeError that says what replaced it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s
    state. On an overflow step the updates are ``-0.0`` (``params +
    updates`` keeps every bit of ``params``) and the inner state is
    unchanged but for :class:`LossScaleState` and :class:`ClipState`.

    Inside another ``skip_on_overflow`` (a trainer wrapping what the user
    built), it runs ``inner`` on the state handed on: the outer one
    measures and skips, and the two are one skip.

  Raises:
    TypeError: at construction, for ``early_select=`` or any other keyword.
    ValueError: at ``init`` and ``update``, unless ``inner``'s first element,
      and only it, is an ``fp16_loss_scale`` (docs/design.md).

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(optax.chain(
    ...     fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=1024.0)),
    ...     fs.clip_by_unscaled_norm(1.0), optax.adam(1e-3)))
    >>> params = jnp.ones(2)
    >>> state = tx.init(params)
    >>> grads = jnp.array([1.0, jnp.inf])  # an overflow: skip the step
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates)
    [-0. -0.]
    >>> m = fs.scale_metrics(state)
    >>> print(bool(m["overflow"]), float(m["loss_scale"]))
    True 512.0
  """
  if removed:
    raise TypeError(
      f"skip_on_overflow got {', '.join(removed)}: it takes the chain alone. "
      "early_select= was removed: the skip always selects after the inner "
      "update. On XLA:CPU, compile the step with compiler_options="
      "{'xla_cpu_copy_insertion_use_region_analysis': True} to keep it in "
      'place (docs/design.md, "In place").'
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    state = inner.init(params)
    chain_layout(state)
    return state

  def update_fn(updates, state, params=None, *, measurement=None, **extra):
    if _handed_on(state):
      return inner.update(updates, state, params, **extra)
    clip_follows = chain_layout(state)
    if measurement is None:
      measurement = _measure.measure_step(updates, state)
    handed = _handed(state, measurement, clip_follows)
    new_updates, new_state = inner.update(updates, handed, params, **extra)
    return skipped_if(measurement.overflow, new_updates, state, new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skipped_if(overflow, updates, old_state, new_state) -> tuple:
  """``(updates, new_state)``, or ``-0.0`` updates and ``old_state``'s
  values (but for the bookkeeping) when ``overflow``."""
  if jax.tree.structure(new_state) != jax.tree.structure(old_state):
    raise ValueError(
      "skip_on_overflow: the inner update returned a state whose structure "
      f"differs from its input state: {jax.tree.structure(new_state)} "
      f"against {jax.tree.structure(old_state)}"
    )

  def keep(new, old):
    return new if _is_bookkeeping(new) else jnp.where(overflow, old, new)

  state = jax.tree.map(keep, new_state, old_state, is_leaf=_is_bookkeeping)
  updates = jax.tree.map(lambda u: jnp.where(overflow, -0.0, u), updates)
  return updates, state


def _handed_on(state) -> bool:
  """Whether ``state`` was handed on by an outer ``skip_on_overflow``,
  which measured the step and selects after it: this one runs its chain."""
  return isinstance(_elements(state)[0], _measure.Handed)


def _handed(state, measurement, clip_follows: bool):
  """``state`` with its loss-scale (and following clip) state handed on."""

  def hand(x):
    if isinstance(x, LossScaleState):
      return _measure.Handed(x, measurement)
    if clip_follows and isinstance(x, ClipState):
      return _measure.Handed(x, measurement)
    return x

  return jax.tree.map(hand, state, is_leaf=_is_bookkeeping)


def _elements(state) -> list:
  """The states of a chain's elements, in order: an optax chain's state (a
  plain tuple, list or dict) is opened; any other value is one element's."""
  if isinstance(state, dict) and state:
    return [e for v in state.values() for e in _elements(v)]
  if (
    isinstance(state, (tuple, list)) and state and not hasattr(state, "_fields")
  ):
    return [e for v in state for e in _elements(v)]
  return [state]


def chain_layout(state) -> bool:
  """Checks the order of the chain whose state is ``state`` (ValueError);
  returns whether its one clip comes right after ``fp16_loss_scale``."""
  found = _lookup.all_with_path(state, LossScaleState)
  if len(found) != 1:
    raise ValueError(_NOT_ONE.format(found=len(found)))
  if _lookup.all_with_path(state, AccumulationState):
    raise ValueError(_INSIDE)
  elements = _elements(state)
  first = next(
    (i for i, e in enumerate(elements) if isinstance(e, LossScaleState)), -1
  )
  if any(isinstance(e, ClipState) for e in elements[:first]):
    raise ValueError(_CLIP_FIRST)
  if first != 0:
    raise ValueError(_NOT_FIRST)
  clips = [i for i, e in enumerate(elements) if isinstance(e, ClipState)]
  return clips == [1]


def chain(*transforms) -> optax.GradientTransformationExtraArgs:
  """The guarded fp16 step: ``fp16_loss_scale`` first, then an optional clip
  and the optimizer (being rewritten to own its step; same semantics)."""
  return skip_on_overflow(optax.chain(*transforms))
