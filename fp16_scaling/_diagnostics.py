"""Host-side reports and checks of what ``fp16_loss_scale`` recorded:
``overflow_report`` and ``raise_if_min_scale_reached``, and the opt-in
overflow line the step prints through a host callback (``log_overflows``;
docs/diagnostics.md).
"""

import dataclasses
import functools
import math
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from fp16_scaling import _lookup
from fp16_scaling import _stacked
from fp16_scaling import _validate
from fp16_scaling._metrics import headroom_bits
from fp16_scaling._metrics import suspect_unscaled_grads
from fp16_scaling._states import KINDS

_ADVICE = {
  "none": "Nothing to do: the last step was clean.",
  "unknown": (
    "Pass the loss as tx.update(grads, opt_state, params, value=loss) to "
    "tell an overflow of the forward pass (no scale fixes it) from one of "
    "the backward pass (the scale was too high; the scaler backs off)."
  ),
  "backward": (
    "The loss was finite and the scaled gradients overflowed float16: the "
    "scale was too high. This is normal while a dynamic scaler probes for "
    "its scale; it has backed off. Act only if skipped steps keep piling up: "
    "lower the initial scale or lengthen the growth window."
  ),
  "absorbed": (
    "The loss was finite and the scaled gradients overflowed float16: the "
    "scale was too high. The scale was not lowered on this step: hysteresis "
    "absorbed the overflow (the scale backs off on the next overflow before "
    "a growth). Act only if skipped steps keep piling up: lower the initial "
    "scale or lengthen the growth window."
  ),
  "forward": (
    "The loss itself was not finite: the forward pass overflowed (float16 "
    "activations or logits past 65504, a log or division of 0). No loss "
    "scale fixes this: compute the listed leaves' layers, softmax and loss "
    "in float32, check the input batch, or lower the learning rate."
  ),
  "unscaled": (
    "The scale reached {scale} with no overflow since the state was built: "
    "float16 gradients made at it overflow from |g| of 2^-8 up, so this "
    "scaler's growth never met float16's range. Likely cause: the "
    "gradients were not made at the scale (the loss not multiplied by "
    "fs.current_scale(opt_state): take them with fs.value_and_grad(loss_fn, "
    "opt_state), whose gradients go to tx.update as they are), and the "
    "updates come out divided by the scale. Or the gradients are not "
    "float16 (a float32 model needs no loss scale: fs.no_scaler()). If "
    "they are float16 and made at the scale, they are only small (below "
    "2^-8): nothing to do."
  ),
  "persistent": (
    "The scale sits at its floor (a static scale, or no scaling, cannot "
    "back off: it always does) and the gradients still overflow: no "
    "back-off fixes this. The listed leaves hold inf or NaN: look for a "
    "diverged parameter, bad input data or a learning rate too high in "
    "their layers; pass value=loss to see whether the loss itself is "
    "finite. A static scale may also be too high: lower it, or use a "
    "dynamic scaler."
  ),
}

# After an overflow step's advice: the tool that names the op.
_LOCATE = (
  " To find the op that overflowed (its line and module, forward or "
  "backward): print(fs.locate_overflow(loss_fn, opt_state)(params, "
  "*batch)) with this step's batch, on the host (docs/locate-overflow.md)."
)

_SELECT_NOTE = (
  "The step was skipped: params and optimizer state are kept. Model state "
  "outside optax (BatchNorm statistics, an EMA) is kept only by "
  "fs.select_on_overflow(opt_state, new=..., old=...) after tx.update; "
  "this report reads the optimizer state alone and cannot see whether it "
  "was called."
)


class MinLossScaleError(RuntimeError):
  """An overflow wanted to lower a loss scale already at its minimum
  (raised on the host by :func:`raise_if_min_scale_reached`)."""


MinLossScaleError.__module__ = "fp16_scaling"  # its public name
# The limits of raise_if_min_scale_reached, in the order they are checked;
# each bounds a count of the state (floor overflows, steps skipped in a row).
_LIMITS = ("max_floor_overflows", "max_consecutive_errors")


