"""docs/locate-overflow.md's worked case of ``fs.locate_overflow``, run as
written: its blocks print what the page shows (numbers with a fraction
aside, which depend on float16 rounding), and what they show holds: the
forward overflow at the attention's line in layer 1, and once the
attention is computed in float32, one skipped step, the scaler's first
(backward), and none after it."""

import contextlib
import io
import re
import sys

import docs_snippets
from helpers import ROOT
import pytest

pytest.importorskip("flax.linen")
pytest.importorskip("tqdm")  # examples/train_lm.py's progress bar

PAGE = "locate-overflow.md"
SECTION = "## A worked case"


def masked(text):
  """``text`` with its fractional numbers and the op's largest finite
  input replaced by ``#``."""
  text = re.sub(r"\d+\.\d+(e[+-]\d+)?|\d+e[+-]\d+", "#", text)
  return re.sub(r"largest finite input \S+", "largest finite input #", text)


def shown():
  """The output blocks (plain fences) of the section, in order."""
  text = (docs_snippets.DOCS / PAGE).read_text()
  start = text.index(f"\n{SECTION}\n")
  end = text.find("\n## ", start + len(SECTION) + 2)
  fences = re.findall(r"^```(\w*)\n(.*?)^```$", text[start:end], re.S | re.M)
  return [body for info, body in fences if not info]


def test_the_worked_case_prints_what_the_page_shows(monkeypatch):
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(sys, "path", list(sys.path))  # the page adds examples/
  blocks = docs_snippets.section_blocks(PAGE, SECTION)
  namespace, printed = {}, []
  for i, code in enumerate(blocks):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(code, f"{PAGE}, block {i}", "exec"), namespace)
    printed.append(out.getvalue())
  assert list(map(masked, printed)) == list(map(masked, shown()))
  report, found, fixed = printed
  assert "Last step OVERFLOWED (forward)" in report
  assert "Skipped steps so far: 3;" in report
  call = "x = x + attention(h, mask=mask).astype(x.dtype)"
  lines = (ROOT / "examples" / "train_lm.py").read_text().splitlines()
  line = lines.index(f"    {call}") + 1
  assert found.splitlines()[:1] + found.splitlines()[2:6] == [
    "First inf/NaN at loss scale 2^11, in the forward pass: dot_general -> "
    "float16[8,2,32,32]",
    f"  at examples/train_lm.py:{line} in Block.__call__",
    "  module ['blocks']['Block_0']['MultiHeadDotProductAttention_0'] "
    "(upstream)",
    "  name scope blocks/Block_0/MultiHeadDotProductAttention_0/"
    "...qhd,...khd->...hqk",
    "  layer 1 (scan)",
  ]
  assert fixed.splitlines()[:2] == [
    "Last step clean at loss scale 2^12; next scale 2^12.",
    "Skipped steps so far: 1; overflows at the scale's floor: 0.",
  ]
  assert f"train_lm.py:{line}" in (docs_snippets.DOCS / PAGE).read_text()
