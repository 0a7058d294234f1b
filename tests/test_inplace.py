"""The skip's early selects: same values as a select after the update, and a
donated step that XLA runs in place, with no more memory traffic than plain
optax."""

from helpers import bits as _bits
from helpers import strip_bookkeeping as _inner
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling import _guard
from fp16_scaling import _inplace
from fp16_scaling._clipping import ClipState
from fp16_scaling._loss_scale import LossScaleState

U, S, K, F = (
  _inplace.UPDATE,
  _inplace.SELECT,
  _inplace.KEEP,
  _inplace.OVERFLOW,
)


def _run(fn, args, labels, olds_of_args):
  """call_selecting with fixed labels; ``olds_of_args(args)`` gives olds."""

  def jitted(*args):
    return _inplace.call_selecting(
      fn, args, lambda _: (labels, olds_of_args(args))
    )

  return jax.jit(jitted)(*args)


def _toy(x, a, b, flag):
  # Outputs: (update, a_new, b_new, shared_1, shared_2, passed, book, flag)
  early = a + 1.0  # a state leaf computed before the flag exists
  flag = flag | jnp.isnan(x).any()
  b_new = b * 2.0 + x
  update = early * b_new  # reads two new state leaves
  book = b_new + 0.5  # bookkeeping must see the unselected b_new
  shared = x * 3.0  # one value returned as two state leaves
  return update, early, b_new, shared, shared, a, book, flag


_LABELS = [U, S, S, S, S, S, K, F]


def _olds(args):
  x, a, b, _ = args
  return [None, a, b, a, b, a, None, None]


@pytest.mark.parametrize("overflow", [False, True])
def test_toy_values_match_a_select_after_the_call(overflow):
  x = jnp.array([1.0, 2.0]) if not overflow else jnp.array([1.0, jnp.nan])
  a, b = jnp.array([10.0, 20.0]), jnp.array([-1.0, -2.0])
  got = _run(_toy, (x, a, b, jnp.bool_(False)), _LABELS, _olds)
  raw = _toy(x, a, b, jnp.bool_(False))
  if not overflow:
    expected = raw
  else:
    expected = (jnp.full(2, -0.0), a, b, a, b, a, raw[6], raw[7])
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
  if overflow:
    # -0.0, not 0.0: params + update keeps the sign of a zero parameter.
    assert np.signbit(np.asarray(got[0])).all()
    # bookkeeping from the unselected leaf: b*2 + x, not b + 0.5
    assert np.asarray(got[6])[0] == -1.0 * 2 + 1.0 + 0.5


def test_exactly_one_overflow_output_is_required():
  with pytest.raises(ValueError, match="one overflow output"):
    _run(lambda x: (x, x), (jnp.ones(2),), [U, U], lambda args: [None, None])


def _reference_skip(inner):
  """skip_on_overflow as a plain select after the update."""

  def update(updates, state, params=None):
    with _guard.guarded():
      new_updates, new_state = inner.update(updates, state, params)
    overflow = fs.scale_metrics(new_state)["overflow"]
    book = (LossScaleState, ClipState)

    def keep(new, old):
      return new if isinstance(new, book) else jnp.where(overflow, old, new)

    new_state = jax.tree.map(
      keep, new_state, state, is_leaf=lambda x: isinstance(x, book)
    )
    new_updates = jax.tree.map(
      lambda u: jnp.where(overflow, -0.0, u), new_updates
    )
    return new_updates, new_state

  def init(params):
    with _guard.guarded():
      return inner.init(params)

  return optax.GradientTransformation(init, update)


