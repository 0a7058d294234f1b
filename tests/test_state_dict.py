"""Plain-value scaler state: round trips, peer formats read by hand, errors,
batched and nnx-wrapped states, restores that lost their types.

The peers' own code is run against these functions in
tests/peers/test_peer_state_dict.py; here the peer dicts are written out by hand
from each peer's ``state_dict()`` (see fp16_scaling/interop/_peers.py).
"""

import dataclasses
import functools
import json
import math

from helpers import bits
from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

O, C = True, False


@functools.cache
def make(scaler):
  """One transformation per scaler, so each jitted step compiles once."""
  return guarded(scaler, optax.sgd(0.1))


def init(scaler):
  return make(scaler).init(jnp.zeros(2))


@functools.cache
def stepper(tx):
  @jax.jit
  def step(params, state, overflow):
    scale = fs.current_scale(state)
    grads = jnp.where(overflow, jnp.inf, 1.0) * scale * jnp.ones_like(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(tx, params, state, overflows):
  step = stepper(tx)
  for o in overflows:
    params, state = step(params, state, jnp.bool_(o))
  return params, state


SEQ = [C, O, O, C, C, C, O, C, C, C, C, C, O, O, O, C, C]
SCALERS = {
  "deepspeed": fs.deepspeed_scaler(
    init_scale=2.0**10, scale_window=3, delayed_shift=2
  ),
  "torch": fs.torch_scaler(init_scale=2.0**10, growth_interval=3),
  "megatron": fs.megatron_scaler(
    initial_scale=2.0**10, growth_interval=3, hysteresis=3
  ),
}


def marked(state):
  """``state`` (a chain's) with its scale marked as set, as a load marks it
  (``scale_set``: a sync keeps it); every other bit as it was."""
  return (state[0]._replace(scale_set=jnp.bool_(True)),) + tuple(state[1:])


def cut_at(name, cut):
  """SCALERS[name]'s run over SEQ[:cut]: its state, and the bits of the
  rest of SEQ run from a state given."""
  tx = make(SCALERS[name])
  params = jnp.zeros(3)
  p_mid, s_mid = run(tx, params, tx.init(params), SEQ[:cut])
  return s_mid, lambda state: bits(run(tx, p_mid, state, SEQ[cut:]))


@pytest.mark.parametrize("name", sorted(SCALERS))
@pytest.mark.parametrize("cut", [1, 2, 6, 13])
def test_own_round_trip_continues_identically(name, cut):
  scaler = SCALERS[name]
  s_mid, rest = cut_at(name, cut)
  d = fs.scaler_state_dict(s_mid, scaler)
  per_leaf = ("leaf_nonfinite", "leaf_nonfinite_steps")
  assert all(
    type(v) in (int, float, bool)
    for k, v in d.items()
    if k not in ("format", "config") + per_leaf
  )
  assert all(len(d[k]) == 1 for k in per_leaf)  # one gradient leaf
  loaded = fs.load_scaler_state_dict(make(scaler).init(jnp.zeros(3)), d, scaler)
  assert bool(loaded[0].scale_set) and not bool(s_mid[0].scale_set)
  assert rest(loaded) == rest(marked(s_mid))


def test_state_dict_values_by_hand():
  # DeepSpeed, window 3, hysteresis 2, from 1024: C, O (absorbed), O (backs
  # off to 512): tracker restarts at -1, hysteresis spent.
  scaler = SCALERS["deepspeed"]
  tx = make(scaler)
  _, state = run(tx, jnp.zeros(3), tx.init(jnp.zeros(3)), [C, O, O])
  d = fs.scaler_state_dict(state)
  assert d["loss_scale"] == 512.0 and d["prev_loss_scale"] == 1024.0
  assert d["growth_tracker"] == -1 and d["hysteresis_left"] == 0
  assert d["skipped_steps"] == 2 and d["overflow"] is True
  assert d["grad_norm"] == 0.0 and "config" not in d  # 0.0 on overflow


# Hand-written peer dicts: each is what the peer's state_dict() returns after
# the stated history, and the expected ScalerState values follow the mapping.
def torch_dict(scale, growth_interval, tracker):
  """torch GradScaler's state_dict()."""
  return dict(
    scale=scale,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=growth_interval,
    _growth_tracker=tracker,
  )


def ds_dict(**fields):
  """DeepSpeed's fp16 optimizer's loss-scaler entries, ``fields`` added."""
  return dict(dynamic_loss_scale=True, scale_factor=2.0, **fields)


def counters(d):
  return d["loss_scale"], d["growth_tracker"], d["hysteresis_left"]


def test_torch_dict_loads():
  scaler = fs.torch_scaler(growth_interval=5)
  tx = make(scaler)
  sd = torch_dict(256.0, 5, 3)
  state = fs.load_scaler_state_dict(init(scaler), sd, scaler)
  assert counters(fs.scaler_state_dict(state)) == (256.0, 3, 0)
  # Two more clean steps: torch grows on the 5th clean step.
  _, state = run(tx, jnp.zeros(2), state, [C, C])
  assert float(fs.current_scale(state)) == 512.0
  assert fs.to_peer_state_dict(state, "torch", scaler)["_growth_tracker"] == 0


def test_deepspeed_optimizer_dict_with_and_without_cur_hysteresis():
  # 10 steps, last overflow at iteration 6: k = 10 - 6 - 1 = 3 clean steps.
  base = ds_dict(
    cur_scale=128.0, cur_iter=10, last_overflow_iter=6, scale_window=3
  )
  scaler = fs.deepspeed_scaler(scale_window=3, delayed_shift=3)
  tx = make(scaler)
  fresh = init(scaler)
  old = fs.scaler_state_dict(fs.load_scaler_state_dict(fresh, base, scaler))
  # k=3 -> tracker (3-1) % 3 = 2; 0.19.8 has no hysteresis: loaded full.
  assert (old["growth_tracker"], old["hysteresis_left"]) == (2, 2)
  new = fs.scaler_state_dict(
    fs.load_scaler_state_dict(fresh, {**base, "cur_hysteresis": 1}, scaler)
  )
  assert (new["growth_tracker"], new["hysteresis_left"]) == (2, 0)
  # k = 3 is a multiple of the window: DeepSpeed grows on the next clean step.
  state = fs.load_scaler_state_dict(fresh, base, scaler)
  _, state = run(tx, jnp.zeros(2), state, [C])
  assert float(fs.current_scale(state)) == 256.0


def test_deepspeed_zero_loss_scaler_attributes():
  attrs = dict(
    cur_scale=64.0,
    cur_iter=4,
    last_overflow_iter=3,
    scale_factor=2.0,
    scale_window=1000,
    min_scale=1,
    delayed_shift=2,
    cur_hysteresis=1,
    consecutive_hysteresis=False,
    raise_error_at_min_scale=True,
    dynamic=True,
  )
  scaler = fs.deepspeed_scaler(delayed_shift=2)
  for sd in (attrs, {"loss_scaler": attrs, "other": 1}):
    d = fs.scaler_state_dict(
      fs.load_scaler_state_dict(init(scaler), sd, scaler)
    )
    assert counters(d) == (64.0, -1, 0)
  with pytest.raises(ValueError, match="consecutive_hysteresis"):
    fs.load_scaler_state_dict(
      init(scaler), {**attrs, "consecutive_hysteresis": True}, scaler
    )
  assert fs.scaler_from_state_dict(attrs) == fs.deepspeed_scaler(
    init_scale=64.0, delayed_shift=2
  )


def test_megatron_dict_negative_hysteresis_tracker():
  # Megatron's tracker falls below 1 while it keeps backing off.
  scaler = fs.megatron_scaler(growth_interval=4, hysteresis=2)
  tx = make(scaler)
  sd = dict(scale=np.float32([8.0]), growth_tracker=0, hysteresis_tracker=-3)
  state = fs.load_scaler_state_dict(init(scaler), sd, scaler)
  _, state = run(tx, jnp.zeros(2), state, [O])
  assert float(fs.current_scale(state)) == 4.0


def test_scaler_from_state_dict_takes_the_peer_config():
  sd = torch_dict(8.0, 7, 1)
  scaler = fs.scaler_from_state_dict(sd)
  assert scaler == fs.torch_scaler(init_scale=8.0, growth_interval=7)
  fs.load_scaler_state_dict(init(scaler), sd, scaler)
  ds = fs.scaler_from_state_dict(
    ds_dict(cur_scale=4.0, cur_iter=0, last_overflow_iter=-1, scale_window=9),
    delayed_shift=2,
  )
  assert ds == fs.deepspeed_scaler(
    init_scale=4.0,
    scale_window=9,
    delayed_shift=2,
    raise_error_at_min_scale=False,
  )
  with pytest.raises(ValueError, match="megatron_scaler"):
    fs.scaler_from_state_dict(
      dict(scale=1.0, growth_tracker=0, hysteresis_tracker=1)
    )


# ---------------------------------------------------------------- errors


def test_config_mismatch_names_the_field():
  torch_sd = fs.to_peer_state_dict(
    init(SCALERS["torch"]), "torch", SCALERS["torch"]
  )
  ds = fs.deepspeed_scaler()
  with pytest.raises(ValueError, match="growth_interval: the state implies 3"):
    fs.load_scaler_state_dict(init(ds), torch_sd, ds)
  same_interval = fs.deepspeed_scaler(scale_window=3)
  with pytest.raises(ValueError, match="growth_delay"):
    fs.load_scaler_state_dict(init(same_interval), torch_sd, same_interval)


@pytest.mark.parametrize(
  "sd, match",
  [
    ({"foo": 1}, "not a known scaler state"),
    ({}, "empty"),
    ([1, 2], "must be a dict"),
  ],
)
def test_unknown_source(sd, match):
  scaler = fs.torch_scaler()
  with pytest.raises((ValueError, TypeError), match=match):
    fs.load_scaler_state_dict(init(scaler), sd, scaler)


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.inf, math.nan, 1e-45])
def test_bad_scale(bad):
  scaler = fs.torch_scaler()
  state = init(scaler)
  sd = fs.to_peer_state_dict(state, "torch", scaler)
  with pytest.raises(ValueError, match=r"state_dict\['scale'\] must be"):
    fs.load_scaler_state_dict(state, {**sd, "scale": bad}, scaler)
  with pytest.raises(ValueError, match="scale must be a positive"):
    fs.set_loss_scale(state, bad)
  own = fs.scaler_state_dict(state)
  with pytest.raises(ValueError, match="loss_scale"):
    fs.load_scaler_state_dict(state, {**own, "loss_scale": bad}, scaler)


