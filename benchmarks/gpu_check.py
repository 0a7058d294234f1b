#!/usr/bin/env python3
"""One unattended check of fp16_scaling on a GPU machine: one command, one
folder of results (benchmarks/README.md describes every part).

  python3 benchmarks/gpu_check.py OUTDIR

Needs the standard library, jax (CUDA), optax, flax and this checkout (jmp
optional); no network. Each part of ``PARTS`` runs in a process session of
its own, killed with its children at its limit; ``--total`` (480 s) caps
the run. OUTDIR gets ``gpu_check.json`` (rewritten after each part),
``gpu_check.md`` and ``logs/``; exit status 0 when every part is ok.

  python3 benchmarks/gpu_check.py /tmp/gpu --parts bandwidth,step_cost
  python3 benchmarks/gpu_check.py /tmp/smoke --tiny            # CPU, seconds
"""

import argparse
import collections
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

CB_OFF = "--xla_gpu_enable_command_buffer="
PAIR = ("floor", "fp16")
# The peers part: the flat forms first (the step near the hardware?), then
# the other recipes users would write instead.
PEERS = ("floor", "flat_fp16", "flat_floor", "apply_if_finite", "jmp")
TEST_IGNORES = ("tests/peers", "tests/mesh", "tests/multihost")
TINY_TESTS = ("tests/test_scaler.py",)
TEST_WORKERS = 6  # pytest-xdist workers on a GPU: 74 s for the suite on an H200


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  limit_s: float  # the default time limit
  what: str
  shape: str = ""  # step_cost parts: the shape, and at --tiny
  tiny_shape: str = ""
  command_buffers: bool = True
  recipes: tuple = PAIR


# In priority order. The H200's figures (2026-12-04): a 500M/500 compile
# takes 21-25 s (apply_if_finite 31 s, jmp over 60 s), a 20M/1000 one over
# 40 s; the parent's inputs and each worker's start add seconds; the suite
# takes 74 s on 6 workers, the train step 38 s. Parts past ``--total`` are
# skipped: the default-flag floor and fp16 rows come first, then the tests.
# fmt: off
PARTS = (
  Part("env", 15, "versions and devices"),
  Part("step_cost_500M_500_cb_on", 120,
       "step_cost 500M/500, command buffers on: floor, fp16", "500M/500",
       "16K/16"),
  Part("tests", 120, "test suite less peers, mesh and multihost"),
  Part("bandwidth", 15, "copy bandwidth, a * 1.0001 on 2 GiB float32"),
  Part("train_step", 60, "whole train step, fp16_scaling / plain optax"),
  Part("step_cost_500M_500_peers", 180,
       "step_cost 500M/500, command buffers on: floor, the flat forms, "
       "apply_if_finite, jmp", "500M/500", "16K/16", recipes=PEERS),
  Part("step_cost_500M_500_cb_off", 100,
       "step_cost 500M/500, command buffers off", "500M/500", "16K/16", False),
  Part("step_cost_20M_1000_cb_on", 120,
       "step_cost 20M/1000, command buffers on", "20M/1000", "4K/32"),
  Part("step_cost_20M_1000_cb_off", 120,
       "step_cost 20M/1000, command buffers off", "20M/1000", "4K/32", False),
  Part("kernels", 120, "the 500M/500 floor and fp16 compiled without a "
       "device for the H100 target (gpu_kernels.py), beside the real "
       "compile's kernels"),
)
# fmt: on
BY_NAME = {p.name: p for p in PARTS}
TOTAL_S = 480.0  # the whole run: 8 minutes; the limits add up to 970


