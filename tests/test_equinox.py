"""fs.value_and_grad on Equinox modules: training through it is bit for bit
the by-hand eqx.filter_value_and_grad of loss * current_scale, overflow
steps included; a non-array leaf elsewhere is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

eqx = pytest.importorskip("equinox")

TX = fs.chain(
  fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=2.0**12)),
  fs.clip_by_unscaled_norm(1.0),
  optax.adamw(1e-2),
)


def loss(model, x, y):
  m16 = jax.tree.map(
    lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model
  )
  pred = jax.vmap(m16)(x.astype(jnp.float16))
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def through_fs(model, state, x, y):
  value, grads = fs.value_and_grad(loss, state)(model, x, y)
  return value, grads


def by_hand(model, state, x, y):
  scaled = lambda m, x, y: loss(m, x, y) * fs.current_scale(state)
  value, grads = eqx.filter_value_and_grad(scaled)(model, x, y)
  return value / fs.current_scale(state), grads


def train(grad_fn):
  model = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.PRNGKey(0))
  state = TX.init(eqx.filter(model, eqx.is_inexact_array))

  @eqx.filter_jit
  def step(model, state, x, y):
    value, grads = grad_fn(model, state, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, state = TX.update(grads, state, params, value=value)
    return eqx.apply_updates(model, updates), state

  for i in range(6):
    x = jax.random.normal(jax.random.PRNGKey(i), (8, 4))
    y = jnp.full((8, 2), 1e5 if i == 3 else 1.0)  # step 3 overflows
    model, state = step(model, state, x, y)
  return model, state


def test_equinox_training_is_bit_identical_to_filter_value_and_grad():
  a_model, a_state = train(through_fs)
  b_model, b_state = train(by_hand)
  assert int(fs.scale_metrics(a_state)["skipped_steps"]) >= 1
  a, b = (
    jax.tree.leaves((a_model, a_state)),
    jax.tree.leaves((b_model, b_state)),
  )
  assert len(a) == len(b)
  for u, v in zip(a, b):
    if eqx.is_array(u):
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_a_non_array_leaf_is_refused_with_the_fix():
  state = TX.init({"w": jnp.ones(2)})
  tree = {"w": jnp.ones(2), "act": jax.nn.relu}
  f = lambda t: jnp.sum(t["act"](t["w"]))
  with pytest.raises(
    TypeError, match=r"custom_jvp at \['act'\].*eqx.partition"
  ):
    fs.value_and_grad(f, state)(tree)
