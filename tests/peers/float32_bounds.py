"""Error bounds for a torch (or DeepSpeed) optimizer replay against optax's,
derived from the computation, not measured (tests/peers/test_torch.py,
tests/peers/test_deepspeed.py).

Both sides are given the same scaled float32 gradients, so their parameters
part only through float32 arithmetic done in different orders, and through
the clip's multiplier: ``clip_grad_norm_`` takes ``max_norm / (norm +
1e-6)`` from its own norm, ours ``max_norm / norm`` from ours (the two norms
within ``norm_rtol``). Per element, with ``U = 2**-24`` (one float32
rounding to nearest, relative):

- the clipped unscaled gradients differ by at most ``dg = r * |g| + c *
  acc``, ``r = norm_rtol + 1e-6 / norm + 8 U`` where either clip may bind
  (the multipliers' roundings and the unscale's), ``8 U`` elsewhere (both
  multiply by 1); ``acc`` is an accumulation window's sum of its ``k``
  microbatches in another order: ``k U`` times the sum of their absolute
  values (``float16_sums``: DeepSpeed adds them into float16 ``.grad``,
  ``k 2**-11``, and each ``h / k`` may round to a float16 subnormal, 2**-25
  scaled);
- the optimizer passes that on through the same filters it runs: Adam's
  ``m`` moves by at most the filter of ``dg``, ``sqrt(v)`` by the root of
  the filter of ``dg**2`` (Minkowski), so ``u = m_hat / (sqrt(v_hat) +
  eps)`` moves by at most ``(dm + |u| dv) / (den - dv)``;
- each side's own roundings: a moment's filter rounds 3 (m) or 4 (v) times
  a step, each within ``U`` of a value no larger than ``m_abs`` (``v``), and
  the filter carries them on (``e = b e + 3 U m_abs``, exactly as the
  moment); the bias corrections, the root, ``+ eps`` and the division add 4
  roundings of ``u``; the step ``p - lr u`` rounds ``lr u`` and the sum;
- AdamW's decay: torch multiplies ``p (1 - lr wd)`` (one rounding of ``p``),
  optax adds ``wd p`` to ``u`` (one rounding of it): at most ``2 U (|p| + lr
  wd |p|)`` apart.

No gradient depends on the parameters (they are given), so nothing feeds
back: free-running, the per-step bounds add up; step by step (each step from
torch's parameters, ``follow_peer``), one step's bound is left.
"""

import numpy as np

U = 2.0**-24


def _inputs(rec, max_norm, norm_rtol, float16_sums):
  """Per parameter, the clipped unscaled gradient of a step (a window: the
  mean of its microbatches) and the bound ``dg`` on the two sides'."""
  windowed = isinstance(rec.grads[0], list)
  micro = rec.grads if windowed else [rec.grads]
  k = len(micro)
  # Where either side's clip may bind (below, both multiply by 1).
  c = 1.0  # the clip's multiplier
  r = 8 * U  # the relative bound on the clipped unscaled gradient
  may_bind = rec.norm * (1 + norm_rtol) + 1e-6 >= max_norm
  if may_bind:
    c = min(1.0, max_norm / (rec.norm + 1e-6))
    r = r + norm_rtol + 1e-6 / rec.norm
  per_sum = 0.0  # a window's sum in another order, relative to sum |h|
  if k > 1:
    one_add = 2.0**-11 if float16_sums else U  # DeepSpeed adds in float16
    per_sum = k * one_add
  out = []
  for i in range(len(micro[0])):
    # Each microbatch's unscaled gradient of parameter i.
    grads = [np.asarray(mb[i], np.float64) for mb in micro]
    hs = [x / rec.scale_before for x in grads]
    g = sum(hs) / k * c
    abs_sum = sum(np.abs(h) for h in hs)
    acc = per_sum * abs_sum / k * c
    if float16_sums and k > 1:  # h / k rounded to a float16 subnormal
      acc = acc + 2.0**-25 / rec.scale_before * c
    dg = r * np.abs(g) + acc
    out.append((g, dg))
  return out


def _zeros(params):
  """float64 zeros shaped as each of ``params``."""
  return [np.zeros(np.shape(p)) for p in params]


def _filtered(x, decay, value):
  """One step of an exponential moving average: ``decay x + (1 - decay)
  value``, as Adam's moments filter their inputs."""
  return decay * x + (1 - decay) * value


