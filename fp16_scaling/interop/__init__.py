"""The interop wing: the peers' scaler states and DeepSpeed's config. No core
module imports it; ``fp16_scaling`` exports every name here too.
"""

from fp16_scaling.interop._deepspeed_config import DeepSpeedFP16
from fp16_scaling.interop._deepspeed_config import from_deepspeed_config
from fp16_scaling.interop._state_dict import load_scaler_state_dict
from fp16_scaling.interop._state_dict import scaler_from_state_dict
from fp16_scaling.interop._state_dict import scaler_state_dict
from fp16_scaling.interop._state_dict import to_peer_state_dict

__all__ = [
  "DeepSpeedFP16",
  "from_deepspeed_config",
  "load_scaler_state_dict",
  "scaler_from_state_dict",
  "scaler_state_dict",
  "to_peer_state_dict",
]
