"""docs/precision-policy.md's blocks, run as written (the Haiku one in
tests/peers/test_peer_docs_policy.py), and the output of fs.compute_dtypes
the page prints, against the page."""

import re

import docs_snippets
import jax.numpy as jnp
import pytest

pytest.importorskip("flax.nnx")


def test_policy_page_runs(capsys):
  ns = {}
  ran = docs_snippets.run_page("precision-policy.md", ns)
  blocks = docs_snippets.blocks("precision-policy.md")
  needs = [b for b in blocks if docs_snippets.NEEDS.match(b)]
  assert len(needs) == 1
  assert ran == len(blocks) - 1 == 5
  # What the page's RL step saw inside the loss: params and obs in float16,
  # the advantages float32.
  assert ns["seen"] == {
    "params": jnp.float16,
    "obs": jnp.float16,
    "adv": jnp.float32,
  }
  # The report the page shows is the one its block printed.
  text = (docs_snippets.DOCS / "precision-policy.md").read_text()
  (shown,) = re.findall(r"It prints[^\n]*\n\n```text\n(.*?)```", text, re.S)
  assert str(ns["report"]) + "\n" == shown
  assert shown in capsys.readouterr().out
