"""Peers that save and load their scaler state, stepped one overflow flag at a
time through their own code.

Each driver has ``step(overflow)``, ``scale`` (a Python float), ``state_dict()``
(what the peer saves) and ``load_state_dict(sd)`` (how the peer restores it).
Only the overflow decision matters to a scaler, so every step presents either
an inf or a finite gradient of 1.0 (already scaled) to the peer's own step.
"""

import contextlib
import math

import numpy as np
import oracles


class TorchGradScaler:
  """``torch.amp.GradScaler`` on CPU through scale, step, update."""

  def __init__(self, *, init_scale, growth_factor, backoff_factor, interval):
    self.torch = torch = oracles.require("torch")
    self.param = torch.nn.Parameter(torch.zeros(()))
    self.opt = torch.optim.SGD([self.param], lr=0.0)
    self.scaler = oracles._grad_scaler(
      torch, init_scale, growth_factor, backoff_factor, interval
    )

  def step(self, overflow):
    torch = self.torch
    oracles._scale_a_loss(torch, self.scaler)
    self.param.grad = torch.full((), math.inf if overflow else 1.0)
    self.scaler.step(self.opt)
    self.scaler.update()

  @property
  def scale(self):
    return float(self.scaler.get_scale())

  def state_dict(self):
    return self.scaler.state_dict()

  def load_state_dict(self, sd):
    self.scaler.load_state_dict(sd)


@contextlib.contextmanager
def _cuda_calls_on_cpu(torch):
  """Megatron's load_state_dict calls ``scale.cuda(current_device())``."""
  cuda, current = torch.Tensor.cuda, torch.cuda.current_device
  torch.Tensor.cuda = lambda self, *a, **k: self
  torch.cuda.current_device = lambda: 0
  try:
    yield
  finally:
    torch.Tensor.cuda, torch.cuda.current_device = cuda, current


class MegatronGradScaler:
  """Megatron-core's ``DynamicGradScaler`` with its tensors on the CPU."""

  def __init__(self, **kwargs):
    self.torch = torch = oracles.require("torch")
    grad_scaler = oracles.require("megatron.core.optimizer.grad_scaler")
    with oracles._torch_tensor_on_cpu(torch):
      self.scaler = grad_scaler.DynamicGradScaler(**kwargs)

  def step(self, overflow):
    self.scaler.update(bool(overflow))

  @property
  def scale(self):
    return float(self.scaler.scale.item())

  def state_dict(self):
    return self.scaler.state_dict()

  def load_state_dict(self, sd):
    with _cuda_calls_on_cpu(self.torch):
      self.scaler.load_state_dict(sd)


_COUNTERS = {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"}


class DeepSpeedLossScaler:
  """DeepSpeed's ``DynamicLossScaler``, the scaler a ZeRO optimizer pickles
  into its checkpoint as ``loss_scaler`` (and takes back whole on load)."""

  def __init__(self, **kwargs):
    oracles.init_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    self.cls, self.kwargs = DynamicLossScaler, kwargs
    self.scaler = DynamicLossScaler(**kwargs)

  def step(self, overflow):
    self.scaler.update_scale(bool(overflow))

  @property
  def scale(self):
    return float(self.scaler.cur_scale)

  def state_dict(self):
    return {"loss_scaler": self.scaler, "dynamic_loss_scale": True}

  def load_state_dict(self, sd):
    # A ZeRO load replaces the scaler object by the checkpoint's; here a
    # fresh one receives the saved attributes (the state's own counters must
    # all be there; entries that are no attribute, such as the optimizer's
    # dynamic_loss_scale, are left out).
    self.scaler = self.cls(**self.kwargs)
    missing = _COUNTERS - set(sd)
    if missing:
      raise KeyError(f"state lacks DynamicLossScaler's {sorted(missing)}")
    for name, value in sd.items():
      if name in vars(self.scaler):
        setattr(self.scaler, name, value)


class DeepSpeedFP16Optimizer:
  """DeepSpeed's ``FP16_Optimizer`` (fused) or ``FP16_UnfusedOptimizer`` over
  one fp16 parameter, inner SGD with lr 0."""

  def __init__(self, *, fused, **dynamic_loss_args):
    self.torch, (self.param,), self.opt = oracles.ds_fp16_optimizer(
      [np.zeros(4)],
      "sgd_momentum",
      fused,
      False,
      dict(lr=0.0, momentum=0.0),
      dynamic_loss_scale=True,
      dynamic_loss_args=dynamic_loss_args,
    )

  def step(self, overflow):
    value = math.inf if overflow else 1.0
    self.param.grad = self.torch.full((4,), value).half()
    self.opt.step()

  @property
  def scale(self):
    return float(self.opt.loss_scale_config.cur_scale)

  def state_dict(self):
    return self.opt.state_dict()

  def load_state_dict(self, sd):
    # What a user does with to_peer_state_dict: merge the loss-scale
    # entries into the optimizer's own state_dict, then load it.
    self.opt.load_state_dict({**self.opt.state_dict(), **sd})
