"""``from_deepspeed_config``: the scaler and clip a DeepSpeed config asks for.

Reads a DeepSpeed JSON config the way DeepSpeed 0.19 does
(``runtime/precision_config.py``, ``runtime/config.py``,
``runtime/engine.py``):

* ``fp16.enabled`` false: no loss scaling (bf16 or fp32 training);
* ``fp16.loss_scale`` > 0: that static scale; 0 (default): dynamic, starting at
  ``2 ** initial_scale_power`` (16), growing every ``loss_scale_window``
  (1000) clean steps, floored at ``min_loss_scale`` (1);
* the same config gives different dynamics by engine path. Without ZeRO the
  fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) read only the
  initial scale, window and floor: ``hysteresis`` and
  ``consecutive_hysteresis`` have no effect and nothing raises at the floor.
  Under ZeRO stages 1-3, ``DynamicLossScaler`` uses ``hysteresis`` (default 2)
  as ``delayed_shift``, honours ``consecutive_hysteresis`` and raises when an
  overflow hits ``min_loss_scale``. The path is read from
  ``zero_optimization.stage``. DeepSpeed's main branch after 0.19.8 makes the
  fp16 optimizers honour ``hysteresis`` and ``consecutive_hysteresis`` too
  (still without raising at the floor); ``stage0_hysteresis=True`` follows it;
* ``gradient_clipping`` (default 1.0 in DeepSpeed 0.19; 0 or less disables it)
  is the fp16 optimizers' ``clip_grad``.
"""

import json
import math
import os
from typing import Any, Mapping, NamedTuple, Optional, Union

import optax

from fp16_scaling import _validate
from fp16_scaling._clipping import clip_by_unscaled_norm
from fp16_scaling._loss_scale import fp16_loss_scale
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import deepspeed_scaler
from fp16_scaling._scaler import no_scaler
from fp16_scaling._scaler import static_scaler
from fp16_scaling._skip import skip_on_overflow

_FP16_KEYS = {
  "enabled",
  "auto_cast",
  "loss_scale",
  "initial_scale_power",
  "loss_scale_window",
  "hysteresis",
  "consecutive_hysteresis",
  "min_loss_scale",
  "fp16_master_weights_and_grads",
}


class DeepSpeedFP16(NamedTuple):
  """What a DeepSpeed config asks for.

  Attributes:
    scaler: the :class:`Scaler` DeepSpeed's engine would run.
    max_norm: ``gradient_clipping``, or None when it is 0 (off).
    zero_stage: the ZeRO stage read from the config (selects the path).
  """

  scaler: Scaler
  max_norm: Optional[float]
  zero_stage: int

  def optimizer(
    self,
    inner: optax.GradientTransformation,
    *,
    expert_mask=None,
    partition_specs=None,
  ) -> optax.GradientTransformationExtraArgs:
    """``skip_on_overflow(chain(fp16_loss_scale, [clip], inner))``."""
    parts = [fp16_loss_scale(self.scaler, partition_specs=partition_specs)]
    if self.max_norm is not None:
      parts.append(
        clip_by_unscaled_norm(
          self.max_norm,
          expert_mask=expert_mask,
          partition_specs=partition_specs,
        )
      )
    parts.append(inner)
    return skip_on_overflow(optax.chain(*parts))


def _number(field: str, value) -> float:
  if isinstance(value, bool):
    raise ValueError(f"{field} must be a number, not bool")
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{field} must be a number, got {value!r}") from None
  if not math.isfinite(v):
    raise ValueError(f"{field} must be a finite number (not inf/-inf/nan)")
  return v


def _integer(field: str, value) -> int:
  v = _number(field, value)
  if v != int(v):
    raise ValueError(f"{field} must be an integer, got {value!r}")
  return int(v)


def _flag(field: str, value) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"{field} must be a bool, got {value!r}")
  return value