def test_counters_out_of_range():
  scaler = fs.torch_scaler(growth_interval=3)
  state = init(scaler)
  sd = fs.to_peer_state_dict(state, "torch", scaler)
  with pytest.raises(ValueError, match=r"_growth_tracker'\] must lie"):
    fs.load_scaler_state_dict(state, {**sd, "_growth_tracker": 3}, scaler)
  ds = fs.deepspeed_scaler(delayed_shift=2)
  sd = fs.to_peer_state_dict(init(ds), "deepspeed", ds)
  with pytest.raises(ValueError, match="cur_hysteresis"):
    fs.load_scaler_state_dict(init(ds), {**sd, "cur_hysteresis": 3}, ds)


def test_to_peer_errors():
  ds = SCALERS["deepspeed"]
  state = init(ds)
  with pytest.raises(ValueError, match="peer must be one of"):
    fs.to_peer_state_dict(state, "jax", ds)
  with pytest.raises(ValueError, match="growth_delay=0"):
    fs.to_peer_state_dict(state, "torch", ds)
  meg = SCALERS["megatron"]
  with pytest.raises(ValueError, match="hysteresis=1"):
    fs.to_peer_state_dict(init(meg), "torch", meg)
  with pytest.raises(ValueError, match="growth_delay=1"):
    fs.to_peer_state_dict(init(meg), "deepspeed", meg)
  with pytest.raises(TypeError, match="scaler must be"):
    fs.to_peer_state_dict(state, "torch", None)


