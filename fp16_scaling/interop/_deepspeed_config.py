"""``from_deepspeed_config``: the scaler and clip a DeepSpeed config asks
for, read as DeepSpeed 0.19 does (docs/peers.md, "DeepSpeed's JSON config").
"""

import json
import os
from typing import Any, Mapping, NamedTuple, Optional, Union
import warnings

import optax

from fp16_scaling import _validate
from fp16_scaling._accumulate import accumulate_gradients
from fp16_scaling._chain import chain
from fp16_scaling._clipping import clip_by_unscaled_norm
from fp16_scaling._loss_scale import fp16_loss_scale
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import deepspeed_scaler
from fp16_scaling._scaler import no_scaler
from fp16_scaling._scaler import static_scaler

_FP16_KEYS = set(
  (
    "enabled auto_cast loss_scale initial_scale_power loss_scale_window "
    "hysteresis consecutive_hysteresis min_loss_scale "
    "fp16_master_weights_and_grads"
  ).split()
)


class DeepSpeedFP16(NamedTuple):
  """What a DeepSpeed config asks for.

  Attributes:
    scaler: the :class:`Scaler` DeepSpeed's engine would run.
    max_norm: ``gradient_clipping``, or None when it is 0 (off).
    zero_stage: the ZeRO stage read from the config (selects the path).
    gradient_accumulation_steps: microbatches per optimizer step.
  """

  scaler: Scaler
  max_norm: Optional[float]
  zero_stage: int
  gradient_accumulation_steps: int = 1

  def optimizer(
    self,
    inner: optax.GradientTransformation,
    *,
    expert_mask=None,
    partition_specs=None,
    stacked_axes=None,
  ) -> optax.GradientTransformationExtraArgs:
    """``fs.chain(fp16_loss_scale, [clip], inner)``, inside
    ``accumulate_gradients(..., gradient_accumulation_steps)`` when that is
    above 1.

    Args:
      inner: the optimizer (any optax transformation).
      expert_mask: the clip's, as for :func:`clip_by_unscaled_norm`.
      partition_specs: ``fp16_loss_scale``'s, as for it.
      stacked_axes: ``fp16_loss_scale``'s, as for it.

    Returns:
      The step, an ``optax.GradientTransformationExtraArgs``.
    """
    parts = [
      fp16_loss_scale(
        self.scaler, partition_specs=partition_specs, stacked_axes=stacked_axes
      )
    ]
    if self.max_norm is not None:
      parts.append(
        clip_by_unscaled_norm(self.max_norm, expert_mask=expert_mask)
      )
    tx = chain(*parts, inner)
    if self.gradient_accumulation_steps > 1:
      tx = accumulate_gradients(tx, self.gradient_accumulation_steps)
    return tx


_BATCH_FIELDS = (
  "train_batch_size",
  "train_micro_batch_size_per_gpu",
  "gradient_accumulation_steps",
)
# Read here; everything else at the top level is named in a warning.
_MODELLED = {
  *"fp16 bf16 bfloat16 zero_optimization gradient_clipping".split(),
  *_BATCH_FIELDS,
}


def _refuse_auto(config, path=()) -> list:
  """The dotted paths of every ``"auto"`` value in ``config``."""
  found = []
  for key, value in config.items():
    here = path + (str(key),)
    if isinstance(value, Mapping):
      found += _refuse_auto(value, here)
    elif isinstance(value, str) and value == "auto":
      found.append(".".join(here))
  return found


def _warn_unmodelled(config) -> None:
  """One warning naming the fields not read here."""
  unmodelled = sorted(set(map(str, config)) - _MODELLED)
  zero = config.get("zero_optimization", {})
  if isinstance(zero, Mapping):
    unmodelled += sorted(
      f"zero_optimization.{k}" for k in map(str, zero) if k != "stage"
    )
  if unmodelled:
    warnings.warn(
      "from_deepspeed_config models the loss scaling, gradient clipping and "
      "gradient accumulation only; these fields are not read and have no "
      f"effect here: {', '.join(unmodelled)}. Build the matching optax "
      "optimizer and schedule yourself and pass it to .optimizer(...).",
      stacklevel=3,
    )


