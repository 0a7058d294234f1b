#!/usr/bin/env python
"""Where the bytes of a compiled step go: a per-instruction breakdown.

Reads ``step_cost.py --dump-hlo`` output and counts, for every instruction
of the entry computation that touches memory, the bytes of its operands and
result (as XLA's ``bytes accessed`` roughly does), grouped by name stem.

  python benchmarks/hlo_traffic.py A.hlo.txt B.hlo.txt --params 20e6
  python benchmarks/hlo_traffic.py A.hlo.txt B.hlo.txt --per-leaf 500  # ops
"""

import argparse
import collections
import re
import sys

_DTYPE_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4)
_DTYPE_BYTES.update(u32=4, f32=4, s64=8, u64=8, f64=8)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$"
)
_FREE = set(
  "parameter constant tuple get-tuple-element bitcast opt-barrier after-all "
  "partition-id replica-id".split()
)


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


def elements(text):
  """``(elements, bytes per element)`` of the first array shape in
  ``text``; (0, 0) for none."""
  m = _ARRAY.search(text)
  if not m:
    return 0, 0
  n = 1
  for d in filter(None, m.group(2).split(",")):
    n *= int(d)
  return n, _DTYPE_BYTES.get(m.group(1), 4)


def slices_only(lines):
  """Whether a fused computation is elementwise work on slices: a
  ``slice`` and nothing that reads an operand otherwise than element for
  element (a reduction, a dot, a gather, a transpose, a concatenation)."""
  ops = {m.group(3) for m in map(_INSTR.match, lines) if m}
  other = {"reduce", "dot", "gather", "transpose", "concatenate", "scatter"}
  other |= {"reduce-window", "dynamic-slice", "dynamic-update-slice", "pad"}
  return "slice" in ops and not ops & other


def breakdown(hlo, branch=None, slices=False):
  """{group: [count, bytes]} over the entry computation of ``hlo``.

  ``branch`` None counts each ``conditional`` by its costliest branch, as
  XLA's ``bytes accessed`` does; an index (0: the false or first branch)
  counts that branch of each top-level conditional and the cheapest of any
  nested one. A ``while`` counts its body once, called computations under
  ``<instruction stem>/``; a fusion counts its operands and result, and
  with ``slices`` a loop fusion of elementwise work on slices
  (``slices_only``) counts, of an operand larger than its result, only as
  many elements as the result has: XLA's count takes the whole operand,
  and ``optax.flatten``'s step slices each leaf's update out of a vector
  of all of them, once a leaf."""
  comps, entry = computations(hlo)

  def walk(comp, prefix, out, branch):
    sizes, shapes = {}, {}
    for line in comps.get(comp, []):
      m = _INSTR.match(line)
      if not m:
        continue
      name, shape, op, rest = m.groups()
      sizes[name], shapes[name] = shape_bytes(shape), shape
      if op in _FREE:
        continue
      if op in ("conditional", "while", "call"):
        if op == "call":
          called = re.findall(r"to_apply=%([\w.\-]+)", rest)
        else:
          found = _CALLED.findall(rest)
          if op == "conditional" and found and not found[0][0]:
            found = [found[1], found[0]]  # pred: false first, as branch 0
          called = [n for g in found for part in g if part
                    for n in re.findall(r"[\w.\-]+", part)]  # fmt: skip
        inner = None if branch is None else "cheapest"
        subs = [walk(c, f"{prefix}{stem(name)}/", {}, inner) for c in called]
        if op == "conditional" and subs:
          cost = [sum(b for _, b in t.values()) for t in subs]
          pick = cost.index(max(cost) if branch is None else min(cost))
          subs = [subs[branch if isinstance(branch, int) else pick]]
        for sub in subs:
          for k, (n, b) in sub.items():
            e = out.setdefault(k, [0, 0])
            e[0] += n
            e[1] += b
        continue
      operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
      b = sizes[name] + sum(sizes.get(o, 0) for o in operands)
      fused = re.search(r"calls=%([\w.\-]+)", rest)
      if slices and fused and slices_only(comps.get(fused.group(1), [])):
        # A loop fusion reads, of an operand larger than its result, the
        # elements of its result's slice: as many as the result has.
        n = elements(shape)[0]
        for o in operands:
          size, width = elements(shapes.get(o, ""))
          b -= (size - n) * width if size > n else 0
      e = out.setdefault(
        prefix + ("copy" if op == "copy" else stem(name)), [0, 0]
      )
      e[0] += 1
      e[1] += b
    return out

  return walk(entry, "", {}, branch)


def total_bytes(hlo, branch=None, slices=False):
  """The bytes of :func:`breakdown`, summed over its groups."""
  return sum(b for _, b in breakdown(hlo, branch, slices).values())


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


