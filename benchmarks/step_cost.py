#!/usr/bin/env python
"""Cost of one jitted optimizer step with float16 loss scaling, side by side.

Every recipe gets the same float16 gradients (already multiplied by the loss
scale where the recipe has one) and float32 parameters, clips at a global norm
of 1.0, runs AdamW and applies the updates, with parameters and optimizer state
donated so that the step is in place like a real training step:

  a  ``optax.chain(clip_by_global_norm(1.0), adamw)``, no scaling: the floor.
  b  ``fp16_scaling``: ``skip_on_overflow(chain(fp16_loss_scale(dynamic
     preset), clip_by_unscaled_norm(1.0), adamw))``, with and without an
     expert mask, and the same executable timed on an overflowing step.
  c  jmp's ``DynamicLossScale`` recipe: ``unscale``, ``all_finite``,
     ``adjust``, ``select_tree`` of params and optimizer state.
  d  ``optax.apply_if_finite`` around clip + AdamW, static loss scale.
  e  Flax's ``DynamicScale`` with the ``jnp.where`` skip of its examples.

For each it reports the compile time (trace + lower + XLA compile, cold, in a
fresh worker process that is killed when it runs past ``--budget``), the median
wall time per step (timing rounds interleaved, round 1 a, b, c, ..., round 2
b, c, ..., a, and so on, so that drift and position effects fall on every
recipe alike) and XLA's ``bytes accessed`` of the compiled step, the
proxy for memory traffic of a memory-bound step; each also as a ratio to (a),
and the median [quartiles] of each recipe's per-round paired ratio to (a).

This is the timer for users. The project's own targets (what fp16_scaling
must cost next to (a)) are judged on the same measurement by
``benchmarks/targets.py``.

  python benchmarks/step_cost.py                   # 20M/200 and 2M/1000
  python benchmarks/step_cost.py --shape 20M/200 --repeats 40
  python benchmarks/step_cost.py --tiny            # seconds; the smoke test
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Benchmark the checkout this file lives in, installed or not.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

LR = 1e-3
WEIGHT_DECAY = 1e-4
MAX_NORM = 1.0
LOSS_SCALE = 2.0**16  # the initial (or static) scale of every scaled recipe

SHAPES = {
  "20M/200": (20_000_000, 200),
  "2M/1000": (2_000_000, 1000),
  "tiny": (4_096, 8),
}
DEFAULT_SHAPES = ("20M/200", "2M/1000")


@dataclasses.dataclass(frozen=True)
class Recipe:
  key: str
  label: str
  module: str  # the third-party package it needs ("" for none)


RECIPES = (
  Recipe("floor", "a. optax clip + adamw, no scaling (floor)", ""),
  Recipe("fp16", "b. fp16_scaling", ""),
  Recipe("fp16_expert", "b. fp16_scaling, expert mask", ""),
  Recipe("jmp", "c. jmp DynamicLossScale + select_tree", "jmp"),
  Recipe("apply_if_finite", "d. optax.apply_if_finite, static scale", ""),
  Recipe("flax", "e. flax DynamicScale + jnp.where", "flax"),
)
BY_KEY = {r.key: r for r in RECIPES}
OVERFLOW_ROW = "b. fp16_scaling, overflow step"


def parse_shape(text):
  """'20M/200', '2000000/1000', '1.5M/300' or a name in SHAPES."""
  if text in SHAPES:
    return text, SHAPES[text]
  try:
    size, leaves = text.split("/")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(size[-1:].upper(), 1)
    n = int(float(size[:-1] if mult > 1 else size) * mult)
    leaves = int(leaves)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"shape must be PARAMS/LEAVES like 20M/200, or one of {list(SHAPES)}; "
      f"got {text!r}"
    ) from None
  if leaves < 1 or n < leaves:
    raise argparse.ArgumentTypeError(f"need 1 <= leaves <= params: {text!r}")
  return text, (n, leaves)


def leaf_sizes(n, leaves):
  sizes = [n // leaves] * leaves
  sizes[0] += n - sum(sizes)
  return sizes


# --------------------------------------------------------------------------
# The recipes. Each is (init(params) -> state, step(params, state, grads)).


def build(key, num_leaves):
  import jax
  import jax.numpy as jnp
  import optax

  f32 = jnp.float32

  def clip_adamw():
    return optax.chain(
      optax.clip_by_global_norm(MAX_NORM),
      optax.adamw(LR, weight_decay=WEIGHT_DECAY),
    )

  def to_f32(grads):
    return jax.tree.map(lambda g: g.astype(f32), grads)

  if key == "floor":
    tx = clip_adamw()

    def step(params, state, grads):
      updates, state = tx.update(to_f32(grads), state, params)
      return optax.apply_updates(params, updates), state

    return tx.init, step

  if key in ("fp16", "fp16_expert"):
    import fp16_scaling as fs

    mask = (
      [i % 2 == 1 for i in range(num_leaves)] if key == "fp16_expert" else None
    )
    tx = fs.skip_on_overflow(
      optax.chain(
        fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=LOSS_SCALE)),
        fs.clip_by_unscaled_norm(MAX_NORM, expert_mask=mask),
        optax.adamw(LR, weight_decay=WEIGHT_DECAY),
      )
    )

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return tx.init, step

  if key == "jmp":
    import jmp

    tx = clip_adamw()

    # The loss scale travels as its two arrays: jmp's DynamicLossScale pytree
    # validates its leaves on unflatten and so cannot be an argument of
    # ``jit(...).lower`` in current JAX; it is rebuilt inside the step.
    def init(params):
      return tx.init(params), (
        jnp.asarray(LOSS_SCALE, f32),
        jnp.zeros([], jnp.int32),
      )

    def step(params, state, grads):
      opt_state, (scale, counter) = state
      loss_scale = jmp.DynamicLossScale(scale, counter)
      grads = loss_scale.unscale(to_f32(grads))  # cast_to_param, then unscale
      grads_finite = jmp.all_finite(grads)
      loss_scale = loss_scale.adjust(grads_finite)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params, opt_state = jmp.select_tree(
        grads_finite, (new_params, new_opt_state), (params, opt_state)
      )
      return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    return init, step

  if key == "apply_if_finite":
    tx = optax.apply_if_finite(clip_adamw(), max_consecutive_errors=5)
    inv_scale = 1.0 / LOSS_SCALE

    def step(params, state, grads):
      grads = jax.tree.map(lambda g: g.astype(f32) * inv_scale, grads)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return tx.init, step

  if key == "flax":
    from flax.training.dynamic_scale import DynamicScale

    tx = clip_adamw()

    # DynamicScale.value_and_grad differentiates ``scale * loss``. Its
    # backward pass here hands back the precomputed (already scaled) float16
    # gradients, so everything DynamicScale does to them afterwards (float32
    # cast, unscale, all-finite check, scale update) runs as written.
    @jax.custom_vjp
    def present(g):
      del g
      return jnp.zeros([], f32)

    present.defvjp(lambda g: (jnp.zeros([], f32), g), lambda g, ct: (g,))

    def init(params):
      return tx.init(params), DynamicScale(
        fin_steps=jnp.zeros([], jnp.int32), scale=jnp.asarray(LOSS_SCALE, f32)
      )

    def step(params, state, grads):
      opt_state, dynamic_scale = state
      dynamic_scale, is_fin, _, grads = dynamic_scale.value_and_grad(present)(
        grads
      )
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      select = functools.partial(jnp.where, is_fin)  # as Flax's examples do
      params = jax.tree.map(select, new_params, params)
      opt_state = jax.tree.map(select, new_opt_state, opt_state)
      return params, (opt_state, dynamic_scale)

    return init, step

  raise KeyError(key)


def make_inputs(n, num_leaves, seed=0):
  """float32 params and two float16 gradient trees: clean and one inf."""
  import jax
  import jax.numpy as jnp

  sizes = leaf_sizes(n, num_leaves)
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * num_leaves)
  params = [
    0.02 * jax.random.normal(keys[i], (s,), jnp.float32)
    for i, s in enumerate(sizes)
  ]
  grads = [
    jax.random.normal(keys[num_leaves + i], (s,), jnp.float16)
    for i, s in enumerate(sizes)
  ]
  overflow = list(grads)
  overflow[0] = overflow[0].at[0].set(jnp.inf)
  return params, grads, overflow


def copy_tree(tree):
  import jax
  import jax.numpy as jnp

  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def jitted(key, num_leaves):
  import jax

  init, step = build(key, num_leaves)
  return init, jax.jit(step, donate_argnums=(0, 1))


def configure_cache(cache_dir):
  import jax

  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# --------------------------------------------------------------------------
# Compile worker: a fresh process per recipe, so a compile that runs past the
# budget is killed, not waited for. It writes the executable to a persistent
# compilation cache that the timing process then loads.


def worker(args):
  configure_cache(args.cache_dir)
  import jax

  _, (n, num_leaves) = parse_shape(args.shape)
  init, step = jitted(args.worker, num_leaves)
  params, grads, _ = make_inputs(n, num_leaves)
  state = init(params)
  jax.block_until_ready((params, state, grads))
  print("READY", flush=True)
  t0 = time.perf_counter()
  lowered = step.lower(params, state, grads)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device
    cost = cost[0]
  if args.dump_hlo:
    os.makedirs(args.dump_hlo, exist_ok=True)
    name = f"{args.worker}_{args.shape.replace('/', '_')}.hlo.txt"
    with open(os.path.join(args.dump_hlo, name), "w") as f:
      f.write(compiled.as_text())
  print(
    "RESULT "
    + json.dumps(
      dict(
        lower_s=t1 - t0,
        compile_s=t2 - t1,
        bytes_accessed=float(cost.get("bytes accessed", float("nan"))),
        flops=float(cost.get("flops", float("nan"))),
      )
    ),
    flush=True,
  )


def compile_in_worker(key, shape, cache_dir, budget, dump_hlo, startup_s=300):
  """Cold compile of one recipe in a subprocess; None when past the budget."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    key,
    "--shape",
    shape,
    "--cache-dir",
    cache_dir,
  ]
  if dump_hlo:
    cmd += ["--dump-hlo", dump_hlo]
  with tempfile.TemporaryFile() as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, bufsize=0)
    lines = _Lines(proc.stdout)

    def failure(what):
      err.seek(0)
      tail = err.read().decode(errors="replace")[-3000:]
      return RuntimeError(f"worker {key} {what}:\n{tail}")

    try:
      # Imports and input construction are not part of the budget: the clock
      # starts when the worker says READY, right before tracing.
      if lines.wait_for("READY", time.monotonic() + startup_s) is None:
        raise failure("died or hung before compiling")
      line = lines.wait_for("RESULT ", time.monotonic() + budget)
      if line == "TIMEOUT":
        return None
      if line is None:
        raise failure("failed")
      return json.loads(line[len("RESULT ") :])
    finally:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
      proc.stdout.close()


