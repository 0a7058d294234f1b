"""Misuses met when porting PyTorch AMP recipes, one test each.

Each docstring says what the library does about it: refuses it loudly, or
leaves no place to write it when the gradients come from
``fs.value_and_grad`` (the helper multiplies by the state's scale, once,
inside the step; ``tx.update`` divides by it, once; ``accumulate_gradients``
takes the window's mean). Where the library cannot tell a misused gradient
from a good one, the test shows what the misuse does (the factor by which
the update is off, derived by hand) and that the helper's gradients, passed
to ``tx.update`` as they are, give plain optax's update on the true
gradients. Scales are powers of two and sgd is linear in the gradient, so
the factors are exact.
"""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

PARAMS = {
  "w": jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]),
  "b": jnp.array([0.125, -0.25]),
}
LR = 0.5
S0 = 2.0**10


def loss(params, x, y):
  return jnp.mean((x @ params["w"].T + params["b"] - y) ** 2)


def _batch(i):
  kx, ky = jax.random.split(jax.random.PRNGKey(i))
  return jax.random.normal(kx, (4, 3)), jax.random.normal(ky, (4, 2))


TX = helpers.guarded(
  fs.torch_scaler(init_scale=S0, growth_interval=2), optax.sgd(LR)
)
PLAIN = optax.sgd(LR)
MAX_NORM = 0.25  # below every batch's true norm: the clip binds
TX_CLIP = helpers.guarded(
  fs.torch_scaler(init_scale=S0),
  fs.clip_by_unscaled_norm(MAX_NORM),
  optax.sgd(LR),
)
PLAIN_CLIP = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.sgd(LR))

true_grads = jax.jit(jax.grad(loss))


@jax.jit
def plain_update(grads, params):
  return PLAIN.update(grads, PLAIN.init(params), params)[0]


@jax.jit
def update(grads, state, params):
  """``TX.update`` of gradients made however the caller made them."""
  return TX.update(grads, state, params)


@jax.jit
def helper_step(params, state, x, y):
  """The step as the helper has it: its gradients go to tx.update as they
  are."""
  _, grads = fs.value_and_grad(loss, state)(params, x, y)
  updates, state = TX.update(grads, state, params)
  return grads, updates, state


