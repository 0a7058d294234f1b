"""fs.jmp_scaler and fs.keras_scaler without their peers: the rules derived by
hand from jmp's and Keras's sources, the construction-time errors, and the
peer records of fp16_scaling/interop/_jax_peers.py. Against jmp's and
Keras's own code: tests/peers/test_jmp_keras.py."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling.interop import _jax_peers
from fp16_scaling.interop import _peers


def _trajectory(scaler, overflows):
  state, out = scaler.init(), []
  for overflow in overflows:
    state = scaler.update(state, overflow)
    out.append(float(state.loss_scale))
  return out


def test_jmp_rule_by_hand():
  # jmp's adjust: counter == period - 1 on a clean step grows by factor
  # (kept when not finite); an overflow divides by factor, to no less than
  # min_loss_scale, and restarts the counter.
  scaler = fs.jmp_scaler(loss_scale=16.0, period=2, factor=4, min_loss_scale=2)
  got = _trajectory(scaler, [0, 0, 0, 1, 0, 1, 1, 1, 0, 0])
  assert got == [16, 64, 64, 16, 16, 4, 2, 2, 2, 8]
  top = fs.jmp_scaler(loss_scale=2.0**126, period=1, factor=4)
  assert _trajectory(top, [0, 0]) == [2.0**126] * 2  # 2**128 is inf: kept
  assert fs.jmp_scaler() == fs.megatron_scaler(
    initial_scale=2.0**15, growth_interval=2000, hysteresis=1
  )


def test_keras_rule_by_hand():
  # LossScaleOptimizer: step_counter == dynamic_growth_steps - 1 on a clean
  # step doubles; a non-finite step halves and restarts the counter.
  scaler = fs.keras_scaler(initial_scale=8.0, dynamic_growth_steps=3)
  got = _trajectory(scaler, [0, 0, 0, 0, 1, 0, 0, 0])
  assert got == [8, 8, 16, 16, 8, 8, 8, 16]
  assert fs.keras_scaler() == fs.torch_scaler(init_scale=2.0**15)


def test_jmp_scaler_takes_jmps_array_arguments():
  scaler = fs.jmp_scaler(
    loss_scale=jnp.asarray(2.0**15),
    counter=np.zeros([], np.int32),
    min_loss_scale=np.ones([], np.float32),
  )
  assert scaler == fs.jmp_scaler()


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(factor=3), ValueError, "factor must be a power of two >= 2"),
    (dict(factor=1), ValueError, "factor must be a power of two >= 2"),
    (dict(factor=0.5), ValueError, "factor must be a power of two >= 2"),
    (dict(factor=2.0**200), ValueError, "factor must be a finite float"),
    (dict(factor="2"), TypeError, "factor must be a real number"),
    (dict(counter=3), ValueError, "counter must be 0.*load_scaler_state_dict"),
    (dict(period=0), ValueError, r"period must be an integer in \[1, "),
    (dict(loss_scale=0.0), ValueError, "loss_scale must be a positive"),
    (dict(loss_scale=jnp.ones(2)), TypeError, "loss_scale must be a number"),
    (dict(min_loss_scale=2.0**20), ValueError, "min_loss_scale must not"),
    (dict(min_loss_scale=-1.0), ValueError, "min_loss_scale must be a pos"),
  ],
)
def test_jmp_scaler_errors_name_the_argument(kw, error, match):
  with pytest.raises(error, match=match):
    fs.jmp_scaler(**kw)


@pytest.mark.parametrize(
  "kw, error, match",
  [
    (dict(initial_scale=float("inf")), ValueError, "initial_scale must be"),
    (dict(initial_scale=2.0**-130), ValueError, "initial_scale must be"),
    (dict(dynamic_growth_steps=0), ValueError, "dynamic_growth_steps must"),
    (dict(dynamic_growth_steps=2.5), TypeError, "dynamic_growth_steps must"),
  ],
)
def test_keras_scaler_errors_name_the_argument(kw, error, match):
  with pytest.raises(error, match=match):
    fs.keras_scaler(**kw)


SCALERS = {
  "jmp": fs.jmp_scaler(loss_scale=2.0**10, period=4, factor=8),
  "keras": fs.keras_scaler(initial_scale=2.0**10, dynamic_growth_steps=4),
}


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_from_own_and_to_own_are_inverses(name):
  scaler, peer = SCALERS[name], _jax_peers.EXPORTS[name]
  for scale in (2.0**-126, 0.5, 2.0**20):
    for tracker in range(scaler.growth_interval):
      c = _peers.Counters(scale, tracker, 0)
      d = peer.save(c, scaler)
      assert peer.load(d, scaler) == c
      assert peer.recognises(d)
      assert not any(p.recognises(d) for p in _peers.PEERS)


def _state(scaler):
  return fs.chain(fs.fp16_loss_scale(scaler), optax.sgd(0.1)).init(jnp.zeros(2))


def test_jmp_state_through_the_public_functions():
  scaler = SCALERS["jmp"]
  state = _state(scaler)
  d = fs.to_peer_state_dict(state, "jmp", scaler)
  assert sorted(d) == ["counter", "factor", "loss_scale", "min_loss_scale",
                       "period"]  # fmt: skip
  assert (d["period"], d["factor"]) == (4, 8)
  assert d["loss_scale"].dtype == np.float32 and d["counter"].dtype == np.int32
  back = fs.load_scaler_state_dict(state, {**d, "counter": 3}, scaler)
  assert fs.scaler_state_dict(back)["growth_tracker"] == 3
  assert fs.scaler_from_state_dict(d) == scaler
  # The jax pytree's leaves alone (scale, counter) load too.
  leaves = {"loss_scale": 2.0, "counter": 1}
  back = fs.load_scaler_state_dict(state, leaves, scaler)
  assert float(fs.current_scale(back)) == 2.0
  with pytest.raises(ValueError, match="disagrees with the scaler on growth_"):
    fs.load_scaler_state_dict(state, {**d, "period": 5}, scaler)
  with pytest.raises(ValueError, match=r"state_dict\['counter'\] must lie in"):
    fs.load_scaler_state_dict(state, {**leaves, "counter": 4}, scaler)
  # A floor that a jitted jmp scale lost (jmp#44) is named on load.
  with pytest.raises(ValueError, match="on min_scale"):
    floored = fs.jmp_scaler(
      loss_scale=2.0**10, period=4, factor=8, min_loss_scale=2.0**-3
    )
    fs.load_scaler_state_dict(_state(floored), d, floored)
  with pytest.raises(ValueError, match="jmp DynamicLossScale cannot continue"):
    fs.to_peer_state_dict(state, "jmp", fs.deepspeed_scaler())
  with pytest.raises(ValueError, match="needs growth_factor a power of two"):
    torch = fs.torch_scaler(growth_factor=1.5)
    fs.to_peer_state_dict(_state(torch), "jmp", torch)


def test_keras_state_through_the_public_functions():
  scaler = SCALERS["keras"]
  state = _state(scaler)
  d = fs.to_peer_state_dict(state, "keras", scaler)
  assert d == {
    "dynamic_scale": 1024.0,
    "step_counter": 0,
    "dynamic_growth_steps": 4,
  }
  variables = {"iteration": 7, "dynamic_scale": 64.0, "step_counter": 2}
  back = fs.load_scaler_state_dict(state, variables, scaler)
  assert float(fs.current_scale(back)) == 64.0
  assert fs.scaler_from_state_dict(d) == fs.keras_scaler(
    initial_scale=1024.0, dynamic_growth_steps=4
  )
  with pytest.raises(ValueError, match="no dynamic_growth_steps"):
    fs.scaler_from_state_dict(variables)
  assert fs.scaler_from_state_dict(variables, dynamic_growth_steps=4)
  for scale in (0.0, float("inf")):
    with pytest.raises(ValueError, match="Keras's scale has no floor"):
      fs.load_scaler_state_dict(state, {**variables, "dynamic_scale": scale},
                                scaler)  # fmt: skip
  with pytest.raises(ValueError, match="Keras halves its scale"):
    torch = fs.torch_scaler(backoff_factor=0.25)
    fs.to_peer_state_dict(_state(torch), "keras", torch)


def test_unknown_state_names_the_jax_peers():
  scaler = fs.torch_scaler()
  with pytest.raises(ValueError, match="not a known scaler state") as e:
    fs.load_scaler_state_dict(_state(scaler), {"foo": 1}, scaler)
  for peer in _jax_peers.PEERS:
    assert peer.saved_by in str(e.value)
  with pytest.raises(ValueError, match="peer must be one of .*'jmp', 'keras'"):
    fs.to_peer_state_dict(_state(scaler), "flax", scaler)
