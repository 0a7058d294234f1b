"""fs.chain's skip: an overflow step leaves parameters and optimizer state
bit-identical, and the run continues as if the step had never happened."""

from helpers import bits as _bits
from helpers import guarded
from helpers import nested_params as _params
from helpers import strip_bookkeeping as _strip_bookkeeping
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs


def _true_grads(i):
  key = jax.random.PRNGKey(100 + i)
  return jax.tree.map(
    lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape),
    _params(),
  )


def _tx():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
  return guarded(
    # Powers of two only: unscaling is exact, so a run with a different
    # scale history sees bit-identical unscaled gradients.
    fs.deepspeed_scaler(init_scale=2.0**10, scale_window=3),
    fs.clip_by_unscaled_norm(2.0),
    optax.adamw(schedule, weight_decay=0.1),
  )


@jax.jit
def _step(params, state, true_grads, poison):
  scale = fs.current_scale(state)
  grads = jax.tree.map(lambda g: g * scale, true_grads)
  grads["out"] = grads["out"].at[1].multiply(jnp.where(poison, jnp.inf, 1.0))
  updates, state = _tx().update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_overflow_step_is_bit_identical_and_run_matches_one_without_it():
  params0 = _params()
  grads = [_true_grads(i) for i in range(10)]
  overflow_at = 5

  # Run A sees an overflow at step 5 (the grads of step 5 with an inf).
  params, state = params0, _tx().init(params0)
  for i in range(10):
    if i == overflow_at:
      before_params, before_state = params, state
      params, state = _step(params, state, grads[i], True)
      assert bool(fs.scale_metrics(state)["overflow"])
      assert _bits(params) == _bits(before_params)
      assert _bits(_strip_bookkeeping(state)) == _bits(
        _strip_bookkeeping(before_state)
      )
      # the bookkeeping did move
      halved = float(fs.current_scale(before_state)) / 2
      assert float(fs.current_scale(state)) == halved
    params, state = _step(params, state, grads[i], False)
  run_a = params, state

  # Run B never sees the overflow step.
  params, state = params0, _tx().init(params0)
  for i in range(10):
    params, state = _step(params, state, grads[i], False)
  run_b = params, state

  assert _bits(run_a[0]) == _bits(run_b[0])
  assert _bits(_strip_bookkeeping(run_a[1])) == _bits(
    _strip_bookkeeping(run_b[1])
  )
  # The schedule and Adam counted 10 steps in both runs, not 11 in run A.
  counts = [
    int(c)
    for c in jax.tree.leaves(_strip_bookkeeping(run_a[1]))
    if np.asarray(c).dtype == np.int32
  ]
  assert counts and all(c == 10 for c in counts)
  assert int(fs.scale_metrics(run_a[1])["skipped_steps"]) == 1
  assert int(fs.scale_metrics(run_b[1])["skipped_steps"]) == 0
  # Sanity: the runs did train (parameters moved).
  assert _bits(run_a[0]) != _bits(params0)


def test_negative_zero_parameters_survive_a_skip():
  params = _params()
  state = _tx().init(params)
  new_params, _ = _step(params, state, _true_grads(0), True)
  assert np.signbit(np.asarray(new_params["dense"]["bias"][1]))


# --------------------------------------------------------------------------
# Gradients through the step (meta-learning, hyperparameter gradients).


def _guarded(opt, clip):
  clips = [fs.clip_by_unscaled_norm(1.0)] if clip else []
  return guarded(fs.static_scaler(4.0), *clips, opt)


_P0 = jnp.array([1.0, 2.0, 3.0])


