"""headroom_scaler(history=W) against deepspeed_scaler on the examples.

``--model mlp`` trains examples/train_mlp.py (digits; initial scale 2**24,
far too high; DeepSpeed's window 100), ``--model lm`` examples/train_lm.py's
small character LM (initial scale 2**24; DeepSpeed's window 200). Same
data, model, optimizer, initial scale and steps for every scaler. For each
scaler and seed:

- skipped steps, and DeepSpeed's on the same seed;
- scale changes after the initial descent: steps whose scale differs from
  the step before's, counted from the first clean step on, as a fraction
  of those steps;
- the range of the scale over the last half of the run;
- test accuracy (mlp) or the final validation loss (lm).

A window settles when its scale changes on at most 1% of the steps after
the descent and it skips no more steps than DeepSpeed, on every seed, with
the same mean accuracy (within 1 test image in 360) or validation loss
(within 0.01).

    python benchmarks/headroom_mlp.py --steps 1000 --seeds 0 1 2 \
      --history 1 16 256 1024
    python benchmarks/headroom_mlp.py --model lm --steps 300 --seeds 0 1 2 \
      --history 1 16 256 1024
"""

import argparse
import contextlib
import dataclasses
import io
import os
import runpy
import statistics

import numpy as np

import fp16_scaling as fs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
ACCURACY_SLACK = 1 / 360  # one of the digits test set's 360 images
VAL_LOSS_SLACK = 0.01


def _pow2(s):
  return f"2^{int(np.log2(s))}"


def changes_after_descent(scales, overflow):
  """``(changes, steps)``: steps from the first clean one on whose scale
  differs from the step before's, and how many steps that counts over."""
  first = int(np.argmin(overflow)) if not np.all(overflow) else len(scales)
  after = scales[first:]
  return int(np.sum(after[1:] != after[:-1])), max(len(after) - 1, 0)


def _mlp(steps, window):
  """``run(name, scaler, seed) -> (scales, overflow, skipped, score)``."""
  example = runpy.run_path(os.path.join(EXAMPLES, "train_mlp.py"))
  presets, train = example["PRESETS"], example["main"]

  def run(name, scaler, seed):
    presets[name] = lambda s, w: scaler(s)  # a preset of this scaler
    argv = f"--preset {name} --steps {steps} --seed {seed} "
    argv += f"--window {window} --plot {os.devnull}"
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
      r = train(argv.split())
    scales = np.asarray(r["scale_history"])
    return scales, np.asarray(r["overflow"]), r["skipped_steps"], r["accuracy"]

  return run


def _lm(steps, window):
  """As :func:`_mlp`, for train_lm's small model (score: final val loss)."""
  lm = runpy.run_path(os.path.join(EXAMPLES, "train_lm.py"))
  data = lm["load_corpus"]()

  def run(name, scaler, seed):
    lm["SCALERS"][name] = lambda c: scaler(c.init_scale)
    cfg = lm["Config"](**dict(lm["SIZES"]["small"], steps=steps))
    cfg = dataclasses.replace(cfg, scaler=name, seed=seed, window=window)
    r = lm["train"](cfg, data, bar=False)
    scales = np.asarray(r["loss_scale"])
    overflow = np.asarray(r["overflow"])
    return scales, overflow, r["skipped_steps"], float(r["val_loss"][-1])

  return run


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", choices=("mlp", "lm"), default="mlp")
  p.add_argument("--steps", type=int, default=None, help="mlp 1000, lm 300")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument(
    "--window", type=int, default=None, help="DeepSpeed's (mlp 100, lm 200)"
  )
  p.add_argument(
    "--history", type=int, nargs="+", default=[1], help="headroom windows"
  )
  args = p.parse_args(argv)
  mlp = args.model == "mlp"
  steps = args.steps or (1000 if mlp else 300)
  window = args.window or (100 if mlp else 200)
  run = (_mlp if mlp else _lm)(steps, window)

  scalers = [
    (
      "deepspeed",
      lambda s: fs.deepspeed_scaler(init_scale=s, scale_window=window),
    )
  ]
  for w in args.history:
    scalers.append(
      (
        f"headroom{w}",
        lambda s, w=w: fs.headroom_scaler(init_scale=s, history=w),
      )
    )
  rows = []
  for name, scaler in scalers:
    runs = []
    for seed in args.seeds:
      scales, overflow, skipped, score = run(name, scaler, seed)
      late = scales[len(scales) // 2 :]
      changes, counted = changes_after_descent(scales, overflow)
      runs.append(
        (skipped, changes, counted, _pow2(late.min()), _pow2(late.max()), score)
      )
      print(name, seed, runs[-1], flush=True)
    rows.append((name, runs))

  score_name = "test accuracy" if mlp else "final val loss"
  slack = ACCURACY_SLACK if mlp else VAL_LOSS_SLACK
  ds_runs = rows[0][1]
  ds_skips = [r[0] for r in ds_runs]
  ds_score = statistics.mean(r[5] for r in ds_runs)
  print()
  print(
    f"| scaler | skipped steps (of {steps}) | DeepSpeed's | scale changes "
    f"after the descent | scale range, 2nd half | {score_name} | settles |"
  )
  print("|---|---:|---:|---:|---:|---:|---|")
  for name, runs in rows:
    skips, changes, counted, lo, hi, score = map(list, zip(*runs))
    frac = [c / max(n, 1) for c, n in zip(changes, counted)]
    mean = statistics.mean(score)
    settles = (
      all(f <= 0.01 for f in frac)
      and all(s <= d for s, d in zip(skips, ds_skips))
      and abs(mean - ds_score) <= slack + 1e-9
    )
    ranges = [f"{a}..{b}" for a, b in zip(lo, hi)]
    ranges = ranges[0] + " (each seed)" if len(set(ranges)) == 1 else ranges
    print(
      f"| {name} | {', '.join(map(str, skips))} | "
      f"{', '.join(map(str, ds_skips))} | "
      f"{', '.join(f'{c} ({f:.1%})' for c, f in zip(changes, frac))} | "
      f"{ranges if isinstance(ranges, str) else ', '.join(ranges)} | "
      f"{', '.join(f'{a:.4f}' for a in score)} (mean {mean:.4f}) | "
      f"{'n/a' if name == 'deepspeed' else 'yes' if settles else 'no'} |"
    )


if __name__ == "__main__":
  main()