def worker_env(args):
  """Versions (None: not installed), the backend and the devices."""
  import jax

  def version(name):
    try:
      return getattr(__import__(name), "__version__", "?")
    except ImportError:
      return None

  out = {name: version(name) for name in ("jax", "jaxlib", "optax", "flax")}
  devices, out["jmp"] = jax.devices(), version("jmp")
  out.update(backend=jax.default_backend(), cpus=os.cpu_count())
  out.update(python=platform.python_version(), machine=platform.machine())
  out["devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in devices]
  out["summary"] = (
    f"jax {jax.__version__} on {jax.default_backend()}, "
    f"{len(devices)} x {devices[0].device_kind}; jmp "
    f"{out['jmp'] or 'not installed'}"
  )
  return out


def worker_bandwidth(args):
  """GB/s of a donated ``a * 1.0001`` over ``args.bytes`` of float32 (read
  and write), median and best of ``args.calls`` calls."""
  import _common as common
  import jax

  out = common.copy_bandwidth(args.bytes, args.calls)
  med, best, size = out["median_gb_s"], out["best_gb_s"], out["bytes"]
  return out | dict(
    calls=args.calls, device=jax.devices()[0].device_kind,
    summary=f"{med:,.1f} GB/s median, {best:,.1f} GB/s best "
    f"({size / 2**30:.3g} GiB float32, read + write, {args.calls} calls)",
  )  # fmt: skip


def worker_train_step(args):
  """``train_step_cost.py`` with ``args.argv``: its per-round ratios."""
  import train_step_cost

  out = train_step_cost.main(args.argv)
  ratios, cpu = out["ratios"], out["cpu_ratios"]
  med, cpu_med = statistics.median(ratios), statistics.median(cpu)
  return dict(
    wall_ratios=ratios, cpu_ratios=cpu, wall_ratio_median=med,
    cpu_ratio_median=cpu_med, times=out["times"],
    summary=f"fp16_scaling / plain optax, per round: wall {med:.3f}x, "
    f"process CPU {cpu_med:.3f}x ({len(ratios)} rounds)",
  )  # fmt: skip


# The kernels part: what gpu_kernels.py counts for the H100 target, at the
# first step_cost part's shape (its tiny one with --tiny), for its recipes.
KERNELS_FROM = "step_cost_500M_500_cb_on"


def worker_kernels(args):
  """``gpu_kernels.py``'s counts of ``PAIR`` compiled without a device for
  the H100 target at ``args.argv``'s shape (``PARAMS/LEAVES``), in this
  process (``JAX_PLATFORMS=cpu``); where the CUDA plugin is missing (a
  CPU machine), a summary that says so."""
  import step_cost

  _, (n, leaves) = step_cost.parse_shape(args.argv[0])
  try:
    import gpu_kernels

    gpu_kernels.devices("h100")
  except Exception as e:  # no jax-cuda12-plugin, or one that cannot load
    return dict(rows={}, summary=f"not measured: {type(e).__name__}: {e}")
  compile_one = functools.partial(
    gpu_kernels.compile_recipe, target="h100", size=n // leaves, leaves=leaves
  )
  rows = {key: compile_one(key) for key in PAIR}
  return dict(
    rows=rows, target="h100", shape=args.argv[0],
    summary="deviceless H100 kernels: " + ", ".join(
      f"{k} {r['kernels']:,}" for k, r in rows.items()),
  )  # fmt: skip


WORKERS = dict(env=worker_env, bandwidth=worker_bandwidth)
WORKERS.update(train_step=worker_train_step, kernels=worker_kernels)


def run_worker(argv):
  """``--worker NAME --result FILE [--bytes N] [--calls N] [-- ARGV]``:
  runs the worker NAME and writes what it returns to FILE as JSON."""
  p = argparse.ArgumentParser()
  p.add_argument("--worker", choices=sorted(WORKERS))
  p.add_argument("--result")
  p.add_argument("--bytes", type=int, default=2**31)
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("argv", nargs="*")
  args = p.parse_args(argv)
  with open(args.result, "w") as f:
    json.dump(WORKERS[args.worker](args), f, indent=1)
  return 0


def command(part, args, outdir):
  """(argv, the file its result lands in, or None)."""
  result = os.path.join(outdir, "parts", f"{part.name}.json")
  me = [sys.executable, os.path.abspath(__file__), "--worker", part.name]
  me += ["--result", result]
  if part.name == "env":
    return me, result
  if part.name == "bandwidth":
    size, calls = (8 * 2**20, 5) if args.tiny else (2**31, 20)
    return me + ["--bytes", str(size), "--calls", str(calls)], result
  if part.name == "kernels":
    source = BY_NAME[KERNELS_FROM]
    shape = source.tiny_shape if args.tiny else source.shape
    return me + ["--", shape], result
  if part.name == "train_step":
    sizes = "tiny --rounds 2 --inner 1 --warmup 0" if args.tiny else "medium"
    sizes += "" if args.tiny else " --rounds 10 --inner 5"
    return me + ["--", "--size", *sizes.split()], result
  if part.name == "tests":
    paths = args.tests or (
      list(TINY_TESTS) if args.tiny else ["tests", "fp16_scaling"]
    )
    cmd = [sys.executable, "-m", "pytest", "-v", "-ra", "-m", "not peers"]
    cmd += ["-p", "no:cacheprovider", *paths]
    cmd += [f"--ignore={p}" for p in TEST_IGNORES]
    workers = test_workers(args)
    return cmd + (["-n", str(workers)] if workers else []), None
  if part.shape:
    recipes = part_recipes(part)
    timing = "2 --warmup 0 --inner 2 --copy-mib 8"
    timing = timing if args.tiny else "10 --warmup 2 --inner 10"
    cmd = [sys.executable, os.path.join(HERE, "step_cost.py"), "--shape"]
    cmd += [part.tiny_shape if args.tiny else part.shape]
    cmd += ["--recipes", ",".join(recipes), "--repeats", *timing.split()]
    # --budget: seconds a compile may take before its row is given up.
    return cmd + ["--budget", "60", "--json", result], result
  raise KeyError(part.name)


def part_recipes(part):
  """A step_cost part's recipes, jmp left out where it is not installed."""
  jmp = importlib.util.find_spec("jmp") is not None
  return [r for r in part.recipes if r != "jmp" or jmp]


def test_workers(args):
  """The ``-n`` the tests part adds: ``--test-workers`` if given; else none
  where ``PYTEST_ADDOPTS`` already says how to run (``-n``,
  ``--numprocesses``, ``-p no:xdist``) or pytest-xdist is missing, and
  ``TEST_WORKERS`` on a GPU (the env part's backend, else ``nvidia-smi``
  on the PATH)."""
  if getattr(args, "test_workers", None) is not None:
    return args.test_workers
  addopts = os.environ.get("PYTEST_ADDOPTS", "")
  if re.search(r"(^|\s)(-n|--numprocesses|-p\s*no:xdist)", addopts):
    return 0
  if importlib.util.find_spec("xdist") is None:
    return 0
  backend = getattr(args, "backend", None)
  gpu = backend == "gpu" if backend else bool(shutil.which("nvidia-smi"))
  return TEST_WORKERS if gpu else 0


def part_env(part):
  env = dict(os.environ)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  )
  if part.name == "kernels":  # compiled for the H100 spec, on the CPU
    env["JAX_PLATFORMS"] = "cpu"
  if part.shape and not part.command_buffers:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CB_OFF).strip()
  return env


