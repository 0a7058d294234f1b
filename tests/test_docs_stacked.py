"""docs/stacked.md's recipes, run as written: each stack's per-layer norms
are L finite, positive values for every stacked leaf, and only those."""

import docs_snippets
import numpy as np
import pytest

pytest.importorskip("flax.nnx")


def test_stacked_recipes_run():
  ns = {}
  assert docs_snippets.run_page("stacked.md", ns) == 4
  expected = {  # each stack's two leaves, under the stacked path
    "linen_norms": ("['blocks']['Dense_0']", "['bias']", "['kernel']"),
    "nnx_norms": ("['blocks']['lin']", "['bias'].value", "['kernel'].value"),
    "maxtext_norms": ("['decoder']['layers']", "['scale']", "['wi']"),
  }
  for name, (stack, *leaves) in expected.items():
    norms = ns[name]
    assert sorted(norms) == [stack + leaf for leaf in leaves], name
    for v in norms.values():
      v = np.asarray(v)
      assert v.shape == (8,) and np.all(np.isfinite(v)) and np.all(v > 0)
