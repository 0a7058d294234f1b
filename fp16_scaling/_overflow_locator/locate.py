"""``locate_overflow``: the op that made a step's first float16 inf or NaN,
found on the host by re-running the step's forward and backward pass op by
op, at the scale the step used (docs/locate-overflow.md).

``jax.make_jaxpr`` traces the gradient function :func:`value_and_grad`
builds, with the scale as its first input, and ``locator`` evaluates it
op by op; ``location`` describes what it found. For a backward overflow
the compiled gradient function is then run at lower scales, to the one at
which the whole step is finite. Nothing here runs in a step: only when
called, on the host.
"""

import dataclasses
import functools
import itertools
from typing import Any, Callable, Optional, Sequence, Union

import jax
from jax.tree_util import keystr
import numpy as np

from fp16_scaling import _lookup
from fp16_scaling import _validate
from fp16_scaling._grad import combine
from fp16_scaling._grad import partition
from fp16_scaling._grad import value_and_grad
from fp16_scaling._overflow_locator import location as _location
from fp16_scaling._overflow_locator import locator as _locator
from fp16_scaling._overflow_locator.location import OverflowLocation
from fp16_scaling._overflow_locator.location import finite
from fp16_scaling._overflow_locator.locator import Origin
from fp16_scaling._overflow_locator.locator import Val

_ARRAYS = (jax.Array, np.ndarray, np.generic)  # traced; other leaves not


def _argument(path, x, nums, count):
  """One argument leaf, at ``path`` in ``(args, kwargs)``: a parameter (a
  leaf of an argument ``nums`` names) names its module as the state names
  its leaves; a non-finite leaf is an origin, named by its path."""
  in_args = path[0].idx == 0
  param = in_args and path[1].idx in nums
  pieces = tuple(keystr((k,)) for k in path[2:])
  if pieces[-1:] == (".value",):
    pieces = pieces[:-1]  # an nnx Variable's
  module = pieces[:-1] if param else None
  origin = None
  if not finite(x):
    name = ("args" if in_args else "kwargs") + keystr(path[1:])
    origin = Origin(seq=next(count), input_path=name)
  return Val(value=x, origin=origin, module=module, param=param)


