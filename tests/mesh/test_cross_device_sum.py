"""The float16 weight-gradient sum across 8 devices, as docs/data-parallel.md
states it: benchmarks/cross_device_sum.py's small run (512 rows).

Under ``jit`` XLA all-reduces the float16 partial sums in float16; with
``nnx.Linear(..., preferred_element_type=jnp.float32)`` the partials and the
all-reduce are float32 (twice the bytes) and the total is rounded to float16
once, as on one device. Errors are against a float64 sum of the same
float16 products, relative to the sum of their magnitudes.
"""

import math

import helpers
import pytest

_BENCH = helpers.load_script(
  helpers.ROOT / "benchmarks" / "cross_device_sum.py"
)
ROWS = 512
# One float16 rounding of the total, half an ulp: 2**-11 of |g| <= sum|terms|
# (in float16's normal range, where the errors are taken); the float32 sum of
# ROWS products adds at most ROWS * 2**-24 of sum|terms|.
ONE_ROUNDING_BITS = math.log2(2.0**-11 + ROWS * 2.0**-24)


@pytest.fixture(scope="module")
def result():
  return _BENCH.measure(ROWS)


def test_jit_all_reduces_float16_and_preferred_float32_twice_the_bytes(result):
  f16 = result["jit f16"]["all_reduce"]
  f32 = result["jit pref f32"]["all_reduce"]
  assert f16 and {d for d, _ in f16} == {"f16"}
  assert f32 and {d for d, _ in f32} == {"f32"}
  assert sum(b for _, b in f32) == 2 * sum(b for _, b in f16)


def test_preferred_float32_rounds_the_total_once(result):
  leaves = result["jit pref f32"]["leaves"]
  for leaf, (_, bits) in leaves.items():
    assert bits <= ONE_ROUNDING_BITS, leaf
  # The float16 all-reduce rounds each add: somewhere it loses more.
  f16 = result["jit f16"]["leaves"]
  assert max(bits for _, bits in f16.values()) > ONE_ROUNDING_BITS


def test_float16_partials_flush_more_of_the_first_kernel(result):
  """Each device's float16 partial (about 1/8 of the total) flushes to zero
  where the total would not, in the jit form and in shard_map's (which casts
  the float16 partials to float32 only after they are made); the float32
  partials lose no more than one device does."""
  zeros = {f: r["leaves"]["0.kernel"][0] for f, r in result.items()}
  assert zeros["jit pref f32"] < zeros["jit f16"]
  assert zeros["jit pref f32"] < zeros["shard_map f32"]
  # Its forward keeps the dots' float32 outputs (the one-device form rounds
  # them to float16), so a product or two may differ: 2 of 4096 elements.
  assert zeros["jit pref f32"] <= zeros["one device"] + 2 / 4096
