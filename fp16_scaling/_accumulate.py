"""``accumulate_gradients``: microbatches at one scale, one step per window;
a window with an inf or NaN is skipped exactly (docs/accumulation.md).
"""

import functools
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
from jax import lax
import jax.numpy as jnp

from fp16_scaling import _donation
from fp16_scaling import _measure
from fp16_scaling import _norm
from fp16_scaling import _sharding
from fp16_scaling import _validate
from fp16_scaling._chain import OwnsStep
from fp16_scaling._chain import Step
from fp16_scaling._states import AccumulationState

POLICIES = ("skip_step", "drop_microbatch")


def _skip_like(s) -> jax.Array:
  """``-0.0`` of ``s``'s type, varying over its ``shard_map`` axes too, as
  ``lax.cond`` wants the same type from both branches."""
  x = jnp.full(s.shape, -0.0, s.dtype)
  axes = _sharding.varying_axes(s)
  return lax.pcast(x, axes, to="varying") if axes else x


def _checked_schedule(every_k_schedule) -> Callable[[jax.Array], Any]:
  """``every_k_schedule`` as a function, checked where it can be."""
  if callable(every_k_schedule):
    try:
      first = every_k_schedule(0)
    # A schedule that takes only arrays (it calls an array method, or jnp
    # refuses the int) is checked on its first window, in update.
    except (TypeError, AttributeError, ValueError):
      first = None
    if isinstance(first, numbers.Number) and not isinstance(first, bool):
      if first < 1:
        raise ValueError(
          f"every_k_schedule must return an integer >= 1, got {first!r} for "
          "window 0"
        )
    return every_k_schedule
  k = _validate.count("every_k_schedule", every_k_schedule)
  return lambda _: k


