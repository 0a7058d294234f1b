"""What every benchmark here shares: the interleaved timer, the figures of a
compiled step, the copy bandwidth, per-round ratios, their quantiles and
the verdicts on them.

Importing it puts the repository root, benchmarks/ and examples/ on
``sys.path``, so a script benchmarks the checkout it lives in.
"""

import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE, os.path.join(ROOT, "examples")):
  if _path not in sys.path:
    sys.path.insert(0, _path)

SLACK = 5e-4  # the rounding of a printed ratio


def interleaved(units, rounds, warmup=0):
  """Interleaved rounds, the timer of every benchmark here: each of
  ``warmup`` untimed and ``rounds`` timed rounds calls every sample once.

  ``units`` is a list of units, each a list of ``(name, sample)`` pairs
  (``sample()`` measures once). The units' order rotates by one per round,
  so no unit always runs first or after the same neighbour; a unit's
  samples run back to back in alternating order, so their per-round ratio
  compares like with like (an A/B test). Returns ``{name: [measurement of
  each timed round]}``: item i of every list comes from round i.
  """
  out = {name: [] for unit in units for name, _ in unit}
  for rnd in range(warmup + rounds if units else 0):
    shift = rnd % len(units)
    for unit in units[shift:] + units[:shift]:
      for name, sample in unit if rnd % 2 == 0 else unit[::-1]:
        value = sample()
        if rnd >= warmup:
          out[name].append(value)
  return out


def stepper(fn, box, grads, calls=1, prepare=None):
  """A ``sample`` for :func:`interleaved`: ``calls`` donated steps
  ``fn(params, state, grads) -> (params, state)`` from the list ``box =
  [params, state]``, which it updates (samples of one box share it), each
  state made by ``prepare(state)`` if given; blocked on. It returns
  ``(wall, cpu)`` seconds per call (CPU: the process's, all threads)."""

  def sample():
    import jax

    p, s = box
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
      p, s = fn(p, prepare(s) if prepare else s, grads)
    jax.block_until_ready((p, s))
    box[:] = p, s
    return (time.perf_counter() - t0) / calls, (
      time.process_time() - c0
    ) / calls

  return sample


def split(samples):
  """``{name: [(wall, cpu)]}`` as ``({name: [wall]}, {name: [cpu]})``."""
  wall = {k: [w for w, _ in v] for k, v in samples.items()}
  return wall, {k: [c for _, c in v] for k, v in samples.items()}


def costs(compiled):
  """XLA's ``flops`` and ``bytes accessed`` of a compiled executable (NaN
  where the backend does not count them), as a dict in that order."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device
    cost = cost[0]
  nan = float("nan")
  return dict(
    flops=float(cost.get("flops", nan)),
    bytes_accessed=float(cost.get("bytes accessed", nan)),
  )


def copy_bandwidth(nbytes, calls=20):
  """The copy bandwidth of the default device: ``a * 1.0001``, jitted and
  donated, on ``nbytes`` of float32, ``calls`` times after one warm-up
  call. Returns ``median_gb_s`` and ``best_gb_s`` (read + write bytes over
  the median and the fastest call's time), ``bytes`` and ``seconds``."""
  import jax
  import jax.numpy as jnp

  n = max(nbytes // 4, 1)
  a = jnp.ones((n,), jnp.float32)
  scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
  a = scale(a).block_until_ready()  # compile and warm up
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    a = scale(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  del a
  med, best = (
    2 * n * 4 / t / 1e9 for t in (statistics.median(times), min(times))
  )
  return dict(median_gb_s=med, best_gb_s=best, bytes=n * 4, seconds=times)


def paired(xs, ys):
  """Per-round ratios: the rows of one round ran back to back, so their
  ratio cancels the drift between rounds that a ratio of medians keeps."""
  return [x / y for x, y in zip(xs, ys)]


def quantile(values, q):
  """The ``q`` quantile of ``values`` (the lower sample); None if empty."""
  if not values:
    return None
  v = sorted(values)
  return v[min(len(v) - 1, int(q * len(v)))]


def spread(ratios):
  """'1.012x [0.980x, 1.040x]': median [quartiles] of per-round ratios."""
  med = statistics.median(ratios)
  lo, hi = quantile(ratios, 0.25), quantile(ratios, 0.75)
  return f"{med:.3f}x [{lo:.3f}x, {hi:.3f}x]"


def judged(ratio, limit):
  """'ok' or 'MISS': one ratio (bytes, compile) against its ``limit``."""
  return "ok" if ratio <= limit + SLACK else "MISS"


def verdict(ratios, limit):
  """'1.012x [0.98x, 1.04x] ok (<= 1.03x)': :func:`spread` and the verdict
  on it: ok when the median is within ``limit``, MISS when even the lower
  quartile is above it, 'within noise, above' otherwise."""
  med, lo = statistics.median(ratios), quantile(ratios, 0.25)
  word = judged(med, limit)
  if word == "MISS" and lo <= limit + SLACK:
    word = "within noise, above"
  return f"{spread(ratios)} {word} (<= {limit}x)"


def machine():
  """One line naming jax, the backend, the device and the host."""
  import jax

  dev = jax.devices()[0]
  return (
    f"jax {jax.__version__}, backend {jax.default_backend()}, "
    f"device {dev.device_kind}, {os.cpu_count()} CPUs, "
    f"{platform.machine()}, Python {platform.python_version()}; "
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
