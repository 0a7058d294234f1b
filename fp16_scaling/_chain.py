"""``chain``: the fp16 step as one transformation. It measures the scaled
gradients once, steps the scale, unscales and clips from that one
measurement, runs the optimizer, and selects (docs/design.md, "Data flow").
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _clipping
from fp16_scaling import _donation
from fp16_scaling import _loss_scale
from fp16_scaling import _measure
from fp16_scaling._clipping import ClipConfig
from fp16_scaling._clipping import UnscaledClip
from fp16_scaling._loss_scale import LossScale
from fp16_scaling._loss_scale import ScaleConfig

_USAGE = (
  "Write fs.chain(fs.fp16_loss_scale(scaler), "
  "fs.clip_by_unscaled_norm(max_norm), optimizer)."
)
_OUTSIDE = (
  " fs.accumulate_gradients goes outside, around the whole chain: "
  "fs.accumulate_gradients(fs.chain(fs.fp16_loss_scale(scaler), ..., "
  "optimizer), every_k_schedule)."
)


class OwnsStep(optax.GradientTransformationExtraArgs):
  """A transformation that runs an :func:`chain` step: one, or a wrapper of
  one (:func:`accumulate_gradients`), which no chain may hold again."""


class Outcome(NamedTuple):
  """A step's result, with the overflow it decided.

  Attributes:
    updates: the updates (``-0.0`` on an overflow step).
    state: the new state.
    overflow: bool scalar, whether the step was skipped.
  """

  updates: Any
  state: tuple
  overflow: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class StepConfig:
  """What :func:`chain` was given, checked, and the step it runs: a
  :class:`Step`'s ``init`` and ``update`` are this one's methods.

  Attributes:
    scale: the :class:`ScaleConfig` of its ``fp16_loss_scale``.
    clip: the :class:`ClipConfig` of the clip right after it, or None.
    rest: the rest of the chain, one ``optax.chain``.
  """

  scale: ScaleConfig
  clip: Optional[ClipConfig]
  rest: optax.GradientTransformationExtraArgs

  @property
  def owned(self) -> int:
    """How many of the state's elements are the step's own (loss scale,
    and the clip when there is one); the rest's follow."""
    return 1 if self.clip is None else 2

  def init(self, params) -> tuple:
    """The state: ``(LossScaleState, [ClipState,] *rest's)``."""
    head = (_loss_scale.init_state(self.scale, params),)
    if self.clip is not None:
      head += (self.clip.init(params),)
    return head + tuple(self.rest.init(params))

  def plan(self, updates, ls) -> _measure.Plan:
    """The measurement's :class:`~fp16_scaling._measure.Plan` of
    ``updates``: the one the loss-scale state ``ls`` holds in its treedef
    (each leaf's spec and the stacked layout, resolved by ``tx.init``),
    with the clip's groups of the expert mask joined here, where the
    clip's configuration lives."""
    plan = self.scale.state_plan(ls, updates)
    if self.clip is None:
      return plan
    return plan.with_groups(self.clip.expert_mask, updates)

  def update(self, updates, state, params=None, **extra):
    """``optax``'s update: :meth:`run` on gradients outside a window."""
    out = self.run(updates, state, params, extra=extra, in_float16_range=False)
    return out.updates, out.state

  def run(
    self, updates, state, params, *, extra: dict, in_float16_range: bool
  ) -> Outcome:
    """The step on the scaled gradients ``updates``, with the overflow it
    decided; ``extra`` are the update's extra arguments, and
    ``in_float16_range`` says that every gradient holds float16-range
    values (:class:`Measurement`)."""
    ls, own = state[0], self.owned
    # First: a state of another configuration is refused before anything
    # of it is read (ScaleConfig.state_plan).
    plan = self.plan(updates, ls)
    m = _measure.measure(
      updates, ls.scaler.loss_scale, plan, in_float16_range=in_float16_range
    )
    head = (
      _loss_scale.step_state(
        self.scale, ls, m, updates, params, extra.get("value")
      ),
    )
    factor = None
    if self.clip is not None:
      norms = m.clip_norms
      factor = self.clip.factor(norms)
      new_clip = _clipping.clip_state(norms)
      # Write-only: each field reads its old value to keep its buffer.
      head += (_donation.written_over(state[1], new_clip),)
    treedef = jax.tree.structure(updates)
    unscaled = jax.tree.unflatten(treedef, m.unscaled(m.grads, factor))
    new_updates, new_rest = self.rest.update(
      unscaled, state[own:], params, **extra
    )
    new_updates = jax.tree.map(
      lambda u: jnp.where(m.overflow, -0.0, u), new_updates
    )
    kept = jax.tree.map(
      lambda new, old: jnp.where(m.overflow, old, new),
      tuple(new_rest),
      tuple(state[own:]),
    )
    return Outcome(updates=new_updates, state=head + kept, overflow=m.overflow)


