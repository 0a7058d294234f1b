"""``skip_on_overflow``: an exact skip of the whole chain on an overflow step.

An element of ``optax.chain`` cannot stop the elements after it, so the guard
wraps the chain. On an overflow step it returns zero updates and keeps every
leaf of the inner state bit for bit (Adam's moments, its count, a schedule's
step), except the bookkeeping that must move: the loss-scale state and the
clip's reported norms.

Unlike ``optax.apply_if_finite``, it does not look at the gradients again:
the overflow decision comes from ``fp16_loss_scale``'s one pass. Every select
is an elementwise select that XLA fuses into the optimizer's own update, so a
skip adds no pass over memory and no host round-trip, and an overflow step
costs no more than a clean one. The selects are placed by ``_inplace``, early
enough that the optimizer's update reads the selected state: XLA can then
write every donated state buffer in place, as it does for plain optax.

``optax.MultiSteps`` around the guarded chain is refused by the state
lookup (``_lookup.loss_scale_state``) that ``current_scale`` and the other
helpers share: the first step that scales its loss raises.
"""

import jax
import optax

from fp16_scaling import _guard
from fp16_scaling import _inplace
from fp16_scaling import _lookup
from fp16_scaling import _validate
from fp16_scaling._states import ClipState
from fp16_scaling._states import LossScaleState

_BOOKKEEPING = (LossScaleState, ClipState)


def _is_bookkeeping(x) -> bool:
  return isinstance(x, _BOOKKEEPING)


def skip_on_overflow(
  inner: optax.GradientTransformation,
  *,
  early_select: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` and discards the step exactly when its gradients overflowed.

  Args:
    inner: a chain that contains exactly one :func:`fp16_loss_scale`,
      typically ``optax.chain(fp16_loss_scale(...),
      clip_by_unscaled_norm(...), optimizer)``.
    early_select: place the state selects inside the traced inner update,
      so that XLA updates donated state in place (see ``_inplace``; it
      relies on JAX internals and falls back to ``False``'s behaviour, with
      one warning, where they fail). ``False`` selects after the inner
      update with public JAX only: the same values, but on XLA:CPU a copy
      of every donated optimizer moment per step.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s
    state. On an overflow step the updates are ``-0.0`` (so ``params +
    updates`` is bit-identical to ``params``, signed zeros included) and the
    inner state is unchanged except for :class:`LossScaleState` and
    :class:`ClipState`. Extra arguments that are not arrays (``optax.lbfgs``'s
    ``value_fn``) reach ``inner`` as they are, untraced. Gradients taken
    through an overflow step are finite: zero through the discarded update.

  Raises:
    ValueError: at ``init``, unless ``inner``'s state holds exactly one
      :class:`LossScaleState`; when the update is traced, if the chain's
      order is wrong (see :func:`fp16_loss_scale`).

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(optax.chain(
    ...     fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=1024.0)),
    ...     fs.clip_by_unscaled_norm(1.0),
    ...     optax.adam(1e-3)))
    >>> params = jnp.ones(2)
    >>> state = tx.init(params)
    >>> grads = jnp.array([1.0, jnp.inf])  # an overflow: skip the step
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates)
    [-0. -0.]
    >>> m = fs.scale_metrics(state)
    >>> print(bool(m["overflow"]), float(m["loss_scale"]))
    True 512.0

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018: a step whose gradients
    overflowed is skipped and the scale lowered.
  """
  early_select = _validate.flag("early_select", early_select)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    with _guard.guarded():
      state = inner.init(params)
    _single_loss_scale_state(state)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    _single_loss_scale_state(state)
    return _inplace.call_selecting(
      _guarded_update(inner),
      (updates, state, params, extra_args),
      _state_labels(state),
      early=early_select,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _single_loss_scale_state(state) -> None:
  found = _lookup.all_with_path(state, LossScaleState)
  if len(found) != 1:
    raise ValueError(
      "skip_on_overflow must wrap a chain with exactly one fp16_loss_scale "
      f"(it decides the overflow); found {len(found)}. Build it as "
      "skip_on_overflow(optax.chain(fp16_loss_scale(...), "
      "clip_by_unscaled_norm(...), optimizer))."
    )


def _guarded_update(inner: optax.GradientTransformationExtraArgs):
  """``inner.update`` inside the guard, told the gradients it starts from."""

  def update(updates, state, params, extra_args):
    with _guard.guarded() as guard:
      guard.receive(jax.tree.leaves(updates))
      return inner.update(updates, state, params, **extra_args)

  return update


def _state_labels(state) -> _inplace.StateLabels:
  """What the skip does to each leaf of the state the inner update returns.

  The state has the structure of ``state``: every leaf takes its old value
  on an overflow (``SELECT``, with that old value), except the bookkeeping,
  returned as computed (``KEEP``; the overflow flag itself is
  ``OVERFLOW``). The updates all become ``-0.0``.
  """
  labels, olds = [], []
  for old in jax.tree.leaves(state, is_leaf=_is_bookkeeping):
    if _is_bookkeeping(old):
      tags = jax.tree.map(lambda _: _inplace.KEEP, old)
      if isinstance(old, LossScaleState):
        tags = tags._replace(overflow=_inplace.OVERFLOW)
      tags = jax.tree.leaves(tags)
      labels += tags
      olds += [None] * len(tags)
    else:
      labels.append(_inplace.SELECT)
      olds.append(old)
  return _inplace.StateLabels(jax.tree.structure(state), labels, olds)
