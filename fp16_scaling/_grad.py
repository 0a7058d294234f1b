"""``value_and_grad``: the gradients of ``loss * S``, with S read from the
state inside the trace, and the unscaled loss.
"""

import sys
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling._metrics import current_scale

_STALE = (
  "fs.value_and_grad: the loss scale was read from a state that is not "
  "part of this trace, so every step would differentiate with that one "
  "scale while tx.update divides by the current one. Call "
  "fs.value_and_grad(fun, opt_state) inside the step, with the opt_state "
  "the step receives."
)


def _is_traced(x) -> bool:
  """Whether ``x`` is a tracer."""
  return isinstance(x, jax.core.Tracer)


def value_and_grad(
  fun: Callable[..., Any],
  state: Any,
  *,
  argnums: Union[int, Sequence[int]] = 0,
  has_aux: bool = False,
  **kwargs: Any,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of ``fun`` at the loss scale of ``state``.

  Args:
    fun: the loss, returning a scalar (and an aux value with ``has_aux``),
      unscaled and not divided by the number of microbatches.
    state: what holds the scale: the optimizer state, a shared scale's
      state, or an ``nnx.Optimizer`` (then ``fun`` takes nnx Modules).
    argnums: as for ``jax.value_and_grad``.
    has_aux: as for ``jax.value_and_grad``.
    **kwargs: passed to ``jax.value_and_grad``.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)`` or
    ``((value, aux), grads)``: ``value`` is ``fun``'s, unscaled; ``grads``
    are those of ``fun * S``, to pass to ``tx.update`` as they are.

  Raises:
    ValueError: called inside ``jit`` with a state from outside any trace.
      Build it where the state is: inside a ``lax.scan`` body that carries
      the state, from the carried state (one built outside the body is not
      caught).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(optax.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(8.0)), optax.sgd(1.0)))
    >>> params = jnp.array([1.0, 2.0])
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p**2)
    >>> value, grads = fs.value_and_grad(loss, state)(params)
    >>> print(value, grads)  # the loss, and the gradients at scale 8
    5.0 [16. 32.]
  """
  nnx_optimizer = hasattr(state, "opt_state")
  scale = current_scale(state.opt_state if nnx_optimizer else state)

  def scaled(*args, **kw):
    out = fun(*args, **kw)
    value, aux = out if has_aux else (out, None)
    value = jnp.asarray(value)
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(
        "fs.value_and_grad: fun must return a floating scalar loss (and an "
        f"aux value with has_aux=True), got {value.dtype}{list(value.shape)}"
      )
    return value.astype(jnp.float32) * scale, (value, aux)

  if nnx_optimizer:
    from flax import nnx  # the caller's: an nnx.Optimizer was passed

    grad = nnx.grad(scaled, argnums=argnums, has_aux=True, **kwargs)
  else:
    grad = jax.grad(scaled, argnums=argnums, has_aux=True, **kwargs)
    grad = _arrays_only(grad, scaled, argnums, kwargs)

  def value_and_scaled_grad(*args, **kw):
    traced = any(_is_traced(x) for x in jax.tree.leaves((args, kw)))
    if traced and not _is_traced(scale):
      raise ValueError(_STALE)
    grads, (value, aux) = grad(*args, **kw)
    return ((value, aux) if has_aux else value), grads

  return value_and_scaled_grad


def _arrays_only(grad, fun, argnums, kwargs) -> Callable[..., Any]:
  """``grad``, with each Equinox module among the differentiated arguments
  reduced to its inexact arrays (as ``eqx.filter_value_and_grad`` does: the
  gradient holds None elsewhere), and any other leaf that is not an array
  refused by name."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

  def call(*args, **kw):
    eqx = sys.modules.get("equinox")  # the caller's, if it passed a module
    args, rest = list(args), {}
    for i in nums:
      if eqx is not None and isinstance(args[i], eqx.Module):
        args[i], rest[i] = eqx.partition(args[i], eqx.is_inexact_array)
      for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, float, int)):
          raise TypeError(
            f"fs.value_and_grad: argument {i} holds a {type(x).__name__} at "
            f"{jax.tree_util.keystr(path)}, which is not an array and cannot "
            "be differentiated. Pass an Equinox module as it is (its inexact "
            "arrays are differentiated), or split the tree and pass its "
            "arrays: eqx.partition(model, eqx.is_inexact_array)."
          )
    if not rest:
      return grad(*args, **kw)
    whole = lambda a: [
      eqx.combine(x, rest[i]) if i in rest else x for i, x in enumerate(a)
    ]
    split = lambda *a, **k: fun(*whole(a), **k)
    return jax.grad(split, argnums=argnums, has_aux=True, **kwargs)(*args, **kw)

  return call
