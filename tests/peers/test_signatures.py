"""Each preset takes its peer's argument names (keyword-only), and
torch_scaler its peer's defaults, as docs/peers.md says.
(flax_scaler's are checked in tests/test_flax.py.)"""

import oracles
import pytest

import fp16_scaling as fs

torch = oracles.require("torch")
oracles.init_deepspeed()
grad_scaler = oracles.require("megatron.core.optimizer.grad_scaler")
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler  # noqa: E402

_params = oracles.signature_params


@pytest.mark.parametrize(
  "preset,peer,leave_out",
  [
    (fs.deepspeed_scaler, DynamicLossScaler.__init__, ("dtype",)),
    (fs.torch_scaler, torch.amp.GradScaler.__init__, ("device", "enabled")),
    (fs.megatron_scaler, grad_scaler.DynamicGradScaler.__init__, ()),
  ],
  ids=["deepspeed", "torch", "megatron"],
)
def test_preset_takes_the_peer_argument_names(preset, peer, leave_out):
  ours = _params(preset)
  assert set(ours) == set(_params(peer, leave_out))
  assert all(p.kind is p.KEYWORD_ONLY for p in ours.values())


def test_torch_scaler_has_grad_scaler_defaults():
  theirs = _params(torch.amp.GradScaler.__init__, ("device", "enabled"))
  for name, p in _params(fs.torch_scaler).items():
    assert p.default == theirs[name].default, name
