"""Runs examples/rl_precision.py --quick (in a subprocess: the example sets
XLA_FLAGS before JAX starts) and checks what docs/rl.md claims from its
table: the sampler-trainer mismatch ordered bfloat16 > float16 > float32,
the scale metrics of each run, the cast audit and the forward overflow."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = ("bfloat16", "float16", "float32")


def _table(text):
  """The table's header and its rows, ``{run: [cells]}``."""
  lines = text.splitlines()
  i = next(i for i, line in enumerate(lines) if line.startswith("run "))
  rows = {}
  for line in lines[i + 2 : i + 2 + len(RUNS)]:
    name, kl, dlogp, r0, arrow, r1, scale, skipped = line.split()
    assert arrow == "->", line
    rows[name] = [float(kl), float(dlogp), float(r0), float(r1)]
    rows[name] += [float(scale), int(skipped)]
  return lines[i], rows


@pytest.fixture(scope="module")
def quick():
  # LLVM's lowest optimisation level: the seven compiles take less time
  # (32 s of CPU for the run, not 48), and every value is still rounded as
  # stored (the example's own flag).
  flags = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  )
  env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=flags)
  out = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "rl_precision.py"), "--quick"],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _check_table(rows):
  assert list(rows) == list(RUNS)
  kl = {k: v[0] for k, v in rows.items()}
  dlogp = {k: v[1] for k, v in rows.items()}
  # float16's 3 more mantissa bits: KL ~ (rounding)^2, 64x less in theory.
  assert 0 < kl["float16"] < kl["bfloat16"] / 10, kl
  assert 0 < kl["float32"] < kl["float16"] / 100, kl
  assert 0 < dlogp["float16"] < dlogp["bfloat16"] / 3, dlogp
  assert dlogp["float32"] < dlogp["float16"] / 100, dlogp
  for name, (_, _, r0, r1, scale, skipped) in rows.items():
    assert 0 <= r0 <= 1 and 0 <= r1 <= 1, (name, r0, r1)
    if name == "float16":  # torch_scaler(growth_interval=400) from 2**16
      assert 2.0**10 <= scale <= 2.0**16 and skipped <= 2, (scale, skipped)
    else:  # no_scaler(): scale 1, and nothing overflows
      assert (scale, skipped) == (1.0, 0), (name, scale, skipped)


def test_quick_run_orders_the_mismatch_by_precision(quick):
  _, rows = _table(quick)
  _check_table(rows)


def _docs_table():
  text = (ROOT / "docs" / "rl.md").read_text()
  (block,) = [b for b in re.findall(r"```\n(.*?)```", text, re.S) if "KL(" in b]
  return _table(block)


def test_docs_table_is_a_full_run_with_sane_values():
  _check_table(_docs_table()[1])


def test_quick_table_has_the_docs_columns(quick):
  assert _table(quick)[0] == _docs_table()[0]


def test_the_cast_audit_and_the_forward_overflow(quick):
  stdout = quick
  audits = [
    line for line in stdout.splitlines() if line.startswith("Cast to float16")
  ]
  # The bfloat16 checkpoint casts cleanly; the copy with one weight at 7e4
  # has one value past 65504, in the leaf it was put in, listed first.
  assert len(audits) == 2
  assert "0 values past the range in 0 of" in audits[0]
  assert "1 values past the range in 1 of" in audits[1]
  after = stdout[stdout.index(audits[1]) :].splitlines()
  assert after[2].split()[0] == "1"
  # The layers are stacked: one leaf per kind, the layer named by the
  # example's own count over the stacked leaves' first axis.
  assert after[2].endswith("['layers']['up']")
  assert "Past the range, by layer of ['layers']: layer 0: 1\n" in stdout
  # One float16 window on it: a forward overflow, skipped.
  assert "Last step OVERFLOWED (forward)" in stdout


def test_the_float16_state_is_stacked(quick):
  # stacked_axes=fs.stacked_under("layers"): scale_metrics has
  # nonfinite_layers (0 in the clean runs), and the poisoned window's report
  # names layer 0 of each stacked leaf and sums them by layer.
  runs = [line for line in quick.splitlines() if "(nonfinite_layers)" in line]
  assert [line.split(":")[0] for line in runs] == list(RUNS)
  assert all(line.endswith("(nonfinite_layers): 0") for line in runs)
  report = quick[quick.index("Last step OVERFLOWED (forward)") :]
  assert "  ['layers']['qkv'][0]\n" in report
  assert "Layers with a non-finite gradient on the last step: 0\n" in report
  by_layer = "Steps with a non-finite gradient, by layer"
  assert report.split(by_layer)[1].splitlines()[1] == "  1  layer 0"
