"""fp16_scaling._norm: overflow and the true norm from one pass.

Each function is checked on small arrays against values derived by hand or
computed in float64 with numpy: a leaf holding an inf or NaN sums to -inf
and is the one attributed; finite squares too large for float32 are capped
at 2**96 and the norm is then recomputed by the rescue branch; float16
gradients never trace that branch; discard_if keeps gradients through a
discarded step finite; widen reads float16 values with float16's range; and
the helpers that lay the sums out across a mesh (spec_axes, broadcast_prefix,
leaf_vector) and the opt-in range telemetry (_range.leaf_range).
"""

from helpers import SQRT_ULPS
from helpers import U32
from helpers import gamma
from helpers import on_cpu
from helpers import ulps
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp16_scaling import _norm
from fp16_scaling import _range

CAP = 2.0**96
INF = np.inf
NAN = np.nan


def _norms(leaves, **kwargs):
  leaves = [jnp.asarray(x) for x in leaves]
  return _norm.reduce_norms(_norm.leaf_sums(leaves), leaves, **kwargs)


def _f64_norm(*leaves):
  return float(
    np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves))
  )


def test_a_finite_leaf_sums_its_squares():
  x = jnp.array([[1.0, -2.0], [0.5, 0.0]])
  (s,) = _norm.leaf_sums([x])
  assert s.dtype == jnp.float32
  assert float(s) == 1 + 4 + 0.25
  h = jnp.array([3.0, 4.0], jnp.float16)
  sums = _norm.leaf_sums([h, x])
  assert [float(v) for v in sums] == [25.0, 5.25]


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_a_non_finite_leaf_is_marked_minus_inf_and_is_the_one_named(bad, dtype):
  leaves = [
    jnp.array([1.0, 2.0], dtype),
    jnp.array([3.0, bad, 4.0], dtype),
    jnp.array([2.0], dtype),
  ]
  sums = _norm.leaf_sums(leaves)
  # The raw sum of the bad leaf is not finite (float16 squares reach +inf
  # or NaN, wide ones are marked -inf); the reduction marks it -inf.
  assert [float(s) for s in sums[::2]] == [5.0, 4.0]
  assert not np.isfinite(float(sums[1]))
  n = _norm.reduce_norms(sums, leaves, leaf_groups=[0, 1, 1], num_groups=2)
  np.testing.assert_array_equal(n.leaf_sums, [5.0, -INF, 4.0])
  assert bool(n.overflow)
  np.testing.assert_array_equal(n.leaf_nonfinite, [False, True, False])
  # No norm exists: 0.0, not NaN; the finite group keeps its true norm. Its
  # sum, 1 + 4, is exact on any backend; its square root is correctly
  # rounded on XLA:CPU (numpy's float32 sqrt(5), bit for bit) and within
  # SQRT_ULPS ulp of it elsewhere (an H200 gave 2.2360678, 1 ulp below).
  assert float(n.norm) == 0.0
  assert float(n.group_norms[1]) == 0.0
  off = ulps(n.group_norms[0], np.sqrt(np.float32(5)))
  assert off <= (0 if on_cpu() else SQRT_ULPS)


def test_a_huge_finite_leaf_next_to_an_inf_is_still_attributed():
  # Without the cap, 1e30**2 would sum to +inf and meet the other leaf's
  # -inf as NaN: neither the flag nor the attribution would survive.
  leaves = [jnp.array([1e30, 1e30]), jnp.array([INF])]
  sums = _norm.leaf_sums(leaves)
  assert [float(s) for s in sums] == [2 * CAP, -INF]  # each square capped
  n = _norm.reduce_norms(sums, leaves)
  assert bool(n.overflow)
  assert float(n.norm) == 0.0
  np.testing.assert_array_equal(n.leaf_nonfinite, [False, True])


@pytest.mark.parametrize(
  "leaves",
  [
    [[3e30, 4e30]],
    [[3e30], [4e30, 1.0]],
    [[2e14] * 3],  # no square reaches the cap; their sum does
    [[-3.4e38], [1e-30]],  # near float32's largest, squared
  ],
  ids=["one leaf", "two leaves", "sum at the cap", "float32 max"],
)
def test_squares_too_large_for_float32_take_the_rescue(leaves):
  arrays = [np.asarray(x, np.float32) for x in leaves]
  n = _norms(arrays)
  assert not bool(n.overflow)
  assert not np.asarray(n.leaf_nonfinite).any()
  want = _f64_norm(*arrays)
  assert want > np.sqrt(CAP)  # the case needs the rescue
  np.testing.assert_allclose(float(n.norm), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(n.group_norms), [want], rtol=1e-6)


