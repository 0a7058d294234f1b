"""fp16_scaling._metrics: what current_scale, scale_metrics and
raise_if_min_scale_reached read out of a state.

The states are made by ``tx.init`` and given hand-picked values with
``_replace``, so each metric is checked against arithmetic done by hand, with
no step in between: which field each key reads, the counts and
size-weighted fractions over the leaves, the headroom in bits, the
accumulation keys between and at the end of a window, a batched state, and
the floor's error message.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling import _lookup

# Three leaves of 6, 3 and 2 elements, in tree order a, b, c.
PARAMS = {"a": jnp.zeros((2, 3)), "b": jnp.zeros(3), "c": jnp.zeros(2)}
BASE_KEYS = set(
  "loss_scale prev_loss_scale overflow skipped_steps consecutive_skipped_steps "
  "floor_overflows overflow_kind nonfinite_leaves grad_norm expert_grad_norm "
  "shared_grad_norm suspect_unscaled_grads".split()
)
RANGE_KEYS = {"grad_max_abs", "min_headroom_bits", "zero_fraction"}
ACCUMULATION_KEYS = set(
  "microbatches applied_steps dropped_microbatches window_ended".split()
)


def _chain(scaler=None, clip=True, **kwargs):
  clips = [fs.clip_by_unscaled_norm(1.0)] if clip else []
  scaler = scaler or fs.static_scaler(64.0)
  return helpers.guarded(scaler, *clips, optax.sgd(0.1), **kwargs)


def _with(state, scaler=None, **fields):
  """``state`` with its LossScaleState's ``fields`` replaced (``scaler``: a
  dict of its ScalerState's)."""
  ls = _lookup.loss_scale_state(state)
  if scaler is not None:
    fields["scaler"] = ls.scaler._replace(**scaler)
  return _lookup.replace_loss_scale_state(state, ls._replace(**fields))


def _with_node(state, kind, **fields):
  """``state`` with the ``fields`` of each of its ``kind`` nodes replaced."""
  return jax.tree.map(
    lambda x: x._replace(**fields) if isinstance(x, kind) else x,
    state,
    is_leaf=lambda x: isinstance(x, kind),
  )


def _host(metrics):
  return {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}


def test_current_scale_found_at_any_depth():
  tx = optax.chain(optax.identity(), _chain(fs.static_scaler(8.0)))
  state = tx.init(PARAMS)
  assert float(fs.current_scale(state)) == 8.0
  with pytest.raises(ValueError, match="no fp16_loss_scale"):
    fs.current_scale(optax.adam(1.0).init(PARAMS))


def test_each_key_reads_its_field():
  state = _with(
    _chain().init(PARAMS),
    scaler=dict(loss_scale=jnp.float32(32.0), floor_overflows=jnp.int32(2)),
    prev_loss_scale=jnp.float32(64.0),
    overflow=jnp.bool_(True),
    skipped_steps=jnp.int32(7),
    consecutive_skipped_steps=jnp.int32(3),
    grad_norm=jnp.float32(0.0),
    leaf_nonfinite=jnp.array([True, False, True]),
    overflow_kind=jnp.int32(fs.OVERFLOW_KINDS.index("backward")),
  )
  state = _with_node(
    state,
    fs.ClipState,
    expert_grad_norm=jnp.float32(3.0),
    shared_grad_norm=jnp.float32(4.0),
  )
  m = fs.scale_metrics(state)
  assert set(m) == BASE_KEYS
  assert all(isinstance(v, jax.Array) and v.shape == () for v in m.values())
  got = _host(m)
  assert got["loss_scale"] == 32.0 and got["prev_loss_scale"] == 64.0
  assert got["overflow"] and got["skipped_steps"] == 7
  assert got["consecutive_skipped_steps"] == 3
  assert got["floor_overflows"] == 2
  assert fs.OVERFLOW_KINDS[int(got["overflow_kind"])] == "backward"
  assert got["nonfinite_leaves"] == 2  # leaves a and c
  assert got["nonfinite_leaves"].dtype == np.int32
  assert got["grad_norm"] == 0.0
  assert (got["expert_grad_norm"], got["shared_grad_norm"]) == (3.0, 4.0)


