"""Smoke test of benchmarks/gpu_check.py at its tiny sizes on the CPU, and
of how it reads what its parts leave. What a user of an unattended GPU run
relies on: one run of every part under pytest-xdist (``PYTEST_ADDOPTS="-n
2"``) ends with every part ok, the tests part's counts read from xdist's
output, the JSON names every part with a status, the markdown table has a
row per part, and the step rows are read right (the floor is the unit of
the ratios, GB/s is bytes over step time, its fraction is of the copy
bandwidth of the same run); a part past its limit is killed, not waited
for, and a step_cost part killed so keeps the rows it timed. No timing is
asserted."""

import argparse
import json
import re
import sys

import helpers
from helpers import ROOT
import pytest

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# The priority order: the default-flag floor and fp16 rows first, then the
# tests, then the rest.
PARTS = ("env", "step_cost_500M_500_cb_on", "tests", "bandwidth")
PARTS += ("train_step", "step_cost_500M_500_peers", "step_cost_500M_500_cb_off")
PARTS += ("step_cost_20M_1000_cb_on", "step_cost_20M_1000_cb_off", "kernels")
# The tests part runs these 4 quick tests, not --tiny's whole file: what
# is checked is how the part's pytest output is read.
TESTS = "tests/test_scaler.py::test_presets_refuse_positional_arguments"
FLOOR, B = "a. optax clip + adamw, no scaling (floor)", "b. fp16_scaling"


@pytest.fixture(scope="module")
def gpu_check():
  return helpers.load_script(SCRIPT)


def test_tiny_run_of_every_part_under_xdist_is_ok(tmp_path, monkeypatch):
  monkeypatch.setenv("PYTEST_ADDOPTS", "-n 2")
  out = tmp_path / "out"
  proc = helpers.run_script(SCRIPT, out, "--tiny", "--tests", TESTS)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  report = json.loads((out / "gpu_check.json").read_text())
  parts = report["parts"]
  assert tuple(parts) == PARTS
  statuses = {name: parts[name]["status"] for name in PARTS}
  assert statuses == dict.fromkeys(PARTS, "ok"), statuses
  assert parts["env"]["result"]["devices"]
  # The tests ran on 2 xdist workers, whose "[gwN]" lines are read.
  tests = parts["tests"]["result"]
  log = (out / parts["tests"]["log"]).read_text()
  assert re.search(r"^\[gw1\] \[\s*\d+%\] PASSED ", log, re.M), log[-3000:]
  assert "-n" not in parts["tests"]["command"]  # PYTEST_ADDOPTS says it
  assert tests["counts"] == dict(passed=4) and tests["failing"] == []
  assert tests["summary"] == "4 passed"
  assert re.match(r"4 passed in ", tests["pytest_summary"])
  table = helpers.table_rows((out / "gpu_check.md").read_text())
  for name in PARTS:
    assert table[name][0] == "ok", table[name]
  assert table["tests"][2] == "4 passed"

  gpu_check = helpers.load_script(SCRIPT)
  recipes = helpers.load_script(ROOT / "benchmarks" / "recipes.py")
  for part in (p for p in gpu_check.PARTS if p.shape):
    step = parts[part.name]
    assert ("--xla_gpu_enable_command_buffer=" in step["xla_flags"]) is (
      not part.command_buffers
    )
    raw = json.loads((out / "parts" / f"{part.name}.json").read_text())
    copy = raw["copy_bandwidth"]["median_gb_s"]
    rows = step["result"]["rows"]
    (raw_shape,) = raw["shapes"]
    raw_rows = raw_shape["rows"]
    labels = [recipes.BY_KEY[k].label for k in gpu_check.part_recipes(part)]
    labels += [f"{B}, overflow step"] if "fp16" in part.recipes else []
    assert sorted(rows) == sorted(labels), part.name
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert rows[FLOOR]["wall_vs_floor"] == rows[FLOOR]["cpu_vs_floor"] == 1.0
    assert table[part.name][2] == step["result"]["summary"]
    for label, row in rows.items():
      assert row["step_ms"] > 0 and row["wall_vs_floor"] > 0
      assert row["bytes_moved"] == raw_rows[label]["bytes_moved"] > 0
      gb_s = row["bytes_moved"] / (row["step_ms"] / 1e3) / 1e9
      assert row["gb_s"] == pytest.approx(gb_s, rel=1e-9)
      assert row["copy_fraction"] == pytest.approx(gb_s / copy, rel=1e-9)
      assert row["kernels"] >= row["fusions"] > 0, label
      # The part's own table, under the parts table: the same figures.
      cells = helpers.table_rows(step["result"]["table"])[label]
      assert cells[1] == f"{row['step_ms']:.3f}", (label, cells)
      assert cells[3] == f"{row['bytes_accessed']:,.0f}", (label, cells)
      assert cells[4] == f"{row['bytes_moved']:,.0f}", (label, cells)
      assert cells[6] == f"{row['kernels']:,} ({row['fusions']:,})"
      assert cells[8] == f"{row['copy_fraction']:.3f}", (label, cells)
      name = label.split(" ", 1)[0].rstrip(".")
      ratio = f"{name} {row['wall_vs_floor']:.3f}x, {row['gb_s']:,.1f} GB/s"
      assert ratio in step["result"]["summary"], (ratio, step["result"])
  # One executable for the clean and the overflow step.
  rows = parts["step_cost_500M_500_cb_on"]["result"]["rows"]
  assert (
    rows[f"{B}, overflow step"]["bytes_accessed"] == (rows[B]["bytes_accessed"])
  )


