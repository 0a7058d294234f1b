"""The step compiles for a GPU and a TPU, on meshes, with nothing copied
and everything donated (benchmarks/gpu_kernels.py's ``mesh_program``,
compiled without a device): ``fs.chain(fp16_loss_scale,
clip_by_unscaled_norm with an expert mask, adamw)`` under jit with every
leaf split over the mesh, ``accumulate_gradients`` of it, and the step
under ``shard_map`` with ``partition_specs`` (experts split, the rest
replicated), on a ``1x1x8`` H100 topology and a TPU v5e ``2x2``. Each
holds no copy larger than a scalar, every output aliases a donated input,
and the norm's collectives are one all-reduce."""

import aot_needs
import pytest

gpu_kernels = aot_needs.gpu_kernels  # the fixture

MESHES = [("h100", 8), ("tpu", 4)]
PROGRAMS = ("step", "accumulate", "sharded")


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("target,count", MESHES)
def test_compiles_with_no_array_copy_and_every_output_donated(
  gpu_kernels, target, count, program
):
  compiled = gpu_kernels.mesh_program(program, target, count)
  tpu = gpu_kernels.TARGETS[target][0] == "tpu"
  row = gpu_kernels.counts(compiled, tpu)
  assert row["array_copies"] == 0, row
  assert row["outputs"] > 0 and row["aliased"] == row["outputs"], row
  # The global, expert and shared norms and the overflow: one all-reduce
  # of the few sums (GSPMD's for split leaves, shard_map's psum), never
  # one a leaf, and no gradient moved between devices.
  assert gpu_kernels.collectives(compiled) == {"all-reduce": 1}
