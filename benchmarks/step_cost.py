#!/usr/bin/env python
"""Cost of one jitted optimizer step with float16 loss scaling, side by side.

Times ``recipes.py``'s steps (a the floor, plain optax; b fp16_scaling, its
expert mask and its overflow step; c jmp; d ``optax.apply_if_finite``; e
Flax; with ``--recipes options`` b's options f to j; with ``--recipes
flat`` the flat forms k and l) in one process, rounds interleaved
(``_common.interleaved``). Each recipe is compiled cold in a worker, killed
``--budget`` seconds into its compile, then every recipe compiled so far
is timed before the next compiles, and ``--json`` is rewritten: a compile
that never ends loses only its own row. Reports compile time, wall and CPU
time per step, XLA's bytes accessed, the kernels of the compiled step, the
GB/s and their fraction of the copy bandwidth measured in the same run,
and the per-round ratios to (a); benchmarks/README.md tells what each
means. ``targets.py`` judges the same measurement.

  python benchmarks/step_cost.py                   # 20M/200 and 2M/1000
  python benchmarks/step_cost.py --shape 500x16 --recipes options
  python benchmarks/step_cost.py --tiny            # seconds; the smoke test
  python benchmarks/step_cost.py --shape 500M/500 --recipes flat --inner 10
  python benchmarks/step_cost.py --recipes floor,fp16,jmp \
      --compiler-option xla_cpu_copy_insertion_use_region_analysis=true
"""

import argparse
import atexit
import json
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402  (also puts the checkout on sys.path)
from hlo_traffic import computations  # noqa: E402
from hlo_traffic import kernels  # noqa: E402
from hlo_traffic import total_bytes  # noqa: E402
import recipes  # noqa: E402

BY_KEY, OPTIONS, RECIPES = recipes.BY_KEY, recipes.OPTIONS, recipes.RECIPES
OVERFLOW_ROW, copy_tree = recipes.OVERFLOW_ROW, recipes.copy_tree
jitted, make_inputs = recipes.jitted, recipes.make_inputs

SHAPES = {"20M/200": (20_000_000, 200), "2M/1000": (2_000_000, 1000)}
SHAPES["tiny"] = (4_096, 8)
DEFAULT_SHAPES = ("20M/200", "2M/1000")
# ``--recipes options``: b's options next to b (and the floor).
OPTION_SET = ("floor", "fp16") + tuple(r.key for r in OPTIONS)
# ``--recipes flat``: the flat forms next to the floor and b.
FLAT_SET = ("floor", "fp16") + tuple(r.key for r in recipes.FLAT)
COMPILING = "COMPILING"  # what a worker prints when its compile starts
DISTINCT = ":distinct"
SHAPE_HELP = (
  "PARAMS/LEAVES (20M/200: 20,000,000 params in 200 leaves; K, M, G "
  "suffixes) or LEAVESxSIZE (500x16: 500 leaves of 16 elements each, "
  "8,000 params), or 'tiny'; a PARAMS/LEAVES shape ending in "
  f"'{DISTINCT}' gives every leaf a size of its own (10M/200{DISTINCT})"
)


def parse_shape(text):
  """``(text, (params, leaves))`` of a shape spelled as SHAPE_HELP says;
  argparse.ArgumentTypeError for any other spelling."""
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


def parse_compiler_option(text):
  """'KEY=VALUE' -> (KEY, value): a bool ('true'/'false', any case), int,
  float, else the string itself; argparse.ArgumentTypeError otherwise."""
  key, sep, value = (x.strip() for x in text.partition("="))
  if not sep or not re.fullmatch(r"[A-Za-z_]\w*", key) or not value:
    raise argparse.ArgumentTypeError(
      "expected KEY=VALUE, an XLA compiler option and its value (e.g. "
      f"xla_cpu_copy_insertion_use_region_analysis=true); got {text!r}"
    )
  if value.lower() in ("true", "false"):
    return key, value.lower() == "true"
  for kind in (int, float):
    try:
      return key, kind(value)
    except ValueError:
      pass
  return key, value