def test_a_part_past_its_limit_is_killed(gpu_check, tmp_path):
  """Killed with its children at its limit, not waited for."""
  part = gpu_check.BY_NAME["bandwidth"]
  sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable,"
  sleeper += " '-c', 'import time; time.sleep(600)']); time.sleep(600)"
  log = tmp_path / "part.log"
  status, secs, rc = gpu_check.run_part(
    part, [sys.executable, "-c", sleeper], None, 0.5, str(log)
  )
  assert status == "timed out" and rc != 0
  assert secs < 300  # not the 600 s the part would take
  assert log.read_text().startswith("$ ")


def _step_json(path, gpu_check):
  """A step_cost JSON as a part killed while compiling its third recipe
  leaves it: the floor and fp16 rows, timed, and nothing of the rest."""
  row = dict(
    status="ok", step_s_median=0.02, lower_s=1.0, compile_s=20.0,
    cpu_s_median=0.02, bytes_accessed=1.4e10, kernels=502, fusions=500,
    wall_vs_floor_per_round=[1.0] * 4, cpu_vs_floor_per_round=[1.0] * 4,
  )  # fmt: skip
  rows = {
    FLOOR: row,
    "k. optax.flatten(clip + adamw), no scaling": dict(
      row, step_s_median=0.01, wall_vs_floor_per_round=[0.4, 0.5, 0.5, 0.6]
    ),
  }
  shape = dict(shape="500M/500", params=500_000_000, leaves=500, rows=rows)
  path.write_text(json.dumps(dict(
    copy_bandwidth=dict(median_gb_s=2800.0), shapes=[shape])))  # fmt: skip


def test_a_killed_step_cost_part_keeps_the_rows_it_timed(gpu_check, tmp_path):
  result, log = tmp_path / "r.json", tmp_path / "log"
  _step_json(result, gpu_check)
  log.write_text("[500000000/500] compiling apply_if_finite ...\n")
  part = gpu_check.BY_NAME["step_cost_500M_500_peers"]
  got = gpu_check.read_part(part, "timed out", str(log), str(result))
  flat = got["rows"]["k. optax.flatten(clip + adamw), no scaling"]
  # 1.4e10 bytes in 10 ms: 1,400 GB/s, half of the 2,800 GB/s copy.
  assert flat["gb_s"] == pytest.approx(1400.0)
  assert flat["copy_fraction"] == pytest.approx(0.5)
  assert flat["wall_vs_floor"] == 0.5
  cells = helpers.table_rows(got["table"])
  assert cells["k. optax.flatten(clip + adamw), no scaling"] == [
    "21.0", "10.000", "0.500x [0.500x, 0.600x]", "14,000,000,000",
    "14,000,000,000", "28.0", "502 (500)", "1,400", "0.500",
  ]  # fmt: skip
  assert "Not reached: l. fs.chain" in got["table"]
  assert "d. optax.apply_if_finite" in got["table"].split("Not reached")[1]
  assert "d. not reached" in got["summary"]


