"""fs.compute_dtypes: the ops of the lowered program counted by kind and
dtype, against counts, FLOPs and source lines derived by hand from small
functions written here."""

import inspect

import jax
from jax import lax
import jax.numpy as jnp
import pytest

import fp16_scaling as fs

F16, F32 = jnp.float16, jnp.float32


def _line_of(fun, text):
  """The line number of ``text`` in ``fun``'s source, in this file."""
  lines, start = inspect.getsourcelines(fun)
  return start + next(i for i, line in enumerate(lines) if text in line)


def mixed(w1, w2, x):
  h = x.astype(F16) @ w1.astype(F16)  # (4, 3) @ (3, 5), float16
  logits = h.astype(F32) @ w2  # (4, 5) @ (5, 2), float32
  return jnp.sum(jax.nn.log_softmax(logits))


W1, W2, X = jnp.ones((3, 5)), jnp.ones((5, 2)), jnp.ones((4, 3))


def test_counts_flops_and_the_first_float32_product_with_its_line():
  report = fs.compute_dtypes(mixed, W1, W2, X)
  assert report.counts["matmul"] == {"float16": 1, "float32": 1}
  # 2 FLOPs per multiply-add: 4*5 outputs of 3 terms; 4*2 outputs of 5.
  assert report.flops == {"float16": 2 * 4 * 5 * 3, "float32": 2 * 4 * 2 * 5}
  assert report.share("float16") == 120 / 200
  assert report.share("bfloat16") == 0.0
  # log_softmax: one exp, one log, its denominator and the sum, float32.
  assert report.counts["exp"] == report.counts["log"] == {"float32": 1}
  assert report.counts["sum"] == {"float32": 2}
  assert report.counts["convolution"] == report.counts["rsqrt"] == {}
  first = report.first_float32.splitlines()
  assert first[0] == (
    "dot_general (tensor<4x5xf32>, tensor<5x2xf32>) -> tensor<4x2xf32>"
  )
  line = _line_of(mixed, "h.astype(F32) @ w2")
  assert first[1] == f"  at {__file__}:{line} (mixed)"


def test_the_backward_pass_is_counted_and_its_sums_named_apart():
  def loss(w, b, x):
    bias = lax.broadcast_in_dim(b.astype(F16), (4, 5), (1,))  # one op
    y = x.astype(F16) @ w.astype(F16) + bias
    return jnp.mean(y.astype(F32) ** 2)

  grad = jax.value_and_grad(loss, argnums=(0, 1))
  report = fs.compute_dtypes(grad, W1, jnp.ones(5), X)
  # The product, then the weight's gradient (x's is not asked for).
  assert report.counts["matmul"] == {"float16": 2}
  assert report.share() == 1.0 and report.first_float32 is None
  # The mean, forward; the bias's gradient sums the float16 cotangent over
  # the batch (the transpose of the broadcast).
  assert report.counts["sum"] == {"float32": 1}
  assert report.counts["backward sum"] == {"float16": 1}


def test_a_product_without_contraction_has_one_multiply_per_output():
  # A batched outer product: dot_general with batch dims and no contracting
  # ones, (3, 5) and (3, 4) to (3, 5, 4).
  def outer(a, b):
    return lax.dot_general(a, b, (((), ()), ((0,), (0,))))

  report = fs.compute_dtypes(outer, jnp.ones((3, 5)), jnp.ones((3, 4)))
  assert report.flops == {"float32": 2 * 3 * 5 * 4}


def test_integer_and_complex_ops_are_not_counted():
  def products(i, c):
    return jnp.sum(i @ i), jnp.sum(c @ c)

  ints, complexes = jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2), jnp.complex64)
  report = fs.compute_dtypes(products, ints, complexes)
  assert report.counts["matmul"] == report.counts["sum"] == {}
  assert report.flops == {} and report.first_float32 is None


