"""No package module imports another's private name: a helper two modules
need lives, public within the package, in the module where its idea lives.

A private name is one with a leading underscore (dunders aside). It crosses
modules as ``from fp16_scaling._x import _y``, or as ``from fp16_scaling
import _x`` (or ``import fp16_scaling._x as _x``) followed by ``_x._y``.
"""

import ast

from helpers import ROOT
import pytest

PACKAGE = ROOT / "fp16_scaling"


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
  """Whether ``dotted`` names a module or package of fp16_scaling."""
  path = ROOT.joinpath(*dotted.split("."))
  return path.with_suffix(".py").is_file() or path.is_dir()


def private_imports(source: str) -> list:
  """The private names ``source`` takes from other fp16_scaling modules,
  as ``"module.name"``."""
  tree = ast.parse(source)
  modules = {}  # local name -> the fp16_scaling module it is bound to
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if not node.module.startswith("fp16_scaling"):
        continue
      for alias in node.names:
        dotted = f"{node.module}.{alias.name}"
        if _is_module(dotted):
          modules[alias.asname or alias.name] = dotted
        elif _is_private(alias.name):
          found.append(dotted)
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.asname and alias.name.startswith("fp16_scaling"):
          modules[alias.asname] = alias.name
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
      continue
    base = node.value
    if isinstance(base, ast.Name) and base.id in modules:
      found.append(f"{modules[base.id]}.{node.attr}")
  return found


def test_the_walk_finds_both_spellings():
  source = """
from fp16_scaling._norm import _sqrt
from fp16_scaling._norm import widen
from fp16_scaling import _sharding
from fp16_scaling.interop import _peers
import fp16_scaling._scaler as scaler

_sharding._leaf_specs(None, None, "")
_sharding.leaf_vector([], [], None)
_peers._int(1)
scaler._floor
x = object()
x._private
"""
  assert sorted(private_imports(source)) == [
    "fp16_scaling._norm._sqrt",
    "fp16_scaling._scaler._floor",
    "fp16_scaling._sharding._leaf_specs",
    "fp16_scaling.interop._peers._int",
  ]


@pytest.mark.parametrize(
  "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name
)
def test_no_private_name_is_imported_across_package_modules(path):
  assert private_imports(path.read_text()) == []