def test_the_rescue_scales_each_group_by_its_own_peak():
  # Relative to the huge group's peak, the small group's squares would
  # underflow float32 (1e-20 / 1e30 squared); each group keeps its norm.
  small = np.float32([3e-20, 4e-20])
  huge = np.float32([1e30, 1e30])
  n = _norms([small, huge], leaf_groups=[0, 1], num_groups=2)
  np.testing.assert_allclose(
    np.asarray(n.group_norms), [5e-20, _f64_norm(huge)], rtol=1e-6
  )
  np.testing.assert_allclose(float(n.norm), _f64_norm(small, huge), rtol=1e-6)


def _norm_rtol(n):
  """A float32 norm of n float32 values against the float64 one, on any
  backend: n rounded squares summed in any order (gamma_n on the sum, half
  of it after the square root), and the square root (u correctly rounded,
  SQRT_ULPS ulp of 2 u more off XLA:CPU)."""
  return gamma(n) / 2 + (1 + (0 if on_cpu() else 2 * SQRT_ULPS)) * U32


def test_below_the_cap_the_norm_is_the_float64_norm():
  rng = np.random.default_rng(0)
  leaves = [rng.standard_normal(s).astype(np.float32) * 1e3 for s in (7, 30)]
  n = _norms(leaves, leaf_groups=[1, 0], num_groups=3)
  want = _f64_norm(*leaves)
  np.testing.assert_allclose(float(n.norm), want, rtol=_norm_rtol(37))
  groups = np.asarray(n.group_norms)
  np.testing.assert_allclose(groups[0], _f64_norm(leaves[1]), _norm_rtol(30))
  np.testing.assert_allclose(groups[1], _f64_norm(leaves[0]), _norm_rtol(7))
  assert groups[2] == 0.0  # group 2 is empty


def _conds(leaves, **kwargs):
  """How many ``cond`` the traced reduction holds, less the choice of its
  form per platform (``lax.platform_dependent``, resolved at lowering:
  ``branches_platforms``)."""
  jaxpr = str(jax.make_jaxpr(lambda leaves: _norms(leaves, **kwargs))(leaves))
  return jaxpr.count(" cond[") - jaxpr.count("branches_platforms=")


def test_float16_gradients_never_trace_the_rescue():
  # 65504**2 * 2**31 < 2**96: no float16 sum can reach the cap.
  assert 65504.0**2 * 2**31 < CAP
  f16 = [jnp.ones(3, jnp.float16), jnp.ones(2, jnp.float16)]
  f32 = [jnp.ones(3, jnp.float32), jnp.ones(2, jnp.float16)]
  assert _conds(f16) == 0
  assert _conds(f32) == 1  # one wide leaf is enough
  # A caller's promise of float16-range values (a mean of float16
  # microbatches): not traced either.
  assert _conds(f32, in_float16_range=True) == 0


def test_no_leaves():
  n = _norm.reduce_norms([], [], num_groups=2)
  assert float(n.norm) == 0.0
  assert not bool(n.overflow)
  np.testing.assert_array_equal(n.group_norms, [0.0, 0.0])
  assert n.leaf_nonfinite.shape == (0,)


def test_integer_leaves_are_refused_by_index():
  _norm.check_float_leaves([jnp.zeros(2), jnp.zeros(2, jnp.bfloat16)], "g")
  with pytest.raises(TypeError) as err:
    _norm.check_float_leaves([jnp.zeros(2), jnp.zeros(2, jnp.int32)], "grads")
  assert str(err.value).startswith(
    "grads must be floating point (float16, bfloat16, float32 or float64); "
    "leaf 1 has dtype int32. Keep integer and bool arrays"
  )


def test_the_sums_derivative_is_2x_and_zero_where_not_finite():
  x = jnp.array([1.0, -3.0, INF, 0.5])
  grad = jax.grad(lambda x: _norm.leaf_sums([x])[0])(x)
  # d(sum x**2)/dx = 2x; the inf element contributes 0, not NaN.
  np.testing.assert_array_equal(grad, [2.0, -6.0, 0.0, 1.0])
  h = jnp.array([2.0, 100.0, INF], jnp.float16)
  grad = jax.grad(lambda h: _norm.leaf_sums([h])[0])(h)
  np.testing.assert_array_equal(grad, [4.0, 200.0, 0.0])


def test_the_norms_gradient_is_finite_at_zero_and_x_over_norm_elsewhere():
  @jax.jit
  @jax.grad
  def grad_of_norm(x):
    return _norms([x]).norm

  np.testing.assert_allclose(
    grad_of_norm(jnp.array([3.0, 4.0])), [0.6, 0.8], rtol=1e-6
  )
  np.testing.assert_array_equal(grad_of_norm(jnp.zeros(2)), [0.0, 0.0])
  # On an overflow step the norm is discarded: its gradient is 0, not NaN.
  np.testing.assert_array_equal(grad_of_norm(jnp.array([1.0, INF])), [0.0, 0.0])