@dataclasses.dataclass(frozen=True)
class LeafRange:
  """One leaf's gradient range on the last step (``grad_range=True``)."""

  max_abs: float
  headroom_bits: float
  zero_fraction: float


@dataclasses.dataclass(frozen=True)
class OverflowReport:
  """Where and why the gradients overflowed; see :func:`overflow_report`.

  Attributes:
    step_overflowed: whether the last step overflowed (and was skipped).
    nonfinite_leaves: paths (``jax.tree_util.keystr``) of the gradient
      leaves that held an inf or NaN on the last step, in tree order.
    counts: path -> number of steps on which that leaf held an inf or NaN,
      for every leaf with a nonzero count, in tree order.
    kind: the last step's overflow kind, one of ``OVERFLOW_KINDS``: "none",
      "unknown" (no ``value=`` given), "forward" (the loss itself was not
      finite), "backward" (a finite loss, non-finite gradients) or
      "persistent" (the scale sat at its floor and the gradients still
      overflowed, with a loss that was finite or not given).
    scale: the loss scale the last step's gradients were made with.
    next_scale: the scale for the next step.
    skipped_steps: overflowing (skipped) steps so far.
    floor_overflows: overflows that hit the scale's floor so far.
    grad_range: path -> :class:`LeafRange`, with ``grad_range=True``.
    top: how many leaves ``str()`` lists.
    layer_counts: with ``stacked_axes``, layer -> the most steps on which
      any one of its stacked leaves held an inf or NaN (if any).
    nonfinite_layers: with ``stacked_axes``, the layers whose gradient held
      an inf or NaN in any stacked leaf on the last step.
    suspect_unscaled_grads: the scale reached 2^24 with no overflow since
      the state was built (``ScaleMetrics.suspect_unscaled_grads``): the
      advice names the likely cause, gradients not made at the scale.

  On an overflow step ``str()`` also says that model state outside optax
  (BatchNorm statistics, an EMA) follows the skip only through
  :func:`select_on_overflow`: the report reads the optimizer state alone,
  so it cannot see whether the step called it.

  With ``stacked_axes`` a path names one layer of a stacked leaf, as
  ``['layers']['W'][5]``.
  """

  step_overflowed: bool
  nonfinite_leaves: Tuple[str, ...]
  counts: Dict[str, int]
  kind: str
  scale: float
  next_scale: float
  skipped_steps: int
  floor_overflows: int
  grad_range: Optional[Dict[str, LeafRange]]
  top: int = 10
  layer_counts: Dict[int, int] = dataclasses.field(default_factory=dict)
  nonfinite_layers: Tuple[int, ...] = ()
  suspect_unscaled_grads: bool = False

  def top_leaves(self) -> list:
    """Up to ``top`` (path, count) pairs, most overflows first."""
    return sorted(self.counts.items(), key=lambda kv: -kv[1])[: self.top]

  def top_leaves_text(self) -> str:
    """``path (count)`` for :meth:`top_leaves`, comma-separated."""
    shown = [f"{p} ({n})" for p, n in self.top_leaves()]
    more = len(self.counts) - len(shown)
    text = ", ".join(shown) + (f", and {more} more" if more > 0 else "")
    return text or "none"

  def advice(self) -> str:
    """What to do about the last overflow (or the run's, if it was clean);
    after an overflow, how to find the op that made it."""
    if self.suspect_unscaled_grads:
      return _ADVICE["unscaled"].format(scale=fmt_scale(self.next_scale))
    if self.kind == "none" and self.skipped_steps:
      return (
        "The last step was clean; earlier skipped steps were the scaler "
        "probing for its scale unless the counts above keep growing."
      )
    advice = _ADVICE[self.kind]
    if self.kind == "backward" and not self.next_scale < self.scale:
      advice = _ADVICE["absorbed"]
    if self.step_overflowed:
      advice += _LOCATE
    return advice

  def __str__(self) -> str:
    last = f"OVERFLOWED ({self.kind})" if self.step_overflowed else "clean"
    lines = [
      f"Last step {last} at loss scale {fmt_scale(self.scale)}; next scale "
      f"{fmt_scale(self.next_scale)}.",
      f"Skipped steps so far: {self.skipped_steps}; overflows at the "
      f"scale's floor: {self.floor_overflows}.",
    ]
    if self.step_overflowed:
      n = len(self.nonfinite_leaves)
      lines.append(f"Non-finite gradient leaves on the last step ({n}):")
      lines += [f"  {p}" for p in self.nonfinite_leaves[: self.top]]
      lines += self._more(n)
      if self.nonfinite_layers:
        layers = ", ".join(map(str, self.nonfinite_layers))
        lines.append(
          f"Layers with a non-finite gradient on the last step: {layers}"
        )
      lines.append(_SELECT_NOTE)
    if self.counts:
      lines.append(
        f"Steps with a non-finite gradient, per leaf (top {self.top}):"
      )
      width = max(len(str(n)) for n in self.counts.values())
      lines += [f"  {n:>{width}}  {p}" for p, n in self.top_leaves()]
      lines += self._more(len(self.counts), " more leaves")
    if self.layer_counts:
      by_layer = sorted(self.layer_counts.items(), key=lambda kv: -kv[1])
      lines.append(
        "Steps with a non-finite gradient, by layer (the most of its "
        f"stacked leaves; top {self.top}):"
      )
      lines += [f"  {n:>{width}}  layer {k}" for k, n in by_layer[: self.top]]
    if self.grad_range:
      lines.append(
        f"Gradient range of the last step, least headroom first (top "
        f"{self.top}): max|g|, headroom bits at {fmt_scale(self.scale)}, "
        "zero fraction"
      )
      lines += self._range_rows()
    lines.append("What to do: " + self.advice())
    return "\n".join(lines)

  def _range_rows(self) -> list:
    """The gradient-range rows: the finite leaves by headroom, then apart
    those that held an inf or NaN, whose range is of their finite values
    only (none, for a leaf with no finite nonzero value)."""
    bad = set(self.nonfinite_leaves)
    finite = [kv for kv in self.grad_range.items() if kv[0] not in bad]
    lines = [
      f"  {r.max_abs:10.3g}  {r.headroom_bits:6.1f}  "
      f"{r.zero_fraction:6.1%}  {p}"
      for p, r in sorted(finite, key=lambda kv: kv[1].headroom_bits)[: self.top]
    ]
    held = [(p, self.grad_range[p]) for p in self.nonfinite_leaves]
    if held:
      lines.append(
        f"  Not ranked, held an inf or NaN on the last step ({len(held)}; "
        "max|g| of their finite values):"
      )
    for p, r in held[: self.top]:
      peak = f"{r.max_abs:10.3g}" if r.max_abs > 0 else "      none"
      lines.append(f"  {peak}  {'-':>6}  {r.zero_fraction:6.1%}  {p}")
    return lines + self._more(len(held), " more")

  def _more(self, n: int, what: str = "") -> list:
    """The line that counts the rows of ``n`` past ``top``, if any."""
    return [f"  ... and {n - self.top}{what}"] if n > self.top else []


