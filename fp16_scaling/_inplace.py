"""The skip's selects, placed where XLA can do the whole step in place.

``skip_on_overflow`` keeps the inner state on an overflow step by selecting
``where(overflow, old, new)`` for every state leaf. Written after the inner
update, as a ``jax.tree.map`` over its outputs, that select leaves two readers
of each new Adam moment: the select, which writes the moment's donated buffer,
and the parameter update, which XLA then recomputes from the *old* moment.
The old moment must survive until both have run, so XLA inserts a ``copy`` of
every donated moment: 16 extra bytes per parameter on XLA:CPU, about a
quarter of a memory-bound step.

This module produces the same values with a different dataflow. It traces
the inner update once, to a jaxpr, and rewrites that jaxpr: as soon as a new
state leaf and the overflow flag both exist it inserts the select, and every
later equation that read the new leaf reads the selected one. The update is
then computed from the selected moments, exactly as an unguarded optimizer
computes it from its new moments, and the step has the structure of plain
optax: one pass writes each moment in place, the parameter update reads it
back. The rewritten jaxpr is bound as the ``jit`` call it was traced as, so
nothing is traced twice.

The values are unchanged: on a clean step the selected leaf *is* the new
leaf, and on an overflow step every update is replaced by ``-0.0`` and every
state leaf by its old value, whatever was computed from them. Equations that
the bookkeeping outputs (the loss-scale state, the clip's norms, the overflow
flag) depend on keep reading the unselected values, so those outputs are
exactly what the inner update computed. A scalar integer counter (Adam's
count) is selected as early, but its later readers keep seeing the new
count: :func:`select_counters`.

JAX internals this relies on (``jax.extend.core``, which JAX documents as
having no compatibility guarantee, and the ``jit`` primitive's parameters):

* ``jax.make_jaxpr(jax.jit(f))`` tracing to one ``jit_p`` equation whose
  ``jaxpr`` parameter is a ``ClosedJaxpr`` of ``f``;
* ``Jaxpr.eqns``/``invars``/``outvars``/``constvars``, ``Jaxpr.replace``
  and ``JaxprEqn.replace``/``effects``; ``Var(aval)``, ``Literal``,
  ``new_jaxpr_eqn``, ``no_effects``, ``primitives.select_n_p``;
* re-binding ``jit_p`` with its ``jaxpr`` parameter swapped for the
  rewritten ``ClosedJaxpr``; ``ShapedArray.update(weak_type=...)``;
* ``jax.core.Tracer``, to tell a traced call from an eager one.

Any exception while tracing, rewriting or binding (an API that moved in a new
JAX), or a traced jaxpr without the expected shape, falls back to the plain
select after the inner update: the same values, with the moment copies on
XLA:CPU. The first fallback in a process warns once, naming the JAX version;
errors of the inner update itself are raised as they are. Called eagerly
(no tracers), the inner update runs op by op and the selects follow it:
there is no donated buffer to reuse. ``early=False`` always selects after.

Why a rewrite and not an interpreter: binding every equation of the inner
jaxpr one by one into the caller's trace, with ``where(flag, old, new)``
substituted for later readers, gives the same dataflow and builds no
``Var``, no new equation and no re-bound ``jit``. Measured against this
module at jax 0.10.2 (a prototype, not kept): the same 0 copies of array
buffers and the same bytes accessed (754,297 for 4 leaves of 4096), the
same bits on clean and overflow steps, but trace + lower of a 200-leaf step
took 3.5 s against the rewrite's 2.6 s (median of 3, select-after 2.2 s),
and it needs ``Primitive.get_bind_params`` for every higher-order equation,
whose return value has itself changed between JAX releases.
"""

from typing import Any, Callable, NamedTuple, Sequence
import warnings

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np

# What each flat output of the inner update is.
UPDATE = "update"  # an update leaf: -0.0 on overflow
SELECT = "select"  # an inner state leaf: kept on overflow
KEEP = "keep"  # bookkeeping: returned as computed
OVERFLOW = "overflow"  # the overflow flag itself (bookkeeping)

_warned = False  # one fallback warning per process


class _Unsupported(Exception):
  """The traced jaxpr does not have the shape the rewrite expects."""


class _Eager(Exception):
  """No argument is traced: the update runs op by op, select after it."""


class _InnerError(Exception):
  """An exception of the inner update: not ours."""


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


