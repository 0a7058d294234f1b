"""The hand-off of the one measurement to clip_by_unscaled_norm.

skip_on_overflow hands its measurement of the gradients to a clip that
comes right after fp16_loss_scale in the chain (read off the chain's state),
and the clip reduces its sums. Pinned here from both sides: with any
element in between (an identity too), the clip is exactly a plain optax
clip of what it receives (oracle: optax's own chain) and measures it itself;
right after fp16_loss_scale, the step reads the gradients once, as plain
optax's does.
"""

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

SCALE = 2.0**9
PARAMS = {
  "w": jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(4, 6),
  "b": jnp.linspace(0.5, 2.0, 16, dtype=jnp.float32),
}
GRADS = {
  "w": jnp.cos(jnp.arange(24, dtype=jnp.float32)).reshape(4, 6),
  "b": jnp.sin(jnp.arange(16, dtype=jnp.float32)) * 0.5,
}
EXPERT_MASK = {"w": True, "b": False}

# Between the two: (transformation, whether the clip follows directly).
BETWEEN = {
  "scale": (lambda: optax.scale(2.0), False),
  "decayed_weights": (lambda: optax.add_decayed_weights(0.1), False),
  "identity": (optax.identity, False),
  "none": (None, True),
}


def _guarded(between, max_norm, expert_mask=None):
  parts = [] if between is None else [between()]
  parts.append(fs.clip_by_unscaled_norm(max_norm, expert_mask=expert_mask))
  return guarded(fs.static_scaler(SCALE), *parts)


def _oracle(between, max_norm):
  """Plain optax: unscale, the same transformation, optax's global clip."""
  parts = [optax.scale(1.0 / SCALE)]
  if between is not None:
    parts.append(between())
  parts.append(optax.clip_by_global_norm(max_norm))
  return optax.chain(*parts)


def _scaled(grads=GRADS, dtype=jnp.float32):
  return jax.tree.map(lambda g: (g * SCALE).astype(dtype), grads)


def _count_big_reductions(fn, *args):
  """Reductions over gradient-sized arrays (every leaf has >= 16 elements;
  the per-leaf partial sums that get combined are fewer) in the traced step,
  outside any lax.cond branch: the rare-case rescue is not a common step."""
  jaxpr = jax.make_jaxpr(fn)(*args)

  def walk(jaxpr):
    n = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "cond":
        continue
      name = eqn.primitive.name
      if name.startswith("reduce_") and any(
        np.prod(v.aval.shape) >= 16 for v in eqn.invars
      ):
        n += 1
      for p in eqn.params.values():
        for sub in p if isinstance(p, (list, tuple)) else [p]:
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            n += walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            n += walk(sub)
    return n

  return walk(jaxpr.jaxpr)


def _np_norm(tree):
  return float(
    np.sqrt(
      sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))
    )
  )


MAX_NORMS = (0.5, 1e9)


@pytest.fixture(scope="module")
def clip_updates():
  """``{(between, max_norm): (updates, state)}``: the guarded chain's update
  of ``_scaled()`` for every case below. One jit updates every case's chain
  (a jit each compiled again what the chains share)."""
  txs = {
    (between, max_norm): _guarded(BETWEEN[between][0], max_norm)
    for between in BETWEEN
    for max_norm in MAX_NORMS
  }

  @jax.jit
  def update_all(states, grads, params):
    return {c: tx.update(grads, states[c], params) for c, tx in txs.items()}

  states = {c: tx.init(PARAMS) for c, tx in txs.items()}
  return update_all(states, _scaled(), PARAMS)


@pytest.mark.parametrize("between", sorted(BETWEEN))
@pytest.mark.parametrize("max_norm", MAX_NORMS)
def test_the_clip_is_a_plain_clip_of_what_it_receives(
  between, max_norm, clip_updates
):
  make, _ = BETWEEN[between]
  oracle = _oracle(make, max_norm)
  updates, state = clip_updates[between, max_norm]
  expected, _ = oracle.update(_scaled(), oracle.init(PARAMS), PARAMS)
  for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  # The clip reports the norm of what it received, before clipping.
  received, _ = _oracle(make, 1e30).update(
    _scaled(), oracle.init(PARAMS), PARAMS
  )
  clip_state = state[-1]
  assert float(clip_state.grad_norm) == pytest.approx(
    _np_norm(received), rel=1e-6
  )


@pytest.mark.parametrize("max_norm", MAX_NORMS)
def test_one_multiply_by_inverse_times_factor_keeps_the_bits(
  max_norm, clip_updates
):
  # Right after fp16_loss_scale the clip multiplies the measured gradients
  # once, by the scale's inverse times its factor; with an identity between,
  # it multiplies the unscaled gradients by its factor. For a power-of-two
  # scale the norms agree exactly, and so do the updates, bit for bit.
  direct, _ = clip_updates["none", max_norm]
  two_multiplies, _ = clip_updates["identity", max_norm]
  for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(two_multiplies)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("between", sorted(BETWEEN))
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_the_gradients_are_read_once_exactly_when_the_clip_follows(
  between, dtype
):
  make, unchanged = BETWEEN[between]
  tx = _guarded(make, 1.0, expert_mask=EXPERT_MASK)
  leaves = len(jax.tree.leaves(GRADS))
  found = _count_big_reductions(
    lambda g, s, p: tx.update(g, s, p),
    _scaled(dtype=dtype),
    tx.init(PARAMS),
    PARAMS,
  )
  # One sum of squares per leaf from the skip's measurement; the clip adds
  # one per leaf only when something stands between it and fp16_loss_scale.
  assert found == (leaves if unchanged else 2 * leaves)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_one_pass_over_the_gradients_like_plain_optax(dtype):
  grads = jax.tree.map(lambda x: x.astype(dtype), GRADS)
  ours = fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(fs.torch_scaler()),
      fs.clip_by_unscaled_norm(1.0, expert_mask=EXPERT_MASK),
      optax.adamw(1e-3),
    )
  )
  floor = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

  def count(tx):
    step = lambda g, s, p: tx.update(g, s, p)
    return _count_big_reductions(step, grads, tx.init(PARAMS), PARAMS)

  assert count(floor) == len(jax.tree.leaves(grads))  # one sum per leaf
  assert count(ours) == count(floor)


def test_an_inf_made_in_between_is_applied_and_the_clip_passes_zeros():
  """docs/design.md, "The hand-off to the clip": a transformation in between
  that makes an inf from finite gradients. The pass of fp16_loss_scale saw
  none, so the step is applied (no overflow, the scale does not back off,
  the optimizer's count moves); the clip's own pass sees the inf and passes
  zeros, reporting no norm."""
  blow_up = optax.stateless(lambda u, p: jax.tree.map(lambda x: x * 1e38, u))
  scaler = fs.deepspeed_scaler(init_scale=SCALE)
  tx = guarded(scaler, blow_up, fs.clip_by_unscaled_norm(1.0), optax.adam(0.1))
  big = jax.tree.map(lambda g: g * 1e3, _scaled())
  state = tx.init(PARAMS)
  updates, state = jax.jit(tx.update)(big, state, PARAMS)
  assert not bool(fs.scale_metrics(state)["overflow"])
  assert float(fs.current_scale(state)) == SCALE
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(u, np.zeros_like(u))
  assert float(state[2].grad_norm) == 0.0  # the clip's own norm
  assert int(state[3][0].count) == 1  # Adam's step: applied, not skipped