def fmt_scale(s: float) -> str:
  """``s`` as ``2^k`` when it is a power of two."""
  if s > 0 and math.isfinite(s):
    k = math.log2(s)
    if k == int(k):
      return f"2^{int(k)}"
  return f"{s:g}"


def overflow_report(opt_state: Any, *, top: int = 10) -> OverflowReport:
  """Which gradient leaves overflowed, how often, at what scale, and why.

  Reads the state that ``fp16_loss_scale`` keeps; call it on the host.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    top: how many leaves the printed report lists; an integer >= 1.

  Returns:
    An :class:`OverflowReport`; ``print`` it for a readable summary.

  Raises:
    ValueError: not one (unbatched) :class:`LossScaleState`; a bad ``top``.
    TypeError: called inside ``jit`` (``opt_state`` holds tracers).

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(4.0)), optax.sgd(1.0))
    >>> params = {"a": {"w": jnp.ones(2)}, "b": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> grads = {"a": {"w": jnp.array([jnp.inf, 0.0])}, "b": jnp.ones(3)}
    >>> _, state = tx.update(grads, state, params)
    >>> report = fs.overflow_report(state)
    >>> report.nonfinite_leaves, report.counts
    (("['a']['w']",), {"['a']['w']": 1})
  """
  top = _validate.count("top", top)
  _validate.require_host(opt_state, "overflow_report")
  ls = _lookup.loss_scale_state(opt_state)
  host = jax.device_get(ls._replace(leaf_paths=None))
  if np.ndim(host.overflow):
    raise ValueError(
      "overflow_report reads one optimizer state; this one is batched "
      f"(shape {np.shape(host.overflow)}, as jax.vmap(tx.init) makes). Ask "
      "for one member's report: fs.overflow_report(jax.tree.map(lambda x: "
      "x[i], opt_state))."
    )
  paths = ls.leaf_paths.paths
  flags = np.asarray(host.leaf_nonfinite, bool)
  counts = np.asarray(host.leaf_nonfinite_steps)
  scale = float(host.prev_loss_scale)
  grad_range = None
  if host.grad_range is not None:
    max_abs = np.asarray(host.grad_range.max_abs, np.float64)
    bits = np.asarray(headroom_bits(max_abs, scale))
    zeros = np.asarray(host.grad_range.zero_fraction)
    grad_range = {
      p: LeafRange(float(m), float(b), float(z))
      for p, m, b, z in zip(paths, max_abs, bits, zeros)
    }
  by_layer = _stacked.by_layer(counts, flags, ls.leaf_paths)
  return OverflowReport(
    step_overflowed=bool(host.overflow),
    nonfinite_leaves=tuple(p for p, bad in zip(paths, flags) if bad),
    counts={p: int(n) for p, n in zip(paths, counts) if n},
    kind=KINDS[int(host.overflow_kind)],
    scale=scale,
    next_scale=float(host.scaler.loss_scale),
    skipped_steps=int(host.skipped_steps),
    floor_overflows=int(host.scaler.floor_overflows),
    grad_range=grad_range,
    top=top,
    layer_counts=by_layer[0],
    nonfinite_layers=by_layer[1],
    suspect_unscaled_grads=bool(suspect_unscaled_grads(host)),
  )


