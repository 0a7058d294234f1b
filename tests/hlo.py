"""Reading a compiled executable's optimized HLO text, for the tests that
check what XLA kept: which outputs alias a donated input, which ``copy``
instructions the entry computation holds, and which instructions an output
depends on.

The text is split into computations and instructions by
benchmarks/hlo_traffic.py's parser, the one that counts where a step's bytes
go: the tests and the benchmark read HLO the same way."""

import re

import helpers

_TRAFFIC = helpers.load_script(helpers.ROOT / "benchmarks" / "hlo_traffic.py")
_ALIAS = re.compile(r"\{(\d+)\}: \((\d+), \{\}")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")


def aliased_outputs(text: str) -> dict:
  """``{output index: parameter number}`` from ``input_output_alias``."""
  header = text.splitlines()[0]
  if "input_output_alias=" not in header:
    return {}
  return {int(o): int(p) for o, p in _ALIAS.findall(header)}


def computations(text: str) -> dict:
  """``{name: [instruction dicts]}``; the entry computation is also under
  the key ``"ENTRY"``. Each instruction has ``name``, ``shape``, ``op``,
  ``operands`` (names), ``calls`` (computation names), ``root``, ``line``."""
  lines_of, entry = _TRAFFIC.computations(text)
  comps = {}
  for comp, lines in lines_of.items():
    comps[comp] = []
    for line in lines:
      m = _TRAFFIC._INSTR.match(line)
      if m is None:
        continue
      name, shape, op, args = m.groups()
      comps[comp].append(
        {
          "name": name,
          "shape": shape,
          "op": op,
          "operands": _OPERAND.findall(args.split("),")[0]) if args else [],
          "calls": _CALLS.findall(line),
          "root": line.lstrip().startswith("ROOT "),
          "line": line.strip(),
        }
      )
  comps["ENTRY"] = comps[entry]
  return comps


def entry_copies(text: str) -> list:
  """The entry computation's ``copy`` instructions, as lines."""
  return [i["line"] for i in computations(text)["ENTRY"] if i["op"] == "copy"]


def output_count(text: str) -> int:
  """How many outputs the entry computation returns (its root tuple's
  operands; 1 for a non-tuple root)."""
  root = [i for i in computations(text)["ENTRY"] if i["root"]][0]
  return len(root["operands"]) if root["op"] == "tuple" else 1


def ops_feeding_output(text: str, index: int) -> list:
  """Every instruction line, called computations included, that the entry's
  output ``index`` depends on."""
  comps = computations(text)
  entry = {i["name"]: i for i in comps["ENTRY"]}
  root = [i for i in comps["ENTRY"] if i["root"]][0]
  todo = [root["operands"][index]] if root["op"] == "tuple" else [root["name"]]
  seen, lines, called = set(), [], []
  while todo:
    name = todo.pop()
    if name in seen or name not in entry:
      continue
    seen.add(name)
    inst = entry[name]
    lines.append(inst["line"])
    todo.extend(inst["operands"])
    called.extend(inst["calls"])
  done = set()
  while called:
    name = called.pop()
    if name in done or name not in comps:
      continue
    done.add(name)
    for inst in comps[name]:
      lines.append(inst["line"])
      called.extend(inst["calls"])
  return lines
