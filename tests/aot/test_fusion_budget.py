"""The bound on the one pass's reduction kernels: XLA:GPU fuses at most
``MaxOperandsAndOutputsPerFusion()`` (96, xla/service/gpu/gpu_fusible.h)
operands and outputs into one kernel, so one reduction kernel reads at
most about 92 separately allocated leaves, and a concatenation of more is
written out, whole, before its reduction. ``_segments`` concatenates
``BATCH`` leaves a kernel, below that edge: on the H100 target the
per-unit sums of squares of ``BATCH`` float16 leaves of 1000x1000 compile
to one kernel reading them and one summing the partials, moving the
leaves' bytes once; at 92 leaves a batch still fuses, at 93 it is
written out (the bytes more than double). benchmarks/README.md, "The
reduction kernels: what bounds them"."""

import aot_needs
import pytest

from fp16_scaling import _segments

gpu_kernels = aot_needs.gpu_kernels  # the fixture

SHAPE = (1000, 1000)
LEAF_BYTES = 2 * SHAPE[0] * SHAPE[1]  # float16


def _sums_of_squares(gpu_kernels, leaves, batch, monkeypatch):
  """``gpu_kernels.counts`` of the per-leaf sums of squares of ``leaves``
  float16 leaves in ``_segments``' GPU form, ``batch`` leaves a
  concatenation, compiled for the H100 target."""
  import jax
  import jax.numpy as jnp

  monkeypatch.setattr(_segments, "BATCH", batch)
  square = lambda x: jnp.square(x.astype(jnp.float32))

  def sums(xs):
    axes = (None,) * len(xs)
    return jnp.stack(_segments.unit_reduce(xs, axes, square, jnp.sum))

  mesh = gpu_kernels.one_device_mesh("h100")
  leaf = jax.ShapeDtypeStruct(SHAPE, jnp.float16)
  args = [gpu_kernels.placed(leaf, mesh)] * leaves
  compiled = jax.jit(sums).lower(args).compile()
  return gpu_kernels.counts(compiled)


@pytest.mark.parametrize("batch", [_segments.BATCH, 92])
def test_a_batch_below_the_budget_is_read_by_one_reduction_kernel(
  gpu_kernels, batch, monkeypatch
):
  row = _sums_of_squares(gpu_kernels, batch, batch, monkeypatch)
  # The batch's kernel and the partials' sum; the pads and the
  # concatenation fused, nothing written but the partials (under 1%).
  assert row["kernels"] == row["reductions"] == 2, row
  assert row["bytes"] < 1.01 * batch * LEAF_BYTES, row


def test_a_batch_over_the_budget_is_written_out(gpu_kernels, monkeypatch):
  row = _sums_of_squares(gpu_kernels, 93, 93, monkeypatch)
  assert row["bytes"] > 2 * 93 * LEAF_BYTES, row