class StateLabels(NamedTuple):
  """What the skip does to each leaf of the state an update returns.

  Attributes:
    tree: the treedef the returned state must have.
    labels: per leaf, ``SELECT``, ``KEEP`` or ``OVERFLOW`` (exactly one).
    olds: per ``SELECT`` leaf the old value it falls back to (``None``
      elsewhere).
  """

  tree: Any
  labels: Sequence[str]
  olds: Sequence[Any]


def call_selecting(
  fn: Callable[..., Any],
  args: Sequence[Any],
  state: StateLabels,
  *,
  early: bool = True,
) -> Any:
  """Calls ``fn(*args)`` and applies the skip, with the selects moved early.

  Args:
    fn: the inner update; returns ``(updates, state)``. Every update leaf
      is ``UPDATE``: ``-0.0`` on an overflow (the updates may have another
      tree than the gradients, as ``optax.lookahead``'s do).
    args: its positional arguments (pytrees). Array leaves are traced; any
      other leaf (a function such as ``optax.lbfgs``'s ``value_fn``, a
      Python number) is passed to ``fn`` as it is.
    state: the labels of the returned state's leaves.
    early: False: always select after the call.

  Returns:
    ``fn``'s ``(updates, state)``, with the updates ``-0.0`` and the
    ``SELECT`` leaves their old values when the overflow flag is set.

  Raises:
    ValueError: ``fn`` returned a state of another structure than
      ``state.tree``, or ``state.labels`` holds no single ``OVERFLOW``.
  """
  _checked(state.labels, state.olds)
  failure = None
  if early:
    try:
      return _call_early(fn, args, state)
    except _Eager:
      pass
    except _InnerError as e:
      raise e.__cause__ from None
    except Exception as e:  # any change in JAX internals: fall back
      failure = e
  out = fn(*args)
  labels_olds = _labelled(out, state)
  if failure is not None:
    _warn_fallback(failure)
  return _finish(
    jax.tree.leaves(out), jax.tree.structure(out), labels_olds, None
  )


def _warn_fallback(failure: Exception) -> None:
  global _warned
  if _warned:
    return
  _warned = True
  warnings.warn(
    f"fp16_scaling.skip_on_overflow: the in-place rewrite failed on JAX "
    f"{jax.__version__} ({type(failure).__name__}: {failure}); selecting "
    f"after the update instead. Results are the same; on XLA:CPU the step "
    f"copies each donated optimizer moment. Pass early_select=False to "
    f"silence this.",
    RuntimeWarning,
    stacklevel=2,
  )


def _call_early(fn, args, state):
  leaves, treedef = jax.tree.flatten(args)
  traced = [_is_array(x) for x in leaves]
  in_vals = [x for x, t in zip(leaves, traced) if t]
  if not any(isinstance(x, jax.core.Tracer) for x in in_vals):
    # Called eagerly, op by op: no buffer is donated, nothing to gain, and
    # binding a freshly traced jit call would compile it on every call.
    raise _Eager

  def flat_fn(*arrays):
    it = iter(arrays)
    full = [next(it) if t else x for x, t in zip(leaves, traced)]
    try:
      return fn(*jax.tree.unflatten(treedef, full))
    except Exception as e:
      raise _InnerError from e

  outer, out_shape = jax.make_jaxpr(jax.jit(flat_fn), return_shape=True)(
    *in_vals
  )
  try:
    labels_olds = _labelled(out_shape, state)
  except ValueError as e:
    raise _InnerError from e
  call = _single_jit_call(outer)
  if call is None:
    raise _Unsupported("the traced update is not one jit call")
  # The call's operands: the arguments, and any traced value ``fn`` closes
  # over (a learning rate under jax.grad), which the outer jaxpr holds as a
  # constant.
  env = dict(zip(outer.jaxpr.invars, in_vals))
  env.update(zip(outer.jaxpr.constvars, outer.consts))
  call_args = [env[v] for v in call.invars]
  labels, olds = labels_olds
  position = {}
  for i, x in enumerate(call_args):
    position.setdefault(id(x), i)
  old_positions = [
    None if old is None else position.get(id(old)) for old in olds
  ]
  inner = call.params["jaxpr"]
  jaxpr, done = select_early(inner.jaxpr, labels, old_positions)
  jaxpr, done = select_counters(jaxpr, labels, old_positions, done)
  params = dict(call.params, jaxpr=jex_core.ClosedJaxpr(jaxpr, inner.consts))
  return _finish(
    call.primitive.bind(*call_args, **params),
    jax.tree.structure(out_shape),
    labels_olds,
    done,
  )


