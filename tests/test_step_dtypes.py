"""The lowered train step of each framework's float16 recipe, counted by
fs.compute_dtypes: every matmul and convolution in float16 (their number
derived by hand from the model: a layer's forward product, its weight's
gradient, and its input's gradient unless the input is the batch), the
forward pass's sums, exps, logs and rsqrts in float32 (statistics, softmax,
the loss's reduction). Tiny models, as shapes: only the lowering runs."""

from functools import partial
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import docs_snippets  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import fp16_scaling as fs  # noqa: E402

POLICY = "p=f32,c=f16,o=f32"
TX = fs.chain(fs.fp16_loss_scale(fs.torch_scaler()), optax.adam(1e-3))
IMAGES = jnp.ones((4, 8, 8, 1))  # scikit-learn's digits' size
LABELS = jnp.arange(4, dtype=jnp.int32)


def _check(report, matmul, convolution, rsqrt, exp=1):
  """All products float16, these counts; forward sums and the loss's ops
  float32 (``exp``: one for the loss's log-softmax, one per softmax)."""
  assert report.share("float16") == 1.0 and report.first_float32 is None
  assert report.counts["matmul"] == {"float16": matmul}
  assert report.counts["convolution"] == (
    {"float16": convolution} if convolution else {}
  )
  assert set(report.counts["sum"]) == {"float32"}, report.counts["sum"]
  assert report.counts["rsqrt"] == ({"float32": rsqrt} if rsqrt else {})
  assert report.counts["exp"] == {"float32": exp}
  assert report.counts["log"] == {"float32": 1}


def _xent(logits, labels):
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ---------------------------------------------------------------------------
# Flax NNX: the MNIST tutorial's CNN, on 8x8 images.


