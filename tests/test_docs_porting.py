"""docs/porting.md's snippets, run as written (the PyTorch one in
tests/peers/test_peer_docs_porting.py)."""

import docs_snippets
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")


def test_porting_snippets_run(tmp_path):
  ran = docs_snippets.run_page("porting.md", {"ckpt_dir": tmp_path})
  assert ran == len(docs_snippets.blocks("porting.md")) - 1