def run_part(part, cmd, env, limit, log_path):
  """(status, seconds, return code). The part runs in its own session, so
  that at its limit it is killed with every process it started."""
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    # fmt: off
    proc = subprocess.Popen(
      cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
      cwd=ROOT, env=env, start_new_session=True,
    )
    # fmt: on
    try:
      rc = proc.wait(timeout=max(limit, 0.01))
      status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      rc = proc.wait()
      status = "timed out"
  return status, time.monotonic() - t0, rc


# --------------------------------------------------------------------------
# Reading what a part left.

_OUTCOME = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
# ``pytest -v``: "ID OUTCOME [ 25%]"; under pytest-xdist: "[gw3] [ 25%]
# OUTCOME ID" (an id may hold spaces: "test_x[adamw+schedule 2]").
_TEST_LINE = re.compile(rf"^(\S+::\S.*?) ({_OUTCOME})\b")
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOME}) (\S.*?)\s*$")
# The short summary (-ra): "FAILED ID - message", "ERROR PATH - message".
_SHORT = re.compile(r"^(FAILED|ERROR) (\S+?(?:\[.*?\])?)(?: - .*)?$")
_CLOSING = re.compile(
  r"^=+ (.*\b(?:passed|failed|errors?|skipped)\b.* in .*?) =+$"
)
_COUNT = re.compile(r"(\d+) (\w+)")
_PLURALS = dict(errors="error", warnings="warning")


