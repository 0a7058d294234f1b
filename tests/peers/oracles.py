"""Oracle drivers: run the PyTorch peers' own code (DeepSpeed, torch AMP,
Megatron-core) on CPU.

Tests compare fp16_scaling against these. The drivers run only the peers'
code; the shared replay helpers (`scan_steps`, `assert_same_steps`) run
fp16_scaling.
Peers are imported lazily through `require`, so a test needing a missing peer
is skipped (a failure under CI).

Conventions
- Scales and norms are returned as Python floats. torch's and Megatron's scales
  live in float32 tensors, so theirs are float32 values; DeepSpeed's scale is a
  Python float (float64).
- Whole-step drivers take the *unscaled* gradient of each step (float32 arrays,
  one per parameter) and present to the peer what its scaled backward would have
  produced at the peer's current scale `s`: `fp16(float32(g) * s)` as the
  `.grad` of DeepSpeed's fp16 parameters (round to nearest even; a value of
  magnitude >= 65520 becomes inf, so an overflow arises as it would in
  training), and `float32(g) * s` as the `.grad` of torch AMP's float32
  parameters. With `scaled=True` the arrays are taken as already scaled and only
  cast (fp16 for DeepSpeed, float32 for torch). Each step's record keeps the
  exact arrays presented (`Step.grads`), so the JAX side can be fed the very
  same values.
"""

import contextlib
import importlib
import inspect
import math
import os
import socket
from typing import NamedTuple, Sequence

import numpy as np

# DeepSpeed reads these when it is first imported: CPU accelerator, no
# torch.compile.
os.environ["DS_ACCELERATOR"] = "cpu"
os.environ["TORCHDYNAMO_DISABLE"] = "1"


def require(name):
  """Import the peer module `name`; if missing, fail under CI (env `CI` set),
  else
  skip the test.
  """
  try:
    return importlib.import_module(name)
  except ImportError as err:
    if os.environ.get("CI"):
      raise
    import pytest

    pytest.skip(
      f"peer {name!r} is not importable: {err}", allow_module_level=True
    )


def signature_params(fn, leave_out=()):
  """``fn``'s parameters by name, less ``self`` and those in ``leave_out``."""
  return {
    name: p
    for name, p in inspect.signature(fn).parameters.items()
    if name not in ("self", *leave_out)
  }


def torch_mlp(torch, hidden, out):
  """docs/porting-torch.md's MLP in torch, bias-free Linear(8, 32), ReLU,
  Linear(32, 1), with the kernels ``hidden`` and ``out`` (JAX's layout)."""
  net = torch.nn.Sequential(
    torch.nn.Linear(8, 32, bias=False),
    torch.nn.ReLU(),
    torch.nn.Linear(32, 1, bias=False),
  )
  with torch.no_grad():
    for layer, kernel in ((net[0], hidden), (net[2], out)):
      layer.weight.copy_(torch.tensor(np.asarray(kernel).T))
  return net


def init_deepspeed():
  """Import deepspeed and initialise its process group once (idempotent): one
  rank,
  gloo, a free port.
  """
  deepspeed = require("deepspeed")
  if not deepspeed.comm.is_initialized():
    # One rank has no use for the shared-memory all-reduce op; not building it
    # saves a C++ JIT compile (about a minute, and a compiler) on a fresh
    # machine. Nothing else depends on it. (`deepspeed.comm.torch` as an
    # attribute is the torch package, hence the import by name.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    os.environ.update(
      MASTER_ADDR="127.0.0.1",
      MASTER_PORT=str(port),
      RANK="0",
      WORLD_SIZE="1",
      LOCAL_RANK="0",
    )
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
  return deepspeed


# ------------------------------------------------------------------------------
# Loss-scale trajectories: the scale after each step, given which steps
# overflowed.


def steps(step, overflows):
  """The scale after each step of ``step(overflow) -> scale`` (one of the
  ``*_step`` drivers below), given which steps overflowed."""
  return [step(overflow) for overflow in overflows]


