"""Overflow is what float16 can hold, whatever the compiler folds.

XLA:GPU may fold a float32 -> float16 -> float32 chain of converts into
nothing (``xla_allow_excess_precision``), so a gradient that overflowed its
cast to float16 can reach the library as a finite float32. The library
compares float16 gradients (their squares, in the norm's pass) with the
least magnitude float16 rounds to inf, 65520, which sends such values to inf
on every backend. XLA:CPU keeps the converts, so here the tests check the
values and that the comparison survives optimisation in the compiled step;
benchmarks/gpu_check.py runs the same tests on a GPU, where the folding
happens.
"""

import re

import helpers
from hlo import computations
from hlo import ops_feeding_output
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

_PARAMS = jnp.ones(3)


def _tx(scaler=None):
  return helpers.guarded(
    scaler or fs.static_scaler(1.0),
    fs.clip_by_unscaled_norm(1e9),
    optax.sgd(1.0),
  )


def _made_in_the_step(make):
  """A jitted step whose float16 gradients ``make(x)`` computes inside it."""
  tx = _tx()

  @jax.jit
  def step(x, state):
    updates, state = tx.update(make(x), state, _PARAMS)
    return updates, state

  return lambda x: step(x, tx.init(_PARAMS))


_MAKERS = {
  # A float32 value cast to float16: 8e5 is out of float16's range.
  "cast": lambda x: x.astype(jnp.float16),
  # float16 arithmetic: 300 * 300 = 9e4 overflows float16.
  "float16 multiply": lambda x: x.astype(jnp.float16) * jnp.float16(300.0),
  # The loss's gradient cast to float16 inside jax.grad, as a model that
  # computes in float16 makes it.
  "grad through a cast": lambda x: jax.grad(
    lambda p: jnp.sum((p * x).astype(jnp.float16).astype(jnp.float32))
  )(jnp.ones(3, jnp.float16)),
}
_BIG = {"cast": 8e5, "float16 multiply": 300.0, "grad through a cast": 8e5}


