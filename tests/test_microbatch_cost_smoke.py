"""Smoke test of benchmarks/microbatch_cost.py on its tiny shape: it runs end
to end, its table says what its JSON says, and the memory it reports reads
as docs/accumulation.md says: accumulate_gradients' call reads one
microbatch, the others the whole batch. No timing is asserted."""

import json
import statistics

import helpers
from helpers import ROOT

FORMS = ("in-step", "accumulate_gradients", "whole batch")


def test_tiny_run_reports_every_form(tmp_path):
  proc = helpers.run_script(
    ROOT / "benchmarks" / "microbatch_cost.py",
    "--tiny",
    "--json",
    tmp_path / "r.json",
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  result = json.loads((tmp_path / "r.json").read_text())
  rows = helpers.table_rows(proc.stdout)
  for form in FORMS:
    wall, cells = result["wall"][form], rows[form]
    assert len(wall) == result["repeats"] and all(t > 0 for t in wall)
    assert cells[0] == f"{statistics.median(wall) * 1e3:.2f}"
    arg, temp = result["memory"][form]
    assert cells[2:] == [f"{arg / 2**20:.2f}", f"{temp / 2**20:.2f}"]
  assert rows["in-step"][1] == "1.000x [1.000x, 1.000x]"
  memory = result["memory"]
  # The batch is 2 float32 arrays of rows x width; a call of
  # accumulate_gradients reads 1/K of it, and holds a float32 accumulator
  # (width x width x 2 parameters) in its state.
  batch = 2 * result["rows"] * result["width"] * 4
  acc = 2 * result["width"] ** 2 * 4
  saved = batch - batch // result["k"] - acc
  assert memory["in-step"][0] == memory["whole batch"][0]
  # optax.microbatch's column-major reshape copies the batch into the loop:
  # the in-step form's temporaries hold at least the batch.
  assert memory["in-step"][1] >= batch
  # Up to 64 bytes: the accumulation state's counters (int32 scalars).
  assert (
    0
    <= saved - (memory["in-step"][0] - memory["accumulate_gradients"][0])
    <= 64
  )
