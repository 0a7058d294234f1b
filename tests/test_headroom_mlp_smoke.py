"""Smoke test of benchmarks/headroom_mlp.py: its count of scale changes on a
hand-made trajectory, and a short run whose table has a row per scaler with
the numbers each row's own columns imply. No figure of a full run is
asserted (docs/diagnostics.md has those)."""

import helpers
from helpers import ROOT
import numpy as np

SCRIPT = ROOT / "benchmarks" / "headroom_mlp.py"


def test_changes_are_counted_from_the_first_clean_step():
  bench = helpers.load_script(SCRIPT)
  # Steps 0-2 overflow (the descent: 8 -> 4 -> 2 are not counted); from
  # step 3 on the scale changes at steps 5 and 6: 2 changes over 4 steps.
  scales = np.array([8.0, 4.0, 2.0, 1.0, 1.0, 2.0, 4.0, 4.0])
  overflow = np.array([1, 1, 1, 0, 0, 0, 0, 0], bool)
  assert bench.changes_after_descent(scales, overflow) == (2, 4)
  assert bench.changes_after_descent(scales, np.ones(8, bool)) == (0, 0)


def test_a_short_run_prints_a_row_per_scaler():
  proc = helpers.run_script(SCRIPT, "--steps", 30, "--seeds", 0, "--history", 4)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = helpers.table_rows(proc.stdout)
  assert {"deepspeed", "headroom4"} <= set(rows)
  for name in ("deepspeed", "headroom4"):
    skipped, ds_skipped, changes, _, accuracy, settles = rows[name]
    assert ds_skipped == rows["deepspeed"][0]
    count, frac = changes.split(" ")
    # The fraction is of the steps after the descent: 30 less the skipped
    # leading steps, less one.
    assert 0 <= int(count) <= 29 and frac.endswith("%)")
    assert 0.0 <= float(accuracy.split(" ")[0]) <= 1.0
    assert settles in ("n/a", "yes", "no")
  assert int(rows["headroom4"][0]) <= 30
