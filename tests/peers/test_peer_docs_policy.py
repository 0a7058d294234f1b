"""docs/precision-policy.md's blocks with Haiku's, as written."""

import docs_snippets
import pytest

pytest.importorskip("haiku")
pytest.importorskip("flax.nnx")


def test_policy_page_runs_with_haiku():
  ran = docs_snippets.run_page("precision-policy.md", {}, available=("haiku",))
  assert ran == len(docs_snippets.blocks("precision-policy.md")) == 6
