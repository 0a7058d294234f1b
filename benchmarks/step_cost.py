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

and, with ``--recipes options``, b's options on clean steps: f
``grad_range=True``, g ``log_overflows=True``, i ``accumulate_gradients(b,
1)`` and j ``accumulate_gradients(b, 4)`` (the mean call of a window). The
steps are defined in ``recipes.py``; this script is only the timer.

For each it reports the compile time (trace + lower + XLA compile, cold, in a
fresh worker process that is killed when it runs past ``--budget``), the median
wall time per step (timing rounds interleaved, round 1 a, b, c, ..., round 2
b, c, ..., a, and so on, so that drift and position effects fall on every
recipe alike), the process CPU time per step over the same samples (all
threads; on a many-leaf shape it is the host's per-call work) and XLA's
``bytes accessed`` of the compiled step, the proxy for memory traffic of a
memory-bound step; each also as a ratio to (a),
and the median [quartiles] of each recipe's per-round paired ratio to (a),
of wall time and of CPU time.

This is the timer for users. The project's own targets (what fp16_scaling
must cost next to (a)) are judged on the same measurement by
``benchmarks/targets.py``.

  python benchmarks/step_cost.py                   # 20M/200 and 2M/1000
  python benchmarks/step_cost.py --shape 20M/200 --repeats 40
  python benchmarks/step_cost.py --shape 500x16 --shape 2000x16 \
      --recipes floor,fp16 --repeats 20 --inner 20   # per-leaf host cost
  python benchmarks/step_cost.py --shape 500x16 --recipes options
  python benchmarks/step_cost.py --tiny            # seconds; the smoke test
  python benchmarks/step_cost.py --recipes floor,fp16,jmp \
      --compiler-option xla_cpu_copy_insertion_use_region_analysis=true

``--compiler-option KEY=VALUE`` (repeatable) compiles every recipe's step
with those XLA options (``jax.jit(..., compiler_options=...)``): the timed
executable and the one whose bytes accessed and copy count are printed.
"""

import argparse
import atexit
import json
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# Benchmark the checkout this file lives in, installed or not.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (ROOT, HERE):
  if _path not in sys.path:
    sys.path.insert(0, _path)

from hlo_traffic import computations  # noqa: E402
from recipes import BY_KEY  # noqa: E402
from recipes import OPTIONS  # noqa: E402
from recipes import OVERFLOW_ROW  # noqa: E402
from recipes import RECIPES  # noqa: E402
from recipes import build  # noqa: E402, F401  (for scripts that import it)
from recipes import copy_tree  # noqa: E402
from recipes import jitted  # noqa: E402
from recipes import leaf_sizes  # noqa: E402, F401
from recipes import make_inputs  # noqa: E402

SHAPES = {
  "20M/200": (20_000_000, 200),
  "2M/1000": (2_000_000, 1000),
  "tiny": (4_096, 8),
}
DEFAULT_SHAPES = ("20M/200", "2M/1000")
# ``--recipes options``: b's options next to b (and the floor).
OPTION_SET = ("floor", "fp16") + tuple(r.key for r in OPTIONS)
DISTINCT = ":distinct"
SHAPE_HELP = (
  "PARAMS/LEAVES (20M/200: 20,000,000 params in 200 leaves; K, M, G "
  "suffixes) or LEAVESxSIZE (500x16: 500 leaves of 16 elements each, "
  "8,000 params), or 'tiny'; a PARAMS/LEAVES shape ending in "
  f"'{DISTINCT}' gives every leaf a size of its own (10M/200{DISTINCT})"
)


def is_distinct(text):
  """Whether shape ``text`` asks for leaves of distinct sizes."""
  return text.endswith(DISTINCT)


def parse_shape(text):
  """'20M/200', '2000000/1000', '1.5M/300', '500x16' or a name in SHAPES."""
  if text in SHAPES:
    return text, SHAPES[text]
  spec = text.removesuffix(DISTINCT)
  try:
    if "x" in spec:
      if spec != text:
        raise ValueError  # LEAVESxSIZE fixes every leaf's size
      leaves, size = (int(v) for v in spec.split("x"))
      n = leaves * size
    else:
      size, leaves = spec.split("/")
      mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(size[-1:].upper(), 1)
      n = int(float(size[:-1] if mult > 1 else size) * mult)
      leaves = int(leaves)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"shape must be {SHAPE_HELP}; got {text!r}"
    ) from None
  if leaves < 1 or n < leaves:
    raise argparse.ArgumentTypeError(f"need 1 <= leaves <= params: {text!r}")
  if spec != text and n // leaves <= leaves:
    raise argparse.ArgumentTypeError(
      f"{DISTINCT} needs more params a leaf than leaves: {text!r}"
    )
  return text, (n, leaves)


def _option_value(text):
  """A compiler option's value: bool ('true'/'false', any case), int, float,
  else the string itself."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_compiler_option(text):
  """'KEY=VALUE' -> (KEY, value), the value as ``_option_value`` reads it."""
  key, sep, value = text.partition("=")
  key = key.strip()
  if not sep or not re.fullmatch(r"[A-Za-z_]\w*", key) or not value.strip():
    raise argparse.ArgumentTypeError(
      "expected KEY=VALUE, an XLA compiler option and its value (e.g. "
      f"xla_cpu_copy_insertion_use_region_analysis=true); got {text!r}"
    )
  return key, _option_value(value.strip())


