"""``fs.locate_overflow`` against planted faults: each names the op, the
module and the source line where the first float16 inf or NaN was made,
forward or backward, in Flax Linen and NNX, Equinox, Haiku and plain JAX
(nested ``jit``, ``custom_vjp``, ``scan``), and blames neither a ``-inf``
mask nor a model for a bad batch."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

POLICY = "p=f32,c=f16,o=f32"
SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line_of(tag):
  """The line of this file that ends with the comment ``# tag``."""
  return next(
    n for n, line in enumerate(SOURCE, 1) if line.endswith(f"# {tag}")
  )


def state_at(scale):
  """An optimizer state whose last step used ``scale``."""
  tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(scale)), optax.sgd(0.1))
  return tx.init({"w": jnp.zeros(1)})


def assert_at(found, tag, **fields):
  """``found`` names this file's line tagged ``tag``, and ``fields``."""
  assert (found.filename, found.lineno) == (__file__, line_of(tag)), found
  for name, want in fields.items():
    assert getattr(found, name) == want, (name, found)


def locate_half(loss, *args, scale=2.0**10, cast_args=(1,)):
  """``fs.locate_overflow`` of ``loss`` on ``args`` at ``scale``, computed
  in float16 by the policy (``cast_args`` too) from float32 arrays."""
  state = state_at(scale)
  locate = fs.locate_overflow(loss, state, policy=POLICY, cast_args=cast_args)
  return locate(*args)


def mean_square(y):
  return jnp.mean(jnp.square(y.astype(jnp.float32)))


# Flax Linen: a forward overflow in the second layer, computed in float16
# by the policy from float32 parameters.


def linen_mlp():
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(16)(x))
      return nn.Dense(4)(h)  # linen-dense-1

  model = MLP()
  x = jax.random.normal(jax.random.key(0), (8, 8))
  params = jax.jit(model.init)(jax.random.key(1), x)
  return model, params, x


def test_a_linen_mlp_forward_overflow_is_named_by_module_and_line():
  model, params, x = linen_mlp()
  params["params"]["Dense_1"]["kernel"] = jnp.full((16, 4), 3e4)

  def loss(params, x):
    return mean_square(model.apply(params, x))

  found = locate_half(loss, params, x)
  assert_at(
    found,
    "linen-dense-1",
    kind="forward",
    primitive="dot_general",
    shape=(8, 4),
    dtype="float16",
    module="['params']['Dense_1']",
    scope="MLP/Dense_1",
    layers=(),
  )
  assert found.max_input < 65504 < found.float32_max < np.inf
  assert "fs.float32" in str(found)


def test_a_backward_only_overflow_names_the_op_and_the_scale_that_fits():
  # The forward pass stays finite; the cotangent of Dense_1's input, the
  # loss's S / 32 (a mean of 8 x 4 outputs) times a row of the kernel,
  # summed (4 x 300), leaves float16's range at 2^12.
  model, params, x = linen_mlp()
  params["params"]["Dense_1"]["kernel"] = jnp.full((16, 4), 300.0)

  def loss(params, x):
    return jnp.mean(model.apply(params, x).astype(jnp.float32))

  def locate(scale):
    at = fs.locate_overflow(loss, state_at(scale), policy=POLICY)
    return at(params, x.astype(jnp.float16))

  found = locate(2.0**12)
  assert_at(
    found,
    "linen-dense-1",
    kind="backward",
    primitive="dot_general",
    shape=(8, 16),
    module="['params']['Dense_1']",
    scope="MLP/Dense_1",
  )
  # Each element of that cotangent is 2^12 / 32 * 4 * 300 = 153600 in
  # float32 (sums of four equal float16 products, exact); 2^10 is the
  # largest power of two that brings it under 65504.
  assert found.float32_max == 153600.0
  assert found.safe_scale == 2.0**10
  # There the next op overflows: Dense_0's bias gradient sums, over the
  # batch's 8 rows, the 38400s (at 2^10) that ReLU lets through: 7 rows
  # for one unit in this draw, 268800, which fits at 2^7, as the step does.
  second = locate(2.0**10)
  assert (second.kind, second.primitive, second.scope, second.module) == (
    "backward",
    "reduce_sum",
    "MLP/Dense_0",
    None,
  )
  assert second.float32_max == 7 * 38400.0
  assert found.step_scale == second.safe_scale == second.step_scale == 2.0**7
  assert locate(2.0**7).kind == "none"
  assert locate(2.0**8).kind == "backward"
  assert "init_scale=128" in str(found)


