"""``flax_scaler`` against Flax's own ``DynamicScale``, bit for bit.

Flax is a peer like DeepSpeed, torch and Megatron, but it needs no PyTorch:
this file lives in tests/ rather than tests/peers/ so that it runs in the
fast loop (``pytest -m "not peers"``) and in the newest-JAX CI run with the
newest Flax, where a change in Flax would show.

``CONFIGS`` random configurations (factors that are and are not float32
values, interval, initial scale, floor) each drive ``SEQUENCES_PER_CONFIG``
random sequences of ``STEPS`` gradients whose magnitudes span 10**-4 to
10**2, with NaN, +inf or -inf injected at a random rate. Flax runs
``DynamicScale.value_and_grad``; ours runs the guarded chain on the gradients
of ``loss * current_scale(state)``.
Both see the same float32 products ``g * scale``, so they overflow on the same
steps, naturally at large scales as well as on the injected values. After
every step the skip decision and the scale must agree bit for bit, until Flax
clamps a growth to float32's maximum: there ours refuses the growth (the
designed difference), and the sequence stops being compared.
"""

import dataclasses
import inspect

from helpers import F32_MAX
from helpers import SEED
from helpers import TINY
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")

CONFIGS = 8
SEQUENCES_PER_CONFIG = 5  # vmapped; one compile for every configuration
STEPS = 300
SIZE = 3  # gradient elements
GROWTH = (2.0, 4.0, 1.5, 1.1)  # 1.1 is not a float32
BACKOFF = (0.5, 0.25, 0.75, 0.3)  # nor is 0.3


def _config(rng):
  scale = 2.0 ** int(rng.integers(-20, 120)) * float(rng.choice([1, 3, 5]))
  return dict(
    growth_factor=float(rng.choice(GROWTH)),
    backoff_factor=float(rng.choice(BACKOFF)),
    growth_interval=int(rng.integers(1, 30)),
    scale=scale,
    minimum_scale=float(rng.choice([TINY, 2.0**-40, min(1.0, scale)])),
  )


def _gradients(rng):
  """[SEQUENCES_PER_CONFIG, STEPS, SIZE] float32 gradients."""
  shape = (SEQUENCES_PER_CONFIG, STEPS, SIZE)
  magnitude = 10 ** rng.uniform(-4, 2, size=shape[:2] + (1,))
  grads = (rng.uniform(-1, 1, size=shape) * magnitude).astype(np.float32)
  rate = 10 ** rng.uniform(-2.5, -0.5, size=(shape[0], 1))
  bad = rng.random(shape[:2]) < rate
  n = int(bad.sum())
  seq, step = np.nonzero(bad)
  grads[seq, step, rng.integers(SIZE, size=n)] = rng.choice(
    [np.nan, np.inf, -np.inf], size=n
  )
  return grads


def _top_sequence():
  # Tiny gradients, no overflow, short interval: the scale must reach the top.
  cfg = dict(
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=1,
    scale=2.0**100,
    minimum_scale=TINY,
  )
  return cfg, np.full((1, STEPS, SIZE), 1e-6, np.float32)


def _loss(p, g):
  return jnp.vdot(p, g)


def _run_all(cfgs, grads, run):
  """``run(cfg, p, g)`` of every configuration, vmapped over its sequences:
  one jit compiles them all (a jit per configuration spent most of its time
  on the fixed cost of each compile)."""
  p = jnp.zeros(SIZE, jnp.float32)

  def run_all(grads):
    out = []
    for cfg, g in zip(cfgs, grads):

      def run_one(g, cfg=cfg):
        return run(cfg, p, g)

      out.append(jax.vmap(run_one)(g))
    return out

  return jax.jit(run_all)(grads)


def _flax_run(cfgs, grads):
  """Flax's scales and finite flags, per configuration."""

  def run(cfg, p, g):
    def step(ds, g):
      ds, finite, _, _ = ds.value_and_grad(_loss)(p, g)
      return ds, (ds.scale, finite)

    return jax.lax.scan(step, _flax_state(cfg), g)[1]

  return _run_all(cfgs, grads, run)


