"""docs/checkpoints.md's snippets, run as written (the PyTorch one in
tests/peers/test_peer_docs_checkpoints.py)."""

import docs_snippets


def test_checkpoint_snippets_run(tmp_path):
  ran = docs_snippets.run_page("checkpoints.md", {"ckpt_dir": tmp_path})
  assert ran == len(docs_snippets.blocks("checkpoints.md")) - 1