def _checked(labels, olds):
  labels, olds = list(labels), list(olds)
  if labels.count(OVERFLOW) != 1 or len(olds) != len(labels):
    raise ValueError(
      f"expected one overflow output and an old value per label, got "
      f"{labels.count(OVERFLOW)} and {len(olds)} for {len(labels)}"
    )
  return labels, olds


def _labelled(out, state: StateLabels) -> tuple:
  """``(labels, olds)`` for every flat output of ``(updates, state)``."""
  updates, new_state = out
  if jax.tree.structure(new_state) != state.tree:
    raise ValueError(
      "skip_on_overflow: the inner update returned a state whose structure "
      f"differs from its input state: {jax.tree.structure(new_state)} "
      f"against {state.tree}"
    )
  n = len(jax.tree.leaves(updates))
  return [UPDATE] * n + list(state.labels), [None] * n + list(state.olds)


def _finish(outs, treedef, labels_olds, done):
  """The selects not made inside: every update, and the state leaves not
  ``done`` (all of them when ``done`` is None)."""
  labels, olds = labels_olds
  done = [False] * len(labels) if done is None else done
  flag = outs[labels.index(OVERFLOW)]
  final = []
  for x, label, old, selected in zip(outs, labels, olds, done):
    if label == UPDATE:
      x = jnp.where(flag, -0.0, x)
    elif label == SELECT and not selected:
      x = jnp.where(flag, old, x)
    final.append(x)
  return jax.tree.unflatten(treedef, final)


def select_early(
  jaxpr, labels: Sequence[str], old_positions: Sequence[Any]
) -> tuple:
  """Inserts the skip's state selects into ``jaxpr`` as early as possible.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr`` whose outputs are labelled.
    labels: one of ``UPDATE``, ``SELECT``, ``KEEP``, ``OVERFLOW`` per output.
    old_positions: for each ``SELECT`` output, the index of the ``jaxpr``
      input that holds its old value (``None``: no early select).

  Returns:
    ``(new_jaxpr, done)``: ``done[i]`` says output ``i`` already is
    ``where(overflow, old, new)`` (selected inside, or passed through
    unchanged); every other ``SELECT`` output still needs its select.
  """
  outvars = jaxpr.outvars
  flag_var = outvars[list(labels).index(OVERFLOW)]
  done = [False] * len(outvars)
  if _is_literal(flag_var):
    return jaxpr, done
  candidates = _candidates(jaxpr, labels, old_positions, done)
  if not candidates:
    return jaxpr, done
  eqns, selected = _with_selects(
    jaxpr, flag_var, candidates, _protected(jaxpr, labels)
  )
  return _with_outputs(jaxpr, labels, done, eqns, selected)


def _protected(jaxpr, labels) -> set:
  """The equations the bookkeeping outputs depend on: they keep reading the
  unselected values."""
  roots = [
    v for v, label in zip(jaxpr.outvars, labels) if label in (KEEP, OVERFLOW)
  ]
  return _backward_slice(jaxpr, roots)


def _with_outputs(jaxpr, labels, done, eqns, selected) -> tuple:
  """``jaxpr`` with ``eqns``, each ``SELECT`` output in ``selected``
  replaced by its selected Var and marked in ``done``."""
  done = list(done)
  new_outvars = list(jaxpr.outvars)
  for i, (v, label) in enumerate(zip(jaxpr.outvars, labels)):
    if label == SELECT and not _is_literal(v) and v in selected:
      new_outvars[i] = selected[v]
      done[i] = True
  return jaxpr.replace(eqns=eqns, outvars=new_outvars), done


def _candidates(jaxpr, labels, old_positions, done) -> dict:
  """The new state leaves to select early, each mapped to its old value.

  A Var returned as the replacement of exactly one old value (a Var
  returned for two different old values has no single selected value), of
  the very same type: shape, dtype and, under explicit sharding or
  shard_map, sharding and varying axes. Scalar state (a step count) is
  not selected here: an optimizer may divide by a function of its count
  that is 0 on the old state (Adam's bias correction at step 0), a
  discarded NaN that would still reach gradients taken through the step
  (:func:`select_counters` selects integer counters so that their readers
  never see the old value). Marks in ``done`` the outputs returned
  unchanged.
  """
  candidates, shared = {}, set()
  for i, (v, label, pos) in enumerate(
    zip(jaxpr.outvars, labels, old_positions)
  ):
    if label != SELECT or pos is None or _is_literal(v):
      continue
    old_var = jaxpr.invars[pos]
    if v is old_var:
      done[i] = True  # returned unchanged: the select is the identity
      continue
    if _strong(v.aval) != _strong(old_var.aval) or not v.aval.shape:
      continue
    if candidates.get(v, old_var) is not old_var:
      shared.add(v)
    candidates[v] = old_var
  for v in shared:
    del candidates[v]
  return candidates


