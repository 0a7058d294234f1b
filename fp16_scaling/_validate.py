"""Argument checks shared by every public constructor, and the checks of
values read from data (a DeepSpeed config, a peer's saved state): each names
the parameter, the allowed range and the value received.
"""

import math
import numbers
import os
import sys
from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
F32_MAX = float(np.finfo(np.float32).max)


def _describe(value):
  """``value`` and its type, for messages."""
  return f"{value!r} ({type(value).__name__})"


def scalar_loss(
  value,
  what: str = "value (the loss, tx.update(grads, state, params, value=loss))",
):
  """``value``, the loss, as a floating scalar array; a TypeError naming
  ``what`` (where the loss came from) for anything else."""
  try:
    array = jnp.asarray(value)
  except (TypeError, ValueError):
    got = f"a {type(value).__name__}"
  else:
    if array.shape == () and jnp.issubdtype(array.dtype, jnp.floating):
      return array
    got = f"{array.dtype}{list(array.shape)}"
  raise TypeError(
    f"{what} must be a floating scalar loss: the mean loss, not per-example "
    f"losses; got {got}"
  )


# The package and the libraries it runs under: their frames are not the
# user's code.
_LIBRARIES = (
  "fp16_scaling",
  "optax",
  "jax",
  "jaxlib",
  "flax",
  "equinox",
  "haiku",
  "jmp",
)


def library_roots() -> tuple:
  """The folders (each ending in a separator) of this package and of the
  libraries it runs under that are loaded: a file under one is not the
  user's code."""
  return tuple(
    os.path.dirname(sys.modules[n].__file__) + os.sep
    for n in _LIBRARIES
    if getattr(sys.modules.get(n), "__file__", None)
  )


def warn(message: str) -> None:
  """``warnings.warn`` pointing at the caller's code: the first frame of
  the stack outside this package and the libraries it runs under."""
  roots = library_roots()
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(roots):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, UserWarning, stacklevel=level + 1)