def option_text(value):
  """The spelling of a value that ``parse_compiler_option`` reads back."""
  if isinstance(value, bool):
    return str(value).lower()
  return repr(value) if isinstance(value, float) else str(value)


def option_args(options):
  """``options`` as the ``--compiler-option`` arguments of a worker."""
  return [
    a
    for k, v in (options or {}).items()
    for a in ("--compiler-option", f"{k}={option_text(v)}")
  ]


def options_line(options):
  """The header line that names the compiler options."""
  names = ", ".join(f"{k}={option_text(v)}" for k, v in options.items())
  return f"Compiler options: {names or 'none (XLA' + chr(39) + 's defaults)'}"


def compiler_options(parser, pairs, check=True):
  """``{KEY: value}`` of the ``--compiler-option`` pairs. A key given twice,
  and (with ``check``) options XLA refuses (an unknown key, a value of the
  wrong type: one compile of a scalar add tells), are usage errors."""
  options = {}
  for key, value in pairs or ():
    if key in options:
      parser.error(f"--compiler-option {key} given twice")
    options[key] = value
  if options and check:
    import jax
    import numpy as np

    try:
      jit = jax.jit(lambda x: x + 1, compiler_options=options)
      jit.lower(np.float32(0)).compile()
    except Exception as e:  # XLA's error type differs between jax versions
      parser.error(f"--compiler-option: XLA refused it: {e}")
  return options


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
  """Every compile of this process goes to the persistent cache in
  ``cache_dir``, however small or quick."""
  import jax

  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def worker(args):
  """``--worker KEY``: compile recipe KEY at ``--shape`` into the cache."""
  configure_cache(args.cache_dir)
  import jax

  _, (n, num_leaves) = parse_shape(args.shape)
  options = dict(args.compiler_option or ())
  init, step = jitted(args.worker, num_leaves, compiler_options=options)
  # Shapes only: the compile needs no array, and the timing process's
  # concrete inputs find the same executable in the cache.
  params, grads = recipes.abstract_inputs(
    n, num_leaves, distinct=args.shape.endswith(DISTINCT)
  )
  state = jax.eval_shape(init, params)
  name = f"{args.worker}_{args.shape.replace('/', '_')}.hlo.txt"
  dump = os.path.join(args.dump_hlo, name) if args.dump_hlo else None
  # The options are the jit's own, so that the timing process's jit, built
  # with the same ones, finds this executable in the cache.
  compile_and_report(step, (params, state, grads), None, dump_path=dump)


def compile_and_report(step, call_args, compiler_options=None, **kwargs):
  """What a compile worker does once its inputs exist: prints COMPILING
  (from then on ``compile_in_worker`` gives it ``budget`` seconds); traces,
  lowers and compiles ``step`` on ``call_args`` (with ``compiler_options``
  on top of the jit's own), each timed; prints RESULT and the figures as
  JSON: ``lower_s``, ``compile_s`` (wall), ``lower_cpu_s``,
  ``compile_cpu_s`` (CPU), ``flops``, ``bytes_accessed``, ``copies``,
  ``fusions`` and ``kernels`` (``hlo_traffic.kernels``) and
  ``bytes_moved`` (``hlo_traffic.total_bytes`` with ``slices``)."""
  print(COMPILING, flush=True)
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = step.lower(*call_args)
  t1, c1 = time.perf_counter(), time.process_time()
  compiled = lowered.compile(compiler_options or None)
  t2, c2 = time.perf_counter(), time.process_time()
  text, dump_path = compiled.as_text(), kwargs.get("dump_path")
  if dump_path:
    os.makedirs(os.path.dirname(dump_path), exist_ok=True)
    with open(dump_path, "w") as f:
      f.write(text)
  result = dict(lower_s=t1 - t0, compile_s=t2 - t1, lower_cpu_s=c1 - c0)
  result.update(compile_cpu_s=c2 - c1, copies=count_copies(text))
  result["fusions"], result["kernels"] = kernels(text)
  result["bytes_moved"] = total_bytes(text, slices=True)
  print("RESULT " + json.dumps(result | common.costs(compiled)), flush=True)


