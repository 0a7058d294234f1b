"""Smoke test of benchmarks/step_cost.py (the timer) and benchmarks/targets.py
(the project's verdicts on the same measurement) on the tiny shape: they run
end to end, print a row for every recipe with its wall and CPU time, and the
per-round ratios a user reads. No timing is asserted."""

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
RECIPES = ROOT / "benchmarks" / "recipes.py"


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
    assert len(cells) == 10, matching[0]
    assert "budget" not in cells[1] and "not installed" not in cells[1]
    assert float(cells[3]) > 0  # a measured step time in ms
    assert float(cells[5]) > 0  # and the process CPU time per step
    assert cells[4].endswith("x") and cells[6].endswith("x")
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
  (line,) = [
    x for x in proc.stdout.splitlines() if "b. fp16_scaling / floor" in x
  ]
  assert "per round: wall " in line and "; process CPU " in line, line
  assert "overflow step / clean step, per round:" in proc.stdout
  assert "target" not in proc.stdout


def test_options_and_many_tiny_leaves(tmp_path):
  """``--recipes options`` prices b's options against b, at a shape of many
  16-element leaves spelled LEAVESxSIZE."""
  proc = subprocess.run(
    [
      sys.executable,
      str(SCRIPT),
      "--shape",
      "40x16",
      "--recipes",
      "options",
      "--repeats",
      "2",
      "--warmup",
      "0",
      "--no-overflow",
      "--json",
      str(tmp_path / "r.json"),
    ],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=ROOT,
    env=_user_env(),
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "Shape 40x16: 640 float32 params in 40 leaves" in proc.stdout
  recipes = _load(RECIPES)
  (shape,) = json.loads((tmp_path / "r.json").read_text())["shapes"]
  assert (shape["params"], shape["leaves"]) == (640, 40)
  for option in recipes.OPTIONS:
    assert f"- {option.label} / b, per round: wall " in proc.stdout
    row = shape["rows"][option.label]
    assert row["status"] == "ok"
    assert len(row["wall_vs_floor_per_round"]) == 2
    assert len(row["cpu_vs_floor_per_round"]) == 2


def test_shape_spellings():
  bench = _load(SCRIPT)
  assert bench.parse_shape("500x16") == ("500x16", (8000, 500))
  assert bench.parse_shape("2000x16") == ("2000x16", (32000, 2000))
  assert bench.parse_shape("8K/500") == ("8K/500", (8000, 500))
  assert bench.parse_shape("20M/200") == ("20M/200", (20_000_000, 200))
  for bad in ("16x", "x16", "20M", "10/20"):
    with pytest.raises(Exception, match="shape|leaves"):
      bench.parse_shape(bad)


def test_step_cost_keeps_every_name_it_had():
  # Other scripts import from step_cost.py. The recipes live in recipes.py
  # and are re-exported; the verdicts live in targets.py only, which imports
  # step_cost and not the other way round.
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
  ):
    assert callable(getattr(bench, name)), name
  assert not hasattr(bench, "_verdict") and not hasattr(bench, "__getattr__")
  assert bench.build.__module__ == "recipes"
  targets = _load(TARGETS)
  assert targets._verdict([1.0, 1.01, 1.02], 1.03).endswith("ok (<= 1.03x)")
  assert "MISS" in targets._verdict([1.2, 1.3, 1.4], 1.03)
  assert "import step_cost" not in RECIPES.read_text()


def test_json_and_hlo_breakdown(tiny_run):
  _, out = tiny_run
  record = json.loads((out / "result.json").read_text())
  (shape,) = record["shapes"]
  assert shape["shape"] == "tiny"
  for row in shape["rows"].values():
    assert row["status"] == "ok"
    assert row["step_s_median"] > 0 and row["cpu_s_median"] > 0
    assert len(row["step_s_samples"]) == len(row["cpu_s_samples"]) == 2
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
