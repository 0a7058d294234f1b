"""The peer records of fp16_scaling/interop/_peers.py, tested directly.

Each record's ``from_own`` and ``to_own`` are inverses on every counter value
its scaler can hold; the DeepSpeed and Megatron mappings are checked against
values derived by hand; recognition picks the right record for each peer's
dict. The peers' own code is run against these in tests/peers/.
"""

import jax.numpy as jnp
import pytest

import fp16_scaling as fs
from fp16_scaling.interop import _peers

SCALERS = {
  "torch": fs.torch_scaler(init_scale=2.0**10, growth_interval=4),
  "megatron": fs.megatron_scaler(
    initial_scale=2.0**10, growth_interval=4, hysteresis=3
  ),
  "deepspeed": fs.deepspeed_scaler(
    init_scale=2.0**10, scale_window=4, delayed_shift=3
  ),
  "deepspeed_static": fs.static_scaler(8.0),
}
EXPORTED = {
  "torch": ("torch", _peers.TORCH),
  "megatron": ("megatron", _peers.MEGATRON),
  "deepspeed": ("deepspeed", _peers.DS_OPTIMIZER),
  "deepspeed_static": ("deepspeed", _peers.DS_STATIC),
}


def ds_dict(**fields):
  """DeepSpeed's fp16 optimizer's loss-scaler entries, ``fields`` added."""
  return dict(dynamic_loss_scale=True, scale_factor=2.0, **fields)


def counters(scaler):
  """Every (scale, tracker, hysteresis left) ``scaler`` can hold, for three
  scales."""
  if not scaler.dynamic:
    return [_peers.Counters(s, 0, 0) for s in (0.5, 8.0, 2.0**20)]
  return [
    _peers.Counters(s, t, h)
    for s in (0.5, 1.0, 2.0**20)
    for t in range(-scaler.growth_delay, scaler.growth_interval)
    for h in range(scaler.hysteresis)
  ]


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_from_own_and_to_own_are_inverses(name):
  if name == "megatron":  # Megatron's scale is a torch tensor
    pytest.importorskip("torch")
  scaler = SCALERS[name]
  export, peer = EXPORTED[name]
  assert _peers.exported(export, scaler) is peer
  for c in counters(scaler):
    d = peer.save(c, scaler)
    assert peer.load(d, scaler) == c
    # The dict is recognised as a record that reads it back the same.
    assert _peers.recognise(d).load(d, scaler) == c


# DeepSpeed counts k = cur_iter - last_overflow_iter - 1 clean steps and grows
# when k is a positive multiple of the window: with window 3, the tracker
# here is -1 for k = 0 and (k - 1) % 3 otherwise. Back in DeepSpeed the
# iteration counter restarts (last_overflow_iter -1): cur_iter is the tracker
# plus 1, the same k modulo the window.
@pytest.mark.parametrize(
  "cur_iter, last_overflow_iter, tracker, restarted",
  [
    (0, -1, -1, 0),  # a fresh scaler
    (7, 6, -1, 0),  # overflow on the last step
    (8, 6, 0, 1),
    (9, 6, 1, 2),
    (10, 6, 2, 3),  # k = 3: grows on the next clean step
    (11, 6, 0, 1),  # k = 4: grew, counting again
    (104, 100, 2, 3),
  ],
)
def test_deepspeed_iterations_by_hand(
  cur_iter, last_overflow_iter, tracker, restarted
):
  scaler = fs.deepspeed_scaler(scale_window=3, delayed_shift=2)
  d = ds_dict(
    cur_scale=4.0,
    cur_iter=cur_iter,
    last_overflow_iter=last_overflow_iter,
    scale_window=3,
    cur_hysteresis=1,
  )
  assert _peers.DS_OPTIMIZER.load(d, scaler) == (4.0, tracker, 0)
  back = _peers.DS_OPTIMIZER.save(_peers.Counters(4.0, tracker, 0), scaler)
  assert (back["cur_iter"], back["last_overflow_iter"]) == (restarted, -1)
  assert back["cur_hysteresis"] == 1


def test_deepspeed_without_cur_hysteresis_loads_it_full():
  scaler = fs.deepspeed_scaler(scale_window=3, delayed_shift=3)
  d = ds_dict(cur_scale=4.0, cur_iter=2, last_overflow_iter=-1, scale_window=3)
  assert _peers.DS_OPTIMIZER.load(d, scaler).hysteresis_left == 2


# Megatron's hysteresis_tracker is hysteresis_left + 1 while it absorbs
# overflows, and goes on falling below 1 while it backs off.
@pytest.mark.parametrize(
  "tracker, left", [(3, 2), (2, 1), (1, 0), (0, 0), (-3, 0)]
)
def test_megatron_hysteresis_by_hand(tracker, left):
  scaler = fs.megatron_scaler(growth_interval=4, hysteresis=3)
  d = {"scale": 8.0, "growth_tracker": 1, "hysteresis_tracker": tracker}
  assert _peers.MEGATRON.load(d, scaler) == (8.0, 1, left)


def test_recognition():
  fresh = _peers.Counters(2.0, 0, 0)
  ds = ds_dict(cur_scale=4.0, cur_iter=0, last_overflow_iter=-1, scale_window=3)
  zero = dict(
    ds,
    min_scale=1.0,
    delayed_shift=2,
    cur_hysteresis=2,
    consecutive_hysteresis=False,
  )
  cases = [
    (_peers.TORCH, _peers.TORCH.from_own(fresh, fs.torch_scaler())),
    (_peers.MEGATRON, dict(scale=2.0, growth_tracker=0, hysteresis_tracker=1)),
    (_peers.DS_OPTIMIZER, ds),
    (_peers.DS_LOSS_SCALER, zero),
    (_peers.DS_STATIC, {**ds, "dynamic_loss_scale": False}),
    (_peers.DS_STATIC, {"cur_scale": 8.0, "dynamic": False}),
    (None, {"cur_scale": 8.0, "dynamic": True}),
    (None, {"scale": 2.0}),
  ]
  for peer, d in cases:
    assert _peers.recognise(d) is peer, d
  assert len({p.name for p in _peers.PEERS}) == len(_peers.PEERS)


def test_deepspeed_static_through_the_public_functions():
  scaler = fs.static_scaler(8.0)
  tx = fs.chain(fs.fp16_loss_scale(scaler))
  state = tx.init(jnp.zeros(2))
  sd = fs.to_peer_state_dict(state, "deepspeed", scaler)
  assert sd == {"dynamic_loss_scale": False, "cur_scale": 8.0, "cur_iter": 0}
  loss_scaler = {"cur_scale": 32.0, "dynamic": False}
  back = fs.load_scaler_state_dict(state, {"loss_scaler": loss_scaler}, scaler)
  assert float(fs.current_scale(back)) == 32.0
  assert fs.scaler_from_state_dict(sd) == scaler
  dynamic = fs.deepspeed_scaler()
  with pytest.raises(ValueError, match="on dynamic.*static_scaler"):
    state = fs.chain(fs.fp16_loss_scale(dynamic)).init(jnp.zeros(2))
    fs.load_scaler_state_dict(state, sd, dynamic)


def test_unknown_state_names_every_peer():
  scaler = fs.torch_scaler()
  state = fs.chain(fs.fp16_loss_scale(scaler)).init(jnp.zeros(2))
  with pytest.raises(ValueError, match="not a known scaler state") as e:
    fs.load_scaler_state_dict(state, {"foo": 1}, scaler)
  for peer in _peers.PEERS:
    assert peer.saved_by in str(e.value)