def test_convolution_flops_and_dtype():
  def conv(x, k):
    return lax.conv_general_dilated(
      x.astype(F16), k.astype(F16), (1, 1), "VALID"
    )

  # NCHW (1, 2, 5, 5) by OIHW (3, 2, 3, 3): (1, 3, 3, 3) outputs, each a
  # sum of 2*3*3 products.
  report = fs.compute_dtypes(
    conv, jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))
  )
  assert report.counts["convolution"] == {"float16": 1}
  assert report.flops == {"float16": 2 * 27 * 18}
  # Shapes alone do: no array is made.
  spec = jax.ShapeDtypeStruct
  shapes = spec((1, 2, 5, 5), F32), spec((3, 2, 3, 3), F32)
  assert fs.compute_dtypes(conv, *shapes) == report


def test_a_function_called_twice_counts_twice_a_loop_body_once():
  inner = jax.jit(lambda a, b: a @ b)

  def twice(a, b):
    return inner(inner(a, b), b)

  square = jnp.ones((3, 3))
  text = jax.jit(twice).lower(square, square).as_text()
  assert text.count("stablehlo.dot_general") == 1  # one function, two calls
  assert fs.compute_dtypes(twice, square, square).counts["matmul"] == {
    "float32": 2
  }

  def loop(a):
    return lax.scan(lambda c, _: (c @ a, None), a, None, length=3)[0]

  assert fs.compute_dtypes(loop, square).counts["matmul"] == {"float32": 1}


def test_each_branch_of_a_cond_counts_once():
  a16, a32 = jnp.ones((3, 3), F16), jnp.ones((3, 3))

  def either(p, a16, a32):
    return lax.cond(p, lambda: a16 @ a16, lambda: (a32 @ a32).astype(F16))

  report = fs.compute_dtypes(either, True, a16, a32)
  assert report.counts["matmul"] == {"float16": 1, "float32": 1}


def test_a_composite_counts_its_decomposition():
  # lax.composite (JAX's xla.scaled_dot is one): XLA inlines the
  # decomposition, a function of its own in the program, unless the backend
  # implements the composite.
  matmul = lax.composite(lambda a, b: a @ b, name="fs_test.matmul")
  report = fs.compute_dtypes(lambda a, b: matmul(a, b) @ b, X, W1 @ W1.T)
  assert report.counts["matmul"] == {"float32": 2}
  assert report.flops == {"float32": 2 * (2 * 4 * 3 * 3)}  # (4, 3) @ (3, 3)
  line = _line_of(test_a_composite_counts_its_decomposition, "= lax.composite")
  assert f"{__file__}:{line} " in report.first_float32


def test_a_custom_call_is_opaque():
  # A kernel XLA is handed whole (a Pallas kernel; cuDNN's attention): it
  # lowers without the kernel registered, and the ops around it count.
  def kernel(a):
    return jax.ffi.ffi_call(
      "fs_test_kernel", jax.ShapeDtypeStruct(a.shape, F16)
    )(a)

  report = fs.compute_dtypes(lambda a: kernel(a) @ a.astype(F16), W1.T @ W1)
  assert report.counts["matmul"] == {"float16": 1}
  assert report.flops == {"float16": 2 * 5 * 5 * 5}


def test_a_jitted_function_is_lowered_as_it_is_called():
  step = jax.jit(mixed, static_argnums=())
  assert fs.compute_dtypes(step, W1, W2, X) == fs.compute_dtypes(
    mixed, W1, W2, X
  )
  with pytest.raises(TypeError, match=r"fun must be a function, got a str"):
    fs.compute_dtypes("step", W1)


def test_the_printed_table():
  text = str(fs.compute_dtypes(mixed, W1, W2, X)).splitlines()
  assert text[0] == (
    "Matmul and convolution FLOPs (200): 60.0% float16, 0.0% bfloat16, "
    "40.0% float32"
  )
  assert text[1].split() == ["op", "float16", "bfloat16", "float32"]
  assert text[2].split() == ["matmul", "1", "0", "1"]
  assert [row.rsplit(None, 3)[0] for row in text[2:9]] == [
    "matmul",
    "convolution",
    "sum",
    "backward sum",
    "exp",
    "log",
    "rsqrt",
  ]
  assert text[9].startswith("First matmul/convolution in float32: dot_general")
  whole = fs.compute_dtypes(lambda x: x.astype(F16) @ x.astype(F16), W1.T @ W1)
  assert str(whole).endswith("No matmul or convolution runs in float32.")