def test_without_a_clip_every_leaf_is_shared():
  state = _chain(clip=False).init(PARAMS)
  state = _with(state, grad_norm=jnp.float32(5.0))
  got = _host(fs.scale_metrics(state))
  assert got["grad_norm"] == got["shared_grad_norm"] == 5.0
  assert got["expert_grad_norm"] == 0.0


def test_grad_range_keys_by_hand():
  state = _chain(grad_range=True).init(PARAMS)
  assert set(fs.scale_metrics(state)) == BASE_KEYS | RANGE_KEYS
  state = _with(
    state,
    prev_loss_scale=jnp.float32(16.0),
    grad_range=fs.GradRange(
      max_abs=jnp.array([0.5, 2.0, 0.0]),
      zero_fraction=jnp.array([4 / 6, 1 / 3, 1.0]),
    ),
  )
  got = _host(fs.scale_metrics(state))
  assert got["grad_max_abs"] == 2.0
  # The least headroom is leaf b's: log2(65504 / (2.0 * 16)) = log2(2047).
  np.testing.assert_allclose(got["min_headroom_bits"], np.log2(2047.0))
  # Weighted by the leaves' sizes 6, 3, 2: (4 + 1 + 2) zeros of 11.
  np.testing.assert_allclose(got["zero_fraction"], 7 / 11, rtol=1e-6)
  # All-zero gradients: no largest |g|, infinite headroom, all zero.
  state = _with(
    state,
    grad_range=fs.GradRange(max_abs=jnp.zeros(3), zero_fraction=jnp.ones(3)),
  )
  got = _host(fs.scale_metrics(state))
  assert got["grad_max_abs"] == 0.0 and got["min_headroom_bits"] == np.inf
  assert got["zero_fraction"] == 1.0


def test_accumulation_keys_between_and_at_the_end_of_a_window():
  tx = fs.accumulate_gradients(_chain(fs.static_scaler(64.0)), 4)
  state = tx.init(PARAMS)
  state = _with(
    state, overflow=jnp.bool_(True), prev_loss_scale=jnp.float32(128.0)
  )
  got = _host(fs.scale_metrics(state))
  assert set(got) == BASE_KEYS | ACCUMULATION_KEYS
  # Between windows, the last window's flag and scale are not news: no
  # overflow, and this microbatch's scale is the current one.
  assert not got["window_ended"] and not got["overflow"]
  assert got["prev_loss_scale"] == got["loss_scale"] == 64.0
  assert (got["microbatches"], got["applied_steps"]) == (0, 0)
  assert got["dropped_microbatches"] == 0
  ended = _with_node(
    state,
    fs.AccumulationState,
    window_ended=jnp.bool_(True),
    microbatches=jnp.int32(8),
    applied_steps=jnp.int32(1),
    dropped_microbatches=jnp.int32(3),
  )
  got = _host(fs.scale_metrics(ended))
  assert got["window_ended"] and got["overflow"]
  assert got["prev_loss_scale"] == 128.0 and got["loss_scale"] == 64.0
  assert (got["microbatches"], got["applied_steps"]) == (8, 1)
  assert got["dropped_microbatches"] == 3


