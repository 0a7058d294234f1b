"""The kernels of the step on the GPU targets (benchmarks/gpu_kernels.py's
counts, compiled without a device): ``fs.chain(fp16_loss_scale,
clip_by_unscaled_norm, adamw)`` at 50 and 200 leaves of 1000x1000 on the
H100 target runs at most 1.2 kernels per leaf, against plain optax's 3
(two reduction kernels and an update kernel a leaf); its reductions grow
by one kernel per batch of leaves (``_segments.BATCH``), not per leaf; no
copy is larger than a scalar and every output aliases a donated input.
The A100 target at 200 leaves likewise."""

import functools

import aot_needs
import pytest

from fp16_scaling import _segments

gpu_kernels = aot_needs.gpu_kernels  # the fixture

SIZE = 1000 * 1000
LEAVES = (50, 200)
PER_LEAF = 1.2  # issue 55's bound on fs.chain's kernels per leaf
PLAIN_PER_LEAF = 3  # plain optax: 2 reduction kernels + 1 update a leaf


@pytest.fixture(scope="module")
def compiled(gpu_kernels):
  """``(recipe, target, leaves) -> counts``, each compiled once."""

  @functools.cache
  def get(key, target, leaves):
    return gpu_kernels.compile_recipe(key, target, SIZE, leaves)

  return get


def _batches(leaves):
  return -(-leaves // _segments.BATCH)


def test_fs_chain_runs_at_most_1_2_kernels_per_leaf_on_the_h100(compiled):
  few, many = (compiled("fp16", "h100", n) for n in LEAVES)
  slope = (many["kernels"] - few["kernels"]) / (LEAVES[1] - LEAVES[0])
  assert slope <= PER_LEAF, (few, many)
  assert many["kernels"] <= PER_LEAF * LEAVES[1], many
  # The reductions: one more kernel a batch of leaves, none a leaf.
  grown = many["reductions"] - few["reductions"]
  assert 0 <= grown <= _batches(LEAVES[1]) - _batches(LEAVES[0]), (few, many)
  assert few["reductions"] <= _batches(LEAVES[0]) + 2, few


def test_plain_optax_runs_three_kernels_per_leaf_on_the_h100(compiled):
  few, many = (compiled("floor", "h100", n) for n in LEAVES)
  slope = (many["kernels"] - few["kernels"]) / (LEAVES[1] - LEAVES[0])
  assert PLAIN_PER_LEAF <= slope < PLAIN_PER_LEAF + 0.1, (few, many)
  chain = compiled("fp16", "h100", LEAVES[1])
  assert chain["kernels"] < many["kernels"] * PER_LEAF / PLAIN_PER_LEAF


@pytest.mark.parametrize("target", ["h100", "a100"])
def test_no_copy_of_an_array_and_every_output_donated(compiled, target):
  row = compiled("fp16", target, LEAVES[1])
  assert row["array_copies"] == 0, row
  assert row["aliased"] == row["outputs"], row
  assert row["kernels"] <= PER_LEAF * LEAVES[1], row