class _Lines:
  """Lines of an unbuffered pipe, with a deadline that really does not wait."""

  def __init__(self, pipe):
    self._fd = pipe.fileno()
    self._buf = b""

  def wait_for(self, prefix, deadline):
    """The first line starting with ``prefix``; "TIMEOUT"; None at EOF."""
    while True:
      while b"\n" not in self._buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return "TIMEOUT"
        ready, _, _ = select.select([self._fd], [], [], remaining)
        if not ready:
          return "TIMEOUT"
        chunk = os.read(self._fd, 65536)
        if not chunk:
          return None
        self._buf += chunk
      line, self._buf = self._buf.split(b"\n", 1)
      line = line.decode(errors="replace")
      if line.startswith(prefix):
        return line


# --------------------------------------------------------------------------
# Timing, in this process.


def time_rows(units, repeats, inner, warmup):
  """Interleaved timing. ``units``: lists of one or two rows, each row a
  list [name, fn, params, state, grads].

  Each round runs ``inner`` steps of every row in turn, blocking at the end
  of each row's steps; the sample is the elapsed time over ``inner``. The
  order of the units rotates by one per round, so that no row always runs
  right after the same neighbour (or first in its round). The two rows of a
  unit (fp16_scaling's clean and overflow steps) always run back to back,
  in alternating order, so that their per-round ratio compares like with
  like: with three rows in one rotation the overflow row followed the clean
  one in two rounds of three, and read 5% slow at 2M/1000 where an A/B
  alternating test reads 0.995x.
  """
  import jax

  samples = {r[0]: [] for unit in units for r in unit}
  for rnd in range(warmup + repeats):
    shift = rnd % len(units)
    for unit in units[shift:] + units[:shift]:
      for row in unit if rnd % 2 == 0 else unit[::-1]:
        name, fn, params, state, grads = row
        t0 = time.perf_counter()
        for _ in range(inner):
          params, state = fn(params, state, grads)
        jax.block_until_ready((params, state))
        dt = (time.perf_counter() - t0) / inner
        row[2], row[3] = params, state
        if rnd >= warmup:
          samples[name].append(dt)
  return samples


