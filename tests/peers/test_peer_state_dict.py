"""Scaler states carried between each peer's own code and fp16_scaling.

Differential: a peer runs N steps over a random overflow sequence, saves its
state_dict, fp16_scaling loads it, and both continue M steps on the same
sequence: after every step the scales are equal and the counters agree (in
the peer's own units). The reverse direction starts from fp16_scaling's state
and loads ``to_peer_state_dict`` into a fresh peer.
"""

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import oracles_state as peers
import pytest

import fp16_scaling as fs

N, M, RATE = 20, 40, 0.3
W = 3  # growth interval: several growths in M steps

_FACTORS = dict(init_scale=2.0**10, growth_factor=1.5, backoff_factor=0.25)
_MEGATRON = dict(initial_scale=2.0**10, min_scale=4.0, hysteresis=2)
CASES = {
  "torch": (
    "torch",
    lambda: peers.TorchGradScaler(
      init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, interval=W
    ),
    fs.torch_scaler(init_scale=2.0**10, growth_interval=W),
  ),
  "torch_factors": (
    "torch",
    lambda: peers.TorchGradScaler(**_FACTORS, interval=2),
    fs.torch_scaler(**_FACTORS, growth_interval=2),
  ),
  "megatron": (
    "megatron",
    lambda: peers.MegatronGradScaler(
      **_MEGATRON, growth_interval=W, growth_factor=2.0, backoff_factor=0.5
    ),
    fs.megatron_scaler(**_MEGATRON, growth_interval=W),
  ),
}
# DeepSpeed's ZeRO loss scaler, with and without consecutive hysteresis.
_ZERO = dict(
  init_scale=2.0**10,
  scale_window=W,
  min_scale=4.0,
  delayed_shift=2,
  raise_error_at_min_scale=False,
)
for _consecutive in (False, True):
  CASES["deepspeed_zero" + "_consecutive" * _consecutive] = (
    "deepspeed",
    lambda c=_consecutive: peers.DeepSpeedLossScaler(
      **_ZERO, consecutive_hysteresis=c
    ),
    fs.deepspeed_scaler(**_ZERO, consecutive_hysteresis=_consecutive),
  )
# What from_deepspeed_config builds for stage 0 (0.19.8).
_STAGE0 = {
  "enabled": True,
  "initial_scale_power": 10,
  "loss_scale_window": W,
  "min_loss_scale": 4,
}
for _fused in (True, False):
  CASES["deepspeed_" + ("fused" if _fused else "unfused")] = (
    "deepspeed",
    lambda fused=_fused: peers.DeepSpeedFP16Optimizer(
      fused=fused, init_scale=2.0**10, scale_window=W, min_scale=4.0
    ),
    fs.from_deepspeed_config({"fp16": _STAGE0}).scaler,
  )

_TX = {}


def ours(scaler):
  """The guarded chain for ``scaler`` and its jitted step (built once)."""
  if scaler not in _TX:
    tx = guarded(scaler, optax.sgd(0.1))

    @jax.jit
    def step(state, overflow):
      grads = jnp.where(overflow, jnp.inf, 1.0) * jnp.ones(2)
      _, state = tx.update(grads, state, jnp.zeros(2))
      return state

    _TX[scaler] = tx, step
  return _TX[scaler]


def counters(peer, sd, window):
  """The peer's counters in its own units, made comparable where a peer has
  several states that act the same."""
  if peer == "torch":
    return sd["scale"], sd["_growth_tracker"]
  if peer == "megatron":
    # Every hysteresis_tracker <= 1 backs off on the next overflow.
    scale = float(np.asarray(sd["scale"]).reshape(()))
    return scale, sd["growth_tracker"], max(sd["hysteresis_tracker"], 1)
  d = sd.get("loss_scaler", sd)
  d = d if isinstance(d, dict) else dict(vars(d))
  k = d["cur_iter"] - d["last_overflow_iter"] - 1  # clean steps since
  # DeepSpeed grows when k is a positive multiple of the window.
  phase = None if k == 0 else (k - 1) % window
  return d["cur_scale"], phase, d.get("cur_hysteresis")


