"""docs/data-parallel.md's blocks, run as written on 8 devices: nnx.Linear
and Linen nn.Dense with float32 dot outputs all-reduce their weight
gradients in float32, the plain float16 layer in float16."""

import docs_snippets
import pytest

pytest.importorskip("flax.nnx")


def test_data_parallel_blocks_run():
  ns = {}
  assert docs_snippets.run_page("data-parallel.md", ns) == 2
  assert ns["all_reduce_dtypes"](*ns["nnx_apply"](ns["plain"])) == {"f16"}
