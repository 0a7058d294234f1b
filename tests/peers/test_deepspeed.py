"""Whole optimizer steps against DeepSpeed's fp16 optimizers (0.19), step by
step.

The same gradient sequences go to DeepSpeed's ``FP16_Optimizer`` (fused) and
``FP16_UnfusedOptimizer`` over torch SGD with momentum or torch Adam, and to::

    chain(fp16_loss_scale(deepspeed_scaler(init, window, floor,
    delayed_shift=1,
                                                            raise_error_at_min_scale=False)),
                           clip_by_unscaled_norm(clip_grad), <the same optimizer
                           in optax>)

The peer casts each step's scaled gradient to float16
(``oracles.run_ds_fp16_optimizer``), so overflows arise in that cast, as in
training; NaN is also injected into random leaves at random steps. fp16_scaling
gets the very float16 arrays DeepSpeed was given (``Step.grads``), its float32
master parameters start at the same fp16-rounded values, and the whole sequence
runs under one ``lax.scan``. After every step: the same skip decision, the same
scale before and after, the same reported true norm, and the same master
parameters.

DeepSpeed 0.19 updates the scale before unscaling (on a growth step it applies
half the gradient and its fused optimizer reports half the norm) and its unfused
optimizer reports the norm still multiplied by the scale. The comparison is
against ``patched=True``, the upstream fix;
``test_unpatched_deepspeed_still_has_both_bugs`` pins the bugs, so that the
suite notices when upstream changes.
"""

import float32_bounds
from helpers import SEED
from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import oracles
import pytest

import fp16_scaling as fs

oracles.require("torch")
oracles.init_deepspeed()

SHAPES = [(16, 8), (33,), (4, 3, 5)]
STEPS = 300
INIT_SCALE, WINDOW, FLOOR = 2.0**14, 8, 2.0**11
# about the median true norm of the sequence below: binds on about half the
# steps
CLIP = 0.05
NAN_RATE = 0.04
# Hyperparameters exactly representable in float32. optax forms Adam's bias
# corrections 1 - b**t in float32 from float32(b); torch in double from the
# Python float. With b2 = 0.999 (not a float32: float32(0.999) is 1.3e-8 off)
# the cancellation in 1 - b2**t turns that into ~1e-5 relative in the bias
# correction, the same sign on every step: torch Adam and optax.adam alone, on
# identical float32 gradients, drift apart by ~3e-7 * max|param| over 300 steps
# at lr 1e-3. With betas and lr that are float32 values, only the rounding of
# b**t is left and the drift is ~1 ulp.
LR = {"sgd_momentum": 2.0**-7, "adam": 2.0**-10}
MOMENTUM, BETAS, EPS = 0.875, (0.875, 1 - 2.0**-10), 1e-8
HYPER = dict(momentum=MOMENTUM, betas=BETAS, eps=EPS)

# Tolerances. The parameters here are held to float32_bounds' bound, derived
# from each run (param_bounds below); PARAM_RTOL_OF_MAX, measured, is left
# for test_peer_accumulation.py's windows. Both sides apply float32
# arithmetic to bit-identical float16
# gradients; they differ only in operation order: the norm's summation order,
# the unscale-and-clip multiplier (DeepSpeed forms 1 / (clip * scale) in double
# and rounds it once; ours multiplies float32 1/scale by the float32 clip
# factor), and the optimizer's expression order (torch folds lr /
# bias_correction1 into addcdiv; optax divides by the bias corrections, then
# scales by -lr). Each update therefore differs by a few float32 ulps of the
# *update*, and now and then ``p + u`` rounds to the other neighbour of ``p``: a
# one-ulp flip of the parameter. Over 300 steps the largest difference measured
# (6 seeds x 4 runs) is 1.2e-7 * max|param| (about one ulp of the largest
# parameter); PARAM_RTOL_OF_MAX = 1e-6 leaves a factor of 8. Real differences
# are far above it: against unpatched DeepSpeed (half the gradient on growth
# steps) the same runs differ by 1.5e-4 to 7e-4 * max|param|; with optax's Adam
# count starting at 0 instead of DeepSpeed's 1, by 2.6e-4 * max|param|.
PARAM_RTOL_OF_MAX = 1e-6
# The reported norm: float32 sums of a few hundred squares in different orders
# (torch's vectorised reduction, XLA's tree reduction). Derived, as
# test_moe.py's: within (N + 10) * 2**-24 relative for any order, N = 221
# elements: 1.4e-5 (measured: 2.7e-7).
NORM_RTOL = (sum(int(np.prod(s)) for s in SHAPES) + 10) * 2.0**-24


def _gradient_sequence(rng):
  """Unscaled gradients spanning the float16 range at the scales the run
  reaches (about 2**11 to 2**15): magnitudes from 1e-6 (many elements underflow
  to fp16 subnormals or zero) up to where ``g * scale`` passes 65504 and the
  cast overflows; NaN in a random leaf on ~4% of the steps.
  """
  return oracles.random_gradient_sequence(
    rng,
    SHAPES,
    STEPS,
    log10_range=(-6, 1),
    bad_rate=NAN_RATE,
    bad_values=[np.nan],
  )