def kernels(hlo, branch=None):
  """``(fusions, kernels)`` of a compiled module: its ``fusion``
  instructions, and every instruction that does work (a fusion, a copy, a
  lone reduction, a custom call: not one of ``_FREE``, nor a ``call``,
  ``while`` or ``conditional``, which are walked into), from the entry
  computation down. A loop's body counts once; every branch of a
  conditional, or with ``branch`` only that one (0: a ``lax.cond``'s false
  branch, the one a clean step of fp16_scaling takes)."""
  found = work(hlo, branch)
  return sum(op == "fusion" for op, _ in found), len(found)


def work(hlo, branch=None):
  """``[(opcode, called computation or None)]``: the instructions
  :func:`kernels` counts."""
  comps, entry = computations(hlo)
  out, todo, seen = [], [entry], set()
  while todo:
    comp = todo.pop()
    if comp in seen:
      continue
    seen.add(comp)
    for line in comps.get(comp, []):
      m = _INSTR.match(line)
      if not m or m.group(3) in _FREE or m.group(3).endswith("-done"):
        continue
      op, rest = m.group(3), m.group(4)
      if op in ("conditional", "while", "call"):
        found = re.findall(r"to_apply=%([\w.\-]+)", rest)
        for groups in _CALLED.findall(rest):
          for part in filter(None, groups):
            found += re.findall(r"[\w.\-]+", part)
        if op == "conditional" and branch is not None:
          groups = _CALLED.findall(rest)
          if groups and not groups[0][0]:  # pred: false first, as branch 0
            groups = [groups[1], groups[0]]
          names = [n for g in groups for part in g if part
                   for n in re.findall(r"[\w.\-]+", part)]  # fmt: skip
          found = names[branch : branch + 1]
        todo += [c.lstrip("%") for c in found]
        continue
      fused = re.search(r"calls=%([\w.\-]+)", rest)
      out.append((op, fused.group(1) if fused else None))
  return out


def reductions(hlo, branch=None):
  """The kernels of :func:`work` that reduce: a fusion whose computation
  holds a ``reduce`` (XLA:GPU's reduction fusions, Triton's included),
  and a lone ``reduce``."""
  comps, _ = computations(hlo)
  ops = lambda c: {m.group(3) for m in map(_INSTR.match, comps.get(c, [])) if m}
  return sum(
    op == "reduce" or (called is not None and "reduce" in ops(called))
    for op, called in work(hlo, branch)
  )


def row(*cells):
  """One markdown table row of ``cells``."""
  return "| " + " | ".join(map(str, cells)) + " |"


def names(files):
  """The files' names, with their folder where two names are the same."""
  out = [f.split("/")[-1] for f in files]
  if len(set(out)) < len(out):
    out = ["/".join(f.split("/")[-2:]) for f in files]
  return out


def per_leaf(files, leaves):
  """Prints each file's fusions and fused array ops per leaf, by opcode."""
  counts = [fused_ops(open(f).read()) for f in files]
  kinds = sorted({k for _, ops in counts for k in ops})
  kinds = [k for k in kinds if not k.endswith("(scalar)")]
  print(row(f"per leaf ({leaves} leaves)", *names(files)))
  print("|---|" + "---:|" * len(files))
  print(row("fusions", *(f"{n / leaves:.2f}" for n, _ in counts)))
  total = [sum(v for k, v in ops.items() if k in kinds) for _, ops in counts]
  print(row("array ops in fusions", *(f"{t / leaves:.1f}" for t in total)))
  for k in kinds:
    print(row(k, *(f"{ops[k] / leaves:.2f}" for _, ops in counts)))


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add = p.add_argument
  add("hlo", nargs="+", help="optimized HLO text files")
  add("--params", type=float, default=1.0, help="the parameter count: B/param")
  add("--min", type=float, default=0.05, help="hide groups below this B/param")
  add("--per-leaf", type=int, metavar="LEAVES", help="fusions, ops per leaf")
  add("--slices", action="store_true", help="an operand that a fusion only "
      "slices counts the slices' bytes, not its own")  # fmt: skip
  args = p.parse_args(argv)
  if args.per_leaf:
    return per_leaf(args.hlo, args.per_leaf)
  tables = [breakdown(open(f).read(), slices=args.slices) for f in args.hlo]
  keys = list(dict.fromkeys(k for t in tables for k in t))
  unit = "B/param" if args.params != 1.0 else "bytes"
  print(row("instructions", *(f"{n} (n, {unit})" for n in names(args.hlo))))
  print("|---|" + "---:|" * len(args.hlo))
  totals = [0.0] * len(tables)
  for k in keys:
    cells = [t.get(k, (0, 0)) for t in tables]
    totals = [s + b / args.params for s, (_, b) in zip(totals, cells)]
    if max(b for _, b in cells) / args.params >= args.min:
      cells = [f"{n}, {b / args.params:.2f}" if n else "–" for n, b in cells]
      print(row(k, *cells))
  print(row("**total**", *(f"{t:.2f}" for t in totals)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