def run_shape(shape_name, n, num_leaves, keys, args):
  import jax

  cache_dir = tempfile.mkdtemp(prefix="step_cost_cache_")
  configure_cache(cache_dir)
  results = {}
  for key in keys:
    recipe = BY_KEY[key]
    if recipe.module:
      try:
        __import__(recipe.module)
      except ImportError as e:
        results[key] = dict(status=f"not installed ({e.name})")
        continue
    print(f"[{shape_name}] compiling {key} ...", file=sys.stderr, flush=True)
    shape_arg = shape_name if shape_name in SHAPES else f"{n}/{num_leaves}"
    attempts = []
    for i in range(args.compile_repeats):
      first = i == 0
      # Every attempt is cold, in its own empty cache. The first one's cache
      # is the one this process then loads the executable from.
      scratch = cache_dir if first else tempfile.mkdtemp(prefix="step_cost_")
      try:
        res = compile_in_worker(
          key, shape_arg, scratch, args.budget, args.dump_hlo if first else None
        )
      finally:
        if not first:
          shutil.rmtree(scratch, ignore_errors=True)
      if res is None:
        break
      attempts.append(res)
      if res["lower_s"] + res["compile_s"] > args.budget / 10:
        break  # a slow compile is not worth repeating: one cold number
    if res is None:
      results[key] = dict(status=f"> budget ({args.budget:g} s)")
      print(
        f"[{shape_name}]   {key}: compile > {args.budget:g} s, killed",
        file=sys.stderr,
        flush=True,
      )
      continue
    totals = [a["lower_s"] + a["compile_s"] for a in attempts]
    res = dict(attempts[totals.index(_median_low(totals))])
    res["compile_attempts_s"] = totals
    res["status"] = "ok"
    results[key] = res
    print(
      f"[{shape_name}]   {key}: "
      + ", ".join(f"{t:.1f}" for t in totals)
      + " s",
      file=sys.stderr,
      flush=True,
    )

  params, grads, grads_overflow = make_inputs(n, num_leaves)
  rows = []
  for key in keys:
    if results[key]["status"] != "ok":
      continue
    init, fn = jitted(key, num_leaves)
    p = copy_tree(params)
    s = init(p)
    # The first call traces and loads the worker's executable from the cache
    # (it does not compile again); it is one more untimed warm-up step.
    t0 = time.perf_counter()
    p, s = jax.block_until_ready(fn(p, s, grads))
    results[key]["load_s"] = time.perf_counter() - t0
    unit = [[BY_KEY[key].label, fn, p, s, grads]]
    if key == "fp16" and not args.no_overflow:
      p = copy_tree(params)
      unit.append([OVERFLOW_ROW, fn, p, init(p), grads_overflow])
    rows.append(unit)
  print(
    f"[{shape_name}] timing {sum(map(len, rows))} rows x {args.repeats} "
    "rounds ...",
    file=sys.stderr,
    flush=True,
  )
  samples = time_rows(rows, args.repeats, args.inner, args.warmup)
  jax.clear_caches()
  shutil.rmtree(cache_dir, ignore_errors=True)
  return results, samples


