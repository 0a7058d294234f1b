"""The loss-scale state machine against trajectories derived by hand from each
peer's code (deepspeed/runtime/fp16/loss_scaler.py, torch._amp_update_scale_,
megatron/core/optimizer/grad_scaler.py, flax/training/dynamic_scale.py).

The tables were worked out step by step on paper from those functions; the
comparison with the peers' running code lives in tests/peers/.
"""

from helpers import TINY
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs


def trajectory(scaler, overflows):
  """Scale after each step, driven through lax.scan under jit."""

  @jax.jit
  def run(flags):
    def body(state, flag):
      state = scaler.update(state, flag)
      return state, state

    return jax.lax.scan(body, scaler.init(), flags)

  final, states = run(jnp.asarray(overflows, bool))
  return np.asarray(states.loss_scale).tolist(), final


C, O = False, True

# Window 3, eight clean steps from scale 8 (docs/peers.md: torch and
# Megatron grow on steps 3 and 6, DeepSpeed on 4 and 7, Flax on 4 and 8).
GROWTH_TABLE = {
  "torch": (
    fs.torch_scaler(init_scale=8.0, growth_interval=3),
    [8, 8, 16, 16, 16, 32, 32, 32],
  ),
  "megatron": (
    fs.megatron_scaler(
      initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=1
    ),
    [8, 8, 16, 16, 16, 32, 32, 32],
  ),
  "deepspeed": (
    fs.deepspeed_scaler(init_scale=8.0, scale_window=3),
    [8, 8, 8, 16, 16, 16, 32, 32],
  ),
  "flax": (
    fs.flax_scaler(growth_interval=3, scale=8.0),
    [8, 8, 8, 16, 16, 16, 16, 32],
  ),
}


@pytest.mark.parametrize("name", sorted(GROWTH_TABLE))
def test_growth_steps_match_each_peer(name):
  scaler, expected = GROWTH_TABLE[name]
  got, _ = trajectory(scaler, [C] * 8)
  assert got == expected


# Overflow pattern O O C C C O C O O, window 2, initial scale 16, floor 1.
# Worked through each peer's update function by hand (see module docstring).
PATTERN = [O, O, C, C, C, O, C, O, O]
HYSTERESIS_TABLE = {
  # DeepSpeed delayed_shift=2: the first overflow only spends hysteresis;
  # growth at stable_interval 2 (step 4) refills it.
  "deepspeed_h2": (
    fs.deepspeed_scaler(
      init_scale=16.0, scale_window=2, min_scale=1.0, delayed_shift=2
    ),
    [16, 8, 8, 8, 16, 16, 16, 8, 4],
  ),
  # consecutive_hysteresis refills on every clean step, so the overflow at
  # step 7 (after the clean step 6) is absorbed too.
  "deepspeed_h2_consecutive": (
    fs.deepspeed_scaler(
      init_scale=16.0,
      scale_window=2,
      min_scale=1.0,
      delayed_shift=2,
      consecutive_hysteresis=True,
    ),
    [16, 8, 8, 8, 16, 16, 16, 16, 8],
  ),
  # Megatron hysteresis=2: the tracker goes 1, 0 (back off), -1 ...;
  # refilled only on growth (step 3, second clean step).
  "megatron_h2": (
    fs.megatron_scaler(
      initial_scale=16.0, min_scale=1.0, growth_interval=2, hysteresis=2
    ),
    [16, 8, 8, 16, 16, 16, 16, 8, 4],
  ),
  "torch": (
    fs.torch_scaler(init_scale=16.0, growth_interval=2),
    [8, 4, 4, 8, 8, 4, 4, 2, 1],
  ),
  # Flax growth_interval=2 grows on the third clean step in a row.
  "flax": (
    fs.flax_scaler(growth_interval=2, scale=16.0),
    [8, 4, 4, 4, 8, 4, 4, 2, 1],
  ),
  "static": (fs.static_scaler(16.0), [16] * 9),
  "none": (fs.no_scaler(), [1] * 9),
}


@pytest.mark.parametrize("name", sorted(HYSTERESIS_TABLE))
def test_overflow_and_hysteresis_tables(name):
  scaler, expected = HYSTERESIS_TABLE[name]
  got, _ = trajectory(scaler, PATTERN)
  assert got == expected


def test_deepspeed_min_scale_errors_counted_where_deepspeed_raises():
  # init 4, floor 2: the first overflow halves to 2, every later one would
  # lower a scale already at the floor, which DeepSpeed raises on.
  kwargs = dict(init_scale=4.0, scale_window=2, min_scale=2.0)
  got, final = trajectory(fs.deepspeed_scaler(**kwargs), [O, C, O, O])
  assert got == [2, 2, 2, 2]
  assert int(final.min_scale_errors) == 2
  quiet = fs.deepspeed_scaler(**kwargs, raise_error_at_min_scale=False)
  assert int(trajectory(quiet, [O, C, O, O])[1].min_scale_errors) == 0


