"""docs/porting-rl.md: the RL frameworks' float16 scalers, and
every loss term inside the one fs.value_and_grad. Checked through tx.update
itself: with optax.sgd(1.0) inside the guarded chain the update is minus
the gradient the optimizer saw, after the unscale."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp16_scaling as fs


def _problem():
  rng = np.random.default_rng(3)
  params = {
    "w": jnp.asarray(rng.normal(0, 0.1, (8, 6)), jnp.float32),
    "mtp": jnp.asarray(rng.normal(0, 0.1, (6, 6)), jnp.float32),
  }
  batch = {
    "x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
    "a": jnp.asarray(rng.integers(0, 6, 16)),
    "next": jnp.asarray(rng.integers(0, 6, 16)),
    "adv": jnp.asarray(rng.normal(size=16), jnp.float32),
  }
  return params, batch


def policy_loss(params, batch):
  logp = jax.nn.log_softmax(batch["x"] @ params["w"])
  taken = jnp.take_along_axis(logp, batch["a"][:, None], 1)[:, 0]
  return -jnp.mean(batch["adv"] * taken)


def aux_loss(params, batch):
  logits = batch["x"] @ params["w"] @ params["mtp"]
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["next"]
  ).mean()


def total_loss(params, batch):
  return policy_loss(params, batch) + 0.3 * aux_loss(params, batch)


def _seen(grads_fn, scaler):
  """The gradient the optimizer applies, from ``grads_fn(opt_state)``."""
  tx = fs.chain(fs.fp16_loss_scale(scaler), optax.sgd(1.0))
  params, batch = _problem()
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = grads_fn(state, params, batch)
    updates, _ = tx.update(grads, state, params)
    return jax.tree.map(jnp.negative, updates)

  return step(params, state), jax.grad(total_loss)(*_problem())


def _together(state, params, batch):
  return fs.value_and_grad(total_loss, state)(params, batch)[1]


def _apart(state, params, batch):
  _, g = fs.value_and_grad(policy_loss, state)(params, batch)
  g_aux = jax.grad(aux_loss)(params, batch)  # at scale 1, not S
  return jax.tree.map(lambda a, b: a + 0.3 * b, g, g_aux)


def test_every_term_in_one_value_and_grad_is_the_true_gradient():
  for scaler in (fs.torch_scaler(growth_interval=400), fs.megatron_scaler()):
    seen, want = _seen(_together, scaler)
    for g, w in zip(jax.tree.leaves(seen), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-9)


def test_an_auxiliary_term_differentiated_apart_is_s_times_too_small():
  for scaler, s in (
    (fs.torch_scaler(growth_interval=400), 2.0**16),
    (fs.megatron_scaler(), 2.0**32),
  ):
    seen, want = _seen(_apart, scaler)
    # The head the auxiliary term alone trains gets its gradient / S...
    np.testing.assert_allclose(seen["mtp"] * s, want["mtp"], rtol=1e-5)
    # ...and the shared weights the policy term's plus the aux term's / S.
    params, batch = _problem()
    g_pol = jax.grad(policy_loss)(params, batch)["w"]
    g_aux = jax.grad(aux_loss)(params, batch)["w"]
    np.testing.assert_allclose(
      seen["w"], g_pol + 0.3 * g_aux / s, rtol=1e-5, atol=1e-9
    )
    assert not np.allclose(seen["w"], want["w"], rtol=1e-2)


def test_the_frameworks_presets():
  # verl FSDP: torch's ShardedGradScaler(growth_interval=400), whose other
  # defaults are GradScaler's; verl Megatron: Megatron's defaults.
  fsdp = fs.torch_scaler(growth_interval=400)
  assert (fsdp.init_scale, fsdp.growth_interval) == (2.0**16, 400)
  assert (fsdp.backoff_factor, fsdp.growth_factor) == (0.5, 2.0)
  meg = fs.megatron_scaler()
  assert (meg.init_scale, meg.min_scale, meg.hysteresis) == (2.0**32, 1.0, 2)
  assert meg.growth_interval == 1000
