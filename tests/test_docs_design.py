"""docs/design.md's state table names every field of every state type, and
nothing else: a field added to a NamedTuple without a word in the design
document fails here."""

import pathlib
import re

import pytest

import fp16_scaling as fs

_DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _table():
  rows = {}
  for line in _DESIGN.read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 3 and cells[0].startswith("`"):
      # Field names are the code spans at the start of each comma-separated
      # item (notes in parentheses may name others).
      items = re.sub(r"\([^)]*\)", "", cells[2]).split(",")
      rows[cells[0].strip("`")] = [
        m.group(1) for i in items if (m := re.match(r"\s*`(\w+)`", i))
      ]
  return rows


@pytest.mark.parametrize(
  "state",
  [fs.ScalerState, fs.LossScaleState, fs.ClipState, fs.AccumulationState],
  ids=lambda s: s.__name__,
)
def test_design_state_table_lists_exactly_the_fields(state):
  assert _table()[state.__name__] == list(state._fields)