@pytest.mark.parametrize("name", sorted(SCALERS))
@pytest.mark.parametrize("cut", [2, 3, 7])
def test_to_peer_and_back_continues_identically(name, cut):
  if name == "megatron":  # Megatron's scale is a torch tensor
    pytest.importorskip("torch")
  scaler = SCALERS[name]
  s_mid, rest = cut_at(name, cut)
  sd = fs.to_peer_state_dict(s_mid, name, scaler)
  back = fs.load_scaler_state_dict(s_mid, sd, scaler)
  # The peers keep no previous scale: it is equal again after one step.
  assert rest(back) == rest(marked(s_mid))


def test_set_loss_scale():
  scaler = SCALERS["deepspeed"]
  tx = make(scaler)
  _, state = run(tx, jnp.zeros(3), tx.init(jnp.zeros(3)), [C, O, C])
  new = fs.set_loss_scale(state, 2.0**20)
  assert float(fs.current_scale(new)) == 2.0**20
  a, b = fs.scaler_state_dict(state), fs.scaler_state_dict(new)
  assert {k: v for k, v in a.items() if k != "loss_scale"} == {
    k: v for k, v in b.items() if k != "loss_scale"
  }
  with pytest.raises(TypeError, match="scale must be a real number"):
    fs.set_loss_scale(state, "1024")


