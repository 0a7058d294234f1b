"""``value_and_grad``: the gradients of ``loss * S``, with S read from the
state inside the trace, and the unscaled loss.
"""

import sys
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _metrics
from fp16_scaling import _policy
from fp16_scaling import _validate
from fp16_scaling._lookup import is_nnx_optimizer
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
_FLOAT16_OUTPUT = (
  "fs.value_and_grad: policy={} casts fun's loss to its output dtype, "
  "float16 (in 'c=f16' the output follows compute): a float16 loss. Its "
  "cotangent is the loss scale S in float16, which is inf once S > 65504: "
  "every step at a scale of 2^16 or more overflows. Name a float32 "
  "output, o=f32: policy='p=f32,c=f16,o=f32'."
)


def _is_traced(x) -> bool:
  """Whether ``x`` is a tracer."""
  return isinstance(x, jax.core.Tracer)


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
  policy: Any = None,
  cast_args: Sequence[Union[int, str]] = (),
  **kwargs: Any,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of ``fun`` at the loss scale of ``state``.

  Each differentiated argument may be any pytree: its inexact arrays (and
  Python floats, as ``jax.grad`` takes them) are differentiated, and every
  other leaf (integers, integer arrays, PRNG keys, functions, strings,
  ``None``) is passed to ``fun`` as it is and gets ``None`` for a gradient,
  as ``eqx.filter_value_and_grad`` does. An argument that holds an Equinox
  module is split as Equinox splits it: its inexact arrays only.

  With ``policy``, the casts happen inside the differentiated function, so
  the gradients come back in the parameters' dtype: the differentiated
  arguments (and the arguments ``cast_args`` names) are cast to the
  policy's compute dtype before ``fun`` sees them, and ``fun``'s loss to
  its output dtype. The other arguments (an RL loss's advantages, old
  log-probabilities, labels) reach ``fun`` as they are, and ``aux`` is
  returned as ``fun`` gave it. A cast touches floating arrays only (see
  :class:`Policy`). An NNX module is passed to ``fun`` as a copy whose Flax
  layers (modules with ``dtype`` and ``param_dtype``) that leave ``dtype``
  None compute in the compute dtype, as if built with ``dtype=`` it: each
  casts its inputs and parameters itself, and a norm keeps float32
  statistics and returns the compute dtype. A layer's own ``dtype=`` is
  kept (a float32 one stays float32; the next layer casts back). The
  ``nnx.Param``s of other modules are cast; the rest (batch statistics, RNG
  counts) keeps its dtype, and what ``fun`` writes there reaches the
  module.

  Args:
    fun: the loss, returning a scalar (and an aux value with ``has_aux``),
      unscaled and not divided by the number of microbatches.
    state: what holds the scale: the optimizer state (of any of several
      optimizers that :func:`sync_loss_scales` keeps at one scale), a
      ``TrainState`` holding it, or an ``nnx.Optimizer`` (then ``fun``
      takes nnx Modules).
    argnums: as for ``jax.value_and_grad``.
    has_aux: as for ``jax.value_and_grad``.
    policy: a :class:`Policy`, a ``jmp.Policy`` (any object with
      ``param_dtype``, ``compute_dtype`` and ``output_dtype``) or a policy
      string (``"p=f32,c=f16,o=f32"``); None casts nothing.
    cast_args: more argument positions (ints) or keyword names (strings)
      to cast to the compute dtype, e.g. the images of a batch; only with
      ``policy``.
    **kwargs: passed to ``jax.value_and_grad``.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)`` or
    ``((value, aux), grads)``: ``value`` is ``fun``'s, unscaled (in the
    policy's output dtype); ``grads`` are those of ``fun * S``, to pass to
    ``tx.update`` as they are.

  Raises:
    ValueError: called inside ``jit`` with a state from outside any trace.
      Build it where the state is: inside a ``lax.scan`` body that carries
      the state, from the carried state (one built outside the body is not
      caught). Also for a state that holds no scale (params, ``tx``, a
      ``jax.eval_shape`` state); ``cast_args`` without a ``policy`` or not
      ints and strings, or naming an argument the call does not give;
      and, at the call, a differentiated argument
      holding a floating leaf of another dtype than the policy's
      ``param_dtype`` (parameters cast already: a double cast), named by
      its path.
    TypeError: ``fun``'s output does not fit ``has_aux``, or its loss is not
      a floating scalar; a ``policy`` of another type.

  ``fun`` must not multiply by the scale itself: ``fs.current_scale`` of
  ``state`` read inside ``fun`` raises ValueError (the loss would be scaled
  twice), eagerly and under ``jit`` alike: a guard set for this call alone
  sees the read. A multiply it cannot see is not refused: by a number
  (``loss * 65536.0``), or by a scale read outside ``fun`` and closed over.
  Then ``value`` comes back S times the loss and the gradients S times
  ``fun``'s scaled ones, so ``tx.update`` makes updates S times too large
  and they overflow S times sooner (``tests/test_refusals.py``). Return the
  unscaled loss.

  Warns:
    UserWarning: ``fun``'s loss is float16, or ``policy``'s output dtype
      is (its cotangent, the scale, overflows float16 above 65504); the
      latter names the fix, ``o=f32``.

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
    >>> half = fs.value_and_grad(loss, state, policy="p=f32,c=f16,o=f32")
    >>> value, grads = half(params)  # computed in float16
    >>> print(value.dtype, grads.dtype)
    float32 float32
  """
  nnx_optimizer = is_nnx_optimizer(state)
  scale = _held_scale(state, nnx_optimizer)
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  policy, cast_args = _cast_plan(policy, cast_args)

  def scaled(*args, **kw):
    if policy is not None:
      args, kw, done = _cast_inputs(policy, nums, cast_args, args, kw)
    with _metrics.differentiating_at(scale):
      out = fun(*args, **kw)
    value, aux = _split_output(out, has_aux)
    if policy is not None:
      done()
      value = policy.cast_to_output(value)
    return value.astype(jnp.float32) * scale, (value, aux)

  if nnx_optimizer:
    from flax import nnx  # the caller's: an nnx.Optimizer was passed

    grad = nnx.grad(scaled, argnums=argnums, has_aux=True, **kwargs)
  else:
    grad = jax.grad(scaled, argnums=argnums, has_aux=True, **kwargs)
    grad = _arrays_only(grad, scaled, argnums, nums, kwargs)

  def value_and_scaled_grad(*args, **kw):
    traced = any(_is_traced(x) for x in jax.tree.leaves((args, kw)))
    if traced and not _is_traced(scale):
      raise ValueError(_STALE)
    if policy is not None:
      _refuse_double_cast(policy, args, nums)
    grads, (value, aux) = grad(*args, **kw)
    if value.dtype == jnp.float16:
      cast = policy is not None and policy.output_dtype == jnp.float16
      _validate.warn(_FLOAT16_OUTPUT.format(policy) if cast else _FLOAT16_LOSS)
    return ((value, aux) if has_aux else value), grads

  return value_and_scaled_grad


def _held_scale(state, nnx_optimizer: bool) -> tuple:
  """The loss scale in the optax state ``state`` is or holds (an
  ``nnx.Optimizer``'s ``opt_state``).

  Raises:
    ValueError: ``state`` holds ``jax.ShapeDtypeStruct``s (shapes without
      values), or no scale (from :func:`current_scale`).
  """
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
    raise ValueError(
      "fs.value_and_grad: the state holds ShapeDtypeStructs (from "
      "jax.eval_shape(tx.init, params)), shapes without values: pass the "
      "state tx.init(params) returned, or the one the step receives"
    )
  return current_scale(state.opt_state if nnx_optimizer else state)


def _cast_plan(policy, cast_args):
  """``(policy, cast_args)``: the policy as a :class:`Policy` (or None),
  and ``cast_args`` as a checked tuple, for :func:`_cast_inputs`, the casts
  inside the differentiated function."""
  if policy is None:
    if tuple(cast_args):
      raise ValueError(
        "fs.value_and_grad: cast_args names arguments to cast to the "
        "compute dtype, but no policy= says which: pass policy= (e.g. "
        "'p=f32,c=f16,o=f32') or drop cast_args"
      )
    return None, ()
  policy = _policy.as_policy(policy, "fs.value_and_grad: policy")
  cast_args = (cast_args,) if isinstance(cast_args, (int, str)) else cast_args
  cast_args = tuple(cast_args)
  for c in cast_args:
    if isinstance(c, bool) or not isinstance(c, (int, str)):
      raise ValueError(
        "fs.value_and_grad: cast_args must hold argument positions (ints) "
        f"and keyword names (strings), got {c!r}"
      )
  return policy, cast_args


def _cast_inputs(policy, nums, cast_args, args, kw):
  """``(args, kw, done)``: the differentiated arguments and those
  ``cast_args`` names cast to the compute dtype; an NNX module as a copy
  computing in it (:func:`_nnx_copy`), whose state other than its
  ``nnx.Param``s (batch statistics, RNG counts) ``done()``, called after
  ``fun``, writes back to the module ``fun`` was given."""
  n = len(args)
  for c in cast_args:
    if isinstance(c, int) and not -n <= c < n:
      raise ValueError(
        f"fs.value_and_grad: cast_args names argument {c}, but fun was "
        f"called with {n} positional arguments"
      )
  missing = [c for c in cast_args if isinstance(c, str) and c not in kw]
  if missing:
    raise ValueError(
      f"fs.value_and_grad: cast_args names the keyword {missing[0]!r}, but "
      f"fun was called without it (keywords given: {sorted(kw)})"
    )
  where = {c % n for c in (*nums, *cast_args) if isinstance(c, int)}
  args, after = list(args), []
  for i in sorted(where):
    args[i] = _cast_one(policy, args[i], after)
  kw = {
    k: _cast_one(policy, v, after) if k in cast_args else v
    for k, v in kw.items()
  }
  return tuple(args), kw, lambda: [f() for f in after]


def _cast_one(policy, x, after):
  """``x`` cast to the compute dtype (see :func:`_cast_inputs`); an NNX
  module in a copy whose Flax layers compute in it (:func:`_nnx_copy`)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None or not isinstance(x, nnx.Module):
    return policy.cast_to_compute(x)
  copy = _nnx_copy(nnx, policy, x)
  after.append(lambda: nnx.update(x, nnx.state(copy, nnx.Not(nnx.Param))))
  return copy


def _is_layer(module) -> bool:
  """A Flax layer: a module with a compute ``dtype`` and a ``param_dtype``,
  that casts its inputs and parameters to its ``dtype`` itself."""
  return hasattr(module, "dtype") and hasattr(module, "param_dtype")


def _nnx_copy(nnx, policy, module):
  """A copy of ``module`` computing in the policy's compute dtype: each
  Flax layer that leaves its ``dtype`` None gets the compute dtype (Flax
  then casts its inputs and parameters, and a norm keeps float32 statistics
  and returns the compute dtype); a layer's own ``dtype=`` is kept. The
  ``nnx.Param``s no layer owns are cast; the rest (batch statistics, RNG
  counts, the layers' parameters) keep their dtype."""
  layers = {path for path, m in nnx.iter_modules(module) if _is_layer(m)}

  def cast(path, value) -> bool:
    return isinstance(value, nnx.Param) and path[:-1] not in layers

  graphdef, params, rest = nnx.split(module, cast, ...)
  copy = nnx.merge(graphdef, policy.cast_to_compute(params), rest)
  for _, m in nnx.iter_modules(copy):
    if _is_layer(m) and m.dtype is None:
      m.dtype = policy.compute_dtype
  return copy


def _refuse_double_cast(policy, args, nums) -> None:
  """A ValueError, naming the leaf, for a differentiated argument that
  holds a floating array of another dtype than ``policy.param_dtype``
  (cast already)."""
  for i in nums:
    for path, x in jax.tree_util.tree_leaves_with_path(args[i]):
      if _policy.is_floating_array(x) and x.dtype != policy.param_dtype:
        raise ValueError(
          f"fs.value_and_grad(policy={policy}): argument {i} holds a "
          f"{x.dtype.name} array at {jax.tree_util.keystr(path)}, not the "
          f"policy's param_dtype {policy.param_dtype.name}: the "
          "parameters look cast already, and the policy would cast them "
          "again. Pass the parameters in their own dtype (the policy "
          "casts them inside), or drop policy="
        )


def _differentiable(x) -> bool:
  """An inexact array, or a Python float (not a bool): what ``jax.grad``
  differentiates."""
  inexact = isinstance(x, (jax.Array, np.ndarray, np.generic)) and (
    jnp.issubdtype(x.dtype, jnp.inexact)
  )
  return inexact or (isinstance(x, float) and not isinstance(x, bool))


def _module_array(x) -> bool:
  """What an Equinox module's argument differentiates: its inexact arrays,
  not a Python float (``eqx.filter_value_and_grad``'s
  ``eqx.is_inexact_array``)."""
  return _differentiable(x) and not isinstance(x, float)


def _arrays_only(grad, fun, argnums, nums, kwargs) -> Callable[..., Any]:
  """``grad``, with each differentiated argument reduced to what can be
  differentiated (see :func:`_differentiable`; in an argument holding an
  Equinox module, its inexact arrays only, as ``eqx.filter_value_and_grad``
  takes them); the rest goes to ``fun`` as it is and its gradient is
  None. ``nums`` is ``argnums`` as a tuple."""

  def call(*args, **kw):
    args, rest = list(args), {}
    for i in nums:
      keep = _differentiable
      if _holds_module(args[i]):
        keep = _module_array
      if not all(keep(x) for x in jax.tree.leaves(args[i])):
        args[i], rest[i] = partition(args[i], keep)
    if not rest:
      return grad(*args, **kw)

    def whole(*parts, **k):
      """``fun`` of the arguments put back together."""
      joined = [
        combine(x, rest[i]) if i in rest else x for i, x in enumerate(parts)
      ]
      return fun(*joined, **k)

    return jax.grad(whole, argnums=argnums, has_aux=True, **kwargs)(*args, **kw)

  return call


def _holds_module(tree) -> bool:
  """Whether ``tree`` is or holds an Equinox module (of a loaded equinox)."""
  eqx = sys.modules.get("equinox")
  if eqx is None:
    return False

  def is_module(x) -> bool:
    return isinstance(x, eqx.Module)

  return any(map(is_module, jax.tree.leaves(tree, is_leaf=is_module)))


def partition(tree, keep):
  """``(kept, rest)``: ``tree`` with None where ``keep`` is false, and its
  complement (``eqx.partition``)."""
  kept = jax.tree.map(lambda x: x if keep(x) else None, tree)
  return kept, jax.tree.map(lambda x: None if keep(x) else x, tree)


def combine(kept, rest):
  """The tree :func:`partition` split (``eqx.combine``)."""
  return jax.tree.map(
    lambda a, b: b if a is None else a, kept, rest, is_leaf=lambda x: x is None
  )