def nnx_cnn(nnx, dtype=None, bn_dtype=None):
  """The tutorial's model: two convolutions with BatchNorm, dropout, two
  linear layers."""

  class CNN(nnx.Module):
    def __init__(self, rngs):
      conv = partial(nnx.Conv, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
      norm = partial(nnx.BatchNorm, dtype=bn_dtype or dtype, rngs=rngs)
      self.conv1, self.batch_norm1 = conv(1, 4), norm(4)
      self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
      self.conv2, self.batch_norm2 = conv(4, 8), norm(8)
      self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
      self.linear1 = nnx.Linear(32, 16, dtype=dtype, rngs=rngs)
      self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
      self.linear2 = nnx.Linear(16, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x):
      x = self.dropout1(self.conv1(x))
      x = self.avg_pool(nnx.relu(self.batch_norm1(x)))
      x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
      x = x.reshape(x.shape[0], -1)
      x = nnx.relu(self.dropout2(self.linear1(x)))
      return self.linear2(x)

  return CNN(nnx.Rngs(0))


def nnx_shapes(nnx, make):
  """``(model, optimizer)`` for the model ``make()`` builds, as shapes
  (``nnx.eval_shape``): the lowering reads no more, and an eager init
  compiles op by op (seconds a model on 2 cores)."""

  def build():
    model = make()
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

  return nnx.eval_shape(build)


def nnx_step(nnx, **grad_kwargs):
  """The tutorial's train step: the loss with the logits as aux, the
  metrics, ``optimizer.update``."""

  def loss_fn(model, x, y):
    logits = model(x)
    return _xent(logits, y), logits

  @nnx.jit
  def train_step(model, optimizer, metrics, x, y):
    grad_fn = fs.value_and_grad(loss_fn, optimizer, has_aux=True, **grad_kwargs)
    (loss, logits), grads = grad_fn(model, x, y)
    metrics.update(loss=loss, logits=logits, labels=y)
    optimizer.update(model, grads)
    return logits

  return train_step


def nnx_loss_step(nnx):
  """A train step on the loss alone, under the policy: the gradients,
  ``optimizer.update``."""

  def loss_fn(model, x, y):
    return _xent(model(x), y)

  @nnx.jit
  def step(model, optimizer, x, y):
    grad = fs.value_and_grad(loss_fn, optimizer, policy=POLICY)
    loss, grads = grad(model, x, y)
    optimizer.update(model, grads)
    return loss

  return step


@pytest.mark.parametrize(
  "dtype, kwargs",
  [
    (None, dict(policy=POLICY)),
    (None, dict(policy=POLICY, cast_args=(1,))),
    (jnp.float16, {}),  # the layers' own dtype, no policy
    (jnp.float16, dict(policy=POLICY)),  # both: they agree
  ],
  ids=["policy", "policy-cast-args", "dtype", "dtype-and-policy"],
)
def test_nnx_tutorial_cnn(dtype, kwargs):
  nnx = pytest.importorskip("flax.nnx")
  model, optimizer = nnx_shapes(nnx, lambda: nnx_cnn(nnx, dtype))
  metrics = nnx.MultiMetric(
    accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
  )
  step = nnx_step(nnx, **kwargs)
  report = fs.compute_dtypes(step, model, optimizer, metrics, IMAGES, LABELS)
  # Convolutions: conv1's product and kernel gradient (its input is the
  # batch), conv2's three; matmuls: both linear layers' three.
  _check(report, matmul=6, convolution=5, rsqrt=2)
  # The aux logits are the model's output, in the compute dtype.
  logits = step.eval_shape(model, optimizer, metrics, IMAGES, LABELS)
  assert logits.dtype == jnp.float16


def test_nnx_a_layer_kept_in_float32_by_its_own_dtype():
  nnx = pytest.importorskip("flax.nnx")
  # BatchNorm(dtype=float32) under the policy: the norms compute and
  # return float32, and the next layer, given the compute dtype by the
  # policy, casts back: every product stays float16.
  model, optimizer = nnx_shapes(nnx, lambda: nnx_cnn(nnx, bn_dtype=jnp.float32))
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
  step = nnx_step(nnx, policy=POLICY)
  report = fs.compute_dtypes(step, model, optimizer, metrics, IMAGES, LABELS)
  _check(report, matmul=6, convolution=5, rsqrt=2)


def test_nnx_without_a_policy_computes_in_float32():
  nnx = pytest.importorskip("flax.nnx")
  # The failure this file guards against, as compute_dtypes names it.
  model, optimizer = nnx_shapes(nnx, lambda: nnx_cnn(nnx))
  metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
  step = nnx_step(nnx)
  report = fs.compute_dtypes(step, model, optimizer, metrics, IMAGES, LABELS)
  assert report.share("float32") == 1.0
  assert report.counts["convolution"] == {"float32": 5}
  assert report.first_float32.startswith("convolution (tensor<4x8x8x1xf32>")
  assert "(Conv.__call__)" in report.first_float32.splitlines()[1]


def _page_attention():
  """docs/precision-policy.md's ``attention``, as the page writes it."""
  (code,) = [
    b
    for b in docs_snippets.section_blocks(
      "precision-policy.md", "## One way in each framework"
    )
    if "def attention" in b
  ]
  ns = {"jax": jax, "jnp": jnp, "fs": fs}
  exec(code, ns)
  return ns["attention"]


def test_the_pages_attention_masks():
  attention = _page_attention()
  q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 4, 2, 8))
  causal = jnp.tril(jnp.ones((4, 4), bool))[None, None]
  out = jax.jit(attention)(q, k, v, mask=causal)
  # The first position attends to itself alone: its value, exactly.
  np.testing.assert_array_equal(out[:, 0], v[:, 0])
  # JAX's own, in float32: sums of at most 8 products and 4 weights, each
  # order off by a few float32 roundings (2**-24 each), far under 1e-5.
  expected = jax.jit(jax.nn.dot_product_attention)(q, k, v, mask=causal)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_nnx_layernorm_rmsnorm_and_attention_block():
  nnx = pytest.importorskip("flax.nnx")
  attention = _page_attention()

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1 = nnx.LayerNorm(8, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(
        2, 8, decode=False, attention_fn=attention, rngs=rngs
      )
      self.ln2 = nnx.RMSNorm(8, rngs=rngs)
      self.mlp = nnx.Linear(8, 8, rngs=rngs)
      self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      causal = nnx.make_causal_mask(x[..., 0])
      x = x + self.attn(self.ln1(x), mask=causal)
      x = x + self.mlp(jax.nn.gelu(self.ln2(x)))
      return self.head(x.mean(1))

  step = nnx_loss_step(nnx)
  model, optimizer = nnx_shapes(nnx, lambda: Block(nnx.Rngs(0)))
  tokens = jnp.ones((2, 5, 8))
  report = fs.compute_dtypes(step, model, optimizer, tokens, LABELS[:2])
  # Matmuls: the four projections, the MLP and the head, three each; the
  # two attention products, forward and both operands' gradients.
  _check(report, matmul=6 * 3 + 2 * 3, convolution=0, rsqrt=2, exp=2)


def test_nnx_a_param_no_layer_owns_is_cast_by_the_policy():
  nnx = pytest.importorskip("flax.nnx")

  class Head(nnx.Module):  # a module of your own: no dtype of its own
    def __init__(self, rngs):
      self.body = nnx.Linear(8, 16, rngs=rngs)
      self.w = nnx.Param(jnp.ones((16, 4)))

    def __call__(self, x):
      return nnx.relu(self.body(x)) @ self.w[...]

  step = nnx_loss_step(nnx)
  model, optimizer = nnx_shapes(nnx, lambda: Head(nnx.Rngs(0)))
  report = fs.compute_dtypes(step, model, optimizer, jnp.ones((4, 8)), LABELS)
  # The Linear's product and kernel gradient; w's product and both
  # gradients: all float16.
  _check(report, matmul=5, convolution=0, rsqrt=0)


@pytest.mark.parametrize("dtype", [None, jnp.float16])
def test_nnx_embed_keeps_its_tables_dtype_unless_built_with_one(dtype):
  nnx = pytest.importorskip("flax.nnx")

  class TiedLM(nnx.Module):  # the output projection is the embedding's
    def __init__(self, rngs):
      self.embed = nnx.Embed(10, 8, dtype=dtype, rngs=rngs)
      self.mlp = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
      h = nnx.relu(self.mlp(self.embed(tokens)))
      return self.embed.attend(h).mean(1)

  step = nnx_loss_step(nnx)
  model, optimizer = nnx_shapes(nnx, lambda: TiedLM(nnx.Rngs(0)))
  tokens = jnp.ones((4, 5), jnp.int32)
  report = fs.compute_dtypes(step, model, optimizer, tokens, LABELS)
  if dtype is not None:  # built with the compute dtype: all float16
    _check(report, matmul=3 + 3, convolution=0, rsqrt=0)
    return
  # Given no dtype, nnx.Embed takes its table's, float32: the policy keeps
  # a layer's own dtype, so attend's product and both its gradients run in
  # float32, and the report names it. The Linear's three: float16.
  assert model.embed.dtype == jnp.float32
  assert report.counts["matmul"] == {"float16": 3, "float32": 3}
  assert "(Embed.attend)" in report.first_float32


def test_nnx_a_scanned_stack_and_a_shared_layer():
  nnx = pytest.importorskip("flax.nnx")

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(8, 8, rngs=rngs)
      self.ln = nnx.LayerNorm(8, rngs=rngs)
      self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
      return x + self.drop(jax.nn.relu(self.lin(self.ln(x))))

  class Net(nnx.Module):  # three blocks by nnx.vmap, run by nnx.scan
    def __init__(self, rngs):
      make = nnx.split_rngs(splits=3)(nnx.vmap(Block, in_axes=0, out_axes=0))
      self.blocks = make(rngs)
      shared = nnx.Linear(8, 10, rngs=rngs)  # one layer, two parents
      self.head, self.tied = nnx.Sequential(shared), nnx.Sequential(shared)

    def __call__(self, x):
      scan = nnx.scan(lambda b, x: (b(x), None), in_axes=(0, nnx.Carry))
      h = scan(self.blocks, x)[0]
      return self.head(h) + self.tied(jnp.tanh(h))

  step = nnx_loss_step(nnx)
  model, optimizer = nnx_shapes(nnx, lambda: Net(nnx.Rngs(0)))
  report = fs.compute_dtypes(step, model, optimizer, jnp.ones((4, 8)), LABELS)
  # The scan's body counts once: its Linear's product, kernel and input
  # gradients; the shared Linear's three at each of its two calls.
  _check(report, matmul=3 + 2 * 3, convolution=0, rsqrt=1)


def test_nnx_default_attention_does_not_lower_in_float16_on_cpu():
  nnx = pytest.importorskip("flax.nnx")
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's limit")
  # Why the block above passes its own attention_fn (docs/precision-policy.md).
  attention = nnx.MultiHeadAttention(
    2, 8, decode=False, dtype=jnp.float16, rngs=nnx.Rngs(0)
  )
  call = nnx.jit(lambda module, x: module(x))
  with pytest.raises(ValueError, match="'F16_F16_F32' is not supported"):
    fs.compute_dtypes(call, attention, jnp.ones((2, 5, 8)))


# ---------------------------------------------------------------------------
# Flax Linen: the same CNN, params a dict; the policy and cast_args.


def test_linen_cnn():
  nn = pytest.importorskip("flax.linen")

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      norm = partial(nn.BatchNorm, use_running_average=not train)
      x = nn.Dropout(0.025, deterministic=not train)(nn.Conv(4, (3, 3))(x))
      x = nn.avg_pool(nn.relu(norm()(x)), (2, 2), (2, 2))
      x = nn.avg_pool(nn.relu(norm()(nn.Conv(8, (3, 3))(x))), (2, 2), (2, 2))
      x = nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1)))
      return nn.Dense(10)(x)

  init = lambda key: CNN().init(key, IMAGES, train=False)  # noqa: E731
  variables = jax.eval_shape(init, jax.random.key(0))  # shapes only
  params, stats = variables["params"], variables["batch_stats"]

  def loss_fn(params, stats, x, y, key):
    logits, new = CNN().apply(
      {"params": params, "batch_stats": stats},
      x,
      train=True,
      rngs={"dropout": key},
      mutable=["batch_stats"],
    )
    return _xent(logits, y), new["batch_stats"]

  @jax.jit
  def step(params, stats, opt_state, x, y, key):
    (loss, new), grads = fs.value_and_grad(
      loss_fn, opt_state, has_aux=True, policy=POLICY, cast_args=(2,)
    )(params, stats, x, y, key)
    updates, opt_state = TX.update(grads, opt_state, params)
    stats = fs.select_on_overflow(opt_state, new=new, old=stats)
    return optax.apply_updates(params, updates), stats, opt_state, loss

  opt_state = jax.eval_shape(TX.init, params)
  args = params, stats, opt_state, IMAGES, LABELS, jax.random.key(1)
  _check(fs.compute_dtypes(step, *args), matmul=6, convolution=5, rsqrt=2)