def test_discard_if_gives_zeros_on_overflow_and_the_leaves_otherwise():
  leaves = (jnp.array([1.0, INF]), jnp.array([2.0], jnp.float16))
  zeros = [np.zeros(b.shape) for b in leaves]
  for overflow, want in [(False, leaves), (True, zeros)]:
    out = _norm.discard_if(jnp.bool_(overflow), leaves)
    for a, b, w in zip(out, leaves, want):
      np.testing.assert_array_equal(a, w)
      assert a.dtype == b.dtype


def test_discard_if_keeps_gradients_through_a_discarded_step_finite():
  # An update lr * g with g holding an inf, discarded on overflow. Selecting
  # after the multiply, the zero cotangent meets the inf: 0 * inf = NaN.
  g = jnp.array([1.0, INF])

  def selected_after(lr):
    return jnp.sum(jnp.where(True, 0.0, lr * g))

  assert np.isnan(float(jax.grad(selected_after)(0.1)))

  def discarded(lr):
    (safe,) = _norm.discard_if(jnp.bool_(True), (g,))
    return jnp.sum(lr * safe)

  assert float(jax.grad(discarded)(0.1)) == 0.0

  def clean(lr):
    (same,) = _norm.discard_if(jnp.bool_(False), (jnp.array([1.0, 2.0]),))
    return jnp.sum(lr * same)

  assert float(jax.grad(clean)(0.1)) == 3.0


def test_widen_sends_out_of_range_to_inf_and_keeps_the_rest():
  """widen of float16 values: out of range is +-inf, NaN stays NaN, the
  rest keeps its float16 value (1e-7 rounds to the subnormal 2**-23), bit
  for bit on any backend.

  Compiled on a float32 value that never became float16 (the fold path):
  XLA:CPU keeps the float32 -> float16 -> float32 converts, and gives the
  same values; XLA:GPU folds the pair away (excess precision), and widen
  reads the float32 value itself: an H200 gave 1e-7 for 1e-7. On any
  backend each value is one of the two, and out-of-range values are +-inf
  either way: the overflow verdict does not depend on the fold."""
  values = np.array([8e5, -8e5, 65504.0, 1e-7, np.nan], np.float32)
  expected = np.array([np.inf, -np.inf, 65504.0, 2.0**-23, np.nan], np.float32)
  halves = jnp.asarray(values).astype("float16")
  wide = np.asarray(jax.jit(_norm.widen)(halves))
  np.testing.assert_array_equal(wide, expected)
  fold = jax.jit(lambda x: _norm.widen(x.astype(jnp.float16)))
  got = np.asarray(fold(jnp.asarray(values)))
  if on_cpu():
    np.testing.assert_array_equal(got, expected)
  # Without the converts: the float32 values, compared with 65520.
  unrounded = np.array([np.inf, -np.inf, 65504.0, 1e-7, np.nan], np.float32)
  kept = np.isnan(got) & np.isnan(expected)
  assert np.all((got == expected) | (got == unrounded) | kept), got
  np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray([8e5, 1.0], dtype)
    np.testing.assert_array_equal(
      np.asarray(_norm.widen(x)), np.asarray(x, np.float32)
    )


def test_widen_keeps_float16_subnormals():
  # A rounding to float16's normal range would flush them to zero; widen
  # keeps every bit.
  tiny = np.array([2.0**-24, 3 * 2.0**-20, -(2.0**-15)], np.float16)
  wide = np.asarray(_norm.widen(jnp.asarray(tiny)))
  assert wide.dtype == np.float32
  np.testing.assert_array_equal(wide, tiny.astype(np.float32))


def test_leaf_range_reads_the_largest_finite_magnitude_and_the_zeros():
  leaves = [
    jnp.array([0.0, -3.0, 0.0, 2.0]),
    jnp.array([INF, 1.0, 0.0], jnp.float32),
    # 8e4 is beyond float16: read as inf (widen), not as the largest.
    jnp.array([0.5, 8e4], jnp.float32).astype(jnp.float16),
    jnp.zeros(2, jnp.bfloat16),
  ]
  peaks, zeros = _range.leaf_range(leaves, [()] * 4)
  np.testing.assert_array_equal(peaks, [3.0, 1.0, 0.5, 0.0])
  np.testing.assert_allclose(zeros, [0.5, 1 / 3, 0.0, 1.0])
  assert peaks.dtype == jnp.float32
  assert zeros.dtype == jnp.float32


def test_under_jit_the_same_values():
  leaves = [jnp.array([3e30, 4e30]), jnp.array([1.0, 2.0], jnp.float16)]
  n = jax.jit(_norms)(leaves)
  eager = _norms(leaves)
  for a, b in zip(n, eager):
    np.testing.assert_array_equal(a, b)
  assert not bool(n.overflow)
  assert float(n.norm) == pytest.approx(5e30)