def read_tests(log_text):
  """Counts and failing ids of a pytest run, from its log: counts from the
  closing line ("20 failed, 567 passed, 1 skipped in 73.96s"), else (a run
  killed before it) from the ``-v`` lines that finished, with or without
  pytest-xdist; failing ids from the ``-v`` lines and the short summary's
  ``FAILED`` and ``ERROR`` lines (collection errors name a file)."""
  outcomes = {}
  for line in log_text.splitlines():
    m = _XDIST_LINE.match(line)
    if m:
      outcomes[m.group(2)] = m.group(1)
      continue
    m = _TEST_LINE.match(line)
    if m:
      outcomes[m.group(1)] = m.group(2)
      continue
    m = _SHORT.match(line)
    if m:  # a collection error is only here
      outcomes.setdefault(m.group(2), m.group(1))
  failing = [k for k, v in outcomes.items() if v in ("FAILED", "ERROR")]
  found = map(_CLOSING.match, log_text.splitlines())
  closing = [m.group(1) for m in found if m]
  if closing:
    words = _COUNT.findall(closing[-1].rsplit(" in ", 1)[0])
    counts = {_PLURALS.get(w, w): int(n) for n, w in words}
    counts.pop("warning", None)
  else:
    counts = dict(collections.Counter(v.lower() for v in outcomes.values()))
  summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
  return dict(
    counts=counts, failing=sorted(failing),
    summary=summary or "no test finished",
    pytest_summary=closing[-1] if closing else None,
  )  # fmt: skip