def real(name: str, value) -> float:
  """A real number that is not a bool, as a Python float."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {_describe(value)}")
  try:
    return float(value)
  except OverflowError:
    raise ValueError(
      f"{name} must be within float32's range (at most {F32_MAX:.6g}), got "
      f"an integer with {len(str(abs(int(value))))} digits"
    ) from None


def scale(name: str, value) -> float:
  """A loss scale: a normal, finite, positive float32."""
  v = real(name, value)
  if not (math.isfinite(v) and F32_TINY <= v <= F32_MAX):
    raise ValueError(
      f"{name} must be a positive, finite, normal float32 in "
      f"[{F32_TINY:.6g}, {F32_MAX:.6g}], got {value!r}"
    )
  return float(np.float32(v))


def above_one(name: str, value) -> float:
  """``value`` as the float32 the state holds, which must be above 1: a
  factor that rounds to 1.0 in float32 would never change the scale."""
  v = real(name, value)
  f = float(np.float32(v)) if math.isfinite(v) and abs(v) <= F32_MAX else v
  if not (math.isfinite(f) and 1.0 < f <= F32_MAX):
    raise ValueError(
      f"{name} must be a finite float above 1 (in float32, the state's "
      f"dtype), got {value!r}"
    )
  return f


def open_unit(name: str, value) -> float:
  """``value`` as the float32 the state holds, which must lie in (0, 1) (so
  that the factor neither zeroes the scale nor leaves it)."""
  v = real(name, value)
  f = float(np.float32(v)) if 0.0 < v < 1.0 else v
  if not 0.0 < f < 1.0:
    raise ValueError(
      f"{name} must lie in the open interval (0, 1) (in float32, the "
      f"state's dtype), got {value!r}"
    )
  return f


def positive(name: str, value) -> float:
  """A real number in (0, float32's maximum]."""
  return _up_to_f32_max(name, value, zero=False)


def non_negative(name: str, value) -> float:
  """A real number in [0, float32's maximum]."""
  return _up_to_f32_max(name, value, zero=True)


def _up_to_f32_max(name: str, value, *, zero: bool) -> float:
  """A finite real number at most float32's maximum, above 0 (at least 0
  with ``zero``); ValueError naming that range otherwise."""
  v = real(name, value)
  low = v >= 0.0 if zero else v > 0.0
  if not (math.isfinite(v) and low and v <= F32_MAX):
    raise ValueError(
      f"{name} must be {'>= 0' if zero else 'positive'} and at most "
      f"float32's maximum ({F32_MAX:.6g}), got {value!r}"
    )
  return v


def count(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an integer >= 1, got {_describe(value)}")
  if not 1 <= int(value) <= 2**31 - 2:
    raise ValueError(
      f"{name} must be an integer in [1, {2**31 - 2}], got {value!r}"
    )
  return int(value)


def flag(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {_describe(value)}")
  return bool(value)


def choice(name: str, value, allowed) -> str:
  """One of the strings in ``allowed``."""
  if not isinstance(value, str) or value not in allowed:
    raise ValueError(
      f"{name} must be one of {', '.join(map(repr, allowed))}, got "
      f"{_describe(value)}"
    )
  return value


def in_range(name: str, value, low: float, high: float) -> float:
  """A real number in the closed interval ``[low, high]``."""
  v = real(name, value)
  if not (math.isfinite(v) and low <= v <= high):
    raise ValueError(f"{name} must lie in [{low:g}, {high:g}], got {value!r}")
  return v


# Values read from data rather than passed as arguments: every bad value
# there is a ValueError, whatever its type, as DeepSpeed's config raises.


def one_element(name: str, value):
  """The one element of a number, array or torch tensor, as a scalar."""
  if hasattr(value, "detach"):  # a torch tensor
    value = value.detach().cpu().numpy()
  a = np.asarray(value)
  if a.size != 1:
    raise ValueError(
      f"{name} must be one number, got an array of shape {a.shape}"
    )
  return a.reshape(()).item()


def number(name: str, value) -> float:
  """A finite number, as ``float()`` reads it, that is not a bool."""
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a finite number, not a bool: {value!r}")
  if isinstance(value, numbers.Real):
    v = real(name, value)  # which names an int too long for a float
  else:
    try:
      v = float(value)  # a numeric string too
    except (TypeError, ValueError):
      raise ValueError(
        f"{name} must be a finite number, got {_describe(value)}"
      ) from None
  if not math.isfinite(v):
    raise ValueError(
      f"{name} must be a finite number (not inf, -inf or nan), got {value!r}"
    )
  return v


def _bounds(low, high) -> str:
  """``" in [low, high]"``, ``" >= low"``, ``" <= high"`` or ``""``."""
  if low is not None and high is not None:
    return f" in [{low}, {high}]"
  if low is not None:
    return f" >= {low}"
  return "" if high is None else f" <= {high}"


def integer(name: str, value, low=None, high=None, why: str = "") -> int:
  """An integer-valued :func:`number` (``3`` or ``3.0``) in ``[low, high]``
  (``None`` leaves that end open); ``why`` follows the range in messages."""
  v = number(name, value)
  span = _bounds(low, high)
  if v != int(v):
    raise ValueError(f"{name} must be an integer{span}{why}, got {value!r}")
  if (low is not None and v < low) or (high is not None and v > high):
    verb = "lie" if span.startswith(" in") else "be"
    raise ValueError(f"{name} must {verb}{span}{why}, got {int(v)}")
  return int(v)


def from_data(check, name: str, value, **kwargs):
  """``check(name, value, **kwargs)`` on a value read from data: a value of
  the wrong type is a ValueError too, with the same message."""
  try:
    return check(name, value, **kwargs)
  except TypeError as e:
    raise ValueError(*e.args) from None


def boolean(name: str, value) -> bool:
  """A bool read from data: :func:`flag`, raising ValueError."""
  return from_data(flag, name, value)


def require_host(opt_state: Any, helper: str) -> None:
  """Raises TypeError when ``opt_state`` holds tracers: ``helper`` reads
  concrete values on the host."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(opt_state)):
    raise TypeError(
      f"{helper} runs on the host, outside jit: it reads concrete values, "
      "and here opt_state holds tracers (it was called inside a jitted, "
      "vmapped or scanned function). Call it on the state the step "
      f"returned, e.g. params, opt_state = train_step(...); then "
      f"{helper}(opt_state). Inside the step use fs.scale_metrics("
      "opt_state), which is traceable, and return its values."
    )