def _with_selects(jaxpr, flag_var, candidates, protected) -> tuple:
  """``jaxpr``'s equations with a select after each candidate's definition
  (once the flag exists), read by every later equation not ``protected``.

  Returns:
    ``(eqns, selected)``: the new equations, and each candidate's selected
    Var.
  """
  defined = set(jaxpr.constvars) | set(jaxpr.invars)
  selected, eqns = {}, []

  def emit_selects(new_vars, source_info):
    for v in new_vars:
      if v in candidates and v not in selected and v in defined:
        selected[v] = _select(eqns, flag_var, v, candidates[v], source_info)

  flag_known = flag_var in defined
  if flag_known:
    emit_selects(list(candidates), None)
  for i, eqn in enumerate(jaxpr.eqns):
    eqns.append(_reading(eqn, selected, i in protected))
    defined.update(eqn.outvars)
    if flag_known:
      emit_selects(eqn.outvars, eqn.source_info)
    elif flag_var in defined:
      flag_known = True
      emit_selects(list(candidates), eqn.source_info)
  return eqns, selected


def _single_jit_call(closed):
  """The one ``jit`` equation of ``make_jaxpr(jax.jit(f))``, or None.

  Its operands must all be inputs or constants of ``closed``, and its
  outputs exactly ``closed``'s outputs.
  """
  jaxpr = closed.jaxpr
  if len(jaxpr.eqns) != 1 or len(closed.consts) != len(jaxpr.constvars):
    return None
  (eqn,) = jaxpr.eqns
  known = set(jaxpr.invars) | set(jaxpr.constvars)
  if (
    eqn.primitive is not jex_core.primitives.jit_p
    or any(_is_literal(v) or v not in known for v in eqn.invars)
    or list(eqn.outvars) != list(jaxpr.outvars)
    or "jaxpr" not in eqn.params
  ):
    return None
  return eqn


def _strong(aval):
  return aval.update(weak_type=False) if hasattr(aval, "weak_type") else aval


def _is_literal(v) -> bool:
  return isinstance(v, jex_core.Literal)


def _backward_slice(jaxpr, roots) -> set:
  """Indices of the equations that ``roots`` depend on."""
  needed = {v for v in roots if not _is_literal(v)}
  indices = set()
  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    if any(v in needed for v in eqn.outvars):
      indices.add(i)
      needed.update(v for v in eqn.invars if not _is_literal(v))
  return indices


def select_counters(
  jaxpr, labels: Sequence[str], old_positions: Sequence[Any], done
) -> tuple:
  """Selects integer scalar state (a step count) where XLA writes it in place.

  :func:`select_early` leaves scalar state to the select after the update:
  an optimizer may divide by a function of its count that is 0 on the old
  state (Adam's bias correction at step 0). But then two fusions read the
  donated old count: the select that overwrites it, and each reader of the
  new count, into which XLA fuses the increment. The old count must survive
  the select, and XLA copies it.

  Here the select is made as soon as the new count and the overflow flag
  exist, and the later readers read ``select_n(flag, selected,
  recount(selected))``, where ``recount`` is the computation of the new
  count from the old one, applied to the selected count. On a clean step
  that is the selected (new) count; on an overflow step the selected count
  is the old one and ``recount`` gives the new count again: the readers see
  the very value they read before, never the old count. They now read the
  selected count alone, and the select is the only reader of the donated
  buffer it overwrites. Only integer scalars whose new value is computed
  from their old value alone: their recount has no NaN to make, and no
  other buffer gains a reader.

  Args:
    jaxpr: the ``Jaxpr`` :func:`select_early` returned.
    labels: as for :func:`select_early`.
    old_positions: as for :func:`select_early`.
    done: :func:`select_early`'s ``done``.

  Returns:
    ``(new_jaxpr, done)``, with ``done`` updated.
  """
  outvars = jaxpr.outvars
  flag_var = outvars[list(labels).index(OVERFLOW)]
  if _is_literal(flag_var):
    return jaxpr, done
  counters = _counters(jaxpr, labels, old_positions, done)
  if not counters:
    return jaxpr, done
  eqns, selected = _with_counter_selects(
    jaxpr, flag_var, counters, _protected(jaxpr, labels)
  )
  return _with_outputs(jaxpr, labels, done, eqns, selected)


