"""fs.value_and_grad(policy=, cast_args=): the casts happen inside the
differentiated function, so the gradients are bit for bit those of the
hand-written cast-inside form and come back in float32; only the
differentiated arguments (and those cast_args names) are cast. Plain
pytrees, Equinox, Linen and NNX models (an NNX module's layers computing as
if built with dtype= the compute dtype); double casts refused by name."""

import warnings

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

F16 = jnp.dtype("float16")
F32 = jnp.dtype("float32")
POLICY = fs.get_policy("p=f32,c=f16,o=f32")
S = 2.0**10
TX = fs.chain(fs.fp16_loss_scale(fs.static_scaler(S)), optax.sgd(0.1))


def _bits(tree):
  leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
  return [(x.dtype, x.tobytes()) for x in leaves]


def _mlp_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": jax.random.normal(k1, (8, 16)) * 0.3,
    "b1": jnp.zeros(16),
    "w2": jax.random.normal(k2, (16, 4)) * 0.3,
  }


def _batch():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 4, size=32))
  return x, y


def mlp_loss(params, x, y):
  h = jax.nn.relu(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
  logits = (h @ params["w2"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _hand_written(loss, policy, scale):
  """The cast-inside form as one writes it by hand: jax.grad of the loss of
  the parameters cast to the compute dtype, its output cast to the output
  dtype, times the scale."""

  def scaled(params, *rest):
    value = loss(policy.cast_to_compute(params), *rest)
    return policy.cast_to_output(value).astype(jnp.float32) * scale

  return jax.jit(jax.grad(scaled))


@pytest.mark.parametrize(
  "policy", [POLICY, "p=f32,c=f16,o=f32", "params=float32,compute=half,o=full"]
)
def test_gradients_are_the_hand_written_cast_inside_forms(policy):
  params = _mlp_params()
  x, y = _batch()
  state = TX.init(params)
  step = jax.jit(
    lambda p, s, x, y: fs.value_and_grad(mlp_loss, s, policy=policy)(p, x, y)
  )
  value, grads = step(params, state, x, y)
  expected = _hand_written(mlp_loss, fs.get_policy(str(policy)), S)
  assert _bits(grads) == _bits(expected(params, x, y))
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  # The loss was computed in float16: not the float32 loss.
  assert value.dtype == F32
  float32_loss = float(mlp_loss(params, x, y))
  assert float(value) != float32_loss
  # float16 compute: 2**-8 relative is loose
  np.testing.assert_allclose(float(value), float32_loss, rtol=2**-6)


def test_the_loss_is_cast_to_the_output_dtype():
  params = _mlp_params()
  x, y = _batch()
  state = TX.init(params)
  with pytest.warns(UserWarning, match="float16 loss"):
    value, _ = fs.value_and_grad(mlp_loss, state, policy="c=f16")(params, x, y)
  assert value.dtype == F16  # "c=f16": output follows compute, as in jmp


def rl_loss(params, obs, advantages, old_logp, seen):
  seen.update(
    params=params["w1"].dtype,
    obs=obs.dtype,
    advantages=advantages.dtype,
    old_logp=old_logp.dtype,
  )
  logits = (jax.nn.relu(obs @ params["w1"]) @ params["w2"]).astype(F32)
  logp = jax.nn.log_softmax(logits)[:, 0]
  ratio = jnp.exp(logp - old_logp)
  return -jnp.mean(ratio * advantages)


def test_only_the_differentiated_arguments_are_cast_by_default():
  params = _mlp_params()
  params = {"w1": params["w1"], "w2": params["w2"]}
  obs, _ = _batch()
  adv = jnp.linspace(-1.0, 1.0, 32)
  old = jnp.full(32, -1.4)
  state = TX.init(params)
  seen = {}

  def loss(p, o, a, lp):
    return rl_loss(p, o, a, lp, seen)

  fs.value_and_grad(loss, state, policy=POLICY)(params, obs, adv, old)
  assert seen == dict(params=F16, obs=F32, advantages=F32, old_logp=F32)
  # cast_args names more: the observations, by position...
  fs.value_and_grad(loss, state, policy=POLICY, cast_args=(1,))(
    params, obs, adv, old
  )
  assert seen == dict(params=F16, obs=F16, advantages=F32, old_logp=F32)
  # ...or by keyword.

  def kw(p, *, obs, adv, old):
    return rl_loss(p, obs, adv, old, seen)

  fs.value_and_grad(kw, state, policy=POLICY, cast_args="obs")(
    params, obs=obs, adv=adv, old=old
  )
  assert seen == dict(params=F16, obs=F16, advantages=F32, old_logp=F32)


def test_a_double_cast_is_refused_by_name():
  params = jax.tree.map(lambda p: p.astype(F16), _mlp_params())
  x, y = _batch()
  with pytest.warns(UserWarning, match="some params are float16"):
    state = TX.init(params)
  grad = fs.value_and_grad(mlp_loss, state, policy=POLICY)
  with pytest.raises(ValueError, match=r"float16 array at \['b1'\].*float32"):
    grad(params, x, y)
  # Without a policy the float16 parameters are the caller's choice.
  _, grads = fs.value_and_grad(mlp_loss, state)(params, x, y)
  assert grads["w1"].dtype == F16


def test_bad_cast_args_are_refused():
  state = TX.init(_mlp_params())
  with pytest.raises(ValueError, match="no policy= says which"):
    fs.value_and_grad(mlp_loss, state, cast_args=(1,))
  with pytest.raises(ValueError, match="keyword names .strings., got 1.5"):
    fs.value_and_grad(mlp_loss, state, policy=POLICY, cast_args=(1.5,))
  grad = fs.value_and_grad(mlp_loss, state, policy=POLICY, cast_args=(5,))
  with pytest.raises(ValueError, match="argument 5, but fun was called with 3"):
    grad(_mlp_params(), *_batch())
  grad = fs.value_and_grad(mlp_loss, state, policy=POLICY, cast_args="obs")
  with pytest.raises(ValueError, match="keyword 'obs', but fun was called"):
    grad(_mlp_params(), *_batch())
  with pytest.raises(TypeError, match="policy must be an fs.Policy"):
    fs.value_and_grad(mlp_loss, state, policy=jnp.float16)


# ---------------------------------------------------------------------------
# Equinox, Linen and NNX models.


def test_equinox_gradients_are_the_hand_written_forms():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(1))
  x, y = _batch()

  def loss(model, x, y):
    logits = jax.vmap(model)(x.astype(model.layers[0].weight.dtype))
    logits = logits.astype(F32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  state = TX.init(eqx.filter(model, eqx.is_inexact_array))
  _, grads = eqx.filter_jit(
    lambda m, s: fs.value_and_grad(loss, s, policy=POLICY)(m, x, y)
  )(model, state)

  def by_hand(m):
    m16 = POLICY.cast_to_compute(m)
    return loss(m16, x, y).astype(F32) * S

  expected = eqx.filter_jit(eqx.filter_grad(by_hand))(model)
  assert _bits(grads) == _bits(expected)
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  assert jax.tree.structure(grads) == jax.tree.structure(expected)


def test_linen_gradients_are_the_hand_written_forms():
  nn = pytest.importorskip("flax.linen")
  x, y = _batch()

  class Net(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(16, dtype=self.dtype)(x))
      return nn.Dense(4, dtype=self.dtype)(x)

  params = Net().init(jax.random.key(0), x)

  def loss(params, x, y):
    logits = Net().apply(params, x).astype(F32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  state = TX.init(params)

  def grad(p, s):
    return fs.value_and_grad(loss, s, policy=POLICY, cast_args=(1,))(p, x, y)

  _, grads = jax.jit(grad)(params, state)

  def by_hand(p):
    return loss(POLICY.cast_to_compute(p), x.astype(F16), y).astype(F32) * S

  expected = jax.jit(jax.grad(by_hand))(params)
  assert _bits(grads) == _bits(expected)
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  # The policy's form runs the layers' products in float16.
  jaxpr = jax.make_jaxpr(grad)(params, state)
  dots = _dot_dtypes(jaxpr.jaxpr)  # forward and backward products
  assert dots and dots <= {F16}, dots
  # A Linen module built with dtype=float16 casts its parameters and inputs
  # itself (Flax's promote_dtype): its products are float16 without a
  # policy, which cannot see it. Use one or the other.
  jaxpr = jax.make_jaxpr(lambda p: Net(dtype=jnp.float16).apply(p, x))(params)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 2
  assert all(v.aval.dtype == F16 for e in dots for v in e.invars)


def _dot_dtypes(jaxpr):
  """The operand dtypes of every dot_general in ``jaxpr`` and the jaxprs
  inside its equations."""
  eqns = helpers.jaxpr_eqns(jaxpr)
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  return {v.aval.dtype for e in dots for v in e.invars}


def _scale_init(key, shape, dtype):
  """1 + k * 2**-12: a scale float16 cannot hold (its spacing at 1 is
  2**-10), so a norm's parameters cast to float16 change the bits."""
  return 1 + jnp.arange(shape[0], dtype=dtype) * 2.0**-12


def _nnx_model(nnx, dtype=None, bn_dtype=None):
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(8, 16, dtype=dtype, rngs=rngs)
      self.bn = nnx.BatchNorm(
        16, dtype=bn_dtype or dtype, scale_init=_scale_init, rngs=rngs
      )
      self.l2 = nnx.Linear(16, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.bn(self.l1(x))))

  return Net(nnx.Rngs(0))


def _nnx_loss(model, x, y):
  logits = model(x).astype(F32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_nnx_functional_gradients_are_the_hand_written_forms():
  nnx = pytest.importorskip("flax.nnx")
  x, y = _batch()
  graphdef, params, rest = nnx.split(_nnx_model(nnx), nnx.Param, ...)

  def loss(params, rest, x, y):
    return _nnx_loss(nnx.merge(graphdef, params, rest, copy=True), x, y)

  state = TX.init(params)
  _, grads = jax.jit(
    lambda p, s: fs.value_and_grad(loss, s, policy=POLICY)(p, rest, x, y)
  )(params, state)

  def by_hand(p):
    return loss(POLICY.cast_to_compute(p), rest, x, y).astype(F32) * S

  expected = jax.jit(jax.grad(by_hand))(params)
  assert _bits(grads) == _bits(expected)
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))

  # The policy sees a pytree, not the layers: with the batch cast too, l1
  # runs in float16 (its product and kernel gradient), and BatchNorm's
  # float32 statistics carry l2 into float32 (its product and both
  # gradients). docs/precision-policy.md: build this form's layers with
  # dtype=.
  def cast_batch(p, s):
    grad = fs.value_and_grad(loss, s, policy=POLICY, cast_args=(2,))
    return grad(p, rest, x, y)

  report = fs.compute_dtypes(cast_batch, params, state)
  assert report.counts["matmul"] == {"float16": 2, "float32": 3}


def _nnx_by_layer_dtype(nnx, x, y, bn_dtype=None):
  """The independent form of the policy on an NNX module: the model built
  with dtype=float16 on every layer (BatchNorm's ``bn_dtype`` if given;
  Flax casts each layer's inputs and parameters itself), jax.grad on its
  split state times the scale; the gradients and the batch statistics the
  forward pass wrote."""
  built = _nnx_model(nnx, F16, bn_dtype)
  graphdef, params, rest = nnx.split(built, nnx.Param, ...)

  def by_hand(p):
    m = nnx.merge(graphdef, p, rest, copy=True)
    return _nnx_loss(m, x, y).astype(F32) * S, nnx.state(m, nnx.BatchStat)

  return jax.jit(jax.grad(by_hand, has_aux=True))(params)


def test_nnx_optimizer_computes_as_the_layers_own_dtype_and_keeps_stats():
  nnx = pytest.importorskip("flax.nnx")
  x, y = _batch()
  model = _nnx_model(nnx)
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  expected, stats = _nnx_by_layer_dtype(nnx, x, y)

  @nnx.jit
  def step(model, optimizer):
    grad = fs.value_and_grad(_nnx_loss, optimizer, policy=POLICY)
    return grad(model, x, y)[1]

  before = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
  grads = step(model, optimizer)
  assert _bits(nnx.to_pure_dict(grads)) == _bits(nnx.to_pure_dict(expected))
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  # The forward pass's batch statistics reached the model, in float32.
  after = nnx.state(model, nnx.BatchStat)
  assert _bits(after) == _bits(stats)
  assert all(v.dtype == F32 for v in jax.tree.leaves(after))
  assert _bits(after) != _bits(before)
  # And the model the caller holds is as built: float32 parameters, untouched
  # by the cast, and its layers' dtype still None (the policy set it on the
  # copy the loss saw).
  assert all(
    v.dtype == F32 for v in jax.tree.leaves(nnx.state(model, nnx.Param))
  )
  assert (model.l1.dtype, model.bn.dtype, model.l2.dtype) == (None,) * 3


def test_an_nnx_module_that_casts_itself_agrees_with_the_policy():
  nnx = pytest.importorskip("flax.nnx")
  x, y = _batch()
  expected, _ = _nnx_by_layer_dtype(nnx, x, y)
  # The layers' own dtype=float16, with the policy and without: the same
  # bits as the policy on a model built without dtype=.
  for policy in (POLICY, None):
    model = _nnx_model(nnx, dtype=jnp.float16)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
      grad = fs.value_and_grad(_nnx_loss, optimizer, policy=policy)
      return grad(model, x, y)[1]

    with warnings.catch_warnings():
      warnings.simplefilter("error")
      grads = step(model, optimizer)
    assert _bits(nnx.to_pure_dict(grads)) == _bits(
      nnx.to_pure_dict(expected)
    ), policy


def test_nnx_a_layers_own_dtype_and_parameters_are_kept_under_the_policy():
  nnx = pytest.importorskip("flax.nnx")
  x, y = _batch()
  # BatchNorm(dtype=float32) in a model otherwise built without dtype=:
  # the policy gives the Linears float16 and keeps the norm's float32 and
  # its scale (which float16 cannot hold) uncast: the bits of the model
  # built with those dtypes by hand.
  expected, _ = _nnx_by_layer_dtype(nnx, x, y, bn_dtype=F32)
  model = _nnx_model(nnx, bn_dtype=F32)
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  seen = {}

  def loss(model, x, y):
    seen.update(l1=model.l1.dtype, bn=model.bn.dtype, l2=model.l2.dtype)
    seen.update(scale=model.bn.scale.dtype)
    return _nnx_loss(model, x, y)

  @nnx.jit
  def step(model, optimizer):
    return fs.value_and_grad(loss, optimizer, policy=POLICY)(model, x, y)[1]

  grads = step(model, optimizer)
  assert seen == dict(l1=F16, bn=F32, l2=F16, scale=F32)
  assert _bits(nnx.to_pure_dict(grads)) == _bits(nnx.to_pure_dict(expected))
  assert (model.l1.dtype, model.bn.dtype, model.l2.dtype) == (None, F32, None)


# ---------------------------------------------------------------------------
# Any pytree: what is not an inexact array passes through (issue 37).


def test_a_plain_dicts_non_array_leaves_pass_through():
  state = TX.init({"w": jnp.ones(2)})
  seen = {}

  def f(t):
    seen.update(n=t["n"], act=t["act"], idx=t["idx"].dtype, none=t["none"])
    return jnp.sum(t["act"](t["w"]) * t["n"]) + t["c"] * jnp.sum(t["idx"])

  tree = {
    "w": jnp.array([0.5, -1.0]),
    "c": 0.25,  # a Python float: differentiated, as jax.grad does
    "n": 3,
    "act": jax.nn.relu,
    "idx": jnp.arange(3),
    "none": None,
  }
  value, grads = fs.value_and_grad(f, state)(tree)
  assert seen == dict(n=3, act=jax.nn.relu, idx=jnp.int32, none=None)
  # d/dw = n * relu'(w) = [3, 0]; d/dc = sum(idx) = 3: times the scale S.
  np.testing.assert_array_equal(grads["w"], [3.0 * S, 0.0])
  assert float(grads["c"]) == 3.0 * S
  assert grads["n"] is None
  assert grads["act"] is None
  assert grads["idx"] is None
  assert grads["none"] is None
  assert float(value) == 1.5 + 0.75
  # With a policy too: the arrays cast, the rest untouched.
  _, grads = fs.value_and_grad(f, state, policy=POLICY)(tree)
  assert grads["w"].dtype == F32
  assert grads["n"] is None
  assert seen["n"] == 3
  assert seen["idx"] == jnp.int32
