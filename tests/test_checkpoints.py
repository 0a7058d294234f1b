"""Checkpoints: orbax round trips mid-run, restores that lost their types,
batched (vmapped) states and nnx.Optimizer's wrapped states."""

from flax import nnx
import flax.serialization
from helpers import assert_same_bits as assert_bitwise
from helpers import bits
from helpers import guarded
from helpers import orbax_round_trip
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

O, C = True, False

SCALER = fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2, delayed_shift=2)
TX = guarded(SCALER, fs.clip_by_unscaled_norm(1.0), optax.adamw(1e-2))
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}


@jax.jit
def step(params, state, key, overflow):
  """One guarded step on random gradients (an inf in ``w`` on overflow)."""
  grads = jax.tree.map(
    lambda p, k: jax.random.normal(k, p.shape), params, {"w": key, "b": key}
  )
  grads["w"] = grads["w"].at[0, 0].set(jnp.where(overflow, jnp.inf, 0.5))
  scaled = jax.tree.map(lambda g: g * fs.current_scale(state), grads)
  updates, state = TX.update(scaled, state, params)
  return optax.apply_updates(params, updates), state


def run(params, state, flags, first):
  for i, f in enumerate(flags):
    key = jax.random.PRNGKey(first + i)
    params, state = step(params, state, key, jnp.bool_(f))
  return params, state


# Up to the cut: 256 grows on the 3rd clean step (window 2, DeepSpeed's
# delay), an overflow is absorbed, the next growth (1024) refills hysteresis
# and one more overflow is absorbed: the state in flight holds hysteresis 0
# and a restarted growth tracker.
BEFORE = [C, C, C, O, C, C, C, O]
AFTER = [O, C, C, C, O, O, C, C, C, C]


def test_orbax_round_trip_mid_run_is_bit_identical(tmp_path):
  params, state = run(PARAMS, TX.init(PARAMS), BEFORE, 0)
  mid = fs.scaler_state_dict(state)
  assert mid["overflow"] and mid["hysteresis_left"] == 0
  assert mid["growth_tracker"] == -1 and mid["loss_scale"] == 2.0**10
  target = {"params": PARAMS, "opt_state": TX.init(PARAMS)}
  live = {"params": params, "opt_state": state}
  restored = orbax_round_trip(tmp_path / "mid", live, target)
  assert_bitwise(restored, live)
  straight = run(params, state, AFTER, len(BEFORE))
  resumed = run(restored["params"], restored["opt_state"], AFTER, len(BEFORE))
  assert_bitwise(straight, resumed)
  # The continuation backs off (the second overflow in a row) and skips.
  assert fs.scaler_state_dict(resumed[1])["skipped_steps"] == 5


# The same tail as TX behind torch's rule: the state's structure is TX's.
TORCH_TX = guarded(
  fs.torch_scaler(init_scale=2.0**8, growth_interval=2),
  fs.clip_by_unscaled_norm(1.0),
  optax.adamw(1e-2),
)


def test_deepspeed_state_restored_into_a_torch_target_follows_torch(tmp_path):
  """D3: a delayed_shift=2 chain's checkpoint, restored into a torch
  chain's ``tx.init(params)``, carries a full hysteresis that torch's rule
  has no use for: the first overflow backs the scale off (the DeepSpeed
  chain absorbs it), and the growth tracker restarts in torch's range."""
  params, state = run(PARAMS, TX.init(PARAMS), [C, C, C, C], 0)
  saved = fs.scaler_state_dict(state)
  # DeepSpeed's delay: grown once, on the third clean step; hysteresis full.
  assert saved["loss_scale"] == 2.0**9 and saved["hysteresis_left"] == 1
  target = {"params": PARAMS, "opt_state": TORCH_TX.init(PARAMS)}
  live = {"params": params, "opt_state": state}
  restored = orbax_round_trip(tmp_path / "ds", live, target)
  assert fs.scaler_state_dict(restored["opt_state"])["hysteresis_left"] == 1

  @jax.jit
  def overflow_step(tx_state, params):
    grads = jax.tree.map(lambda p: jnp.full(p.shape, jnp.inf), params)
    return TORCH_TX.update(grads, tx_state, params)[1]

  after = overflow_step(restored["opt_state"], restored["params"])
  assert float(fs.current_scale(after)) == 2.0**8  # torch: halved at once
  assert fs.scaler_state_dict(after)["growth_tracker"] == 0  # torch's restart
  # The DeepSpeed chain itself absorbs that overflow (the rule differs).
  _, absorbed = run(params, state, [O], 4)
  assert float(fs.current_scale(absorbed)) == 2.0**9
  assert fs.scaler_state_dict(absorbed)["growth_tracker"] == -1