def test_failing_tests_are_named(gpu_check):
  """Counts and failing ids from pytest's lines, with and without
  pytest-xdist, also when it was killed before its closing line."""
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
  # Under xdist (as the H200's log has them), killed, then finished.
  xdist = [
    "[gw0] [ 33%] PASSED tests/test_a.py::test_one ",
    "[gw5] [ 67%] FAILED tests/test_a.py::test_o[MultiSteps adam] ",
    "[gw1] [100%] SKIPPED tests/test_b.py::test_three ",
  ]
  result = gpu_check.read_tests("\n".join(xdist))
  assert result["counts"] == dict(passed=1, failed=1, skipped=1)
  assert result["failing"] == ["tests/test_a.py::test_o[MultiSteps adam]"]
  closing = (
    "== 20 failed, 567 passed, 1 skipped, 1 warning in 73.96s (0:01:13) =="
  )
  summary = [
    "FAILED tests/test_a.py::test_o[MultiSteps adam]",
    "FAILED tests/test_n.py::test_w - AssertionError: x [1] - y",
    "ERROR tests/test_c.py - ImportError: no module",
    closing,
  ]
  result = gpu_check.read_tests("\n".join(xdist + summary))
  assert result["counts"] == dict(failed=20, passed=567, skipped=1)
  assert result["summary"] == "20 failed, 567 passed, 1 skipped"
  assert result["failing"] == [
    "tests/test_a.py::test_o[MultiSteps adam]",
    "tests/test_c.py",
    "tests/test_n.py::test_w",
  ]
  assert result["pytest_summary"].startswith("20 failed, 567 passed")


def test_tests_part_runs_the_suite_or_the_paths_given(
  gpu_check, tmp_path, monkeypatch
):
  part = gpu_check.BY_NAME["tests"]

  def command(tiny, tests=None, **kw):
    args = argparse.Namespace(tiny=tiny, tests=tests, **kw)
    cmd, result = gpu_check.command(part, args, str(tmp_path))
    assert result is None and cmd[1:3] == ["-m", "pytest"]
    return cmd

  def paths(tiny, tests=None):
    cmd = command(tiny, tests)
    rest = cmd[cmd.index("no:cacheprovider") + 1 :]
    return [a for a in rest if not a.startswith("--ignore=")]

  monkeypatch.setenv("PYTEST_ADDOPTS", "")
  monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
  assert paths(False) == ["tests", "fp16_scaling"]
  assert paths(True) == list(gpu_check.TINY_TESTS)
  given = ["tests/test_a.py::test_b[x, 1]", "tests/test_c.py"]
  assert paths(False, given) == paths(True, given) == given
  ignored = [a for a in command(False) if a.startswith("--ignore=")]
  assert ignored == [f"--ignore={p}" for p in gpu_check.TEST_IGNORES]
  # pytest-xdist: 6 workers on a GPU, none on a CPU, and what
  # PYTEST_ADDOPTS or --test-workers say when they say it.
  assert "-n" not in command(False, backend="cpu")
  assert command(False, backend="gpu")[-2:] == ["-n", "6"]
  assert command(False, backend="gpu", test_workers=3)[-2:] == ["-n", "3"]
  assert "-n" not in command(False, backend="gpu", test_workers=0)
  monkeypatch.setattr(gpu_check.shutil, "which", lambda name: "/bin/x")
  assert command(False)[-2:] == ["-n", "6"]  # nvidia-smi, no env part
  for addopts in ("-n 2", "--numprocesses=4", "-x -p no:xdist"):
    monkeypatch.setenv("PYTEST_ADDOPTS", addopts)
    assert "-n" not in command(False, backend="gpu"), addopts


def test_the_limits_fit_the_h200s_figures_and_eight_minutes(gpu_check):
  """The 2026-12-04 H200 run (benchmarks/README.md, "On a GPU"): the
  suite took 74 s on 6 workers and the train step 38 s; the run is capped
  at 8 minutes; the default-flag floor and fp16 rows come before the
  tests."""
  limits = {p.name: p.limit_s for p in gpu_check.PARTS}
  assert limits["tests"] > 74 and limits["train_step"] > 38
  assert gpu_check.TOTAL_S == 480
  names = list(limits)
  assert names.index("step_cost_500M_500_cb_on") < names.index("tests")
  first = gpu_check.BY_NAME["step_cost_500M_500_cb_on"]
  assert first.recipes == ("floor", "fp16") and first.command_buffers


def test_the_real_compiles_kernels_stand_beside_the_deviceless_ones(gpu_check):
  part = lambda rows: dict(status="ok", result=dict(rows=rows))
  real = {FLOOR: dict(kernels=1508), B: dict(kernels=1523)}
  aot = dict(floor=dict(kernels=1505), fp16=dict(kernels=545))
  report = dict(
    parts={gpu_check.KERNELS_FROM: part(real), "kernels": part(aot)}
  )
  table = helpers.table_rows("\n".join(gpu_check.kernels_table(report)))
  assert table["floor"] == ["1,508", "1,505"]
  assert table["fp16"] == ["1,523", "545"]
  # A part that measured nothing (no CUDA plugin) leaves the section out.
  report["parts"]["kernels"] = part({})
  assert gpu_check.kernels_table(report) == []
