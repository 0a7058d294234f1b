"""Runs examples/train_mlp.py end to end (short) and checks what it claims to
show.
"""

import runpy

from helpers import ROOT
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

EXAMPLE = ROOT / "examples" / "train_mlp.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  plot = tmp_path_factory.mktemp("plot") / "mlp.png"
  # Not run as __main__: no training yet.
  main = runpy.run_path(str(EXAMPLE))["main"]
  args = f"--steps 120 --window 20 --init-scale {2.0**24} --plot {plot}"
  result = main(args.split())
  return result, plot


def _assert_halved(scales, leading):
  """The scale halved from 2**24 on each of the ``leading`` overflows."""
  want = 2.0**24 / 2.0 ** np.arange(leading + 1)
  np.testing.assert_array_equal(scales[: leading + 1], want)


def test_high_initial_scale_overflows_and_backs_off(run):
  result, _ = run
  overflow, scales = result["overflow"], result["scale_history"]
  # 2**24 overflows float16 on the first step, which is skipped...
  assert overflow[0] and scales[0] == 2.0**24
  assert result["skipped_steps"] >= 1
  assert result["skipped_steps"] == int(overflow.sum())
  # ...and the scale backs off below it, halving on each leading overflow.
  assert scales.min() < 2.0**24
  leading = int(np.argmin(overflow))
  assert leading >= 1 and not overflow[leading]
  _assert_halved(scales, leading)
  # Skipped steps report a 0.0 norm (none exists; never NaN); clean ones a
  # finite, positive true norm.
  norms = result["grad_norm"]
  assert (norms[overflow] == 0).all()
  assert np.isfinite(norms[~overflow]).all() and (norms[~overflow] > 0).all()


def test_report_names_the_overflowing_leaves(run):
  result, _ = run
  report = result["report"]
  assert report.skipped_steps == result["skipped_steps"]
  # The loss (float32) stayed finite: every overflow was in the backward pass,
  # and a leaf of the output layer overflowed on every skipped step.
  assert report.counts and max(report.counts.values()) == report.skipped_steps
  assert all(p.startswith("['params']['Dense_") for p in report.counts)
  assert "What to do" in str(report)


def test_scale_grows_again_after_clean_window(run):
  result, _ = run
  # The deepspeed preset grows after window + 1 clean steps: 120 steps are
  # enough.
  scales = result["scale_history"]
  assert (scales[1:] > scales[:-1]).any()


def test_learns_and_writes_plot(run):
  result, plot = run
  assert result["accuracy"] > 0.7  # chance is 0.1
  assert plot.exists() and plot.stat().st_size > 10_000
  assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_leaves_a_gap_for_skipped_steps(run):
  # The metrics say 0.0 on a skipped step; a log axis must not draw it.
  result, _ = run
  plotted, overflow = result["plotted_grad_norm"], result["overflow"]
  assert overflow.any() and (~overflow).any()
  assert np.isnan(plotted[overflow]).all()
  assert (plotted[~overflow] > 0).all()


def test_accumulate_runs_one_step_per_window(tmp_path):
  main = runpy.run_path(str(EXAMPLE))["main"]
  args = "--steps 80 --accumulate 4 --window 5 --plot".split()
  result = main(args + [str(tmp_path / "mlp.png")])
  overflow, scales = result["overflow"], result["scale_history"]
  assert len(overflow) == 20  # 80 microbatches, 20 optimizer steps
  # 2**24 overflows: the first windows are skipped, one back-off each.
  assert overflow[0] and result["skipped_steps"] == int(overflow.sum())
  _assert_halved(scales, int(np.argmin(overflow)))
  assert result["accuracy"] > 0.3  # chance is 0.1