def _scaled_grads(p, poison):
  # Gradients that depend on the parameters; with poison the middle one
  # overflows float16 (4 * 2 * 1e5 > 65504).
  spread = jnp.array([1.0, jnp.where(poison, 1e5, 1.0), 1.0])
  return (4.0 * p * spread).astype(jnp.float16)


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no clip"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_gradient_through_an_overflow_step_is_finite(name, clip):
  # params + update is params on an overflow step, so its gradient with
  # respect to the params is exactly 1 and with respect to a learning rate
  # exactly 0: the discarded update contributes nothing. It used to be NaN
  # (0 * inf in the backward pass of the discarded clip and update).
  def opt(lr):
    if name == "sgd":
      return optax.sgd(lr, momentum=0.9)
    return optax.adamw(lr, weight_decay=0.1)

  state = _guarded(opt(0.1), clip).init(_P0)  # a fresh state: Adam's count 0

  def moved(p, lr, poison):
    tx = _guarded(opt(lr), clip)
    updates, _ = tx.update(_scaled_grads(p, poison), state, p)
    return jnp.sum(p + updates)

  # One jit for the overflow step and the clean one below: poison is traced.
  d_moved = jax.jit(jax.grad(moved, argnums=(0, 1)))
  d_params, d_lr = d_moved(_P0, 0.1, True)
  np.testing.assert_array_equal(np.asarray(d_params), [1.0, 1.0, 1.0])
  assert float(d_lr) == 0.0

  # On a clean step the same gradient is finite and not trivial, and agrees
  # with plain optax on the unscaled gradients.
  def plain_moved(p, lr):
    parts = [optax.clip_by_global_norm(1.0)] if clip else []
    tx = optax.chain(*parts, opt(lr))
    grads = _scaled_grads(p, False).astype(jnp.float32) / 4.0
    updates, _ = tx.update(grads, tx.init(p), p)
    return jnp.sum(p + updates)

  ours = d_moved(_P0, 0.1, False)
  plain = jax.jit(jax.grad(plain_moved, argnums=(0, 1)))(_P0, 0.1)
  # The backward pass rounds cotangents to float16 where the gradients
  # were cast, in a different order for each chain: 1e-4, not 1e-6.
  for a, b in zip(ours, plain):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4)
  assert float(ours[1]) != 0.0


def test_lbfgs_free_running_matches_plain_lbfgs_bit_for_bit():
  """optax.lbfgs needs value_fn, a function: it must reach the optimizer
  untraced (it used to raise TypeError under jit). 50 free-running steps of
  the zoom line search on a 6-D Rosenbrock: the guarded chain (a
  power-of-two scale, so unscaling is exact) takes plain optax.lbfgs's
  steps and learning rates bit for bit, both jitted. (Eager and jitted
  plain optax part from step 1 and pick learning rates apart by step 40:
  compare like with like.)"""

  def loss(p):
    return jnp.sum(100.0 * (p[1:] - p[:-1] ** 2) ** 2 + (1 - p[:-1]) ** 2)

  def trajectory(tx, scale):
    @jax.jit
    def step(p, s):
      value, grad = jax.value_and_grad(loss)(p)
      updates, s = tx.update(
        grad * scale, s, p, value=value, grad=grad, value_fn=loss
      )
      return optax.apply_updates(p, updates), s

    # Strongly typed float32 throughout: a weak-typed start (jnp.full's
    # default, optax's scalar state) is another signature, and the step
    # compiled three times over per chain.
    p = jnp.full(6, -0.5, jnp.float32)
    s = jax.tree.map(lambda x: jnp.asarray(x, x.dtype), tx.init(p))
    out = []
    for _ in range(50):
      p, s = step(p, s)
      out.append((np.asarray(p), optax.tree_utils.tree_get(s, "learning_rate")))
    return out

  plain = trajectory(optax.lbfgs(), 1.0)
  ours = trajectory(
    fs.chain(fs.fp16_loss_scale(fs.static_scaler(4.0)), optax.lbfgs()),
    4.0,
  )
  for (p_plain, lr_plain), (p_ours, lr_ours) in zip(plain, ours):
    np.testing.assert_array_equal(p_ours, p_plain)
    assert float(lr_ours) == float(lr_plain)
  assert float(loss(plain[-1][0])) < 1e-6  # it converged
  np.testing.assert_allclose(ours[-1][0], np.ones(6), atol=1e-3)


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no clip"])
def test_gradient_in_the_learning_rate_alone_is_zero_on_an_overflow_step(clip):
  # Differentiated with respect to the learning rate only, the gradients
  # are constants: the discard must be in the values, not in a derivative
  # rule, or lr * inf meets the discarded update's zero cotangent (NaN).
  grads = jnp.array([4.0, jnp.inf, 4.0], jnp.float16)
  state = _guarded(optax.sgd(0.1, momentum=0.9), clip).init(_P0)

  def moved(lr):
    tx = _guarded(optax.sgd(lr, momentum=0.9), clip)
    updates, _ = tx.update(grads, state, _P0)
    return jnp.sum(_P0 + updates)

  assert float(jax.jit(jax.grad(moved))(0.1)) == 0.0
