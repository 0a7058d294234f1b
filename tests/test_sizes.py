"""The project's size limits, counted in statements, and a density cap.

A statement is an ``ast.stmt`` node, imports and docstrings aside: what the
code does, however it is laid out. The limits: the package at most 3,000
statements, no module over 160, no function over 35 (a function's
statements are those of its body, nested functions included);
benchmarks/ at most 1,950 (1,551 when the rule was set, and room for the
step_cost and gpu_check rows then being added).

Density is AST nodes (every node of the module's tree) per code line, a
code line being a line that holds a token other than a comment, outside
docstrings. No package module is over 10 nodes per code line and no test
file over 12.5; a module of fewer than 30 code lines is exempt (too few
lines to average), and so are the data tables named in ``TABLES``.

The package's limit was 2,150 when the rule was set (2,066 statements
then). Three changes made with it brought the package to 2,232: the checks
that make the silent slips loud (the model-state select refusing a stale,
swapped or aliasing pair, unscaled gradients named, apply_if_finite and a
sync that would undo a set scale refused: about 80 statements, most in
``_select``, ``_lookup``, ``_metrics`` and ``_shared``), the declared
protocol between the step's pieces (``_chain``, about 10), and the named
intermediate values that brought ``_norm`` and ``_sharding`` under the
density cap (about 45). None of them is folded back to meet a size. The
stacked layout's move into the closure (``ScaleConfig.layout``, resolved
once by ``tx.init``) added 8, and simplifications took 22 away (``_norm``'s
grouped reduction, jmp's configuration fields read from one table, and
four smaller ones): 2,219. The state's history out of its treedef, into
``_provenance`` (records by identity, 35 statements, with the marks, their
replace and the nnx special case gone: +10 in all), then 20 statements of
dead branches and duplicated reads found by coverage and ``duplicates``
(the peers' configuration tables read by one reader, checks whose callers
already guarantee them, an empty tree's special case the general path
covers): 2,209.

Five issues on 2026-12-06, the limit restated from 2,250 to 3,000 for the
capabilities they asked for, each counted when it landed: the state's
history out of module tables and into the treedef, compared by value
(``_provenance`` and ``_select``'s tables gone, a ``Built`` record and a
per-call guard in: -33, 2,176); the measurement's GPU form and its one plan
(``_segments``, ``_range``, ``_measure.Plan``: +185); ``fs.keras``, Keras's
``compile`` and ``fit`` (+160, 10 of them the step's own loss for the
overflow kind); ``fs.locate_overflow``, the host-side locator (+300, after
a review took 20 away: the package's own ``set_loss_scale`` and argument
split reused); ``fs.compute_dtypes`` and the NNX layers' compute dtype
under ``policy=`` (+133): 2,954. A review of the five after they landed:
dead code (``measure``'s plan fallback, a never-taken ``__eq__`` branch),
an argument read only for a shape, the skip read once in Keras's step
(-5), and the range's kind by the configuration for ``tree_map_params``'
placeholder (+1): 2,950.

History: the limits were in lines of code (at last 3,700 for the package,
300 a module, 60 a function body). Lines measure layout, not logic: they
were met by folding, and the folding added statements (a named lambda, a
kwargs dict built in pieces) while it cut lines. Statements count the logic;
the density cap keeps the logic from being packed onto fewer lines.
"""

import ast
import io
import pathlib
import tokenize

from helpers import ROOT
import pytest

PACKAGE = ROOT / "fp16_scaling"
BENCHMARKS = ROOT / "benchmarks"
TESTS = ROOT / "tests"
PACKAGE_DENSITY = 10.0
TEST_DENSITY = 12.5
# Modules with fewer code lines than this are not held to a density.
DENSITY_FROM = 30
# Data tables: top-level assignments, by file and name, whose lines and
# nodes a test file's density leaves out, each with why it is a table.
TABLES = {}
_SKIP = {
  tokenize.COMMENT,
  tokenize.NL,
  tokenize.NEWLINE,
  tokenize.INDENT,
  tokenize.DEDENT,
  tokenize.ENDMARKER,
}
_SCOPES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def docstrings(tree: ast.AST) -> list:
  """The docstring statements of ``tree``: of the module, a class or a
  function."""
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, _SCOPES) or not node.body:
      continue
    first = node.body[0]
    is_string = isinstance(first, ast.Expr) and isinstance(
      first.value, ast.Constant
    )
    if is_string and isinstance(first.value.value, str):
      out.append(first)
  return out