def _close(a, b, factor=1.0):
  """``a == factor * b`` leaf by leaf, to float32 rounding."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x), factor * np.asarray(y), rtol=1e-6, atol=1e-9
    )


def test_a_scale_read_once_outside_the_step_and_closed_over():
  """Misuse (1): the scale read once on the host and closed over, where
  torch reads ``scaler.scale(loss)`` anew every step: the step keeps
  differentiating at that scale while ``tx.update`` divides by the current
  one, so after the first back-off every update is off by the scale's
  ratio. Refused loudly through the helper: ``fs.value_and_grad`` built
  from a state outside the step raises ValueError when the jitted step
  calls it. (Built in the step but outside a lax.scan body that carries
  the state, it is not refused: JAX's public API cannot tell the two traces
  apart, so the docstring says to build it where the state is, as
  test_value_and_grad.py's scan-body test does.) Built inside the step, it
  follows the scale as it moves."""
  # The refusal, and the helper built in the step following the scale as
  # it moves: test_value_and_grad.py. What the refusal prevents, written
  # without the helper: after an overflow halves the scale, the closed-over
  # S0 makes the update twice the true one.
  state = TX.init(PARAMS)
  x, y = _batch(0)
  s = float(fs.current_scale(state))
  _, state_after = update(
    jax.tree.map(lambda p: jnp.full(p.shape, jnp.inf), PARAMS), state, PARAMS
  )
  assert float(fs.current_scale(state_after)) == s / 2
  closed_over = jax.grad(lambda p: loss(p, x, y) * s)(PARAMS)
  updates, _ = update(closed_over, state_after, PARAMS)
  _close(updates, plain_update(true_grads(PARAMS, x, y), PARAMS), 2.0)


def test_forgetting_the_multiply_by_the_scale():
  """Misuse (2): ``jax.grad(loss)`` straight into ``tx.update``, the
  ``scaler.scale(loss)`` of the torch loop dropped. The library cannot
  refuse it (a gradient made at scale 1 is an array like any other): the
  update comes out divided by S, and float16 gradients would underflow.
  Impossible through the helper: ``fs.value_and_grad`` multiplies by the
  state's scale itself, and its gradients go to ``tx.update`` as they are,
  giving plain optax's update."""
  state = TX.init(PARAMS)
  x, y = _batch(1)
  true = true_grads(PARAMS, x, y)
  plain = plain_update(true, PARAMS)

  updates, _ = update(true, state, PARAMS)  # the misuse
  _close(updates, plain, 1 / S0)

  grads, updates, _ = helper_step(PARAMS, state, x, y)
  _close(grads, true, S0)  # the multiply is the helper's
  _close(updates, plain)


def test_multiplying_by_the_scale_twice():
  """Misuse (3): the loss scaled by hand and the gradients scaled again
  (``scaler.scale(loss)`` kept, plus the scale a JAX port multiplies in):
  the update is S times the true one, and the scaled gradients overflow
  float16 S times sooner. The library cannot refuse it. Impossible through
  the helper as long as ``fun`` is the plain loss: no multiply is left in
  the caller's code, and the helper's gradients give plain optax's update.
  A ``fun`` that multiplies by ``fs.current_scale`` of the helper's state
  is refused when it runs (issue 48), naming the fix; one that multiplies
  by a number it holds (``loss * 65536.0``) is not detected: its value
  comes back S times the loss, the one sign of it."""
  state = TX.init(PARAMS)
  x, y = _batch(2)
  true = true_grads(PARAMS, x, y)
  plain = plain_update(true, PARAMS)

  twice = jax.tree.map(
    lambda g: g * S0, jax.grad(lambda p: loss(p, x, y) * S0)(PARAMS)
  )
  updates, _ = update(twice, state, PARAMS)
  _close(updates, plain, S0)

  grads, updates, _ = helper_step(PARAMS, state, x, y)
  _close(grads, true, S0)  # once
  _close(updates, plain)

  def scaled_fun(p, x, y):
    return loss(p, x, y) * fs.current_scale(state)

  with pytest.raises(ValueError) as e:
    fs.value_and_grad(scaled_fun, state)(PARAMS, x, y)
  assert "fs.current_scale: read inside the fun" in str(e.value)
  assert "Return the unscaled loss from fun" in str(e.value)

  @jax.jit
  def jitted(state, x, y):
    def fun(p, x, y):
      return loss(p, x, y) * fs.current_scale(state)

    return fs.value_and_grad(fun, state)(PARAMS, x, y)

  with pytest.raises(ValueError, match="scaled twice"):
    jitted(state, x, y)
  # Outside fun the scale reads as before (the stack is empty again).
  assert float(fs.current_scale(state)) == S0

  def by_number(p, x, y):
    return loss(p, x, y) * S0

  value, grads = fs.value_and_grad(by_number, state)(PARAMS, x, y)
  assert float(value) == pytest.approx(S0 * float(loss(PARAMS, x, y)))
  _close(grads, true, S0 * S0)


def test_dividing_the_loss_by_k_under_accumulate_gradients():
  """Misuse (4): torch's accumulation recipe, ``loss / iters_to_accumulate``
  on every microbatch, kept under ``accumulate_gradients``, which takes the
  window's mean itself: the update is K times too small (with sgd). The
  library cannot refuse it (a divided loss is a loss). Through the helper
  no K appears: ``fun`` is the plain loss, and the window's update is plain
  optax's on the mean of the K microbatches' true gradients."""
  k = 4
  tx = fs.accumulate_gradients(
    helpers.guarded(fs.torch_scaler(init_scale=S0), optax.sgd(LR)), k
  )

  @jax.jit
  def step(params, state, x, y, divide):
    def fun(p, x, y):
      return loss(p, x, y) / jnp.where(divide, k, 1)

    _, grads = fs.value_and_grad(fun, state)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return updates, state

  batches = [_batch(10 + j) for j in range(k)]
  mean = jax.tree.map(
    lambda *g: sum(g) / k, *[true_grads(PARAMS, x, y) for x, y in batches]
  )
  plain = plain_update(mean, PARAMS)
  for divide, factor in [(False, 1.0), (True, 1 / k)]:
    state = tx.init(PARAMS)
    for x, y in batches:
      updates, state = step(PARAMS, state, x, y, divide)
    assert bool(fs.scale_metrics(state)["window_ended"])
    _close(updates, plain, factor)


def test_unscaling_by_hand_before_tx_update():
  """Misuse (5): torch's ``scaler.unscale_(optimizer)`` habit (unscale,
  then clip): the gradients divided by S before ``tx.update``, which
  divides by S again, so the update is off by 1/S and the clip measures a
  norm S times too small. The library cannot refuse it. Impossible through
  the helper: its gradients go to ``tx.update`` as they are, and the chain
  clips by the unscaled norm itself, so the update is plain optax's
  clip_by_global_norm and sgd on the true gradients."""
  state = TX_CLIP.init(PARAMS)
  x, y = _batch(3)
  true = true_grads(PARAMS, x, y)
  assert float(optax.tree.norm(true)) > MAX_NORM  # the clip binds
  plain = PLAIN_CLIP.update(true, PLAIN_CLIP.init(PARAMS), PARAMS)[0]

  @jax.jit
  def step(params, state, x, y, unscale_by_hand):
    _, grads = fs.value_and_grad(loss, state)(params, x, y)
    inv = 1 / fs.current_scale(state)
    grads = jax.tree.map(
      lambda g: jnp.where(unscale_by_hand, g * inv, g), grads
    )
    return TX_CLIP.update(grads, state, params)[0]

  _close(step(PARAMS, state, x, y, False), plain)
  # By hand: the chain sees |g| / S, far below MAX_NORM, so it does not
  # clip, and sgd moves by LR * g / S.
  misused = step(PARAMS, state, x, y, True)
  _close(misused, plain_update(true, PARAMS), 1 / S0)


def _grown_run(make_grads, steps=10):
  """A torch scaler from 2^16 growing every clean step, fed
  ``make_grads(state)`` for ``steps`` steps: the final state."""
  tx = helpers.guarded(
    fs.torch_scaler(init_scale=2.0**16, growth_interval=1), optax.sgd(LR)
  )
  state = tx.init(PARAMS)
  step = jax.jit(lambda g, s: tx.update(g, s, PARAMS)[1])
  for _ in range(steps):
    state = step(make_grads(state), state)
  return state


def test_a_scale_that_grew_with_no_overflow_names_unscaled_gradients():
  """Issue 48: float16 gradients never multiplied by the scale (a float16
  loss through ``jax.grad``) never overflow, so the scale climbs, here
  2^16 -> 2^26 in 10 clean steps, with no skip and updates 2^26 times too
  small. Past 2^24 with no overflow since init, the metrics and the
  report say so (read from the counters), naming fs.value_and_grad. The
  same gradients made at the scale overflow float16 at once (|g| of 1 at
  2^16 is past 65504), so the scaler backs off and the flag stays
  False; and at init (no step yet) it is False too."""
  x, y = _batch(4)
  true = true_grads(PARAMS, x, y)
  assert float(optax.tree.norm(true)) > 1.0  # some |g| near 1

  def unscaled(state):
    return jax.tree.map(lambda g: g.astype(jnp.float16), true)

  def at_scale(state):
    s = fs.current_scale(state)
    return jax.tree.map(lambda g: (g * s).astype(jnp.float16), true)

  state = _grown_run(unscaled)
  m = fs.scale_metrics(state)
  assert float(m["loss_scale"]) == 2.0**26 and int(m["skipped_steps"]) == 0
  assert bool(m["suspect_unscaled_grads"])
  report = fs.overflow_report(state)
  assert report.suspect_unscaled_grads
  text = str(report)
  assert "reached 2^26 with no overflow since the state was built" in text
  assert "fs.value_and_grad(loss_fn, opt_state)" in text

  state = _grown_run(at_scale)
  assert int(fs.scale_metrics(state)["skipped_steps"]) > 0
  assert not bool(fs.scale_metrics(state)["suspect_unscaled_grads"])
  assert not fs.overflow_report(state).suspect_unscaled_grads
  fresh = helpers.guarded(fs.deepspeed_scaler(), optax.sgd(LR)).init(PARAMS)
  assert float(fs.current_scale(fresh)) == 2.0**32  # above 2^24, no step
  assert not bool(fs.scale_metrics(fresh)["suspect_unscaled_grads"])


def test_small_float16_gradients_made_at_the_scale_raise_the_flag_too():
  """What the flag cannot tell (docs/diagnostics.md): float16 gradients
  made at the scale whose every |g| is below 2^-8 do not overflow at 2^24
  either. Here |g| <= 2^-10 made at the scale: the flag is raised at 2^26
  with no skip, as for unscaled gradients; the advice says that then there
  is nothing to do."""
  small = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-10), PARAMS)

  def at_scale(state):
    s = fs.current_scale(state)
    return jax.tree.map(lambda g: (g * s).astype(jnp.float16), small)

  state = _grown_run(at_scale)
  assert int(fs.scale_metrics(state)["skipped_steps"]) == 0
  assert bool(fs.scale_metrics(state)["suspect_unscaled_grads"])
  assert "they are only small (below 2^-8): nothing to do" in str(
    fs.overflow_report(state)
  )