def option_text(value):
  """The spelling of a value that ``_option_value`` reads back as it is."""
  if isinstance(value, bool):
    return str(value).lower()
  return repr(value) if isinstance(value, float) else str(value)


def compiler_options(parser, pairs):
  """``{KEY: value}`` of the ``--compiler-option`` pairs; a key given twice
  is a usage error."""
  options = {}
  for key, value in pairs or ():
    if key in options:
      parser.error(f"--compiler-option {key} given twice")
    options[key] = value
  return options


def options_line(options):
  """The header line that names the compiler options."""
  if not options:
    return "Compiler options: none (XLA's defaults)"
  return "Compiler options: " + ", ".join(
    f"{k}={option_text(v)}" for k, v in options.items()
  )


def option_args(options):
  """``options`` as the ``--compiler-option`` arguments of a worker."""
  args = []
  for key, value in (options or {}).items():
    args += ["--compiler-option", f"{key}={option_text(value)}"]
  return args


def check_compiler_options(parser, options):
  """A usage error unless XLA takes ``options`` (it refuses an unknown key
  or a value of the wrong type): one compile of a scalar add."""
  if not options:
    return
  import jax
  import numpy as np

  try:
    jax.jit(lambda x: x + 1, compiler_options=options).lower(
      np.float32(0)
    ).compile()
  except Exception as e:  # XLA's error type differs between jax versions
    parser.error(f"--compiler-option: XLA refused it: {e}")


