"""One loss-scale state machine, and the presets that configure it as each
peer's scaler (docs/peers.md; docs/design.md, "The state machine").
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fp16_scaling import _validate

F16_MAX = 65504.0  # float16's largest finite value


class ScalerState(NamedTuple):
  """State of the loss-scale machine.

  Attributes:
    loss_scale: float32 scale to multiply the *next* loss by.
    growth_tracker: int32 clean steps counted towards the next growth.
    hysteresis_left: int32 overflows still absorbed before a back-off
      (``hysteresis - 1`` when full).
    min_scale_errors: int32 overflows that found the scale at its floor
      (:meth:`Scaler.at_floor`) with no hysteresis left, so that it could
      not back off, counted only when ``raise_at_min_scale`` (DeepSpeed's
      ``raise_error_at_min_scale``, where DeepSpeed raises):
      :func:`raise_if_min_scale_reached` raises once it is above 0.
    floor_overflows: int32 the same overflows, counted for every preset
      whatever ``raise_at_min_scale`` says: a run that keeps overflowing at
      its floor has a problem scaling cannot fix. Every overflow of a scale
      that cannot back off (static, or no scaling) counts here. An overflow
      that hysteresis absorbs, or one that backs the scale off onto the
      floor, counts in neither.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_left: jax.Array
  min_scale_errors: jax.Array
  floor_overflows: jax.Array


