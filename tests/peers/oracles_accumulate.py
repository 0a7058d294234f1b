"""Oracle drivers for gradient accumulation: the peers' own recipes, run by
the peers.

Each window of ``k`` microbatches goes through the peer's accumulation
recipe, with autograd doing the accumulation:

* torch.amp: ``scaler.scale(loss / k).backward()`` k times over float32
  parameters, then ``scaler.unscale_``, ``clip_grad_norm_``,
  ``scaler.step``, ``scaler.update`` and ``zero_grad``;
* DeepSpeed's fp16 optimizers: ``optimizer.backward(loss / k)`` k times over
  float16 parameters (what the engine's ``backward`` does with
  ``gradient_accumulation_steps = k``), then ``step`` and ``zero_grad``
  (what the engine does at the accumulation boundary).

Microbatch ``i`` presents the float16 gradient ``h_i = fp16(g_i * s)`` of
``loss * s`` at the peer's current scale ``s`` (a cast past 65504 is an inf,
as in training), through the loss ``sum(p * C_i)`` with the constant
``C_i = float32(h_i) / s``: the peer's backward of ``loss / k`` at scale
``s`` then contributes ``(s / k) * C_i = h_i / k`` to ``.grad``, exactly
when ``s`` and ``k`` are powers of two. Each record keeps the presented
``h_i`` (``Step.grads``: one list of arrays per microbatch), so
fp16_scaling can be fed the very same microbatch gradients.
"""

from typing import Sequence

import numpy as np
import oracles


def _coefficients(torch, grads, scale):
  """``(h, C)``: the float16 gradients of ``loss * scale`` and the float32
  loss coefficients whose backward at ``scale`` reproduces them."""
  h = oracles._present(grads, scale, False, np.float16)
  with np.errstate(invalid="ignore"):
    c = [torch.tensor(x.astype(np.float32) / np.float32(scale)) for x in h]
  return h, c


def run_torch_amp_accumulate(
  params0: Sequence[np.ndarray],
  windows: Sequence[Sequence[Sequence[np.ndarray]]],
  *,
  lr,
  max_norm,
  betas,
  eps,
  **scaler_args,
):
  """torch Adam on float32 parameters with torch.amp.GradScaler (taking
  ``scaler_args``: init_scale, growth_factor, backoff_factor,
  growth_interval), each window
  accumulated over its microbatches by autograd. ``Step.norm`` is what
  ``clip_grad_norm_`` returns; ``skipped`` is read from Adam's step count.
  """
  torch, params, opt = oracles.torch_adam(params0, lr=lr, betas=betas, eps=eps)
  scaler = torch.amp.GradScaler("cpu", **scaler_args)
  records = []
  for window in windows:
    k = len(window)
    oracles._scale_a_loss(torch, scaler)  # creates the scale on first use
    before = scaler.get_scale()
    presented = []
    for grads in window:
      h, c = _coefficients(torch, grads, before)
      presented.append(h)
      loss = sum((p * ci).sum() for p, ci in zip(params, c))
      scaler.scale(loss / k).backward()
    steps = oracles._adam_steps(opt, params)
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    records.append(
      oracles.torch_record(opt, params, scaler, steps, before, norm, presented)
    )
  return records


def run_ds_fp16_optimizer_accumulate(
  params0: Sequence[np.ndarray],
  windows: Sequence[Sequence[Sequence[np.ndarray]]],
  *,
  optimizer,
  lr,
  clip_grad,
  fused,
  momentum,
  betas,
  eps,
  **dynamic_loss_args,
):
  """DeepSpeed's ``FP16_Optimizer`` (``fused``) or ``FP16_UnfusedOptimizer``
  with the upstream fix (``oracles._scale_after_step``), over float16
  parameters, its dynamic scale taking ``dynamic_loss_args`` (init_scale,
  scale_window, min_scale), each window accumulated by
  ``optimizer.backward(loss / k)``.
  The inner optimizer and the record are those of
  ``oracles.run_ds_fp16_optimizer``; ``Step.norm`` is the unscaled norm
  (inf on an overflow window).
  """
  torch, model, opt = oracles.ds_fp16_optimizer(
    params0,
    optimizer,
    fused,
    True,
    dict(lr=lr, momentum=momentum, betas=betas, eps=eps),
    clip_grad=clip_grad,
    dynamic_loss_scale=True,
    dynamic_loss_args=dynamic_loss_args,
  )
  records = []
  for window in windows:
    k = len(window)
    before = float(opt.loss_scale_config.cur_scale)
    presented = []
    for grads in window:
      h, c = _coefficients(torch, grads, before)
      presented.append(h)
      loss = sum((p.float() * ci).sum() for p, ci in zip(model, c))
      opt.backward(loss / k)  # the engine's backward divides by k
    overflow = opt.step()
    opt.zero_grad()  # the engine's step at the accumulation boundary
    records.append(oracles.ds_record(opt, fused, overflow, before, presented))
  return records