def test_a_bad_batch_or_parameter_is_named_as_the_input_a_clean_one_not():
  model, params, x = linen_mlp()

  def loss(params, batch):
    return mean_square(model.apply(params, batch["x"]))

  def locate(params, batch):
    return locate_half(loss, params, batch, scale=2.0**15)

  bad = locate(params, {"x": x.at[3, 1].set(jnp.nan)})
  assert (bad.kind, bad.input_path, bad.primitive) == (
    "input",
    "args[1]['x']",
    None,
  )
  assert "bad batch" in str(bad)
  diverged = jax.tree.map(lambda a: a, params)  # a copy of the dicts
  kernel = diverged["params"]["Dense_0"]["kernel"]
  diverged["params"]["Dense_0"]["kernel"] = kernel.at[0, 0].set(jnp.inf)
  found = locate(diverged, {"x": x})
  assert (found.kind, found.input_path) == (
    "input",
    "args[0]['params']['Dense_0']['kernel']",
  )
  clean = locate(params, {"x": x})
  assert (clean.kind, clean.scale, clean.primitive) == ("none", 2.0**15, None)
  assert str(clean).startswith("Nothing overflows at loss scale 2^15 ")


# Flax NNX: causal attention that masks with -inf (an inf made on purpose)
# before its output projection overflows.


def test_an_nnx_attention_overflow_is_found_past_its_minus_inf_mask():
  nnx = pytest.importorskip("flax.nnx")

  class Attention(nnx.Module):
    def __init__(self, d, rngs):
      dense = lambda: nnx.Linear(d, d, dtype=jnp.float16, rngs=rngs)
      self.q, self.k, self.v, self.out = dense(), dense(), dense(), dense()

    def __call__(self, x):
      s = self.q(x) @ self.k(x).T
      causal = jnp.tril(jnp.ones(s.shape, bool))
      s = jnp.where(causal, s, -jnp.inf)  # nnx-mask
      return self.out(jax.nn.softmax(s) @ self.v(x))  # nnx-out

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.attn = Attention(8, rngs)

  model = Model(nnx.Rngs(0))
  opt = nnx.Optimizer(
    model,
    fs.chain(fs.fp16_loss_scale(fs.static_scaler(2.0**8)), optax.sgd(0.1)),
    wrt=nnx.Param,
  )
  x = jnp.abs(jax.random.normal(jax.random.key(2), (6, 8), jnp.float16))

  def loss(model, x):
    return mean_square(model.attn(x))

  locate = fs.locate_overflow(loss, opt)
  assert locate(model, x).kind == "none"  # the -inf alone: nothing
  model.attn.v.kernel[...] = jnp.full((8, 8), 0.5)
  model.attn.out.kernel[...] = jnp.full((8, 8), 2e4)
  found = locate(model, x)
  assert_at(
    found,
    "nnx-out",
    kind="forward",
    primitive="dot_general",
    module=".attn.out",
    constant=False,
  )


def test_a_minus_inf_that_an_op_carries_is_not_blamed_for_its_overflow():
  # The product holds the mask's -inf where it masks, and a new inf where
  # 500 * 200 leaves float16's range: the multiply is the origin.
  def loss(w, x):
    s = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), x * w, -jnp.inf)
    return mean_square(jax.nn.softmax(s * 200.0))  # mask-times

  x = jnp.full((4, 4), 500.0, jnp.float16)
  found = fs.locate_overflow(loss, state_at(1.0))(jnp.float16(1.0), x)
  assert_at(
    found,
    "mask-times",
    kind="forward",
    primitive="mul",
    module=None,
    constant=False,
  )


def test_a_row_masked_whole_is_blamed_on_its_constant_inf():
  # A row of -inf only: softmax's x - max(x) is -inf - -inf, a NaN that
  # reaches the loss from the mask alone.
  def loss(w, x):
    rows = jnp.arange(4)[:, None] > 0  # row 0 masked whole
    s = jnp.where(rows, x * w, -jnp.inf)  # mask-all
    return mean_square(jax.nn.softmax(s))

  x = jnp.ones((4, 4), jnp.float16)
  found = fs.locate_overflow(loss, state_at(1.0))(jnp.float16(1.0), x)
  assert_at(found, "mask-all", kind="forward", constant=True)
  assert "a row masked entirely?" in found.advice()