def overflow_flags(seed, name, direction, cut):
  """N + M random flags; the cut falls right after an overflow or after a
  run of clean steps (so a counter mapped one step off would show)."""
  rng = np.random.default_rng([seed, sorted(CASES).index(name), direction])
  flags = rng.random(N + M) < RATE
  if cut == "after_overflow":
    flags[N - 1] = True
  else:
    flags[N - 1 - rng.integers(2 * W) : N] = False
  return flags


def check_together(name, peer, state, flags):
  kind, _, scaler = CASES[name]
  _, step = ours(scaler)
  scales = [peer.scale]
  for f in flags:
    peer.step(bool(f))
    state = step(state, jnp.bool_(f))
    assert float(fs.current_scale(state)) == peer.scale
    mine = counters(
      kind, fs.to_peer_state_dict(state, kind, scaler), scaler.growth_interval
    )
    theirs = counters(kind, peer.state_dict(), scaler.growth_interval)
    if mine[-1] is not None and theirs[-1] is None:
      mine = mine[:-1] + (None,)  # 0.19.8's FP16_Optimizer has no hysteresis
    assert mine == theirs
    scales.append(peer.scale)
  # The continuation grew and backed off at least once.
  steps = np.diff(scales)
  assert (steps > 0).any() and (steps < 0).any(), scales


CUTS = ["after_overflow", "after_clean_run"]


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_peer_to_fp16_scaling(name, cut, seed):
  kind, make_peer, scaler = CASES[name]
  flags = overflow_flags(seed, name, 1, cut)
  peer = make_peer()
  for f in flags[:N]:
    peer.step(bool(f))
  tx, _ = ours(scaler)
  start = tx.init(jnp.zeros(2))
  state = fs.load_scaler_state_dict(start, peer.state_dict(), scaler)
  assert float(fs.current_scale(state)) == peer.scale
  check_together(name, peer, state, flags[N:])


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fp16_scaling_to_peer(name, cut, seed):
  kind, make_peer, scaler = CASES[name]
  flags = overflow_flags(seed, name, 2, cut)
  tx, step = ours(scaler)
  state = tx.init(jnp.zeros(2))
  for f in flags[:N]:
    state = step(state, jnp.bool_(f))
  peer = make_peer()
  peer.load_state_dict(fs.to_peer_state_dict(state, kind, scaler))
  assert float(fs.current_scale(state)) == peer.scale
  check_together(name, peer, state, flags[N:])


def test_deepspeed_after_0198_stage0_checkpoint(seed):
  """DeepSpeed after 0.19.8: FP16_Optimizer keeps cur_hysteresis as
  DynamicLossScaler does and saves it in its state_dict. The installed
  0.19.8 cannot run that optimizer, so DynamicLossScaler is the oracle and
  its attributes are written in the optimizer's state_dict format."""
  config = {"fp16": dict(_STAGE0, hysteresis=2)}
  scaler = fs.from_deepspeed_config(config, stage0_hysteresis=True).scaler
  peer = peers.DeepSpeedLossScaler(**_ZERO, consecutive_hysteresis=False)
  flags = np.random.default_rng([seed, 3]).random(N + M) < RATE
  flags[N - 2 : N] = [True, False]  # hysteresis spent or refilled at the cut
  for f in flags[:N]:
    peer.step(bool(f))
  keys = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor")
  sd = {k: getattr(peer.scaler, k) for k in keys}
  sd.update(
    dynamic_loss_scale=True,
    scale_window=peer.scaler.scale_window,
    cur_hysteresis=peer.scaler.cur_hysteresis,
  )
  tx, step = ours(scaler)
  state = fs.load_scaler_state_dict(tx.init(jnp.zeros(2)), sd, scaler)
  for f in flags[N:]:
    peer.step(bool(f))
    state = step(state, jnp.bool_(f))
    assert float(fs.current_scale(state)) == peer.scale
    left = fs.scaler_state_dict(state)["hysteresis_left"]
    assert left == peer.scaler.cur_hysteresis - 1
