"""Error bounds for a torch (or DeepSpeed) optimizer replay against optax's,
derived from the computation, not measured (tests/peers/test_torch.py,
tests/peers/test_deepspeed.py).

Both sides are given the same scaled float32 gradients, so their parameters
part only through float32 arithmetic done in different orders, and through
the clip's multiplier: ``clip_grad_norm_`` takes ``max_norm / (norm +
1e-6)`` from its own norm, ours ``max_norm / norm`` from ours (the two norms
within ``norm_rtol``). Per element, with ``U = 2**-24`` (one float32
rounding to nearest, relative):

- the clipped unscaled gradients differ by at most ``r * |g|``, ``r =
  norm_rtol + 1e-6 / norm + 8 U`` where either clip may bind (the
  multipliers' roundings and the unscale's), ``8 U`` elsewhere (both
  multiply by 1);
- Adam passes that on: ``|m_hat' - m_hat| <= r m_hat_abs`` (``m_abs``: the
  same filter of ``|g|``) and ``|sqrt(v_hat') - sqrt(v_hat)| <= r
  sqrt(v_hat)``, so ``u = m_hat / (sqrt(v_hat) + eps)`` moves by at most ``r
  (m_hat_abs + |m_hat|) / (sqrt(v_hat) + eps)``;
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


def _clip(norm, max_norm, norm_rtol):
  """The clip's multiplier (torch's and DeepSpeed's: ``max_norm / (norm +
  1e-6)``, at most 1) and the relative bound ``r`` on the two sides' clipped
  gradients."""
  # Where either side's clip may bind (below, both multiply by 1).
  if norm * (1 + norm_rtol) + 1e-6 >= max_norm:
    return min(1.0, max_norm / (norm + 1e-6)), 8 * U + norm_rtol + 1e-6 / norm
  return 1.0, 8 * U


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
):
  """Per parameter, ``(steps, *shape)`` bounds on |ours - torch's| after
  each step of ``records`` (``oracles.run_torch_amp``'s, or
  ``run_ds_fp16_optimizer``'s: its Adam counts one step on zero gradients
  before the first, ``count_offset=1``)."""
  b1, b2 = betas
  zeros = [np.zeros(np.shape(p)) for p in params0]
  m, m_abs, v, e_m, e_v, d = ([z.copy() for z in zeros] for _ in range(6))
  before = [np.abs(np.asarray(p, np.float64)) for p in params0]
  out = [[] for _ in params0]
  k, r_max = 0, 0.0
  for rec in records:
    if rec.skipped:  # both keep every bit
      for i in range(len(params0)):
        out[i].append(zeros[i] if follow_peer else d[i].copy())
      continue
    k += 1
    c, r = _clip(rec.norm, max_norm, norm_rtol)
    r_max = max(r_max, r)
    bc1, bc2 = 1 - b1 ** (k + count_offset), 1 - b2 ** (k + count_offset)
    for i in range(len(params0)):
      g = np.asarray(rec.grads[i], np.float64) / rec.scale_before * c
      m[i] = b1 * m[i] + (1 - b1) * g
      m_abs[i] = b1 * m_abs[i] + (1 - b1) * np.abs(g)
      v[i] = b2 * v[i] + (1 - b2) * g**2
      e_m[i] = b1 * e_m[i] + 3 * U * m_abs[i]
      e_v[i] = b2 * e_v[i] + 4 * U * v[i]
      m_hat, m_abs_hat, v_hat = m[i] / bc1, m_abs[i] / bc1, v[i] / bc2
      root = np.sqrt(v_hat)
      den = root + eps
      u = m_hat / den
      given = r_max * (m_abs_hat + np.abs(m_hat)) / den
      # One side's own roundings: the moments' (|d sqrt(v)| <= |dv| / 2
      # sqrt(v)), then 4 of u.
      with np.errstate(divide="ignore", invalid="ignore"):
        dv = np.where(root > 0, e_v[i] / bc2 / (2 * root), 0.0)
      own = (e_m[i] / bc1 + np.abs(u) * dv) / den + 4 * U * np.abs(u)
      p = np.abs(np.asarray(rec.params[i], np.float64))
      step = lr * (given + 2 * own) + 2 * U * (p + lr * np.abs(u))
      if weight_decay:
        step += 2 * U * (before[i] + lr * weight_decay * before[i])
      d[i] = step if follow_peer else d[i] + step
      out[i].append(d[i].copy())
      before[i] = p
  return [np.stack(o) for o in out]


def sgd_momentum_param_bounds(
  records, params0, *, lr, momentum, max_norm, norm_rtol
):
  """As ``adam_param_bounds``, for SGD with momentum (torch's and optax's:
  ``b = mu b + g``, ``p -= lr b``): the buffer moves by at most ``r b_abs``
  (``b_abs`` the same filter of ``|g|``) from the inputs, and by its own 2
  roundings a step, carried by the filter; the step rounds ``lr b`` and the
  sum. Free-running: the bounds add up."""
  zeros = [np.zeros(np.shape(p)) for p in params0]
  b_abs, b, e_b, d = ([z.copy() for z in zeros] for _ in range(4))
  out = [[] for _ in params0]
  r_max = 0.0
  for rec in records:
    if rec.skipped:
      for i in range(len(params0)):
        out[i].append(d[i].copy())
      continue
    c, r = _clip(rec.norm, max_norm, norm_rtol)
    r_max = max(r_max, r)
    for i in range(len(params0)):
      g = np.asarray(rec.grads[i], np.float64) / rec.scale_before * c
      b[i] = momentum * b[i] + g
      b_abs[i] = momentum * b_abs[i] + np.abs(g)
      e_b[i] = momentum * e_b[i] + 2 * U * b_abs[i]
      p = np.abs(np.asarray(rec.params[i], np.float64))
      d[i] = d[i] + lr * (r_max * b_abs[i] + 2 * e_b[i])
      d[i] = d[i] + 2 * U * (p + lr * np.abs(b[i]))
      out[i].append(d[i].copy())
  return [np.stack(o) for o in out]
