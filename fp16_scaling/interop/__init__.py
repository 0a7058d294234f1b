"""The interop wing: other libraries' formats, read and written.

The scaler's state as plain values and as the PyTorch peers save it
(``_state_dict``, with one record per peer in ``_peers``), and the scaler and
clip a DeepSpeed JSON config asks for (``_deepspeed_config``). These modules
import the core (``fp16_scaling/_*.py``); no core module imports them. Every
name here is also exported by ``fp16_scaling`` itself.
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
