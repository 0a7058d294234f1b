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


_PACKAGE = _DESIGN.parents[1] / "fp16_scaling"


def _module_map():
  names = []
  for line in _DESIGN.read_text().splitlines():
    m = re.match(r"\| `(_\w+)\.py` \|", line)
    if m:
      names.append(m.group(1))
  return names


def _imports(module):
  """The fp16_scaling modules ``module`` imports."""
  import ast

  tree = ast.parse((_PACKAGE / f"{module}.py").read_text())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "fp16_scaling":
        found.update(a.name for a in node.names)
      elif node.module.startswith("fp16_scaling."):
        found.add(node.module.split(".")[1])
  return found


def test_module_map_lists_every_module():
  on_disk = sorted(
    p.stem for p in _PACKAGE.glob("_*.py") if p.stem != "__init__"
  )
  assert sorted(_module_map()) == on_disk


def test_modules_import_only_those_above_them_in_the_map():
  order = _module_map()
  for i, module in enumerate(order):
    below = set(order[i:])
    assert not _imports(module) & below, (module, _imports(module) & below)
