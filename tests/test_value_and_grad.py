"""fs.value_and_grad: the unscaled loss and the gradients of ``loss * S``,
with S read from the state inside the trace.

Expectations are independent of the helper: hand-derived gradients for the
``argnums`` and ``has_aux`` cases, ``jax.grad`` of the unscaled loss times
the scale the state holds, and plain optax on the true gradients for the
updates that follow. Scales are powers of two and the compute float32, so
``S * g`` and its unscaling are exact and the comparisons are tight.
"""

import re
import warnings

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

nnx = pytest.importorskip("flax.nnx")

PARAMS = {
  "w": jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]),
  "b": jnp.array([0.125, -0.25]),
}


def _batch(i, n=4):
  key = jax.random.PRNGKey(10 + i)
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (n, 3)), jax.random.normal(ky, (n, 2))


def loss(params, x, y):
  pred = x @ params["w"].T + params["b"]
  return jnp.mean((pred - y) ** 2)


def _loss_times(params, x, y, scale):
  return loss(params, x, y) * scale


_grad = jax.jit(jax.grad(loss))
_grad_times = jax.jit(jax.grad(_loss_times))


def _true_grads(params, x, y):
  """The unscaled loss's gradients, as numpy arrays."""
  return jax.tree.map(np.asarray, _grad(params, x, y))


def _sgd(params, grads, lr=0.5):
  """Plain sgd, in numpy float32."""
  return jax.tree.map(
    lambda p, g: np.asarray(p) - np.float32(lr) * np.asarray(g), params, grads
  )


def _assert_tree_equal(a, b, rtol=0.0):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if rtol:
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _torch_sgd(**kwargs):
  """The guarded sgd(0.5), torch's rule with ``kwargs``."""
  return helpers.guarded(fs.torch_scaler(**kwargs), optax.sgd(0.5))


def _scaled(tree, scale):
  return jax.tree.map(lambda g: g * scale, tree)


# ------------------------------------------------------ argnums and has_aux

S = 8.0
STATIC = helpers.guarded(fs.static_scaler(S), optax.sgd(0.5))


def three(a, b, c):
  """d/da = b + c**2, d/db = a, d/dc = 2 c sum(a): derived by hand."""
  return jnp.sum(a * b) + c**2 * jnp.sum(a)


A = jnp.array([1.0, -2.0])
B = jnp.array([3.0, 0.5])
C = jnp.float32(1.5)


def test_argnums_an_int_and_a_tuple():
  state = STATIC.init(A)
  value = 3.0 - 1.0 + 2.25 * -1.0
  da = B + C**2
  db = A
  dc = 2 * C * jnp.sum(A)

  v, g = fs.value_and_grad(three, state)(A, B, C)
  assert float(v) == value  # unscaled
  np.testing.assert_array_equal(g, S * da)

  v, g = fs.value_and_grad(three, state, argnums=1)(A, B, C)
  np.testing.assert_array_equal(g, S * db)

  v, g = fs.value_and_grad(three, state, argnums=(0, 2))(A, B, C)
  assert float(v) == value
  assert isinstance(g, tuple)
  assert len(g) == 2
  np.testing.assert_array_equal(g[0], S * da)
  assert float(g[1]) == S * float(dc)

  v, g = fs.value_and_grad(three, state, argnums=(2,))(A, B, C)
  assert isinstance(g, tuple)
  assert float(g[0]) == S * float(dc)


def test_has_aux_returns_the_aux_as_fun_gave_it():
  state = STATIC.init(A)

  def with_aux(a, b, c):
    return three(a, b, c), {"sum_a": jnp.sum(a), "tag": c * 2}

  (v, aux), g = fs.value_and_grad(with_aux, state, has_aux=True)(A, B, C)
  assert float(v) == float(three(A, B, C))
  assert float(aux["sum_a"]) == -1.0
  assert float(aux["tag"]) == 3.0
  np.testing.assert_array_equal(g, S * (B + C**2))

  (v, aux), (ga, gc) = fs.value_and_grad(
    with_aux, state, argnums=(0, 2), has_aux=True
  )(A, B, C)
  assert float(aux["tag"]) == 3.0
  np.testing.assert_array_equal(ga, S * (B + C**2))
  assert float(gc) == S * float(2 * C * jnp.sum(A))
  # The gradients go to tx.update as they are: the update is sgd(0.5) on
  # the true gradient.
  updates, _ = STATIC.update(ga, state, A)
  np.testing.assert_array_equal(updates, -0.5 * (B + C**2))


