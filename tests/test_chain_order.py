"""The chain's order is read off its state, at ``init`` and again at every
``update``: each wrong order is an error that names the fix, not a silently
wrong step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

# True gradients of global norm 0.4; the loss scale is 2**10.
GRADS = {"w": jnp.array([0.24, 0.0]), "b": jnp.array([0.32])}
SCALE = 2.0**10
FIX = r"skip_on_overflow\(optax.chain\(fp16_loss_scale\(...\), "


def _scaler():
  return fs.static_scaler(SCALE)


def _step(tx):
  state = tx.init(GRADS)
  scaled = jax.tree.map(lambda g: g * SCALE, GRADS)
  return jax.jit(tx.update)(scaled, state, GRADS)


def test_the_right_order_applies_the_true_gradient():
  # The control for the tests below: the same pieces in the right order.
  tx = fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(_scaler()),
      fs.clip_by_unscaled_norm(1.0),
      optax.sgd(1.0),
    )
  )
  updates, state = _step(tx)
  np.testing.assert_allclose(updates["w"], [-0.24, 0.0], rtol=1e-6)
  np.testing.assert_allclose(updates["b"], [-0.32], rtol=1e-6)
  np.testing.assert_allclose(
    fs.scale_metrics(state)["grad_norm"], 0.4, rtol=1e-6
  )


def test_clip_before_loss_scale_is_refused():
  # Unchecked, this chain clipped the scaled gradients to a norm of 0.1 and
  # then divided them by the scale: it applied 0.1 / 2**10, not 0.1.
  tx = fs.skip_on_overflow(
    optax.chain(
      fs.clip_by_unscaled_norm(0.1),
      fs.fp16_loss_scale(_scaler()),
      optax.sgd(1.0),
    )
  )
  with pytest.raises(
    ValueError,
    match="clip_by_unscaled_norm comes before fp16_loss_scale.*" + FIX,
  ):
    _step(tx)


@pytest.mark.parametrize(
  "first",
  [optax.sgd(0.1), optax.adam(1e-3), optax.clip_by_global_norm(1.0)],
  ids=["sgd", "adam", "optax_clip"],
)
def test_transformation_before_loss_scale_is_refused(first):
  tx = fs.skip_on_overflow(
    optax.chain(first, fs.fp16_loss_scale(_scaler()), optax.sgd(1.0))
  )
  with pytest.raises(
    ValueError, match="fp16_loss_scale is not the first element.*front.*" + FIX
  ):
    _step(tx)


def test_update_checks_the_order_of_the_state_it_is_given():
  # A state assembled past init (here the wrong chain's, bypassing init's
  # check) is refused by the update too, eager or traced.
  wrong = optax.chain(optax.sgd(0.1), fs.fp16_loss_scale(_scaler()))
  state = wrong.init(GRADS)
  tx = fs.skip_on_overflow(wrong)
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(ValueError, match="Move fp16_loss_scale to the front"):
      update(GRADS, state)


def test_any_element_before_loss_scale_is_refused_even_an_identity():
  # The order is read off the chain's state, not off the arrays: an element
  # before fp16_loss_scale is refused whatever it does, optax.identity()
  # included (its state is optax.clip_by_global_norm's, EmptyState).
  tx = fs.skip_on_overflow(
    optax.chain(optax.identity(), fs.fp16_loss_scale(_scaler()))
  )
  with pytest.raises(ValueError, match="not the first element"):
    tx.init(GRADS)


def test_two_loss_scales_are_refused_at_init():
  tx = fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(_scaler()),
      fs.fp16_loss_scale(_scaler()),
      optax.sgd(1.0),
    )
  )
  with pytest.raises(ValueError, match="exactly one fp16_loss_scale.*found 2"):
    tx.init(GRADS)


def test_two_loss_scales_are_refused_when_traced():
  # Past init (a state assembled by hand), the update's check still holds.
  one = fs.fp16_loss_scale(_scaler())
  two = optax.chain(one, one)
  state = two.init(GRADS)
  with pytest.raises(ValueError, match="unscale gradients that are.*" + FIX):
    jax.jit(fs.skip_on_overflow(two).update)(GRADS, state)


def test_missing_wrapper_is_refused_at_the_first_update():
  tx = optax.chain(fs.fp16_loss_scale(_scaler()), fs.clip_by_unscaled_norm(1.0))
  state = tx.init(GRADS)
  with pytest.raises(RuntimeError, match="outside skip_on_overflow.*" + FIX):
    jax.jit(tx.update)(GRADS, state)
  with pytest.raises(RuntimeError, match="outside skip_on_overflow"):
    jax.eval_shape(tx.update, GRADS, state)


def test_wrappers_around_the_guard_keep_the_check_quiet():
  # A wrapper that traces the guarded update inside a lax.cond (as
  # optax.MultiSteps and optax.apply_if_finite do): the gradients
  # fp16_loss_scale receives are still the ones the guard received.
  guarded = fs.skip_on_overflow(
    optax.chain(fs.fp16_loss_scale(_scaler()), optax.sgd(1.0))
  )

  def update_fn(updates, state, params=None):
    run = lambda: guarded.update(updates, state, params)
    return jax.lax.cond(jnp.bool_(True), run, run)

  tx = optax.GradientTransformation(guarded.init, update_fn)
  state = tx.init(GRADS)
  scaled = jax.tree.map(lambda g: g * SCALE, GRADS)
  updates, state = jax.jit(tx.update)(scaled, state, GRADS)
  np.testing.assert_allclose(updates["b"], [-0.32], rtol=1e-6)


def test_a_nested_skip_gives_the_trajectory_of_one():
  """skip_on_overflow(skip_on_overflow(chain)), as a trainer that wraps what
  the user built does: the inner one finds its state handed on by the outer
  one and runs its chain; every step's updates and state are one skip's,
  bit for bit, over clean and overflowing steps."""
  import helpers  # noqa: PLC0415

  def chain():
    return optax.chain(
      fs.fp16_loss_scale(fs.torch_scaler(init_scale=8.0, growth_interval=2)),
      fs.clip_by_unscaled_norm(1.0),
      optax.adam(0.1),
    )

  one = fs.skip_on_overflow(chain())
  nested = fs.skip_on_overflow(fs.skip_on_overflow(chain()))
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  states = [tx.init(params) for tx in (one, nested)]
  assert helpers.bits(states[0]) == helpers.bits(states[1])
  steps = [jax.jit(tx.update) for tx in (one, nested)]
  for t, bad in enumerate([False, True, False, False, True, False]):
    grads = {"a": jnp.full(2, 8.0 + t), "b": jnp.full(3, -4.0)}
    if bad:
      grads["b"] = grads["b"].at[1].set(jnp.inf)
    out = [step(grads, s, params) for step, s in zip(steps, states)]
    assert helpers.bits(out[0]) == helpers.bits(out[1])
    states = [o[1] for o in out]
  assert int(fs.scale_metrics(states[1])["skipped_steps"]) == 2