def test_deepspeed_state_given_to_a_torch_chain_is_refused():
  """D3: the DeepSpeed chain's own state (not restored into the torch
  target) passed to the torch chain's update: its counters follow other
  rules, and the message names each scaler field that differs. The
  state's treedef records its scaler, so the refusal is the same eager,
  inside one program, and for a state a jitted call returned."""
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  _, state = TX.update(grads, TX.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match="built with another scaler") as err:
    TORCH_TX.update(grads, state, PARAMS)
  _, returned = jax.jit(TX.update)(grads, TX.init(PARAMS), PARAMS)
  with pytest.raises(ValueError, match="built with another scaler"):
    jax.jit(TORCH_TX.update)(grads, returned, PARAMS)

  def mixed(state):
    _, state = TX.update(grads, state, PARAMS)
    return TORCH_TX.update(grads, state, PARAMS)

  with pytest.raises(ValueError, match="built with another scaler"):
    jax.jit(mixed)(TX.init(PARAMS))  # at trace time
  message = str(err.value)
  fields = ["growth_delay=1, here 0", "min_scale=1.0, here 1.17549"]
  fields += ["hysteresis=2, here 1", "raise_at_min_scale=True, here False"]
  for field in fields:
    assert field in message, field
  assert "growth_interval" not in message  # 2 in both
  assert "fs.load_scaler_state_dict" in message


def test_a_scale_loaded_with_another_scaler_than_the_states_is_refused():
  """Where a state enters: load_scaler_state_dict given a scaler other than
  the one the optimizer state was built with (its initial scale aside) is
  refused, naming a field that differs, before anything is loaded."""
  state = TORCH_TX.init(PARAMS)
  saved = fs.scaler_state_dict(fs.set_loss_scale(state, 2.0**5))
  with pytest.raises(
    ValueError, match="the optimizer's state disagrees with the scaler on"
  ) as e:
    fs.load_scaler_state_dict(state, saved, SCALER)
  assert "Pass the Scaler its fs.fp16_loss_scale was built with" in str(e.value)
  # With the scaler it was built with (another initial scale), it loads.
  torch = fs.torch_scaler(init_scale=2.0**3, growth_interval=2)
  loaded = fs.load_scaler_state_dict(state, saved, torch)
  assert float(fs.current_scale(loaded)) == 2.0**5
  # Without one, the state's record (its treedef's) is the scaler.
  assert bits(fs.load_scaler_state_dict(state, saved)) == bits(loaded)
  peer = fs.to_peer_state_dict(loaded, "torch", torch)
  assert bits(fs.load_scaler_state_dict(state, peer)) == bits(
    fs.load_scaler_state_dict(state, peer, torch)
  )


HELPERS = [
  fs.current_scale,
  fs.scale_metrics,
  fs.raise_if_min_scale_reached,
  fs.scaler_state_dict,
  lambda s: fs.set_loss_scale(s, 2.0),
  lambda s: fs.to_peer_state_dict(s, "deepspeed", SCALER),
  lambda s: fs.load_scaler_state_dict(s, {}, SCALER),
]


@pytest.fixture(scope="module")
def untyped(tmp_path_factory):
  """A state, and its orbax and msgpack restores made without a target."""
  tmp_path = tmp_path_factory.mktemp("untyped")
  state = run(PARAMS, TX.init(PARAMS), BEFORE[:2], 0)[1]
  from_orbax = orbax_round_trip(tmp_path / "s", {"opt_state": state})
  from_orbax = from_orbax["opt_state"]
  from_msgpack = flax.serialization.msgpack_restore(
    flax.serialization.to_bytes(state)
  )
  return state, from_orbax, from_msgpack


@pytest.mark.parametrize("helper", range(len(HELPERS)))
def test_untyped_restore_says_how_to_restore(helper, untyped):
  _, from_orbax, from_msgpack = untyped
  for restored in (from_orbax, from_msgpack):
    with pytest.raises(ValueError, match=r"lost its types.*tx\.init\(params\)"):
      HELPERS[helper](restored)