# ---------------------------------------------------------------------------
# Equinox: the policy casts the module's arrays and the batch.


def test_equinox_cnn_with_batchnorm():
  eqx = pytest.importorskip("equinox")

  class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    linear: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
      self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
      self.linear = eqx.nn.Linear(4 * 8 * 8, 10, key=k2)

    def __call__(self, x, state):
      x = self.conv(x)
      # Statistics in float32 (jmp's BatchNorm policy): Equinox's BatchNorm
      # computes in its input's dtype.
      y, state = self.norm(x.astype(jnp.float32), state)
      return self.linear(jax.nn.relu(y.astype(x.dtype)).reshape(-1)), state

  model, state = eqx.nn.make_with_state(CNN)(jax.random.key(0))
  arrays = eqx.filter(model, eqx.is_inexact_array)

  def loss_fn(model, state, x, y):
    batched = jax.vmap(
      model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )
    logits, state = batched(x, state)
    assert logits.dtype == jnp.float16  # cast in the loss, not the model
    return _xent(logits, y), state

  @eqx.filter_jit
  def step(model, state, opt_state, x, y):
    (loss, new), grads = fs.value_and_grad(
      loss_fn, opt_state, has_aux=True, policy=POLICY, cast_args=(2,)
    )(model, state, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = TX.update(grads, opt_state, params)
    state = fs.select_on_overflow(opt_state, new=new, old=state)
    return eqx.apply_updates(model, updates), state, opt_state, loss

  images = jnp.moveaxis(IMAGES, -1, 1)  # channels first
  report = fs.compute_dtypes(
    step, model, state, TX.init(arrays), images, LABELS
  )
  # Equinox's BatchNorm divides by a sqrt: no rsqrt.
  _check(report, matmul=3, convolution=2, rsqrt=0)


def test_equinox_norms_widen_to_float32_but_batchnorm_does_not():
  eqx = pytest.importorskip("equinox")
  x = jnp.ones((4, 8), jnp.float16)
  for norm in (
    eqx.nn.LayerNorm(8),
    eqx.nn.RMSNorm(8),
    eqx.nn.GroupNorm(2, 8, channelwise_affine=False),
  ):
    report = fs.compute_dtypes(jax.vmap(norm), x)
    assert report.counts["sum"] and set(report.counts["sum"]) == {"float32"}
    assert report.counts["rsqrt"] == {"float32": 1}, norm
    assert jax.eval_shape(jax.vmap(norm), x).dtype == jnp.float16
  # BatchNorm's statistics: each example's in float32, rounded to float16,
  # then averaged over the batch (pmean) in float16.
  bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
    8, axis_name="batch", mode="batch"
  )
  batched = jax.vmap(
    bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
  )
  report = fs.compute_dtypes(eqx.filter_jit(batched), x, state)
  assert report.counts["sum"]["float16"] == 2  # the mean's and the var's