class WindowedScalerState(NamedTuple):
  """:class:`ScalerState` with the window of ``headroom_scaler(history=W)``,
  ``W > 1``. A type of its own, so that every other scaler's state (and
  its checkpoints) keeps :class:`ScalerState`'s five fields.

  Attributes:
    loss_scale: as :class:`ScalerState`'s.
    growth_tracker: as :class:`ScalerState`'s.
    hysteresis_left: as :class:`ScalerState`'s.
    min_scale_errors: as :class:`ScalerState`'s.
    floor_overflows: as :class:`ScalerState`'s.
    grad_max_history: float32 ``[history]`` ring of the largest unscaled
      ``|g|`` of the last ``history`` clean steps (0.0 where no step has been
      yet).
    history_position: int32 slot of ``grad_max_history`` the next clean
      step writes.
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array
  hysteresis_left: jax.Array
  min_scale_errors: jax.Array
  floor_overflows: jax.Array
  grad_max_history: jax.Array
  history_position: jax.Array


@dataclasses.dataclass(frozen=True)
class Scaler:
  """Configuration of the loss-scale machine. Build one with a preset.

  Attributes:
    init_scale: first loss scale.
    growth_factor: multiplier on growth (1.0 never grows).
    backoff_factor: multiplier on back-off (1.0 never backs off).
    growth_interval: clean steps between growths.
    growth_delay: extra clean steps before the first growth after an overflow.
    min_scale: floor of the scale on back-off.
    hysteresis: overflows in a row (with no growth between) to back off.
    consecutive_hysteresis: refill hysteresis on every clean step.
    raise_at_min_scale: count overflows at the floor in ``min_scale_errors``.
    headroom_bits: if set, see :func:`headroom_scaler`.
    growth_margin_bits: with ``headroom_bits``, see :func:`headroom_scaler`.
    max_scale: ceiling of the scale on every growth path (a scale that
      would grow past it grows to it).
    history: with ``headroom_bits``, see :func:`headroom_scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.torch_scaler(init_scale=8.0, growth_interval=2)
    >>> state = scaler.init()
    >>> for overflow in [False, False, True]:
    ...   state = scaler.update(state, overflow)
    ...   print(float(state.loss_scale))
    8.0
    16.0
    8.0

  References:
    Micikevicius et al., Mixed Precision Training, ICLR 2018.
  """

  init_scale: float
  growth_factor: float = 1.0
  backoff_factor: float = 1.0
  growth_interval: int = 1
  growth_delay: int = 0
  min_scale: float = _validate.F32_TINY
  hysteresis: int = 1
  consecutive_hysteresis: bool = False
  raise_at_min_scale: bool = False
  headroom_bits: Optional[float] = None
  growth_margin_bits: float = 0.0
  max_scale: float = _validate.F32_MAX
  history: int = 1

  @property
  def dynamic(self) -> bool:
    return self.growth_factor != 1.0 or self.backoff_factor != 1.0

  @property
  def needs_grad_max(self) -> bool:
    """Whether :meth:`update` needs the step's largest gradient magnitude."""
    return self.headroom_bits is not None

  def at_floor(self, scale: jax.Array) -> jax.Array:
    """Whether ``scale`` sits at the floor: it cannot back off any further.

    Args:
      scale: float32 scalar, a loss scale of this machine.

    Returns:
      A bool scalar: ``scale <= min_scale``; always True when
      ``backoff_factor`` is 1.0 (a static scale, or no scaling, cannot back
      off, so each of its overflows is a floor overflow of kind
      ``persistent``).
    """
    if self.backoff_factor == 1.0:
      return jnp.bool_(True)
    return scale <= jnp.float32(self.min_scale)

  def init(self) -> ScalerState:
    """The state before the first step: ``init_scale``, the growth counter
    at ``-growth_delay``, hysteresis full, both floor counters at 0, and
    (``history > 1`` only) an empty window of gradient maxima."""
    state = ScalerState(
      loss_scale=jnp.asarray(self.init_scale, jnp.float32),
      growth_tracker=jnp.asarray(-self.growth_delay, jnp.int32),
      hysteresis_left=jnp.asarray(self.hysteresis - 1, jnp.int32),
      min_scale_errors=jnp.zeros([], jnp.int32),
      floor_overflows=jnp.zeros([], jnp.int32),
    )
    ring = jnp.zeros([self.history], jnp.float32)
    return self._with_window(state, (ring, jnp.zeros([], jnp.int32)))

  def _with_window(self, state: ScalerState, window: tuple):
    """``state``, with the ``window`` (ring, position) when ``history > 1``
    (a :class:`WindowedScalerState`), else as it is."""
    if self.history == 1:
      return state
    ring, position = window
    return WindowedScalerState(
      **state._asdict(), grad_max_history=ring, history_position=position
    )

  def update(
    self,
    state: ScalerState,
    overflow: jax.Array,
    grad_max: Optional[jax.Array] = None,
  ) -> ScalerState:
    """Advances the machine by one step.

    The rule reads :class:`ScalerState`'s five fields; with ``history > 1``
    the state is a :class:`WindowedScalerState`, whose two more fields (the
    window) only :meth:`_window` reads and writes.

    Args:
      state: the state before the step, whose scale made its gradients.
      overflow: scalar bool, whether those had a non-finite element.
      grad_max: float32 largest finite magnitude of the step's unscaled
        gradients; required when :attr:`needs_grad_max`, else ignored.

    Returns:
      The state after the step (jnp selects only; it jits and scans).
    """
    scale = state.loss_scale
    overflow = jnp.asarray(overflow, jnp.bool_)
    full = jnp.int32(self.hysteresis - 1)
    # Counters read within this machine's ranges (docs/design.md).
    left = jnp.clip(state.hysteresis_left, 0, full)
    counted = jnp.clip(
      state.growth_tracker, -self.growth_delay, self.growth_interval - 1
    )

    # Overflow: absorbed while hysteresis is left, else back off to the floor.
    absorbed = left > 0
    backed_off = jnp.maximum(
      scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_scale)
    )
    scale_after_overflow = jnp.where(absorbed, scale, backed_off)
    hysteresis_after_overflow = jnp.maximum(left - 1, 0)
    hit_floor = ~absorbed & self.at_floor(scale)

    # Clean step: count, and grow when the interval is complete.
    tracker = counted + 1
    grow = tracker == self.growth_interval
    grown = scale * jnp.float32(self.growth_factor)
    # Growth stops at max_scale on every path (F32_MAX unless a preset sets
    # it, where this is the isfinite check alone).
    capped = jnp.minimum(grown, jnp.float32(self.max_scale))
    scale_after_clean = jnp.where(grow & jnp.isfinite(grown), capped, scale)
    window = state[len(ScalerState._fields) :]  # () without a window
    if self.headroom_bits is not None:
      window_max, window = self._measured_max(state, overflow, grad_max)
      scale_after_clean = self._headroom_scale(scale, window_max, capped)
    refill = grow | self.consecutive_hysteresis
    hysteresis_after_clean = jnp.where(refill, full, left)

    floored = (overflow & hit_floor).astype(jnp.int32)
    errors = state.min_scale_errors
    if self.raise_at_min_scale:
      errors = errors + floored
    new = ScalerState(
      loss_scale=jnp.where(overflow, scale_after_overflow, scale_after_clean),
      growth_tracker=jnp.where(
        overflow,
        jnp.int32(-self.growth_delay),
        jnp.where(grow, jnp.int32(0), tracker),
      ),
      hysteresis_left=jnp.where(
        overflow, hysteresis_after_overflow, hysteresis_after_clean
      ),
      min_scale_errors=errors,
      floor_overflows=state.floor_overflows + floored,
    )
    return self._with_window(new, window)

  def _measured_max(self, state: ScalerState, overflow, grad_max) -> tuple:
    """``(largest gradient the headroom rule reads, window after the
    step)``: the step's ``grad_max``, or with ``history > 1`` the window's
    largest, ``grad_max`` written in."""
    if grad_max is None:
      raise ValueError("a headroom scaler needs the step's grad_max")
    grad_max = jnp.asarray(grad_max, jnp.float32)
    if self.history == 1:
      return grad_max, ()
    return self._window(state, overflow, grad_max)

  def _window(self, state: ScalerState, overflow, grad_max: jax.Array):
    """``(window_max, (ring, position))`` after a step: a clean step writes
    ``grad_max`` into the ring's oldest slot; an overflow leaves it."""
    # Read within range, whatever a checkpoint held: an entry that is not a
    # finite magnitude counts as no step, a position wraps into the ring.
    ring = state.grad_max_history
    ring = jnp.where(jnp.isfinite(ring), jnp.abs(ring), jnp.float32(0))
    position = jnp.mod(state.history_position, self.history)
    written = ring.at[position].set(grad_max)
    ring = jnp.where(overflow, ring, written)
    position = jnp.where(overflow, position, (position + 1) % self.history)
    return jnp.max(written), (ring, position.astype(jnp.int32))

  def _headroom_scale(self, scale: jax.Array, grad_max: jax.Array, capped):
    """The next scale after a clean step, from the largest gradient (of
    the window, with ``history``); ``capped`` is the counted growth's,
    ``min(scale * growth_factor, max_scale)``."""
    # float16's max over (largest gradient times 2**bits); +inf when every
    # gradient is zero, and then the growth cap decides. Never NaN.
    target = jnp.float32(F16_MAX) / (
      grad_max * jnp.float32(2.0**self.headroom_bits)
    )
    # Rounded down to a power of two, exactly: target = m * 2**e, m in [.5, 1).
    _, exponent = jnp.frexp(target)
    target = jnp.where(
      jnp.isfinite(target), jnp.ldexp(jnp.float32(1), exponent - 1), target
    )
    capped = jnp.minimum(target, capped)
    # Fall at once (the largest gradient is nearer the top than asked); grow
    # only with the margin to spare.
    margin = jnp.float32(2.0**self.growth_margin_bits)
    move = (target < scale) | (target >= scale * margin)
    return jnp.maximum(
      jnp.where(move, capped, scale), jnp.float32(self.min_scale)
    )


_TWINS = {
  "jmp": (
    ": jmp's scale, which fs.jmp_scaler(loss_scale=..., period=..., "
    "factor=..., min_loss_scale=...) runs step for step; a running one's "
    "scale and counter move in with fs.load_scaler_state_dict"
  ),
  "torch": ": PyTorch's; its twin is fs.torch_scaler(init_scale=...)",
  "keras": ": Keras's; its twin is fs.keras_scaler(initial_scale=...)",
}


def check_scaler(scaler: Any) -> Scaler:
  """``scaler``, checked to be a :class:`Scaler`: the one check of every
  function that takes one.

  Args:
    scaler: the value given as a ``scaler`` argument.

  Returns:
    ``scaler``.

  Raises:
    TypeError: ``scaler`` is not a :class:`Scaler`; the message names the
      presets and the type given.
  """
  if not isinstance(scaler, Scaler):
    # Another library's scaler object: name the preset that is its twin.
    home = type(scaler).__module__.split(".")[0]
    twin = _TWINS.get(home, "")
    raise TypeError(
      "scaler must be a Scaler from a preset such as fs.torch_scaler(), "
      f"got {type(scaler).__name__}{twin}"
    )
  return scaler


def static_scaler(scale: float) -> Scaler:
  """A fixed loss scale (DeepSpeed's ``fp16.loss_scale`` > 0).

  Args:
    scale: the loss scale, a positive normal float32.

  Returns:
    A :class:`Scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.static_scaler(128.0)
    >>> state = scaler.update(scaler.init(), overflow=True)
    >>> print(float(state.loss_scale))
    128.0
  """
  return Scaler(init_scale=_validate.scale("scale", scale))


def no_scaler() -> Scaler:
  """No loss scaling (scale 1.0), for bfloat16 or float32 training.

  Returns:
    A :class:`Scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> print(fs.no_scaler().init_scale)
    1.0
  """
  return Scaler(init_scale=1.0)


def scale_bound(
  name: str, value: float, init_scale: float, *, ceiling: bool = False
) -> float:
  """``value``, checked to be a scale on the side of ``init_scale`` it
  bounds: a floor at most ``init_scale``, a ``ceiling`` at least it.

  Raises:
    ValueError: ``value`` is not a scale, or lies on the other side of
      ``init_scale``; the message names ``name``.
  """
  value = _validate.scale(name, value)
  if value < init_scale if ceiling else value > init_scale:
    how = "be at least" if ceiling else "not exceed"
    raise ValueError(
      f"{name} must {how} the initial scale ({init_scale!r}), got {value!r}"
    )
  return value


def deepspeed_scaler(
  *,
  init_scale: float = 2.0**32,
  scale_window: int = 1000,
  min_scale: float = 1.0,
  delayed_shift: int = 1,
  consecutive_hysteresis: bool = False,
  raise_error_at_min_scale: bool = True,
) -> Scaler:
  """DeepSpeed's ``DynamicLossScaler``, step for step (docs/peers.md).

  Args:
    init_scale: initial scale (DeepSpeed: ``2 ** initial_scale_power``).
    scale_window: clean steps between growths (``loss_scale_window``).
    min_scale: floor (``min_loss_scale``), at most ``init_scale``.
    delayed_shift: overflows in a row needed to back off (``hysteresis``).
    consecutive_hysteresis: refill hysteresis on every clean step.
    raise_error_at_min_scale: count overflows at the floor so that
      :func:`raise_if_min_scale_reached` raises where DeepSpeed does.

  Returns:
    A :class:`Scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.deepspeed_scaler(init_scale=8.0, scale_window=2)
    >>> state = scaler.init()
    >>> for _ in range(3):
    ...   state = scaler.update(state, overflow=False)
    ...   print(float(state.loss_scale))
    8.0
    8.0
    16.0

  References:
    DeepSpeed 0.19, ``deepspeed/runtime/fp16/loss_scaler.py``.
  """
  init_scale = _validate.scale("init_scale", init_scale)
  return Scaler(
    init_scale=init_scale,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=_validate.count("scale_window", scale_window),
    growth_delay=1,
    min_scale=scale_bound("min_scale", min_scale, init_scale),
    hysteresis=_validate.count("delayed_shift", delayed_shift),
    consecutive_hysteresis=_validate.flag(
      "consecutive_hysteresis", consecutive_hysteresis
    ),
    raise_at_min_scale=_validate.flag(
      "raise_error_at_min_scale", raise_error_at_min_scale
    ),
  )


def torch_scaler(
  *,
  init_scale: float = 2.0**16,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
) -> Scaler:
  """``torch.amp.GradScaler``, step for step (docs/peers.md).

  Designed differences: a floor at float32's smallest normal; float32 factors.

  Args:
    init_scale: initial scale.
    growth_factor: growth multiplier, above 1.
    backoff_factor: back-off multiplier in (0, 1).
    growth_interval: consecutive clean steps between growths.

  Returns:
    A :class:`Scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.torch_scaler(init_scale=8.0, growth_interval=2)
    >>> state = scaler.init()
    >>> for _ in range(2):
    ...   state = scaler.update(state, overflow=False)
    >>> print(float(state.loss_scale))
    16.0

  References:
    PyTorch 2.13, ``torch.amp.GradScaler`` and ``torch._amp_update_scale_``.
  """
  return Scaler(
    init_scale=_validate.scale("init_scale", init_scale),
    growth_factor=_validate.above_one("growth_factor", growth_factor),
    backoff_factor=_validate.open_unit("backoff_factor", backoff_factor),
    growth_interval=_validate.count("growth_interval", growth_interval),
  )


def megatron_scaler(
  *,
  initial_scale: float = 2.0**32,
  min_scale: float = 1.0,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 1000,
  hysteresis: int = 2,
) -> Scaler:
  """Megatron-core's ``DynamicGradScaler``, step for step (docs/peers.md).

  Defaults are Megatron's command-line defaults.

  Args:
    initial_scale: initial scale.
    min_scale: floor, at most ``initial_scale``.
    growth_factor: growth multiplier, above 1.
    backoff_factor: back-off multiplier in (0, 1).
    growth_interval: clean steps between growths.
    hysteresis: overflows (with no growth between) needed to back off.

  Returns:
    A :class:`Scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.megatron_scaler(initial_scale=8.0)
    >>> state = scaler.init()
    >>> for _ in range(2):
    ...   state = scaler.update(state, overflow=True)
    ...   print(float(state.loss_scale))
    8.0
    4.0

  References:
    Megatron-core 0.16, ``megatron/core/optimizer/grad_scaler.py``.
  """
  initial_scale = _validate.scale("initial_scale", initial_scale)
  return Scaler(
    init_scale=initial_scale,
    growth_factor=_validate.above_one("growth_factor", growth_factor),
    backoff_factor=_validate.open_unit("backoff_factor", backoff_factor),
    growth_interval=_validate.count("growth_interval", growth_interval),
    min_scale=scale_bound("min_scale", min_scale, initial_scale),
    hysteresis=_validate.count("hysteresis", hysteresis),
  )


def flax_scaler(
  *,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  scale: float = 2.0**16,
  minimum_scale: float = _validate.F32_TINY,
) -> Scaler:
  """Flax's ``flax.training.dynamic_scale.DynamicScale`` (docs/peers.md).

  It grows every ``growth_interval + 1`` clean steps, as Flax does.

  Args:
    growth_factor: growth multiplier, above 1.
    backoff_factor: back-off multiplier in (0, 1).
    growth_interval: Flax's ``growth_interval``.
    scale: initial scale (Flax's ``scale``).
    minimum_scale: floor, at most ``scale``.

  Returns:
    A :class:`Scaler`.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.flax_scaler(growth_interval=2, scale=8.0)
    >>> state = scaler.init()
    >>> for _ in range(3):
    ...   state = scaler.update(state, overflow=False)
    ...   print(float(state.loss_scale))
    8.0
    8.0
    16.0

  References:
    Flax 0.12, ``flax.training.dynamic_scale.DynamicScale``.
  """
  scale = _validate.scale("scale", scale)
  return Scaler(
    init_scale=scale,
    growth_factor=_validate.above_one("growth_factor", growth_factor),
    backoff_factor=_validate.open_unit("backoff_factor", backoff_factor),
    growth_interval=_validate.count("growth_interval", growth_interval) + 1,
    min_scale=scale_bound("minimum_scale", minimum_scale, scale),
  )


def headroom_scaler(
  *,
  init_scale: float = 2.0**16,
  headroom_bits: float = 4.0,
  growth_margin_bits: float = 2.0,
  max_growth: float = 2.0,
  backoff_factor: float = 0.5,
  min_scale: float = 1.0,
  max_scale: float = 2.0**24,
  history: int = 256,
) -> Scaler:
  """A scale set from the measured gradient range, not a clean-step count.

  After a clean step the scale targets ``2**floor(log2(65504 / (max|g| *
  2**headroom_bits)))``, where ``max|g|`` is the largest unscaled gradient
  magnitude of the last ``history`` clean steps (overflowed steps are not
  counted): it falls to it at once, and grows to it (by at most
  ``max_growth``) when it lies ``growth_margin_bits`` above. With
  ``history=1`` the target follows each step's largest gradient; a longer
  window moves it only when a new maximum enters the window or an old one
  leaves it (Transformer Engine's ``DelayedScaling`` with
  ``amax_compute_algo="max"``).

  Args:
    init_scale: first scale.
    headroom_bits: bits between ``max|g| * scale`` and 65504, in [0, 24].
    growth_margin_bits: how far above the scale the target must be for it to
      grow, in [0, 24].
    max_growth: largest factor the scale may grow by in one step, above 1.
    backoff_factor: back-off multiplier on overflow, in (0, 1).
    min_scale: floor, at most ``init_scale``.
    max_scale: ceiling, at least ``init_scale``.
    history: clean steps whose largest ``|g|`` the target is taken from, an
      integer >= 1; above 1 the state holds a ring of that many float32
      maxima (4 bytes each). The default, 256, settles on the examples
      (docs/diagnostics.md); 1 is the rule before ``history`` existed.

  Returns:
    A :class:`Scaler`.

  Raises:
    TypeError: ``history`` is not an integer.
    ValueError: an argument outside its range (named in the message).

  Examples:
    >>> import fp16_scaling as fs
    >>> fs.headroom_scaler(headroom_bits=6.0).headroom_bits
    6.0
    >>> scaler = fs.headroom_scaler(
    ...   init_scale=2.0**10, growth_margin_bits=0.0, history=2
    ... )
    >>> state = scaler.init()
    >>> for g in [2.0, 1.0, 1.0]:  # on the third step the 2.0 leaves
    ...   state = scaler.update(state, False, grad_max=g)
    ...   print(float(state.loss_scale))
    1024.0
    1024.0
    2048.0
  """
  init_scale = _validate.scale("init_scale", init_scale)
  max_scale = scale_bound("max_scale", max_scale, init_scale, ceiling=True)
  return Scaler(
    init_scale=init_scale,
    growth_factor=_validate.above_one("max_growth", max_growth),
    backoff_factor=_validate.open_unit("backoff_factor", backoff_factor),
    min_scale=scale_bound("min_scale", min_scale, init_scale),
    headroom_bits=_validate.in_range("headroom_bits", headroom_bits, 0, 24),
    growth_margin_bits=_validate.in_range(
      "growth_margin_bits", growth_margin_bits, 0, 24
    ),
    max_scale=max_scale,
    history=_validate.count("history", history),
  )
