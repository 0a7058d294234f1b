"""The JAX-side peers' scaler states, one :class:`~._peers.Peer` record each:
jmp's ``DynamicLossScale`` and Keras 3's ``LossScaleOptimizer`` variables.
"""

import math
from typing import Mapping

import numpy as np

from fp16_scaling import _validate
from fp16_scaling._jax_presets import jmp_scaler
from fp16_scaling._jax_presets import keras_scaler
from fp16_scaling._scaler import Scaler
from fp16_scaling.interop._peers import Counters
from fp16_scaling.interop._peers import Peer
from fp16_scaling.interop._peers import implied
from fp16_scaling.interop._peers import read_config
from fp16_scaling.interop._peers import read_scale
from fp16_scaling.interop._peers import read_tracker

# What counting clean steps with no hysteresis needs, as jmp and Keras do.
_COUNTING = (
  ("growth_delay", 0, "it grows after its interval of clean steps"),
  ("hysteresis", 1, "it has no hysteresis"),
  ("headroom_bits", None, "it grows by counting clean steps"),
)


# jmp's DynamicLossScale: its dataclass fields (``vars(loss_scale)``, or
# ``jmp.DynamicLossScale(**d)`` back); counter is the tracker here. A scale
# that went through jit holds min_loss_scale 1.0 whatever was set (jmp#44).


# Its configuration fields a state may hold, a read_config table: (jmp's
# name, the Scaler field it sets, its check, the check's range).
_JMP_CONFIG = (
  ("period", "growth_interval", _validate.integer, {"low": 1}),
  ("min_loss_scale", "min_scale", _validate.scale, {}),
  ("factor", "growth_factor", _validate.positive, {}),
)


def _jmp_implies(d: Mapping) -> dict:
  out = implied(d, _JMP_CONFIG)
  if "growth_factor" in out:
    out["backoff_factor"] = 1.0 / out["growth_factor"]
  return {"growth_delay": 0, "hysteresis": 1, **out}


def _jmp_from_own(c: Counters, scaler: Scaler) -> dict:
  factor = scaler.growth_factor
  if not (math.frexp(factor)[0] == 0.5 and factor >= 2) or (
    scaler.backoff_factor != 1.0 / factor
  ):
    raise ValueError(
      "jmp cannot continue this state: it needs growth_factor a power of two "
      ">= 2 (its factor) and backoff_factor 1 / growth_factor (it divides by "
      f"factor), the scaler has {factor!r} and {scaler.backoff_factor!r}"
    )
  return {
    "loss_scale": np.asarray(c.loss_scale, np.float32),
    "counter": np.asarray(c.growth_tracker, np.int32),
    "period": scaler.growth_interval,
    "factor": int(factor),
    "min_loss_scale": np.asarray(scaler.min_scale, np.float32),
  }


def _jmp_preset(d: Mapping, overrides: dict) -> Scaler:
  kw = {
    "loss_scale": read_scale(d, "loss_scale"),
    **read_config(d, _JMP_CONFIG),
  }
  return jmp_scaler(**{**kw, **overrides})


JMP = Peer(
  name="jmp DynamicLossScale",
  saved_by="jmp's DynamicLossScale (or its fields: loss_scale, counter)",
  keys=frozenset({"loss_scale", "counter"}),
  implies=_jmp_implies,
  to_own=lambda d, scaler: Counters(
    read_scale(d, "loss_scale"), read_tracker(d, "counter", scaler), 0
  ),
  from_own=_jmp_from_own,
  needs=_COUNTING,
  preset=_jmp_preset,
)


# Keras 3's LossScaleOptimizer: the variables dynamic_scale and step_counter
# (``{v.name: v for v in opt.variables}``, or the optimizer itself);
# step_counter is the tracker here. dynamic_growth_steps is configuration,
# not a variable: the optimizer object and get_config() hold it.

# The configuration a state may hold, a read_config table.
_KERAS_CONFIG = (
  ("dynamic_growth_steps", "growth_interval", _validate.integer, {"low": 1}),
)


def _keras_scale(d: Mapping) -> float:
  try:
    return read_scale(d, "dynamic_scale")
  except ValueError as e:
    raise ValueError(
      f"{e}. Keras's scale has no floor and no ceiling: halved below "
      "2**-126 it reaches 0.0, doubled past 2**127 inf, and that run no "
      "longer trains. Start from a scale instead (fs.set_loss_scale)."
    ) from None


def _keras_implies(d: Mapping) -> dict:
  return {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_delay": 0,
    "hysteresis": 1,
    **implied(d, _KERAS_CONFIG),
  }


def _keras_preset(d: Mapping, overrides: dict) -> Scaler:
  kw = {
    "initial_scale": _keras_scale(d),
    **read_config(d, _KERAS_CONFIG),
    **overrides,
  }
  if "dynamic_growth_steps" not in kw:
    raise ValueError(
      "Keras's optimizer variables hold no dynamic_growth_steps: pass the "
      "LossScaleOptimizer itself, or "
      "fs.scaler_from_state_dict(state_dict, dynamic_growth_steps=N)"
    )
  return keras_scaler(**kw)


KERAS = Peer(
  name="Keras LossScaleOptimizer",
  saved_by=(
    "Keras's LossScaleOptimizer (or its variables by name: dynamic_scale, "
    "step_counter)"
  ),
  keys=frozenset({"dynamic_scale", "step_counter"}),
  implies=_keras_implies,
  to_own=lambda d, scaler: Counters(
    _keras_scale(d), read_tracker(d, "step_counter", scaler), 0
  ),
  from_own=lambda c, scaler: {
    "dynamic_scale": c.loss_scale,
    "step_counter": c.growth_tracker,
    "dynamic_growth_steps": scaler.growth_interval,
  },
  needs=(
    *_COUNTING,
    ("growth_factor", 2.0, "Keras doubles its scale"),
    ("backoff_factor", 0.5, "Keras halves its scale"),
  ),
  preset=_keras_preset,
)

PEERS = (JMP, KERAS)

# to_peer_state_dict's names.
EXPORTS = {"jmp": JMP, "keras": KERAS}