def _optax_optimizer(name):
  if name == "sgd_momentum":
    # torch SGD: buf = m * buf + g; p -= lr * buf
    return optax.sgd(LR[name], momentum=MOMENTUM)
  # eps added to sqrt(v_hat) in both
  return optax.adam(LR[name], b1=BETAS[0], b2=BETAS[1], eps=EPS)


def replay_args(optimizer, params0, records, scaler, clip):
  """What ``oracles.scan_steps`` needs to run fp16_scaling on the exact
  float16 gradients the peer was given, one ``lax.scan``: ``(tx, params,
  state, grads, None)``. The scan returns per-step arrays: params (list,
  [T, ...]), scale before, prev_loss_scale, loss_scale, overflow, grad_norm.
  """
  inner = _optax_optimizer(optimizer)
  tx = fs.chain(
    fs.fp16_loss_scale(scaler), fs.clip_by_unscaled_norm(clip), inner
  )
  # DeepSpeed's masters
  params = [
    jnp.asarray(p.astype(np.float16).astype(np.float32)) for p in params0
  ]
  state = tx.init(params)
  if optimizer == "adam":
    # DeepSpeed's fp16 optimizers run one inner step on zero gradients when
    # built: torch Adam's step count is 1 (moments still zero) before the first
    # real step. Do the same here.
    adam_state = inner.init(params)
    _, adam_state = inner.update(
      jax.tree.map(jnp.zeros_like, params), adam_state, params
    )
    loss_scale_state, clip_state, _ = state
    state = (loss_scale_state, clip_state, adam_state)
  grads = [jnp.asarray(np.stack(g)) for g in zip(*(r.grads for r in records))]
  assert all(g.dtype == jnp.float16 for g in grads)
  return tx, params, state, grads, None


def param_bounds(optimizer, records, params0, clip):
  """float32_bounds' elementwise bound on the master parameters, derived
  from the run: DeepSpeed's clip (``(norm + 1e-6) / clip``), the norms'
  NORM_RTOL, the optimizer's sensitivity and each side's roundings."""
  masters = [p.astype(np.float16).astype(np.float32) for p in params0]
  common = dict(lr=LR[optimizer], max_norm=clip, norm_rtol=NORM_RTOL)
  if optimizer == "sgd_momentum":
    return float32_bounds.sgd_momentum_param_bounds(
      records, masters, **common, momentum=MOMENTUM
    )
  # count_offset: DeepSpeed's step on zero gradients, as in the replay
  return float32_bounds.adam_param_bounds(
    records, masters, **common, betas=BETAS, eps=EPS, count_offset=1
  )


def assert_same_steps(records, ours, clip, bounds=None):
  """Every step: skip, scales, reported norm, master parameters (within
  ``bounds``, else PARAM_RTOL_OF_MAX). Returns event counts.
  """
  skipped, peer_norm = oracles.assert_same_steps(
    records,
    ours,
    norm_rtol=NORM_RTOL,
    param_rtol_of_max=None if bounds is not None else PARAM_RTOL_OF_MAX,
    param_bounds=bounds,
  )
  assert np.isinf(peer_norm[skipped]).all()
  # DeepSpeed's clip rule: clip = (norm + 1e-6) / clip_grad binds when > 1.
  binds = (peer_norm + 1e-6) / clip > 1
  return dict(
    skipped=int(skipped.sum()),
    clip_binds=int((binds & ~skipped).sum()),
    clip_free=int((~binds & ~skipped).sum()),
    growths=int(sum(r.scale_after > r.scale_before for r in records)),
    skips_at_floor=int(
      sum(r.skipped and r.scale_before == FLOOR for r in records)
    ),
  )


OPTIMIZERS = ("sgd_momentum", "adam")
FUSED = (True, False)


