#!/usr/bin/env python
"""Where the bytes of a compiled step go: a per-instruction breakdown.

Reads the optimized HLO that ``step_cost.py --dump-hlo DIR`` writes and, for
every instruction of the entry computation that touches memory (fusions,
copies, reductions, ...), counts the bytes of its operands and of its result,
as XLA's ``bytes accessed`` roughly does. Instructions are grouped by name
stem (``copy``, ``add_select_fusion``, ``wrapped_reduce-window``, ...), which
shows each extra pass over memory: a ``copy`` of an optimizer moment, a second
read of the gradients, a materialized intermediate.

  python benchmarks/hlo_traffic.py /tmp/hlo/fp16_20M_200.hlo.txt --params 20e6
  python benchmarks/hlo_traffic.py A.hlo.txt B.hlo.txt --params 20e6  # side by
  side
  python benchmarks/hlo_traffic.py A.hlo.txt B.hlo.txt --per-leaf 500  # ops
"""

import argparse
import collections
import re
import sys

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$"
)
_FREE = {
  "parameter",
  "constant",
  "tuple",
  "get-tuple-element",
  "bitcast",
  "opt-barrier",
  "after-all",
  "partition-id",
  "replica-id",
}


def shape_bytes(text):
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _DTYPE_BYTES.get(dtype, 4)
  return total


def computations(hlo):
  """{name: [instruction lines]} and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
    if m and not line.startswith(" "):
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        entry = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def stem(name):
  return re.sub(r"(\.\d+)+$", "", name)


_CALLED = re.compile(
  r"(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+)|"
  r"false_computation=%([\w.\-]+)|body=%([\w.\-]+)|"
  r"condition=%([\w.\-]+))"
)


def breakdown(hlo):
  """{group: [count, bytes]} over the entry computation.

  A ``conditional`` counts its costliest branch, a ``while`` its body once,
  each under ``<instruction stem>/``; fused computations are not entered (a
  fusion is counted by its operands and result, as XLA does).
  """
  comps, entry = computations(hlo)

  def walk(comp, prefix, out):
    sizes = {}
    for line in comps.get(comp, []):
      m = _INSTR.match(line)
      if not m:
        continue
      name, shape, op, rest = m.groups()
      sizes[name] = shape_bytes(shape)
      if op in _FREE:
        continue
      if op in ("conditional", "while", "call"):
        called = [
          n
          for g in _CALLED.findall(rest)
          for part in g
          if part
          for n in re.findall(r"[\w.\-]+", part)
        ]
        if op == "call":
          called = re.findall(r"to_apply=%([\w.\-]+)", rest)
        subs = []
        for c in called:
          sub = collections.OrderedDict()
          walk(c, f"{prefix}{stem(name)}/", sub)
          subs.append(sub)
        if op == "conditional" and subs:
          subs = [max(subs, key=lambda t: sum(b for _, b in t.values()))]
        for sub in subs:
          for k, (n, b) in sub.items():
            e = out.setdefault(k, [0, 0])
            e[0] += n
            e[1] += b
        continue
      operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
      b = sizes[name] + sum(sizes.get(o, 0) for o in operands)
      key = prefix + ("copy" if op == "copy" else stem(name))
      e = out.setdefault(key, [0, 0])
      e[0] += 1
      e[1] += b
    return out

  return walk(entry, "", collections.OrderedDict())


def fused_ops(hlo):
  """``(fusions, {opcode: count})`` of the entry computation: its fusions,
  and the array instructions inside them (not parameters, constants,
  broadcasts or bitcasts; a scalar instruction counted as ``op(scalar)``)."""
  comps, entry = computations(hlo)
  fusions, ops = 0, collections.Counter()
  for line in comps.get(entry, []):
    m = _INSTR.match(line)
    if not m or m.group(3) != "fusion":
      continue
    fusions += 1
    called = re.search(r"calls=%([\w.\-]+)", m.group(4)).group(1)
    for inner in comps.get(called, []):
      i = _INSTR.match(inner)
      if i and i.group(3) not in ("parameter", "constant", "broadcast"):
        if i.group(3) != "bitcast":
          scalar = "[]" in i.group(2).split("{")[0]
          ops[i.group(3) + ("(scalar)" if scalar else "")] += 1
  return fusions, ops


def per_leaf(files, leaves):
  """Prints each file's fusions and fused array ops per leaf, by opcode."""
  counts = [fused_ops(open(f).read()) for f in files]
  kinds = sorted({k for _, ops in counts for k in ops})
  kinds = [k for k in kinds if not k.endswith("(scalar)")]
  names = [f.split("/")[-1] for f in files]
  if len(set(names)) < len(names):  # same file name: add the folder
    names = ["/".join(f.split("/")[-2:]) for f in files]
  print(f"| per leaf ({leaves} leaves) | " + " | ".join(names) + " |")
  print("|---|" + "---:|" * len(files))
  print(
    "| fusions | " + " | ".join(f"{n / leaves:.2f}" for n, _ in counts) + " |"
  )
  total = [sum(v for k, v in ops.items() if k in kinds) for _, ops in counts]
  print(
    "| array ops in fusions | "
    + " | ".join(f"{t / leaves:.1f}" for t in total)
    + " |"
  )
  for k in kinds:
    print(
      f"| {k} | "
      + " | ".join(f"{ops[k] / leaves:.2f}" for _, ops in counts)
      + " |"
    )


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("hlo", nargs="+", help="optimized HLO text files")
  p.add_argument(
    "--params",
    type=float,
    default=1.0,
    help="divide bytes by this (the parameter count) for B/param",
  )
  p.add_argument(
    "--min",
    type=float,
    default=0.05,
    help="hide groups below this many B/param (default 0.05)",
  )
  p.add_argument(
    "--per-leaf",
    type=int,
    metavar="LEAVES",
    help="instead: fusions and the array ops inside them, per leaf",
  )
  args = p.parse_args(argv)
  if args.per_leaf:
    return per_leaf(args.hlo, args.per_leaf)
  tables = [breakdown(open(f).read()) for f in args.hlo]
  keys = []
  for t in tables:
    keys += [k for k in t if k not in keys]
  unit = "B/param" if args.params != 1.0 else "bytes"
  names = [f.split("/")[-1] for f in args.hlo]
  if len(set(names)) < len(names):  # same file name: add the folder
    names = ["/".join(f.split("/")[-2:]) for f in args.hlo]
  print(
    "| instructions | " + " | ".join(f"{n} (n, {unit})" for n in names) + " |"
  )
  print("|---|" + "---:|" * len(args.hlo))
  totals = [0.0] * len(tables)
  for k in keys:
    cells = []
    show = False
    for i, t in enumerate(tables):
      n, b = t.get(k, (0, 0))
      totals[i] += b / args.params
      show |= b / args.params >= args.min
      cells.append(f"{n}, {b / args.params:.2f}" if n else "–")
    if show:
      print(f"| {k} | " + " | ".join(cells) + " |")
  print("| **total** | " + " | ".join(f"{t:.2f}" for t in totals) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
