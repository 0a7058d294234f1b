"""docs/stacked.md's recipes, run as written: each stack's per-layer norms
are L finite, positive values for every stacked leaf, and only those."""

import docs_snippets
import numpy as np
import pytest

pytest.importorskip("flax.nnx")


def test_stacked_recipes_run():
  ns = {}
  assert docs_snippets.run_page("stacked.md", ns) == 4
  expected = {
    "linen_norms": [
      "['blocks']['Dense_0']['bias']",
      "['blocks']['Dense_0']['kernel']",
    ],
    "nnx_norms": [
      "['blocks']['lin']['bias'].value",
      "['blocks']['lin']['kernel'].value",
    ],
    "maxtext_norms": [
      "['decoder']['layers']['scale']",
      "['decoder']['layers']['wi']",
    ],
  }
  for name, paths in expected.items():
    norms = ns[name]
    assert sorted(norms) == paths, name
    for v in norms.values():
      v = np.asarray(v)
      assert v.shape == (8,)
      assert np.all(np.isfinite(v))
      assert np.all(v > 0)
