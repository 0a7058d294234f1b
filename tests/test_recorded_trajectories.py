"""The presets replay the peers' recorded loss-scale trajectories bit for bit,
on whatever backend runs the tests, with no PyTorch.

``tests/data/peer_trajectories.npz`` was recorded from DeepSpeed's
``DynamicLossScaler``, ``torch.amp``'s update op and Megatron's
``DynamicGradScaler`` on CPU (tests/peers/test_trajectory_recording.py
rebuilds it from the live peers and checks the file). Here each preset runs
the recorded overflow sequences through ``Scaler.update`` under a jitted
``lax.scan`` and must give the recorded scale after every step: on a GPU this
is the check that the compiled scale machine there agrees with the peers.
"""

import json
import pathlib

import helpers
import numpy as np
import pytest

import fp16_scaling as fs

_RECORDING = pathlib.Path(__file__).parent / "data" / "peer_trajectories.npz"
_PRESETS = {
  "deepspeed": lambda c: fs.deepspeed_scaler(
    **c, raise_error_at_min_scale=True
  ),
  "torch": lambda c: fs.torch_scaler(**c),
  "megatron": lambda c: fs.megatron_scaler(**c),
}


@pytest.mark.parametrize("name", sorted(_PRESETS))
def test_presets_replay_the_recorded_peer_trajectories(name):
  recording = np.load(_RECORDING)
  configs = json.loads(str(recording[f"{name}/configs"]))
  overflows = recording[f"{name}/overflows"]
  expected = recording[f"{name}/scales"]
  growths = backoffs = 0
  all_scales, all_errors = helpers.replay_scalers(
    [_PRESETS[name](cfg) for cfg in configs], overflows
  )
  for i, cfg in enumerate(configs):
    scales, errors = all_scales[i], all_errors[i]
    np.testing.assert_array_equal(scales, expected[i], err_msg=f"{name} {cfg}")
    if name == "deepspeed":
      np.testing.assert_array_equal(errors, recording[f"{name}/raises"][i])
    growths += int((np.diff(scales, axis=-1) > 0).sum())
    backoffs += int((np.diff(scales, axis=-1) < 0).sum())
  # Not vacuous: the scale both grew and backed off many times.
  assert growths >= 20 and backoffs >= 20, (growths, backoffs)
