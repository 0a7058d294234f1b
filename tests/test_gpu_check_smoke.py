"""Smoke test of benchmarks/gpu_check.py at its tiny sizes on the CPU: one
run of a few parts, the second of them given a limit too small to finish. What a
user of an unattended GPU run relies on: the JSON names every part with a
status, the markdown table has a row per part, a part past its limit is
recorded as timed out (killed, not waited for) and the parts after it still
run, and their numbers are read right: the markdown says what the JSON says,
the floor is the unit of the ratios, GB/s is bytes over step time, and
fp16_scaling's bytes stay within benchmarks/README.md's bound (<= 1.0x the
floor's). No timing is asserted."""

import argparse
import json
import re

import helpers
from helpers import ROOT
import pytest

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# The priority order: the tests first.
PARTS = ("env", "tests", "bandwidth", "step_cost_500M_500_cb_on")
PARTS += ("step_cost_500M_500_cb_off", "train_step", "step_cost_20M_1000_cb_on")
PARTS += ("step_cost_20M_1000_cb_off",)
# The step_cost part with command buffers off at its smaller --tiny shape
# (16 leaves, not 32: cheaper compiles, the same code path).
STEP = "step_cost_500M_500_cb_off"
RAN = ("env", "bandwidth", STEP, "tests")
# The tests part runs these (4 quick tests), not --tiny's whole file: what
# is checked is how the part's pytest output is read.
TESTS = "tests/test_scaler.py::test_presets_refuse_positional_arguments"
FLOOR, B = "a. optax clip + adamw, no scaling (floor)", "b. fp16_scaling"


def test_tiny_run_records_every_part(tmp_path):
  out = tmp_path / "out"
  args = ["--tiny", "--parts", ",".join(RAN), "--tests", TESTS]
  # jax cannot even be imported in this: the part must be killed.
  proc = helpers.run_script(SCRIPT, out, *args, "--limit", "bandwidth=0.5")
  # One part did not finish, so the run says so in its exit status.
  assert proc.returncode == 1, proc.stdout + proc.stderr
  report = json.loads((out / "gpu_check.json").read_text())
  parts = report["parts"]
  assert tuple(parts) == PARTS
  statuses = {name: parts[name]["status"] for name in PARTS}
  ran = {"env": "ok", "bandwidth": "timed out", STEP: "ok", "tests": "ok"}
  assert statuses == {n: ran.get(n, "not selected") for n in PARTS}, statuses
  assert parts["bandwidth"]["seconds"] < 60  # killed at its limit
  assert parts["env"]["result"]["devices"]
  # The parts that ran after the one that timed out measured their rows.
  tests = parts["tests"]["result"]
  assert tests["counts"]["passed"] > 1 and tests["failing"] == []
  assert TESTS in parts["tests"]["command"]
  # Counted from pytest's lines, one a test; the same as its closing line.
  closing = rf"{tests['counts']['passed']} passed in "
  assert re.match(closing, tests["pytest_summary"])
  step = parts[STEP]
  assert "--xla_gpu_enable_command_buffer=" in step["xla_flags"]
  rows = step["result"]["rows"]
  assert sorted(rows) == sorted([FLOOR, B, f"{B}, overflow step"])
  assert all(row["status"] == "ok" for row in rows.values()), rows
  assert rows[FLOOR]["wall_vs_floor"] == rows[FLOOR]["cpu_vs_floor"] == 1.0
  for row in rows.values():
    assert row["step_ms"] > 0 and row["wall_vs_floor"] > 0
    assert row["cpu_vs_floor"] > 0
    gb_s = row["bytes_accessed"] / (row["step_ms"] / 1e3) / 1e9
    assert row["gb_s"] == pytest.approx(gb_s, rel=1e-9)
  # One executable for the clean and the overflow step. (Its bytes against
  # the floor's are judged where the backend is known: on a GPU by
  # gpu_check's table, on XLA:CPU, which needs the copy option, by
  # tests/test_alias.py and targets.py.)
  overflow_bytes = rows[f"{B}, overflow step"]["bytes_accessed"]
  assert overflow_bytes == rows[B]["bytes_accessed"]
  assert rows[B]["bytes_accessed"] > 0
  for name in RAN:
    assert (out / parts[name]["log"]).exists()

  table = helpers.table_rows((out / "gpu_check.md").read_text())
  for name in PARTS:
    assert table[name][0] == statuses[name], table[name]
  assert table[STEP][2] == step["result"]["summary"]
  # Under the parts, each step_cost part's own table, as it printed it; the
  # part's summary gives each row's per-round ratio and its GB/s.
  for label, row in rows.items():
    cells = table[label]
    assert cells[2] == f"{row['step_ms']:.3f}", (label, cells)
    name = label.split(" ", 1)[0].rstrip(".")
    ratio = f"{name} {row['wall_vs_floor']:.3f}x, {row['gb_s']:,.1f} GB/s"
    assert ratio in step["result"]["summary"], (ratio, step["result"])
    if label != f"{B}, overflow step":
      assert cells[6] == f"{row['bytes_accessed']:,.0f}", (label, cells)


def test_failing_tests_are_named(tmp_path):
  """The failing ids come from pytest's own lines, also when it was killed
  before its summary."""
  gpu_check = helpers.load_script(SCRIPT)
  log = "\n".join(
    [
      "tests/test_a.py::test_one PASSED                    [ 25%]",
      "tests/test_a.py::test_two[x-1] FAILED               [ 50%]",
      "fp16_scaling/_norm.py::fp16_scaling._norm.norm PASSED [ 75%]",
      "tests/test_b.py::test_three SKIPPED (no jmp)        [100%]",
      "ERROR tests/test_c.py - ImportError: no module",
    ]
  )
  result = gpu_check.read_tests(log)
  assert result["counts"] == dict(passed=2, failed=1, skipped=1, error=1)
  failing = ["tests/test_a.py::test_two[x-1]", "tests/test_c.py"]
  assert result["failing"] == failing
  assert result["pytest_summary"] is None  # killed: no closing line


def test_tests_part_runs_the_suite_or_the_paths_given(tmp_path):
  gpu_check = helpers.load_script(SCRIPT)
  part = gpu_check.BY_NAME["tests"]

  def paths(tiny, tests=None):
    args = argparse.Namespace(tiny=tiny, tests=tests)
    cmd, result = gpu_check.command(part, args, str(tmp_path))
    assert result is None and cmd[1:3] == ["-m", "pytest"]
    rest = cmd[cmd.index("no:cacheprovider") + 1 :]
    return [a for a in rest if not a.startswith("--ignore=")]

  assert paths(False) == ["tests", "fp16_scaling"]
  assert paths(True) == list(gpu_check.TINY_TESTS)
  given = ["tests/test_a.py::test_b[x, 1]", "tests/test_c.py"]
  assert paths(False, given) == paths(True, given) == given
