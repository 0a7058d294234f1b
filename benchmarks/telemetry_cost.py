"""What overflow diagnostics cost per optimizer step, next to plain optax.

Rows (float16 gradients, float32 parameters, clip at 1.0, AdamW, donated
params and state, exactly as ``step_cost.py`` times them):

  a. optax clip + adamw, no scaling (the floor)
  b. fp16_scaling with per-leaf attribution (the default, always on)
  b. the same executable on an overflow step
  f. b + ``grad_range=True`` (per-leaf max |g| and zero fraction)
  g. b + ``log_overflows=True``, clean step, and an overflow step (printing
     to a discarded stdout)
  h. ``headroom_scaler()`` (measures max |g| for its rule)

It reports XLA's bytes accessed, in-process compile time (trace + lower +
compile, one cold compile per row) and the per-round paired step-time ratio
to the floor, with ``step_cost.py``'s targets for b (wall <= 1.03x, bytes
<= 1.0x, compile <= 1.5x; overflow step <= 1.0x the clean one).

    python benchmarks/telemetry_cost.py                  # 20M/200, 2M/1000
    python benchmarks/telemetry_cost.py --shape tiny --repeats 3
"""

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
  if path not in sys.path:
    sys.path.insert(0, path)

import recipes  # noqa: E402  (the floor, the constants and the inputs)
import step_cost  # noqa: E402  (the shapes and the timing)
import targets  # noqa: E402  (the verdicts)

FLOOR = "a. optax clip + adamw, no scaling (floor)"
PLAIN = "b. fp16_scaling, attribution (default)"
PLAIN_OVF = "b. ... overflow step"
RANGE = "f. + grad_range=True"
LOG = "g. + log_overflows=True"
LOG_OVF = "g. ... overflow step (logs)"
HEADROOM = "h. headroom_scaler()"


def build(label, num_leaves):
  import jax
  import optax

  import fp16_scaling as fs

  if label == FLOOR:
    return recipes.build("floor", num_leaves)
  kwargs, scaler = {}, fs.deepspeed_scaler(init_scale=recipes.LOSS_SCALE)
  if label == RANGE:
    kwargs = {"grad_range": True}
  elif label == LOG:
    kwargs = {"log_overflows": True}
  elif label == HEADROOM:
    scaler = fs.headroom_scaler(init_scale=recipes.LOSS_SCALE)
  tx = fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(scaler, **kwargs),
      fs.clip_by_unscaled_norm(recipes.MAX_NORM),
      optax.adamw(recipes.LR, weight_decay=recipes.WEIGHT_DECAY),
    )
  )

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  del jax
  return tx.init, step


def run_shape(name, n, num_leaves, args):
  import jax

  params, grads, overflow = recipes.make_inputs(n, num_leaves)
  labels = (FLOOR, PLAIN, RANGE, LOG, HEADROOM)
  rows, compiled = {}, {}
  # A first compile pays for JAX's own warm-up: compile the floor twice and
  # time the second.
  for label in (FLOOR,) + labels:
    init, step = build(label, num_leaves)
    state = jax.jit(init)(params)
    t0 = time.perf_counter()
    exe = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads)
    exe = exe.compile()
    compile_s = time.perf_counter() - t0
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    compiled[label] = (exe, init)
    rows[label] = {
      "compile_s": compile_s,
      "bytes": float(cost.get("bytes accessed", float("nan"))),
    }
    print(f"  compiled {label}: {compile_s:.1f} s", flush=True)

  def row(label, g, exe_label=None):
    exe, init = compiled[exe_label or label]
    p = recipes.copy_tree(params)
    return [label, exe, p, jax.jit(init)(p), g]

  units = [
    [row(FLOOR, grads)],
    [row(PLAIN, grads), row(PLAIN_OVF, overflow, PLAIN)],
    [row(RANGE, grads)],
    [row(LOG, grads), row(LOG_OVF, overflow, LOG)],
    [row(HEADROOM, grads)],
  ]
  with contextlib.redirect_stdout(io.StringIO()) as logged:
    samples = step_cost.time_rows(units, args.repeats, args.inner, args.warmup)
    jax.effects_barrier()
  log_lines = logged.getvalue().count("OVERFLOW!")
  return rows, samples, log_lines


