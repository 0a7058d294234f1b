"""Smoke test of benchmarks/step_cost.py on its tiny shape: it runs end to end
and prints a table with a row for every recipe. No timing is asserted."""

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
TRAFFIC = ROOT / "benchmarks" / "hlo_traffic.py"


def _load(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  pytest.importorskip("jmp")
  pytest.importorskip("flax")
  out = tmp_path_factory.mktemp("step_cost")
  # Run it as a user would: without the 8 simulated devices conftest.py sets
  # up for the mesh tests.
  env = dict(os.environ)
  env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
  proc = subprocess.run(
    [
      sys.executable,
      str(SCRIPT),
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
    env=env,
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
  assert "overflow step / clean step" in stdout
  assert "vs targets" in stdout


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
