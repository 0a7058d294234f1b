"""``float32``: run a function with its float16 and bfloat16 inputs widened
to float32, as ``torch.autocast`` runs its float32 ops (softmax, the norms,
the losses); docs/float32-ops.md has the table.
"""

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling._policy import cast_floating

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_F32 = jnp.dtype(jnp.float32)


def _is_half(x) -> bool:
  """Whether ``x`` is a float16 or bfloat16 array (JAX's, a tracer, or
  numpy's)."""
  return isinstance(x, (jax.Array, np.ndarray)) and x.dtype in _HALF


def _widen(tree):
  """``tree`` with its float16 and bfloat16 arrays as float32; every other
  leaf (float32 and float64 arrays, integers, keys, Python scalars) as it
  is."""
  return jax.tree.map(lambda x: x.astype(_F32) if _is_half(x) else x, tree)


def float32(
  fn: Optional[Callable[..., Any]] = None, keep_dtype: bool = False
) -> Callable[..., Any]:
  """``fn`` run in float32 on float16 and bfloat16 inputs.

  Every float16 and bfloat16 array among the arguments (any pytree, keyword
  arguments too) is cast to float32 before ``fn`` runs; float32 and float64
  arrays, integer arrays, PRNG keys, Python scalars and non-array leaves go
  in as they are. A float16 or bfloat16 array ``fn`` returns anyway (from a
  constant, a closed-over array) is widened to float32 too, so the result
  is float32 wherever it is floating and was not float64.

  With ``keep_dtype=True`` the floating outputs are cast back to the
  inputs' half dtype instead: float16 in, float16 out, the computation
  between in float32 (one rounding at the end). Inputs of both half dtypes
  (or none) give float32 outputs, as JAX promotes float16 with bfloat16.

  Usable as ``fs.float32(fn)``, ``@fs.float32`` or
  ``@fs.float32(keep_dtype=True)``; ``fs.float32(fn, True)`` is
  ``fs.float32(fn, keep_dtype=True)``. Differentiable: the cotangents flow back
  through the casts, so a float16 input gets a float16 gradient.

  Args:
    fn: the function; omitted, ``float32(keep_dtype=...)`` returns the
      decorator.
    keep_dtype: cast the floating outputs back to the inputs' half dtype.

  Returns:
    The wrapped function (``functools.wraps`` of ``fn``).

  Raises:
    TypeError: ``fn`` is not callable, or ``keep_dtype`` is not a bool.

  Examples:
    >>> import jax, jax.numpy as jnp, fp16_scaling as fs
    >>> logits = jnp.array([0.0, 10.0, 20.0], jnp.float16)
    >>> fs.float32(jax.nn.log_softmax)(logits).dtype
    dtype('float32')
    >>> fs.float32(jax.nn.log_softmax, keep_dtype=True)(logits).dtype
    dtype('float16')
  """
  if not isinstance(keep_dtype, bool):
    raise TypeError(
      f"fs.float32: keep_dtype must be True or False, got {keep_dtype!r}"
    )
  if fn is None:
    return functools.partial(float32, keep_dtype=keep_dtype)
  if not callable(fn):
    raise TypeError(
      f"fs.float32: fn must be a function, got a {type(fn).__name__}; use "
      "it as fs.float32(fn), @fs.float32 or @fs.float32(keep_dtype=True)"
    )

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    out = _widen(fn(*_widen(args), **_widen(kwargs)))
    if not keep_dtype:
      return out
    halves = {x.dtype for x in jax.tree.leaves((args, kwargs)) if _is_half(x)}
    if len(halves) != 1:
      return out
    return cast_floating(out, halves.pop())

  return wrapped