def raise_if_min_scale_reached(
  opt_state: Any,
  *,
  max_floor_overflows: Optional[int] = None,
  max_consecutive_errors: Optional[int] = None,
) -> None:
  """Host-side check: raises where DeepSpeed's ``raise_error_at_min_scale``
  would, or for any preset once its scale keeps overflowing at its floor,
  or once too many steps in a row were skipped.

  A jitted step cannot raise, so the state counts those overflows; call this
  on the host (say when logging). A scale that cannot back off
  (:func:`static_scaler`, :func:`no_scaler`) is always at its floor.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    max_floor_overflows: if set (an integer >= 1), also raise once this many
      overflows hit the floor, whatever the preset.
    max_consecutive_errors: if set (an integer >= 1), also raise once this
      many steps in a row were skipped (``consecutive_skipped_steps``), as
      ``optax.apply_if_finite``'s argument of that name stops applying.
      A dynamic scaler skips some steps in a row while it backs off from a
      high initial scale (about 16 from DeepSpeed's 2^32): leave room.

  Raises:
    TypeError: called inside ``jit`` (``opt_state`` holds tracers).
    MinLossScaleError: an overflow hit the floor with
      ``raise_error_at_min_scale=True``, or a limit was reached.

  Examples:
    >>> import jax.numpy as jnp, fp16_scaling as fs
    >>> tx = fs.chain(fs.fp16_loss_scale(
    ...     fs.deepspeed_scaler(init_scale=1.0, min_scale=1.0)))
    >>> state = tx.init({"w": jnp.ones(1)})
    >>> _, state = tx.update({"w": jnp.array([jnp.nan])}, state)
    >>> fs.raise_if_min_scale_reached(state)
    Traceback (most recent call last):
    ...
    fp16_scaling.MinLossScaleError: Current loss scale already at
    minimum (1.0) - cannot decrease scale anymore: 1 overflowing step(s) ...
  """
  given = zip(_LIMITS, (max_floor_overflows, max_consecutive_errors))
  limits = {k: _validate.count(k, v) for k, v in given if v is not None}
  _validate.require_host(opt_state, "raise_if_min_scale_reached")
  ls = _lookup.loss_scale_state(opt_state)
  ls = jax.device_get(ls._replace(leaf_paths=None))
  # Summed, so that a batched (vmapped) state raises if any member would.
  errors = int(np.sum(ls.scaler.min_scale_errors))
  seen = zip(_LIMITS, (ls.scaler.floor_overflows, ls.consecutive_skipped_steps))
  counts = {k: int(np.max(v)) for k, v in seen}
  reached = [k for k in limits if counts[k] >= limits[k]]
  scale = float(np.min(ls.scaler.loss_scale))
  at_min = (
    f"Current loss scale already at minimum ({scale}) - cannot decrease "
    "scale anymore: "
  )
  if errors:
    why = (
      f"{at_min}{errors} overflowing step(s) hit the floor (DeepSpeed "
      "raises here; raise_error_at_min_scale=True)"
    )
  elif "max_floor_overflows" in reached:
    why = (
      f"{at_min}{counts['max_floor_overflows']} overflowing step(s) hit "
      f"the floor (max_floor_overflows={limits['max_floor_overflows']})"
    )
  elif reached:
    why = (
      f"{counts['max_consecutive_errors']} steps in a row were skipped "
      f"(max_consecutive_errors={limits['max_consecutive_errors']}), the "
      f"last at loss scale {scale}"
    )
  else:
    return
  if np.ndim(ls.scaler.loss_scale) == 0:
    report = overflow_report(opt_state, top=5)
    detail = (
      f" Last overflow: {report.kind}. Leaves that kept overflowing: "
      f"{report.top_leaves_text()}. {report.advice()}"
    )
  else:  # a batched state: the report reads one member's leaves
    detail = " Call overflow_report on one member to see its leaves."
  raise MinLossScaleError(f"{why}.{detail}")


