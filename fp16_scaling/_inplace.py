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
exactly what the inner update computed.

Where the traced jaxpr does not have the expected shape (one ``jit`` call
over the arguments), or a leaf cannot be selected early, the select is made
after the call instead: slower on XLA:CPU, never different. Called eagerly
(no tracers), the inner update runs op by op and the selects follow it:
there is no donated buffer to reuse.
"""

from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp

# What each flat output of the inner update is.
UPDATE = "update"  # an update leaf: -0.0 on overflow
SELECT = "select"  # an inner state leaf: kept on overflow
KEEP = "keep"  # bookkeeping: returned as computed
OVERFLOW = "overflow"  # the overflow flag itself (bookkeeping)


def call_selecting(
  fn: Callable[..., Any],
  args: Sequence[Any],
  labels_and_olds: Callable[[Any], tuple],
) -> Any:
  """Calls ``fn(*args)`` and applies the skip, with the selects moved early.

  Args:
    fn: the inner update; returns a pytree.
    args: its positional arguments (pytrees of arrays).
    labels_and_olds: given ``fn``'s output shape tree, returns
      ``(labels, olds)``: for every flat output one of ``UPDATE``,
      ``SELECT``, ``KEEP`` or ``OVERFLOW`` (exactly one), and for every
      ``SELECT`` output the old value it falls back to (``None`` elsewhere).

  Returns:
    ``fn``'s output pytree, with ``UPDATE`` leaves ``-0.0`` and ``SELECT``
    leaves their old values when the overflow flag is set.
  """
  in_vals = jax.tree.leaves(args)
  if not any(isinstance(x, jax.core.Tracer) for x in in_vals):
    # Called eagerly, op by op: no buffer is donated, nothing to gain, and
    # binding a freshly traced jit call would compile it on every call.
    out = fn(*args)
    return _finish(
      jax.tree.leaves(out),
      jax.tree.structure(out),
      _checked(labels_and_olds(out)),
      None,
    )
  outer, out_shape = jax.make_jaxpr(jax.jit(fn), return_shape=True)(*args)
  labels_olds = _checked(labels_and_olds(out_shape))
  call = _single_jit_call(outer)
  if call is None:
    return _finish(
      jex_core.jaxpr_as_fun(outer)(*in_vals),
      jax.tree.structure(out_shape),
      labels_olds,
      None,
    )
  labels, olds = labels_olds
  position = {id(x): i for i, x in enumerate(in_vals)}
  old_positions = [
    None if old is None else position.get(id(old)) for old in olds
  ]
  inner = call.params["jaxpr"]
  jaxpr, done = select_early(inner.jaxpr, labels, old_positions)
  params = dict(call.params, jaxpr=jex_core.ClosedJaxpr(jaxpr, inner.consts))
  return _finish(
    call.primitive.bind(*in_vals, **params),
    jax.tree.structure(out_shape),
    labels_olds,
    done,
  )


def _checked(labels_olds):
  labels, olds = map(list, labels_olds)
  if labels.count(OVERFLOW) != 1:
    raise ValueError(
      f"expected one overflow output, got {labels.count(OVERFLOW)}"
    )
  return labels, olds


def _finish(outs, treedef, labels_olds, done):
  """The selects not made inside: every update, and the state leaves not
  ``done`` (all of them when ``done`` is None)."""
  labels, olds = labels_olds
  done = [False] * len(labels) if done is None else done
  flag = outs[labels.index(OVERFLOW)]
  final = []
  for x, label, old, selected in zip(outs, labels, olds, done):
    if label == UPDATE:
      # select_n takes the scalar flag as is; full_like keeps x's sharding.
      x = jax.lax.select_n(flag, x, jax.lax.full_like(x, -0.0))
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

  # The new state leaves to select early: a Var returned as the replacement
  # of exactly one old value (a Var returned for two different old values
  # has no single selected value), of the very same type: shape, dtype and,
  # under explicit sharding or shard_map, sharding and varying axes.
  candidates, shared = {}, set()
  for i, (v, label, pos) in enumerate(zip(outvars, labels, old_positions)):
    if label != SELECT or pos is None or _is_literal(v):
      continue
    old_var = jaxpr.invars[pos]
    if v is old_var:
      done[i] = True  # returned unchanged: the select is the identity
      continue
    if _strong(v.aval) != _strong(old_var.aval):
      continue
    if candidates.get(v, old_var) is not old_var:
      shared.add(v)
    candidates[v] = old_var
  for v in shared:
    del candidates[v]
  if not candidates:
    return jaxpr, done

  protected = _backward_slice(
    jaxpr, [v for v, label in zip(outvars, labels) if label in (KEEP, OVERFLOW)]
  )
  defined = set(jaxpr.constvars) | set(jaxpr.invars)
  selected, eqns = {}, []

  def emit_selects(new_vars, source_info):
    for v in new_vars:
      if v in candidates and v not in selected and v in defined:
        out = jex_core.Var(v.aval)
        eqns.append(
          jex_core.new_jaxpr_eqn(
            [flag_var, v, candidates[v]],
            [out],
            jex_core.primitives.select_n_p,
            {},
            jex_core.no_effects,
            source_info,
          )
        )
        selected[v] = out

  flag_known = flag_var in defined
  if flag_known:
    emit_selects(list(candidates), None)
  for i, eqn in enumerate(jaxpr.eqns):
    if i not in protected and any(
      not _is_literal(v) and v in selected for v in eqn.invars
    ):
      eqn = eqn.replace(
        invars=[v if _is_literal(v) else selected.get(v, v) for v in eqn.invars]
      )
    eqns.append(eqn)
    defined.update(eqn.outvars)
    if flag_known:
      emit_selects(eqn.outvars, eqn.source_info)
    elif flag_var in defined:
      flag_known = True
      emit_selects(list(candidates), eqn.source_info)

  new_outvars = list(outvars)
  for i, (v, label) in enumerate(zip(outvars, labels)):
    if label == SELECT and not _is_literal(v) and v in selected:
      new_outvars[i] = selected[v]
      done[i] = True
  return jaxpr.replace(eqns=eqns, outvars=new_outvars), done


def _single_jit_call(closed):
  """The one ``jit`` equation of ``make_jaxpr(jax.jit(f))``, or None."""
  jaxpr = closed.jaxpr
  if closed.consts or jaxpr.constvars or len(jaxpr.eqns) != 1:
    return None
  (eqn,) = jaxpr.eqns
  if (
    eqn.primitive is not jex_core.primitives.jit_p
    or list(eqn.invars) != list(jaxpr.invars)
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