def test_set_loss_scale_inside_jit():
  """D4: set_loss_scale takes a float32 array inside a jitted step (one
  trace for every scale); the counters
  stay as they were, and the step's gradients are then made and unscaled
  at the new scale."""
  scaler = SCALERS["deepspeed"]
  tx = make(scaler)
  params = jnp.zeros(3)
  _, state = run(tx, params, tx.init(params), [C, O, C])
  traces = []

  @jax.jit
  def set_and_step(params, state, scale):
    traces.append(1)
    state = fs.set_loss_scale(state, scale)
    grads = fs.current_scale(state) * jnp.array([1.0, 2.0, 4.0])
    return state, tx.update(grads, state, params)

  before = fs.scaler_state_dict(state)
  for scale in (2.0**20, 2.0**-3):
    set_state, (updates, stepped) = set_and_step(
      params, state, jnp.float32(scale)
    )
    after = fs.scaler_state_dict(set_state)
    assert after.pop("loss_scale") == scale
    assert after == {k: v for k, v in before.items() if k != "loss_scale"}
    assert fs.current_scale(set_state).dtype == jnp.float32
    assert float(fs.scale_metrics(stepped)["prev_loss_scale"]) == scale
    # sgd(0.1) on the true gradient: unscaled by the scale just set.
    np.testing.assert_allclose(updates, [-0.1, -0.2, -0.4], rtol=1e-7)
  assert len(traces) == 1


# ------------------------------------------- DeepSpeed after 0.19.8, stage 0