def watch(proc, budget, startup_s):
  """``(stdout, killed)`` of a compile worker ``proc`` (stdout a pipe):
  read until it exits, or killed (``killed`` True) ``budget`` seconds after
  its COMPILING line unless its RESULT line came first. RuntimeError if it
  spends over ``startup_s`` before COMPILING, or after RESULT."""
  fd, out = proc.stdout.fileno(), b""
  deadline, stage = time.monotonic() + startup_s, "starting"
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      proc.kill()
      proc.wait()
      if stage == "compiling":
        return out.decode(errors="replace"), True
      raise RuntimeError(f"worker hung past {startup_s:g} s {stage}")
    if not select.select([fd], [], [], left)[0]:
      continue
    chunk = os.read(fd, 1 << 16)
    if not chunk:  # end of output: the worker is exiting
      proc.wait()
      return out.decode(errors="replace"), False
    out += chunk
    lines = out.splitlines()
    if stage != "done" and b"RESULT " in out:
      stage, deadline = "done", time.monotonic() + startup_s
    elif stage == "starting" and COMPILING.encode() in lines:
      stage, deadline = "compiling", time.monotonic() + budget


def compile_in_worker(key, shape, cache_dir, budget, dump_hlo, **kwargs):
  """Cold compile of recipe ``key`` at ``shape`` in a subprocess (of
  ``script``, default this one), into the cache in ``cache_dir``:
  ``compile_and_report``'s figures, or None when it was killed ``budget``
  seconds into its compile (its imports and inputs do not count): the
  compile is given up, not waited for. RuntimeError (with the tail of its
  stderr) when the worker failed or spent over ``startup_s`` starting."""
  script = kwargs.get("script") or os.path.abspath(__file__)
  cmd = [sys.executable, script, "--worker", key, "--shape", shape]
  cmd += ["--cache-dir", cache_dir, "--budget", str(budget)]
  cmd += ["--dump-hlo", dump_hlo] if dump_hlo else []
  cmd += option_args(kwargs.get("compiler_options"))
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    try:
      stdout, killed = watch(proc, budget, kwargs.get("startup_s", 300))
    except RuntimeError as e:
      raise RuntimeError(f"worker {key}: {e}") from None
    err.seek(0)
    stderr = err.read()
  if killed:
    return None
  found = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
  if proc.returncode or not found:
    raise RuntimeError(f"worker {key} failed:\n{stderr[-3000:]}")
  return json.loads(found[-1][len("RESULT ") :])