def accumulate_gradients(
  tx: Step,
  every_k_schedule: Union[int, Callable[[jax.Array], Any]],
  *,
  on_microbatch_overflow: str = "skip_step",
) -> OwnsStep:
  """Accumulates microbatch gradients and runs the guarded chain once a window.

  Use it where ``optax.MultiSteps`` would go (docs/accumulation.md). The call
  that completes a window passes the float32 mean of the window's gradients
  to ``tx`` and returns its updates; the others return ``-0.0`` updates.

  Args:
    tx: the step, ``fs.chain(fp16_loss_scale(...),
      clip_by_unscaled_norm(...), optimizer)``; its ``fp16_loss_scale``'s
      ``partition_specs`` and ``stacked_axes`` hold here too.
    every_k_schedule: microbatches per window: an int >= 1, or a function of
      the number of windows ended so far returning one.
    on_microbatch_overflow: ``"skip_step"`` (default, as DeepSpeed and torch):
      an inf or NaN in any microbatch skips the window's step.
      ``"drop_microbatch"``: the clean microbatches are averaged; the window
      is skipped only when none is clean.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulationState`. Extra arguments are passed to ``tx`` on the
    calls that end a window; ``value=`` (the loss, on every microbatch or
    on none) reaches ``tx`` as the window's mean loss.

  Raises:
    TypeError: ``tx`` is not an :func:`chain`.
    ValueError: ``every_k_schedule`` below 1; an unknown
      ``on_microbatch_overflow``; at ``update``, gradients whose tree or
      shapes differ from the params.
    TypeError: at ``update``, a ``value`` that is not a floating scalar.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.accumulate_gradients(fs.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(4.0)), optax.sgd(1.0)), 2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> u, state = tx.update({"w": jnp.array([4.0, 8.0])}, state, params)
    >>> u["w"], bool(fs.scale_metrics(state)["window_ended"])
    (Array([-0., -0.], dtype=float32), False)
    >>> u, state = tx.update({"w": jnp.array([12.0, 8.0])}, state, params)
    >>> u["w"], bool(fs.scale_metrics(state)["window_ended"])
    (Array([-2., -2.], dtype=float32), True)

  References:
    PyTorch, "Automatic Mixed Precision examples: gradient accumulation".
  """
  schedule = _checked_schedule(every_k_schedule)
  drop = (
    _validate.choice("on_microbatch_overflow", on_microbatch_overflow, POLICIES)
    == "drop_microbatch"
  )
  if not isinstance(tx, Step):
    raise TypeError(
      f"accumulate_gradients: tx must be the step fs.chain(fs.fp16_loss_scale"
      f"(...), ..., optimizer), got {type(tx).__name__}: the window's mean "
      "is measured once, at the scale its microbatches were made with, and "
      "the window's step is skipped exactly on an overflow."
    )
  step = tx.config

  def init_fn(params):
    _norm.check_float_leaves(
      jax.tree.leaves(params), "accumulate_gradients", params
    )
    return _initial_state(tx.init(params), params)

  def update_fn(updates, state, params=None, **extra_args):
    leaves = _checked_microbatch(updates, state.acc_grads)
    k = jnp.maximum(jnp.asarray(schedule(state.windows), jnp.int32), 1)
    ends = state.mini_step + 1 >= k
    bad = (
      _dropped(updates, step, state.inner_state) if drop else jnp.bool_(False)
    )
    window = _Window(k, bad, state.clean_in_window + (~bad).astype(jnp.int32))
    losses = _Losses.of(extra_args.get("value"), state, window, drop)
    if losses.window_loss is not None:
      extra_args = {**extra_args, "value": losses.window_loss}
    # Outside the cond, so that XLA writes it into the donated accumulator in
    # place; the cond then reads it (last microbatch) or passes it through.
    summed = _accumulated(
      jax.tree.leaves(state.acc_grads), leaves, window, drop
    )
    new_updates, inner_state, acc, overflow = _end_window_if(
      ends,
      functools.partial(_mean_of, window=window, drop=drop),
      step,
      (
        jax.tree.unflatten(jax.tree.structure(updates), summed),
        state.inner_state,
        params,
      ),
      extra_args,
      in_range=all(jnp.result_type(g) == jnp.float16 for g in leaves),
    )
    return new_updates, AccumulationState(
      mini_step=jnp.where(ends, 0, state.mini_step + 1),
      windows=state.windows + ends.astype(jnp.int32),
      acc_grads=acc,
      clean_in_window=jnp.where(ends, 0, window.clean),
      inner_state=inner_state,
      microbatches=state.microbatches + 1,
      applied_steps=state.applied_steps + (ends & ~overflow).astype(jnp.int32),
      dropped_microbatches=state.dropped_microbatches + bad.astype(jnp.int32),
      # Write-only: reads its old value to keep its donated buffer.
      window_ended=_donation.written_over(state.window_ended, ends),
      loss_sum=jnp.where(ends, 0.0, losses.loss_sum),
      loss_nonfinite=~ends & losses.loss_nonfinite,
    )

  return OwnsStep(init_fn, update_fn)


def _initial_state(inner_state, params) -> AccumulationState:
  """The state before the first microbatch."""
  return AccumulationState(
    mini_step=jnp.zeros([], jnp.int32),
    windows=jnp.zeros([], jnp.int32),
    acc_grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
    clean_in_window=jnp.zeros([], jnp.int32),
    inner_state=inner_state,
    microbatches=jnp.zeros([], jnp.int32),
    applied_steps=jnp.zeros([], jnp.int32),
    dropped_microbatches=jnp.zeros([], jnp.int32),
    window_ended=jnp.bool_(False),
    loss_sum=jnp.zeros([], jnp.float32),
    loss_nonfinite=jnp.bool_(False),
  )


def _checked_microbatch(updates, acc_grads) -> list:
  """``updates``' leaves, checked against the accumulator's tree and shapes."""
  leaves, treedef = jax.tree.flatten(updates)
  acc_leaves, acc_def = jax.tree.flatten(acc_grads)
  if treedef != acc_def or any(
    jnp.shape(g) != a.shape for g, a in zip(leaves, acc_leaves)
  ):
    raise ValueError(
      "accumulate_gradients: the microbatch gradients must have the tree "
      f"structure and leaf shapes of the params; got {treedef} with shapes "
      f"{[jnp.shape(g) for g in leaves]}, params {acc_def} with shapes "
      f"{[a.shape for a in acc_leaves]}"
    )
  _norm.check_float_leaves(leaves, "accumulate_gradients gradients")
  return leaves


