"""The chain's order is checked when it is built or traced: each wrong order
is an error that names the fix, not a silently wrong step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling import _guard

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
    ValueError, match="clip_by_unscaled_norm ran before fp16_loss_scale.*" + FIX
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
    ValueError, match="fp16_loss_scale received gradients.*front.*" + FIX
  ):
    _step(tx)


def test_eager_update_checks_the_order_too():
  tx = fs.skip_on_overflow(
    optax.chain(optax.sgd(0.1), fs.fp16_loss_scale(_scaler()))
  )
  state = tx.init(GRADS)
  with pytest.raises(ValueError, match="Move fp16_loss_scale to the front"):
    tx.update(GRADS, state)


def test_identity_before_loss_scale_is_accepted():
  # Only a transformation that changes the gradients is refused.
  tx = fs.skip_on_overflow(
    optax.chain(optax.identity(), fs.fp16_loss_scale(_scaler()))
  )
  updates, _ = _step(tx)
  np.testing.assert_array_equal(updates["b"], np.float32(0.32))


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
  # Past init (a state assembled by hand), the trace-time check still holds.
  one = fs.fp16_loss_scale(_scaler())
  two = optax.chain(one, one)
  with _guard.guarded():
    state = two.init(GRADS)
  with _guard.guarded() as guard:
    guard.receive(jax.tree.leaves(GRADS))
    with pytest.raises(ValueError, match="more than once.*" + FIX):
      two.update(GRADS, state)


def test_missing_wrapper_is_refused_at_init():
  tx = optax.chain(fs.fp16_loss_scale(_scaler()), fs.clip_by_unscaled_norm(1.0))
  with pytest.raises(RuntimeError, match="outside skip_on_overflow.*" + FIX):
    tx.init(GRADS)
  with pytest.raises(RuntimeError, match="outside skip_on_overflow"):
    jax.eval_shape(tx.init, GRADS)


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
