"""docs/data-parallel.md's blocks, run as written on 8 devices: nnx.Linear
and Linen nn.Dense with float32 dot outputs all-reduce their weight
gradients in float32, the plain float16 layer in float16. On one device the
second block stops with the flag that gives a CPU eight."""

import docs_snippets
import helpers
import jax
import pytest

pytest.importorskip("flax.nnx")


def test_data_parallel_blocks_run():
  ns = {}
  assert docs_snippets.run_page("data-parallel.md", ns) == 2
  assert ns["all_reduce_dtypes"](*ns["nnx_apply"](ns["plain"])) == {"f16"}


def test_on_one_device_the_page_names_the_flag(monkeypatch):
  first, second = docs_snippets.blocks("data-parallel.md")
  ns = {}
  exec(compile(first, "data-parallel.md block 0", "exec"), ns)
  monkeypatch.setattr(jax, "device_count", lambda *args: 1)
  with pytest.raises(RuntimeError, match="JAX sees 1") as raised:
    exec(compile(second, "data-parallel.md block 1", "exec"), ns)
  # The flag the page names is the one tests/conftest.py sets.
  assert helpers.DEVICES_FLAG in str(raised.value)
  assert "before JAX is first imported" in str(raised.value)
  assert "mesh" not in ns  # it stopped before building one
