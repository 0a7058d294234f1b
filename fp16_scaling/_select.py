"""``select_on_overflow``: the model state outside the optimizer (BatchNorm's
statistics, an EMA of the parameters) follows the optimizer's skip
(docs/design.md, "What the skip covers").
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _lookup
from fp16_scaling import _metrics
from fp16_scaling._lookup import is_nnx_variable

_LIVE = (
  "select_on_overflow: {} holds live nnx.Variable objects (at {}), which "
  "the forward pass overwrites in place: a snapshot of them taken before it "
  "already holds the new values, so old would be new. Take both as plain "
  "arrays: old = nnx.as_pure(nnx.state(model, nnx.BatchStat)) before the "
  "forward pass, new = nnx.as_pure(nnx.state(model, nnx.BatchStat)) after "
  "the update."
)


def _refuse_live(new, old) -> None:
  """Raises ValueError, naming the fix, for live nnx ``Variable`` s in
  ``new`` or ``old`` (a type check)."""
  for name, tree in (("old", old), ("new", new)):
    paths = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_nnx_variable)
    live = [jax.tree_util.keystr(p) for p, x in paths if is_nnx_variable(x)]
    if live:
      raise ValueError(_LIVE.format(name, live[0] or "the root"))


def skipped(opt_state: optax.OptState) -> jax.Array:
  """Whether the call that produced ``opt_state`` must keep the old model
  state: the bool array :func:`select_on_overflow` selects on."""
  overflow = _metrics.scale_metrics(opt_state)["overflow"]
  acc = _lookup.accumulation_state(opt_state)
  if acc is None:
    return overflow
  # Mid-window the optimizer did not step. From the window's first
  # non-finite microbatch on, its forward pass may have written inf or NaN
  # into the model state: keep the old one up to the window's end.
  # "skip_step" adds that microbatch to the accumulator (which stays
  # non-finite until the window ends); "drop_microbatch" leaves it out and
  # counts one clean microbatch fewer than it has seen.
  batch = jnp.ndim(overflow)
  finite = jnp.stack(
    [
      jnp.all(jnp.isfinite(a), axis=tuple(range(batch, jnp.ndim(a))))
      for a in jax.tree.leaves(acc.acc_grads)
    ]
    or [jnp.ones(jnp.shape(overflow), bool)]
  ).all(axis=0)
  dropped = acc.clean_in_window < acc.mini_step
  return jnp.where(acc.window_ended, overflow, ~finite | dropped)


def select_on_overflow(opt_state: optax.OptState, *, new: Any, old: Any) -> Any:
  """``old`` where the optimizer skipped the step, else ``new``, per leaf.

  The guarded chain keeps the parameters and the optimizer state bit for bit
  on an overflow step; state it does not hold (Haiku's ``state``, Linen's
  ``batch_stats``, NNX's ``BatchStat``, an EMA of the parameters kept
  outside optax) follows the skip only through this select. Call it in the
  step, after ``tx.update``, on the state that update returned, with
  ``new`` and ``old`` by keyword (so that they cannot be swapped silently).

  Which calls keep ``old``: without :func:`accumulate_gradients`, the
  overflow steps (``scale_metrics(opt_state)["overflow"]``). Under
  :func:`accumulate_gradients`, a window's end keeps ``old`` when the
  window's step was skipped; a call inside a window keeps ``old`` from the
  window's first non-finite microbatch on (``"skip_step"``: the accumulator
  holds its inf or NaN; ``"drop_microbatch"``: it was dropped), so a
  forward overflow's statistics never enter the model state, and the clean
  microbatches before it keep their updates, as torch and DeepSpeed keep
  every microbatch's BatchNorm update. This reads the accumulator once a
  call. Under ``"drop_microbatch"`` a dropped *last* microbatch of a
  window whose step was applied leaves no trace in the state: that call
  keeps ``new``.

  Args:
    opt_state: the optax state ``tx.update`` just returned (an
      ``nnx.Optimizer``'s ``opt_state`` too), holding one
      ``fp16_loss_scale`` state. A batched state (``vmap`` ped ``init``)
      has its batch axes in front of every leaf of ``new`` and ``old``.
    new: the pytree after this step (e.g. the state ``apply`` returned).
    old: the pytree before it, of the same tree structure. Under NNX take
      it as a snapshot, ``nnx.as_pure(nnx.state(model, nnx.BatchStat))``,
      before the forward pass: ``nnx.state`` alone holds the live
      ``Variable`` s, which the forward pass overwrites.

  Returns:
    A pytree of ``new``'s structure: each leaf ``old``'s, bit for bit, on
    a kept call, else ``new``'s; traceable (one ``jnp.where`` per leaf).

  Raises:
    ValueError: ``new`` and ``old`` differ in tree structure, or in a leaf's
      shape or dtype; a batched state's batch axes do not lead a leaf;
      ``opt_state`` holds no ``fp16_loss_scale`` state; ``new`` or ``old``
      holding live nnx ``Variable`` s (a snapshot without ``nnx.as_pure``,
      which the forward pass overwrites), naming the fix.
    TypeError: ``new`` or ``old`` passed by position.

  Not refused, since no value, type or tree structure tells them from the
  documented call (the same eager and under ``jit``;
  ``tests/test_refusals.py``):

  * ``opt_state`` from *before* ``tx.update`` (the one the gradients were
    computed with): its overflow flag is the last step's, so the select
    lags one step. On an overflow step it keeps ``new``, the statistics
    the bad batch wrote (an inf or NaN in the moving averages), and on the
    clean step after it keeps ``old``, those same statistics: from then
    on the model state is not finite.
  * ``old`` taken after the forward pass (an NNX snapshot taken after the
    model ran): it holds the new values already, so the select keeps them
    on an overflow step too.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(8.0)),
    ...               optax.sgd(0.1))
    >>> params = {"w": jnp.zeros(2)}
    >>> opt_state = tx.init(params)
    >>> ema = {"w": jnp.ones(2)}
    >>> _, opt_state = tx.update({"w": jnp.array([jnp.inf, 0.0])},
    ...                          opt_state, params)
    >>> fs.select_on_overflow(
    ...     opt_state, new={"w": jnp.full(2, jnp.nan)}, old=ema)
    {'w': Array([1., 1.], dtype=float32)}
  """
  _refuse_live(new, old)
  new_paths, treedef = jax.tree_util.tree_flatten_with_path(new)
  old_leaves, old_def = jax.tree.flatten(old)
  if treedef != old_def:
    raise ValueError(
      "select_on_overflow: new and old must have the same tree structure; "
      f"got new {treedef}, old {old_def}. Under NNX take old as "
      "nnx.as_pure(nnx.state(model, nnx.BatchStat)) before the forward pass "
      "and new as nnx.as_pure(...) of the same filter after it"
    )
  for (path, n), o in zip(new_paths, old_leaves):
    if jnp.shape(n) != jnp.shape(o) or jnp.result_type(n) != jnp.result_type(o):
      raise ValueError(
        "select_on_overflow: new and old differ at "
        f"{jax.tree_util.keystr(path)}: {jnp.result_type(n)}"
        f"{list(jnp.shape(n))} and {jnp.result_type(o)}{list(jnp.shape(o))}"
      )
  if not new_paths:  # nothing to select (a model without BatchStat)
    return new
  keep = skipped(opt_state)

  def select(n, o):
    if jnp.shape(n)[: keep.ndim] != jnp.shape(keep):
      raise ValueError(
        "select_on_overflow: a batched opt_state's batch axes "
        f"{list(jnp.shape(keep))} must lead every leaf of new and old; got a "
        f"leaf of shape {list(jnp.shape(n))}"
      )
    flag = jnp.reshape(keep, jnp.shape(keep) + (1,) * (jnp.ndim(n) - keep.ndim))
    return jnp.where(flag, o, n)

  return jax.tree.unflatten(
    treedef, [select(n, o) for (_, n), o in zip(new_paths, old_leaves)]
  )
