"""fp16_loss_scale in fs.chain: unscaling, reported norm, errors."""

import functools
import warnings

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

# Gradients whose true global norm is exactly 1.0: 0.6, 0.8 and zeros.
TRUE_GRADS = {
  "w": jnp.array([[0.6, 0.0], [0.0, 0.0]], jnp.float32),
  "b": jnp.array([0.8, 0.0], jnp.float32),
}


def make_tx(scaler, max_norm=10.0):
  # No optimizer after the clip: the chain's update is the unscaled, clipped
  # gradient itself, so "the applied update equals the true gradient" is an
  # exact equality to check.
  return guarded(scaler, fs.clip_by_unscaled_norm(max_norm))


def run(tx, steps, grads_fn=lambda i: TRUE_GRADS):
  return run_each([tx], steps, grads_fn)[0]


def run_each(txs, steps, grads_fn=lambda i: TRUE_GRADS):
  """``[run(tx, steps, grads_fn) for tx in txs]``, with one jit stepping
  every chain (a jit each compiled again what the chains share)."""

  def one(tx, state, true_grads):
    scale = fs.current_scale(state)
    scaled = jax.tree.map(lambda g: g * scale, true_grads)
    updates, state = tx.update(scaled, state)
    return updates, state, fs.scale_metrics(state)

  @jax.jit
  def step(states, true_grads):
    return [one(tx, state, true_grads) for tx, state in zip(txs, states)]

  states = [tx.init(TRUE_GRADS) for tx in txs]
  out = [[] for _ in txs]
  for i in range(steps):
    results = step(states, grads_fn(i))
    states = [state for _, state, _ in results]
    for run_out, (updates, _, metrics) in zip(out, results):
      run_out.append((updates, jax.device_get(metrics)))
  return out


def test_static_scale_reports_true_norm():
  # DeepSpeed 0.19's FP16_UnfusedOptimizer reports 128.0 here.
  ((updates, metrics),) = run(make_tx(fs.static_scaler(128.0)), 1)
  assert float(metrics["grad_norm"]) == 1.0
  assert float(metrics["prev_loss_scale"]) == 128.0
  jax.tree.map(np.testing.assert_array_equal, updates, TRUE_GRADS)


DYNAMIC = {
  "deepspeed": fs.deepspeed_scaler(
    init_scale=128.0, scale_window=2, min_scale=1.0
  ),
  "torch": fs.torch_scaler(init_scale=128.0, growth_interval=2),
  "megatron": fs.megatron_scaler(
    initial_scale=128.0, min_scale=1.0, growth_interval=2, hysteresis=1
  ),
  "megatron_h2": fs.megatron_scaler(
    initial_scale=128.0, min_scale=1.0, growth_interval=2
  ),
  "flax": fs.flax_scaler(growth_interval=2, scale=128.0),
}


@pytest.fixture(scope="module")
def dynamic_runs():
  """Six steps of every DYNAMIC preset's chain, stepped by one jit."""
  names = sorted(DYNAMIC)
  return dict(zip(names, run_each([make_tx(DYNAMIC[n]) for n in names], 6)))


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_growth_steps_unscale_by_the_scale_the_grads_were_made_with(
  name, dynamic_runs
):
  # DeepSpeed 0.19 grows the scale before unscaling: on growth steps it
  # reports 0.5 and applies half the gradient.
  steps = dynamic_runs[name]
  scales_used = [float(m["prev_loss_scale"]) for _, m in steps]
  next_scales = [float(m["loss_scale"]) for _, m in steps]
  growth_steps = [i for i in range(6) if next_scales[i] > scales_used[i]]
  assert len(growth_steps) >= 2, "the scale must move for this test to bite"
  assert scales_used[0] == 128.0 and max(next_scales) >= 512.0
  for updates, metrics in steps:
    assert float(metrics["grad_norm"]) == 1.0
    assert not bool(metrics["overflow"])
    jax.tree.map(np.testing.assert_array_equal, updates, TRUE_GRADS)


def test_float16_gradients_are_unscaled_in_float32():
  tx = make_tx(fs.static_scaler(2.0**15))
  grads = jax.tree.map(lambda g: jnp.full_like(g, 2.0**-20), TRUE_GRADS)
  state = tx.init(grads)
  # 2**-20 lies below float16's normal range (2**-14); scaled by 2**15 it is
  # 2**-5, exact in float16, and must come back as 2**-20 in float32.
  scaled = jax.tree.map(lambda g: (g * 2.0**15).astype(jnp.float16), grads)
  updates, state = jax.jit(tx.update)(scaled, state)
  assert updates["w"].dtype == jnp.float32
  jax.tree.map(np.testing.assert_array_equal, updates, grads)
  norm = pytest.approx(2.0**-20 * np.sqrt(6), rel=1e-6)
  assert float(state[0].grad_norm) == norm


def test_finite_gradient_whose_square_overflows_is_not_an_overflow():
  # 3e30 squared overflows float32; the element is finite, so the step must
  # be taken and the norm reported exactly (3e30 / 4 alongside 4e30 / 4).
  tx = make_tx(fs.static_scaler(4.0), max_norm=1e35)
  w = jnp.array([[3e30, 0.0], [0.0, 0.0]], jnp.float32)
  grads = {"w": w, "b": jnp.array([4e30, 0.0], jnp.float32)}
  state = tx.init(grads)
  updates, state = jax.jit(tx.update)(grads, state)
  ls = state[0]
  assert not bool(ls.overflow)
  assert float(ls.grad_norm) == pytest.approx(5e30 / 4, rel=1e-6)
  assert float(updates["b"][0]) == pytest.approx(1e30, rel=1e-6)