@pytest.mark.parametrize("how", sorted(_MAKERS))
def test_float16_overflow_made_inside_the_step_is_seen(how):
  step = _made_in_the_step(_MAKERS[how])
  updates, state = step(jnp.array([1.0, _BIG[how], 2.0]))
  m = fs.scale_metrics(state)
  assert bool(m["overflow"]) and int(m["skipped_steps"]) == 1
  np.testing.assert_array_equal(np.asarray(updates), -0.0)
  assert list(fs.overflow_report(state).nonfinite_leaves) == ["<root>"]
  # The same values one float16 ulp inside the range are clean.
  updates, state = step(jnp.array([1.0, 2.0, 3.0]))
  assert not bool(fs.scale_metrics(state)["overflow"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_wide_gradient_above_float16_max_is_not_an_overflow(dtype):
  grads = jnp.array([3e5, 4e5, 0.0], dtype)
  tx = _tx()
  updates, state = jax.jit(tx.update)(grads, tx.init(_PARAMS), _PARAMS)
  m = fs.scale_metrics(state)
  assert not bool(m["overflow"])
  # 3e5 and 4e5 are exact in bfloat16 to its 8 bits: 299008 and 399360.
  # float32 rounds their two squares and the sum (2 u on the sum, u after
  # the square root) and the square root (u, correctly rounded on XLA:CPU;
  # elsewhere SQRT_ULPS ulp, 2 u each, more).
  expected = np.linalg.norm(np.asarray(grads, np.float64))
  rtol = 2 * 2.0**-24 + (
    0 if helpers.on_cpu() else 2 * helpers.SQRT_ULPS * 2.0**-24
  )
  np.testing.assert_allclose(float(m["grad_norm"]), expected, rtol=rtol)
  np.testing.assert_array_equal(
    np.asarray(updates), -np.asarray(grads, np.float32)
  )


def test_float16_max_is_finite_and_the_next_rounding_step_is_not():
  # float16 rounds to nearest: 65519 rounds down to 65504, 65520 up to inf.
  cast = _made_in_the_step(lambda x: x.astype(jnp.float16))
  for value, overflow in [(65504.0, False), (65519.0, False), (65520.0, True)]:
    _, state = cast(jnp.array([value, 0.0, 0.0]))
    assert bool(fs.scale_metrics(state)["overflow"]) == overflow, value


def test_subnormal_float16_gradients_keep_their_norm():
  # A rounding to float16's normal range would flush float16 subnormals to
  # zero; the detection must not: a gradient float16 holds keeps every bit
  # in the norm.
  tiny = np.array([2.0**-24, 3 * 2.0**-20, 2.0**-15], np.float16)
  tx = _tx()
  _, state = jax.jit(tx.update)(jnp.asarray(tiny), tx.init(_PARAMS), _PARAMS)
  # The squares (2**-48, 9 * 2**-40, 2**-30) and their sum, 264449 *
  # 2**-48, are exact in float32: only the square root rounds, correctly on
  # XLA:CPU (numpy's value), within SQRT_ULPS ulp of it elsewhere.
  expected = np.float32(np.linalg.norm(tiny.astype(np.float64)))
  off = helpers.ulps(fs.scale_metrics(state)["grad_norm"], expected)
  assert off <= (0 if helpers.on_cpu() else helpers.SQRT_ULPS)


def _overflow_index(tx, params, grads):
  """The flat output index of ``LossScaleState.overflow`` in ``step``'s
  outputs, and the compiled donated step."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  marked = jax.tree.map(lambda _: False, (params, state))
  ls = fs.LossScaleState
  marked = jax.tree.map(
    lambda x: x._replace(overflow=True) if isinstance(x, ls) else x,
    marked,
    is_leaf=lambda x: isinstance(x, ls),
  )
  index = jax.tree.leaves(marked).index(True)
  compiled = (
    jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  )
  return index, compiled.as_text()


def _threshold_compares(text, lines):
  """The ``compare`` instructions among ``lines`` that compare a value with
  65520**2 (broadcast or not), the square of the least magnitude float16
  rounds to inf."""
  named = {i["name"]: i for c in computations(text).values() for i in c}
  square = np.float32(65520.0**2)

  def is_threshold(name):
    inst = named.get(name)
    while inst is not None and inst["op"] == "broadcast":
      inst = named.get(inst["operands"][0])
    if inst is None or inst["op"] != "constant":
      return False
    value = re.search(r"constant\(([^)]+)\)", inst["line"]).group(1)
    try:
      return np.float32(float(value)) == square
    except ValueError:  # an array constant
      return False

  return [
    line
    for line in lines
    if " compare(" in line
    and any(is_threshold(name) for name in re.findall(r"%([\w.\-]+)", line))
  ]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32, jnp.bfloat16])
def test_the_detection_op_survives_optimisation_for_float16_only(dtype):
  params = [jnp.zeros(64), jnp.zeros((8, 8))]
  grads = [jnp.ones(64, dtype), jnp.ones((8, 8), dtype)]
  index, text = _overflow_index(
    _tx(fs.deepspeed_scaler(init_scale=2.0**8)), params, grads
  )
  feeding = _threshold_compares(text, ops_feeding_output(text, index))
  everywhere = _threshold_compares(text, text.splitlines())
  if dtype == jnp.float16:
    # On the path to the overflow flag: one per gradient leaf.
    assert len(feeding) >= len(grads), feeding
  else:
    assert not everywhere, everywhere


def test_accumulation_sees_a_cast_overflow_in_any_microbatch():
  tx = fs.accumulate_gradients(_tx(fs.torch_scaler(init_scale=2.0**4)), 2)

  @jax.jit
  def step(x, state):
    updates, state = tx.update(x.astype(jnp.float16), state, _PARAMS)
    return updates, state

  state = tx.init(_PARAMS)
  _, state = step(jnp.array([1.0, 8e5, 2.0]), state)  # the bad microbatch
  updates, state = step(jnp.array([1.0, 2.0, 3.0]), state)
  m = fs.scale_metrics(state)
  assert bool(m["window_ended"]) and bool(m["overflow"])
  assert float(m["loss_scale"]) == 8.0  # backed off once
  np.testing.assert_array_equal(np.asarray(updates), -0.0)