_COPY = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\S+)\s+copy(-start)?\(")


def count_copies(hlo_text):
  """Array copy instructions in the entry computation of an optimized HLO
  module: copies that copy insertion added (of a donated buffer the step
  still reads, for one), each a pass over its buffer. A scalar's copy
  (``f32[]``) moves four bytes and is not counted."""
  comps, entry = computations(hlo_text)
  found = [_COPY.match(line) for line in comps.get(entry, [])]
  return sum(bool(m) and "[]" not in m.group(1) for m in found)


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
  options = dict(args.compiler_option or ())
  init, step = jitted(args.worker, num_leaves, compiler_options=options)
  params, grads, _ = make_inputs(
    n, num_leaves, distinct=is_distinct(args.shape)
  )
  state = init(params)
  jax.block_until_ready((params, state, grads))
  dump = None
  if args.dump_hlo:
    name = f"{args.worker}_{args.shape.replace('/', '_')}.hlo.txt"
    dump = os.path.join(args.dump_hlo, name)
  # The options are the jit's own, so that the timing process's jit, built
  # with the same ones, finds this executable in the cache.
  compile_and_report(step, (params, state, grads), dump_path=dump)


def compile_and_report(step, call_args, compiler_options=None, dump_path=None):
  """What a compile worker does once its inputs exist: prints READY, traces
  and lowers ``step`` on ``call_args``, compiles it (with
  ``compiler_options`` on top of the jit's own), each timed, and prints
  RESULT and the figures as JSON."""
  print("READY", flush=True)
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = step.lower(*call_args)
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile(compiler_options or None)
  t2, c2 = time.perf_counter(), time.process_time()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device
    cost = cost[0]
  text = compiled.as_text()
  if dump_path:
    os.makedirs(os.path.dirname(dump_path), exist_ok=True)
    with open(dump_path, "w") as f:
      f.write(text)
  print(
    "RESULT "
    + json.dumps(
      dict(
        lower_s=t1 - t0,
        compile_s=t2 - t1,
        lower_cpu_s=c1 - c0,
        compile_cpu_s=c2 - c1,
        bytes_accessed=float(cost.get("bytes accessed", float("nan"))),
        flops=float(cost.get("flops", float("nan"))),
        copies=count_copies(text),
      )
    ),
    flush=True,
  )


def compile_in_worker(
  key,
  shape,
  cache_dir,
  budget,
  dump_hlo,
  startup_s=300,
  compiler_options=None,
  script=None,
):
  """Cold compile of one recipe in a subprocess; None when past the budget.

  ``compiler_options``: XLA options for the compile. ``script``: the
  script whose ``--worker`` compiles (default this one); it takes the same
  arguments and answers READY and RESULT as ``compile_and_report`` does.
  """
  cmd = [
    sys.executable,
    script or os.path.abspath(__file__),
    "--worker",
    key,
    "--shape",
    shape,
    "--cache-dir",
    cache_dir,
  ]
  if dump_hlo:
    cmd += ["--dump-hlo", dump_hlo]
  cmd += option_args(compiler_options)
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


def time_rows(units, repeats, inner, warmup, cpu=None):
  """Interleaved timing. ``units``: lists of one or two rows, each row a
  list [name, fn, params, state, grads] and optionally, sixth, the calls
  that make one unit of work (an accumulation window); default 1.

  Each round runs ``inner`` units of every row in turn, blocking at the end
  of each row's steps; the sample is the elapsed wall time over the calls
  made. When ``cpu`` is a dict, it gets, under each row's name, the
  process's CPU time (all its threads: ``time.process_time``) over the same
  calls, taken around the same sample. The order of the units rotates by
  one per round, so that no row always runs right after the same neighbour
  (or first in its round). The two rows of a unit (fp16_scaling's clean and
  overflow steps) always run back to back, in alternating order, so that
  their per-round ratio compares like with like: with three rows in one
  rotation the overflow row followed the clean one in two rounds of three,
  and read 5% slow at 2M/1000 where an A/B alternating test reads 0.995x.

  Returns ``{name: [seconds per call, one per round]}``.
  """
  import jax

  samples = {r[0]: [] for unit in units for r in unit}
  if cpu is not None:
    cpu.update({name: [] for name in samples})
  for rnd in range(warmup + repeats):
    shift = rnd % len(units)
    for unit in units[shift:] + units[:shift]:
      for row in unit if rnd % 2 == 0 else unit[::-1]:
        name, fn, params, state, grads = row[:5]
        calls = inner * (row[5] if len(row) > 5 else 1)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
          params, state = fn(params, state, grads)
        jax.block_until_ready((params, state))
        dt = (time.perf_counter() - t0) / calls
        dc = (time.process_time() - c0) / calls
        row[2], row[3] = params, state
        if rnd >= warmup:
          samples[name].append(dt)
          if cpu is not None:
            cpu[name].append(dc)
  return samples


def run_shape(shape_name, n, num_leaves, keys, args):
  import jax

  cache_dir = _process_cache()
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
    if is_distinct(shape_name):
      shape_arg += DISTINCT
    attempts = []
    for i in range(args.compile_repeats):
      first = i == 0
      # Every attempt is cold, in its own empty cache. The first one's cache
      # is the one this process then loads the executable from.
      scratch = cache_dir if first else tempfile.mkdtemp(prefix="step_cost_")
      try:
        res = compile_in_worker(
          key,
          shape_arg,
          scratch,
          args.budget,
          args.dump_hlo if first else None,
          compiler_options=args.options,
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

  params, grads, grads_overflow = make_inputs(
    n, num_leaves, distinct=is_distinct(shape_name)
  )
  rows = []
  for key in keys:
    if results[key]["status"] != "ok":
      continue
    init, fn = jitted(key, num_leaves, compiler_options=args.options)
    p = copy_tree(params)
    s = copy_tree(init(p))
    # The first call traces and loads the worker's executable from the cache
    # (it does not compile again); it is one more untimed warm-up step.
    t0 = time.perf_counter()
    with _CacheEvents() as events:
      p, s = jax.block_until_ready(fn(p, s, grads))
    results[key]["load_s"] = time.perf_counter() - t0
    # The cache key holds the compiler options: a hit is the worker's
    # executable, compiled with them.
    hit = events.hit()
    results[key]["first_call_cache_hit"] = hit
    if hit is False:
      print(
        f"[{shape_name}]   {key}: not in the worker's cache, compiled again",
        file=sys.stderr,
        flush=True,
      )
    unit = [[BY_KEY[key].label, fn, p, s, grads, BY_KEY[key].calls]]
    if key == "fp16" and not args.no_overflow:
      p = copy_tree(params)
      unit.append([OVERFLOW_ROW, fn, p, copy_tree(init(p)), grads_overflow])
    rows.append(unit)
  print(
    f"[{shape_name}] timing {sum(map(len, rows))} rows x {args.repeats} "
    "rounds ...",
    file=sys.stderr,
    flush=True,
  )
  cpu = {}
  samples = time_rows(rows, args.repeats, args.inner, args.warmup, cpu)
  jax.clear_caches()
  return results, samples, cpu


class _CacheEvents:
  """The persistent compilation cache's hit and miss events inside a
  ``with``; ``hit()`` is None where jax has no event listeners."""

  HIT = "/jax/compilation_cache/cache_hits"
  MISS = "/jax/compilation_cache/cache_misses"

  def __init__(self):
    self.events = []

  def _listen(self, event, **_):
    self.events.append(event)

  def __enter__(self):
    import jax

    monitoring = getattr(jax, "monitoring", None)
    self._off = getattr(monitoring, "unregister_event_listener", None)
    if self._off is not None:
      monitoring.register_event_listener(self._listen)
    return self

  def __exit__(self, *exc):
    if self._off is not None:
      self._off(self._listen)

  def hit(self):
    if self._off is None:
      return None
    return self.HIT in self.events and self.MISS not in self.events


_CACHE = []


def _process_cache():
  """One compilation cache directory for the whole process, removed at exit.

  JAX opens its persistent cache once, at the first compile, and keeps that
  directory: a second shape given a directory of its own found no
  executable there and compiled every recipe again in this process.
  Executables of different shapes have different keys, so they share it.
  """
  if not _CACHE:
    _CACHE.append(tempfile.mkdtemp(prefix="step_cost_cache_"))
    configure_cache(_CACHE[0])
    atexit.register(shutil.rmtree, _CACHE[0], ignore_errors=True)
  return _CACHE[0]


def _median_low(values):
  return sorted(values)[(len(values) - 1) // 2]


def fmt_ratio(x, base):
  if x is None or base is None or base != base or base == 0:
    return "–"
  return f"{x / base:.3f}x"


def table(
  shape_name, n, num_leaves, keys, results, samples, notes_fn=None, cpu=None
):
  """The markdown table and a dict of everything measured.

  ``cpu``: the process CPU time samples that ``time_rows`` took next to
  ``samples``. ``notes_fn(keys, results, samples, record)``, when given,
  returns more lines for the notes under the table (``targets.py``'s
  verdicts).
  """
  cpu = cpu or {}
  floor = results.get("floor", {})
  floor_ok = floor.get("status") == "ok"
  floor_label = BY_KEY["floor"].label
  med = {name: statistics.median(v) for name, v in samples.items() if v}
  cpu_med = {name: statistics.median(v) for name, v in cpu.items() if v}
  base_step = med.get(floor_label) if floor_ok else None
  base_cpu = cpu_med.get(floor_label) if floor_ok else None
  base_compile = (floor["lower_s"] + floor["compile_s"]) if floor_ok else None
  base_bytes = floor.get("bytes_accessed") if floor_ok else None
  lines = [
    f"Shape {shape_name}: {n:,} float32 params in {num_leaves} leaves, "
    "float16 grads",
    "",
    "| recipe | compile s | vs a | step ms (median) | vs a | "
    "CPU ms/step (median) | vs a | bytes accessed | B/param | vs a |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
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
      lines.append(f"| {name} | {res['status']} |" + " – |" * 8)
      record["rows"][name] = dict(status=res["status"])
      continue
    step, cpu_step = med.get(name), cpu_med.get(name)
    same = name == OVERFLOW_ROW
    compile_s = res["lower_s"] + res["compile_s"]
    b = res["bytes_accessed"]
    cells = [
      name,
      "(same executable)" if same else f"{compile_s:.2f}",
      "" if same else fmt_ratio(compile_s, base_compile),
      f"{step * 1e3:.3f}" if step is not None else "–",
      fmt_ratio(step, base_step),
      f"{cpu_step * 1e3:.3f}" if cpu_step is not None else "–",
      fmt_ratio(cpu_step, base_cpu),
      "" if same else f"{b:,.0f}",
      "" if same else f"{b / n:.1f}",
      "" if same else fmt_ratio(b, base_bytes),
    ]
    lines.append("| " + " | ".join(cells) + " |")
    spread = samples.get(name, [])
    row = dict(
      status="ok",
      lower_s=res["lower_s"],
      compile_s=res["compile_s"],
      compile_attempts_s=res.get("compile_attempts_s"),
      first_call_s=res.get("load_s"),
      step_s_median=step,
      step_s_p10=_quantile(spread, 0.1),
      step_s_p90=_quantile(spread, 0.9),
      step_s_samples=spread,
      cpu_s_median=cpu_step,
      cpu_s_samples=cpu.get(name, []),
      bytes_accessed=b,
      flops=res["flops"],
      copies=res.get("copies"),
      first_call_cache_hit=res.get("first_call_cache_hit"),
    )
    if floor_ok and name in samples and floor_label in samples:
      row["wall_vs_floor_per_round"] = _paired(
        samples[name], samples[floor_label]
      )
      if name in cpu and floor_label in cpu:
        row["cpu_vs_floor_per_round"] = _paired(cpu[name], cpu[floor_label])
    record["rows"][name] = row

  notes = []
  if samples.get(OVERFLOW_ROW) and samples.get(BY_KEY["fp16"].label):
    ratios = _paired(samples[OVERFLOW_ROW], samples[BY_KEY["fp16"].label])
    notes.append(
      "fp16_scaling overflow step / clean step, per round: " + _spread(ratios)
    )

  def both(name, base):
    text = "wall " + _spread(_paired(samples[name], samples[base]))
    if cpu.get(name) and cpu.get(base):
      text += "; process CPU " + _spread(_paired(cpu[name], cpu[base]))
    return text

  if floor_ok:
    for key, name in names:
      if key == "floor" or name == OVERFLOW_ROW or name not in samples:
        continue
      notes.append(f"{name} / floor, per round: {both(name, floor_label)}")
  fp16_label = BY_KEY["fp16"].label
  for key, name in names:
    if key in OPTION_SET[2:] and name in samples and fp16_label in samples:
      notes.append(f"{name} / b, per round: {both(name, fp16_label)}")
  copies = [
    f"{key} {results[key]['copies']}"
    for key in keys
    if results[key].get("status") == "ok"
    and results[key].get("copies") is not None
  ]
  if copies:
    notes.append(
      "array copy instructions in each compiled step (entry computation): "
      + ", ".join(copies)
    )
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
    help=SHAPE_HELP + " (repeatable; default 20M/200 and 2M/1000). "
    "500x16 and 2000x16 price the per-leaf host work of a call",
  )
  parser.add_argument(
    "--tiny",
    action="store_true",
    help=f"the tiny shape {SHAPES['tiny']} (smoke test)",
  )
  parser.add_argument(
    "--recipes",
    default=",".join(r.key for r in RECIPES),
    help="comma-separated subset of: "
    + ", ".join(BY_KEY)
    + "; 'options' stands for "
    + ",".join(OPTION_SET)
    + " (b's options, each also as a ratio to b). Default: "
    + ",".join(r.key for r in RECIPES),
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
  parser.add_argument(
    "--compiler-option",
    action="append",
    type=parse_compiler_option,
    metavar="KEY=VALUE",
    help="an XLA compiler option every recipe's step is compiled with "
    "(jax.jit's compiler_options), e.g. "
    "xla_cpu_copy_insertion_use_region_analysis=true; VALUE is read as a "
    "bool, int, float or string. Repeatable; default none (XLA's defaults)",
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
  keys = []
  for word in args.recipes.split(","):
    for k in OPTION_SET if word.strip() == "options" else [word.strip()]:
      if k and k not in keys:
        keys.append(k)
  for k in keys:
    if k not in BY_KEY:
      parser.error(f"unknown recipe {k!r}; choose from {list(BY_KEY)}")
  if "floor" not in keys:
    keys.insert(0, "floor")  # everything is a ratio to it
  args.options = compiler_options(parser, args.compiler_option)
  if args.options:
    _process_cache()  # before this process's first compile: see there
    check_compiler_options(parser, args.options)

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
  print(options_line(args.options))
  records = []
  for shape_name, (n, num_leaves) in shapes:
    results, samples, cpu = run_shape(shape_name, n, num_leaves, keys, args)
    text, record = table(
      shape_name, n, num_leaves, keys, results, samples, notes_fn, cpu
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
          compiler_options=args.options,
          shapes=records,
        ),
        f,
        indent=1,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