def ds_loss_scaler_step(cfg, cls=None):
  """DeepSpeed's `DynamicLossScaler` (the ZeRO path's scaler), or its subclass
  ``cls``, built from ``cfg`` (its arguments) with
  raise_error_at_min_scale=False: ``step(overflow) -> scale``.
  """
  init_deepspeed()
  from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

  scaler = (cls or DynamicLossScaler)(**cfg, raise_error_at_min_scale=False)

  def step(overflow):
    scaler.update_scale(bool(overflow))
    return float(scaler.cur_scale)

  return step


def _grad_scaler(
  torch, init_scale, growth_factor, backoff_factor, growth_interval
):
  """A CPU ``torch.amp.GradScaler``."""
  return torch.amp.GradScaler(
    "cpu",
    init_scale=init_scale,
    growth_factor=growth_factor,
    backoff_factor=backoff_factor,
    growth_interval=growth_interval,
  )


def _scale_a_loss(torch, scaler):
  """What ``scaler.scale(loss).backward()`` does to the scaler: it creates the
  scale on first use."""
  scaler.scale(torch.zeros(()))


def torch_scaler_trajectory(overflows, growth_interval, **cfg):
  """torch.amp.GradScaler on CPU through its public path: scale, step (unscale_
  + inf check), update (``oracles_state.TorchGradScaler``).

  The one parameter's scaled gradient is inf on an overflow step, 1.0 otherwise;
  SGD with lr=0.
  """
  import oracles_state  # which builds on this module

  peer = oracles_state.TorchGradScaler(**cfg, interval=growth_interval)
  out = []
  for overflow in overflows:
    peer.step(overflow)
    out.append(peer.scale)
  return out


def torch_update_step(cfg, floor=0.0):
  """The op `GradScaler.update` calls, `torch._amp_update_scale_`, alone, from
  ``cfg`` (init_scale, growth_factor, backoff_factor, growth_interval):
  ``step(overflow) -> scale``. A scale below ``floor`` is then raised to it
  (the default never acts).
  """
  torch = require("torch")
  scale = torch.full((), cfg["init_scale"], dtype=torch.float32)
  growth_tracker = torch.zeros((), dtype=torch.int32)
  # what unscale_ leaves in found_inf: 0.0 or 1.0
  found_inf = (torch.zeros(()), torch.ones(()))

  def step(overflow):
    torch._amp_update_scale_(
      scale,
      growth_tracker,
      found_inf[bool(overflow)],
      cfg["growth_factor"],
      cfg["backoff_factor"],
      cfg["growth_interval"],
    )
    if scale.item() < floor:
      scale.fill_(floor)
    return scale.item()

  return step


@contextlib.contextmanager
def _torch_tensor_on_cpu(torch):
  """Make every `torch.tensor(...)` land on the CPU, whatever device it asks
  for.
  """
  real = torch.tensor

  def on_cpu(*args, **kwargs):
    kwargs["device"] = "cpu"
    return real(*args, **kwargs)

  torch.tensor = on_cpu
  try:
    yield
  finally:
    torch.tensor = real


def megatron_scaler_step(cfg, clamp=False):
  """Megatron-core's `DynamicGradScaler` built from ``cfg`` (its arguments):
  ``step(overflow) -> scale``; with ``clamp``, a growth to inf is refused.
  Its __init__ hard-codes device='cuda'
  (the only CUDA use:
  `update` is plain Python over the tensors made there), so it is built with
  torch.tensor forced to CPU.
  """
  torch = require("torch")
  grad_scaler = require("megatron.core.optimizer.grad_scaler")
  with _torch_tensor_on_cpu(torch):
    scaler = grad_scaler.DynamicGradScaler(**cfg)

  def step(overflow):
    # update() assigns a new tensor; it does not write into this one
    before = scaler._scale
    scaler.update(bool(overflow))
    if clamp and not math.isfinite(scaler._scale.item()):
      scaler._scale = before
    return scaler.scale.item()

  return step


# ------------------------------------------------------------------------------
# Whole optimizer steps.