def _print_overflow(paths, skipped, kind, old, new, nonfinite):
  """Prints the overflow line (a host callback)."""
  # Plain numpy first: iterating a jax.Array dispatches a computation, which
  # inside a host callback can deadlock the runtime that called it.
  nonfinite = np.asarray(nonfinite)
  leaves = [p for p, bad in zip(paths, nonfinite.tolist()) if bad]
  shown = ", ".join(leaves[:10]) + (" ..." if len(leaves) > 10 else "")
  print(
    f"[fp16_scaling] OVERFLOW! Skipping step ({int(skipped)} skipped so "
    f"far, {KINDS[int(kind)]}). Attempted loss scale: {float(old):g}, "
    f"reducing to {float(new):g}; non-finite gradient leaves "
    f"({len(leaves)}): {shown or '(none)'}"
  )


def log_if_overflow(old: Any, new: Any) -> None:
  """Prints the DeepSpeed-style overflow line (``fp16_loss_scale(...,
  log_overflows=True)``) from inside the step, on overflow steps only: a
  host callback under a ``lax.cond`` on the new state's flag.

  Args:
    old: the :class:`LossScaleState` the step was given.
    new: the one it returns.
  """
  log = functools.partial(_print_overflow, old.leaf_paths.paths)
  scales = (old.scaler.loss_scale, new.scaler.loss_scale)
  args = (new.skipped_steps, new.overflow_kind, *scales, new.leaf_nonfinite)
  jax.lax.cond(
    new.overflow, lambda: jax.debug.callback(log, *args), lambda: None
  )