def compile_recipe(key, shape_arg, cache_dir, args):
  """The median of ``--compile-repeats`` cold compiles of ``key`` (their
  totals under ``compile_attempts_s``), with ``status``: "ok", or why not."""
  if BY_KEY[key].module:
    try:
      __import__(BY_KEY[key].module)
    except ImportError as e:
      return dict(status=f"not installed ({e.name})")
  log(f"[{shape_arg}] compiling {key} ...")
  attempts = []
  for i in range(args.compile_repeats):
    # Every attempt is cold, in its own empty cache. The first one's cache
    # is the one this process then loads the executable from.
    with tempfile.TemporaryDirectory(prefix="step_cost_") as scratch:
      cache, dump = (cache_dir, args.dump_hlo) if i == 0 else (scratch, None)
      res = compile_in_worker(
        key, shape_arg, cache, args.budget, dump, compiler_options=args.options
      )
    if res is None:
      log(f"[{shape_arg}]   {key}: compile > {args.budget:g} s, killed")
      return dict(status=f"> budget ({args.budget:g} s)")
    attempts.append(res)
    if res["lower_s"] + res["compile_s"] > args.budget / 10:
      break  # a slow compile is not worth repeating: one cold number
  totals = [a["lower_s"] + a["compile_s"] for a in attempts]
  log(f"[{shape_arg}]   {key}: " + ", ".join(f"{t:.1f}" for t in totals) + " s")
  res = dict(attempts[totals.index(sorted(totals)[(len(totals) - 1) // 2])])
  return res | dict(compile_attempts_s=totals, status="ok")


def load_unit(key, fn, init, inputs, args):
  """The timing unit of recipe ``key`` (its row, and the overflow step's
  for b) and ``{load_s, cache_hit}``: the first call, which loads the
  worker's executable from the cache, and one more untimed step."""
  params, grads, grads_overflow = inputs
  p = copy_tree(params)
  s = copy_tree(init(p))
  t0 = time.perf_counter()
  (p, s), hit = first_call(fn, p, s, grads)
  loaded = dict(load_s=time.perf_counter() - t0, cache_hit=hit)
  calls = args.inner * BY_KEY[key].calls
  unit = [(BY_KEY[key].label, common.stepper(fn, [p, s], grads, calls))]
  if key == "fp16" and not args.no_overflow:
    p = copy_tree(params)
    box = [p, copy_tree(init(p))]
    unit.append((OVERFLOW_ROW, common.stepper(fn, box, grads_overflow, calls)))
  return unit, loaded


def run_shape(shape_name, n, num_leaves, keys, args, on_pass=None):
  """Compiles and times ``keys`` at one shape, one recipe at a time: after
  each compile every recipe compiled so far is timed, in interleaved
  rounds, and ``on_pass(results, wall, cpu)`` gets the figures so far
  (``main`` writes the JSON there), before the next recipe compiles.
  Returns the last pass's ``(results, wall, cpu)``: the compile figures by
  key and ``{row label: [seconds per call]}``."""
  import jax

  cache_dir = _process_cache()
  shape_arg = shape_name if shape_name in SHAPES else f"{n}/{num_leaves}"
  shape_arg += DISTINCT if shape_name.endswith(DISTINCT) else ""
  inputs = make_inputs(n, num_leaves, distinct=shape_name.endswith(DISTINCT))
  results, units, wall, cpu = {}, [], {}, {}
  for key in keys:
    results[key] = compile_recipe(key, shape_arg, cache_dir, args)
    if results[key]["status"] == "ok":
      init, fn = jitted(key, num_leaves, compiler_options=args.options)
      unit, loaded = load_unit(key, fn, init, inputs, args)
      results[key].update(loaded)
      if loaded["cache_hit"] is False:
        log(
          f"[{shape_name}]   {key}: not in the worker's cache, compiled again"
        )
      units.append(unit)
      rows = sum(map(len, units))
      log(f"[{shape_name}] timing {rows} rows x {args.repeats} ...")
      timed = common.interleaved(units, args.repeats, args.warmup)
      wall, cpu = common.split(timed)
    if on_pass is not None:
      on_pass(dict(results), wall, cpu)
  jax.clear_caches()
  return results, wall, cpu


def log(text):
  print(text, file=sys.stderr, flush=True)


def first_call(call, *args):
  """``call(*args)``'s result, blocked on, and whether it loaded its
  executable from the persistent compilation cache (None where jax has no
  event listeners)."""
  import jax

  events, monitoring = [], getattr(jax, "monitoring", None)
  off = getattr(monitoring, "unregister_event_listener", None)
  listen = lambda event, **_: events.append(event)
  if off is None:
    return jax.block_until_ready(call(*args)), None
  monitoring.register_event_listener(listen)
  try:
    out = jax.block_until_ready(call(*args))
  finally:
    off(listen)
  cache = "/jax/compilation_cache/cache_"
  return out, cache + "hits" in events and cache + "misses" not in events


_CACHE = []


def _process_cache():
  """One compilation cache directory for the whole process, removed at
  exit: JAX opens its persistent cache once, at the first compile, so every
  shape's executables (different keys) share it."""
  if not _CACHE:
    _CACHE.append(tempfile.mkdtemp(prefix="step_cost_cache_"))
    configure_cache(_CACHE[0])
    atexit.register(shutil.rmtree, _CACHE[0], ignore_errors=True)
  return _CACHE[0]


def fmt_ratio(x, base):
  """'1.234x', or '–' where there is no base to divide by."""
  if x is None or not base or base != base:
    return "–"
  return f"{x / base:.3f}x"


def table(
  shape_name, n, num_leaves, keys, results, wall, cpu, notes_fn=None, **kw
):
  """``(text, record)``: the markdown table of one shape with its notes,
  and its JSON record (``rows`` by label: compile figures, samples and
  per-round ratios to the floor). ``results``, ``wall`` and ``cpu`` are
  ``run_shape``'s (``keys``: those of ``results`` to show);
  ``notes_fn(keys, results, wall, record)`` returns more notes
  (``targets.py``'s verdicts); ``copy_gb_s``, the copy bandwidth that each
  row's GB/s (bytes accessed / median step time) is a fraction of."""
  copy_gb_s = kw.get("copy_gb_s")
  floor, fp16 = BY_KEY["floor"].label, BY_KEY["fp16"].label
  floor_ok = results.get("floor", {}).get("status") == "ok"
  ok = [k for k, r in results.items() if r["status"] == "ok"]
  total = {k: results[k]["lower_s"] + results[k]["compile_s"] for k in ok}
  med = {name: statistics.median(v) for name, v in wall.items() if v}
  cpu_med = {name: statistics.median(v) for name, v in cpu.items() if v}
  lines = [
    f"Shape {shape_name}: {n:,} float32 params in {num_leaves} leaves, "
    "float16 grads",
    "",
    "| recipe | compile s | vs a | step ms (median) | vs a | "
    "CPU ms/step (median) | vs a | bytes accessed | B/param | vs a | "
    "bytes moved | kernels (fusions) | GB/s | of copy |",
    "|---|" + "---:|" * 13,
  ]
  record = dict(shape=shape_name, params=n, leaves=num_leaves, rows={})
  names = [(k, BY_KEY[k].label) for k in keys]
  if OVERFLOW_ROW in wall:
    names.insert(
      [k for k, _ in names].index("fp16") + 1, ("fp16", OVERFLOW_ROW)
    )

  for key, name in names:
    res = results[key]
    if res["status"] != "ok":
      lines.append(f"| {name} | {res['status']} |" + " – |" * 12)
      record["rows"][name] = dict(status=res["status"])
      continue
    same, b = name == OVERFLOW_ROW, res["bytes_accessed"]
    base_b = results["floor"]["bytes_accessed"] if floor_ok else None
    cells = [
      "(same executable)" if same else f"{total[key]:.2f}",
      "" if same else fmt_ratio(total[key], total.get("floor")),
      f"{med[name] * 1e3:.3f}" if name in med else "–",
      fmt_ratio(med.get(name), med.get(floor) if floor_ok else None),
      f"{cpu_med[name] * 1e3:.3f}" if name in cpu_med else "–",
      fmt_ratio(cpu_med.get(name), cpu_med.get(floor) if floor_ok else None),
    ]
    cells += ["", "", ""] if same else [f"{b:,.0f}", f"{b / n:.1f}"]
    cells += [] if same else [fmt_ratio(b, base_b)]
    moved = res["bytes_moved"]
    gb_s = moved / med[name] / 1e9 if med.get(name) else None
    copy = gb_s / copy_gb_s if gb_s and copy_gb_s else None
    cells += ["" if same else f"{moved:,.0f}"]
    cells += ["" if same else f"{res['kernels']:,} ({res['fusions']:,})"]
    cells += [f"{gb_s:,.1f}" if gb_s else "–"]
    cells += [f"{copy:.3f}" if copy else "–"]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
    spread = wall.get(name, [])
    fields = ("lower_s", "compile_s", "flops", "copies", "fusions", "kernels")
    fields += ("bytes_moved",)
    row = {k: res.get(k) for k in fields}
    # fmt: off
    row.update(
      status="ok", compile_attempts_s=res.get("compile_attempts_s"),
      first_call_s=res.get("load_s"), first_call_cache_hit=res["cache_hit"],
      step_s_median=med.get(name), step_s_samples=spread,
      step_s_p10=common.quantile(spread, 0.1),
      step_s_p90=common.quantile(spread, 0.9),
      cpu_s_median=cpu_med.get(name), cpu_s_samples=cpu.get(name, []),
      bytes_accessed=b, gb_s=gb_s, copy_fraction=copy,
    )
    # fmt: on
    if floor_ok and name in wall:
      row["wall_vs_floor_per_round"] = common.paired(wall[name], wall[floor])
      row["cpu_vs_floor_per_round"] = common.paired(cpu[name], cpu[floor])
    record["rows"][name] = row

  def both(name, base):
    ratios = [common.paired(t[name], t[base]) for t in (wall, cpu)]
    return "wall {}; process CPU {}".format(*map(common.spread, ratios))

  notes = []
  if wall.get(OVERFLOW_ROW) and wall.get(fp16):
    ratios = common.spread(common.paired(wall[OVERFLOW_ROW], wall[fp16]))
    notes.append(
      f"fp16_scaling overflow step / clean step, per round: {ratios}"
    )
  for key, name in names:
    if floor_ok and key != "floor" and name != OVERFLOW_ROW and name in wall:
      notes.append(f"{name} / floor, per round: {both(name, floor)}")
  for key, name in names:
    vs_b = key in OPTION_SET[2:] or key == "flat_fp16"
    if vs_b and name in wall and fp16 in wall:
      notes.append(f"{name} / b, per round: {both(name, fp16)}")
  copies = [f"{k} {results[k]['copies']}" for k in keys if k in total]
  if copies:
    notes.append(
      "array copy instructions in each compiled step (entry computation): "
      + ", ".join(copies)
    )
  if copy_gb_s:
    notes.append(
      f"copy bandwidth in this run: {copy_gb_s:,.1f} GB/s (median; "
      "`a * 1.0001`, read + write); GB/s is bytes moved / step time, "
      "bytes moved hlo_traffic.py's count of the compiled step with "
      "--slices (XLA's bytes accessed but for an operand a loop fusion "
      "only slices, which counts as its slice)"
    )
  if notes_fn is not None:
    notes += notes_fn(keys, results, wall, record)
  return "\n".join(lines + [""] + [f"- {x}" for x in notes]), record


# fmt: off
FLAG = {  # flags that compile_cost.py takes too
  "--compiler-option": dict(
    action="append", type=parse_compiler_option, metavar="KEY=VALUE",
    help="an XLA option for every step's compile, e.g. "
    "xla_cpu_copy_insertion_use_region_analysis=true (repeatable)"),
  "--json": dict(metavar="PATH", help="write results as JSON"),
  "--worker": dict(help=argparse.SUPPRESS),
  "--cache-dir": dict(help=argparse.SUPPRESS),
}
# fmt: on


def parser_for(description, prog):
  """The command line of ``step_cost.py`` (and ``targets.py``)."""
  # fmt: off
  parser = argparse.ArgumentParser(prog=prog, description=description,
    formatter_class=argparse.RawDescriptionHelpFormatter)
  add, recipes = parser.add_argument, ",".join(r.key for r in RECIPES)
  add("--shape", action="append", type=parse_shape,
      help=SHAPE_HELP + " (repeatable; default 20M/200 and 2M/1000)")
  add("--tiny", action="store_true", help=f"the tiny shape {SHAPES['tiny']}")
  add("--recipes", default=recipes, help=f"comma-separated, of {list(BY_KEY)}"
      f"; 'options' stands for {','.join(OPTION_SET)}, 'flat' for "
      f"{','.join(FLAT_SET)}. Default: {recipes}")
  add("--repeats", type=int, default=30, help="timed rounds (default 30)")
  add("--inner", type=int, default=1,
      help="steps per timed sample (default 1; more on a GPU)")
  add("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
  add("--budget", type=float, default=300.0,
      help="seconds a compile may take before it is killed (default 300)")
  add("--compile-repeats", type=int, default=1, help="cold compiles per "
      "recipe, median reported; one if it took over budget/10 (default 1)")
  add("--no-overflow", action="store_true", help="no overflow-step row")
  add("--copy-mib", type=float, help="MiB of float32 for the copy bandwidth "
      "that each row's GB/s is a fraction of (default 2048 on a GPU or TPU, "
      "256 on a CPU, 8 with --tiny; 0: none)")
  add("--dump-hlo", metavar="DIR", help="write each step's optimized HLO here")
  for flag in ("--compiler-option", "--json", "--worker", "--cache-dir"):
    add(flag, **FLAG[flag])
  # fmt: on
  return parser


def recipe_keys(parser, text):
  """The recipes of ``--recipes`` ('options', 'flat' expanded), the floor
  first."""
  keys, sets = [], dict(options=OPTION_SET, flat=FLAT_SET)
  for word in (w.strip() for w in text.split(",")):
    words = sets.get(word, [word])
    keys += [k for k in words if k and k not in keys]
  for k in keys:
    if k not in BY_KEY:
      parser.error(f"unknown recipe {k!r}; choose from {list(BY_KEY)}")
  return keys if "floor" in keys else ["floor"] + keys


def main(argv=None, notes_fn=None, description=None, prog=None):
  parser = parser_for(description or __doc__, prog)
  args = parser.parse_args(argv)
  if args.worker:
    args.shape = args.shape[0][0] if args.shape else "tiny"
    return worker(args)
  shapes = list(args.shape or [])
  shapes += [parse_shape("tiny")] if args.tiny else []
  shapes = shapes or [parse_shape(s) for s in DEFAULT_SHAPES]
  keys = recipe_keys(parser, args.recipes)
  args.options = compiler_options(parser, args.compiler_option, check=False)
  if args.options:
    _process_cache()  # before this process's first compile: see there
    compiler_options(parser, args.compiler_option)
  argv = list(sys.argv[1:] if argv is None else argv)
  print(f"Machine: {common.machine()}")
  print(f"Command: python benchmarks/{prog or 'step_cost.py'} {' '.join(argv)}")
  settings = ("repeats", "inner", "warmup", "budget", "compile_repeats")
  print(" ".join(f"{k}={getattr(args, k):g}" for k in settings))
  print(options_line(args.options))
  copy = copy_bandwidth(args)
  head = dict(machine=common.machine(), argv=argv, copy_bandwidth=copy)
  head.update(xla_flags=os.environ.get("XLA_FLAGS", ""))
  head.update(compiler_options=args.options)
  records = []
  save = lambda shapes: args.json and write_json(args.json, head, shapes)
  copy_gb_s = copy and copy["median_gb_s"]
  for shape_name, (n, num_leaves) in shapes:
    shape = (shape_name, n, num_leaves)

    def on_pass(results, wall, cpu, shape=shape):
      _, record = table(
        *shape, list(results), results, wall, cpu, notes_fn,
        copy_gb_s=copy_gb_s,
      )  # fmt: skip
      save(records + [record])

    results, wall, cpu = run_shape(*shape, keys, args, on_pass)
    text, record = table(
      *shape, keys, results, wall, cpu, notes_fn, copy_gb_s=copy_gb_s
    )
    print(f"\n{text}", flush=True)
    records.append(record)
  save(records)
  return 0


def copy_bandwidth(args):
  """``_common.copy_bandwidth`` at ``--copy-mib``, printed; None at 0."""
  import jax

  mib = args.copy_mib
  if mib is None:
    mib = 8 if args.tiny else 256 if jax.default_backend() == "cpu" else 2048
  if not mib:
    return None
  copy = common.copy_bandwidth(int(mib * 2**20)) | dict(mib=mib)
  print(
    f"Copy bandwidth: {copy['median_gb_s']:,.1f} GB/s median, "
    f"{copy['best_gb_s']:,.1f} GB/s best (a * 1.0001 on {mib:g} MiB "
    "float32, read + write)",
    flush=True,
  )
  return copy


def write_json(path, head, shapes):
  """``head`` and ``shapes`` as JSON in ``path``, atomically: a reader (or
  a kill) finds the previous file or this one, never half of one."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(head | dict(shapes=shapes), f, indent=1)
  os.replace(tmp, path)


if __name__ == "__main__":
  sys.exit(main())