class Step(NamedTuple):
  """What one step of a whole-step driver did."""

  skipped: bool  # the peer found an overflow and did not update the parameters
  scale_before: float  # scale the step's gradients were made with
  scale_after: float  # scale for the next step
  # the norm the peer reports for this step (see each driver); DeepSpeed: inf
  # when skipped
  norm: float
  # the scaled gradients presented to the peer (np.float16 for DeepSpeed,
  # np.float32 for torch)
  grads: list
  # float32 master parameters after the step (np.float32 arrays, shapes of
  # params0)
  params: list


def random_gradient_sequence(
  rng, shapes, steps, *, log10_range, bad_rate, bad_values
):
  """Unscaled float32 gradients for ``steps`` steps: each step draws a
  magnitude ``10**u``, ``u`` uniform over ``log10_range``, and each leaf a
  further factor in [0.1, 10]; on about ``bad_rate`` of the steps one random
  element of one random leaf becomes a value drawn from ``bad_values`` (NaN,
  +inf, -inf). Returns the sequence and the indices of those steps.
  """
  seq, bad_steps = [], []
  for t in range(steps):
    magnitude = 10 ** rng.uniform(*log10_range)
    grads = [
      (rng.standard_normal(s) * magnitude * 10 ** rng.uniform(-1, 1)).astype(
        np.float32
      )
      for s in shapes
    ]
    if rng.random() < bad_rate:
      leaf = grads[rng.integers(len(grads))]
      value = bad_values[0] if len(bad_values) == 1 else rng.choice(bad_values)
      leaf.reshape(-1)[rng.integers(leaf.size)] = value
      bad_steps.append(t)
    seq.append(grads)
  return seq, bad_steps


def scan_steps(tx, params, state, grads, given=None):
  """Runs the guarded chain ``tx`` over gradients stacked along axis 0, in one
  jitted ``lax.scan``.

  With ``given`` (parameters stacked the same way), step t starts from
  ``given[t]`` instead of the previous step's parameters. Returns numpy arrays
  per step: params (list), scale before, prev_loss_scale, loss_scale, overflow,
  grad_norm.
  """
  return scan_steps_each([(tx, params, state, grads, given)])[0]


def scan_steps_each(runs):
  """:func:`scan_steps` of each ``(tx, params, state, grads, given)`` in
  ``runs``, all in one jit: a jit each compiled again what the chains share
  (the tests that replay several cases take about half the CPU time).
  """
  import jax
  import optax

  import fp16_scaling as fs

  def scan(tx, params, state, grads, given):
    def step(carry, xs):
      params, state = carry
      g, start = xs
      if start is not None:
        params = start
      before = fs.current_scale(state)
      updates, state = tx.update(list(g), state, params)
      params = optax.apply_updates(params, updates)
      m = fs.scale_metrics(state)
      keys = ("prev_loss_scale", "loss_scale", "overflow", "grad_norm")
      return (params, state), (params, before, *(m[k] for k in keys))

    return jax.lax.scan(step, (params, state), (grads, given))[1]

  txs = [run[0] for run in runs]

  @jax.jit
  def run_all(args):
    return [scan(tx, *a) for tx, a in zip(txs, args)]

  out = run_all([run[1:] for run in runs])
  return [jax.tree.map(np.asarray, o) for o in out]


def assert_same_skips_and_scales(records, overflow, before, prev, after):
  """Step by step against a peer run's records: the skip decision, the scale
  before the step,
  the scale the gradients were made with (the peer's scale before), the scale
  after. Returns
  the peer's skip mask."""
  skipped = np.array([r.skipped for r in records])
  np.testing.assert_array_equal(overflow, skipped, err_msg="skip decisions")
  peer_before = [r.scale_before for r in records]
  np.testing.assert_array_equal(
    before, peer_before, err_msg="scale before the step"
  )
  np.testing.assert_array_equal(
    prev, peer_before, err_msg="scale the grads were made with"
  )
  np.testing.assert_array_equal(
    after, [r.scale_after for r in records], err_msg="scale after the step"
  )
  return skipped