# ---------------------------------------------------------------------------
# Haiku: jmp's policies per module, BatchNorm in float32 (Haiku's ImageNet
# example, docs/porting-haiku.md); the loss needs no policy=.


def test_haiku_resnet_block_with_batchnorm():
  hk = pytest.importorskip("haiku")

  class ResNet(hk.Module):
    def __call__(self, x, is_training):
      bn = lambda: hk.BatchNorm(True, True, decay_rate=0.9)  # noqa: E731
      x = jax.nn.relu(bn()(hk.Conv2D(4, 3)(x), is_training))
      y = jax.nn.relu(bn()(hk.Conv2D(4, 3)(x), is_training))
      y = bn()(hk.Conv2D(4, 3)(y), is_training)
      return hk.Linear(10)(jnp.mean(jax.nn.relu(x + y), axis=(1, 2)))

  forward = hk.transform_with_state(lambda x, t: ResNet()(x, t))
  policy = fs.get_policy(POLICY)
  bn_policy = fs.get_policy("p=f32,c=f32,o=f16")
  hk.mixed_precision.set_policy(hk.BatchNorm, bn_policy)
  hk.mixed_precision.set_policy(ResNet, policy)
  try:
    # Shapes only: nothing runs (an eager init compiles op by op).
    init = lambda key: forward.init(key, IMAGES, True)  # noqa: E731
    params, state = jax.eval_shape(init, jax.random.key(0))

    def loss_fn(params, state, x, y):
      logits, state = forward.apply(params, state, None, x, True)
      return _xent(logits, y), state

    @jax.jit
    def step(params, state, opt_state, x, y):
      (loss, new), grads = fs.value_and_grad(loss_fn, opt_state, has_aux=True)(
        params, state, x, y
      )
      updates, opt_state = TX.update(grads, opt_state, params)
      state = fs.select_on_overflow(opt_state, new=new, old=state)
      return optax.apply_updates(params, updates), state, opt_state, loss

    args = params, state, jax.eval_shape(TX.init, params), IMAGES, LABELS
    report = fs.compute_dtypes(step, *args)
  finally:  # set_policy is global to the process
    hk.mixed_precision.clear_policy(hk.BatchNorm)
    hk.mixed_precision.clear_policy(ResNet)
  # Three convolutions (the first's input is the batch), one linear layer.
  _check(report, matmul=3, convolution=3 + 3 + 2, rsqrt=3)


