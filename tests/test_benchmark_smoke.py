"""Smoke test of benchmarks/step_cost.py (the timer) and benchmarks/targets.py
(the project's verdicts on the same measurement) on the tiny shape: they run
end to end and print a table with a row for every recipe. No timing is
asserted."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import helpers
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "step_cost.py"
TARGETS = ROOT / "benchmarks" / "targets.py"
TRAFFIC = ROOT / "benchmarks" / "hlo_traffic.py"


def _load(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _user_env():
  # Run it as a user would: without the 8 simulated devices conftest.py sets
  # up for the mesh tests.
  env = dict(os.environ)
  env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
  return env


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  pytest.importorskip("jmp")
  pytest.importorskip("flax")
  out = tmp_path_factory.mktemp("step_cost")
  proc = subprocess.run(
    [
      sys.executable,
      str(TARGETS),
      "--tiny",
      "--repeats",
      "2",
      "--warmup",
      "1",
      "--budget",
      "300",
      "--json",
      str(out / "result.json"),
      "--dump-hlo",
      str(out / "hlo"),
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=ROOT,
    env=_user_env(),
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout, out


def test_table_has_every_row(tiny_run):
  stdout, _ = tiny_run
  bench = _load(SCRIPT)
  rows = [line for line in stdout.splitlines() if line.startswith("| ")]
  assert rows[0].startswith("| recipe | compile s")
  labels = [r.label for r in bench.RECIPES] + [bench.OVERFLOW_ROW]
  for label in labels:
    matching = [r for r in rows if r.startswith(f"| {label} |")]
    assert len(matching) == 1, (label, stdout)
    cells = [c.strip() for c in matching[0].strip("|").split("|")]
    assert len(cells) == 8, matching[0]
    assert "budget" not in cells[1] and "not installed" not in cells[1]
    float(cells[3])  # a measured step time in ms
  assert "overflow step / clean step vs target" in stdout
  assert "b. fp16_scaling vs targets: wall per round" in stdout
  assert "b. fp16_scaling, expert mask vs targets" in stdout


def test_the_timer_alone_prints_ratios_and_no_verdicts():
  proc = subprocess.run(
    [
      sys.executable,
      str(SCRIPT),
      "--tiny",
      "--recipes",
      "floor,fp16",
      "--repeats",
      "2",
      "--warmup",
      "0",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
    env=_user_env(),
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "b. fp16_scaling / floor, per round:" in proc.stdout
  assert "overflow step / clean step, per round:" in proc.stdout
  assert "target" not in proc.stdout


def test_step_cost_keeps_every_name_it_had():
  # Other scripts import from step_cost.py; the verdicts moved to
  # targets.py and stay importable from step_cost.py.
  bench = _load(SCRIPT)
  for name in (
    "parse_shape",
    "leaf_sizes",
    "build",
    "make_inputs",
    "copy_tree",
    "jitted",
    "configure_cache",
    "worker",
    "compile_in_worker",
    "time_rows",
    "run_shape",
    "table",
    "fmt_ratio",
    "machine",
    "main",
    "_Lines",
    "_median_low",
    "_paired",
    "_quantile",
    "_verdict",
  ):
    assert callable(getattr(bench, name)), name
  assert bench._verdict([1.0, 1.01, 1.02], 1.03).endswith("ok (<= 1.03x)")
  assert "MISS" in bench._verdict([1.2, 1.3, 1.4], 1.03)


def test_json_and_hlo_breakdown(tiny_run):
  _, out = tiny_run
  record = json.loads((out / "result.json").read_text())
  (shape,) = record["shapes"]
  assert shape["shape"] == "tiny"
  for row in shape["rows"].values():
    assert row["status"] == "ok"
    assert row["step_s_median"] > 0
  floor = shape["rows"][_load(SCRIPT).RECIPES[0].label]
  assert floor["bytes_accessed"] > 0
  dumps = sorted((out / "hlo").glob("*.hlo.txt"))
  assert len(dumps) == len(_load(SCRIPT).RECIPES)
  proc = subprocess.run(
    [
      sys.executable,
      str(TRAFFIC),
      str(dumps[0]),
      "--params",
      str(shape["params"]),
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stderr
  assert "| **total** |" in proc.stdout
