#!/usr/bin/env python
"""The project's step-cost targets, judged on ``step_cost.py``'s measurement.

Same flags as ``step_cost.py``; next to the floor, fp16_scaling's step must
hold ``TARGETS`` (benchmarks/README.md): wall per round <= 1.03x, bytes
<= 1.0x, compile <= 1.5x, an overflow step <= 1.0x a clean one. On XLA:CPU
it compiles with ``CPU_OPTION`` unless ``--compiler-option`` is given.

  python benchmarks/targets.py --shape 20M/200 --recipes floor,fp16,fp16_expert
  python benchmarks/targets.py --tiny              # seconds; the smoke test
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
import step_cost  # noqa: E402  (one way: step_cost imports nothing here)

TARGETS = dict(wall=1.03, bytes=1.0, compile=1.5, overflow=1.0)
CPU_OPTION = "xla_cpu_copy_insertion_use_region_analysis=true"


def verdicts(keys, results, wall, record):
  """Lines judging fp16_scaling's rows of ``step_cost.table`` against
  ``TARGETS`` (its ``notes_fn``)."""
  label = {k: step_cost.BY_KEY[k].label for k in ("floor", "fp16")}
  rows, notes = record["rows"], []
  if wall.get(step_cost.OVERFLOW_ROW) and wall.get(label["fp16"]):
    ratios = common.paired(wall[step_cost.OVERFLOW_ROW], wall[label["fp16"]])
    verdict = common.verdict(ratios, TARGETS["overflow"])
    notes.append(f"overflow step / clean step vs target: {verdict}")
  floor = rows.get(label["floor"], {})
  if floor.get("status") != "ok":
    return notes
  for key in (k for k in ("fp16", "fp16_expert") if k in keys):
    name, row = step_cost.BY_KEY[key].label, rows[step_cost.BY_KEY[key].label]
    limit = TARGETS["compile"]
    if row.get("status") != "ok":
      notes.append(f"{name}: {row['status']}: MISS (compile target {limit}x)")
      continue
    b = row["bytes_accessed"] / floor["bytes_accessed"]
    c = (row["lower_s"] + row["compile_s"]) / (
      floor["lower_s"] + floor["compile_s"]
    )
    ratios = common.paired(wall[name], wall[label["floor"]])
    time = common.verdict(ratios, TARGETS["wall"])
    notes.append(
      f"{name} vs targets: wall per round {time}; bytes {b:.3f}x "
      f"{common.judged(b, TARGETS['bytes'])} (<= {TARGETS['bytes']}x); "
      f"compile {c:.3f}x {common.judged(c, limit)} (<= {limit}x)"
    )
  return notes


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--compiler-option" not in argv:
    import jax

    if jax.default_backend() == "cpu":
      argv += ["--compiler-option", CPU_OPTION]
  return step_cost.main(argv, verdicts, __doc__, prog="targets.py")


if __name__ == "__main__":
  sys.exit(main())
