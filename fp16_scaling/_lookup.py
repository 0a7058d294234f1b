"""The one way to find fp16_scaling's states inside a nested optax state, so
that a state that lost its types, holds several or sits inside
``optax.MultiSteps`` or ``optax.apply_if_finite`` gets the same message
everywhere; states come back with plain arrays (:func:`unwrap`, for
``nnx.Optimizer``).
"""

import sys
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _validate
from fp16_scaling._scaler import ScalerState
from fp16_scaling._states import AccumulationState
from fp16_scaling._states import ClipState
from fp16_scaling._states import LossScaleState


def looks_like_loss_scale_state(keys) -> bool:
  """Whether a dict with ``keys`` is a LossScaleState without its types:
  ``scaler`` and two more fields (older releases lack the newer ones)."""
  keys = set(map(str, keys)) & set(LossScaleState._fields)
  return "scaler" in keys and len(keys) >= 3


def is_nnx_optimizer(x: Any) -> bool:
  """Whether ``x`` is an ``nnx.Optimizer`` (of a loaded flax.nnx)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Optimizer)


def is_nnx_variable(x: Any) -> bool:
  """Whether ``x`` is an nnx ``Variable`` (of a loaded flax.nnx)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def unwrap(tree: Any) -> Any:
  """``tree`` with every container around one array (an nnx ``Variable``)
  replaced by the array; tuples, lists, dicts and NamedTuples are walked."""
  if isinstance(tree, (tuple, list)):
    items = [unwrap(v) for v in tree]
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
  if isinstance(tree, dict):
    return {k: unwrap(v) for k, v in tree.items()}
  leaves = jax.tree.leaves(tree)
  return leaves[0] if len(leaves) == 1 else tree


def all_with_path(tree: Any, cls: type) -> list:
  """Every node of type ``cls`` (a NamedTuple) in ``tree``, with its path."""
  return optax.tree_utils.tree_get_all_with_path(
    tree, cls.__name__, filtering=lambda _, v: isinstance(v, cls)
  )


def _looks_untyped(x: Any) -> bool:
  """Whether ``x`` holds a loss-scale state restored as plain containers."""
  if isinstance(x, dict):
    return looks_like_loss_scale_state(x) or any(
      map(_looks_untyped, x.values())
    )
  if isinstance(x, (list, tuple)) or hasattr(x, "_fields"):
    return any(map(_looks_untyped, x))
  return False


_MULTISTEPS = (
  "opt_state is optax.MultiSteps' state around fs.chain: MultiSteps "
  "resets its accumulator by multiplying it by 0, so one inf or NaN "
  "microbatch poisons every later window (NaN * 0 is NaN), the scale halves "
  "every window and training stops. Use fp16_scaling.accumulate_gradients("
  "tx, every_k_schedule) in its place: microbatches at one scale, one "
  "overflow decision and one exact skip per window."
)


_APPLY_IF_FINITE = (
  "opt_state is optax.apply_if_finite's state around fs.chain: on a step "
  "with an inf or NaN, apply_if_finite keeps fs.chain's state as it was "
  "(up to max_consecutive_errors steps in a row), so the loss scale never "
  "sees those overflows and does not back off, and skipped_steps does not "
  "count them: from a scale too high, every step is dropped until "
  "apply_if_finite lets one through. fs.chain already skips every step "
  "with an inf or NaN exactly, and backs the scale off on each. Drop "
  "apply_if_finite and use fs.chain(...) alone; to stop after n skipped "
  "steps in a row, call fs.raise_if_min_scale_reached(opt_state, "
  "max_consecutive_errors=n) on the host (say when logging)."
)

_MASKED = (
  "fs.chain is under optax.masked (or optax.multi_transform, which masks "
  "each of its transformations): the leaves masked out never reach the "
  "chain, and the wrapper passes their gradients on as their updates, "
  "still multiplied by the loss scale (a static scale of 1024 adds 1024 "
  "times the gradient to those params) and not skipped on an overflow. "
  "Mask inside the chain: fs.chain(fs.fp16_loss_scale(scaler), ..., "
  "optax.masked(optimizer, mask)); for several optimizers, one fs.chain "
  "around optax.multi_transform: fs.chain(fs.fp16_loss_scale(scaler), "
  "optax.multi_transform(transforms, param_labels))."
)

# Wrappers refused around a LossScaleState: their state's type, and why.
_REFUSED_WRAPPERS = (
  (optax.MultiStepsState, _MULTISTEPS),
  (optax.ApplyIfFiniteState, _APPLY_IF_FINITE),
  (optax.MaskedState, _MASKED),
)


