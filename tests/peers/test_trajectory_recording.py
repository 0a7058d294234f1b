"""The peers' loss-scale trajectories, recorded for the tests that run where
PyTorch does not (a GPU machine, the newest JAX).

``tests/data/peer_trajectories.npz`` holds, for DeepSpeed's
``DynamicLossScaler``, ``torch.amp``'s update op and Megatron's
``DynamicGradScaler``: random configurations, random overflow sequences, and
the peer's own scale after every step, with only the designed difference
patched in (see test_trajectories.py). ``tests/test_recorded_trajectories.py``
replays them through the presets on any backend. The test here rebuilds the
recording from the live peers and requires it to equal the stored file, so the
file cannot drift from the peers' code. Write it anew with

  DS_ACCELERATOR=cpu TORCHDYNAMO_DISABLE=1 PYTHONPATH=tests:tests/peers \
    python tests/peers/test_trajectory_recording.py
"""

import json
import pathlib

import numpy as np
import test_trajectories as tt

RECORDING = (
  pathlib.Path(__file__).resolve().parents[1] / "data" / "peer_trajectories.npz"
)
SEED = 20251130  # fixed: the recording does not follow FP16_SCALING_PEER_SEED
CONFIGS, SEQUENCES, STEPS = 6, 3, 1500

# name: (configs, peer for the overflow draws, clamped trajectory, preset)
_PRESETS = tt.PEERS


def record() -> dict:
  """The recording's arrays, made by the peers' own code."""
  out = {}
  for k, (name, (configs, peer, clamped, _)) in enumerate(_PRESETS.items()):
    rng = np.random.default_rng([SEED, k])
    cfgs = configs(rng)[:CONFIGS]
    drawn = [
      tt._overflows_and_scales(rng, peer, c, SEQUENCES, STEPS) for c in cfgs
    ]
    flags = np.stack([overflows for overflows, _ in drawn])
    scales = np.array(
      [[clamped(f, c) for f in fc] for fc, c in zip(flags, cfgs)], np.float64
    )
    out[f"{name}/configs"] = np.array(json.dumps(cfgs))
    out[f"{name}/overflows"] = flags
    out[f"{name}/scales"] = scales
    if name == "deepspeed":
      out[f"{name}/raises"] = np.array(
        [
          [tt._deepspeed_raises(f, c) for f in fc] for fc, c in zip(flags, cfgs)
        ],
        np.int32,
      )
  return out


def test_the_recording_is_the_peers_own_code():
  stored = np.load(RECORDING)
  fresh = record()
  assert sorted(stored.files) == sorted(fresh)
  for key, value in fresh.items():
    np.testing.assert_array_equal(stored[key], value, err_msg=key)
  # The recording exercises what the replay must show.
  for name in _PRESETS:
    scales = fresh[f"{name}/scales"]
    steps = np.diff(scales, axis=-1)
    assert (steps > 0).sum() >= 20 and (steps < 0).sum() >= 20, name


if __name__ == "__main__":
  RECORDING.parent.mkdir(exist_ok=True)
  np.savez_compressed(RECORDING, **record())
  print(f"wrote {RECORDING} ({RECORDING.stat().st_size} bytes)")
