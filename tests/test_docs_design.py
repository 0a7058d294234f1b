"""docs/design.md's state table names every field of every state type, and
nothing else: a field added to a NamedTuple without a word in the design
document fails here."""

import ast
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


_STATES = [fs.ScalerState, fs.WindowedScalerState, fs.LossScaleState]
_STATES += [fs.ClipState, fs.AccumulationState]


@pytest.mark.parametrize("state", _STATES, ids=lambda s: s.__name__)
def test_design_state_table_lists_exactly_the_fields(state):
  assert _table()[state.__name__] == list(state._fields)


_PACKAGE = _DESIGN.parents[1] / "fp16_scaling"
_LOCATOR = "_overflow_locator"  # the host-side locator's subpackage


def _module_map():
  """The table's modules as paths under fp16_scaling/ without ``.py``:
  ``_scaler``, ``interop/_peers``, ``_overflow_locator/locate``."""
  pattern = r"^\| `((?:interop/|_overflow_locator/)?_?\w+)\.py` \|"
  return re.findall(pattern, _DESIGN.read_text(), re.M)


def _on_disk(pattern):
  paths = [p for p in _PACKAGE.glob(pattern) if p.stem != "__init__"]
  return sorted(
    p.relative_to(_PACKAGE).with_suffix("").as_posix() for p in paths
  )


def _modules():
  """Every module of the package and of its two subpackages (interop, the
  overflow locator), as :func:`_module_map` names them; ``keras.py``, a
  wing no module imports, is checked on its own."""
  return (
    _on_disk("_*.py") + _on_disk("interop/_*.py") + _on_disk(f"{_LOCATOR}/*.py")
  )


def _parse(module):
  return ast.parse((_PACKAGE / f"{module}.py").read_text())


def _as_path(dotted):
  """``fp16_scaling.interop._peers.Peer`` as the module path
  ``interop/_peers``: the longest prefix that is a module or a package."""
  parts = dotted.split(".")[1:]
  while parts:
    path = "/".join(parts)
    if (_PACKAGE / f"{path}.py").exists() or (_PACKAGE / path).is_dir():
      return path
    parts.pop()
  return ""


def _imports(module):
  """The fp16_scaling modules ``module`` imports, as :func:`_module_map`
  names them (``interop`` for the subpackage itself); relative imports
  too."""
  tree = _parse(module)
  package = ["fp16_scaling", *module.split("/")[:-1]]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      dotted = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module.split(".") if node.module else []
      if node.level:
        base = package[: len(package) - node.level + 1] + base
      dotted = [".".join(base + [a.name]) for a in node.names]
    else:
      continue
    ours = [d for d in dotted if d.split(".")[0] == "fp16_scaling"]
    found.update(map(_as_path, ours))
  return found - {""}


def test_module_map_lists_every_module():
  assert sorted(_module_map()) == sorted(_modules())


def test_modules_import_only_those_above_them_in_the_map():
  order = _module_map()
  for i, module in enumerate(order):
    below = set(order[i:])
    assert not _imports(module) & below, (module, _imports(module) & below)


def test_the_interop_modules_are_listed_after_the_core():
  order = _module_map()
  wing = [m.startswith("interop/") for m in order]
  assert wing == sorted(wing) and any(wing), order


def test_no_core_module_imports_the_interop_subpackage():
  for module in _on_disk("_*.py"):
    wing = {m for m in _imports(module) if m.split("/")[0] == "interop"}
    assert not wing, (module, wing)


def test_no_module_imports_the_keras_wing():
  # fp16_scaling/keras.py imports Keras: the package reaches it only
  # through fs.keras (__init__'s __getattr__, by name, on first use).
  assert {"_chain", "_select"} <= _imports("keras")  # the reader sees it
  for module in _modules():
    assert "keras" not in _imports(module), module
  assert "keras" not in _imports("__init__")