def test_a_log_or_division_of_zero_is_not_sent_to_float32():
  # exp(-20) ~ 2e-9 is under float16's smallest subnormal, 6e-8: the
  # softmax's second probability is 0 in float16, and its log -inf. In
  # float32, from the same inputs, the log is -inf too: no float32 op
  # fixes it; its input, made in float32 or in the log domain, does.
  def loss(w, x):
    p = jax.nn.softmax(x * w)
    return -jnp.mean(jnp.log(p).astype(jnp.float32))  # log-of-0

  locate = fs.locate_overflow(loss, state_at(1.0))
  x = jnp.array([20.0, 0.0], jnp.float16)
  found = locate(jnp.float16(1.0), x)
  assert_at(found, "log-of-0", kind="forward", primitive="log")
  assert (found.max_input, found.float32_max) == (1.0, np.inf)
  assert "jax.nn.log_softmax" in found.advice()
  assert "wrap the function that computes it" not in found.advice()

  # x / 0: inf and 0 / 0's NaN in float32 alike.
  def ratio(w, x):
    return jnp.mean((x / jnp.sum(x * w)).astype(jnp.float32))  # div-by-0

  found = fs.locate_overflow(ratio, state_at(1.0))(jnp.float16(0.0), x)
  assert_at(found, "div-by-0", kind="forward", primitive="div")
  assert found.float32_max == np.inf
  assert "division" in found.advice()


# Equinox: an MLP whose last layer overflows, applied with jax.vmap.


def test_an_equinox_mlp_overflow_is_named_by_its_layer():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(3))
  model = eqx.tree_at(
    lambda m: m.layers[2].weight, model, jnp.full((4, 16), 1e4)
  )
  x = 10 * jax.random.normal(jax.random.key(4), (8, 8))

  def loss(model, x):
    return mean_square(jax.vmap(model)(x))  # eqx-call

  found = locate_half(loss, model, x)
  assert_at(
    found,
    "eqx-call",
    kind="forward",
    primitive="dot_general",
    module=".layers[2]",
  )


# Haiku: a ResNet block whose BatchNorm squares float16 activations past
# 256 for its variance: the first inf is the BatchNorm's, not a layer's.


def test_a_haiku_resnet_block_overflow_is_named_in_its_batchnorm():
  hk = pytest.importorskip("haiku")

  class Block(hk.Module):
    def __call__(self, x, is_training):
      h = hk.Conv2D(4, 3, name="conv_0")(x)
      h = hk.BatchNorm(True, True, 0.9, name="bn_0")(h, is_training)
      h = hk.Conv2D(4, 3, name="conv_1")(jax.nn.relu(h))
      h = hk.BatchNorm(True, True, 0.9, name="bn_1")(h, is_training)  # hk-bn
      return jax.nn.relu(h + x)

  net = hk.transform_with_state(lambda x, t: Block(name="block")(x, t))
  x = jax.random.normal(jax.random.key(5), (2, 6, 6, 4))
  params, state = jax.jit(net.init, static_argnums=2)(
    jax.random.key(6), x, True
  )
  params["block/conv_1"]["w"] *= 3000.0

  def loss(params, state, x):
    y, _ = net.apply(params, state, None, x, True)
    return mean_square(y)

  found = locate_half(loss, params, state, x, cast_args=(2,))
  assert_at(
    found,
    "hk-bn",
    kind="forward",
    module="['block/conv_1']",
    scope="block/bn_1",
  )
  assert found.primitive in ("integer_pow", "square", "mul")


# A scanned stack: nn.scan's layers stacked on axis 0; the third overflows.


def test_a_scanned_stack_names_the_layer_index():
  nn = pytest.importorskip("flax.linen")

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.relu(nn.Dense(8)(x)), None  # scan-dense

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      layers = nn.scan(
        Layer,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=4,
      )
      return layers(name="layers")(x, None)[0]

  model = Stack()
  x = 10 * jax.random.normal(jax.random.key(7), (4, 8))
  params = jax.jit(model.init)(jax.random.key(8), x)
  kernel = params["params"]["layers"]["Dense_0"]["kernel"]
  params["params"]["layers"]["Dense_0"]["kernel"] = kernel.at[2].set(3e4)

  def loss(params, x):
    return mean_square(model.apply(params, x))

  found = locate_half(loss, params, x)
  assert_at(
    found,
    "scan-dense",
    kind="forward",
    primitive="dot_general",
    module="['params']['layers']['Dense_0']",
    layers=(2,),
  )


# Plain JAX: a jitted function inside the loss, a custom_vjp whose backward
# rule overflows, a lax.scan over stacked layers and a checkpoint.


@jax.jit
def exp_inside_jit(x):
  return jnp.exp(x)  # jit-exp


@jax.custom_vjp
def amplify_grad(x):
  return x


def _amplify_fwd(x):
  return x, None


def _amplify_bwd(_, g):
  return (g * 4000.0,)


amplify_grad.defvjp(_amplify_fwd, _amplify_bwd)


