"""Error bounds for comparing a torch float16 run with a JAX one, derived
from the computation, not measured (tests/peers/test_porting_torch.py).

The model is docs/porting-torch.md's: ``pred = relu(x @ W1) @ w2``, computed
in float16 on float32 parameters. Both frameworks compute each float16
operation from the same float16 operands with float32 accumulation (torch's
CPU kernels accumulate float16 in float32, its opmath type; XLA:CPU promotes
a float16 dot to float32 and converts the result) and round the result once
to float16. One rounding to nearest is within U = 2**-11 of the exact value,
relative; so each framework's result is within R * U of the exact one, and
the two within 2 * R * U = R * 2**-10, where R counts the roundings on the
path, each relative to the sum of the absolute values of the terms it
rounds (a rounding error carried through a sum or a product is bounded by
the same sum of absolute values).

That "absolute gradient" is the gradient of a positive surrogate: the same
network at ``|x|``, ``|W1|``, ``|w2|``, with the ReLU mask of the real
forward, differentiated with the cotangent ``c = 2/n (|pred - y| +
|pred|_abs)`` (the loss's cotangent plus the forward roundings' share).
Every term of the surrogate's gradient is the absolute value of a term of
the real one, so no cancellation hides an error.

The parameters then drift apart through the optimizer. A difference ``d``
in the parameters changes the next gradient by at most ``H_abs @ d``, with
``H_abs`` the surrogate's Hessian, elementwise at least ``|H|``; the updates'
own float32 roundings add at most 2**-23 * |p| a step (one half-ulp in each
framework). Each bound is one step's, by induction: from the difference the
two runs have before the step (observed), what the step can add to it; a
worst case compounded over the run would soon bound nothing.
"""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np

U = 2.0**-11  # float16's unit roundoff
F32 = 2.0**-23  # two float32 half-ulps, relative: one in each framework


def _net_abs(params, xa, mask):
  """The positive surrogate of the page's MLP at ``|params|``, ``|x|``."""
  h = (xa @ params["hidden"]["kernel"]) * mask
  w2 = params["out"]["kernel"][:, 0]
  return h @ w2


def _pred(params, x):
  """The page's MLP."""
  h = jax.nn.relu(x @ params["hidden"]["kernel"])
  w2 = params["out"]["kernel"][:, 0]
  return h @ w2


def _relu_mask(params, x):
  """1.0 where the hidden layer's ReLU passes, else 0.0."""
  return (x @ params["hidden"]["kernel"] > 0).astype(jnp.float32)


def _combo_abs(coeffs, absp, xa, masks):
  """``sum_j |coeffs[j]| * surrogate_j(|x|)``: the loss's combination of
  the nets, at absolute values."""
  return sum(
    abs(a) * _net_abs(q, xa, m) for a, q, m in zip(coeffs, absp, masks)
  )


def _parts(nets, losses):
  """Per loss: the nets' |parameters|, each net's |x| and ReLU mask, and the
  cotangent bound ``c``. ``losses``: ``(coeffs, x, y)``, the loss
  ``mean((sum_j coeffs[j] * net_j(x) - y) ** 2)``."""
  absp = [jax.tree.map(jnp.abs, p) for p in nets]
  out = []
  for coeffs, x, y in losses:
    x = jnp.asarray(x, jnp.float32)
    xa = jnp.abs(x)
    masks = [_relu_mask(p, x) for p in nets]
    combo = sum(a * _pred(p, x) for a, p in zip(coeffs, nets))
    combo_abs = _combo_abs(coeffs, absp, xa, masks)
    n = x.shape[0]
    residual = jnp.abs(combo - y) + combo_abs  # with the roundings' share
    c = 2.0 / n * residual
    out.append((coeffs, xa, masks, c))
  return absp, out


def _surrogate(absp, parts, quadratic):
  """``sum_k sum_r c_kr * combo_abs_kr`` (its gradient: the absolute
  gradient), plus ``combo_abs**2 / n`` when ``quadratic`` (its Hessian then
  bounds the loss's |Hessian| elementwise)."""
  total = 0.0
  for coeffs, xa, masks, c in parts:
    combo = _combo_abs(coeffs, absp, xa, masks)
    total += jnp.sum(c * combo)
    if quadratic:
      n = xa.shape[0]
      total += jnp.sum(combo**2) / n
  return total


def abs_grad(nets, losses):
  """The absolute gradient: one tree per net, every element at least the sum
  of the absolute values of the terms of the true gradient's element."""
  absp, parts = _parts(nets, losses)

  def surrogate(q):
    return _surrogate(q, parts, False)

  return jax.grad(surrogate)(absp)


