"""headroom_scaler against deepspeed_scaler on examples/train_mlp.py.

For each preset and seed: skipped steps, steps until the scale is stable
(the first step from which every later scale stays within a factor of 2 of
the final one), how often the scale changed, the range of the scale over the
last half of the run, and the final test accuracy. Same data, model, optimizer,
initial scale (2**24, far too high) and steps for both.

    python benchmarks/headroom_mlp.py --steps 1000 --seeds 0 1 2
"""

import argparse
import contextlib
import io
import os
import runpy
import statistics

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_mlp.py")


def _pow2(s):
  return f"2^{int(np.log2(s))}"


def steps_until_stable(scales, band=2.0):
  final = scales[-1]
  ok = (scales <= final * band) & (scales >= final / band)
  bad = np.flatnonzero(~ok)
  return int(bad[-1] + 1) if bad.size else 0


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--window", type=int, default=100)
  args = p.parse_args(argv)
  train = runpy.run_path(EXAMPLE)["main"]
  rows = []
  for preset in ("deepspeed", "headroom"):
    runs = []
    for seed in args.seeds:
      argv = f"--preset {preset} --steps {args.steps} --seed {seed} "
      argv += f"--window {args.window} --plot {os.devnull}"
      quiet = io.StringIO()
      with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        r = train(argv.split())
      scales = np.asarray(r["scale_history"])
      late = scales[len(scales) // 2 :]
      changes = int(np.sum(scales[1:] != scales[:-1]))
      run = (r["skipped_steps"], steps_until_stable(scales), r["accuracy"])
      runs.append(run + (changes, _pow2(late.min()), _pow2(late.max())))
      print(preset, seed, runs[-1], flush=True)
    rows.append((preset, runs))
  print()
  print(
    f"| preset | skipped steps (of {args.steps}) | steps until stable | "
    "scale changes | scale range, 2nd half | test accuracy |"
  )
  print("|---|---:|---:|---:|---:|---:|")
  for preset, runs in rows:
    cols = list(zip(*runs))
    print(
      f"| {preset} | {', '.join(map(str, cols[0]))} | "
      f"{', '.join(map(str, cols[1]))} | "
      f"{', '.join(map(str, cols[3]))} | "
      f"{', '.join(f'{a}..{b}' for a, b in zip(cols[4], cols[5]))} | "
      f"{', '.join(f'{a:.4f}' for a in cols[2])} (mean "
      f"{statistics.mean(cols[2]):.4f}) |"
    )


if __name__ == "__main__":
  main()
