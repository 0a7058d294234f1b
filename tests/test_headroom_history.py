"""headroom_scaler(history=W): the clean-step target from the largest |g| of
the last W clean steps, against a numpy reference of the rule written here
and hand-derived sequences; its state through checkpoints; its arguments."""

import json
import math

import flax.serialization
from helpers import assert_same_bits
from helpers import guarded
from helpers import orbax_round_trip
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs


def reference(init_scale, grad_maxes, overflows, history):
  """The scales after each step, by the rule as docs/diagnostics.md states
  it, in numpy float32 (power-of-two floor by float64 log2: exact, since a
  float32 just below 2**k has log2 at least 2**-24 below k)."""
  # headroom_scaler's defaults.
  headroom, margin_bits, growth, backoff = 4.0, 2.0, 2.0, 0.5
  lo, hi = 1.0, 2.0**24
  f32 = np.float32
  scale = f32(init_scale)
  window = []  # the last ``history`` clean steps' maxima
  out = []
  for g, overflow in zip(grad_maxes, overflows):
    if overflow:
      scale = max(scale * f32(backoff), f32(lo))
    else:
      window = (window + [f32(g)])[-history:]
      with np.errstate(divide="ignore"):
        target = f32(65504.0) / (max(window) * f32(2.0**headroom))
      if np.isfinite(target):
        target = f32(2.0 ** math.floor(math.log2(float(target))))
      capped = min(target, scale * f32(growth), f32(hi))
      if target < scale or target >= scale * f32(2.0**margin_bits):
        scale = capped
      scale = max(scale, f32(lo))
    out.append(scale)
  return np.asarray(out, np.float32)


def scales(scaler, grad_maxes, overflows):
  update = jax.jit(scaler.update)
  state = scaler.init()
  out = []
  for g, o in zip(grad_maxes, overflows):
    state = update(state, jnp.bool_(o), jnp.float32(g))
    out.append(state.loss_scale)
  return np.asarray(out, np.float32), state


def random_run(n=300, seed=0):
  """Maxima over six decades (some exactly 0.0) and 5% overflows."""
  rng = np.random.default_rng(seed)
  g = (10.0 ** rng.uniform(-6, 0, n)).astype(np.float32)
  g[rng.random(n) < 0.03] = 0.0
  return g, rng.random(n) < 0.05


@pytest.mark.parametrize("history", [1, 3, 16])
def test_the_rule_equals_the_numpy_reference_bit_for_bit(history):
  g, o = random_run()
  scaler = fs.headroom_scaler(init_scale=2.0**16, history=history)
  got, _ = scales(scaler, g, o)
  want = reference(2.0**16, g, o, history)
  assert got.tobytes() == want.tobytes()
  if history > 1:  # the window changes what the rule does on this run
    assert not np.array_equal(got, reference(2.0**16, g, o, 1))


def test_history_1_is_the_old_state_and_the_default_has_a_window():
  # history=1 keeps no window: the state is the five counters, as before.
  state = fs.headroom_scaler(history=1).init()
  assert type(state) is fs.ScalerState
  assert len(jax.tree.leaves(state)) == 5
  default = fs.headroom_scaler().init()
  assert type(default) is fs.WindowedScalerState
  assert default[:5] == tuple(default)[:5]
  assert default.grad_max_history.shape == (256,)
  assert default.grad_max_history.dtype == jnp.float32
  assert default.history_position.dtype == jnp.int32


def test_other_presets_state_is_unchanged():
  """Every other preset's state is the five-field ScalerState, so that its
  checkpoints written before the window existed restore (tests/test_chain.py
  and tests/test_stacked.py restore two)."""
  for scaler in (fs.deepspeed_scaler(), fs.torch_scaler(), fs.no_scaler()):
    state = scaler.init()
    assert type(state) is fs.ScalerState
    assert state._fields == (
      "loss_scale",
      "growth_tracker",
      "hysteresis_left",
      "min_scale_errors",
      "floor_overflows",
    )