def test_a_batched_state_gives_one_value_per_member():
  tx = _chain(grad_range=True)
  state = jax.vmap(tx.init)(jax.tree.map(lambda p: jnp.stack([p] * 2), PARAMS))
  state = _with(
    state,
    leaf_nonfinite=jnp.array([[False, False, False], [True, True, False]]),
    prev_loss_scale=jnp.float32([1.0, 4.0]),
    grad_range=fs.GradRange(
      max_abs=jnp.array([[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]]),
      zero_fraction=jnp.array([[0.0, 0.0, 1.0], [0.5, 1.0, 0.0]]),
    ),
  )
  got = _host(fs.scale_metrics(state))
  assert all(v.shape == (2,) for v in got.values())
  np.testing.assert_array_equal(got["nonfinite_leaves"], [0, 2])
  np.testing.assert_array_equal(got["grad_max_abs"], [1.0, 0.0])
  np.testing.assert_allclose(
    got["min_headroom_bits"], [np.log2(65504.0), np.inf]
  )
  # Member 0: 2 zeros of 11; member 1: 3 + 3 of 11.
  np.testing.assert_allclose(got["zero_fraction"], [2 / 11, 6 / 11], rtol=1e-6)


def _at_floor(errors, floor_overflows, scale=1.0):
  tx = _chain(fs.deepspeed_scaler(init_scale=2.0, min_scale=1.0))
  return _with(
    tx.init(PARAMS),
    scaler=dict(
      loss_scale=jnp.float32(scale),
      min_scale_errors=jnp.int32(errors),
      floor_overflows=jnp.int32(floor_overflows),
    ),
  )


def test_raise_if_min_scale_reached_says_why():
  fs.raise_if_min_scale_reached(_at_floor(0, 0))
  fs.raise_if_min_scale_reached(_at_floor(0, 3))  # torch-like: no error
  fs.raise_if_min_scale_reached(_at_floor(0, 2), max_floor_overflows=3)
  with pytest.raises(fs.MinLossScaleError) as err:
    fs.raise_if_min_scale_reached(_at_floor(2, 2))
  assert str(err.value).startswith(
    "Current loss scale already at minimum (1.0) - cannot decrease scale "
    "anymore: 2 overflowing step(s) hit the floor (DeepSpeed raises here; "
    "raise_error_at_min_scale=True). Last overflow: "
  )
  with pytest.raises(fs.MinLossScaleError) as err:
    fs.raise_if_min_scale_reached(_at_floor(0, 3), max_floor_overflows=3)
  assert "3 overflowing step(s) hit the floor (max_floor_overflows=3)" in str(
    err.value
  )
  for bad, kind in [(0, ValueError), (2.5, TypeError), (True, TypeError)]:
    with pytest.raises(kind, match="max_floor_overflows"):
      fs.raise_if_min_scale_reached(_at_floor(0, 0), max_floor_overflows=bad)


def test_raise_if_min_scale_reached_on_a_batched_state():
  one = _at_floor(0, 0)
  state = jax.tree.map(lambda x: jnp.stack([x, x]), one)
  fs.raise_if_min_scale_reached(state)
  state = _with(
    state,
    scaler=dict(
      min_scale_errors=jnp.int32([0, 1]), loss_scale=jnp.float32([4.0, 1.0])
    ),
  )
  with pytest.raises(fs.MinLossScaleError) as err:
    fs.raise_if_min_scale_reached(state)
  # The smallest member's scale, and no per-leaf report for a batch.
  assert str(err.value).startswith(
    "Current loss scale already at minimum (1.0)"
  )
  assert str(err.value).endswith(
    " Call overflow_report on one member to see its leaves."
  )


def test_raise_if_min_scale_reached_after_real_steps():
  tx = helpers.guarded(
    fs.deepspeed_scaler(init_scale=2.0, scale_window=4, min_scale=1.0),
    fs.clip_by_unscaled_norm(10.0),
  )
  nan = jax.tree.map(lambda g: g * jnp.nan, PARAMS)
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  _, state = update(nan, state)  # 2 -> 1: allowed
  fs.raise_if_min_scale_reached(state)
  _, state = update(nan, state)  # already at 1: DeepSpeed raises here
  with pytest.raises(fs.MinLossScaleError, match="minimum"):
    fs.raise_if_min_scale_reached(state)
