"""from_deepspeed_config without DeepSpeed: the scaler, the clip and the
accumulation it builds, and the errors and warning it gives. The comparisons
with DeepSpeed's own config classes are in tests/peers/."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs


def test_hysteresis_only_matters_under_zero():
  base = {"fp16": {"enabled": True, "hysteresis": 4}}
  assert fs.from_deepspeed_config(base).scaler.hysteresis == 1
  zero = dict(base, zero_optimization={"stage": 3})
  assert fs.from_deepspeed_config(zero).scaler.hysteresis == 4


def test_values_deepspeed_accepts_but_float32_cannot_hold():
  with pytest.raises(ValueError, match="initial_scale_power"):
    fs.from_deepspeed_config(
      {"fp16": {"enabled": True, "initial_scale_power": 200}}
    )
  with pytest.raises(ValueError, match="min_loss_scale"):
    fs.from_deepspeed_config(
      {"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}}
    )
  with pytest.raises(ValueError, match="unknown"):
    fs.from_deepspeed_config({"fp16": {"enabled": True, "windw": 3}})


def test_optimizer_builds_the_guarded_chain():

  recipe = fs.from_deepspeed_config(
    {"fp16": {"enabled": True}, "gradient_clipping": 0.5}
  )
  tx = recipe.optimizer(optax.sgd(1.0))
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  grads = {"w": jnp.full(4, 2.0**16)}  # true gradient 1.0 each, norm 2
  updates, state = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_allclose(updates["w"], -0.25 * np.ones(4), rtol=1e-5)
  assert float(fs.scale_metrics(state)["grad_norm"]) == 2.0


def test_accumulation_builds_the_accumulating_chain():
  recipe = fs.from_deepspeed_config(
    {
      "fp16": {"enabled": True, "loss_scale": 4},
      "gradient_clipping": 0,
      "train_batch_size": 8,
      "train_micro_batch_size_per_gpu": 4,
    }
  )
  assert recipe.gradient_accumulation_steps == 2
  tx = recipe.optimizer(optax.sgd(1.0))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  assert isinstance(state, fs.AccumulationState)
  step = jax.jit(tx.update)
  u, state = step({"w": jnp.array([4.0, 8.0])}, state, params)
  np.testing.assert_array_equal(u["w"], [-0.0, -0.0])
  u, state = step({"w": jnp.array([12.0, 8.0])}, state, params)
  np.testing.assert_array_equal(u["w"], [-2.0, -2.0])  # mean 8 / scale 4
  assert int(fs.scale_metrics(state)["applied_steps"]) == 1


def test_world_size_enters_the_batch_check():
  config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
  assert fs.from_deepspeed_config(config).gradient_accumulation_steps == 8
  ours = fs.from_deepspeed_config(config, world_size=4)
  assert ours.gradient_accumulation_steps == 2
  with pytest.raises(ValueError, match="32 != 4 \\* 8 \\* 2"):
    fs.from_deepspeed_config(
      dict(config, gradient_accumulation_steps=8), world_size=2
    )
  with pytest.raises(ValueError, match="world_size"):
    fs.from_deepspeed_config(config, world_size=0)


def test_without_batch_sizes_the_steps_are_taken_as_given():
  assert fs.from_deepspeed_config({}).gradient_accumulation_steps == 1
  config = {"gradient_accumulation_steps": 3}
  assert fs.from_deepspeed_config(config).gradient_accumulation_steps == 3
  with pytest.raises(ValueError, match="gradient_accumulation_steps"):
    fs.from_deepspeed_config({"gradient_accumulation_steps": 0})


def test_auto_values_must_be_resolved_first():
  config = {
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "train_batch_size": "auto",
    "gradient_accumulation_steps": 2,
  }
  with pytest.raises(ValueError, match="fp16.enabled, train_batch_size"):
    fs.from_deepspeed_config(config)


def test_one_warning_names_the_fields_not_modelled():
  config = {
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR"},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
    "train_micro_batch_size_per_gpu": 4,
  }
  with pytest.warns(UserWarning) as record:
    fs.from_deepspeed_config(config)
  assert len(record) == 1
  message = str(record[0].message)
  for field in ("optimizer", "scheduler", "zero_optimization.reduce_bucket"):
    assert field in message
  assert "fp16" not in message and "train_micro" not in message
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fs.from_deepspeed_config({"fp16": {"enabled": True}, "train_batch_size": 8})