def assert_same_steps(
  records, ours, *, norm_rtol, param_rtol_of_max=None, param_bounds=None
):
  """Whole optimizer steps against a peer run's records: skips and scales
  (``assert_same_skips_and_scales``), the reported norm (0.0 for ours and not
  finite for the peer on a skipped step, within ``norm_rtol`` elsewhere) and
  the master parameters (within ``param_rtol_of_max`` times their largest
  magnitude, or elementwise within ``param_bounds``: per parameter, one bound
  a step and element). ``ours`` is what ``scan_steps`` returns. Returns the
  peer's skip mask and reported norms.
  """
  params, before, prev, after, overflow, norm = ours
  skipped = assert_same_skips_and_scales(records, overflow, before, prev, after)
  peer_norm = np.array([r.norm for r in records])
  assert not np.isfinite(peer_norm[skipped]).any()
  assert (norm[skipped] == 0).all()
  np.testing.assert_allclose(
    norm[~skipped], peer_norm[~skipped], rtol=norm_rtol, err_msg="reported norm"
  )
  if param_bounds is not None:
    for i, (ours_i, bound) in enumerate(zip(params, param_bounds)):
      diff = np.abs(ours_i - np.stack([r.params[i] for r in records]))
      worst = np.unravel_index(np.argmax(diff - bound), diff.shape)
      assert (diff <= bound).all(), (
        f"master parameter {i}, step {worst[0]}: {diff[worst]} > {bound[worst]}"
      )
    return skipped, peer_norm
  largest = max(float(np.abs(p).max()) for r in records for p in r.params)
  for i, ours_i in enumerate(params):
    np.testing.assert_allclose(
      ours_i,
      np.stack([r.params[i] for r in records]),
      rtol=0,
      atol=param_rtol_of_max * largest,
      err_msg=f"master parameter {i}",
    )
  return skipped, peer_norm


def _present(grads, scale, scaled, dtype):
  with np.errstate(over="ignore", invalid="ignore"):
    if scaled:
      return [np.asarray(g).astype(dtype) for g in grads]
    return [
      (np.asarray(g, np.float32) * np.float32(scale)).astype(dtype)
      for g in grads
    ]


def _scale_after_step(cls, unscale_reported_norm):
  """`cls` with only the upstream fix applied: the scale update takes effect
  after the step.

  DeepSpeed 0.19.8's step() calls `_update_scale` before
  `unscale_and_clip_grads`, which then divides by (and clips against) the
  *updated* `cur_scale`; on a growth step the applied gradient is half the true
  one. Here `_update_scale` is deferred to the end of step(), so unscaling,
  clipping and the fused optimizer's reported norm use the scale the gradients
  were made with. The unfused optimizer reports the norm still multiplied by the
  scale; with `unscale_reported_norm` it is divided by that scale.
  """

  class ScaleAfterStep(cls):
    def _update_scale(self, skip):
      # step() applies it once the gradients have been used
      self._deferred_skip = skip

    def step(self, closure=None):
      scale = self.loss_scale_config.cur_scale
      self._deferred_skip = None
      overflow = super().step(closure)
      if self._deferred_skip is not None:
        if unscale_reported_norm and not overflow:
          self._global_grad_norm /= scale
        super()._update_scale(self._deferred_skip)
      return overflow

  ScaleAfterStep.__name__ = ScaleAfterStep.__qualname__ = (
    f"{cls.__name__}ScaleAfterStep"
  )
  return ScaleAfterStep


def ds_master_params(opt, fused):
  """The float32 master parameters of a DeepSpeed fp16 optimizer, as numpy."""
  from torch._utils import _unflatten_dense_tensors

  if fused:
    tensors = _unflatten_dense_tensors(
      opt.fp32_groups_flat[0], opt.fp16_groups[0]
    )
  else:
    tensors = opt.fp32_groups[0]
  return [t.detach().numpy().copy() for t in tensors]


