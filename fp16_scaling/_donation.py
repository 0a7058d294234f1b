"""Write-only state that keeps its own donated buffer.

Under ``jax.jit(step, donate_argnums=...)`` JAX gives each output the buffer
of a donated input of the same shape and dtype, in order, after dropping the
inputs the step never reads (``keep_unused=False``). Bookkeeping fields
(the last step's overflow flag, norms, per-leaf flags) are write-only: left
alone, their inputs are dropped, their outputs take a fresh buffer on every
call, and the remaining inputs pair with the wrong outputs.
:func:`written_over` makes each such field read its old value through a
select on the constant ``True``, which XLA removes: the input stays, and
every output aliases the input of its own field, as in plain optax's step.
``tests/test_alias.py`` shows each use is needed.
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
  """``new``, each leaf written as a function of the same leaf of ``old``,
  so that a donating ``jit`` gives it ``old``'s buffer.

  Args:
    old: the state before the update.
    new: the state after it, with ``old``'s tree structure.

  Returns:
    ``new``, value for value.
  """
  return jax.tree.map(_written_over, old, new)