# ---------------------------------------------------------------------------
# Keras 3: its own mixed_float16 dtype policy, the float32 on a last
# Activation (Keras's advice for the output).


@pytest.mark.parametrize("last", ["activation", "dense"])
def test_keras_model_with_batchnorm(last):
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported with {keras.backend.backend()} first")
  mixed = "mixed_float16"
  model = keras.Sequential(
    [
      keras.Input((8, 8, 1)),
      keras.layers.Conv2D(4, 3, activation="relu", dtype=mixed),
      keras.layers.BatchNormalization(dtype=mixed),
      keras.layers.Flatten(dtype=mixed),
      keras.layers.Dense(16, activation="relu", dtype=mixed),
      # docs/frameworks.md's Keras model ends in a float32 Dense.
      keras.layers.Dense(
        10, dtype=mixed if last == "activation" else "float32"
      ),
    ]
    + [keras.layers.Activation("linear", dtype="float32")]
    * (last == "activation")
  )
  trainable = [v.value for v in model.trainable_variables]
  non_trainable = [v.value for v in model.non_trainable_variables]
  assert {v.dtype for v in trainable + non_trainable} == {np.dtype("float32")}

  def loss_fn(trainable, non_trainable, x, y):
    logits, non_trainable = model.stateless_call(
      trainable, non_trainable, x, training=True
    )
    return _xent(logits, y), non_trainable

  @jax.jit
  def step(trainable, non_trainable, opt_state, x, y):
    (loss, new), grads = fs.value_and_grad(loss_fn, opt_state, has_aux=True)(
      trainable, non_trainable, x, y
    )
    updates, opt_state = TX.update(grads, opt_state, trainable)
    non_trainable = fs.select_on_overflow(opt_state, new=new, old=non_trainable)
    return optax.apply_updates(trainable, updates), non_trainable, loss

  args = trainable, non_trainable, TX.init(trainable), IMAGES, LABELS
  report = fs.compute_dtypes(step, *args)
  if last == "activation":
    # One convolution on the batch, two dense layers.
    _check(report, matmul=6, convolution=2, rsqrt=1)
    return
  # A float32 Dense: its product and both gradients in float32, named.
  assert report.counts["matmul"] == {"float16": 3, "float32": 3}
  assert report.first_float32.startswith("dot_general (tensor<4x16xf32>")
  assert "(Dense.call)" in report.first_float32