def adam_param_bounds(
  records,
  params0,
  *,
  lr,
  betas,
  eps,
  max_norm,
  norm_rtol,
  weight_decay=0.0,
  follow_peer=False,
  count_offset=0,
  float16_sums=False,
):
  """Per parameter, ``(steps, *shape)`` bounds on |ours - torch's| after
  each step of ``records`` (``oracles.run_torch_amp``'s, or
  ``run_ds_fp16_optimizer``'s: its Adam counts one step on zero gradients
  before the first, ``count_offset=1``; or a window's, from
  ``oracles_accumulate``)."""
  b1, b2 = betas
  n = len(params0)
  z = _zeros(params0)
  m = _zeros(params0)  # Adam's first moment, of our side's inputs
  m_abs = _zeros(params0)  # the same filter of |g|: m's roundings' scale
  v = _zeros(params0)  # the second moment
  dm = _zeros(params0)  # m's filter of dg: the other side's m is within it
  dv2 = _zeros(params0)  # v's filter of dg**2: sqrt(v) moves within its root
  e_m = _zeros(params0)  # one side's own roundings of m, carried on
  e_v = _zeros(params0)  # and of v
  d = _zeros(params0)  # the bound on the parameters
  before = [np.abs(np.asarray(p, np.float64)) for p in params0]
  out = [[] for _ in params0]
  k = 0
  for rec in records:
    if rec.skipped:  # both keep every bit
      for i in range(n):
        out[i].append(z[i] if follow_peer else d[i].copy())
      continue
    k += 1
    count = k + count_offset  # the step count Adam's bias corrections see
    bc1 = 1 - b1**count
    bc2 = 1 - b2**count
    inputs = _inputs(rec, max_norm, norm_rtol, float16_sums)
    for i, (g, dg) in enumerate(inputs):
      m[i] = _filtered(m[i], b1, g)
      m_abs[i] = _filtered(m_abs[i], b1, np.abs(g))
      v[i] = _filtered(v[i], b2, g**2)
      dm[i] = _filtered(dm[i], b1, dg)
      dv2[i] = _filtered(dv2[i], b2, dg**2)
      e_m[i] = b1 * e_m[i] + 3 * U * m_abs[i]
      e_v[i] = b2 * e_v[i] + 4 * U * v[i]
      root = np.sqrt(v[i] / bc2)
      den = root + eps
      u = m[i] / bc1 / den
      # The other side's inputs, and one side's own roundings (the moments'
      # filters; |d sqrt(v)| <= |dv| / 2 sqrt(v)), then 4 of u.
      with np.errstate(divide="ignore", invalid="ignore"):
        own_v = np.where(root > 0, e_v[i] / bc2 / (2 * root), 0.0)
      dmh = dm[i] / bc1 + 2 * e_m[i] / bc1
      dvh = np.sqrt(dv2[i] / bc2) + 2 * own_v
      low = np.maximum(den - dvh, eps)
      abs_u = np.abs(u)
      from_moments = (dmh + abs_u * dvh) / low
      du = from_moments + 8 * U * abs_u
      p = np.abs(np.asarray(rec.params[i], np.float64))
      own_step = 2 * U * (p + lr * abs_u)  # p - lr u rounds twice
      step = lr * du + own_step
      if weight_decay:
        decay = 2 * U * (before[i] + lr * weight_decay * before[i])
        step += decay
      d[i] = step if follow_peer else d[i] + step
      out[i].append(d[i].copy())
      before[i] = p
  return [np.stack(o) for o in out]


def sgd_momentum_param_bounds(
  records, params0, *, lr, momentum, max_norm, norm_rtol, float16_sums=False
):
  """As ``adam_param_bounds``, for SGD with momentum (torch's and optax's:
  ``b = mu b + g``, ``p -= lr b``): the buffer moves by at most the same
  filter of ``dg``, and by its own 2 roundings a step, carried by the
  filter; the step rounds ``lr b`` and the sum. Free-running: the bounds add
  up."""
  b = _zeros(params0)  # the momentum buffer, of our side's inputs
  b_abs = _zeros(params0)  # the same filter of |g|: its roundings' scale
  db = _zeros(params0)  # its filter of dg
  e_b = _zeros(params0)  # one side's own roundings of it, carried on
  d = _zeros(params0)  # the bound on the parameters
  out = [[] for _ in params0]
  for rec in records:
    if rec.skipped:
      for i in range(len(params0)):
        out[i].append(d[i].copy())
      continue
    inputs = _inputs(rec, max_norm, norm_rtol, float16_sums)
    for i, (g, dg) in enumerate(inputs):
      b[i] = momentum * b[i] + g
      b_abs[i] = momentum * b_abs[i] + np.abs(g)
      db[i] = momentum * db[i] + dg
      e_b[i] = momentum * e_b[i] + 2 * U * b_abs[i]
      p = np.abs(np.asarray(rec.params[i], np.float64))
      from_inputs = lr * (db[i] + 2 * e_b[i])
      own = 2 * U * (p + lr * np.abs(b[i]))  # the step's two roundings
      d[i] = d[i] + from_inputs + own
      out[i].append(d[i].copy())
  return [np.stack(o) for o in out]
