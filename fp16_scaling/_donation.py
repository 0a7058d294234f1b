"""State written over its own donated buffers.

Under ``jax.jit(step, donate_argnums=...)`` JAX hands each output the buffer
of a donated input of the same shape and dtype, pairing them in order. An
input the step never reads is dropped from the compiled executable first
(``jit``'s ``keep_unused=False``), so its buffer pairs with nothing: every
call then allocates a fresh buffer for the output that replaces it, and the
pairing of the inputs that remain shifts, so one field's old buffer ends up
holding another field's new value and XLA inserts ``copy`` instructions to
keep the old values alive.

Bookkeeping fields are exactly such write-only state: the last step's
overflow flag, its norms, its per-leaf attribution. :func:`written_over`
makes each of them read its own old value, through a select whose predicate
is the constant ``True``. XLA removes the select, so it costs nothing, but
the input stays a parameter of the executable, and every output aliases the
input of the same field, as in plain optax's step.

On a GPU this is what keeps a step's buffers at fixed addresses, so the
command buffers (CUDA graphs) XLA records for the step are replayed as
recorded; a fresh output buffer on every call changes the addresses that
every kernel reading it was recorded with.

An aliased output can still cost a ``copy``: XLA copies a donated buffer
when another fusion reads its old value after the one that overwrites it.
:func:`snapshot` and :func:`after` write such scalar state so that the
overwriting fusion is the last reader.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp


def _written_over(old, new):
  if jax.typeof(old) != jax.typeof(new):
    return new  # a changed type has no buffer of its own to reuse
  return lax.select_n(jnp.bool_(True), old, new)


def written_over(old: Any, new: Any) -> Any:
  """``new``, with each leaf written as a function of the same leaf of
  ``old``, so that a donating ``jit`` gives it ``old``'s buffer.

  Args:
    old: the state before the update.
    new: the state after it, with ``old``'s tree structure.

  Returns:
    ``new``, value for value.
  """
  return jax.tree.map(_written_over, old, new)


def snapshot(x: jax.Array) -> jax.Array:
  """``x`` (a float), as a value of its own that every reader reads.

  XLA recomputes a cheap scalar expression inside each fusion that reads
  it, so a donated scalar read by several fusions is read from its input
  buffer by each of them; when one of them writes that buffer in place, XLA
  copies the old value first. The snapshot is one instruction that XLA
  neither folds away nor duplicates once it is also an output (returned as
  another field, ``prev_loss_scale``): every reader reads the snapshot, and
  the donated buffer has one reader.

  Returns:
    ``x``, bit for bit, where it is not NaN; a NaN stays a NaN.
  """
  return jnp.where(jnp.isnan(x), jnp.nan, x)


def after(x: jax.Array, *reads: jax.Array) -> jax.Array:
  """``x`` (an integer or bool), computed after ``reads``.

  XLA writes a donated buffer in place only once every other reader of its
  old value has run, and it orders instructions by their data alone (copy
  insertion runs before scheduling). Where the new value of a state field
  does not depend on the other fields that read its old value, XLA copies
  the old value first. ``max(x, min(x, r))`` is ``x`` for every ``r`` of an
  integer or bool dtype (a lattice identity XLA does not fold), and makes
  ``x`` depend on ``reads``. It is also one instruction of two operands,
  which XLA computes once when it is an output, where it would recompute a
  cheap function of one value inside each reader.

  Args:
    x: an integer or bool array.
    *reads: scalars computed from the old value that ``x`` overwrites (any
      dtype; only their dependency counts).

  Returns:
    ``x``, bit for bit.
  """
  r = jnp.zeros([], x.dtype)
  for y in reads:
    if jnp.issubdtype(y.dtype, jnp.floating):
      y = lax.bitcast_convert_type(y, jnp.dtype(f"int{y.dtype.itemsize * 8}"))
    r = r + y.astype(x.dtype)
  return jnp.maximum(x, jnp.minimum(x, r))