@pytest.fixture(scope="module")
def runs():
  """``{(fused, optimizer): (records, nan_steps, ours)}``: DeepSpeed's run of
  each case, the steps given a NaN, and fp16_scaling's replay. The peer runs
  case by case; one jit replays every case (a jit each compiled again what
  the chains share)."""
  ds = dict(init_scale=INIT_SCALE, scale_window=WINDOW, min_scale=FLOOR)
  scaler = fs.deepspeed_scaler(
    **ds, delayed_shift=1, raise_error_at_min_scale=False
  )
  keys, peer, args = [], [], []
  for fused in FUSED:
    for optimizer in OPTIMIZERS:
      rng = np.random.default_rng([SEED, fused, optimizer == "adam"])
      params0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
      seq, nan_steps = _gradient_sequence(rng)
      records = oracles.run_ds_fp16_optimizer(
        params0,
        seq,
        optimizer=optimizer,
        lr=LR[optimizer],
        clip_grad=CLIP,
        **ds,
        fused=fused,
        patched=True,
        **HYPER,
      )
      keys.append((fused, optimizer))
      peer.append((records, nan_steps, params0))
      args.append(replay_args(optimizer, params0, records, scaler, CLIP))
  ours = oracles.scan_steps_each(args)
  return {k: (*p, o) for k, p, o in zip(keys, peer, ours)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("fused", FUSED, ids=["fused", "unfused"])
def test_whole_steps_match_deepspeed_fp16_optimizer(fused, optimizer, runs):
  records, nan_steps, params0, ours = runs[fused, optimizer]
  bounds = param_bounds(optimizer, records, params0, CLIP)
  counts = assert_same_steps(records, ours, CLIP, bounds)
  # The bound: mostly p - lr u's rounding, half an ulp a step on each side
  # (300 * 2**-23 * |p|: 3.6e-5 * |p|); an unpatched DeepSpeed differs by
  # 1.5e-4 to 7e-4 * max|param|, at least twice the bound.
  largest = max(float(np.abs(p).max()) for p in params0)
  assert max(float(b.max()) for b in bounds) < 1.5e-4 / 2 * largest
  cast_overflows = sum(
    r.skipped for t, r in enumerate(records) if t not in nan_steps
  )
  print(
    f"\n{'fused' if fused else 'unfused'} {optimizer}: {STEPS} steps, "
    f"{counts}, "
    f"{cast_overflows} overflows in the fp16 cast, {len(nan_steps)} injected "
    f"NaN"
  )
  assert cast_overflows >= 10 and len(nan_steps) >= 5
  assert all(records[t].skipped for t in nan_steps)
  assert counts["clip_binds"] >= 50 and counts["clip_free"] >= 50
  assert counts["growths"] >= 10 and counts["skips_at_floor"] >= 3


# ------------------------------------------------------------------------------
# DeepSpeed 0.19's two bugs, pinned; fp16_scaling has neither.

# true norm exactly 1.0; 0.5 * 2**k is exact in float16
HALVES = [np.full((4,), 0.5, np.float32)]


def _ours_exact(scaler, steps):
  """Plain SGD, lr 1, no clip: each step's parameter change is the applied
  gradient.
  """
  tx = guarded(scaler, fs.clip_by_unscaled_norm(1e9), optax.sgd(1.0))
  params = [jnp.zeros((4,), jnp.float32)]
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    grads = [(HALVES[0] * fs.current_scale(s)).astype(jnp.float16)]
    return tx.update(grads, s, p)

  applied = []
  norms = []
  scales = []
  for _ in range(steps):
    updates, state = step(params, state)
    new = optax.apply_updates(params, updates)
    applied.append(np.asarray(params[0] - new[0]))
    params = new
    norms.append(float(fs.scale_metrics(state)["grad_norm"]))
    scales.append(float(fs.scale_metrics(state)["loss_scale"]))
  return applied, norms, scales


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_unpatched_deepspeed_still_has_both_bugs(fused):
  zero = [np.zeros(4, np.float32)]

  def run(**kw):
    return oracles.run_ds_fp16_optimizer(
      zero, [HALVES] * 6, lr=1.0, momentum=0.0, fused=fused, **kw
    )

  # 1. The unfused optimizer reports the norm still multiplied by the scale:
  # 128.0 for a true 1.0.
  static = run(init_scale=128.0, dynamic=False)
  assert [r.norm for r in static] == [128.0 if not fused else 1.0] * 6
  # 2. Scale 128, window 2: DeepSpeed grows on steps 2 and 4, before unscaling,
  # so it divides those steps' gradients by the new scale and applies half of
  # them.
  dynamic = run(init_scale=128.0, scale_window=2)
  before = zero + [r.params[0] for r in dynamic[:-1]]
  # SGD, lr 1: the applied gradient
  applied = [b - r.params[0] for b, r in zip(before, dynamic)]
  growth = [r.scale_after > r.scale_before for r in dynamic]
  assert growth == [False, False, True, False, True, False]
  for a, g in zip(applied, growth):
    np.testing.assert_array_equal(a, np.full(4, 0.25 if g else 0.5, np.float32))
  if fused:  # and reports half the norm there
    assert [r.norm for r in dynamic] == [0.5 if g else 1.0 for g in growth]
  else:  # and reports the norm times the scale the gradients were made with
    assert (
      [r.norm for r in dynamic]
      == [r.scale_before for r in dynamic]
      == [128, 128, 128, 256, 256, 512]
    )
  # The upstream fix (patched=True) applies the whole gradient and reports the
  # true norm.
  fixed = run(init_scale=128.0, scale_window=2, patched=True)
  assert [r.norm for r in fixed] == [1.0] * 6
  assert [r.scale_after for r in fixed] == [r.scale_after for r in dynamic]
  np.testing.assert_array_equal(
    fixed[-1].params[0], np.full(4, -3.0, np.float32)
  )
  # fp16_scaling: the same scales, the full gradient every step, 1.0 reported.
  applied, norms, scales = _ours_exact(
    fs.deepspeed_scaler(init_scale=128.0, scale_window=2, min_scale=1.0), 6
  )
  assert scales == [r.scale_after for r in dynamic]
  assert norms == [1.0] * 6
  for a in applied:
    np.testing.assert_array_equal(a, HALVES[0])
  applied, norms, _ = _ours_exact(fs.static_scaler(128.0), 1)
  assert norms == [1.0]
  np.testing.assert_array_equal(applied[0], HALVES[0])
