"""The one pass's GPU form (fp16_scaling/_segments.py), run on the CPU: per
unit (a leaf, or a layer of a stacked leaf) the same sums of squares,
peaks and zero counts as a reduction per leaf, over leaves of many sizes,
dtypes and layer axes, more than one batch of them; the batches' plan;
and the choice of the form per platform (the CPU's is the reduction per
leaf, bit for bit). The kernels it compiles to on a GPU are
tests/aot/test_kernels.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp16_scaling import _norm
from fp16_scaling import _segments

U32 = np.finfo(np.float32).eps / 2


def _leaves():
  """Leaves of 20 sizes, float16 and float32, one scalar, one empty, and
  stacked ones (layer axis 0 and 1), with an inf, a NaN and zeros."""
  rng = np.random.default_rng(0)
  sizes = [1, 3, 16, 17, 1000, 4096, 4097, 70_000, 0] + list(range(5, 16))
  leaves = [rng.standard_normal(s).astype(np.float16) for s in sizes]
  leaves[3][2] = np.inf
  leaves[5][:100] = 0
  leaves.append(rng.standard_normal((4, 3, 5)).astype(np.float32))
  leaves.append(rng.standard_normal((3, 4, 700)).astype(np.float16))
  leaves.append(np.float32(2.5))
  leaves.append((rng.standard_normal(9000) * 300).astype(np.float32))
  leaves[-1][7] = np.nan
  axes = [None] * (len(leaves) - 4) + [0, 1, None, None]
  return [jnp.asarray(x) for x in leaves], axes


def _per_unit(x, axis, fn):
  """numpy, in float64: ``fn`` of each unit's elements."""
  x = np.asarray(x, np.float64)
  if axis is None:
    return fn(x.reshape(-1))
  return np.array([fn(u.reshape(-1)) for u in np.moveaxis(x, axis, 0)])


def _sum_squares(u):
  finite = np.isfinite(u).all()
  return np.sum(u * u) if finite else np.inf


def test_unit_sums_of_squares_are_each_units_own():
  leaves, axes = _leaves()
  got = _segments.unit_reduce(leaves, axes, _norm._wide_squares, jnp.sum)
  for x, a, g in zip(leaves, axes, got):
    want = np.asarray(_per_unit(x, a, _sum_squares))
    g = np.asarray(g, np.float64)
    assert g.shape == np.shape(want)
    finite = np.isfinite(want)
    # n float32 squares summed in any order: n u relative (plus the
    # squares' own rounding, u each).
    n = max(np.size(x) // max(np.size(want), 1), 1)
    np.testing.assert_allclose(g[finite], want[finite], rtol=(n + 1) * U32)
    # float16's non-finite squares are +inf (or NaN), a wider leaf's -inf.
    assert not np.isfinite(g[~finite]).any()


def test_unit_peaks_and_zero_counts_are_exact():
  leaves, axes = _leaves()
  peaks = _segments.unit_reduce(leaves, axes, _norm._abs32, jnp.max)
  nonzero = _segments.unit_reduce(leaves, axes, _norm._nonzero, jnp.sum)

  def peak(u):
    finite = np.abs(u[np.isfinite(u)])
    return finite.max(initial=0.0)

  for x, a, p, c in zip(leaves, axes, peaks, nonzero):
    np.testing.assert_array_equal(p, _per_unit(x, a, peak))
    np.testing.assert_array_equal(c, _per_unit(x, a, np.count_nonzero))


def test_batches_hold_one_kind_and_at_most_batch_leaves_in_size_order():
  n = 3 * _segments.BATCH
  shapes = [(1 + (7 * i) % n,) for i in range(n)] + [(4, 10)]
  dtypes = [np.float16 if i % 3 else np.float32 for i in range(n)]
  dtypes.append(np.float16)
  layer_axes = [None] * n + [0]
  batches = _segments.batches(shapes, dtypes, layer_axes)
  assert sorted(i for b in batches for i in b) == list(range(n + 1))
  for batch in batches:
    assert len(batch) <= _segments.BATCH
    assert len({np.dtype(dtypes[i]) for i in batch}) == 1
  unit = lambda i: np.prod(shapes[i]) // (4 if i == n else 1)
  for batch in batches:
    assert [unit(i) for i in batch] == sorted(unit(i) for i in batch)
  # As few batches as the dtypes allow.
  f32 = sum(d == np.float32 for d in dtypes)
  f16 = len(dtypes) - f32
  assert len(batches) == sum(-(-k // _segments.BATCH) for k in (f16, f32))


@pytest.mark.parametrize("size", [1, 16, 4096, 10**6, 5 * 10**7])
def test_a_unit_is_cut_into_at_most_max_chunks(size):
  chunk = _segments._chunk(size)
  assert chunk & (chunk - 1) == 0  # a power of two
  assert -(-size // chunk) <= _segments.MAX_CHUNKS
  assert chunk <= max(_segments.CHUNK, size)


def test_the_cpu_step_reduces_each_leaf_alone():
  # On XLA:CPU the one pass is a reduction per leaf: each leaf's sum is,
  # bit for bit, a jitted jnp.sum of that leaf's float32 squares.
  rng = np.random.default_rng(1)
  leaves = tuple(
    jnp.asarray(rng.standard_normal(s).astype(np.float16))
    for s in (3, 5000, 70_001)
  )
  got = jax.jit(_norm.leaf_sums)(leaves)
  for x, g in zip(leaves, got):
    want = jax.jit(lambda x: jnp.sum(x.astype(jnp.float32) ** 2))(x)
    assert np.asarray(g).tobytes() == np.asarray(want).tobytes()