def _counters(jaxpr, labels, old_positions, done) -> dict:
  """Integer scalar state computed from its old value alone: each new Var
  mapped to ``(old_var, recount)``, the equations that compute it."""
  counters, shared = {}, set()
  for i, (v, label, pos) in enumerate(
    zip(jaxpr.outvars, labels, old_positions)
  ):
    if label != SELECT or pos is None or done[i] or _is_literal(v):
      continue
    old_var = jaxpr.invars[pos]
    aval = _strong(v.aval)
    if (
      aval != _strong(old_var.aval)
      or aval.shape
      or not jnp.issubdtype(aval.dtype, jnp.integer)
    ):
      continue
    if counters.get(v, old_var) is not old_var:
      shared.add(v)
    counters[v] = old_var
  found = {}
  for v, old_var in counters.items():
    recount = _slice_from(jaxpr, v, old_var)
    if v not in shared and recount is not None:
      found[v] = (old_var, recount)
  return found


def _with_counter_selects(jaxpr, flag_var, counters, protected) -> tuple:
  """``jaxpr``'s equations with each counter selected as soon as it and the
  flag exist, and its later readers (not ``protected``) reading
  ``select_n(flag, selected, recount(selected))``.

  Returns:
    ``(eqns, selected)``: the new equations, each counter's selected Var.
  """
  defined = set(jaxpr.constvars) | set(jaxpr.invars)
  selected, reads, eqns = {}, {}, []

  def emit(source_info):
    for v, (old_var, recount) in counters.items():
      if v in selected or v not in defined or flag_var not in defined:
        continue
      chosen = _select(eqns, flag_var, v, old_var, source_info)
      renamed = {old_var: chosen}
      for eqn in recount:
        outs = [jex_core.Var(o.aval) for o in eqn.outvars]
        invars = [
          x if _is_literal(x) else renamed.get(x, x) for x in eqn.invars
        ]
        eqns.append(eqn.replace(invars=invars, outvars=outs))
        renamed.update(zip(eqn.outvars, outs))
      selected[v] = chosen
      reads[v] = _select(eqns, flag_var, chosen, renamed[v], source_info)

  emit(None)
  for i, eqn in enumerate(jaxpr.eqns):
    eqns.append(_reading(eqn, reads, i in protected))
    defined.update(eqn.outvars)
    emit(eqn.source_info)
  return eqns, selected


def _reading(eqn, renames: dict, protected: bool):
  """``eqn`` reading ``renames[v]`` for each input ``v`` it renames, unless
  ``protected``."""
  if protected or not any(
    not _is_literal(v) and v in renames for v in eqn.invars
  ):
    return eqn
  return eqn.replace(
    invars=[v if _is_literal(v) else renames.get(v, v) for v in eqn.invars]
  )


def _select(eqns, flag_var, new, old, source_info):
  """Appends ``select_n(flag, new, old)`` to ``eqns``; its output Var."""
  out = jex_core.Var(new.aval)
  eqns.append(
    jex_core.new_jaxpr_eqn(
      [flag_var, new, old],
      [out],
      jex_core.primitives.select_n_p,
      {},
      jex_core.no_effects,
      source_info,
    )
  )
  return out


def _slice_from(jaxpr, v, old_var):
  """The equations that compute ``v`` from ``old_var`` (and literals and
  constants) alone, in order; None if it needs any other input, an
  equation with effects or a non-scalar value."""
  producer = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for o in eqn.outvars:
      producer[o] = i
  consts = set(jaxpr.constvars)
  needed, todo = set(), [v]
  while todo:
    x = todo.pop()
    if _is_literal(x) or x is old_var or x in consts:
      continue
    if x not in producer:
      return None  # another input of the update
    i = producer[x]
    if i in needed:
      continue
    eqn = jaxpr.eqns[i]
    if eqn.effects or any(o.aval.shape for o in eqn.outvars):
      return None
    needed.add(i)
    todo.extend(eqn.invars)
  return [jaxpr.eqns[i] for i in sorted(needed)]