def from_deepspeed_config(
  config: Union[Mapping[str, Any], str, os.PathLike],
  *,
  stage0_hysteresis: bool = False,
) -> DeepSpeedFP16:
  """Builds the loss scaler and clip that a DeepSpeed config describes.

  Args:
    config: a DeepSpeed config dict, or the path of its JSON file.
    stage0_hysteresis: without ZeRO (stage 0), honour ``fp16.hysteresis``
      and ``fp16.consecutive_hysteresis`` as DeepSpeed's fp16 optimizers do
      after 0.19.8 (their ``state_dict`` then holds ``cur_hysteresis``). The
      default, False, is 0.19.8's behaviour: no hysteresis at stage 0.

  Returns:
    A :class:`DeepSpeedFP16`; ``.optimizer(optax.adamw(...))`` builds the
    guarded chain.

  Raises:
    ValueError: for values DeepSpeed rejects (with DeepSpeed's field names),
      and for values it accepts but that cannot be a float32 loss scale.
  """
  stage0_hysteresis = _validate.flag("stage0_hysteresis", stage0_hysteresis)
  if not isinstance(config, Mapping):
    with open(config) as f:
      config = json.load(f)
  fp16 = config.get("fp16", {})
  if not isinstance(fp16, Mapping):
    raise ValueError(f"fp16 must be a JSON object, got {fp16!r}")
  unknown = set(fp16) - _FP16_KEYS
  if unknown:
    raise ValueError(
      f"fp16: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FP16_KEYS)}"
    )

  stage = _integer(
    "zero_optimization.stage",
    config.get("zero_optimization", {}).get("stage", 0),
  )
  if not 0 <= stage <= 3:
    raise ValueError(
      f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}"
    )
  # The fp16 optimizers clip only when clip_grad > 0.
  clipping = _number("gradient_clipping", config.get("gradient_clipping", 1.0))
  max_norm = (
    _validate.positive("gradient_clipping", clipping) if clipping > 0 else None
  )

  if not _flag("fp16.enabled", fp16.get("enabled", False)):
    return DeepSpeedFP16(no_scaler(), max_norm, stage)

  loss_scale = _number("fp16.loss_scale", fp16.get("loss_scale", 0))
  if loss_scale < 0:
    raise ValueError(
      "fp16.loss_scale must be >= 0 (0 enables dynamic loss scaling)"
    )
  if loss_scale > 0:
    return DeepSpeedFP16(static_scaler(loss_scale), max_norm, stage)

  power = _integer(
    "fp16.initial_scale_power", fp16.get("initial_scale_power", 16)
  )
  if not -126 <= power <= 127:
    raise ValueError(
      "fp16.initial_scale_power must be in [-126, 127] so that "
      f"2**power is a normal float32, got {power}"
    )
  window = _integer(
    "fp16.loss_scale_window", fp16.get("loss_scale_window", 1000)
  )
  if window <= 0:
    raise ValueError(
      "fp16.loss_scale_window must be > 0 when dynamic loss "
      "scaling is enabled (loss_scale=0)"
    )
  min_scale = _integer("fp16.min_loss_scale", fp16.get("min_loss_scale", 1))
  if min_scale <= 0:
    raise ValueError(
      "fp16.min_loss_scale must be > 0 when dynamic loss "
      "scaling is enabled (loss_scale=0)"
    )
  hysteresis = _integer("fp16.hysteresis", fp16.get("hysteresis", 2))
  consecutive = _flag(
    "fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis", False)
  )
  if stage == 0 and not stage0_hysteresis:
    # FP16_Optimizer / FP16_UnfusedOptimizer: no hysteresis, never raise.
    hysteresis, consecutive, raise_at_min = 1, False, False
  elif stage == 0:
    # The same optimizers after 0.19.8: hysteresis, still never raise.
    if hysteresis < 1:
      raise ValueError(f"fp16.hysteresis must be >= 1, got {hysteresis}")
    raise_at_min = False
  else:
    if hysteresis < 1:
      raise ValueError(f"fp16.hysteresis must be >= 1, got {hysteresis}")
    raise_at_min = True
  try:
    scaler = deepspeed_scaler(
      init_scale=2.0**power,
      scale_window=window,
      min_scale=float(min_scale),
      delayed_shift=hysteresis,
      consecutive_hysteresis=consecutive,
      raise_error_at_min_scale=raise_at_min,
    )
  except ValueError as e:
    raise ValueError(
      f"fp16: {e} (min_scale is fp16.min_loss_scale, "
      "init_scale is 2**fp16.initial_scale_power)"
    ) from None
  return DeepSpeedFP16(scaler, max_norm, stage)