def run_ds_fp16_optimizer(
  params0: Sequence[np.ndarray],
  grad_seq: Sequence[Sequence[np.ndarray]],
  *,
  optimizer="sgd_momentum",
  lr,
  clip_grad=0.0,
  init_scale,
  scale_window=1000,
  min_scale=1.0,
  dynamic=True,
  fused=True,
  patched=False,
  scaled=False,
  momentum=0.9,
  betas=(0.9, 0.999),
  eps=1e-8,
):
  """DeepSpeed's `FP16_Optimizer` (fused=True) or `FP16_UnfusedOptimizer` over
  fp16 parameters.

  The model's parameters are `params0` cast to fp16; the fp32 masters start as
  those fp16 values. The inner optimizer is torch SGD (`momentum`) or Adam
  (`betas`, `eps`), no weight decay, foreach off. Both DeepSpeed wrappers run
  one inner step on zero gradients when built: SGD's momentum buffer starts at 0
  (the same as a fresh one) and Adam's step count starts at 1. `dynamic=False`
  keeps `init_scale` as a static scale. `patched=True` applies the upstream fix
  (`_scale_after_step`). `Step.norm` is the optimizer's `_global_grad_norm`:
  fused, the scaled norm over the updated scale (over the scale used, when
  patched); unfused, the scaled norm itself (unscaled, when patched).
  """
  if dynamic:
    scaling = dict(
      dynamic_loss_scale=True,
      dynamic_loss_args=dict(
        init_scale=init_scale, scale_window=scale_window, min_scale=min_scale
      ),
    )
  else:
    scaling = dict(static_loss_scale=init_scale)
  inner = dict(lr=lr, momentum=momentum, betas=betas, eps=eps)
  torch, model, opt = ds_fp16_optimizer(
    params0, optimizer, fused, patched, inner, clip_grad=clip_grad, **scaling
  )
  records = []
  for grads in grad_seq:
    before = float(opt.loss_scale_config.cur_scale)
    grads16 = _present(grads, before, scaled, np.float16)
    for p, g in zip(model, grads16):
      p.grad = torch.tensor(g)
    overflow = opt.step()
    records.append(ds_record(opt, fused, overflow, before, grads16))
  return records


def ds_fp16_optimizer(params0, optimizer, fused, patched, inner, **kwargs):
  """``(torch, model, opt)``: the fp16 parameters (``params0`` cast) and the
  DeepSpeed fp16 optimizer over them that `run_ds_fp16_optimizer` describes,
  the inner optimizer taking ``inner`` (lr, momentum, betas, eps) and the
  wrapper ``kwargs``.
  """
  torch = require("torch")
  init_deepspeed()
  from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
  from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

  cls = FP16_Optimizer if fused else FP16_UnfusedOptimizer
  if patched:
    cls = _scale_after_step(cls, unscale_reported_norm=not fused)
  model = [
    torch.nn.Parameter(torch.tensor(np.asarray(p, np.float32)).half())
    for p in params0
  ]
  lr, momentum, betas, eps = map(inner.get, ("lr", "momentum", "betas", "eps"))
  if optimizer == "sgd_momentum":
    inner = torch.optim.SGD(model, lr=lr, momentum=momentum, foreach=False)
  elif optimizer == "adam":
    inner = torch.optim.Adam(model, lr=lr, betas=betas, eps=eps, foreach=False)
  else:
    raise ValueError(f"unknown optimizer {optimizer!r}")
  return torch, model, cls(inner, verbose=False, **kwargs)


def ds_record(opt, fused, overflow, before, grads):
  """The `Step` a DeepSpeed fp16 optimizer's ``step`` leaves, made at scale
  ``before`` from ``grads``."""
  return Step(
    bool(overflow),
    before,
    float(opt.loss_scale_config.cur_scale),
    float(opt._global_grad_norm),
    grads,
    ds_master_params(opt, fused),
  )