# Initial scale 2**10, headroom 4 bits, no growth margin. The target of a
# largest |g| of 2**k is the power of two below 65504 / 2**(k + 4), 2**(11-k).
HAND = dict(init_scale=2.0**10, growth_margin_bits=0.0)


def test_target_rises_when_the_old_maximum_leaves_the_window():
  # |g| = 4 (target 2**9), then 1s (target 2**11). With W=3 the 4 stays in
  # the window for the next two clean steps, and an overflow between them
  # does not count as one; it leaves on the third: then the scale grows by
  # at most 2x per step to 2**11. With W=1 it grows on the next clean step.
  g = [4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  o = [False, False, True, False, False, False, False]
  got, state = scales(fs.headroom_scaler(**HAND, history=3), g, o)
  np.testing.assert_array_equal(got, 2.0 ** np.array([9, 9, 8, 9, 10, 11, 11]))
  got1, _ = scales(fs.headroom_scaler(**HAND, history=1), g, o)
  np.testing.assert_array_equal(
    got1, 2.0 ** np.array([9, 10, 9, 10, 11, 11, 11])
  )
  # Six clean steps wrote slots 0, 1, 2, 0, 1, 2: the ring holds three 1s.
  np.testing.assert_array_equal(state.grad_max_history, [1.0, 1.0, 1.0])
  assert int(state.history_position) == 0


def test_falls_at_once_on_a_new_maximum():
  # At 2**11 on a window of 1s, one |g| of 16 (target 2**7): down at once,
  # and it holds the scale there for the window's length.
  g = [1.0, 1.0, 1.0, 1.0, 16.0, 1.0, 1.0, 1.0, 1.0]
  got, _ = scales(fs.headroom_scaler(**HAND, history=4), g, [False] * 9)
  np.testing.assert_array_equal(got, 2.0 ** np.array([11] * 4 + [7] * 4 + [8]))


def test_backs_off_on_overflow_and_keeps_the_window():
  scaler = fs.headroom_scaler(**HAND, history=4)
  _, state = scales(scaler, [1.0, 2.0], [False, False])
  after = scaler.update(state, jnp.bool_(True), jnp.float32(1e-3))
  assert float(after.loss_scale) == float(state.loss_scale) / 2
  assert after.grad_max_history.tobytes() == state.grad_max_history.tobytes()
  assert int(after.history_position) == int(state.history_position) == 2


def test_a_corrupt_window_is_read_within_range():
  # A checkpoint's NaN, inf or negative entries count as no step; its
  # position wraps into the ring: the scale stays a finite power of two.
  scaler = fs.headroom_scaler(**HAND, history=4)
  state = scaler.init()._replace(
    grad_max_history=jnp.array([jnp.nan, jnp.inf, -8.0, 0.0]),
    history_position=jnp.int32(9),
  )
  after = scaler.update(state, jnp.bool_(False), jnp.float32(8.0))
  # max of (8 written at slot 9 mod 4 = 1, |-8|): target 2**(11-3) = 2**8.
  assert float(after.loss_scale) == 2.0**8
  np.testing.assert_array_equal(after.grad_max_history, [0.0, 8.0, 8.0, 0.0])
  assert int(after.history_position) == 2


SCALER = fs.headroom_scaler(init_scale=2.0**12, history=8)
TX = guarded(SCALER, fs.clip_by_unscaled_norm(1.0), optax.adam(1e-2))
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}


@jax.jit
def step(params, state, key, overflow):
  """One guarded step on float16 gradients whose size moves over two
  decades per step (an inf in ``w`` on overflow)."""
  k1, k2 = jax.random.split(key)
  size = 10.0 ** jax.random.uniform(k2, (), minval=-3.0, maxval=-1.0)
  grads = jax.tree.map(lambda p: size * jax.random.normal(k1, p.shape), params)
  poison = jnp.where(overflow, jnp.inf, 0.0)
  grads["w"] = grads["w"].at[0, 0].set(poison)
  scale = fs.current_scale(state)
  scaled = jax.tree.map(lambda g: (g * scale).astype(jnp.float16), grads)
  updates, state = TX.update(scaled, state, params)
  return optax.apply_updates(params, updates), state