_OPTIMIZERS = {
  "adamw+schedule": lambda: optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20), weight_decay=0.1
  ),
  "sgd nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-3),
  "adafactor": lambda: optax.adafactor(1e-2),
  "inject_hyperparams adam": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=1e-3
  ),
  "MultiSteps adam": lambda: optax.MultiSteps(
    optax.adam(1e-3), 2
  ).gradient_transformation(),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_same_bits_as_a_select_after_the_update(name):
  params = {
    "w": jax.random.normal(jax.random.PRNGKey(0), (8, 4)),
    "b": jnp.array([0.0, -0.0, 1.0, 2.0]),
  }

  def chain():
    return optax.chain(
      fs.fp16_loss_scale(
        fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)
      ),
      fs.clip_by_unscaled_norm(1.0),
      _OPTIMIZERS[name](),
    )

  ours, ref = fs.skip_on_overflow(chain()), _reference_skip(chain())

  def step(tx, params, state, i):
    key = jax.random.fold_in(jax.random.PRNGKey(1), i)
    scale = fs.current_scale(state)
    grads = jax.tree.map(
      lambda p: (
        jax.random.normal(jax.random.fold_in(key, p.size), p.shape) * scale
      ).astype(jnp.float16),
      params,
    )
    # Steps 3 and 4 overflow.
    poison = (i == 3) | (i == 4)
    grads["w"] = (
      grads["w"].at[0, 0].set(jnp.where(poison, jnp.inf, grads["w"][0, 0]))
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def run(tx):
    p, s, trace = params, tx.init(params), []
    f = jax.jit(step, static_argnums=0)
    for i in range(8):
      p, s = f(tx, p, s, i)
      trace.append((p, s))
    assert int(fs.scale_metrics(s)["skipped_steps"]) == 2
    return trace

  ours_run, ref_run = run(ours), run(ref)
  # On the overflow steps the parameters and every inner state leaf keep
  # their bits (only the bookkeeping moves).
  for i in (3, 4):
    before, after = ours_run[i - 1], ours_run[i]
    assert fs.scale_metrics(after[1])["overflow"]
    assert _bits(after[0]) == _bits(before[0])
    assert _bits(_inner(after[1])) == _bits(_inner(before[1]))
  # Everywhere else the same values as the select after the update. XLA
  # fuses the two dataflows differently, so a compiled update may round
  # differently in the last place.
  for ours_step, ref_step in zip(ours_run, ref_run):
    for a, b in zip(jax.tree.leaves(ours_step), jax.tree.leaves(ref_step)):
      np.testing.assert_allclose(
        np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
      )


def _chain():
  return fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(
        fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)
      ),
      fs.clip_by_unscaled_norm(1.0),
      optax.adamw(1e-2, weight_decay=0.1),
    )
  )


def _grads(scale, poison):
  g = {"w": jnp.arange(12.0).reshape(3, 4) / 7 - 0.5, "b": jnp.ones(4)}
  g = jax.tree.map(lambda x: (x * scale).astype(jnp.float16), g)
  g["b"] = g["b"].at[2].set(jnp.where(poison, jnp.inf, g["b"][2]))
  return g


def test_rewritten_jaxpr_typechecks():
  # jax_enable_checks typechecks every jaxpr JAX builds or binds, the
  # rewritten one included (select_n's operand types, variable scoping).
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  tx = _chain()
  with jax.enable_checks(True):
    state = tx.init(params)
    for poison in (False, True, False):
      updates, state = jax.jit(tx.update)(
        _grads(fs.current_scale(state), poison), state, params
      )
      params = optax.apply_updates(params, updates)
  assert int(fs.scale_metrics(state)["skipped_steps"]) == 1


def test_unexpected_jaxpr_shape_falls_back_to_selecting_after(monkeypatch):
  # If a future JAX traces the inner update differently, the skip must
  # stay exact (only slower): same parameters, same skipped step.
  params0 = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}

  def run():
    tx, params = _chain(), params0
    state = tx.init(params)
    out = []
    for poison in (False, True, False, False):
      updates, state = jax.jit(tx.update)(
        _grads(fs.current_scale(state), poison), state, params
      )
      params = optax.apply_updates(params, updates)
      out.append((params, state))
    return out

  fast = run()
  monkeypatch.setattr(_inplace, "_single_jit_call", lambda closed: None)
  slow = run()
  assert _bits(slow[1][0]) == _bits(slow[0][0])  # the overflow step
  assert _bits(_inner(slow[1][1])) == _bits(_inner(slow[0][1]))
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(slow)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
    )


def test_eager_update_runs_op_by_op_and_skips_exactly(monkeypatch):
  # Outside jit there is no donated buffer to reuse; tracing and binding a
  # jit call would compile the whole update on every eager call.
  params0 = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}

  def run(update):
    tx, params = _chain(), params0
    state = tx.init(params)
    out = []
    for poison in (False, True, False):
      updates, state = update(tx)(
        _grads(fs.current_scale(state), poison), state, params
      )
      params = optax.apply_updates(params, updates)
      out.append((params, state))
    return out

  jitted = run(lambda tx: jax.jit(tx.update))

  def no_tracing(*args, **kwargs):
    raise AssertionError("traced an eager update")

  monkeypatch.setattr(jax, "make_jaxpr", no_tracing)
  eager = run(lambda tx: tx.update)
  assert _bits(eager[1][0]) == _bits(eager[0][0])  # the overflow step
  assert _bits(_inner(eager[1][1])) == _bits(_inner(eager[0][1]))
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
    )