def read_step_cost(result, recipes=()):
  """Per recipe: step ms, per-round wall and CPU ratio to the floor, bytes
  (XLA's, and moved: step_cost's ``bytes_moved``), kernels, the bandwidth
  the bytes moved imply and its fraction of the run's copy bandwidth;
  ``table``, the markdown table of them (and a line naming those of
  ``recipes`` that the run did not reach)."""
  import _common as common
  import recipes as recipe_set

  rows, lines = {}, []
  copy = (result.get("copy_bandwidth") or {}).get("median_gb_s")
  for shape in result.get("shapes", []):
    lines += [
      f"Shape {shape['shape']}: {shape['params']:,} float32 params in "
      f"{shape['leaves']} leaves. Copy bandwidth in the same run: "
      + (f"{copy:,.1f} GB/s (median)." if copy else "not measured."),
      "",
      "| recipe | compile s | step ms | per round vs floor [quartiles] | "
      "bytes accessed | bytes moved | B/param moved | kernels (fusions) | "
      "GB/s | of copy |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in shape["rows"].items():
      if row.get("status") != "ok":
        rows[label] = dict(status=row.get("status"), shape=shape["shape"])
        lines.append(f"| {label} | {row.get('status')} |" + " – |" * 8)
        continue
      step, b = row["step_s_median"], row["bytes_accessed"]
      moved = row.get("bytes_moved") or b
      wall = row.get("wall_vs_floor_per_round")
      cpu = row.get("cpu_vs_floor_per_round")
      gb_s = moved / step / 1e9 if step else None
      # fmt: off
      rows[label] = r = dict(
        status="ok", shape=shape["shape"], step_ms=step * 1e3,
        cpu_ms=(row.get("cpu_s_median") or 0.0) * 1e3,
        wall_vs_floor=statistics.median(wall) if wall else None,
        cpu_vs_floor=statistics.median(cpu) if cpu else None,
        bytes_accessed=b, bytes_moved=moved, gb_s=gb_s,
        copy_fraction=gb_s / copy if gb_s and copy else None,
        compile_s=row["lower_s"] + row["compile_s"],
        kernels=row.get("kernels"), fusions=row.get("fusions"),
      )
      # fmt: on
      ratio = common.spread(wall) if wall else "–"
      cells = [f"{r['compile_s']:.1f}", f"{r['step_ms']:.3f}", ratio]
      cells += [f"{b:,.0f}", f"{moved:,.0f}", f"{moved / shape['params']:.1f}"]
      kernels = r["kernels"] and f"{r['kernels']:,} ({r['fusions']:,})"
      cells += [kernels or "–"]
      cells += [f"{gb_s:,.0f}" if gb_s else "–"]
      cells += [f"{r['copy_fraction']:.3f}" if r["copy_fraction"] else "–"]
      lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
  missing = [recipe_set.BY_KEY[k].label for k in recipes]
  missing = [label for label in missing if label not in rows]
  if missing and lines:
    lines.append("Not reached: " + "; ".join(missing) + ".")
  short = []
  for label, r in rows.items():
    name = label.split(" ", 1)[0].rstrip(".")
    if r["status"] != "ok":
      short.append(f"{name} {r['status']}")
    elif r["wall_vs_floor"] is not None:
      short.append(f"{name} {r['wall_vs_floor']:.3f}x, {r['gb_s']:,.1f} GB/s")
  short += [label.split(" ", 1)[0] + " not reached" for label in missing]
  return dict(
    rows=rows, table="\n".join(lines).strip(),
    summary="wall / floor, per round: " + ", ".join(short),
  )  # fmt: skip


def read_part(part, status, log_path, result_path):
  """What a part left: the tests' counts from its log; a step_cost part's
  rows from its JSON, which it rewrites after every row (so a part killed
  at its limit keeps the rows it timed); another part's JSON if it
  finished, else its log's last line."""
  with open(log_path, errors="replace") as f:
    log_text = f.read()
  if part.name == "tests":
    return read_tests(log_text)
  found = bool(result_path) and os.path.exists(result_path)
  if found and (part.shape or status == "ok"):
    with open(result_path) as f:
      result = json.load(f)
    if part.shape:
      return read_step_cost(result, part_recipes(part))
    return result
  tail = log_text.strip().splitlines()[-1:] or [""]
  return dict(summary=tail[0][:200])


def markdown(report):
  lines = [
    "# gpu_check",
    "",
    f"Command: `{report['command']}`",
    f"Started {report['started']}; "
    f"{'tiny sizes (smoke test); ' if report['tiny'] else ''}"
    f"total limit {report['total_limit_s']:g} s.",
  ]
  env = report["parts"]["env"].get("result", {})
  if env.get("summary"):
    lines.append(f"Machine: {env['summary']}.")
  lines += ["", "| part | status | seconds (limit) | result |"]
  lines.append("|---|---|---:|---|")
  for name, r in report["parts"].items():
    secs = "–"
    if r.get("seconds") is not None:
      secs = f"{r['seconds']:.1f} ({r['limit_s']:g})"
    summary = r.get("result", {}).get("summary", "")
    summary = summary.replace("|", "/").replace("\n", " ")
    lines.append(f"| {name} | {r['status']} | {secs} | {summary} |")
  for name, r in report["parts"].items():
    if r.get("result", {}).get("table"):  # read from step_cost's JSON
      flags = f"`XLA_FLAGS={r['xla_flags']}`" if r.get("xla_flags") else ""
      flags = flags or "XLA's default flags (command buffers on)"
      lines += ["", f"## {name}: {r['status']}, {flags}", ""]
      lines.append(r["result"]["table"])
  lines += kernels_table(report)
  failing = report["parts"]["tests"].get("result", {}).get("failing")
  if failing:
    lines += ["", "## Failing tests", ""] + [f"- `{t}`" for t in failing]
  return "\n".join(lines) + "\n"


def kernels_table(report):
  """Lines of the markdown: per recipe of ``PAIR``, the kernels of the
  real compile (the ``KERNELS_FROM`` part's) beside the deviceless
  compile's for the H100 target (the kernels part's); none where either
  is missing."""
  import recipes as recipe_set

  real = report["parts"][KERNELS_FROM].get("result", {}).get("rows", {})
  aot = report["parts"]["kernels"].get("result", {}).get("rows", {})
  pairs = [(k, real.get(recipe_set.BY_KEY[k].label), aot.get(k)) for k in PAIR]
  pairs = [(k, r, a) for k, r, a in pairs if r and r.get("kernels") and a]
  if not pairs:
    return []
  lines = ["", "## Kernels: this device's compile and the H100 target's", ""]
  lines += ["| recipe | kernels here | kernels, H100 target (no device) |"]
  lines.append("|---|---:|---:|")
  for key, r, a in pairs:
    lines.append(f"| {key} | {r['kernels']:,} | {a['kernels']:,} |")
  return lines


def write(report, outdir):
  path = os.path.join(outdir, "gpu_check.json")
  with open(path + ".tmp", "w") as f:
    json.dump(report, f, indent=1)
  os.replace(path + ".tmp", path)
  with open(os.path.join(outdir, "gpu_check.md"), "w") as f:
    f.write(markdown(report))


def select_parts(text, parser):
  chosen = []
  for word in (w.strip() for w in text.split(",")):
    names = [p.name for p in PARTS if p.name == word]
    if not names and word == "step_cost":
      names = [p.name for p in PARTS if p.shape]
    if not names:
      parser.error(
        f"unknown part {word!r}; choose from {list(BY_NAME)} or 'step_cost'"
      )
    chosen += [n for n in names if n not in chosen]
  return chosen


def parse_limit(text):
  name, _, secs = text.partition("=")
  if name not in BY_NAME:
    raise argparse.ArgumentTypeError(f"unknown part {name!r} in {text!r}")
  try:
    return name, float(secs)
  except ValueError:
    raise argparse.ArgumentTypeError(f"need PART=SECONDS: {text!r}") from None


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--worker"]:
    return run_worker(argv)
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add = parser.add_argument
  # fmt: off
  add("outdir", help="folder for the results (created)")
  add("--tiny", action="store_true", help="shrink every part to seconds on a "
      "CPU (the smoke test): 8 MiB copy, step_cost at 16K/16 and 4K/32 with "
      f"the same recipes, the tiny train step, {', '.join(TINY_TESTS)}")
  add("--parts", default=",".join(BY_NAME), help="comma-separated parts, run "
      f"in this order: {', '.join(BY_NAME)} ('step_cost': every step_cost "
      "part). Default: all")
  add("--limit", action="append", type=parse_limit, default=[],
      metavar="PART=SECONDS", help="a part's time limit (repeatable). "
      "Defaults: " + ", ".join(f"{p.name} {p.limit_s:g}" for p in PARTS))
  add("--tests", action="append", metavar="PATH", help="a pytest path or "
      "node id for the tests part, instead of the suite (repeatable)")
  add("--test-workers", type=int, metavar="N", help="pytest-xdist workers "
      f"for the tests part (0: none). Default: {TEST_WORKERS} on a GPU, none "
      "on a CPU or where PYTEST_ADDOPTS names -n")
  add("--total", type=float, default=TOTAL_S, help="seconds for the whole "
      f"run (default {TOTAL_S:g}); a part gets at most what is left")
  # fmt: on
  args = parser.parse_args(argv)
  chosen = select_parts(args.parts, parser)
  limits = {p.name: p.limit_s for p in PARTS}
  limits.update(dict(args.limit))
  outdir = os.path.abspath(args.outdir)
  os.makedirs(os.path.join(outdir, "logs"), exist_ok=True)
  os.makedirs(os.path.join(outdir, "parts"), exist_ok=True)

  # fmt: off
  report = dict(
    command="python3 benchmarks/gpu_check.py " + " ".join(argv),
    started=datetime.datetime.now().isoformat(timespec="seconds"),
    tiny=args.tiny, total_limit_s=args.total, python=sys.version.split()[0],
    xla_flags=os.environ.get("XLA_FLAGS", ""),
  )
  # fmt: on
  report["parts"] = {
    p.name: dict(status="not selected", what=p.what, limit_s=limits[p.name])
    for p in PARTS
  }
  write(report, outdir)
  start = time.monotonic()
  for part in (p for p in PARTS if p.name in chosen):
    entry = report["parts"][part.name]
    left = args.total - (time.monotonic() - start)
    if left < 2:
      entry.update(status="skipped", result=dict(summary="no time left"))
      write(report, outdir)
      continue
    limit = min(limits[part.name], left)
    cmd, result_path = command(part, args, outdir)
    env = part_env(part)
    log = os.path.join(outdir, "logs", f"{part.name}.log")
    print(f"gpu_check: {part.name} (limit {limit:g} s) ...", flush=True)
    status, secs, rc = run_part(part, cmd, env, limit, log)
    entry.update(status=status, seconds=secs, limit_s=limit, returncode=rc)
    entry.update(log=os.path.relpath(log, outdir), command=cmd)
    if part.shape:
      entry["xla_flags"] = env.get("XLA_FLAGS", "")
    entry["result"] = read_part(part, status, log, result_path)
    if part.name == "env":  # the tests part's workers depend on it
      args.backend = entry["result"].get("backend")
    if part.name == "tests" and status == "ok" and entry["result"]["failing"]:
      entry["status"] = "failed"
    print(
      f"gpu_check: {part.name}: {entry['status']} in {secs:.1f} s: "
      f"{entry['result'].get('summary', '')}",
      flush=True,
    )
    write(report, outdir)
  report["seconds"] = time.monotonic() - start
  write(report, outdir)
  print(f"gpu_check: wrote {outdir}/gpu_check.json and gpu_check.md")
  ok = all(report["parts"][n]["status"] == "ok" for n in chosen)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
