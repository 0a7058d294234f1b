"""The interpreter behind :func:`locate_overflow`: it evaluates a jaxpr
(what ``jax.make_jaxpr`` returns) equation by equation with
``primitive.bind``, JAX's documented interpreter idiom, entering the calls
(``jit``, ``custom_jvp``, ``custom_vjp``, ``checkpoint``), the taken branch
of a ``cond`` and each iteration of a ``scan`` (a layer). Each value
carries where its inf or NaN came from, whether it depends on the loss
scale (the backward pass does, the forward pass does not) and the path of
the module whose parameters are nearest upstream.
"""

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from fp16_scaling._overflow_locator.location import bind
from fp16_scaling._overflow_locator.location import finite
from fp16_scaling._overflow_locator.location import floating
from fp16_scaling._overflow_locator.location import module_of

# Evaluated whole, not entered: a while loop (its body runs any number of
# times) and the per-device bodies of the mapped calls.
_WHOLE = ("while", "shard_map", "xla_pmap")


class Origin(NamedTuple):
  """Where a non-finite value came from.

  Origins order as the first one is chosen: a constant after any other,
  then by ``seq``.

  Attributes:
    constant: the equation only wrote an inf no op made (a ``-inf`` mask).
    seq: the order in which the origins were found.
    eqn: the equation that made it, or None for an argument leaf.
    out: the output of the equation that is not finite.
    ins: the equation's inputs (:class:`Val` s): whether it is of the
      backward pass and its module follow from them.
    path: what the op lies in, outermost first: each call's equation (a
      ``jit``, ``cond``, ``scan``...) and each scan's iteration (an int).
    input_path: for an argument leaf, its path (``args[1]['x']``).
  """

  constant: bool = False
  seq: int = 0
  eqn: Any = None
  out: Any = None
  ins: tuple = ()
  path: tuple = ()
  input_path: str = ""


class Val(NamedTuple):
  """A value of the run, with what the interpreter knows of it."""

  value: Any
  origin: Optional[Origin] = None  # of its inf or NaN, if it holds any
  back: bool = False  # depends on the loss scale: the backward pass
  module: Optional[tuple] = None  # the nearest module's path, in pieces
  param: Optional[bool] = None  # a view of parameters (None: a constant)


def _open(j):
  """``(jaxpr, consts)`` of a closed or an open jaxpr, of either JAX."""
  jaxpr = getattr(j, "jaxpr", j)
  consts = getattr(j, "consts", ())
  return jaxpr, consts


def run(j, args, count, path=()):
  """The outputs of jaxpr ``j`` on ``args``, as :class:`Val` s.

  Args:
    j: a jaxpr, closed or open.
    args: a :class:`Val` per input.
    count: an ``itertools.count`` that numbers the origins.
    path: the calls (equations) and scan iterations (ints) ``j`` lies in.

  Returns:
    A :class:`Val` per output.
  """
  jaxpr, consts = _open(j)
  env = dict(zip(jaxpr.constvars, map(Val, consts)))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    if hasattr(v, "val"):  # a literal
      return Val(v.val)
    return env[v]

  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _eqn(eqn, ins, count, path)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _inner(eqn):
  """The jaxpr ``eqn`` calls with its own inputs for its own outputs (a
  ``jit``, ``checkpoint``, ``custom_jvp`` or ``custom_vjp`` call), or
  None (for a ``while`` loop, a ``shard_map`` or a ``pmap``, run whole)."""
  if eqn.primitive.name in _WHOLE:
    return None
  arity = (len(eqn.invars), len(eqn.outvars))
  for param in eqn.params.values():
    jaxpr = _open(param)[0]
    if not hasattr(jaxpr, "eqns"):
      continue
    if arity == (len(jaxpr.invars), len(jaxpr.outvars)):
      return param
  return None