def _is_masked_node(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def refuse_masked(params: Any) -> None:
  """Raises ValueError, naming the fix, for params that ``optax.masked``
  (or ``optax.multi_transform``) masked before ``fs.chain``'s ``init``
  saw them: they hold ``optax.MaskedNode`` s (a type check)."""
  if any(
    map(_is_masked_node, jax.tree.leaves(params, is_leaf=_is_masked_node))
  ):
    raise ValueError(_MASKED)


def _check_not_wrapped(opt_state: Any) -> None:
  """Raises ValueError for a LossScaleState inside a refused wrapper's
  state."""
  for wrapper_state, message in _REFUSED_WRAPPERS:
    for _, wrapper in all_with_path(opt_state, wrapper_state):
      if all_with_path(wrapper, LossScaleState):
        raise ValueError(message)


def _described(x: Any) -> str:
  """What ``x`` is, for a message."""
  if isinstance(x, optax.GradientTransformation):
    return "which is the optimizer (tx) itself, not its state"
  if isinstance(x, dict):
    return f"a dict with keys {sorted(map(str, x))[:6]}"
  return f"a {type(x).__name__}"


def loss_scale_state(opt_state: Any, what: str = "opt_state") -> LossScaleState:
  """The one :class:`LossScaleState` in ``opt_state``.

  Args:
    opt_state: an optax state, at any depth, nnx ``Variable`` s included.
    what: how error messages name ``opt_state``.

  Returns:
    The state, its arrays unwrapped from any nnx ``Variable``.

  Raises:
    ValueError: none (or one restored as plain dicts and lists, which the
      message says how to restore), several (``optax.multi_transform`` of
      several chains: the message names one chain around it), or one
      inside ``optax.MultiSteps`` (use ``accumulate_gradients``),
      ``optax.apply_if_finite`` (``fs.chain`` skips alone) or
      ``optax.masked`` (mask inside the chain).
  """
  found = all_with_path(opt_state, LossScaleState)
  if len(found) == 1:
    _check_not_wrapped(opt_state)
    return unwrap(found[0][1])
  if not found:
    if _looks_untyped(opt_state):
      raise ValueError(
        f"{what} holds a loss-scale state that lost its types: it was "
        "restored as plain dicts or lists (orbax or flax.serialization "
        "without a target). Restore with a target of the right structure, "
        "e.g. checkpointer.restore(path, target=tx.init(params)) or "
        "flax.serialization.from_state_dict(tx.init(params), restored)."
      )
    raise ValueError(
      f"no fp16_loss_scale state found in {what}, {_described(opt_state)}. "
      "Pass the optimizer state that tx.init(params) or tx.update returned, "
      "of a chain built with fp16_loss_scale(...)"
    )
  paths = "; ".join(
    f"at {jax.tree_util.keystr(p) or 'the root'}" for p, _ in found
  )
  raise ValueError(
    f"{what} holds {len(found)} fp16_loss_scale states ({paths}); expected "
    "exactly one. Pass each optimizer's state alone (fs.sync_loss_scales "
    "keeps several at one scale); for optax.multi_transform, one fs.chain "
    "around it: fs.chain(fs.fp16_loss_scale(scaler), "
    "optax.multi_transform(transforms, param_labels))"
  )


def scaler_state(state: Any, what: str = "opt_state") -> ScalerState:
  """The scale machine's state in ``state``'s one loss-scale state."""
  return loss_scale_state(state, what).scaler


def clip_state(opt_state: Any) -> Optional[ClipState]:
  """The first :class:`ClipState` in ``opt_state``, or None."""
  found = all_with_path(opt_state, ClipState)
  return unwrap(found[0][1]) if found else None


def accumulation_state(opt_state: Any) -> Optional[AccumulationState]:
  """The one :class:`AccumulationState` in ``opt_state`` (plain arrays), or
  None; raises ValueError for more than one."""
  found = all_with_path(opt_state, AccumulationState)
  if len(found) > 1:
    paths = ", ".join(jax.tree_util.keystr(p) for p, _ in found)
    raise ValueError(
      f"opt_state holds {len(found)} accumulate_gradients states ({paths}); "
      "expected at most one"
    )
  return unwrap(found[0][1]) if found else None


def replace_loss_scale_state(opt_state: Any, new: LossScaleState) -> Any:
  """``opt_state`` with its one :class:`LossScaleState` replaced by ``new``,
  whose arrays go into the old state's containers (nnx ``Variable`` s);
  ValueError as :func:`loss_scale_state` when there is not exactly one."""
  loss_scale_state(opt_state)

  def rewrap(old: LossScaleState) -> LossScaleState:
    return jax.tree.unflatten(jax.tree.structure(old), jax.tree.leaves(new))

  return jax.tree.map(
    lambda x: rewrap(x) if isinstance(x, LossScaleState) else x,
    opt_state,
    is_leaf=lambda x: isinstance(x, LossScaleState),
  )


def replace_set_scale(opt_state: Any, new: LossScaleState) -> Any:
  """:func:`replace_loss_scale_state` with ``new``, the loss-scale state of
  ``opt_state`` with its scale set: marked as set (``scale_set``, an
  array), so that :func:`sync_loss_scales` keeps its scale over those of
  states whose scale was not set."""
  new = new._replace(scale_set=jnp.ones_like(new.scale_set))
  return replace_loss_scale_state(opt_state, new)


def set_loss_scale(opt_state: Any, scale: Any) -> Any:
  """``opt_state`` with the loss scale for the next step set to ``scale``.

  Traceable; the growth tracker and hysteresis are left as they are.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    scale: a positive normal finite float32, or a float32 scalar array.

  Returns:
    The new state, marked as one whose scale was set (``scale_set``):
    :func:`sync_loss_scales` keeps its scale over those of the states
    whose scale was not set.

  Raises:
    ValueError: a Python ``scale`` that is not a positive normal float32.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(fs.fp16_loss_scale(fs.torch_scaler()))
    >>> state = fs.set_loss_scale(tx.init(jnp.zeros(2)), 512.0)
    >>> float(fs.current_scale(state))
    512.0
  """
  if not hasattr(scale, "dtype"):
    scale = _validate.scale("scale", scale)
  old = loss_scale_state(opt_state)
  loss_scale = jnp.full_like(old.scaler.loss_scale, scale)
  new = old._replace(scaler=old.scaler._replace(loss_scale=loss_scale))
  return replace_set_scale(opt_state, new)