# ------------------------------------------------- jit follows a new scale


def test_one_jitted_step_follows_the_scale_as_it_moves():
  """A torch scaler that grows every 2 clean steps, an injected overflow
  that backs it off, and a scale set from the host: every call's gradients
  are ``jax.grad(loss * S)`` at the state's current S, with one trace."""
  tx = _torch_sgd(init_scale=2.0**10, growth_interval=2)
  traces = []

  @jax.jit
  def step(params, state, x, y, poison):
    traces.append(1)
    value, grads = fs.value_and_grad(loss, state)(params, x, y)
    returned = grads
    grads = {
      **grads,
      "b": grads["b"].at[0].multiply(jnp.where(poison, jnp.inf, 1.0)),
    }
    updates, state = tx.update(grads, state, params)
    return value, returned, optax.apply_updates(params, updates), state

  params = PARAMS
  state = tx.init(PARAMS)
  poisons = [False, False, False, True, False, False, False]
  seen = []
  for i, poison in enumerate(poisons):
    if i == 5:
      state = fs.set_loss_scale(state, 2.0**3)  # from the host
    x, y = _batch(i)
    scale = float(fs.current_scale(state))
    seen.append(scale)
    value, grads, new_params, state = step(params, state, x, y, poison)
    expected = _grad_times(params, x, y, scale)
    _assert_tree_equal(grads, expected, rtol=1e-6)
    assert float(value) == pytest.approx(float(loss(params, x, y)), rel=1e-6)
    if poison:
      _assert_tree_equal(new_params, params)
    else:  # sgd(0.5) on the true gradient
      plain = _sgd(params, _true_grads(params, x, y))
      _assert_tree_equal(new_params, plain, rtol=1e-6)
    params = new_params
  # By hand: grown after 2 clean steps, backed off by the overflow, set
  # from the host, grown again (the set leaves the tracker at 1).
  assert seen == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**3, 2.0**4]
  assert len(traces) == 1


# ---------------------------------------------------- accumulate_gradients


def test_under_accumulate_gradients_the_window_steps_on_the_mean():
  """fun is the plain loss, not divided by K: the window's applied update
  is plain optax's on the mean of the K microbatches' true gradients (sgd
  with momentum: an update that a stray factor of K would change)."""
  k = 4
  inner = optax.sgd(0.25, momentum=0.5)
  tx = fs.accumulate_gradients(
    helpers.guarded(fs.torch_scaler(init_scale=2.0**12), inner), k
  )

  @jax.jit
  def step(params, state, x, y):
    value, grads = fs.value_and_grad(loss, state)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return value, optax.apply_updates(params, updates), state

  params = PARAMS
  state = tx.init(PARAMS)
  plain_params = PARAMS
  plain_state = inner.init(PARAMS)
  for window in range(2):
    true = []
    for j in range(k):
      x, y = _batch(window * k + j)
      true.append(_true_grads(plain_params, x, y))
      before = params
      _, params, state = step(params, state, x, y)
      if j < k - 1:
        _assert_tree_equal(params, before)  # no step inside the window
    mean = jax.tree.map(lambda *g: sum(g) / k, *true)
    updates, plain_state = inner.update(mean, plain_state, plain_params)
    plain_params = optax.apply_updates(plain_params, updates)
    _assert_tree_equal(params, plain_params, rtol=1e-6)
  assert int(fs.scale_metrics(state)["applied_steps"]) == 2


# -------------------------------------------------------------------- vmap


