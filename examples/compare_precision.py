"""fp32 against fp16 with and without loss scaling, on the same transformer.

Trains the character-level LM of ``train_lm.py`` (same model, data, batches
and optimizer) once per precision recipe:

  fp32             float32 compute, ``no_scaler()``: the reference
  fp16 none        float16 compute, ``no_scaler()``: no loss scaling
  fp16 static      float16, ``static_scaler(--static-scale)``
  fp16 deepspeed   float16, ``deepspeed_scaler(init_scale=, scale_window=)``
  fp16 torch       float16, ``torch_scaler(init_scale=, growth_interval=)``
  fp16 headroom    float16, ``headroom_scaler(init_scale=)``

and that for each setting in ``--settings``:

  default      train_lm's defaults (2,048 tokens per step)
  accum-128    each step's loss divided by 128, as DeepSpeed's engine,
               Megatron's schedules and torch's AMP recipe divide every
               microbatch's loss when they accumulate 128 microbatches; one
               microbatch is run per step, so each step's float16 gradients
               are those of one microbatch of that recipe, at 1/128 of its
               compute (``--microbatches 128`` runs all of them)
  small-init   (not run by default) every weight initialised with std 1e-5
               instead of 0.02

It prints a table
(final validation loss, skipped steps, fraction of float16 gradient elements
that are zero, step time) and draws one figure, a row per setting: validation
loss, the loss scale each step used, skipped steps, and the zero-gradient
fraction over training.

    pip install -e ".[examples]"   # from the repository root
    python examples/compare_precision.py  # docs/images/compare_precision.png
    python examples/compare_precision.py --settings default --size tiny \\
        --steps 100 --runs fp32,none,deepspeed --plot /tmp/cmp.png
"""

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")  # headless: write the figure to a file
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lm  # noqa: E402

# The runs, in order: "fp32" (float32 compute, no_scaler) and then float16 with
# each scaler, by its name in train_lm.SCALERS. A new preset (for instance a
# headroom scaler) joins by adding it to train_lm.SCALERS and its name here
# (or to --runs).
RUNS = ("fp32", "none", "static", "deepspeed", "torch", "headroom")

# Settings: Config overrides on top of --size, and a title for the figure.
SETTINGS = {
  "default": {},
  "accum-128": {"accumulate": 128, "microbatches": 1},
  "small-init": {"init_std": 1e-5},
}
DEFAULT_SETTINGS = ("default", "accum-128")
TITLES = {
  "default": "default",
  "accum-128": "loss / 128 (accumulation recipe)",
  "small-init": "init std 1e-5",
}

STYLES = {"torch": "--"}  # torch and deepspeed often coincide
COLORS = {
  "fp32 none": "black",
  "fp16 none": "tab:red",
  "fp16 static": "tab:orange",
  "fp16 deepspeed": "tab:blue",
  "fp16 torch": "tab:green",
  "fp16 headroom": "tab:purple",
}


def recipe(run):
  """(precision, scaler) of a --runs name."""
  return ("fp32", "none") if run == "fp32" else ("fp16", run)


def label(cfg) -> str:
  return f"{cfg.precision} {cfg.scaler}"


def table(results) -> str:
  """The printed table: one line per (setting, run)."""
  head = (
    f"{'setting':<11} {'run':<15} {'val loss':>8} {'vs ref':>8} "
    f"{'skipped':>8} {'zero grads':>10} {'ms/step':>8}"
  )
  lines = [head, "-" * len(head)]
  for setting, runs in results.items():
    ref = runs[0]["val_loss"][-1]
    for r in runs:
      c = r["config"]
      lines.append(
        f"{setting:<11} {label(c):<15} {r['val_loss'][-1]:>8.3f} "
        f"{r['val_loss'][-1] - ref:>+8.3f} "
        f"{r['skipped_steps']:>4}/{c.steps:<3} "
        f"{np.mean(r['zero_frac']):>10.2%} {1e3 * r['step_time']:>8.0f}"
      )
  return "\n".join(lines)


def plot(results, path):
  rows = len(results)
  fig, axes = plt.subplots(rows, 4, figsize=(17, 3.8 * rows), squeeze=False)
  for (setting, runs), ax in zip(results.items(), axes):
    for r in runs:
      c = r["config"]
      name, color = label(c), COLORS.get(label(c))
      steps = np.arange(1, c.steps + 1)
      ls = STYLES.get(c.scaler, "-")
      ax[0].plot(
        r["eval_steps"], r["val_loss"], ls, color=color, label=name, marker="."
      )
      ax[1].step(
        steps, r["loss_scale"], ls, where="post", color=color, label=name
      )
      ax[2].plot(steps, np.cumsum(r["overflow"]), ls, color=color, label=name)
      # Per step, on a log axis; a step with no zero at all is drawn at 1e-4 %.
      ax[3].plot(
        steps,
        np.maximum(100 * r["zero_frac"], 1e-4),
        ls,
        color=color,
        label=name,
        lw=0.8,
      )
    ax[0].set(
      title=f"{TITLES.get(setting, setting)}: validation loss",
      xlabel="step",
      ylabel="nats/char",
    )
    ax[0].legend(fontsize=8)
    ax[1].set(title="loss scale used", xlabel="step", ylabel="scale")
    ax[1].set_yscale("log", base=2)
    ax[2].set(title="skipped (overflow) steps", xlabel="step", ylabel="total")
    ax[3].set(
      title="gradient elements exactly zero",
      xlabel="step",
      ylabel="% of elements",
      yscale="log",
    )
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv=None):
  """Runs every recipe for every setting; prints the table, saves the figure.

  Returns:
    {setting: [train_lm.train result per recipe, fp32 first]}.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--settings",
    default=",".join(DEFAULT_SETTINGS),
    help=f"comma-separated, from {sorted(SETTINGS)}",
  )
  p.add_argument(
    "--runs",
    default=",".join(RUNS),
    help=f"comma-separated: fp32 and float16 scalers from "
    f"{sorted(train_lm.SCALERS)}; the first is the reference",
  )
  p.add_argument("--plot", default="docs/images/compare_precision.png")
  train_lm.add_config_args(p)
  args = p.parse_args(argv)
  settings = [s for s in args.settings.split(",") if s]
  runs = [r for r in args.runs.split(",") if r]
  known_runs = ["fp32", *train_lm.SCALERS]
  for name, known in ((settings, SETTINGS), (runs, known_runs)):
    bad = [n for n in name if n not in known]
    if bad:
      p.error(f"unknown {bad}; choose from {sorted(known)}")

  data = train_lm.load_corpus(args.max_chars)
  print(f"corpus: {len(data[0]):,} train / {len(data[1]):,} validation chars")
  results = {}
  for setting in settings:
    results[setting] = []
    for precision, scaler in map(recipe, runs):
      # Command-line flags win over the setting's overrides.
      over = {
        k: v
        for k, v in SETTINGS[setting].items()
        if getattr(args, k, None) is None
      }
      cfg = train_lm.config_from_args(
        args, precision=precision, scaler=scaler, **over
      )
      r = train_lm.train(cfg, data, desc=f"{setting}: {label(cfg)}")
      print(f"{setting}: {train_lm.summary(r)}", flush=True)
      results[setting].append(r)
  print()
  print(table(results))
  plot(results, args.plot)
  print(f"figure saved to {args.plot}")
  return results


if __name__ == "__main__":
  main()
