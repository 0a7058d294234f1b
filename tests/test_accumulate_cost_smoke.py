"""Smoke test of benchmarks/accumulate_cost.py on its tiny shape: it runs end
to end and reports both phases of both recipes. No timing is asserted."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_run_reports_both_phases(tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f
    for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  )
  proc = subprocess.run(
    [
      sys.executable,
      str(ROOT / "benchmarks" / "accumulate_cost.py"),
      "--tiny",
      "--json",
      str(tmp_path / "r.json"),
    ],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
    env=env,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "| others |" in proc.stdout and "| last |" in proc.stdout
  result = json.loads((tmp_path / "r.json").read_text())
  for phase in ("others", "last"):
    r = result["phases"][phase]
    assert len(r["base_s"]) == len(r["ours_s"]) == 3
    assert r["base_bytes"] > 0 and r["ours_bytes"] > 0
  # The other microbatches skip the optimizer: fewer bytes than the last.
  assert (
    result["phases"]["others"]["ours_bytes"]
    < (result["phases"]["last"]["ours_bytes"])
  )