def _median_low(values):
  return sorted(values)[(len(values) - 1) // 2]


def fmt_ratio(x, base):
  if x is None or base is None or base != base or base == 0:
    return "–"
  return f"{x / base:.3f}x"


def table(shape_name, n, num_leaves, keys, results, samples, notes_fn=None):
  """The markdown table and a dict of everything measured.

  ``notes_fn(keys, results, samples, record)``, when given, returns more
  lines for the notes under the table (``targets.py``'s verdicts).
  """
  floor = results.get("floor", {})
  floor_ok = floor.get("status") == "ok"
  med = {name: statistics.median(v) for name, v in samples.items() if v}
  base_step = med.get(BY_KEY["floor"].label) if floor_ok else None
  base_compile = (floor["lower_s"] + floor["compile_s"]) if floor_ok else None
  base_bytes = floor.get("bytes_accessed") if floor_ok else None
  lines = [
    f"Shape {shape_name}: {n:,} float32 params in {num_leaves} leaves, "
    "float16 grads",
    "",
    "| recipe | compile s | vs a | step ms (median) | vs a | "
    "bytes accessed | B/param | vs a |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  record = dict(shape=shape_name, params=n, leaves=num_leaves, rows={})
  names = []
  for key in keys:
    names.append((key, BY_KEY[key].label))
    if key == "fp16" and OVERFLOW_ROW in samples:
      names.append((key, OVERFLOW_ROW))
  for key, name in names:
    res = results[key]
    if res.get("status") != "ok":
      lines.append(f"| {name} | {res['status']} | – | – | – | – | – | – |")
      record["rows"][name] = dict(status=res["status"])
      continue
    step = med.get(name)
    same = name == OVERFLOW_ROW
    compile_s = res["lower_s"] + res["compile_s"]
    b = res["bytes_accessed"]
    cells = [
      name,
      "(same executable)" if same else f"{compile_s:.2f}",
      "" if same else fmt_ratio(compile_s, base_compile),
      f"{step * 1e3:.3f}" if step is not None else "–",
      fmt_ratio(step, base_step),
      "" if same else f"{b:,.0f}",
      "" if same else f"{b / n:.1f}",
      "" if same else fmt_ratio(b, base_bytes),
    ]
    lines.append("| " + " | ".join(cells) + " |")
    spread = samples.get(name, [])
    record["rows"][name] = dict(
      status="ok",
      lower_s=res["lower_s"],
      compile_s=res["compile_s"],
      compile_attempts_s=res.get("compile_attempts_s"),
      first_call_s=res.get("load_s"),
      step_s_median=step,
      step_s_p10=_quantile(spread, 0.1),
      step_s_p90=_quantile(spread, 0.9),
      step_s_samples=spread,
      bytes_accessed=b,
      flops=res["flops"],
    )

  notes = []
  if samples.get(OVERFLOW_ROW) and samples.get(BY_KEY["fp16"].label):
    ratios = _paired(samples[OVERFLOW_ROW], samples[BY_KEY["fp16"].label])
    notes.append(
      "fp16_scaling overflow step / clean step, per round: " + _spread(ratios)
    )
  floor_label = BY_KEY["floor"].label
  if floor_ok:
    for key, name in names:
      if key == "floor" or name == OVERFLOW_ROW or name not in samples:
        continue
      ratios = _paired(samples[name], samples[floor_label])
      notes.append(f"{name} / floor, per round: {_spread(ratios)}")
  if notes_fn is not None:
    notes += notes_fn(keys, results, samples, record)
  lines += [""] + [f"- {x}" for x in notes]
  return "\n".join(lines), record


def _paired(xs, ys):
  """Per-round ratios: the rows of one round ran back to back, so their
  ratio cancels the drift between rounds that a ratio of medians keeps."""
  return [x / y for x, y in zip(xs, ys)]


def _spread(ratios):
  """'1.012x [0.980x, 1.040x]': median [quartiles] of per-round ratios."""
  med = statistics.median(ratios)
  lo, hi = _quantile(ratios, 0.25), _quantile(ratios, 0.75)
  return f"{med:.3f}x [{lo:.3f}x, {hi:.3f}x]"


def __getattr__(name):
  # The target verdicts moved to targets.py; their names stay importable.
  if name in ("_verdict", "TARGETS", "verdicts"):
    if HERE not in sys.path:
      sys.path.insert(0, HERE)
    import targets

    return getattr(targets, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _quantile(values, q):
  if not values:
    return None
  v = sorted(values)
  return v[min(len(v) - 1, int(q * len(v)))]


def machine():
  import jax

  dev = jax.devices()[0]
  return (
    f"jax {jax.__version__}, backend {jax.default_backend()}, "
    f"device {dev.device_kind}, {os.cpu_count()} CPUs, "
    f"{platform.machine()}, Python {platform.python_version()}"
  )


def main(argv=None, notes_fn=None, description=None, prog=None):
  parser = argparse.ArgumentParser(
    prog=prog,
    description=description or __doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--shape",
    action="append",
    type=parse_shape,
    help="PARAMS/LEAVES, e.g. 20M/200 (repeatable; default "
    "20M/200 and 2M/1000)",
  )
  parser.add_argument(
    "--tiny",
    action="store_true",
    help=f"the tiny shape {SHAPES['tiny']} (smoke test)",
  )
  parser.add_argument(
    "--recipes",
    default=",".join(r.key for r in RECIPES),
    help="comma-separated subset of: " + ", ".join(r.key for r in RECIPES),
  )
  parser.add_argument(
    "--repeats",
    type=int,
    default=30,
    help="timed rounds per recipe (default 30)",
  )
  parser.add_argument(
    "--inner",
    type=int,
    default=1,
    help="steps per timed sample (default 1; raise it on a "
    "GPU, where a step is shorter than its dispatch)",
  )
  parser.add_argument(
    "--warmup", type=int, default=3, help="untimed rounds first (default 3)"
  )
  parser.add_argument(
    "--budget",
    type=float,
    default=300.0,
    help="seconds a recipe's compile may take before it is "
    "killed and reported as '> budget' (default 300)",
  )
  parser.add_argument(
    "--compile-repeats",
    type=int,
    default=1,
    help="cold compiles per recipe, each in a fresh worker; "
    "the median is reported. A compile longer than a tenth "
    "of the budget is not repeated (default 1)",
  )
  parser.add_argument(
    "--no-overflow",
    action="store_true",
    help="skip the fp16_scaling overflow-step row",
  )
  parser.add_argument(
    "--dump-hlo",
    metavar="DIR",
    help="write each compiled step's optimized HLO here",
  )
  parser.add_argument("--json", metavar="PATH", help="write results as JSON")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args.worker:
    args.shape = args.shape[0][0] if args.shape else "tiny"
    return worker(args)

  shapes = list(args.shape or [])
  if args.tiny:
    shapes.append(parse_shape("tiny"))
  if not shapes:
    shapes = [parse_shape(s) for s in DEFAULT_SHAPES]
  keys = [k.strip() for k in args.recipes.split(",") if k.strip()]
  for k in keys:
    if k not in BY_KEY:
      parser.error(f"unknown recipe {k!r}; choose from {list(BY_KEY)}")
  if "floor" not in keys:
    keys.insert(0, "floor")  # everything is a ratio to it

  print(f"Machine: {machine()}")
  if os.environ.get("XLA_FLAGS"):
    print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
  print(
    f"Command: python benchmarks/{prog or 'step_cost.py'} "
    f"{' '.join(argv if argv is not None else sys.argv[1:])}"
  )
  print(
    f"repeats={args.repeats} inner={args.inner} warmup={args.warmup} "
    f"budget={args.budget:g}s compile_repeats={args.compile_repeats}"
  )
  records = []
  for shape_name, (n, num_leaves) in shapes:
    results, samples = run_shape(shape_name, n, num_leaves, keys, args)
    text, record = table(
      shape_name, n, num_leaves, keys, results, samples, notes_fn
    )
    print()
    print(text, flush=True)
    records.append(record)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        dict(
          machine=machine(),
          argv=argv or sys.argv[1:],
          xla_flags=os.environ.get("XLA_FLAGS", ""),
          shapes=records,
        ),
        f,
        indent=1,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