def test_the_import_reader_sees_the_interop_subpackage():
  # The check above reads these forms; a reader that missed one would pass
  # it vacuously.
  assert "interop/_peers" in _imports("interop/_state_dict")
  assert "_lookup" in _imports("interop/_state_dict")
  assert _as_path("fp16_scaling.interop") == "interop"
  assert _as_path("fp16_scaling.interop._peers.Peer") == "interop/_peers"
  assert _as_path("fp16_scaling._scaler.Scaler") == "_scaler"


# ---------------------------------------------------------------------------
# The data-flow table: who makes each value, who receives it.


def _flow_rows():
  """``[(type, makers, receivers)]`` from the table under "## Data flow":
  makers as ``module.qualname``, receivers as ``(module.qualname, arg)``."""
  text = _DESIGN.read_text()
  section = text[text.index("## Data flow") :]
  section = section[: section.index("\n## ", 1)]
  rows = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 4 or not cells[1].startswith("`"):
      continue
    makers = re.findall(r"`([\w.]+)`", cells[2])
    receivers = re.findall(r"`([\w.]+)\((\w+)\)`", cells[3])
    rows.append((cells[1].strip("`"), makers, receivers))
  return rows


def _functions():
  """``{module.qualname: FunctionDef}`` for every function and method of
  the package, nested ones included."""
  found = {}

  def walk(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
        name = f"{prefix}.{child.name}"
        if isinstance(child, ast.FunctionDef):
          found[name] = child
        walk(child, name)

  for module in _modules():
    walk(_parse(module), module)
  return found


def _constructed_in(type_name, functions):
  """The innermost functions whose own body calls ``type_name(...)`` (or
  ``module.type_name(...)``)."""
  makers = set()
  for name, fn in functions.items():
    nested = [
      f for f in ast.walk(fn) if f is not fn and isinstance(f, ast.FunctionDef)
    ]
    inner = {id(n) for f in nested for n in ast.walk(f)}
    for node in ast.walk(fn):
      if id(node) in inner or not isinstance(node, ast.Call):
        continue
      f = node.func
      called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
      if called == type_name:
        makers.add(name)
  return makers


def test_data_flow_table_names_every_maker_and_real_receivers():
  rows = _flow_rows()
  assert len(rows) >= 7, rows
  functions = _functions()
  for type_name, makers, receivers in rows:
    # Each value is constructed by exactly the functions the table names.
    assert _constructed_in(type_name, functions) == set(makers), type_name
    for qualname, arg in receivers:
      fn = functions[qualname]
      names = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
      assert arg in names, (type_name, qualname, arg)
      # And it takes that type: annotated so, or traced to a use of it.
      why = _takes(type_name, qualname, arg, functions)
      assert why, f"{qualname}({arg}) shows no use of a {type_name}"


def _fields():
  """``{class name: {field: annotation text}}`` of the package's classes."""
  found = {}
  for module in _modules():
    for node in ast.walk(_parse(module)):
      if isinstance(node, ast.ClassDef):
        found[node.name] = {
          n.target.id: ast.unparse(n.annotation)
          for n in node.body
          if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        props = [n.name for n in node.body if isinstance(n, ast.FunctionDef)]
        found[node.name].update(dict.fromkeys(props, ""))
  return found


def _takes(type_name, qualname, arg, functions, depth=3):
  """Why ``qualname``'s parameter ``arg`` is a ``type_name`` (or holds one,
  for a lookup), or "" when nothing says so. The evidence, in order: the
  annotation names the type; the body calls something with ``arg`` and the
  type itself (``isinstance(state, LossScaleState)``, ``all_with_path(opt_state,
  LossScaleState)``); the body reads fields of ``arg`` and every one is a
  field of the type; or ``arg`` is passed to a package function whose
  parameter takes the type (traced ``depth`` calls deep), or to a class
  whose field of that place is annotated with the type."""
  fn = functions[qualname]
  params = fn.args.args + fn.args.kwonlyargs
  (param,) = [a for a in params if a.arg == arg]
  if param.annotation is not None:
    if type_name in ast.unparse(param.annotation):
      return "annotation"
  fields = _fields()
  reads = set()
  for node in ast.walk(fn):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      if node.value.id == arg:
        reads.add(node.attr)
    if not isinstance(node, ast.Call):
      continue
    given = [(i, a) for i, a in enumerate(node.args)]
    given += [(k.arg, k.value) for k in node.keywords]
    passed = [key for key, a in given if _is_name(a, arg)]
    if not passed:
      continue
    if any(_is_name(a, type_name) for _, a in given):
      return "called with the type"
    f = node.func
    callee = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
    if callee in fields and isinstance(passed[0], int):  # a constructor
      slots = list(fields[callee])[passed[0] : passed[0] + 1]
      if slots and type_name in fields[callee][slots[0]]:
        return f"stored as {callee}.{slots[0]}"
    for name, target in functions.items():
      if depth and name.rsplit(".", 1)[-1] == callee and name != qualname:
        targs = [a.arg for a in target.args.args + target.args.kwonlyargs]
        key = passed[0]
        if isinstance(key, int):
          key = targs[key] if key < len(targs) else None
        if key in targs and _takes(type_name, name, key, functions, depth - 1):
          return f"passed to {name}({key})"
  if reads and reads <= set(fields.get(type_name, ())):
    return "reads its fields"
  return ""


def _is_name(node, name):
  """``name``, ``x.name``, or either branch of ``a if c else b`` so."""
  if isinstance(node, ast.IfExp):
    return _is_name(node.body, name) or _is_name(node.orelse, name)
  return (isinstance(node, ast.Name) and node.id == name) or (
    isinstance(node, ast.Attribute) and node.attr == name
  )


def test_the_receiver_check_sees_a_wrong_type():
  # The check can fail: a receiver that takes something else is caught.
  functions = _functions()
  where = ("_loss_scale._next_state", "measurement", functions)
  assert _takes("Measurement", *where) and not _takes("ClipState", *where)
  assert not _takes("Measurement", "_lookup.clip_state", "opt_state", functions)


def test_the_package_has_no_hidden_channels():
  """No context variable, no jax.extend, no jaxpr: values travel by
  argument (the data-flow table above). The overflow locator, a host-side
  debugging tool that no step runs, reads the jaxpr of the step it re-runs
  (``jax.make_jaxpr``, public JAX); no context variable or ``jax.extend``
  there either."""
  channels = re.compile(r"contextvars|ContextVar|jax\.extend")
  jaxpr = re.compile(r"jaxpr")
  for path in _PACKAGE.rglob("*.py"):
    text = path.read_text()
    assert not channels.search(text), path
    if path.parent.name != _LOCATOR:
      assert not jaxpr.search(text), path


def test_no_module_of_the_step_imports_the_overflow_locator():
  # Only the package's __init__ reaches it (fs.locate_overflow).
  assert {"_grad", f"{_LOCATOR}/location"} <= _imports(f"{_LOCATOR}/locate")
  for module in _on_disk("_*.py") + _on_disk("interop/_*.py"):
    found = {m for m in _imports(module) if m.split("/")[0] == _LOCATOR}
    assert not found, (module, found)


# ---------------------------------------------------------------------------
# The step as docs/design.md tells it.


def _section(title, page=_DESIGN):
  text = page.read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end]


def test_the_backend_section_names_tests_that_exist():
  """ "On every backend" backs each claim with the tests that pin it: every
  file and test it names is there, and so is each helper it names."""
  section = _section("On every backend", _DESIGN.parent / "backends.md")
  named = re.findall(r"`(tests/\w+\.py)(?:::(\w+))?`", section)
  assert len(named) >= 10
  root = _DESIGN.parents[1]
  for path, test in named:
    source = (root / path).read_text()
    if test:
      assert re.search(rf"^def {test}\(", source, re.M), (path, test)
  helpers = (root / "tests" / "helpers.py").read_text()
  for name in ("SQRT_ULPS", "first_order_bound"):
    assert name in section and re.search(rf"^(def )?{name}\b", helpers, re.M)