def code_lines(source: str) -> set:
  """The line numbers of ``source`` that hold code: a token other than a
  comment, a newline or an indent, outside any docstring."""
  docs = set()
  for doc in docstrings(ast.parse(source)):
    docs.update(range(doc.lineno, doc.end_lineno + 1))
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in _SKIP:
      lines.update(range(tok.start[0], tok.end[0] + 1))
  return lines - docs


def statements(tree: ast.AST) -> int:
  """The statements in ``tree`` (itself included), imports and docstrings
  aside."""
  docs = {id(doc) for doc in docstrings(tree)}
  count = 0
  for node in ast.walk(tree):
    is_import = isinstance(node, (ast.Import, ast.ImportFrom))
    if isinstance(node, ast.stmt) and not is_import and id(node) not in docs:
      count += 1
  return count


def function_statements(source: str) -> dict:
  """``{name (line): statements of its body}`` for every function, nested
  ones included (a body counts the functions nested in it)."""
  out = {}
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, _FUNCTIONS):
      out[f"{node.name} ({node.lineno})"] = statements(node) - 1
  return out


def density(source: str, tables=()) -> float:
  """AST nodes per code line of ``source``, leaving out the top-level
  assignments to the names in ``tables``; 0.0 under ``DENSITY_FROM`` code
  lines."""
  tree = ast.parse(source)
  lines = code_lines(source)
  nodes = sum(1 for _ in ast.walk(tree))
  for node in tree.body:
    targets = getattr(node, "targets", [getattr(node, "target", None)])
    names = {getattr(t, "id", None) for t in targets}
    if names & set(tables):
      nodes -= sum(1 for _ in ast.walk(node))
      lines -= set(range(node.lineno, node.end_lineno + 1))
  if len(lines) < DENSITY_FROM:
    return 0.0
  return nodes / len(lines)


def _modules():
  return sorted(PACKAGE.rglob("*.py"))


def _test_files():
  return sorted(TESTS.rglob("*.py"))


def _relative(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def _test_file_cases():
  cases = []
  for path in _test_files():
    cases.append(pytest.param(path, id=_relative(path)))
  return cases


def test_the_counter_counts_statements_nodes_and_code_lines():
  source = '''"""Module
docstring."""
import os

# a comment
def f(x):  # trailing
  """Doc."""
  y = (x +
       1)
  if y:
    return y
  return -y
'''
  # The def, y =, the if, and the two returns; not the import or the
  # docstrings.
  assert statements(ast.parse(source)) == 5
  assert function_statements(source) == {"f (6)": 4}
  assert sorted(code_lines(source)) == [3, 6, 8, 9, 10, 11, 12]
  # Module, its docstring's Expr and Constant, Import, alias, FunctionDef,
  # arguments, arg, f's docstring's Expr and Constant; y = (x + 1): Assign,
  # Name y, Store, BinOp, Name x, Load, Add, Constant 1; the if: If, Name y,
  # Load, Return, Name y, Load; return -y: Return, UnaryOp, USub, Name y,
  # Load. 29 nodes on 7 code lines, a density of 0.0 under 30 code lines.
  assert sum(1 for _ in ast.walk(ast.parse(source))) == 29
  assert density(source) == 0.0
  long = source + "z = 0\n" * 30
  assert density(long) == (29 + 30 * 4) / 37
  # A table's assignment leaves its lines and nodes out.
  table = "TABLE = [\n" + "  (1, 2),\n" * 3 + "]\n"
  assert density(long + table, tables={"TABLE"}) == density(long)


def test_the_package_holds_at_most_3000_statements():
  total = sum(statements(ast.parse(p.read_text())) for p in _modules())
  assert total <= 3000, total


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_module_over_160_statements(path):
  assert statements(ast.parse(path.read_text())) <= 160


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_function_over_35_statements(path):
  sizes = function_statements(path.read_text())
  long = {name: n for name, n in sizes.items() if n > 35}
  assert not long, long


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_no_package_module_over_10_nodes_per_code_line(path):
  assert density(path.read_text()) <= PACKAGE_DENSITY


@pytest.mark.parametrize("path", _test_file_cases())
def test_no_test_file_over_12_5_nodes_per_code_line(path):
  tables = TABLES.get(_relative(path), {})
  assert density(path.read_text(), tables) <= TEST_DENSITY


def test_benchmarks_hold_at_most_1950_statements():
  sizes = {
    p.name: statements(ast.parse(p.read_text()))
    for p in BENCHMARKS.glob("*.py")
  }
  assert sum(sizes.values()) <= 1950, sizes