def test_under_vmap_each_member_uses_its_own_scale():
  tx = _torch_sgd()
  n = 3
  params = jax.tree.map(lambda p: jnp.stack([p] * n), PARAMS)
  states = jax.vmap(tx.init)(params)
  scales = jnp.array([2.0, 2.0**5, 2.0**9])
  states = jax.vmap(fs.set_loss_scale)(states, scales)
  x, y = _batch(0)

  @jax.jit
  def step(params, states):
    def one(p, s):
      value, grads = fs.value_and_grad(loss, s)(p, x, y)
      updates, s = tx.update(grads, s, p)
      return value, grads, optax.apply_updates(p, updates)

    return jax.vmap(one)(params, states)

  values, grads, new_params = step(params, states)
  true = _true_grads(PARAMS, x, y)
  for i, s in enumerate(np.asarray(scales)):
    member = jax.tree.map(lambda g: g[i], grads)
    # A batched matmul may round differently from the unbatched one (an ulp
    # on some CPUs); a wrong scale would be off by a factor of 2 or more.
    _assert_tree_equal(member, _scaled(true, s), rtol=1e-6)
    assert float(values[i]) == float(loss(PARAMS, x, y))
    moved = jax.tree.map(lambda p: p[i], new_params)
    _assert_tree_equal(moved, _sgd(PARAMS, true), rtol=1e-6)
  # vmapped without jit too.
  _, grads = jax.vmap(lambda p, s: fs.value_and_grad(loss, s)(p, x, y))(
    params, states
  )
  _assert_tree_equal(
    jax.tree.map(lambda g: g[2], grads), _scaled(true, 2.0**9), rtol=1e-6
  )


# --------------------------------------------------------------------- nnx


def test_nnx_optimizer_form_inside_nnx_jit():
  """``fs.value_and_grad(loss_fn, optimizer)(model, ...)`` inside
  ``nnx.jit``, then ``optimizer.update(model, grads)``: the gradients are
  the true ones times the optimizer's current scale (which grows every
  step here), and the parameters move as plain sgd on the true ones."""
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = _torch_sgd(init_scale=2.0**4, growth_interval=1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  @nnx.jit
  def step(model, optimizer, x, y):
    value, grads = fs.value_and_grad(loss_fn, optimizer)(model, x, y)
    optimizer.update(model, grads)
    return value, grads

  def plain(tree):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(tree))

  for i in range(3):
    x, y = _batch(i)
    scale = float(fs.current_scale(optimizer.opt_state))
    assert scale == 2.0 ** (4 + i)
    before = plain(nnx.state(model, nnx.Param))
    true = plain(nnx.grad(loss_fn)(model, x, y))
    expected_value = float(loss_fn(model, x, y))
    value, grads = step(model, optimizer, x, y)
    # Jitted against eager: float32 rounding apart.
    assert float(value) == pytest.approx(expected_value, rel=1e-6)
    _assert_tree_equal(plain(grads), _scaled(true, scale), rtol=1e-6)
    moved = _sgd(before, true)
    _assert_tree_equal(plain(nnx.state(model, nnx.Param)), moved, rtol=1e-6)


# ------------------------------------------------------- a TrainState


def test_a_flax_train_state_as_state():
  """``fs.value_and_grad(loss, train_state)``: the scale is read from the
  TrainState's opt_state, and the gradients are the true ones times it."""
  train_state = pytest.importorskip("flax.training.train_state")
  tx = _torch_sgd(init_scale=4.0, growth_interval=1)
  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)

  @jax.jit
  def step(state, x, y):
    value, grads = fs.value_and_grad(loss, state)(state.params, x, y)
    return value, grads, state.apply_gradients(grads=grads)

  for i, scale in enumerate([4.0, 8.0, 16.0]):
    x, y = _batch(i)
    true = _true_grads(state.params, x, y)
    value, grads, new = step(state, x, y)
    assert float(value) == pytest.approx(float(loss(state.params, x, y)))
    _assert_tree_equal(grads, _scaled(true, scale))
    _assert_tree_equal(new.params, _sgd(state.params, true), rtol=1e-6)
    state = new


# ------------------------------------------------------------- refusals


