"""Gradient accumulation against the peers' own accumulation recipes.

Windows of K float16 microbatch gradients go through torch's recipe
(``scaler.scale(loss / K).backward()`` K times, then ``unscale_``,
``clip_grad_norm_``, ``step``, ``update``) and DeepSpeed's fp16 optimizers
(``backward(loss / K)`` K times, then ``step``, with the upstream fix of
``test_deepspeed.py``), run by the peers (``oracles_accumulate``), and the
very same microbatch gradients go to::

    accumulate_gradients(chain(fp16_loss_scale(...),
                         clip_by_unscaled_norm(...), <the same optimizer>), K)

in one ``lax.scan``. Window by window: the same skipped windows, the same
scale before and after, the same reported norm and the same master
parameters, within the whole-step tests' tolerances.

torch sums ``h_i / K`` into float32 ``.grad`` in the same order as
fp16_scaling's float32 accumulator, so its windows' gradients are the same
bits. DeepSpeed sums into float16 ``.grad``; its microbatch gradients are
drawn on a grid where every float16 partial sum is exact (``_grid_windows``),
so that the comparison measures the recipe, not float16 rounding.
"""

import float32_bounds
import jax
import jax.numpy as jnp
import numpy as np
import optax
import oracles
import oracles_accumulate
import pytest

import fp16_scaling as fs

oracles.require("torch")
oracles.init_deepspeed()

import test_deepspeed  # noqa: E402  (the whole-step tests' settings)
import test_torch  # noqa: E402

K = 4
WINDOWS = 200


