"""The porting guides' snippets (docs/porting-*.md), each page run alone,
as written, in a fresh namespace: every page's first block brings its own
imports and helpers. tests/peers/test_porting_torch.py runs
docs/porting-torch.md again with the torch side of each recipe."""

import pathlib

import docs_snippets
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("equinox")

# page: its number of Python blocks.
PAGES = {
  "porting-deepspeed.md": 5,
  "porting-torch.md": 12,
  "porting-ddp.md": 3,
  "porting-equinox.md": 2,
  "porting-rl.md": 2,
}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_porting_page_runs_alone(page, tmp_path):
  blocks = docs_snippets.blocks(page)
  assert not any(docs_snippets.NEEDS.match(b) for b in blocks)  # no torch
  ran = docs_snippets.run_page(page, {"ckpt_dir": tmp_path})
  assert ran == len(blocks) == PAGES[page]


def test_porting_index_links_every_guide():
  index = (docs_snippets.DOCS / "porting.md").read_text()
  for page in PAGES:
    assert f"]({page})" in index, page
  assert "](frameworks.md#flax-nnx)" in index  # the NNX row


def test_framework_pages_link_the_frameworks_step_instead_of_repeating_it():
  # Each guide that starts from a framework points to that framework's
  # step on docs/frameworks.md (run by tests/test_docs_frameworks.py).
  links = {
    "porting-deepspeed.md": "frameworks.md#flax-nnx",
    "porting-haiku.md": "frameworks.md#flax-nnx",
    "porting-equinox.md": "frameworks.md#equinox",
    "porting-keras.md": "frameworks.md#keras-3-jax-backend",
  }
  frameworks = (docs_snippets.DOCS / "frameworks.md").read_text()
  for page, link in links.items():
    text = (docs_snippets.DOCS / page).read_text()
    assert f"]({link})" in text, (page, link)
  for heading in ["## Flax NNX", "## Equinox", "## Keras 3 (JAX backend)"]:
    assert f"\n{heading}\n" in frameworks, heading
  # The NNX step with BatchStat is written out on frameworks.md, and
  # porting-haiku.md no longer repeats it.
  haiku = (docs_snippets.DOCS / "porting-haiku.md").read_text()
  assert "nnx.update(model, fs.select_on_overflow" not in haiku
  assert "nnx.update(model, fs.select_on_overflow" in frameworks


def test_no_docs_page_over_500_lines():
  for page in sorted(pathlib.Path(docs_snippets.DOCS).glob("*.md")):
    assert len(page.read_text().splitlines()) <= 500, page.name