def test_untyped_restore_as_state_dict_is_named(untyped):
  state, from_orbax, _ = untyped
  with pytest.raises(ValueError, match=r"lost its types.*target=tx\.init"):
    fs.load_scaler_state_dict(state, from_orbax[0], SCALER)


def test_msgpack_restore_with_target_resumes(untyped):
  state = untyped[0]
  blob = flax.serialization.to_bytes(state)
  back = flax.serialization.from_bytes(TX.init(PARAMS), blob)
  assert_bitwise(back, state)


# ---------------------------------------------------------------- batched


def batched_state(n=3):
  """n runs under vmap; member 1 overflows where the others do not."""
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  params = jax.tree.map(lambda p: jnp.stack([p] * n), PARAMS)
  state = jax.vmap(TX.init)(params)
  flags = jnp.array([False, True, False])
  for _ in range(2):
    params, state = jax.vmap(step)(params, state, keys, flags)
  return params, state


def test_host_helpers_on_a_batched_state():
  _, state = batched_state()
  # By hand: window 2 from 256, hysteresis 2: two clean steps leave 256 with
  # the tracker at 1; two overflows are absorbed once, then halve to 128.
  np.testing.assert_array_equal(fs.current_scale(state), [256, 128, 256])
  metrics = fs.scale_metrics(state)
  assert all(isinstance(v, jax.Array) for v in metrics.values())
  assert all(v.shape == (3,) for v in metrics.values())
  np.testing.assert_array_equal(metrics["skipped_steps"], [0, 2, 0])
  fs.raise_if_min_scale_reached(state)  # no member at the floor
  d = fs.scaler_state_dict(state)
  assert d["loss_scale"] == [256.0, 128.0, 256.0]
  assert d["growth_tracker"] == [1, -1, 1]
  back = fs.load_scaler_state_dict(
    jax.vmap(TX.init)(batched_state()[0]), d, SCALER
  )
  loaded = fs.scaler_state_dict(back)
  for k in d:
    np.testing.assert_array_equal(loaded[k], d[k])
  one = fs.set_loss_scale(state, 64.0)
  np.testing.assert_array_equal(fs.current_scale(one), [64, 64, 64])
  with pytest.raises(ValueError, match="batched"):
    fs.to_peer_state_dict(state, "deepspeed", SCALER)


def test_min_scale_error_on_one_batch_member():
  scaler = fs.deepspeed_scaler(init_scale=2.0, min_scale=1.0)
  tx = fs.chain(fs.fp16_loss_scale(scaler))
  state = jax.vmap(tx.init)(jnp.zeros((2, 3)))

  def upd(g, s):
    return tx.update(g, s, None)[1]

  bad = jnp.stack([jnp.ones(3), jnp.full(3, jnp.inf)])
  for _ in range(2):  # 2 -> 1, then an overflow at the floor
    state = jax.vmap(upd)(bad, state)
  with pytest.raises(fs.MinLossScaleError):
    fs.raise_if_min_scale_reached(state)


# ---------------------------------------------------------------- nnx


def test_nnx_optimizer_state_gives_plain_arrays():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = fs.chain(fs.fp16_loss_scale(SCALER), optax.sgd(0.1))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert isinstance(fs.current_scale(opt.opt_state), jax.Array)
  assert not isinstance(fs.current_scale(opt.opt_state), nnx.Variable)
  metrics = fs.scale_metrics(opt.opt_state)
  assert all(isinstance(v, jax.Array) for v in metrics.values())
  assert not any(isinstance(v, nnx.Variable) for v in metrics.values())
  grads = jax.tree.map(
    lambda p: jnp.full(p.shape, jnp.inf), nnx.state(model, nnx.Param)
  )
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  opt.update(model, grads)  # an overflow: skipped
  assert_bitwise(before, jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
  assert int(opt.step.get_value()) == 1  # nnx counts the skipped step
  assert fs.scaler_state_dict(opt.opt_state)["skipped_steps"] == 1
  # Writing goes back into Variables of the same kind.
  opt.opt_state = fs.set_loss_scale(opt.opt_state, 32.0)
  leaves = jax.tree.leaves(
    opt.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  kinds = {type(x) for x in leaves}
  assert all(issubclass(k, nnx.Variable) for k in kinds)
  assert float(fs.current_scale(opt.opt_state)) == 32.0
  opt.update(model, jax.tree.map(jnp.ones_like, grads))
  assert float(fs.scale_metrics(opt.opt_state)["prev_loss_scale"]) == 32.0
