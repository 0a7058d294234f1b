"""from_deepspeed_config against DeepSpeed's own config classes and scalers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

import fp16_scaling as fs

oracles.init_deepspeed()
from deepspeed.runtime import config as ds_config  # noqa: E402
from deepspeed.runtime.fp16 import loss_scaler as ds_ls  # noqa: E402
from deepspeed.runtime.precision_config import get_float16_config  # noqa: E402


def _ds_reads(config):
  """What DeepSpeed's engine builds from ``config``: (kind, scaler fields,
  clip).

  Non-ZeRO fp16 optimizers take a ``LossScaleConfig``; ZeRO stages build a
  ``DynamicLossScaler`` via ``CreateLossScaler`` from the same args.
  """
  import torch

  fp16 = get_float16_config(config)
  clip = ds_config.get_gradient_clipping(config)
  stage = config.get("zero_optimization", {}).get("stage", 0)
  if not fp16.enabled:
    return "none", None, clip
  dynamic = fp16.loss_scale == 0
  if not dynamic:
    return "static", fp16.loss_scale, clip
  args = fp16.dynamic_loss_scale_args()
  if stage == 0:
    lsc = ds_ls.LossScaleConfig(torch.float16, True, fp16.loss_scale, args)
    return "fp16_optimizer", lsc, clip
  scaler = ds_ls.CreateLossScaler(torch.float16, fp16.loss_scale, True, args)
  return "zero", scaler, clip


def _trajectory(scaler, overflows):
  state, out = scaler.init(), []
  update = jax.jit(scaler.update)
  for o in overflows:
    state = update(state, jnp.bool_(o))
    out.append(float(state.loss_scale))
  return out


def _ds_optimizer_trajectory(lsc, overflows):
  """FP16_Optimizer._update_scale's rule on a LossScaleConfig (0.19.8)."""
  scale, last_overflow, out = lsc.cur_scale, -1, []
  for it, o in enumerate(overflows):
    if o:
      scale = max(scale / lsc.scale_factor, lsc.min_loss_scale)
      last_overflow = it
    else:
      stable = it - last_overflow - 1
      if stable > 0 and stable % lsc.scale_window == 0:
        scale *= lsc.scale_factor
    out.append(float(scale))
  return out


_FP16 = {
  "enabled": True,
  "initial_scale_power": 8,
  "loss_scale_window": 3,
  "hysteresis": 3,
  "min_loss_scale": 4,
}
CONFIGS = [
  {"fp16": {"enabled": True}},
  {"fp16": _FP16, "gradient_clipping": 0.5},
  {"fp16": _FP16, "zero_optimization": {"stage": 2}},
  {
    "fp16": {
      "enabled": True,
      "initial_scale_power": 6,
      "loss_scale_window": 2,
      "hysteresis": 2,
      "consecutive_hysteresis": True,
    },
    "zero_optimization": {"stage": 1},
    "gradient_clipping": 0,
  },
  {"fp16": {"enabled": True, "loss_scale": 1024}},
  {"fp16": {"enabled": False}, "bf16": {"enabled": True}},
  {},
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: json.dumps(c))
def test_matches_what_deepspeed_builds(config, tmp_path):
  ours = fs.from_deepspeed_config(config)
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(config))
  assert fs.from_deepspeed_config(str(path)) == ours

  kind, ds, clip = _ds_reads(config)
  assert ours.max_norm == (clip if clip > 0 else None)
  rng = np.random.default_rng(0)
  overflows = rng.random(200) < 0.3
  if kind == "none":
    assert ours.scaler.init_scale == 1.0 and not ours.scaler.dynamic
  elif kind == "static":
    assert ours.scaler.init_scale == ds and not ours.scaler.dynamic
  elif kind == "fp16_optimizer":
    assert _trajectory(ours.scaler, overflows) == _ds_optimizer_trajectory(
      ds, overflows
    )
  else:
    assert ours.scaler.raise_at_min_scale == ds.raise_error_at_min_scale
    expected = []
    ds.raise_error_at_min_scale = False
    for o in overflows:
      ds.update_scale(bool(o))
      expected.append(float(ds.cur_scale))
    assert _trajectory(ours.scaler, overflows) == expected


BAD = [
  ({"loss_scale": True}, "fp16.loss_scale"),
  ({"loss_scale": -1}, "fp16.loss_scale"),
  ({"loss_scale": float("inf")}, "fp16.loss_scale"),
  ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
  ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
  ({"min_loss_scale": True}, "fp16.min_loss_scale"),
  ({"loss_scale_window": float("nan")}, "fp16.loss_scale_window"),
]


@pytest.mark.parametrize("fp16,field", BAD, ids=[f for _, f in BAD])
def test_deepspeed_validation_errors(fp16, field):
  config = {"fp16": dict(enabled=True, **fp16)}
  with pytest.raises(ValueError, match=field):
    get_float16_config(config)  # DeepSpeed rejects it ...
  with pytest.raises(ValueError, match=field):
    fs.from_deepspeed_config(config)  # ... and so do we, naming the field.


BATCHES = [
  {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
  {"train_batch_size": 32, "gradient_accumulation_steps": 4},
  {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
  {"train_batch_size": 16},
  {"train_micro_batch_size_per_gpu": 4},
  {
    "train_batch_size": 24,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 12,
  },
  {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3},
  {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
  },
  {"train_batch_size": 8, "gradient_accumulation_steps": 0},
  {"train_batch_size": 0, "train_micro_batch_size_per_gpu": 4},
]


@pytest.mark.parametrize("batch", BATCHES, ids=lambda c: json.dumps(c))
def test_accumulation_steps_as_deepspeed_derives_and_checks_them(batch):
  config = dict(batch, fp16={"enabled": True})
  try:
    expected = ds_config.DeepSpeedConfig(config).gradient_accumulation_steps
  except (AssertionError, ZeroDivisionError):
    expected = None
  if expected is None:  # DeepSpeed refuses it, and so do we
    with pytest.raises(ValueError, match="train_batch_size|steps"):
      fs.from_deepspeed_config(config)
  else:
    ours = fs.from_deepspeed_config(config)
    assert ours.gradient_accumulation_steps == expected
