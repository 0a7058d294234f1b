"""Smoke test of benchmarks/gpu_check.py at its tiny sizes on the CPU: one
run of a few parts, the second of them given a limit too small to finish. What a
user of an unattended GPU run relies on: the JSON names every part with a
status, the markdown table has a row per part, a part past its limit is
recorded as timed out (killed, not waited for) and the parts after it still
run. No timing is asserted."""

import json
import os
import pathlib
import subprocess
import sys

import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = (  # the priority order: the tests first
  "env",
  "tests",
  "bandwidth",
  "step_cost_500M_500_cb_on",
  "step_cost_500M_500_cb_off",
  "train_step",
  "step_cost_20M_1000_cb_on",
  "step_cost_20M_1000_cb_off",
)
RAN = ("env", "bandwidth", "step_cost_20M_1000_cb_off", "tests")


def test_tiny_run_records_every_part(tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
  out = tmp_path / "out"
  proc = subprocess.run(
    [
      sys.executable,
      str(SCRIPT),
      str(out),
      "--tiny",
      "--parts",
      ",".join(RAN),
      # jax cannot even be imported in this: the part must be killed.
      "--limit",
      "bandwidth=0.5",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
    env=env,
  )
  # One part did not finish, so the run says so in its exit status.
  assert proc.returncode == 1, proc.stdout + proc.stderr
  report = json.loads((out / "gpu_check.json").read_text())
  parts = report["parts"]
  assert tuple(parts) == PARTS
  statuses = {name: parts[name]["status"] for name in PARTS}
  assert statuses == {
    "env": "ok",
    "bandwidth": "timed out",
    "step_cost_500M_500_cb_on": "not selected",
    "step_cost_500M_500_cb_off": "not selected",
    "step_cost_20M_1000_cb_on": "not selected",
    "step_cost_20M_1000_cb_off": "ok",
    "train_step": "not selected",
    "tests": "ok",
  }, statuses
  assert parts["bandwidth"]["seconds"] < 60  # killed at its limit
  assert parts["env"]["result"]["devices"]
  # The parts that ran after the one that timed out measured their rows.
  tests = parts["tests"]["result"]
  assert tests["counts"]["passed"] > 0 and tests["failing"] == []
  assert "passed" in tests["pytest_summary"]
  step = parts["step_cost_20M_1000_cb_off"]
  assert "--xla_gpu_enable_command_buffer=" in step["xla_flags"]
  rows = step["result"]["rows"]
  fp16 = rows["b. fp16_scaling"]
  assert fp16["status"] == "ok", rows
  assert fp16["step_ms"] > 0 and fp16["wall_vs_floor"] > 0
  assert fp16["cpu_vs_floor"] > 0
  for name in RAN:
    assert (out / parts[name]["log"]).exists()

  table = (out / "gpu_check.md").read_text().splitlines()
  for name in PARTS:
    (row,) = [x for x in table if x.startswith(f"| {name} |")]
    assert f"| {statuses[name]} |" in row, row
  assert any(x.startswith("| b. fp16_scaling | ") for x in table)


def test_failing_tests_are_named(tmp_path):
  """The failing ids come from pytest's own lines, also when it was killed
  before its summary."""
  sys.path.insert(0, str(SCRIPT.parent))
  try:
    import gpu_check
  finally:
    sys.path.remove(str(SCRIPT.parent))
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
  assert result["counts"] == {
    "passed": 2,
    "failed": 1,
    "skipped": 1,
    "error": 1,
  }
  assert result["failing"] == [
    "tests/test_a.py::test_two[x-1]",
    "tests/test_c.py",
  ]
  assert result["pytest_summary"] is None  # killed: no closing line
