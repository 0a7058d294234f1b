"""fp16_scaling: float16 loss scaling for JAX, as optax transformations.

README.md has the quickstart; docs/design.md, the design. ``fs.keras``
(Keras 3's ``compile`` and ``fit``) imports Keras when first used, not here.
"""

import importlib

from fp16_scaling._accumulate import accumulate_gradients
from fp16_scaling._cast import cast_report
from fp16_scaling._chain import chain
from fp16_scaling._clipping import clip_by_unscaled_norm
from fp16_scaling._compute_dtypes import ComputeDtypes
from fp16_scaling._compute_dtypes import compute_dtypes
from fp16_scaling._diagnostics import MinLossScaleError
from fp16_scaling._diagnostics import OverflowReport
from fp16_scaling._diagnostics import overflow_report
from fp16_scaling._diagnostics import raise_if_min_scale_reached
from fp16_scaling._float32 import float32
from fp16_scaling._grad import value_and_grad
from fp16_scaling._jax_presets import jmp_scaler
from fp16_scaling._jax_presets import keras_scaler
from fp16_scaling._lookup import set_loss_scale
from fp16_scaling._loss_scale import fp16_loss_scale
from fp16_scaling._metrics import ScaleMetrics
from fp16_scaling._metrics import current_scale
from fp16_scaling._metrics import layer_grad_norms
from fp16_scaling._metrics import scale_metrics
from fp16_scaling._overflow_locator.locate import locate_overflow
from fp16_scaling._overflow_locator.location import OverflowLocation
from fp16_scaling._policy import Policy
from fp16_scaling._policy import get_policy
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import ScalerState
from fp16_scaling._scaler import WindowedScalerState
from fp16_scaling._scaler import deepspeed_scaler
from fp16_scaling._scaler import flax_scaler
from fp16_scaling._scaler import headroom_scaler
from fp16_scaling._scaler import megatron_scaler
from fp16_scaling._scaler import no_scaler
from fp16_scaling._scaler import static_scaler
from fp16_scaling._scaler import torch_scaler
from fp16_scaling._select import select_on_overflow
from fp16_scaling._shared import sync_loss_scales
from fp16_scaling._stacked import stacked_under
from fp16_scaling._states import KINDS as OVERFLOW_KINDS
from fp16_scaling._states import AccumulationState
from fp16_scaling._states import ClipState
from fp16_scaling._states import GradRange
from fp16_scaling._states import LossScaleState
from fp16_scaling._states import StackedRange
from fp16_scaling.interop import DeepSpeedFP16
from fp16_scaling.interop import from_deepspeed_config
from fp16_scaling.interop import load_scaler_state_dict
from fp16_scaling.interop import scaler_from_state_dict
from fp16_scaling.interop import scaler_state_dict
from fp16_scaling.interop import to_peer_state_dict

__version__ = "0.1.0"


def __getattr__(name):
  """``fs.keras``, imported on first use: it imports Keras, which
  ``import fp16_scaling`` does not."""
  if name == "keras":
    return importlib.import_module("fp16_scaling.keras")
  raise AttributeError(f"module 'fp16_scaling' has no attribute {name!r}")


__all__ = [
  "AccumulationState",
  "ClipState",
  "ComputeDtypes",
  "DeepSpeedFP16",
  "GradRange",
  "LossScaleState",
  "MinLossScaleError",
  "OVERFLOW_KINDS",
  "OverflowLocation",
  "OverflowReport",
  "Policy",
  "ScaleMetrics",
  "Scaler",
  "ScalerState",
  "StackedRange",
  "WindowedScalerState",
  "accumulate_gradients",
  "cast_report",
  "chain",
  "clip_by_unscaled_norm",
  "compute_dtypes",
  "current_scale",
  "deepspeed_scaler",
  "flax_scaler",
  "float32",
  "load_scaler_state_dict",
  "locate_overflow",
  "fp16_loss_scale",
  "from_deepspeed_config",
  "get_policy",
  "headroom_scaler",
  "jmp_scaler",
  "keras_scaler",
  "layer_grad_norms",
  "megatron_scaler",
  "no_scaler",
  "overflow_report",
  "raise_if_min_scale_reached",
  "scale_metrics",
  "scaler_from_state_dict",
  "scaler_state_dict",
  "select_on_overflow",
  "set_loss_scale",
  "stacked_under",
  "static_scaler",
  "sync_loss_scales",
  "to_peer_state_dict",
  "torch_scaler",
  "value_and_grad",
]