@functools.lru_cache(maxsize=None)
def _overflow_tx():
  """One chain and one jitted update for every non-finite value below: the
  values are data, so the three cases share one compile."""
  tx = make_tx(fs.deepspeed_scaler(init_scale=64.0, scale_window=4))
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_any_non_finite_element_is_an_overflow(bad):
  tx, update = _overflow_tx()
  grads = {"w": jnp.zeros((2, 2)).at[1, 0].set(bad), "b": jnp.ones((2,))}
  state = tx.init(grads)
  updates, state = update(grads, state)
  ls = state[0]
  assert bool(ls.overflow) and int(ls.skipped_steps) == 1
  assert float(ls.loss_scale) == 32.0 and float(ls.prev_loss_scale) == 64.0
  for u in jax.tree.leaves(updates):
    assert np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u)))


def test_integer_gradients_are_rejected():
  tx = make_tx(fs.torch_scaler())
  with pytest.raises(TypeError, match="floating point"):
    tx.init({"w": jnp.zeros((2,), jnp.int32)})


def test_scaler_argument_is_checked():
  with pytest.raises(TypeError, match="scaler"):
    fs.fp16_loss_scale(128.0)


def _guarded(scaler):
  return guarded(scaler, optax.sgd(1.0))


def test_float16_params_warn_that_there_are_no_float32_masters():
  """The warning points at the caller's line (not into optax), under any
  wrapping: a chain, accumulate_gradients, a nested chain."""
  params = {"w": jnp.ones(2, jnp.float16)}
  wrapped = [
    _guarded(fs.torch_scaler()),
    fs.accumulate_gradients(_guarded(fs.torch_scaler()), 2),
    optax.chain(optax.identity(), _guarded(fs.torch_scaler())),
  ]
  for tx in wrapped:
    with pytest.warns(
      UserWarning, match="params are float16.*param_dtype"
    ) as w:
      tx.init(params)
    assert [x.filename for x in w] == [__file__]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _guarded(fs.torch_scaler()).init({"w": jnp.ones(2, jnp.float32)})


_WARNS = [(fs.torch_scaler(), True), (fs.static_scaler(1024.0), True)]
_WARNS += [(fs.no_scaler(), False), (fs.static_scaler(1.0), False)]


@pytest.mark.parametrize("scaler, warns", _WARNS)
def test_bfloat16_gradients_warn_unless_the_scale_is_one(scaler, warns):
  tx = _guarded(scaler)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  grads = {"w": jnp.ones(2, jnp.bfloat16)}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(tx.update)(grads, state, params)
  said = [w for w in caught if "bfloat16" in str(w.message)]
  assert bool(said) == warns
  if warns:
    assert "no_scaler()" in str(said[0].message)
    assert said[0].filename == __file__  # the caller's line


def test_nnx_variable_paths_are_named_without_value():
  """An nnx State of Variables names its leaves as the pure State does:
  ``['kernel']``, not ``['kernel'].value``."""
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  tx = _guarded(fs.static_scaler(2.0))
  for params in (nnx.state(model, nnx.Param), nnx.pure(nnx.state(model))):
    state = tx.init(params)
    assert state[0].leaf_paths.paths == ("['bias']", "['kernel']")


def test_the_states_treedef_holds_what_made_it_compared_by_value():
  """The state's static LeafPaths holds the leaves' names and sizes and
  what made the state (the scaler less its initial scale, the partition
  specs), compared by value: chains of other scalers or specs give other
  treedefs, equal configurations one (so a chain's states never retrace),
  and optax.tree_map_params' leafless placeholder still maps onto the real
  state."""
  params = {"b": jnp.ones(2), "w": jnp.ones(4)}
  P = jax.sharding.PartitionSpec
  txs = [
    _guarded(fs.torch_scaler(init_scale=8.0)),
    _guarded(fs.torch_scaler(init_scale=8.0, growth_interval=3)),
    fs.chain(
      fs.fp16_loss_scale(fs.torch_scaler(init_scale=8.0), partition_specs=P()),
      optax.sgd(1.0),
    ),
  ]
  states = [tx.init(params) for tx in txs]
  assert len({jax.tree.structure(s) for s in states}) == 3
  paths = states[0][0].leaf_paths
  assert (paths.paths, paths.sizes) == (("['b']", "['w']"), (2, 4))
  assert paths.built.scaler == fs.torch_scaler(init_scale=1.0)
  assert states[2][0].leaf_paths.built.partition_specs[0] == (P(),)
  # Another chain of the first's configuration but its initial scale: one
  # treedef, one hash.
  again = _guarded(fs.torch_scaler(init_scale=2.0**10)).init(params)
  assert jax.tree.structure(again) == jax.tree.structure(states[0])
  assert hash(again[0].leaf_paths) == hash(paths)
  # The placeholder's state (no leaves) maps onto the real one.
  shapes = optax.tree_map_params(
    txs[0], lambda p: p.shape, states[0], transform_non_params=lambda _: None
  )
  assert shapes[0].leaf_nonfinite is None
