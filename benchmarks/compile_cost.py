#!/usr/bin/env python
"""Cold compile time of fp16_scaling's step next to plain optax's.

Each round compiles the floor, fp16_scaling's step and any other
``--recipes``, the order rotating (``_common.interleaved``), each cold in a
fresh ``step_cost.py`` worker; trace + lower and compile timed apart, in
CPU and wall time. ``lm:SIZE`` compiles examples/train_lm.py's whole train
step instead (``train_step_cost.py``'s). benchmarks/README.md has the rest.

  python benchmarks/compile_cost.py        # 10M/200, 2M/1000 and lm:medium
  python benchmarks/compile_cost.py --shape lm:medium --rounds 4
  python benchmarks/compile_cost.py --recipes floor,fp16,apply_if_finite
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import recipes  # noqa: E402
import step_cost  # noqa: E402

DEFAULT_SHAPES = ("10M/200", "2M/1000", "lm:medium")
PAIR = ("floor", "fp16")
LM = "lm:"  # a shape "lm:SIZE": train_lm's whole train step at --size SIZE


def lm_size(shape):
  """SIZE of a shape ``lm:SIZE``; None for a synthetic shape."""
  return shape[len(LM) :] if shape.startswith(LM) else None


def lm_steps():
  """{recipe: train_step_cost.py's builder of that train step}."""
  import train_step_cost

  return dict(
    floor=train_step_cost.plain_step,
    fp16=train_step_cost.scaled_step,
    apply_if_finite=lambda cfg: train_step_cost.plain_step(cfg, 2.0**12),
  )


def lm_worker(args):
  """A compile worker for a shape ``lm:SIZE``: builds train_step_cost.py's
  step (the donated params and optimizer state from train_lm's init, its
  batch), then traces, lowers and compiles it as ``step_cost.py``'s worker
  does."""
  step_cost.configure_cache(args.cache_dir)
  import jax
  import train_step_cost

  cfg = train_step_cost.make_config(lm_size(args.shape))
  x, y = train_step_cost.make_batch(cfg)
  tx, step = lm_steps()[args.worker](cfg)
  params = train_step_cost.train_lm.init_params(cfg)
  state = tx.init(params)
  jax.block_until_ready((params, state, x, y))
  options = dict(args.compiler_option or ())
  step_cost.compile_and_report(
    step, (params, state, x, y), options, budget=args.budget
  )


def compile_once(key, shape, budget, compiler_options=None):
  """One cold compile of ``key`` at ``shape`` (with ``compiler_options``):
  CPU seconds of trace + lower and of compile, and the wall seconds of
  both."""
  script = os.path.abspath(__file__) if lm_size(shape) else None
  with tempfile.TemporaryDirectory() as cache_dir:
    res = step_cost.compile_in_worker(
      key, shape, cache_dir, budget, None,
      compiler_options=compiler_options, script=script,
    )  # fmt: skip
  if res is None:
    raise RuntimeError(f"{key} at {shape}: compile past {budget:g} s")
  wall = res["lower_s"] + res["compile_s"]
  return res["lower_cpu_s"], res["compile_cpu_s"], wall


def measure(shape, rounds, budget, keys=PAIR, log=print, compiler_options=None):
  """Per recipe the list of (lower CPU s, compile CPU s, wall s), one entry
  a round, the order of the recipes rotating by one each round
  (``_common.interleaved``)."""

  def sample(key):
    def compile_it():
      lower, comp, wall = compile_once(key, shape, budget, compiler_options)
      log(
        f"[{shape}] {key}: CPU s lower {lower:.2f}, compile {comp:.2f}; "
        f"wall {wall:.2f} s"
      )
      return lower, comp, wall

    return compile_it

  return _common.interleaved([[(k, sample(k))] for k in keys], rounds)


def summary(shape, times):
  """Markdown rows and the per-round ratio lines for one shape; the first
  recipe of ``times`` is the floor. Also returns the median per-round ratio
  of the second recipe to the floor."""
  median = statistics.median
  a, *others = times
  totals = {key: [lo + co for lo, co, _ in rows] for key, rows in times.items()}
  walls = {key: [w for _, _, w in rows] for key, rows in times.items()}
  lines = []
  for key, rows in times.items():
    lower, comp, _ = (median(part) for part in zip(*rows))
    total, wall = median(totals[key]), median(walls[key])
    ratio, wall_ratio = total / median(totals[a]), wall / median(walls[a])
    lines.append(
      f"| {shape} | {key} | {lower:.2f} | {comp:.2f} | {total:.2f} | "
      f"{ratio:.3f}x | {wall:.2f} | {wall_ratio:.3f}x |"
    )
  notes, medians = [], []
  for key in others:
    paired = sorted(_common.paired(totals[key], totals[a]))
    medians.append(statistics.median(paired))
    notes.append(
      f"{shape}: per-round {key}/{a} of total CPU time, median "
      f"{medians[-1]:.3f}x [{paired[0]:.3f}, {paired[-1]:.3f}] over "
      f"{len(paired)} rounds"
    )
  return lines, "\n".join(notes), medians[0]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add = parser.add_argument
  # fmt: off
  add("--shape", action="append", help="step_cost.py's spellings (10M/200) "
      "or lm:SIZE, train_lm.py's whole train step at --size SIZE; "
      f"repeatable (default: {', '.join(DEFAULT_SHAPES)})")
  add("--recipes", default=",".join(PAIR), help="comma-separated step_cost.py"
      f" recipes, the floor first (default: {','.join(PAIR)})")
  add("--rounds", type=int, default=4)
  add("--budget", type=float, default=600.0)
  for flag in ("--compiler-option", "--worker", "--cache-dir"):
    add(flag, **step_cost.FLAG[flag])
  # fmt: on
  args = parser.parse_args(argv)
  if args.worker:  # a shape lm:SIZE's compile, in a process of its own
    args.shape = args.shape[0]
    return lm_worker(args)
  if args.rounds < 1:
    parser.error("--rounds must be >= 1")
  keys = tuple(args.recipes.split(","))
  if keys[0] != PAIR[0] or len(keys) < 2 or len(set(keys)) < len(keys):
    parser.error("--recipes: the floor first, then one or more others")
  unknown = [k for k in keys if k not in recipes.BY_KEY]
  if unknown:
    parser.error(f"--recipes: unknown {', '.join(unknown)}")
  shapes = args.shape or list(DEFAULT_SHAPES)
  for shape in shapes:
    if lm_size(shape) is None:
      step_cost.parse_shape(shape)
      continue
    import train_step_cost

    sizes = ", ".join(LM + s for s in sorted(train_step_cost.train_lm.SIZES))
    if lm_size(shape) not in train_step_cost.train_lm.SIZES:
      parser.error(f"--shape {shape}: train_lm.py's sizes are {sizes}")
  options = step_cost.compiler_options(parser, args.compiler_option)
  header = (
    "| shape | recipe | trace + lower CPU s | compile CPU s | total CPU s "
    "| vs floor | wall s | vs floor |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|"
  )
  rows, notes = [], []
  for shape in shapes:
    shape_keys = keys
    if lm_size(shape):
      shape_keys = tuple(k for k in keys if k in PAIR)
      left_out = [k for k in keys if k not in PAIR]
      if left_out:
        notes.append(
          f"{shape}: only floor (plain optax) and fp16 (fp16_scaling) have a "
          f"train step; {', '.join(left_out)} not compiled"
        )
    times = measure(shape, args.rounds, args.budget, shape_keys, print, options)
    lines, per_round, _ = summary(shape, times)
    rows += lines
    notes.append(per_round)
  print(f"\nCold compiles, median of {args.rounds}, alternating order:")
  print(step_cost.options_line(options))
  print("\n".join([header] + rows + [""] + notes))


if __name__ == "__main__":
  main()
