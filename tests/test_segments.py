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
from fp16_scaling import _range
from fp16_scaling import _segments

U32 = np.finfo(np.float32).eps / 2
# Sizes around the chunks and the batches: 1 element, odd sizes, one chunk
# (4096) and one more, many chunks, an empty leaf, and 11 small ones.
SIZES = [1, 3, 16, 17, 1000, 4096, 4097, 70_000, 0]
SIZES += list(range(5, 16))


def _leaves():
  """float16 leaves of ``SIZES`` with an inf and zeros; stacked ones
  (layer axis 0, float32, and 1, float16); a float32 scalar; a float32
  leaf with a NaN. Returns the leaves and their layer axes."""
  rng = np.random.default_rng(0)
  leaves = []
  for size in SIZES:
    leaves.append(rng.standard_normal(size).astype(np.float16))
  leaves[3][2] = np.inf
  leaves[5][:100] = 0
  leaves.append(rng.standard_normal((4, 3, 5)).astype(np.float32))
  leaves.append(rng.standard_normal((3, 4, 700)).astype(np.float16))
  leaves.append(np.float32(2.5))
  wide = rng.standard_normal(9000) * 300
  wide[7] = np.nan
  leaves.append(wide.astype(np.float32))
  axes = [None] * len(SIZES) + [0, 1, None, None]
  return [jnp.asarray(x) for x in leaves], axes


def _per_unit(x, axis, fn):
  """numpy, in float64: ``fn`` of each unit's elements."""
  x = np.asarray(x, np.float64)
  if axis is None:
    return np.asarray(fn(x.reshape(-1)))
  units = np.moveaxis(x, axis, 0)
  return np.array([fn(u.reshape(-1)) for u in units])


def _sum_squares(u):
  if not np.isfinite(u).all():
    return np.inf
  return np.sum(u * u)


def _finite_peak(u):
  finite = np.abs(u[np.isfinite(u)])
  return finite.max(initial=0.0)


def test_unit_sums_of_squares_are_each_units_own():
  leaves, axes = _leaves()
  got = _segments.unit_reduce(leaves, axes, _norm._wide_squares, jnp.sum)
  for x, a, g in zip(leaves, axes, got):
    want = _per_unit(x, a, _sum_squares)
    g = np.asarray(g, np.float64)
    assert g.shape == want.shape
    finite = np.isfinite(want)
    # n float32 squares, each rounded (u), summed in any order (n u).
    n = max(np.size(x) // max(want.size, 1), 1)
    rtol = (n + 1) * U32
    np.testing.assert_allclose(g[finite], want[finite], rtol=rtol)
    # float16's non-finite squares are +inf (or NaN), a wider leaf's -inf.
    assert not np.isfinite(g[~finite]).any()


def test_unit_peaks_and_zero_counts_are_exact():
  leaves, axes = _leaves()
  peaks = _segments.unit_reduce(leaves, axes, _range._abs32, jnp.max)
  counts = _segments.unit_reduce(leaves, axes, _range._nonzero, jnp.sum)
  for x, a, peak, count in zip(leaves, axes, peaks, counts):
    np.testing.assert_array_equal(peak, _per_unit(x, a, _finite_peak))
    nonzero = _per_unit(x, a, np.count_nonzero)
    np.testing.assert_array_equal(count, nonzero)


def test_batches_hold_one_kind_and_at_most_batch_leaves_in_size_order():
  n = 3 * _segments.BATCH + 1
  sizes = {}
  kinds = {}
  for i in range(n):
    sizes[i] = 1 + (7 * i) % n
    kinds[i] = "float16" if i % 3 else "float32"
  batches = _segments.batches(kinds, sizes)
  every = sorted(i for batch in batches for i in batch)
  assert every == list(range(n))
  for batch in batches:
    assert len(batch) <= _segments.BATCH
    assert len({kinds[i] for i in batch}) == 1
    in_batch = [sizes[i] for i in batch]
    assert in_batch == sorted(in_batch)
  # As few batches as the kinds allow.
  f32 = list(kinds.values()).count("float32")
  fewest = -(-f32 // _segments.BATCH) + -(-(n - f32) // _segments.BATCH)
  assert len(batches) == fewest


@pytest.mark.parametrize("size", [1, 16, 4096, 10**6, 5 * 10**7])
def test_a_unit_is_cut_into_at_most_max_chunks(size):
  chunk = _segments._chunk(size)
  assert chunk & (chunk - 1) == 0  # a power of two
  chunks = -(-size // chunk)
  assert chunks <= _segments.MAX_CHUNKS
  assert chunk <= max(_segments.CHUNK, size)


def test_the_cpu_step_reduces_each_leaf_alone():
  # On XLA:CPU the one pass is a reduction per leaf: each leaf's sum is,
  # bit for bit, a jitted jnp.sum of that leaf's float32 squares.
  rng = np.random.default_rng(1)
  leaves = []
  for size in (3, 5000, 70_001):
    leaves.append(jnp.asarray(rng.standard_normal(size).astype(np.float16)))
  got = jax.jit(_norm.leaf_sums)(tuple(leaves))
  alone = jax.jit(lambda x: jnp.sum(x.astype(jnp.float32) ** 2))
  for x, g in zip(leaves, got):
    want = alone(x)
    assert np.asarray(g).tobytes() == np.asarray(want).tobytes()