def _accumulation_steps(config, world_size: int) -> int:
  """``gradient_accumulation_steps`` as DeepSpeed 0.19's ``DeepSpeedConfig``
  derives and checks it (taken as it is without batch sizes)."""
  train, micro, steps = (
    None if config.get(f) is None else _validate.integer(f, config[f])
    for f in _BATCH_FIELDS
  )
  if train is None and micro is None:
    steps = 1 if steps is None else steps
  elif train is not None and micro is not None and steps is None:
    steps = train // micro // world_size
  elif train is not None and steps is not None and micro is None:
    micro = train // world_size // max(steps, 1)
  elif micro is not None and steps is not None and train is None:
    train = micro * steps * world_size
  elif train is not None and micro is None:
    steps, micro = 1, train // world_size
  elif micro is not None and train is None:
    steps, train = 1, micro * world_size
  for field, value in zip(_BATCH_FIELDS, (train, micro, steps)):
    if value is not None:
      _validate.integer(field, value, low=1)
  if train is not None and train != micro * steps * world_size:
    raise ValueError(
      "train_batch_size must equal train_micro_batch_size_per_gpu * "
      f"gradient_accumulation_steps * world_size: {train} != {micro} * "
      f"{steps} * {world_size}"
    )
  return steps


def from_deepspeed_config(
  config: Union[Mapping[str, Any], str, os.PathLike],
  *,
  world_size: int = 1,
  stage0_hysteresis: bool = False,
) -> DeepSpeedFP16:
  """Builds the loss scaler and clip that a DeepSpeed config describes.

  Args:
    config: a DeepSpeed config dict, or the path of its JSON file.
    world_size: the data-parallel world size DeepSpeed would check the batch
      sizes against.
    stage0_hysteresis: without ZeRO, honour ``fp16.hysteresis`` as the fp16
      optimizers do after DeepSpeed 0.19.8 (False: as 0.19.8 does).

  Returns:
    A :class:`DeepSpeedFP16`; ``.optimizer(optax.adamw(...))`` builds the
    guarded chain (accumulating when ``gradient_accumulation_steps`` > 1).

  Raises:
    ValueError: for values DeepSpeed rejects, that cannot be a float32 loss
      scale, or that are ``"auto"``.

  Warns:
    UserWarning: once, naming the fields that are not modelled.

  Examples:
    >>> import optax, fp16_scaling as fs
    >>> ds = fs.from_deepspeed_config({
    ...     "fp16": {"enabled": True, "initial_scale_power": 12},
    ...     "gradient_clipping": 1.0,
    ...     "zero_optimization": {"stage": 2},
    ... })
    >>> print(ds.scaler.init_scale, ds.scaler.hysteresis, ds.max_norm)
    4096.0 2 1.0
    >>> tx = ds.optimizer(optax.adamw(1e-3))

  References:
    DeepSpeed 0.19, ``deepspeed/runtime/{precision_config,config,engine}.py``.
  """
  world_size = _validate.count("world_size", world_size)
  stage0_hysteresis = _validate.flag("stage0_hysteresis", stage0_hysteresis)
  config = _read(config)
  _warn_unmodelled(config)
  accumulation = _accumulation_steps(config, world_size)
  fp16 = _fp16_section(config)
  stage = _zero_stage(config)
  # The fp16 optimizers clip only when clip_grad > 0.
  clipping = _validate.number(
    "gradient_clipping", config.get("gradient_clipping", 1.0)
  )
  max_norm = (
    _validate.positive("gradient_clipping", clipping) if clipping > 0 else None
  )
  if not _validate.boolean("fp16.enabled", fp16.get("enabled", False)):
    return DeepSpeedFP16(
      scaler=no_scaler(),
      max_norm=max_norm,
      zero_stage=stage,
      gradient_accumulation_steps=accumulation,
    )
  loss_scale = _validate.number("fp16.loss_scale", fp16.get("loss_scale", 0))
  if loss_scale < 0:
    raise ValueError(
      "fp16.loss_scale must be >= 0 (0 enables dynamic loss scaling)"
    )
  if loss_scale > 0:
    scaler = static_scaler(loss_scale)
  else:
    scaler = _dynamic_scaler(fp16, stage, stage0_hysteresis)
  return DeepSpeedFP16(
    scaler=scaler,
    max_norm=max_norm,
    zero_stage=stage,
    gradient_accumulation_steps=accumulation,
  )


