"""Wrappers whose params are not the gradients' tree.

``optax.lookahead``'s init gets ``LookaheadParams`` (fast and slow weights);
its gradients are the fast weights only. The guarded chain must train it as
plain ``optax.lookahead`` does on clean steps, skip an overflow exactly and
name the overflowing fast leaf. Any other mismatch between the params init
saw and the gradients turns per-leaf attribution off, with a warning, and
keeps the rest working.
"""

import warnings

from helpers import bits
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

SCALE = 8.0  # a power of two: unscaling is exact, trajectories bitwise


def _loss(fast):
  return sum(
    jnp.sum((x - i) ** 2 * (i + 1)) for i, x in enumerate(jax.tree.leaves(fast))
  )


def _params():
  # Every leaf float32, none weak-typed: a weak-typed leaf came back from the
  # first step strong, and each step function compiled a second time.
  return optax.LookaheadParams.init_synced(
    {
      "a": jnp.ones(2),
      "b": {"c": jnp.zeros(3)},
      "d": jnp.full(1, 2.0, jnp.float32),
    }
  )


def _make_step(tx, scale):
  @jax.jit
  def step(params, state, poison):
    grads = jax.grad(_loss)(params.fast)
    grads = jax.tree.map(lambda g: g * scale, grads)
    grads["b"]["c"] = (
      grads["b"]["c"].at[0].multiply(jnp.where(poison, jnp.inf, 1.0))
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _lookahead():
  return optax.lookahead(optax.adam(0.05), sync_period=3, slow_step_size=0.5)


def test_lookahead_matches_plain_lookahead_and_skips_exactly():
  guarded = fs.chain(fs.fp16_loss_scale(fs.static_scaler(SCALE)), _lookahead())
  plain = _lookahead()
  ours_step, plain_step = _make_step(guarded, SCALE), _make_step(plain, 1.0)
  ours, plain_p = _params(), _params()
  s_ours, s_plain = guarded.init(ours), plain.init(plain_p)
  poisoned = {4}
  for t in range(10):
    before = ours
    ours, s_ours = ours_step(ours, s_ours, t in poisoned)
    if t in poisoned:  # skipped: every bit of the params kept
      assert bits(ours) == bits(before)
      report = fs.overflow_report(s_ours)
      assert report.nonfinite_leaves == ("['b']['c']",)
      continue
    plain_p, s_plain = plain_step(plain_p, s_plain, False)
    assert bits(ours) == bits(plain_p)
  assert fs.overflow_report(s_ours).counts == {"['b']['c']": 1}
  # It trained: the slow weights moved towards the minimum.
  assert float(_loss(ours.slow)) < 0.7 * float(_loss(_params().slow))


def test_other_mismatched_trees_keep_working_without_attribution():
  """A state built for 3 leaves fed 1: a warning, no per-leaf attribution,
  the overflow still decided and skipped."""
  tx = fs.chain(fs.fp16_loss_scale(fs.torch_scaler(init_scale=4.0)))
  state = tx.init({"a": jnp.ones(2), "b": jnp.ones(1), "c": jnp.ones(1)})
  with pytest.warns(UserWarning, match="gradients have 1 leaves, the params"):
    updates, state = tx.update(jnp.array([jnp.inf, 1.0]), state)
  np.testing.assert_array_equal(updates, [0.0, 0.0])
  report = fs.overflow_report(state)
  assert report.step_overflowed and report.next_scale == 2.0
  assert report.nonfinite_leaves == () and report.counts == {}


def test_matching_trees_do_not_warn():
  tx = fs.chain(fs.fp16_loss_scale(fs.no_scaler()))
  state = tx.init({"a": jnp.ones(2)})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update({"a": jnp.ones(2)}, state)


def test_gradients_of_another_tree_are_refused_naming_argnums():
  """Gradients with argnums=(0, 1), or of the batch, are not of the params'
  tree: refused at tx.update (eagerly and traced) with the fix, before
  optax.apply_updates fails on them. Lookahead's fast weights (above) and
  matching trees pass."""
  tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(SCALE)), optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  batch = {"x": jnp.ones(3), "y": jnp.ones(3)}
  state = tx.init(params)

  def loss(p, b):
    return jnp.sum(p["w"]) * jnp.sum(b["x"] * b["y"])

  both = fs.value_and_grad(loss, state, argnums=(0, 1))(params, batch)[1]
  of_batch = fs.value_and_grad(loss, state, argnums=1)(params, batch)[1]
  fix = r"argnums=\(0, 1\), or of the batch.*argnums=0"
  for grads, listed in [
    (both, r"3 leaves \(\[0\]\['w'\], \[1\]\['x'\]"),
    (of_batch, r"2 leaves \(\['x'\], \['y'\]\)"),
  ]:
    message = f"not of the params' tree: {listed}.*1 params.*{fix}"
    with pytest.raises(ValueError, match=message):
      tx.update(grads, state, params)
    with pytest.raises(ValueError, match=message):
      jax.jit(tx.update)(grads, state, params)
  good = fs.value_and_grad(loss, state)(params, batch)[1]
  updates, _ = tx.update(good, state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