def test_built_from_a_concrete_state_outside_jit_and_called_inside_refused():
  state = STATIC.init(PARAMS)
  x, y = _batch(0)
  stale = fs.value_and_grad(loss, state)  # outside the step
  message = (
    r"not part of this trace.*Call fs\.value_and_grad\(fun, "
    r"opt_state\) inside the step"
  )
  with pytest.raises(ValueError, match=message):
    jax.jit(stale)(PARAMS, x, y)
  with pytest.raises(ValueError, match=message):  # the state closed over
    jax.jit(lambda p: fs.value_and_grad(loss, state)(p, x, y))(PARAMS)
  with pytest.raises(ValueError, match=message):
    jax.vmap(stale, in_axes=(None, 0, 0))(PARAMS, x[None], y[None])
  # Outside any trace the same helper is fine (nothing can go stale there).
  _, grads = stale(PARAMS, x, y)
  _assert_tree_equal(grads, _scaled(_true_grads(PARAMS, x, y), S))


def test_built_where_the_state_is_it_follows_the_scale_in_a_scan_body():
  """Built in a lax.scan body from the state the body carries, the helper
  follows the scale as it grows every step. (Built outside the body, its
  scale would be the enclosing jit's tracer: JAX's public API cannot tell
  that trace from the body's, so that case is not refused; the docstring
  says to build it where the state is.)"""
  tx = _torch_sgd(init_scale=8.0, growth_interval=1)

  def linear(p, v):
    return jnp.sum(p * v)

  @jax.jit
  def train(params, state, vs):
    def body(carry, v):
      params, state = carry
      _, grads = fs.value_and_grad(linear, state)(params, v)
      updates, state = tx.update(grads, state, params)
      return (params + updates, state), (updates, grads)

    return jax.lax.scan(body, (params, state), vs)[1]

  p = jnp.ones(2)
  updates, grads = train(p, tx.init(p), jnp.ones((4, 2)))
  # The scale doubles every clean step: 8, 16, 32, 64; the update is sgd(0.5)
  # on the true gradient, 1.0, every step.
  np.testing.assert_array_equal(grads[:, 0], [8.0, 16.0, 32.0, 64.0])
  np.testing.assert_array_equal(updates, np.full((4, 2), -0.5))


def test_built_from_an_nnx_optimizer_outside_nnx_jit_is_refused():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, STATIC, wrt=nnx.Param)
  x, y = _batch(0)
  stale = fs.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2), optimizer)
  with pytest.raises(ValueError, match="inside the step"):
    nnx.jit(lambda m: stale(m))(model)


def test_a_loss_that_is_not_a_floating_scalar_is_refused():
  state = STATIC.init(A)

  def per_example(a):
    return a**2

  with pytest.raises(TypeError, match=r"floating scalar loss.*float32\[2\]"):
    fs.value_and_grad(per_example, state)(A)
  with pytest.raises(TypeError, match=r"floating scalar loss.*int32\[\]"):
    fs.value_and_grad(lambda a: jnp.int32(1), state)(A)
  with pytest.raises(TypeError, match=r"floating scalar loss.*float32\[2\]"):
    jax.jit(lambda a, s: fs.value_and_grad(per_example, s)(a))(A, state)


def test_output_mistakes_get_the_librarys_message():
  """Each way ``fun``'s output can disagree with ``has_aux`` is named, with
  the fix, before JAX's or numpy's own errors."""
  state = STATIC.init(A)

  def pair(a):
    return jnp.sum(a), {"n": a}

  def wrong_order(a):
    return {"n": a}, jnp.sum(a)

  mistakes = [
    (pair, False, r"returned a tuple of 2, with has_aux=False: .*has_aux=True"),
    (jnp.sum, True, r"returned one value, with has_aux=True: return the loss"),
    (lambda a: (jnp.sum(a),), True, r"returned a tuple of 1, with has_aux"),
    (
      wrong_order,
      True,
      r"first output \(with has_aux=True it returns "
      r"\(loss, aux\)\) must be a floating scalar.*a dict",
    ),
  ]
  for fun, has_aux, message in mistakes:
    with pytest.raises(TypeError, match=message):
      fs.value_and_grad(fun, state, has_aux=has_aux)(A)
    with pytest.raises(TypeError, match=message):  # traced alike
      jax.jit(lambda a, s: fs.value_and_grad(fun, s, has_aux=has_aux)(a))(
        A, state
      )
  # The right forms still work.
  (value, aux), grads = fs.value_and_grad(pair, state, has_aux=True)(A)
  assert float(value) == -1.0
  assert aux["n"] is A
  np.testing.assert_array_equal(grads, [S, S])