def _dropped(updates, step, inner_state) -> jax.Array:
  """Whether this microbatch holds an inf or NaN, on any device: measured
  by the plan the chain's loss-scale state holds."""
  plan = step.scale.state_plan(inner_state[0], updates)
  what = "accumulate_gradients"
  return _measure.measure(updates, 1.0, plan, what=what).overflow


class _Window(NamedTuple):
  """This microbatch's place in its window."""

  k: jax.Array  # int32 microbatches in the window, >= 1
  bad: jax.Array  # bool: this microbatch is dropped ("drop_microbatch")
  clean: jax.Array  # int32 microbatches accumulated, this one included

  @property
  def inv_k(self) -> jax.Array:
    return 1.0 / self.k.astype(jnp.float32)


class _Losses(NamedTuple):
  """The window's running loss, and the loss the window's step is told."""

  loss_sum: jax.Array
  loss_nonfinite: jax.Array
  window_loss: Optional[jax.Array]  # None without ``value=``

  @classmethod
  def of(cls, value, state: AccumulationState, window: _Window, drop: bool):
    if value is None:
      return cls(state.loss_sum, state.loss_nonfinite, None)
    value = _validate.scalar_loss(value).astype(jnp.float32)
    loss_sum = state.loss_sum + value * window.inv_k
    nonfinite = state.loss_nonfinite | ~jnp.isfinite(_norm.widen(value))
    if not drop:
      return cls(loss_sum, nonfinite, loss_sum)
    loss_sum = jnp.where(window.bad, state.loss_sum, loss_sum)
    # Mean of the clean microbatches' losses; with none, only whether a
    # loss was not finite matters (the window is skipped).
    window_loss = jnp.where(
      window.clean > 0,
      loss_sum * (window.k.astype(jnp.float32) / jnp.maximum(window.clean, 1)),
      jnp.where(nonfinite, jnp.float32(jnp.nan), value),
    )
    return cls(loss_sum, nonfinite, window_loss)


def _accumulated(acc, grads, window: _Window, drop: bool) -> list:
  """The accumulator plus ``grads / k`` (unchanged for a dropped one)."""

  def add(a, g):
    # widen: a float16 overflow poisons the sum even where XLA kept the
    # value in float32 (see _norm.widen).
    new = a + _norm.widen(g).astype(jnp.float32) * window.inv_k
    # A select, never a multiply: a dropped NaN must not reach the sum.
    return jnp.where(window.bad, a, new) if drop else new

  return [add(a, g) for a, g in zip(acc, grads)]


def _mean_of(acc, window: _Window, drop: bool):
  """The window's mean gradient from its accumulated sum of ``g / k``."""
  if not drop:
    return acc
  # Times k / clean; with no clean microbatch a NaN, so the guarded chain
  # skips the window.
  factor = jnp.where(
    window.clean > 0,
    window.k.astype(jnp.float32) / window.clean,
    jnp.float32(jnp.nan),
  )
  return jax.tree.map(lambda a: a * factor, acc)


def _end_window_if(ends, mean_of, step, operands, extra_args, *, in_range):
  """``(updates, inner_state, acc_grads, overflow)``: the ``step`` (a
  :class:`StepConfig`) on the window's mean, and the accumulator reset,
  when ``ends``; else ``-0.0`` updates. ``operands`` are the ``lax.cond``'s:
  (the accumulated gradients, the inner state, params)."""

  def run_inner(acc, inner_state, params):
    # The step on the window's mean, measured once inside it: an Outcome.
    return step.run(
      mean_of(acc),
      inner_state,
      params,
      extra=extra_args,
      in_float16_range=in_range,
    )

  out_shape = jax.eval_shape(run_inner, *operands).updates

  def final(acc, inner_state, params):
    out = run_inner(acc, inner_state, params)
    # Replaced, never multiplied by 0, which would keep a NaN.
    return (
      out.updates,
      out.state,
      jax.tree.map(jnp.zeros_like, acc),
      out.overflow,
    )

  def middle(acc, inner_state, params):
    del params
    skip = jax.tree.map(_skip_like, out_shape)
    return skip, inner_state, acc, jnp.bool_(False)

  return lax.cond(ends, final, middle, *operands)
