"""docs/porting.md's snippets, run as written (those that need PyTorch in
tests/peers/test_peer_docs_porting.py)."""

import docs_snippets
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")


def test_porting_snippets_run(tmp_path):
  ran = docs_snippets.run_page("porting.md", {"ckpt_dir": tmp_path})
  blocks = docs_snippets.blocks("porting.md")
  torch_blocks = [b for b in blocks if docs_snippets.NEEDS.match(b)]
  assert torch_blocks and ran == len(blocks) - len(torch_blocks)