def test_hysteresis_absorbed_overflow_at_floor_is_not_an_error():
  scaler = fs.deepspeed_scaler(
    init_scale=2.0, scale_window=2, min_scale=2.0, delayed_shift=2
  )
  got, final = trajectory(scaler, [O])
  assert got == [2] and int(final.min_scale_errors) == 0


def test_torch_scale_never_reaches_zero_and_recovers():
  # torch's scale sinks through float32 subnormals to 0 under persistent NaN
  # and can never grow back; ours stops at float32's smallest normal number.
  scaler = fs.torch_scaler(init_scale=2.0**16, growth_interval=1)
  got, _ = trajectory(scaler, [O] * 300 + [C] * 3)
  floor_steps = got[:300]
  assert min(floor_steps) == TINY
  assert all(s >= TINY for s in got)
  assert got[-3:] == [TINY * 2, TINY * 4, TINY * 8]


@pytest.mark.parametrize(
  "scaler",
  [
    fs.megatron_scaler(
      initial_scale=2.0**126, min_scale=1.0, growth_interval=1, hysteresis=1
    ),
    fs.deepspeed_scaler(init_scale=2.0**126, scale_window=1),
    fs.torch_scaler(init_scale=2.0**126, growth_interval=1),
    fs.flax_scaler(growth_interval=1, scale=2.0**126),
  ],
)
def test_growth_never_reaches_inf(scaler):
  got, _ = trajectory(scaler, [C] * 10)
  assert max(got) == 2.0**127
  assert all(np.isfinite(got))


def test_non_power_of_two_factors_round_like_float32():
  scaler = fs.torch_scaler(
    init_scale=1000.0, growth_factor=1.5, backoff_factor=0.25, growth_interval=1
  )
  got, _ = trajectory(scaler, [C, C, O])
  s = np.float32(1000.0)
  expected = [s * np.float32(1.5)]
  expected.append(expected[-1] * np.float32(1.5))
  expected.append(expected[-1] * np.float32(0.25))
  assert got == [float(v) for v in expected]


# (preset, its arguments, the error): the last argument is the bad one.
BAD = [
  (fs.static_scaler, dict(scale=0.0), ValueError),
  (fs.static_scaler, dict(scale=float("inf")), ValueError),
  (fs.static_scaler, dict(scale=1e-40), ValueError),
  (fs.torch_scaler, dict(init_scale=-1.0), ValueError),
  (fs.torch_scaler, dict(growth_factor=1.0), ValueError),
  (fs.torch_scaler, dict(backoff_factor=1.0), ValueError),
  (fs.torch_scaler, dict(backoff_factor=0.0), ValueError),
  (fs.torch_scaler, dict(growth_interval=0), ValueError),
  (fs.torch_scaler, dict(growth_interval=2.5), TypeError),
  (fs.deepspeed_scaler, dict(scale_window=0), ValueError),
  (fs.deepspeed_scaler, dict(delayed_shift=0), ValueError),
  (fs.deepspeed_scaler, dict(init_scale=8.0, min_scale=16.0), ValueError),
  (fs.deepspeed_scaler, dict(consecutive_hysteresis="yes"), TypeError),
  (fs.megatron_scaler, dict(hysteresis=0), ValueError),
  (fs.megatron_scaler, dict(initial_scale=8.0, min_scale=16.0), ValueError),
  (fs.megatron_scaler, dict(initial_scale=8.0, min_scale=0.0), ValueError),
  (fs.flax_scaler, dict(backoff_factor=2.0), ValueError),
]


@pytest.mark.parametrize(
  "preset, kwargs, error",
  BAD,
  ids=[f"{p.__name__}-{'-'.join(kw)}" for p, kw, _ in BAD],
)
def test_bad_configuration_names_the_parameter(preset, kwargs, error):
  with pytest.raises(error, match=list(kwargs)[-1]):
    preset(**kwargs)


@pytest.mark.parametrize(
  "preset",
  [fs.deepspeed_scaler, fs.torch_scaler, fs.megatron_scaler, fs.flax_scaler],
)
def test_presets_refuse_positional_arguments(preset):
  # flax_scaler(2.0**15) once set growth_factor=32768 without a word.
  with pytest.raises(TypeError, match="positional"):
    preset(2.0**15)


@pytest.mark.parametrize(
  "max_scale, want",
  [(2.0**5, [8.0, 16.0, 32.0, 32.0]), (24.0, [8.0, 16.0, 24.0, 24.0])],
)
def test_max_scale_bounds_the_growth_of_every_rule(max_scale, want):
  """torch's rule, doubling every clean step, with a ceiling: a growth that
  would pass it grows to it, and it holds (hand-derived)."""
  import dataclasses

  scaler = dataclasses.replace(
    fs.torch_scaler(init_scale=4.0, growth_interval=1), max_scale=max_scale
  )
  state, seen = scaler.init(), []
  for _ in range(4):
    state = scaler.update(state, jnp.bool_(False))
    seen.append(float(state.loss_scale))
  assert seen == want