def _ours_run(cfgs, grads):
  """Ours, as :func:`_flax_run`: the scales and overflow flags."""

  def run(cfg, p, g):
    tx = fs.chain(fs.fp16_loss_scale(fs.flax_scaler(**cfg)), optax.sgd(0.1))

    def step(state, g):
      scale = fs.current_scale(state)
      scaled = jax.grad(lambda p: _loss(p, g) * scale)(p)
      _, state = tx.update(scaled, state, p)
      m = fs.scale_metrics(state)
      return state, (m["loss_scale"], m["overflow"])

    return jax.lax.scan(step, tx.init(p), g)[1]

  return _run_all(cfgs, grads, run)


def _flax_state(cfg):
  # The scale as a float32 array, as Flax holds it after its first step.
  return dynamic_scale.DynamicScale(
    growth_factor=cfg["growth_factor"],
    backoff_factor=cfg["backoff_factor"],
    growth_interval=cfg["growth_interval"],
    fin_steps=jnp.int32(0),
    scale=jnp.float32(cfg["scale"]),
    minimum_scale=cfg["minimum_scale"],
  )


def test_scales_match_flax_dynamic_scale_bit_for_bit():
  rng = np.random.default_rng([SEED, 7])
  runs = [(_config(rng), _gradients(rng)) for _ in range(CONFIGS)]
  runs.append(_top_sequence())
  tally = dict(steps=0, overflows=0, growths=0, back_offs=0, tops=0)
  cfgs, all_grads = zip(*runs)
  flax_runs = _flax_run(cfgs, all_grads)
  ours_runs = _ours_run(cfgs, all_grads)
  for index, (cfg, grads) in enumerate(runs):
    flax_scales, flax_finite = map(np.asarray, flax_runs[index])
    ours_scales, ours_overflow = map(np.asarray, ours_runs[index])
    for seq in range(len(grads)):
      where = f"configuration {index} {cfg}, sequence {seq}"
      flax_scale, finite = flax_scales[seq], flax_finite[seq]
      ours_scale, overflow = ours_scales[seq], ours_overflow[seq]
      top = np.flatnonzero(flax_scale == np.float32(F32_MAX))
      end = int(top[0]) if top.size else STEPS
      np.testing.assert_array_equal(overflow[:end], ~finite[:end], where)
      np.testing.assert_array_equal(ours_scale[:end], flax_scale[:end], where)
      if end < STEPS:
        # Flax clamped a growth to float32's maximum; ours refused it.
        before = ours_scale[end - 1] if end else np.float32(cfg["scale"])
        assert ours_scale[end] == before and not overflow[end], where
        tally["tops"] += 1
      prev = np.concatenate([[np.float32(cfg["scale"])], flax_scale[:-1]])
      now, prev, clean = flax_scale[:end], prev[:end], finite[:end]
      tally["steps"] += end
      tally["overflows"] += int((~clean).sum())
      tally["growths"] += int((clean & (now > prev)).sum())
      tally["back_offs"] += int((~clean & (now < prev)).sum())
  # The comparison is not vacuous: every kind of event happened.
  assert tally["steps"] > CONFIGS * SEQUENCES_PER_CONFIG * STEPS // 2, tally
  assert tally["overflows"] > 300 and tally["back_offs"] > 300, tally
  assert tally["growths"] > 300 and tally["tops"] >= 1, tally


def test_defaults_are_dynamic_scale_defaults():
  ours = fs.flax_scaler()
  theirs = dynamic_scale.DynamicScale()
  assert ours.growth_factor == theirs.growth_factor
  assert ours.backoff_factor == theirs.backoff_factor
  # Flax compares its counter before counting the step.
  assert ours.growth_interval == theirs.growth_interval + 1
  assert ours.init_scale == float(theirs.scale)
  assert ours.min_scale == float(theirs.minimum_scale)


def test_argument_names_and_defaults_are_dynamic_scale_fields():
  fields = {
    f.name: f.default
    for f in dataclasses.fields(dynamic_scale.DynamicScale)
    if f.name != "fin_steps"  # Flax's step counter, not a setting
  }
  params = inspect.signature(fs.flax_scaler).parameters
  assert set(params) == set(fields)
  for name, p in params.items():
    assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
    assert p.default == fields[name], name
