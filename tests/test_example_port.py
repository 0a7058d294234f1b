"""Runs examples/port_deepspeed_nnx.py (short) and checks what it claims:
the injected overflow is a skipped backward window that hysteresis absorbs,
and the orbax resume continues bit for bit."""

import runpy

from helpers import ROOT
import pytest

pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")

EXAMPLE = ROOT / "examples" / "port_deepspeed_nnx.py"


def test_port_recipe_skips_the_bad_window_and_resumes_bit_for_bit(tmp_path):
  main = runpy.run_path(str(EXAMPLE))["main"]
  result = main(["--steps", "40", "--bad", "9", "--ckpt-dir", str(tmp_path)])
  report, m = result["report"], result["metrics"]
  # Microbatch 9 sits in window 2 (microbatches 8-11): that window is skipped.
  assert report.kind == "backward" and report.step_overflowed
  assert report.next_scale == report.scale == 2.0**12  # hysteresis 2
  assert int(m["skipped_steps"]) == 1 and int(m["applied_steps"]) == 40 // 4 - 1
  assert result["identical"]
  assert (tmp_path / "step_20").exists()
  losses = result["losses"]
  assert sum(losses[-4:]) < 0.5 * sum(losses[:4])