def _eqn(eqn, ins, count, path):
  """The outputs of one equation, entered if it calls a jaxpr."""
  name = eqn.primitive.name
  inside = (*path, eqn)
  if name == "scan":
    return _scan(eqn, ins, count, inside)
  if name == "cond":
    taken = int(ins[0].value)
    branch = eqn.params["branches"][taken]
    return run(branch, ins[1:], count, inside)
  inner = _inner(eqn)
  if inner is not None:
    return run(inner, ins, count, inside)
  values = [i.value for i in ins]
  outs = bind(eqn, values)
  return _mark(eqn, ins, outs, count, path)


def _with_layer_axis(outer, inner):
  """How many of the variables ``outer`` have one axis more than their
  counterparts ``inner`` in a scan's body: its xs (or ys)."""
  more = [o.aval.ndim > i.aval.ndim for o, i in zip(outer, inner)]
  return sum(more)


def _scan_parts(eqn, ins):
  """``(consts, carry, xs)``: a scan's inputs, split as its outputs are
  (carry, then ys; an x and a y have a leading axis more than in the
  body)."""
  body = _open(eqn.params["jaxpr"])[0]
  n_ys = _with_layer_axis(eqn.outvars, body.outvars)
  n_carry = len(eqn.outvars) - n_ys
  n_xs = _with_layer_axis(eqn.invars, body.invars)
  first_x = len(ins) - n_xs
  first_carry = first_x - n_carry
  consts = ins[:first_carry]
  carry = ins[first_carry:first_x]
  xs = ins[first_x:]
  return consts, carry, xs


def _scan(eqn, ins, count, path):
  """A ``scan``'s outputs, its body run one iteration (a layer) at a time."""
  consts, carry, xs = _scan_parts(eqn, ins)
  body = eqn.params["jaxpr"]
  n_carry = len(carry)
  length = eqn.params["length"]
  order = range(length)
  if eqn.params["reverse"]:
    order = reversed(order)
  ys = [None] * length
  for i in order:
    sliced = [x._replace(value=x.value[i]) for x in xs]
    args = consts + carry + sliced
    out = run(body, args, count, (*path, i))
    carry = out[:n_carry]
    ys[i] = out[n_carry:]
  columns = zip(*ys)  # per output, its value at each iteration
  return carry + [_stacked(list(vals)) for vals in columns]


def _stacked(vals):
  """A scan's output, stacked from its iterations' ``vals``."""
  value = jnp.stack([v.value for v in vals])
  origin = first(v.origin for v in vals)
  return vals[-1]._replace(value=value, origin=origin)


def first(origins):
  """The first of ``origins`` found (None aside), one that is not a
  constant if any is (the order of :class:`Origin`); None if none is."""
  return min(filter(None, origins), default=None)


def _mark(eqn, ins, outs, count, path):
  """``outs`` as :class:`Val` s: backward if an input is, of the nearest
  module, each non-finite one with its origin."""
  floats = [i for i in ins if floating(i.value)]
  module, _, view = module_of(floats)
  back = any(i.back for i in ins)
  vals = []
  for out in outs:
    origin = None
    if not finite(out):
      origin = _origin(eqn, ins, out, count, path)
    vals.append(Val(out, origin, back, module=module, param=view))
  return vals


def _fresh(ins, out):
  """Whether an element of ``out`` is not finite where every input is
  finite (an input of another shape, broadcast: if it is finite
  throughout)."""
  fresh = ~np.isfinite(out)
  for i in ins:
    if not floating(i.value):
      continue
    ok = np.isfinite(i.value)
    if ok.shape == fresh.shape:
      fresh &= ok
    else:  # where it is not finite cannot be told
      fresh &= bool(ok.all())
  return bool(fresh.any())


def _origin(eqn, ins, out, count, path):
  """Where ``out``'s inf or NaN came from: ``eqn``, if it made a new one
  (a constant, if only an input no op made holds one), else the first
  origin of its inputs; ``path`` is what the op lies in."""
  found = [i.origin for i in ins]
  new = _fresh(ins, out)
  if new or not any(found):
    made = Origin(
      constant=not new, seq=next(count), eqn=eqn, out=out, ins=ins, path=path
    )
    found.append(made)
  return first(found)