class Step(OwnsStep):
  """What :func:`chain` returns: an ``optax.GradientTransformationExtraArgs``
  whose ``init`` and ``update`` are its :class:`StepConfig`'s, which
  :attr:`config` reads back (for :func:`accumulate_gradients`)."""

  @property
  def config(self) -> StepConfig:
    """The :class:`StepConfig` this step runs."""
    return self.update.__self__


def _no_state(params) -> tuple:
  del params
  return ()


def _passed_on(updates, state, params=None, **extra) -> tuple:
  del state, params, extra
  return updates, ()


# A chain of no more elements (optax.chain() takes at least one): its state
# stays ``()``.
_NOTHING_MORE = optax.GradientTransformationExtraArgs(_no_state, _passed_on)


def _kind(tx) -> str:
  """What ``tx`` is, for a message."""
  if isinstance(tx, Step):
    return "an fs.chain"
  if isinstance(tx, OwnsStep):
    return "an fs.accumulate_gradients"
  if isinstance(tx, LossScale):
    return "an fp16_loss_scale"
  return type(tx).__name__


def _checked(transforms) -> StepConfig:
  """The :class:`StepConfig` of ``chain``'s arguments, refused
  (ValueError) unless in the step's order."""
  if not transforms or not isinstance(transforms[0], LossScale):
    first = _kind(transforms[0]) if transforms else "nothing"
    outside = first == "an fs.accumulate_gradients"
    raise ValueError(
      f"fs.chain: the first element must be fs.fp16_loss_scale(...), got "
      f"{first}: it must see the raw scaled gradients to divide them by the "
      f"scale they were made with. {_USAGE}" + (_OUTSIDE if outside else "")
    )
  scale, rest = transforms[0].config, list(transforms[1:])
  clip = None
  if rest and isinstance(rest[0], UnscaledClip):
    clip = rest.pop(0).config
    if clip.partition_specs is not None:
      raise ValueError(
        "fs.chain: clip_by_unscaled_norm right after fp16_loss_scale got "
        "partition_specs: it clips by the step's one measurement, made with "
        "fp16_loss_scale's. Pass partition_specs to fs.fp16_loss_scale only."
      )
  for i, tx in enumerate(rest):
    if isinstance(tx, (LossScale, OwnsStep)):
      raise ValueError(
        f"fs.chain: element {i + 1 + (clip is not None)} is {_kind(tx)}: "
        "a second loss scale would unscale gradients that are already "
        "unscaled and step a second scale. One fs.chain has one "
        f"fp16_loss_scale, first. {_USAGE}"
      )
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
        f"fs.chain: element {i + 1 + (clip is not None)} is a "
        f"{type(tx).__name__}, not an optax GradientTransformation"
      )
  return StepConfig(
    scale=scale,
    clip=clip,
    rest=optax.chain(*rest) if rest else _NOTHING_MORE,
  )


def chain(*transforms: optax.GradientTransformation) -> Step:
  """The float16 step: ``optax.chain``'s arguments, with an exact skip.

  ``fs.chain(fs.fp16_loss_scale(scaler), fs.clip_by_unscaled_norm(1.0),
  optimizer, ...)`` runs as ``optax.chain`` of the same elements would if
  its elements could see one another: each update measures the scaled
  gradients once (inf/NaN, per-leaf and global norms), steps the scale,
  unscales and clips them from that measurement in one multiply, runs the
  rest of the chain on the result, and on an overflow step returns
  ``-0.0`` updates and the rest's state unchanged, so ``params + updates``
  keeps every bit of ``params``.

  ``init`` and ``update`` are pure, as optax's are: nothing marks a state
  given to ``update`` as used, so given it again ``update`` returns the same
  result (``tests/test_refusals.py``); keep the state it returns.

  Args:
    *transforms: :func:`fp16_loss_scale` first; then optionally
      :func:`clip_by_unscaled_norm`, which clips by the true norm; then any
      optax transformations (an optimizer). A ``clip_by_unscaled_norm``
      further on clips what reaches it.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its state
    is a tuple of the elements' states, as ``optax.chain``'s:
    ``(LossScaleState, [ClipState,] *rest)``. Extra arguments (``value=``,
    the loss) reach every element.

  Raises:
    ValueError: the first element is not ``fp16_loss_scale``, another one
      follows, or the clip right after it has ``partition_specs``.
    TypeError: an element is not a ``GradientTransformation``.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=1024.0)),
    ...     fs.clip_by_unscaled_norm(1.0), optax.adam(1e-3))
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
  config = _checked(transforms)
  return Step(config.init, config.update)