def run_torch_amp(
  params0: Sequence[np.ndarray],
  grad_seq: Sequence[Sequence[np.ndarray]],
  *,
  lr,
  max_norm=math.inf,
  init_scale=2.0**16,
  growth_factor=2.0,
  backoff_factor=0.5,
  growth_interval=2000,
  betas=(0.9, 0.999),
  eps=1e-8,
  weight_decay=0.0,
  decoupled_weight_decay=False,
  scaled=False,
):
  """torch Adam (AdamW with `decoupled_weight_decay`) on float32 parameters
  with torch.amp.GradScaler.

  Each step: scaler.unscale_(opt); clip_grad_norm_(params, max_norm);
  scaler.step(opt); scaler.update(). `Step.norm` is what clip_grad_norm_
  returns: the norm of the unscaled gradients before clipping (inf or nan on an
  overflow step). `max_norm=inf` leaves the gradients as they are. `skipped` is
  read from Adam's step count, which only advances when the scaler lets
  optimizer.step() run.
  """
  torch, params, opt = torch_adam(
    params0,
    lr=lr,
    betas=betas,
    eps=eps,
    weight_decay=weight_decay,
    decoupled_weight_decay=decoupled_weight_decay,
  )
  scaler = _grad_scaler(
    torch, init_scale, growth_factor, backoff_factor, growth_interval
  )
  records = []
  for grads in grad_seq:
    _scale_a_loss(torch, scaler)
    before = scaler.get_scale()
    grads32 = _present(grads, before, scaled, np.float32)
    for p, g in zip(params, grads32):
      p.grad = torch.tensor(g)
    steps = _adam_steps(opt, params)
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(opt)
    scaler.update()
    records.append(
      torch_record(opt, params, scaler, steps, before, norm, grads32)
    )
  return records


def torch_adam(params0, **kwargs):
  """``(torch, params, opt)``: float32 parameters (``params0``) and torch Adam
  over them, foreach off, taking ``kwargs``."""
  torch = require("torch")
  params = [
    torch.nn.Parameter(torch.tensor(np.asarray(p, np.float32))) for p in params0
  ]
  return torch, params, torch.optim.Adam(params, **kwargs, foreach=False)


def _adam_steps(opt, params):
  return float(opt.state[params[0]].get("step", 0))


def torch_record(opt, params, scaler, steps, before, norm, grads):
  """The `Step` of one torch.amp step made at scale ``before`` from ``grads``:
  skipped when Adam's step count is still ``steps``, its count before."""
  return Step(
    _adam_steps(opt, params) == steps,
    before,
    scaler.get_scale(),
    float(norm),
    grads,
    [p.detach().numpy().copy() for p in params],
  )


def ds_moe_norm(
  expert_grads: Sequence[np.ndarray], shared_grads: Sequence[np.ndarray]
):
  """The global gradient norm `FP16_Optimizer.step` computes with one expert
  parameter group, one rank.

  As in that step: the shared (non-expert) group's gradients are flattened to
  one float32 tensor whose norm is taken by `get_flattened_grad_norm`; the
  expert group's, flattened likewise, are handed to `get_norm_with_moe_layers`
  under the expert-parallel group "ep_size_1". Returns -1.0 (DeepSpeed's
  sentinel) when any gradient is inf or nan.
  """
  torch = require("torch")
  init_deepspeed()
  from deepspeed.runtime.utils import get_flattened_grad_norm
  from deepspeed.runtime.utils import get_norm_with_moe_layers
  from deepspeed.utils import groups

  if "ep_size_1" not in groups._get_expert_parallel_group_dict():
    groups._create_expert_and_data_parallel(1)

  def flat(grads):
    return torch.cat(
      [torch.tensor(np.asarray(g, np.float32)).reshape(-1) for g in grads]
    )

  shared_master = torch.zeros(sum(np.size(g) for g in shared_grads))
  shared_master.grad = flat(shared_grads) if shared_grads else None
  non_expert_norm = get_flattened_grad_norm([shared_master])
  return float(
    get_norm_with_moe_layers(
      non_expert_norm,
      mpu=None,
      expert_tensors={"ep_size_1": [flat(expert_grads)]},
    )
  )
