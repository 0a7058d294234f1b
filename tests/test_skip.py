"""skip_on_overflow: an overflow step leaves parameters and optimizer state
bit-identical, and the run continues as if the step had never happened."""

from helpers import bits as _bits
from helpers import strip_bookkeeping as _strip_bookkeeping
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp16_scaling as fs


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "dense": {
      "kernel": jax.random.normal(k1, (4, 3)),
      "bias": jnp.array([0.0, -0.0, 1.0]),
    },
    "out": jax.random.normal(k2, (3,)),
  }


def _true_grads(i):
  key = jax.random.PRNGKey(100 + i)
  return jax.tree.map(
    lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape),
    _params(),
  )


def _tx():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)
  return fs.skip_on_overflow(
    optax.chain(
      # Powers of two only: unscaling is exact, so a run with a different
      # scale history sees bit-identical unscaled gradients.
      fs.fp16_loss_scale(
        fs.deepspeed_scaler(init_scale=2.0**10, scale_window=3)
      ),
      fs.clip_by_unscaled_norm(2.0),
      optax.adamw(schedule, weight_decay=0.1),
    )
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
      assert (
        float(fs.current_scale(state))
        == float(fs.current_scale(before_state)) / 2
      )
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
