"""fs.value_and_grad on Equinox modules: training through it is bit for bit
the by-hand eqx.filter_value_and_grad of loss * current_scale, overflow
steps included; non-array leaves pass through as Equinox passes them."""

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

eqx = pytest.importorskip("equinox")

TX = guarded(
  fs.deepspeed_scaler(init_scale=2.0**12),
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
  return fs.value_and_grad(loss, state)(model, x, y)


def by_hand(model, state, x, y):
  value, grads = eqx.filter_value_and_grad(
    lambda m, x, y: loss(m, x, y) * fs.current_scale(state)
  )(model, x, y)
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
  a = jax.tree.leaves((a_model, a_state))
  b = jax.tree.leaves((b_model, b_state))
  assert len(a) == len(b)
  for u, v in zip(a, b):
    if eqx.is_array(u):
      assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_non_array_leaves_pass_through_as_in_filter_value_and_grad():
  # A plain dict (no Module) holding an int, a function and an integer
  # array beside its float arrays: the float arrays are differentiated, the
  # rest reach fun as they are and get None, as eqx.filter_value_and_grad
  # gives them.
  state = TX.init({"w": jnp.ones(2)})
  tree = {
    "w": jnp.array([0.5, -1.0]),
    "act": jax.nn.relu,
    "n": 3,
    "idx": jnp.arange(2),
    "none": None,
  }

  def f(t):
    return jnp.sum(t["act"](t["w"]) * t["n"]) + jnp.sum(t["idx"])

  value, grads = fs.value_and_grad(f, state)(tree)
  ref_value, ref_grads = eqx.filter_value_and_grad(
    lambda t: f(t) * fs.current_scale(state)
  )(tree)
  assert float(value) * 2.0**12 == float(ref_value)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  assert (grads["act"], grads["n"], grads["idx"]) == (None, None, None)
  np.testing.assert_array_equal(grads["w"], ref_grads["w"])
  np.testing.assert_array_equal(grads["w"], [3.0 * 2.0**12, 0.0])


def test_a_modules_float_field_is_left_as_equinox_leaves_it():
  class Scaled(eqx.Module):
    weight: jax.Array
    alpha: float  # a Python float field: not an inexact array

    def __call__(self, x):
      return self.alpha * x @ self.weight

  model = Scaled(jnp.ones((2, 2)), 0.5)
  state = TX.init(eqx.filter(model, eqx.is_inexact_array))

  def loss(m):
    return jnp.sum(m(jnp.array([1.0, 2.0])))

  _, grads = fs.value_and_grad(loss, state)(model)
  ref = eqx.filter_grad(lambda m: loss(m) * fs.current_scale(state))(model)
  assert grads.alpha is None and ref.alpha is None
  np.testing.assert_array_equal(grads.weight, ref.weight)