def test_from_deepspeed_config_stage0_hysteresis():
  config = {
    "fp16": {
      "enabled": True,
      "hysteresis": 2,
      "initial_scale_power": 4,
      "consecutive_hysteresis": True,
    }
  }
  old = fs.from_deepspeed_config(config).scaler
  new = fs.from_deepspeed_config(config, stage0_hysteresis=True).scaler
  assert (old.hysteresis, old.consecutive_hysteresis) == (1, False)
  assert (new.hysteresis, new.consecutive_hysteresis) == (2, True)
  assert not new.raise_at_min_scale  # the fp16 optimizers never raise
  # By hand, from 16: 0.19.8 halves on every overflow; after 0.19.8 the
  # first of two overflows in a row is absorbed, and with consecutive
  # hysteresis a clean step between them refills it.
  flags = [O, C, O, O]
  _, s_old = run(make(old), jnp.zeros(2), init(old), flags)
  _, s_new = run(make(new), jnp.zeros(2), init(new), flags)
  assert float(fs.current_scale(s_old)) == 2.0
  assert float(fs.current_scale(s_new)) == 8.0
  with pytest.raises(TypeError, match="stage0_hysteresis must be a bool"):
    fs.from_deepspeed_config(config, stage0_hysteresis=1)
  # A checkpoint of the newer optimizer carries cur_hysteresis; a 0.19.8
  # one does not and loads with hysteresis full, as DeepSpeed loads it.
  sd = fs.to_peer_state_dict(s_new, "deepspeed", new)
  assert sd["cur_hysteresis"] == 1
  back = fs.load_scaler_state_dict(init(new), sd, new)
  assert fs.scaler_state_dict(back)["hysteresis_left"] == 0
  del sd["cur_hysteresis"]
  back = fs.load_scaler_state_dict(init(new), sd, new)
  assert fs.scaler_state_dict(back)["hysteresis_left"] == 1


def _other(value):
  """A valid value of a Scaler field that differs from ``value``."""
  if value is None:
    return 3.0
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 1
  return value / 2 if value > 1 else value * 2


@pytest.mark.parametrize(
  "field",
  [f.name for f in dataclasses.fields(fs.Scaler) if f.name != "init_scale"],
)
def test_every_scaler_field_is_checked_on_load(field):
  """Derived from the dataclass: a field added to Scaler is covered here."""
  saved_with = fs.headroom_scaler(headroom_bits=4)
  d = json.loads(json.dumps(fs.scaler_state_dict(init(saved_with), saved_with)))
  other = dataclasses.replace(
    saved_with, **{field: _other(getattr(saved_with, field))}
  )
  with pytest.raises(ValueError, match=f"on {field}: the state implies"):
    fs.load_scaler_state_dict(init(other), d, other)
  # The scaler it was saved with loads it.
  fs.load_scaler_state_dict(init(saved_with), d, saved_with)


def test_headroom_bits_differing_is_refused():
  four = fs.headroom_scaler(headroom_bits=4)
  ten = fs.headroom_scaler(headroom_bits=10)
  d = fs.scaler_state_dict(init(four), four)
  with pytest.raises(ValueError, match="headroom_bits.*implies 4.0.*has 10.0"):
    fs.load_scaler_state_dict(init(ten), d, ten)


def _tree(n):
  return {f"p{i}": jnp.zeros(2) for i in range(n)}


@pytest.mark.parametrize("saved, target", [(1, 2), (3, 2)])
@pytest.mark.parametrize("grad_range", [False, True])
def test_per_leaf_fields_for_another_model_are_refused(
  saved, target, grad_range
):
  scaler = fs.torch_scaler()
  tx = fs.chain(fs.fp16_loss_scale(scaler, grad_range=grad_range))
  d = fs.scaler_state_dict(tx.init(_tree(saved)), scaler)
  with pytest.raises(
    ValueError,
    match=rf"state_dict\['leaf_nonfinite'\] holds {saved} gradient leaves, "
    rf"the optimizer state {target}",
  ):
    fs.load_scaler_state_dict(tx.init(_tree(target)), d, scaler)
  # Without the per-leaf fields, as the message says, the scale loads.
  for field in (
    "leaf_nonfinite",
    "leaf_nonfinite_steps",
    "grad_max_abs",
    "grad_zero_fraction",
  ):
    d.pop(field, None)
  d["loss_scale"] = 1024.0
  state = fs.load_scaler_state_dict(tx.init(_tree(target)), d, scaler)
  assert float(fs.current_scale(state)) == 1024.0
  report = fs.overflow_report(state)
  assert report.counts == {} and report.nonfinite_leaves == ()
