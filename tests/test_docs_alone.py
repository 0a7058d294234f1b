"""The docs sections a README link points a reader to run when pasted
alone, each in a fresh namespace: their blocks bring their own imports
and data, not those of the sections before them. (Each porting page,
linked from docs/porting.md, runs alone in tests/test_docs_porting.py.)"""

import docs_snippets
import pytest

SECTIONS = [
  ("design.md", "## In place"),  # README: docs/design.md#in-place
  ("stacked.md", "## The recipes"),  # README: "scanned layers"
]


@pytest.mark.parametrize("page, heading", SECTIONS)
def test_section_runs_pasted_alone(page, heading):
  if page == "stacked.md":
    pytest.importorskip("flax.nnx")
  blocks = docs_snippets.section_blocks(page, heading)
  assert blocks, (page, heading)
  namespace = {}
  for i, code in enumerate(blocks):
    exec(compile(code, f"{page} {heading} block {i}", "exec"), namespace)


def test_stacked_md_gives_its_first_recipe_before_the_figures():
  text = (docs_snippets.DOCS / "stacked.md").read_text()
  assert text.index("## The recipes") < text.index("## Stack your layers")
  first_block = text.index("```python")
  assert "benchmarks/stacked_cost.py" not in text[:first_block]