def _windows(seq):
  return [seq[w * K : (w + 1) * K] for w in range(len(seq) // K)]


def _replay(tx, params, state, records):
  """Every microbatch through ``tx`` in one scan; the windows' last calls."""
  grads = _microbatches(records, params)
  return _window_ends(oracles.scan_steps(tx, params, state, grads))


def _microbatches(records, params):
  """Every microbatch's float16 gradients, stacked per leaf."""
  grads = [
    jnp.asarray(np.stack([mb[i] for r in records for mb in r.grads]))
    for i in range(len(params))
  ]
  assert all(g.dtype == jnp.float16 for g in grads)
  return grads


def _window_ends(out):
  """A replay's outputs at the windows' last calls."""
  ends = slice(K - 1, None, K)
  return ([p[ends] for p in out[0]],) + tuple(x[ends] for x in out[1:])


def _assert_same_windows(
  records, ours, norm_rtol, bounds=None, param_rtol=None
):
  """Skips, scales, norms, and the master parameters within ``bounds``
  (float32_bounds', derived from the run: per parameter, a bound a window
  and element), or within ``param_rtol`` of their largest magnitude
  (``oracles.assert_same_steps``)."""
  skipped, peer_norm = oracles.assert_same_steps(
    records,
    ours,
    norm_rtol=norm_rtol,
    param_rtol_of_max=param_rtol,
    param_bounds=bounds,
  )
  if bounds is not None:
    # Tight enough to see a real difference (test_deepspeed.py: an unpatched
    # DeepSpeed moves the parameters by 1.5e-4 * max|param| and more).
    largest = max(float(np.abs(p).max()) for p in records[0].params)
    assert max(float(b.max()) for b in bounds) < 1.5e-4 / 2 * largest
  return skipped, peer_norm


# ------------------------------------------------------------------------------
# torch.amp


TORCH_MAX_NORM = 0.5
TORCH_SCALER = test_torch.SCALERS["powers_of_two"]


def _assert_exercised(peer, records, bad, skipped, binds):
  """Every window with an injected NaN was skipped, and the run was not
  vacuous: injected and cast overflows, windows where the clip bound and
  where it did not, and scale growths, each often enough."""
  injected = sorted({t // K for t in bad})
  assert skipped[injected].all()
  counts = dict(
    skipped=int(skipped.sum()),
    cast_overflows=int(skipped.sum()) - len(injected),
    clip_binds=int((binds & ~skipped).sum()),
    clip_free=int((~binds & ~skipped).sum()),
    growths=int(sum(r.scale_after > r.scale_before for r in records)),
  )
  print(f"\n{peer}, {WINDOWS} windows of {K}: {counts}")
  assert len(injected) >= 5 and counts["cast_overflows"] >= 5
  assert counts["clip_binds"] >= 20 and counts["clip_free"] >= 20
  assert counts["growths"] >= 5


def test_accumulation_matches_torch_amp_recipe(seed):
  rng = np.random.default_rng([seed, 9])
  shapes = test_torch.SHAPES
  params0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  # Unscaled magnitudes such that g * 2**16 spans float16, from flushing to
  # zero to overflowing in the cast; NaN, +inf or -inf in 2% of microbatches.
  seq, bad = oracles.random_gradient_sequence(
    rng,
    shapes,
    WINDOWS * K,
    log10_range=(-9, -0.5),
    bad_rate=0.02,
    bad_values=[np.nan, np.inf, -np.inf],
  )
  lr, betas, eps = test_torch.LR, test_torch.BETAS, test_torch.EPS
  adam = dict(lr=lr, betas=betas, eps=eps, max_norm=TORCH_MAX_NORM)
  records = oracles_accumulate.run_torch_amp_accumulate(
    params0, _windows(seq), **adam, **TORCH_SCALER
  )
  tx = fs.accumulate_gradients(
    fs.chain(
      fs.fp16_loss_scale(fs.torch_scaler(**TORCH_SCALER)),
      fs.clip_by_unscaled_norm(TORCH_MAX_NORM),
      optax.adam(lr, b1=betas[0], b2=betas[1], eps=eps),
    ),
    K,
  )
  params = [jnp.asarray(p) for p in params0]
  ours = _replay(tx, params, tx.init(params), records)
  # the window's float32 sums in .grad: k * 2**-24 of their |terms|
  bounds = float32_bounds.adam_param_bounds(
    records, params0, **adam, norm_rtol=test_torch.NORM_RTOL
  )
  skipped, peer_norm = _assert_same_windows(
    records, ours, test_torch.NORM_RTOL, bounds
  )
  binds = TORCH_MAX_NORM / (peer_norm + 1e-6) < 1
  _assert_exercised("torch.amp", records, bad, skipped, binds)


# ------------------------------------------------------------------------------
# DeepSpeed


DS_SCALER = dict(init_scale=2.0**14, scale_window=4, min_scale=2.0**11)
DS_CLIP = 3.0


def _grid_windows(rng, shapes):
  """Unscaled microbatch gradients ``n * 2**f``, ``|n| < 2**9``, with one
  exponent ``f`` per element: at a scale ``2**j``, ``j`` in [11, 15], the
  float16 gradient ``n * 2**(f + j)`` and every partial sum of ``h_i / 4``
  are exact in float16. ``f`` spans [-33, -10] (float16 values from 2**-22
  to 2**14); a few hot elements have ``f = -7``, which overflows the cast
  at 2**15 for ``|n| >= 256``. NaN in 2% of the microbatches."""
  exps = []
  for s in shapes:
    e = rng.integers(-33, -9, size=s)
    e.reshape(-1)[rng.choice(e.size, 2, replace=False)] = -7
    exps.append(e)
  seq, bad = [], []
  for t in range(WINDOWS * K):
    grads = [
      (rng.integers(-511, 512, size=s) * 2.0**e).astype(np.float32)
      for s, e in zip(shapes, exps)
    ]
    if rng.random() < 0.02:
      leaf = grads[rng.integers(len(grads))]
      leaf.reshape(-1)[rng.integers(leaf.size)] = np.nan
      bad.append(t)
    seq.append(grads)
  return seq, bad


DS_CASES = {  # id: (fused, optimizer)
  "fused-sgd_momentum": (True, "sgd_momentum"),
  "unfused-adam": (False, "adam"),
}


def _ds_case(seed, fused, optimizer):
  """DeepSpeed's run of one case, the steps given an inf, and what
  ``oracles.scan_steps`` needs to replay every microbatch through ours."""
  rng = np.random.default_rng([seed, 9, fused])
  shapes = test_deepspeed.SHAPES
  params0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  seq, bad = _grid_windows(rng, shapes)
  lr = test_deepspeed.LR[optimizer]
  records = oracles_accumulate.run_ds_fp16_optimizer_accumulate(
    params0,
    _windows(seq),
    optimizer=optimizer,
    lr=lr,
    clip_grad=DS_CLIP,
    **DS_SCALER,
    fused=fused,
    **test_deepspeed.HYPER,
  )
  inner = test_deepspeed._optax_optimizer(optimizer)
  scaler = fs.deepspeed_scaler(
    **DS_SCALER, delayed_shift=1, raise_error_at_min_scale=False
  )
  tx = fs.accumulate_gradients(
    fs.chain(
      fs.fp16_loss_scale(scaler), fs.clip_by_unscaled_norm(DS_CLIP), inner
    ),
    K,
  )
  # DeepSpeed's masters
  params = [
    jnp.asarray(p.astype(np.float16).astype(np.float32)) for p in params0
  ]
  state = tx.init(params)
  if optimizer == "adam":
    # DeepSpeed's optimizers run one inner step on zero gradients when built
    # (see test_deepspeed.replay_args): Adam's count starts at 1.
    adam = inner.init(params)
    _, adam = inner.update(jax.tree.map(jnp.zeros_like, params), adam, params)
    ls, clip, _ = state.inner_state
    state = state._replace(inner_state=(ls, clip, adam))
  return records, bad, (tx, params, state, _microbatches(records, params))


@pytest.fixture(scope="module")
def ds_runs(seed):
  """``{case: (records, bad, ours)}`` for DS_CASES: the peer runs case by
  case; one jit replays both (a jit each compiled again what the chains
  share)."""
  cases = {k: _ds_case(seed, *v) for k, v in DS_CASES.items()}
  ours = oracles.scan_steps_each([(*c[2], None) for c in cases.values()])
  return {
    k: (records, bad, _window_ends(out))
    for (k, (records, bad, _)), out in zip(cases.items(), ours)
  }


@pytest.mark.parametrize("case", DS_CASES)
def test_accumulation_matches_deepspeed_fp16_optimizer(case, ds_runs):
  fused, optimizer = DS_CASES[case]
  records, bad, ours = ds_runs[case]
  # The parameters: test_deepspeed.py's measured tolerance, not a derived
  # one. DeepSpeed adds the window's microbatches into float16 .grad, and
  # the bound of a float16 sum (k * 2**-11 of its |terms|, float32_bounds'
  # float16_sums) carried through Adam is above the differences this test
  # must see (an unpatched DeepSpeed: 1.5e-4 * max|param|); in these runs
  # the float16 sums of h / k are exact, which no bound can assume.
  skipped, peer_norm = _assert_same_windows(
    records,
    ours,
    test_deepspeed.NORM_RTOL,
    param_rtol=test_deepspeed.PARAM_RTOL_OF_MAX,
  )
  binds = (peer_norm + 1e-6) / DS_CLIP > 1
  _assert_exercised(
    f"DeepSpeed {fused=} {optimizer}", records, bad, skipped, binds
  )


def test_deepspeed_engine_divides_each_microbatch_loss_by_gas():
  """DeepSpeed's engine divides every microbatch's loss by
  gradient_accumulation_steps before its backward pass: the recipe that
  examples/train_lm.py's ``accumulate`` (and the accum-128 setting of
  examples/compare_precision.py) reproduces, whose float16 gradients are that
  many times smaller.
  """
  from deepspeed.runtime.engine import DeepSpeedEngine
  import torch

  class Engine:
    def gradient_accumulation_steps(self):
      return 128

  loss = torch.tensor(3.0)
  scaled = DeepSpeedEngine._scale_loss_by_gas(Engine(), loss)
  assert scaled.item() == 3.0 / 128