def abs_hessian(nets, losses):
  """An elementwise bound on the |Hessian| of the summed losses over all
  nets' parameters, flattened in ``jax.flatten_util.ravel_pytree`` order."""
  absp, parts = _parts(nets, losses)
  flat, unravel = jax.flatten_util.ravel_pytree(absp)

  def surrogate(f):
    return _surrogate(unravel(f), parts, True)

  return np.asarray(jax.hessian(surrogate)(flat), np.float64)


def flat(tree):
  return np.asarray(jax.flatten_util.ravel_pytree(tree)[0], np.float64)


def update_roundings(params):
  """The two runs' own float32 roundings of an update, flat: ``F32 * |p|``
  of the parameters after it."""
  return F32 * np.abs(flat(params))


def gap(a, b):
  """``|a - b|`` of two parameter trees, elementwise, flat."""
  return np.abs(flat(a) - flat(b))


def mlp_bounds(params, x, y, rounds, scale):
  """eps (``rounds`` float16 roundings of the absolute gradient, at loss
  scale ``scale``), the |Hessian| bound, and the float32 gradient, flat, of
  the page's mse at ``params`` on ``(x, y)``."""
  losses = [((1.0,), x, y)]
  abs_grads = abs_grad([params], losses)
  eps = rounds * 2.0**-10 * flat(abs_grads)
  # A subnormal float16 result's rounding is absolute: at most 2**-25 in
  # the scaled gradient; 8 rows of |x| carry it into dW.
  largest = float(np.abs(x).max())
  eps += rounds * 8 * largest * 2.0**-25 / scale

  def mse(p):
    return jnp.mean((_pred(p, x) - y) ** 2)

  g = jax.grad(mse)(params)
  hess = abs_hessian([params], losses)
  return eps, hess, flat(g)


def adam_ratio_bound(t, b1=0.9, b2=0.999):
  """The largest |m_hat| / sqrt(v_hat) of bias-corrected Adam after ``t``
  steps, over every gradient sequence: with weights ``w`` (m's) and ``w2``
  (v's), Cauchy-Schwarz gives sqrt(sum w**2 / w2)."""
  s = np.arange(t)
  w = (1 - b1) * b1**s / (1 - b1**t)
  w2 = (1 - b2) * b2**s / (1 - b2**t)
  terms = w**2 / w2
  return float(np.sqrt(np.sum(terms)))


def adam_step_bounds(steps, lr, b1=0.9, b2=0.999):
  """Bounds on |p_torch - p_jax| after each Adam step: ``steps`` lists, per
  applied step, ``(d, eps, hess, p, g)``: the two runs' difference before
  the step (flat, elementwise), the gradients' rounding bound, the
  |Hessian| bound, the parameters after the step and the float32 gradient.
  Each run's gradient is taken at its own parameters, so the two differ by
  ``e = eps + hess @ d``. Adam's update ``u = m_hat / sqrt(v_hat)``: with
  every gradient so far within ``E = max(e)`` of the other run's
  (elementwise), ``|m_hat' - m_hat| <= E`` and ``|sqrt(v_hat') -
  sqrt(v_hat)| <= E`` (a weighted root mean square is 1-Lipschitz), so
  ``|u' - u| <= (1 + B) E / sqrt(v_hat)_low``, ``B = adam_ratio_bound``,
  and never more than ``2 B``: where a gradient is near 0, Adam magnifies
  its error up to that cap."""
  v = big_e = None
  out = []
  for k, (d, eps, hess, p, g) in enumerate(steps, 1):
    if v is None:
      v = np.zeros_like(p)
      big_e = np.zeros_like(p)
    e = eps + hess @ d  # this step's gradients, one run's against the other's
    big_e = np.maximum(big_e, e)
    v = b2 * v + (1 - b2) * g**2
    v_hat = v / (1 - b2**k)
    low = np.sqrt(v_hat) - 2 * big_e  # both runs' sqrt(v_hat)
    ratio = adam_ratio_bound(k, b1, b2)
    du = np.full_like(p, 2 * ratio)
    ok = low > 0
    from_inputs = (1 + ratio) * big_e[ok] / low[ok]
    du[ok] = np.minimum(du[ok], from_inputs)
    # The two Adams' own float32 arithmetic: a few roundings of u.
    own = 2.0**-20 * ratio
    out.append(d + lr * (du + own) + F32 * np.abs(p))
  return out
