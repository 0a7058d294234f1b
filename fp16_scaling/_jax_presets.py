"""The presets of the JAX-side peers, jmp's ``DynamicLossScale`` and Keras 3's
``LossScaleOptimizer``, as settings of the one machine (docs/peers.md).
"""

import functools
import inspect
import math
import numbers

import numpy as np

from fp16_scaling import _validate
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import scale_bound


def _number(name: str, value):
  """A number, or a NumPy/JAX array of one (jmp takes ``jnp.asarray(2.**15)``
  and ``np.ones([], np.float32)``), as a Python number."""
  if isinstance(value, numbers.Number) or not hasattr(value, "shape"):
    return value
  a = np.asarray(value)
  if a.size != 1 or a.dtype.kind not in "iuf":
    raise TypeError(
      f"{name} must be a number or an array of one number, got an array of "
      f"dtype {a.dtype} and shape {a.shape}"
    )
  return a.reshape(()).item()


def _by_keyword(preset):
  """``preset`` (keyword-only, as every preset), with a TypeError that names
  the keywords for an argument given by position, as jmp's
  ``DynamicLossScale(loss_scale)`` and Keras's ``LossScaleOptimizer`` take
  theirs; its signature and docstring are ``preset``'s."""
  names = list(inspect.signature(preset).parameters)

  @functools.wraps(preset)
  def call(*args, **kwargs):
    if args:
      raise TypeError(
        f"fs.{preset.__name__} takes keyword arguments only, as every "
        f"preset: write fs.{preset.__name__}({names[0]}={args[0]!r}) for "
        f"its first; got {len(args)} by position. Its keywords are "
        f"{', '.join(names)}"
      )
    return preset(**kwargs)

  return call


def _power_of_two_factor(value) -> int:
  """jmp's ``factor``: an integer power of two, at least 2."""
  value = _number("factor", value)
  v = _validate.real("factor", value)
  if not (math.isfinite(v) and v >= 2 and math.frexp(v)[0] == 0.5):
    raise ValueError(
      "factor must be a power of two >= 2 (2, 4, 8, ...): jmp divides the "
      "scale by factor on an overflow and fp16_scaling multiplies it by "
      "1 / factor, which is the same number only for powers of two; "
      f"got {value!r}"
    )
  return int(_validate.above_one("factor", v))


@_by_keyword
def jmp_scaler(
  *,
  loss_scale: float = 2.0**15,
  counter: int = 0,
  period: int = 2000,
  factor: int = 2,
  min_loss_scale: float = 1.0,
) -> Scaler:
  """jmp's ``DynamicLossScale``, step for step (docs/peers.md).

  jmp multiplies the scale by ``factor`` after ``period`` clean steps in a
  row (keeping it when the product is not finite) and divides it by
  ``factor``, to no less than ``min_loss_scale``, on an overflow.

  Designed difference: jmp loses ``min_loss_scale`` when its
  ``DynamicLossScale`` goes through ``jax.jit`` or ``lax.scan`` (jmp#44: its
  pytree keeps only the scale and the counter, and rebuilds the floor as
  1.0); this scaler keeps it.

  Args:
    loss_scale: initial scale, a positive normal float32 (a number or an
      array of one; the scale runs in float32 whatever its dtype).
    counter: jmp's counter of a fresh ``DynamicLossScale``: 0. A running
      jmp scale's counter is state: load it with
      :func:`load_scaler_state_dict`.
    period: clean steps in a row between growths, at least 1.
    factor: growth multiplier and back-off divisor, a power of two >= 2.
    min_loss_scale: floor, a positive normal float32 at most ``loss_scale``.

  Returns:
    A :class:`Scaler`.

  Raises:
    ValueError: an argument outside its range; the message names it.
    TypeError: an argument of the wrong type, or one given by position
      (``jmp.DynamicLossScale(2.0**15)``'s habit): the message names its
      keyword.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.jmp_scaler(loss_scale=4.0, period=2)
    >>> state = scaler.init()
    >>> for overflow in [False, False, True, True, True]:
    ...   state = scaler.update(state, overflow)
    ...   print(float(state.loss_scale))
    4.0
    8.0
    4.0
    2.0
    1.0

  References:
    jmp 0.0.4, ``jmp/_src/loss_scale.py``.
  """
  init_scale = _validate.scale("loss_scale", _number("loss_scale", loss_scale))
  counter = _number("counter", counter)
  if isinstance(counter, bool) or counter != 0:
    raise ValueError(
      "counter must be 0, a fresh DynamicLossScale's: a running jmp scale's "
      "counter is state, not configuration; build the scaler with "
      "counter=0 and load the jmp state with "
      f"fs.load_scaler_state_dict(opt_state, loss_scale, scaler); got "
      f"{counter!r}"
    )
  factor = _power_of_two_factor(factor)
  min_scale = scale_bound(
    "min_loss_scale", _number("min_loss_scale", min_loss_scale), init_scale
  )
  return Scaler(
    init_scale=init_scale,
    growth_factor=float(factor),
    backoff_factor=1.0 / factor,
    growth_interval=_validate.count("period", _number("period", period)),
    min_scale=min_scale,
  )


@_by_keyword
def keras_scaler(
  *,
  initial_scale: float = 2.0**15,
  dynamic_growth_steps: int = 2000,
) -> Scaler:
  """Keras 3's ``LossScaleOptimizer``, step for step (docs/peers.md).

  Keras doubles the scale after ``dynamic_growth_steps`` clean steps in a
  row and halves it on an overflow, which skips the step: the inner
  optimizer's iteration counter does not advance, as an optax state kept by
  :func:`chain` does not.

  Designed difference: Keras's float32 scale has no floor and no ceiling.
  Halved below 2**-126 it goes to 0.0 (XLA flushes subnormals), and doubled
  past 2**127 to inf; then it never returns. This scaler stops at 2**-126
  and 2**127.

  Args:
    initial_scale: initial scale, a positive normal float32.
    dynamic_growth_steps: clean steps in a row between growths, at least 1.

  Returns:
    A :class:`Scaler`.

  Raises:
    ValueError: an argument outside its range; the message names it.
    TypeError: an argument of the wrong type, or one given by position:
      the message names its keyword.

  Examples:
    >>> import fp16_scaling as fs
    >>> scaler = fs.keras_scaler(initial_scale=8.0, dynamic_growth_steps=2)
    >>> state = scaler.init()
    >>> for overflow in [False, False, True]:
    ...   state = scaler.update(state, overflow)
    ...   print(float(state.loss_scale))
    8.0
    16.0
    8.0

  References:
    Keras 3.15, ``keras/src/optimizers/loss_scale_optimizer.py``.
  """
  return Scaler(
    init_scale=_validate.scale("initial_scale", initial_scale),
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=_validate.count(
      "dynamic_growth_steps", dynamic_growth_steps
    ),
  )