def test_plain_jax_nested_jit_custom_vjp_cond_and_scan_are_entered():
  def loss(params, x):
    def layer(h, w):
      return jax.checkpoint(jnp.tanh)(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["layers"])
    g = amplify_grad(h) * params["gain"]  # vjp-call
    y = jax.lax.cond(jnp.all(h > 0), exp_inside_jit, jnp.negative, g)
    return mean_square(y)

  x = jnp.ones((4, 8), jnp.float16)
  params = {
    "layers": jnp.ones((3, 8, 8), jnp.float16) / 8,
    "gain": jnp.float16(1.0),
  }
  locate = fs.locate_overflow(loss, state_at(2.0**10))
  found = locate(params, x)
  # JAX records a custom_vjp's backward ops at the line that calls it.
  assert_at(found, "vjp-call", kind="backward", primitive="mul", module=None)
  found = locate(dict(params, gain=jnp.float16(32.0)), x)
  assert_at(found, "jit-exp", kind="forward", primitive="exp", module=None)


def test_a_while_loop_runs_whole_as_one_op():
  # A while loop is not differentiated: here it works on the batch. (A
  # fori_loop of static bounds is a scan, entered.)
  def loss(w, x):
    def body(carry):
      i, h = carry
      return i + 1, h * x

    _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))  # while-loop
    return mean_square(h * w)

  x = jnp.full(2, 100.0, jnp.float16)  # 100^4 is past 65504
  found = fs.locate_overflow(loss, state_at(1.0))(jnp.ones(2, jnp.float16), x)
  # The loop's outputs are its counter and h: the shape and dtype are h's.
  assert_at(
    found,
    "while-loop",
    kind="forward",
    primitive="while",
    shape=(2,),
    dtype="float16",
  )


def test_a_stack_the_report_names_whole_is_named_by_its_layer():
  # A forward overflow in layer 2 of a lax.scan stack: every layer's
  # gradient is non-finite, so the report, by layer (stacked_under), names
  # all four; the locator names layer 2, at the line of its matmul.
  def loss(params, x):
    def layer(h, w):
      return jax.nn.relu(h @ w), None  # stack-matmul

    h, _ = jax.lax.scan(layer, x, params["layers"]["w"])
    return mean_square(h @ params["head"])

  w = jnp.full((4, 8, 8), 0.5, jnp.float16).at[2].set(3e3)
  params = {"layers": {"w": w}, "head": jnp.ones((8, 2), jnp.float16)}
  x = jnp.ones((2, 8), jnp.float16)
  tx = fs.chain(
    fs.fp16_loss_scale(
      fs.torch_scaler(init_scale=2.0**8),
      stacked_axes=fs.stacked_under("layers"),
    ),
    optax.sgd(0.1),
  )

  @jax.jit
  def step(params, opt_state, x):
    value, grads = fs.value_and_grad(loss, opt_state)(params, x)
    return tx.update(grads, opt_state, params, value=value)[1]

  with pytest.warns(UserWarning, match="some params are float16"):
    opt_state = step(params, tx.init(params), x)
  report = fs.overflow_report(opt_state)
  assert (report.kind, report.nonfinite_layers) == ("forward", (0, 1, 2, 3))
  assert (report.scale, report.next_scale) == (2.0**8, 2.0**7)
  assert "fs.locate_overflow(loss_fn, opt_state)(params, *batch)" in str(report)
  found = fs.locate_overflow(loss, opt_state)(params, x)
  assert_at(
    found,
    "stack-matmul",
    kind="forward",
    primitive="dot_general",
    module="['layers']",
    layers=(2,),
    scale=2.0**8,  # the step's scale, not the next one
  )


def test_only_a_report_of_an_overflow_step_points_to_the_locator():
  tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(4.0)), optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  clean = tx.update({"w": jnp.ones(2)}, state, params)[1]
  bad = tx.update({"w": jnp.array([jnp.inf, 1.0])}, clean, params)[1]
  pointer = "print(fs.locate_overflow(loss_fn, opt_state)(params, *batch))"
  assert pointer not in str(fs.overflow_report(clean))
  assert pointer in str(fs.overflow_report(bad))
  with pytest.raises(fs.MinLossScaleError, match="fs.locate_overflow"):
    fs.raise_if_min_scale_reached(bad, max_floor_overflows=1)


def test_bad_arguments_are_refused_by_name():
  def loss(w):
    return jnp.sum(w)

  with pytest.raises(ValueError, match="locate_overflow: scale must be"):
    fs.locate_overflow(loss, state_at(1.0), scale=-1.0)
  with pytest.raises(ValueError, match="no fp16_loss_scale state"):
    fs.locate_overflow(loss, {"w": jnp.ones(1)})
  with pytest.raises(TypeError, match="locate_overflow runs on the host"):
    jax.jit(lambda state: fs.locate_overflow(loss, state))(state_at(1.0))
