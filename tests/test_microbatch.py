"""``optax.microbatch`` around ``fs.value_and_grad``: the in-step form of
gradient accumulation (docs/accumulation.md), pinned against a change in
either library.

Inside one jitted step, ``optax.microbatch(fs.value_and_grad(loss,
opt_state), argnums=1, microbatch_size=2, accumulator=MEAN)`` runs the
scaled backward of 4 microbatches in a ``lax.fori_loop`` and averages them
in the gradients' dtype; the guarded chain runs once on the mean. optax
splits the batch column-major: microbatch i holds rows i, i + 4, ...
"""

from helpers import bits
from helpers import strip_bookkeeping
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

K, SIZE, D = 4, 2, 8  # microbatches, rows per microbatch, features
MEAN = optax.microbatching.AccumulationType.MEAN
INIT_SCALE = 2.0**10


def _loss(params, batch):
  """Mean squared error of a float16 linear model, reduced in float32."""
  x, y = batch
  w = params["w"].astype(jnp.float16)
  b = params["b"].astype(jnp.float16)
  pred = x.astype(jnp.float16) @ w + b
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def _params(dtype=jnp.float32):
  k = jax.random.PRNGKey(0)
  return {
    "w": jax.random.normal(k, (D, 1)).astype(dtype),
    "b": jnp.zeros((1,), dtype),
  }


def _batch(seed=1):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (K * SIZE, D))
  y = jax.random.normal(ky, (K * SIZE, 1))
  return x, y


def _tx(inner=None, max_norm=10.0):
  scaler = fs.deepspeed_scaler(init_scale=INIT_SCALE, scale_window=100)
  inner = inner or optax.adamw(1e-2, weight_decay=0.1)
  clip = fs.clip_by_unscaled_norm(max_norm)
  return fs.chain(fs.fp16_loss_scale(scaler), clip, inner)


def _microbatched(opt_state):
  grad = fs.value_and_grad(_loss, opt_state)
  return optax.microbatch(
    grad, argnums=1, microbatch_size=SIZE, accumulator=MEAN
  )


def _in_step(tx):
  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = _microbatched(opt_state)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = optax.apply_updates(params, updates)
    return params, opt_state, updates, (loss, grads)

  return step


def test_one_bad_microbatch_skips_the_whole_step_exactly():
  tx = _tx()
  step = _in_step(tx)
  params = _params()
  state = tx.init(params)
  params, state, _, _ = step(params, state, _batch(1))  # a clean step first
  x, y = _batch(2)
  x = x.at[5, 3].set(jnp.inf)  # row 5: microbatch 1 of 4 (column-major)
  new_params, new_state, updates, _ = step(params, state, (x, y))
  assert bits(new_params) == bits(params)
  assert bits(strip_bookkeeping(new_state)) == bits(strip_bookkeeping(state))
  for u in jax.tree.leaves(updates):  # -0.0: adding it keeps every bit
    np.testing.assert_array_equal(u, 0.0)
    assert np.all(np.signbit(u))
  before = fs.scale_metrics(state)
  after = fs.scale_metrics(new_state)
  assert bool(after["overflow"])
  assert not bool(before["overflow"])
  assert float(after["loss_scale"]) == INIT_SCALE / 2  # backed off once
  assert int(after["skipped_steps"]) == int(before["skipped_steps"]) + 1
  # The next clean step trains.
  params2, state2, _, _ = step(new_params, new_state, _batch(3))
  assert not bool(fs.scale_metrics(state2)["overflow"])
  assert bits(params2) != bits(new_params)


def test_clean_step_gradients_are_accumulate_gradients_window_mean():
  """The mean of the 4 microbatch gradients (and losses), optax's in the
  loop carry (sum, then / 4) against accumulate_gradients' (each / 4, then
  summed), both float32: 4 float32 values summed in possibly another order,
  each within 3 roundings of 2**-24 of sum|g_i| / 4, so 2 * 3 * 2**-24 of
  it apart."""
  batch = _batch(4)
  tx = _tx(optax.sgd(1.0), max_norm=1e9)  # no clip: updates = -mean / S
  params = _params()
  state = tx.init(params)
  _, _, updates, (loss, grads) = _in_step(tx)(params, state, batch)

  acc = fs.accumulate_gradients(_tx(optax.sgd(1.0), max_norm=1e9), K)

  @jax.jit
  def micro(params, acc_state, mb):
    value, g = fs.value_and_grad(_loss, acc_state)(params, mb)
    out, acc_state = acc.update(g, acc_state, params)
    return out, acc_state, (value, g)

  acc_state = acc.init(params)
  per_mb = []  # each microbatch's gradients
  losses = []
  for i in range(K):
    mb = jax.tree.map(lambda a, i=i: a[i::K], batch)
    acc_updates, acc_state, (value, g) = micro(params, acc_state, mb)
    per_mb.append(g)
    losses.append(float(value))
  # The loss is averaged too (MEAN on the (loss, grads) pair), against the
  # float64 mean of the same 4 float32 losses: 3 float32 adds of positive
  # values, each within 2**-24 of a partial sum <= the sum; / 4 is exact.
  mean_loss = sum(losses) / K
  assert abs(float(loss) - mean_loss) <= 3 * 2.0**-24 * mean_loss
  assert bool(fs.scale_metrics(acc_state)["window_ended"])
  # The window's step and the in-step one applied the same sgd(1.0) step on
  # the same clean mean: -mean / S either way (S a power of two: exact).
  scale = float(fs.current_scale(state))
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    abs_sum = sum(np.abs(np.asarray(_at(m, path))) for m in per_mb) / K
    bound = 6 * 2.0**-24 * abs_sum
    window_mean = -np.asarray(_at(acc_updates, path)) * scale
    in_step_mean = np.asarray(_at(updates, path)) * -scale
    assert np.all(np.abs(np.asarray(g) - window_mean) <= bound), path
    assert np.all(np.abs(in_step_mean - g) <= bound)


def _at(tree, path):
  """The leaf of ``tree`` at a key path of ``tree_leaves_with_path``."""
  for key in path:
    tree = tree[key.key]
  return tree


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gradients_are_accumulated_in_the_parameters_dtype(dtype):
  """float32 parameters, float16 compute: the loop carries and returns
  float32 gradients (a float16 sum would round every add); float16
  parameters would accumulate in float16."""
  params = _params(dtype)
  state = _tx().init(_params())  # only its scale

  def fn(params, state, batch):
    return _microbatched(state)(params, batch)

  _, grads = jax.eval_shape(fn, params, state, _batch())
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(dtype)}
  eqns = jax.make_jaxpr(fn)(params, state, _batch()).jaxpr.eqns
  (loop,) = [e for e in eqns if e.primitive.name in ("while", "scan")]
  carried = [v.aval for v in loop.outvars if v.aval.shape == (D, 1)]
  assert {aval.dtype for aval in carried} == {jnp.dtype(dtype)}