def locate_overflow(
  fun: Callable[..., Any],
  opt_state: Any,
  *,
  argnums: Union[int, Sequence[int]] = 0,
  has_aux: bool = False,
  policy: Any = None,
  cast_args: Sequence[Union[int, str]] = (),
  scale: Optional[float] = None,
) -> Callable[..., OverflowLocation]:
  """The op that made the first float16 inf or NaN of a step, on the host.

  Takes what :func:`value_and_grad` takes and returns a function of
  ``fun``'s arguments: called with the batch a step overflowed on, it
  re-runs the step's forward and backward pass op by op, as
  ``fs.value_and_grad(fun, opt_state, ...)`` computes them, at the scale
  that step used, and names the op whose inputs were all finite and whose
  output was not (the first in the run whose inf or NaN reaches the loss
  or the gradients). An op whose inputs already hold the inf, or that
  writes a constant one (a ``-inf`` mask), is not the origin; an input
  leaf that holds one is. ``jit`` calls, ``custom_jvp``, ``custom_vjp``,
  ``checkpoint``, ``cond`` and ``scan`` are entered (each scan iteration
  a layer); a ``while`` loop is run whole, as one op.

  The run is op by op, as ``jax_debug_nans`` re-runs a step: a compiled
  step may round otherwise (XLA keeps some float16 intermediates in
  float32), so an overflow by a hair may show in one and not the other.
  Nothing in the compiled step changes: this runs only when called.

  Args:
    fun: the loss, as given to :func:`value_and_grad`.
    opt_state: the state the step returned (an optax state, a
      ``TrainState`` holding it, or an ``nnx.Optimizer``); its
      ``prev_loss_scale`` is the scale re-run at.
    argnums: as for :func:`value_and_grad`; the leaves of these arguments
      are the parameters that name an op's module.
    has_aux: as for :func:`value_and_grad`.
    policy: as for :func:`value_and_grad`: the casts the step made.
    cast_args: as for :func:`value_and_grad`.
    scale: the loss scale to re-run at, instead of the state's
      ``prev_loss_scale``.

  Returns:
    A function of ``fun``'s arguments returning an
    :class:`OverflowLocation` (``print`` it): the op, its line, its module,
    forward or backward, and what to do.

  Raises:
    TypeError: ``opt_state`` holds tracers (call it on the host).
    ValueError: no loss-scale state in ``opt_state``; a ``scale`` that is
      not a positive normal float32; and what :func:`value_and_grad`
      raises for its arguments.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(1024.0)),
    ...               optax.sgd(0.1))
    >>> w = jnp.array([20.0, 1.0])  # exp(20) is past float16's 65504
    >>> loss = lambda w: jnp.sum(jnp.exp(w))
    >>> state = tx.init(w)
    >>> found = fs.locate_overflow(loss, state, policy="p=f32,c=f16,o=f32")(w)
    >>> found.kind, found.primitive
    ('forward', 'exp')
  """
  _validate.require_host(opt_state, "locate_overflow")
  if scale is None:
    scale = float(_lookup.loss_scale_state(opt_state).prev_loss_scale)
  scale = _validate.scale("locate_overflow: scale", scale)
  grad = functools.partial(
    value_and_grad,
    fun,
    argnums=argnums,
    has_aux=has_aux,
    policy=policy,
    cast_args=cast_args,
  )

  def step(s, *args, **kwargs) -> list:
    """The loss and the gradients' leaves at scale ``s``."""
    out, grads = grad(_lookup.set_loss_scale(opt_state, s))(*args, **kwargs)
    loss = out[0] if has_aux else out
    return [loss, *jax.tree.leaves(grads)]

  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  return functools.partial(_locate, step, scale, nums)


def _locate(step, scale, nums, *args, **kwargs):
  """What :func:`locate_overflow` returns for ``fun``'s arguments: ``step``
  (scale, arguments -> loss and gradients) traced with the scale and the
  arguments' arrays as inputs, and run."""
  kept, rest = partition((args, kwargs), lambda x: isinstance(x, _ARRAYS))
  pairs, tree = jax.tree_util.tree_flatten_with_path(kept)
  arrays = [x for _, x in pairs]

  def on_arrays(s, *new):
    """``step`` at scale ``s`` of the arguments with the arrays ``new`` (the
    other leaves, such as an Equinox module's functions, as they are)."""
    a, kw = combine(jax.tree.unflatten(tree, new), rest)
    return step(s, *a, **kw)

  count = itertools.count()
  params = {n % len(args) for n in nums}
  vals = [Val(np.float32(scale), back=True, param=False)]
  vals += [_argument(p, x, params, count) for p, x in pairs]
  jaxpr = jax.make_jaxpr(on_arrays)(np.float32(scale), *arrays)
  outs = _locator.run(jaxpr, vals, count)
  origin = _locator.first(v.origin for v in outs)
  if origin is None:
    return OverflowLocation(kind="none", scale=scale)
  if origin.eqn is None:
    return OverflowLocation(
      kind="input", scale=scale, input_path=origin.input_path
    )
  found = _location.described(origin, scale)
  if found.kind != "backward":
    return found
  start = found.safe_scale or scale
  fits = _fitting_scale(on_arrays, arrays, start)
  return dataclasses.replace(found, step_scale=fits)


def _fitting_scale(step, leaves, scale) -> Optional[float]:
  """The largest power-of-two scale from ``scale`` down at which the
  compiled ``step`` (scale, leaves -> loss and gradients) gives only finite
  values; None if none does down to 2^-24."""
  compiled = jax.jit(step)
  while scale >= 2.0**-24:
    if all(finite(x) for x in compiled(np.float32(scale), *leaves)):
      return scale
    scale /= 2
  return None