def run(params, state, first, n):
  for i in range(first, first + n):
    overflow = jnp.bool_(i % 7 == 3)
    params, state = step(params, state, jax.random.PRNGKey(i), overflow)
  return params, state


def test_saved_and_restored_mid_run_continues_bit_for_bit(tmp_path):
  params, state = run(PARAMS, TX.init(PARAMS), 0, 11)
  # Steps 3 and 10 overflowed: 9 clean steps have gone round the ring of 8.
  mid = fs.scaler_state_dict(state)
  assert len(mid["grad_max_history"]) == 8
  assert mid["history_position"] == 1
  straight = run(params, state, 11, 12)
  # orbax, with a target; flax msgpack with a target; the own dict as JSON.
  live = {"params": params, "opt_state": state}
  target = {"params": PARAMS, "opt_state": TX.init(PARAMS)}
  from_orbax = orbax_round_trip(tmp_path / "mid", live, target)
  blob = flax.serialization.to_bytes(live)
  from_msgpack = flax.serialization.from_bytes(target, blob)
  # The own dict holds the whole loss-scale state: loaded into the live
  # state with its loss-scale part reset (AdamW's moments are not in it).
  saved = json.loads(json.dumps(fs.scaler_state_dict(state, SCALER)))
  blank = fs.load_scaler_state_dict(
    state, fs.scaler_state_dict(TX.init(PARAMS)), SCALER
  )
  assert fs.scaler_state_dict(blank)["grad_max_history"] == [0.0] * 8
  loaded = fs.load_scaler_state_dict(blank, saved, SCALER)
  # A load marks the scale as set (scale_set, which a sync reads); cleared
  # here, every other bit is compared.
  assert bool(loaded[0].scale_set)
  unmarked = loaded[0]._replace(scale_set=jnp.bool_(False))
  from_dict = {"params": params, "opt_state": (unmarked, *loaded[1:])}
  for restored in (from_orbax, from_msgpack, from_dict):
    assert_same_bits(restored, live)
    resumed = run(restored["params"], restored["opt_state"], 11, 12)
    assert_same_bits(straight, resumed)
  # The window is part of what continues: without it, the run differs.
  del saved["grad_max_history"], saved["history_position"]
  forgot = fs.load_scaler_state_dict(blank, saved, SCALER)
  _, forgot = run(params, forgot, 11, 12)
  assert float(fs.current_scale(forgot)) != float(
    fs.current_scale(straight[1])
  ) or fs.scaler_state_dict(forgot) != fs.scaler_state_dict(straight[1])


def test_a_state_saved_without_a_window_loads_into_one():
  # A dict from history=1 (or from before history existed) has no ring: it
  # loads into a history=8 state with an empty window, the scale kept.
  one = fs.headroom_scaler(init_scale=2.0**12, history=1)
  tx1 = guarded(one, fs.clip_by_unscaled_norm(1.0), optax.adam(1e-2))
  d = fs.scaler_state_dict(tx1.init(PARAMS))
  assert "grad_max_history" not in d
  d["loss_scale"] = 2.0**9
  back = fs.load_scaler_state_dict(TX.init(PARAMS), d, SCALER)
  ls = fs.scaler_state_dict(back)
  assert ls["loss_scale"] == 2.0**9
  assert ls["grad_max_history"] == [0.0] * 8
  # With its config, a window of another length is refused by name.
  d8 = fs.scaler_state_dict(TX.init(PARAMS), SCALER)
  with pytest.raises(ValueError, match="history"):
    fs.load_scaler_state_dict(tx1.init(PARAMS), d8, one)


_BAD = [(0, ValueError), (-3, ValueError), (2.0, TypeError)]


@pytest.mark.parametrize(
  "bad, error", _BAD + [(True, TypeError), (None, TypeError)]
)
def test_history_is_checked_at_construction(bad, error):
  with pytest.raises(error, match="history must be an integer"):
    fs.headroom_scaler(history=bad)