def _read(config: Union[Mapping[str, Any], str, os.PathLike]) -> Mapping:
  """The config dict (from its JSON file), refusing ``"auto"`` values."""
  if not isinstance(config, Mapping):
    with open(config) as f:
      config = json.load(f)
  auto = _refuse_auto(config)
  if auto:
    raise ValueError(
      f'"auto" values in {", ".join(auto)}: "auto" is resolved by the '
      "Hugging Face Trainer, not by DeepSpeed. Resolve them first: use the "
      "config the Trainer resolved, or write the values in."
    )
  return config


def _fp16_section(config: Mapping) -> Mapping:
  """The ``fp16`` section, checked for unknown fields."""
  fp16 = config.get("fp16", {})
  if not isinstance(fp16, Mapping):
    raise ValueError(f"fp16 must be a JSON object, got {fp16!r}")
  unknown = set(fp16) - _FP16_KEYS
  if unknown:
    raise ValueError(
      f"fp16: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FP16_KEYS)}"
    )
  return fp16


def _zero_stage(config: Mapping) -> int:
  """``zero_optimization.stage``, 0 to 3."""
  stage = config.get("zero_optimization", {}).get("stage", 0)
  return _validate.integer("zero_optimization.stage", stage, low=0, high=3)


def _int(fp16: Mapping, key: str, default: int, **kw) -> int:
  """``fp16[key]`` (or ``default``), an integer (``kw``: its range)."""
  return _validate.integer(f"fp16.{key}", fp16.get(key, default), **kw)


def _dynamic_scaler(
  fp16: Mapping, stage: int, stage0_hysteresis: bool
) -> Scaler:
  """The ``DynamicLossScaler`` the engine builds for ``fp16.loss_scale`` 0."""
  why = " so that 2**power is a normal float32"
  power = _int(fp16, "initial_scale_power", 16, low=-126, high=127, why=why)
  dynamic = " when dynamic loss scaling is enabled (loss_scale=0)"
  window = _int(fp16, "loss_scale_window", 1000, low=1, why=dynamic)
  min_scale = _int(fp16, "min_loss_scale", 1, low=1, why=dynamic)
  hysteresis = _int(fp16, "hysteresis", 2)
  consecutive = _validate.boolean(
    "fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis", False)
  )
  if stage == 0 and not stage0_hysteresis:
    # FP16_Optimizer / FP16_UnfusedOptimizer: no hysteresis, never raise.
    hysteresis, consecutive = 1, False
  else:
    _validate.integer("fp16.hysteresis", hysteresis, low=1)
  try:
    return deepspeed_scaler(
      init_scale=2.0**power,
      scale_window=window,
      min_scale=float(min_scale),
      delayed_shift=hysteresis,
      consecutive_hysteresis=consecutive,
      # After 0.19.8 the fp16 optimizers (stage 0) honour hysteresis but
      # still never raise at the floor; ZeRO's DynamicLossScaler raises.
      raise_error_at_min_scale=stage > 0,
    )
  except ValueError as e:
    raise ValueError(
      f"fp16: {e} (min_scale is fp16.min_loss_scale, "
      "init_scale is 2**fp16.initial_scale_power)"
    ) from None
