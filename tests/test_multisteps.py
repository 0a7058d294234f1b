"""optax.MultiSteps around fs.chain is refused, by the state's type.

The reason, shown on MultiSteps alone, and the refusal: every helper finds
the loss-scale state through one lookup, which raises for a LossScaleState
inside a MultiStepsState, so the first step that scales its loss fails with
a message naming accumulate_gradients. Wrapped the other way, or with no
MultiSteps, nothing is refused.
"""

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

PARAMS = {"w": jnp.zeros(2)}


def _guarded():
  scaler = fs.deepspeed_scaler(init_scale=2.0**10)
  return guarded(scaler, fs.clip_by_unscaled_norm(1.0), optax.sgd(1.0))


def test_why_multisteps_is_refused():
  """optax.MultiSteps alone (no loss scaling): one NaN microbatch stays in
  its accumulator for good; with skip_not_finite it vanishes uncounted."""
  nan, one = {"w": jnp.array([jnp.nan, 1.0])}, {"w": jnp.ones(2)}
  ms = optax.MultiSteps(optax.sgd(1.0), 2)
  state = ms.init(PARAMS)
  update = jax.jit(ms.update)
  for g in [nan, one] + [one] * 6:  # one bad window, then three clean ones
    updates, state = update(g, state, PARAMS)
  assert np.isnan(state.acc_grads["w"][0]) and np.isnan(updates["w"][0])
  ms = optax.MultiSteps(
    optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
  )
  state = ms.init(PARAMS)
  _, state = jax.jit(ms.update)(nan, state, PARAMS)
  assert int(state.mini_step) == 0 and not np.any(state.acc_grads["w"])


WRAPPERS = {
  "MultiSteps": lambda: optax.MultiSteps(_guarded(), 2),
  "skip_not_finite": lambda: optax.MultiSteps(
    _guarded(), 2, should_skip_update_fn=optax.skip_not_finite
  ),
  "chain in MultiSteps": lambda: optax.MultiSteps(
    optax.chain(_guarded()), 2
  ).gradient_transformation(),
}
HELPERS = {
  "current_scale": fs.current_scale,
  "scale_metrics": fs.scale_metrics,
  "overflow_report": fs.overflow_report,
  "scaler_state_dict": fs.scaler_state_dict,
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_every_helper_refuses_a_loss_scale_inside_multisteps(wrapper, helper):
  state = WRAPPERS[wrapper]().init(PARAMS)
  with pytest.raises(ValueError, match="accumulate_gradients"):
    HELPERS[helper](state)


def test_the_first_step_that_scales_its_loss_raises():
  tx = WRAPPERS["MultiSteps"]()
  state = tx.init(PARAMS)

  @jax.jit
  def step(params, state):
    def loss(p):
      return jnp.sum(p["w"] ** 2) * fs.current_scale(state)

    grads = jax.grad(loss)(params)
    return tx.update(grads, state, params)

  with pytest.raises(ValueError, match="MultiSteps"):
    step(PARAMS, state)


@pytest.mark.parametrize(
  "make",
  [
    _guarded,
    lambda: fs.accumulate_gradients(_guarded(), 2),
    # MultiSteps inside the guarded chain holds no loss-scale state.
    lambda: fs.chain(
      fs.fp16_loss_scale(fs.static_scaler(4.0)),
      optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation(),
    ),
  ],
  ids=["guarded", "accumulate_gradients", "MultiSteps inside"],
)
def test_without_the_loss_scale_inside_multisteps_nothing_is_refused(make):
  state = make().init(PARAMS)
  scale = float(fs.current_scale(state))
  assert scale in (4.0, 2.0**10)


# ------------------------------------- optax.apply_if_finite around fs.chain


def test_why_apply_if_finite_around_the_chain_is_refused():
  """Read past the lookup: apply_if_finite keeps fs.chain's state on each of
  its first max_consecutive_errors non-finite steps, so the scale stays at
  2^10 and skipped_steps at 0; the step it lets through is the first the
  scale sees, and backs it off once (DeepSpeed's rule, hysteresis 1)."""
  tx = optax.apply_if_finite(_guarded(), 3)
  state = tx.init(PARAMS)
  inf = {"w": jnp.array([jnp.inf, 1.0])}
  for _ in range(3):
    updates, state = tx.update(inf, state, PARAMS)
    assert float(state.inner_state[0].scaler.loss_scale) == 2.0**10
    assert int(state.inner_state[0].skipped_steps) == 0
  assert int(state.total_notfinite) == 3
  _, state = tx.update(inf, state, PARAMS)
  assert float(state.inner_state[0].scaler.loss_scale) == 2.0**9
  assert int(state.inner_state[0].skipped_steps) == 1


IF_FINITE = {
  "apply_if_finite": lambda: optax.apply_if_finite(_guarded(), 3),
  "accumulating": lambda: optax.apply_if_finite(
    fs.accumulate_gradients(_guarded(), 2), 3
  ),
  "in optax.chain": lambda: optax.chain(optax.apply_if_finite(_guarded(), 3)),
}


@pytest.mark.parametrize("wrapper", sorted(IF_FINITE))
@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_every_helper_refuses_a_loss_scale_inside_apply_if_finite(
  wrapper, helper
):
  state = IF_FINITE[wrapper]().init(PARAMS)
  with pytest.raises(ValueError, match="apply_if_finite") as e:
    HELPERS[helper](state)
  message = str(e.value)
  assert "use fs.chain(...) alone" in message
  assert "max_consecutive_errors=n" in message


def test_value_and_grad_refuses_apply_if_finite_before_the_first_step():
  """The step reads its scale through fs.value_and_grad: refused there, at
  trace time, before any update runs."""
  tx = IF_FINITE["apply_if_finite"]()
  state = tx.init(PARAMS)

  @jax.jit
  def step(params, state):
    loss = lambda p: jnp.sum(p["w"] ** 2)
    _, grads = fs.value_and_grad(loss, state)(params)
    return tx.update(grads, state, params)

  with pytest.raises(ValueError, match="optax.apply_if_finite's state"):
    step(PARAMS, state)


def test_apply_if_finite_inside_the_chain_holds_no_loss_scale_and_is_kept():
  tx = fs.chain(
    fs.fp16_loss_scale(fs.static_scaler(4.0)),
    optax.apply_if_finite(optax.sgd(1.0), 3),
  )
  state = tx.init(PARAMS)
  assert float(fs.current_scale(state)) == 4.0