def report(name, n, num_leaves, rows, samples, log_lines, args):
  base = samples[FLOOR]
  floor_ms = statistics.median(base) * 1e3
  lines = [
    f"**{name}** ({n:,} params in {num_leaves} leaves; {args.repeats} "
    f"rounds, {args.inner} step(s) each)",
    "",
    "| row | compile s | vs a | step ms (median) | vs a, per round | "
    "bytes accessed | vs a |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  order = (FLOOR, PLAIN, PLAIN_OVF, RANGE, LOG, LOG_OVF, HEADROOM)
  for label in order:
    ms = statistics.median(samples[label]) * 1e3
    ratios = step_cost._paired(samples[label], base)
    if label in rows:
      r = rows[label]
      rel = r["compile_s"] / rows[FLOOR]["compile_s"]
      comp = f"{r['compile_s']:.2f} | {rel:.3f}x"
      byt = f"{r['bytes']:,.0f} | {r['bytes'] / rows[FLOOR]['bytes']:.3f}x"
    else:
      comp, byt = "(same executable) |", "|"
    med = statistics.median(ratios)
    lo = step_cost._quantile(ratios, 0.25)
    hi = step_cost._quantile(ratios, 0.75)
    lines.append(
      f"| {label} | {comp} | {ms:.3f} | {med:.3f}x [{lo:.3f}x, {hi:.3f}x] "
      f"| {byt} |"
    )
  lines.append("")
  wall = step_cost._paired(samples[PLAIN], base)
  b = rows[PLAIN]["bytes"] / rows[FLOOR]["bytes"]
  c = rows[PLAIN]["compile_s"] / rows[FLOOR]["compile_s"]
  lines.append(
    f"- attribution on vs targets: wall per round "
    f"{targets._verdict(wall, 1.03)}; bytes {b:.3f}x "
    f"{'ok' if b <= 1.0005 else 'MISS'} (<= 1.0x); compile {c:.3f}x "
    f"{'ok' if c <= 1.5005 else 'MISS'} (<= 1.5x)"
  )
  lines.append(
    "- overflow step / clean step, per round: "
    + targets._verdict(
      step_cost._paired(samples[PLAIN_OVF], samples[PLAIN]), 1.0
    )
  )
  for label, what in (
    (RANGE, "grad_range"),
    (LOG, "log_overflows, clean"),
    (HEADROOM, "headroom_scaler"),
  ):
    ratios = step_cost._paired(samples[label], samples[PLAIN])
    lines.append(
      f"- {what} / attribution only, per round: "
      f"{statistics.median(ratios):.3f}x; bytes "
      f"{rows[label]['bytes'] / rows[PLAIN]['bytes']:.3f}x"
    )
  ratios = step_cost._paired(samples[LOG_OVF], samples[PLAIN_OVF])
  lines.append(
    f"- log_overflows, overflow step / attribution-only overflow step, per "
    f"round: {statistics.median(ratios):.3f}x ({log_lines} lines logged, one "
    f"per overflow step timed)"
  )
  lines.append(f"- floor step: {floor_ms:.3f} ms")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--shape", action="append", type=step_cost.parse_shape, default=None
  )
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--inner", type=int, default=1)
  args = p.parse_args(argv)
  shapes = args.shape or [
    step_cost.parse_shape(s) for s in step_cost.DEFAULT_SHAPES
  ]
  import jax

  print(step_cost.machine())
  print(f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  out = []
  for name, (n, num_leaves) in shapes:
    print(f"{name}: compiling", flush=True)
    rows, samples, log_lines = run_shape(name, n, num_leaves, args)
    text = report(name, n, num_leaves, rows, samples, log_lines, args)
    print(text, flush=True)
    out.append(text)
  return "\n\n".join(out)


if __name__ == "__main__":
  main()
