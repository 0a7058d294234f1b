"""``value_and_grad``: the gradients of ``loss * S``, with S read from the
state inside the trace, and the unscaled loss.
"""

import sys
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _validate
from fp16_scaling._metrics import current_scale

_STALE = (
  "fs.value_and_grad: the loss scale was read from a state that is not "
  "part of this trace, so every step would differentiate with that one "
  "scale while tx.update divides by the current one. Call "
  "fs.value_and_grad(fun, opt_state) inside the step, with the opt_state "
  "the step receives."
)


_FLOAT16_LOSS = (
  "fs.value_and_grad: fun returned a float16 loss. Its cotangent is the "
  "loss scale S in float16, which is inf once S > 65504: every step at a "
  "scale of 2^16 or more overflows, and the scale stays below it. Reduce "
  "the loss in float32, e.g. jnp.mean(per_example.astype(jnp.float32))."
)


def _is_traced(x) -> bool:
  """Whether ``x`` is a tracer."""
  return isinstance(x, jax.core.Tracer)


def _scale_of(state):
  """The loss scale held by ``state``, an optax state or nnx.Optimizer."""
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
    raise ValueError(
      "fs.value_and_grad: the state holds ShapeDtypeStructs (from "
      "jax.eval_shape(tx.init, params)), shapes without values: pass the "
      "state tx.init(params) returned, or the one the step receives"
    )
  return current_scale(state.opt_state if _is_nnx_optimizer(state) else state)


def _is_nnx_optimizer(state) -> bool:
  """Whether ``state`` is an ``nnx.Optimizer`` (of a loaded flax.nnx)."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(state, nnx.Optimizer)


def _split_output(out, has_aux: bool) -> tuple:
  """``(loss, aux)`` of ``fun``'s output, with the mistakes named."""
  if has_aux != isinstance(out, (tuple, list)) or (has_aux and len(out) != 2):
    got = "one value"
    if isinstance(out, (tuple, list)):
      got = f"a {type(out).__name__} of {len(out)}"
    raise TypeError(
      f"fs.value_and_grad: fun returned {got}, with has_aux={has_aux}: "
      "return the loss alone, or pass has_aux=True and return (loss, aux)"
    )
  loss, aux = out if has_aux else (out, None)
  what = "fs.value_and_grad: fun's " + (
    "first output (with has_aux=True it returns (loss, aux))"
    if has_aux
    else "loss"
  )
  return _validate.scalar_loss(loss, what), aux


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
    state: what holds the scale: the optimizer state (of any of several
      optimizers that :func:`sync_loss_scales` keeps at one scale), a
      ``TrainState`` holding it, or an ``nnx.Optimizer`` (then ``fun``
      takes nnx Modules).
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
      caught). Also for a state that holds no scale (params, ``tx``, a
      ``jax.eval_shape`` state).
    TypeError: ``fun``'s output does not fit ``has_aux``, or its loss is not
      a floating scalar.

  Warns:
    UserWarning: ``fun``'s loss is float16 (its cotangent, the scale,
      overflows float16 above 65504).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.static_scaler(8.0)), optax.sgd(1.0))
    >>> params = jnp.array([1.0, 2.0])
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p**2)
    >>> value, grads = fs.value_and_grad(loss, state)(params)
    >>> print(value, grads)  # the loss, and the gradients at scale 8
    5.0 [16. 32.]
  """
  nnx_optimizer = _is_nnx_optimizer(state)
  scale = _scale_of(state)

  def scaled(*args, **kw):
    value, aux = _split_output(fun(*args, **kw), has_aux)
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
    if value.dtype == jnp.float16:
      _validate.warn(_FLOAT16_LOSS)
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
