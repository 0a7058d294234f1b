"""No package record of four or more fields is built by position.

A record is a class the package defines as a ``NamedTuple`` or a
``dataclasses.dataclass`` (or a subclass of one). Built by position, a
record of many fields reads as a list whose order the reader must recall
(``Measurement(...)`` with 7 arguments); by keyword, each value names its
field. Records of up to three fields may be built by position.
"""

import ast

from helpers import ROOT
import pytest

PACKAGE = ROOT / "fp16_scaling"
# The most fields a record may be given by position.
MOST_POSITIONAL = 3


def _name(node: ast.AST):
  """The last name of ``node``: ``X`` of ``X`` or ``a.b.X``, else None."""
  if isinstance(node, ast.Attribute):
    return node.attr
  if isinstance(node, ast.Name):
    return node.id
  return None


def _is_dataclass(decorator: ast.AST) -> bool:
  """Whether ``decorator`` is ``dataclass`` or ``dataclasses.dataclass``,
  called (``@dataclass(frozen=True)``) or not."""
  if isinstance(decorator, ast.Call):
    decorator = decorator.func
  return _name(decorator) == "dataclass"


def record_classes(sources) -> set:
  """The names of the classes ``sources`` (module texts) define as records:
  deriving ``NamedTuple``, decorated as a dataclass, or deriving one of
  these (across the sources)."""
  classes = [
    node
    for source in sources
    for node in ast.walk(ast.parse(source))
    if isinstance(node, ast.ClassDef)
  ]
  records = {"NamedTuple"}
  grew = True
  while grew:  # until no class joins: a subclass may come before its base
    grew = False
    for node in classes:
      bases = {_name(b) for b in node.bases}
      is_record = bases & records or any(
        map(_is_dataclass, node.decorator_list)
      )
      if is_record and node.name not in records:
        records.add(node.name)
        grew = True
  return records - {"NamedTuple"}


def positional_records(source: str, records: set) -> list:
  """``"Name (line): n positional"`` for each call in ``source`` that
  builds one of ``records`` with more than ``MOST_POSITIONAL`` positional
  arguments (a ``*splat`` counts as one)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Call) or _name(node.func) not in records:
      continue
    if len(node.args) > MOST_POSITIONAL:
      name = _name(node.func)
      found.append(f"{name} ({node.lineno}): {len(node.args)} positional")
  return found


def _sources() -> dict:
  return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_walk_finds_records_and_their_positional_calls():
  source = """
import dataclasses
from typing import NamedTuple
from fp16_scaling import _measure

class Four(NamedTuple):
  a: int
  b: int
  c: int
  d: int

class Later(Base):
  pass

@dataclasses.dataclass(frozen=True)
class Base:
  a: int

class Plain:
  pass

Four(1, 2, 3, 4)
Four(1, 2, 3, d=4)
Four(a=1, b=2, c=3, d=4)
_measure.Four(1, 2, 3, 4, 5)
Later(1, 2, 3, 4)
Plain(1, 2, 3, 4)
"""
  records = record_classes([source])
  assert records == {"Four", "Base", "Later"}
  assert positional_records(source, records) == [
    "Four (22): 4 positional",
    "Four (25): 5 positional",
    "Later (26): 4 positional",
  ]


def test_the_package_defines_the_records_the_rule_is_about():
  records = record_classes(_sources().values())
  some = {"Measurement", "LossScaleState", "ScalerState", "ScaleConfig"}
  assert some <= records, some - records


@pytest.mark.parametrize(
  "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name
)
def test_no_record_of_four_or_more_fields_is_built_by_position(path):
  records = record_classes(_sources().values())
  assert positional_records(path.read_text(), records) == []
