"""docs/porting.md's snippets, the PyTorch one included, as written."""

import docs_snippets
import oracles

oracles.require("torch")


def test_porting_snippets_run_with_torch(tmp_path):
  ran = docs_snippets.run_page(
    "porting.md", {"ckpt_dir": tmp_path}, available=("torch",)
  )
  assert ran == len(docs_snippets.blocks("porting.md"))
