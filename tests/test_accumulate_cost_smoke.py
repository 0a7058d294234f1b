"""Smoke test of benchmarks/accumulate_cost.py on its tiny shape: it runs end
to end, reports both phases of both recipes, its table says what its JSON
says, and the accumulating step moves no more bytes than optax.MultiSteps'
(the bound its verdicts check). No timing is asserted."""

import json
import statistics

import helpers
from helpers import ROOT


def test_tiny_run_reports_both_phases(tmp_path):
  script = ROOT / "benchmarks" / "accumulate_cost.py"
  proc = helpers.run_script(script, "--tiny", "--json", tmp_path / "r.json")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  result = json.loads((tmp_path / "r.json").read_text())
  n, leaves = (int(v) for v in result["shape"].split("/"))
  assert f"{n:,} params in {leaves} leaves, K={result['k']}" in proc.stdout
  rows = helpers.table_rows(proc.stdout)
  for phase in ("others", "last"):
    r, cells = result["phases"][phase], rows[phase]
    assert len(r["base_s"]) == len(r["ours_s"]) == 3
    assert all(t > 0 for t in r["base_s"] + r["ours_s"])
    medians = [statistics.median(r[k]) * 1e3 for k in ("base_s", "ours_s")]
    assert cells[:2] == [f"{m:.3f}" for m in medians]
    # The wall ratio is the median of per-round ratios, not of medians.
    per_round = [o / b for o, b in zip(r["ours_s"], r["base_s"])]
    assert r["wall_ratio"] == statistics.median(per_round)
    assert cells[2].startswith(f"{r['wall_ratio']:.3f}x [")
    per_param = [f"{r[k] / n:.2f}" for k in ("base_bytes", "ours_bytes")]
    assert cells[3:5] == per_param
    ratio = r["ours_bytes"] / r["base_bytes"]
    assert 0 < ratio <= 1.0 and cells[5] == f"{ratio:.3f}x ok (<= 1.0x)"
  phases = result["phases"]
  # MultiSteps runs its optimizer on every microbatch: one executable, the
  # same bytes in both phases. The other microbatches skip ours: fewer bytes
  # than the last.
  assert phases["others"]["base_bytes"] == phases["last"]["base_bytes"]
  assert phases["others"]["ours_bytes"] < phases["last"]["ours_bytes"]
