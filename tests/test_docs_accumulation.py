"""docs/accumulation.md's ``optax.microbatch`` block, run as written: a
jitted step over 4 microbatches trains without an overflow. (The page's
other blocks are sketches with the user's ``loss_fn``.)"""

import docs_snippets


def test_microbatch_block_runs():
  blocks = docs_snippets.blocks("accumulation.md")
  (code,) = [b for b in blocks if "optax.microbatch(" in b]
  ns = {}
  exec(compile(code, "accumulation.md optax.microbatch block", "exec"), ns)
  assert ns["params"]["w"].dtype == "float32"