def test_a_state_that_holds_no_scale_is_named():
  """Params, the optimizer, a float, the metrics dict and an abstract
  (eval_shape) state: each refused with what it is and what to pass."""
  state = STATIC.init(A)
  fix = re.escape(
    "Pass the optimizer state that tx.init(params) or tx.update returned"
  )
  wrong = [
    ({"w": A}, "a dict with keys \\['w'\\]"),
    (STATIC, r"which is the optimizer \(tx\) itself, not its state"),
    (1.0, "a float"),
    (fs.scale_metrics(state), r"a dict with keys \[.consecutive_skipped.*\]"),
  ]
  for given, what in wrong:
    with pytest.raises(ValueError, match=f"found in opt_state, {what}. {fix}"):
      fs.value_and_grad(jnp.sum, given)(A)
  abstract = jax.eval_shape(STATIC.init, A)
  with pytest.raises(ValueError, match=r"ShapeDtypeStructs \(from jax.eval_"):
    fs.value_and_grad(jnp.sum, abstract)(A)


def test_a_float16_loss_warns_at_the_callers_line():
  """A float16 loss's cotangent is the scale in float16: inf from 2^16 on,
  so every such step overflows. Warned about when traced, pointing at the
  caller's line, eagerly and under jit."""
  state = helpers.guarded(fs.static_scaler(2.0**16), optax.sgd(0.5)).init(A)

  def half(a):
    return jnp.mean(a.astype(jnp.float16))

  with pytest.warns(UserWarning, match="float16 loss.*2\\^16") as got:
    _, grads = fs.value_and_grad(half, state)(A)
  assert [w.filename for w in got] == [__file__]
  assert not np.isfinite(np.asarray(grads)).any()  # why it warns
  with pytest.warns(UserWarning, match="float16 loss") as got:
    jax.jit(lambda a, s: fs.value_and_grad(half, s)(a))(A, state)
  assert [w.filename for w in got] == [__file__]
  # The mean taken in float32: no warning, and each float16 element's
  # cotangent, S / 2, fits.
  with warnings.catch_warnings():
    warnings.simplefilter("error")

    def full(a):
      return jnp.mean(a.astype(jnp.float16).astype(jnp.float32))

    _, grads = fs.value_and_grad(full, state)(A)
  np.testing.assert_array_equal(grads, [2.0**15, 2.0**15])


def test_a_fun_that_reads_the_scale_is_refused_in_every_state_form():
  """Issue 48: ``fs.current_scale`` of the helper's own state read inside
  ``fun`` (a loss the user scales again) raises ValueError naming the
  fix, for an optax state, a TrainState and an ``nnx.Optimizer`` inside
  ``nnx.jit``; reading it outside ``fun`` (to log it) is untouched, and
  another state's scale inside ``fun`` is not this one's."""
  tx = _torch_sgd(init_scale=4.0)
  opt_state = tx.init(PARAMS)
  x, y = _batch(0)

  def twice(p, x, y):
    return loss(p, x, y) * fs.current_scale(opt_state)

  with pytest.raises(ValueError, match="scaled twice"):
    fs.value_and_grad(twice, opt_state)(PARAMS, x, y)
  other = tx.init(PARAMS)  # its own arrays: another state's scale
  value, _ = fs.value_and_grad(twice, other)(PARAMS, x, y)
  assert float(value) == pytest.approx(4.0 * float(loss(PARAMS, x, y)))

  train_state = pytest.importorskip("flax.training.train_state")
  state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)

  @jax.jit
  def ts_step(state):
    def fun(p, x, y):
      return loss(p, x, y) * fs.current_scale(state.opt_state)

    return fs.value_and_grad(fun, state)(state.params, x, y)

  with pytest.raises(ValueError, match="scaled twice"):
    ts_step(state)

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def fun(model, x, y):
      s = fs.current_scale(optimizer.opt_state)
      return jnp.mean((model(x) - y) ** 2) * s

    return fs.value_and_grad(fun, optimizer)(model, x, y)

  with pytest.raises(ValueError, match="Return the unscaled loss from fun"):
    step(model, optimizer, x, y)
  assert float(fs.current_scale(optimizer.opt_state)) == 4.0
