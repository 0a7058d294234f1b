"""fs.float32, and docs/float32-ops.md: every row of its table checked on the
jaxpr's dtypes, its measured log_softmax errors recomputed, its code run."""

import pathlib
import re

import docs_snippets
import helpers
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "float32-ops.md"
F16, BF16, F32 = map(jnp.dtype, ("float16", "bfloat16", "float32"))


# ---------------------------------------------------------------------------
# The wrapper.


def test_half_inputs_widen_and_the_rest_pass_unchanged():
  seen = {}

  def fn(a, b, *, c, n, key, s):
    seen.update(a=a.dtype, b=b["w"].dtype, c=c.dtype, n=n.dtype, s=s)
    seen["key"] = key
    return a + b["w"] + c

  key = jax.random.key(0)
  out = fs.float32(fn)(
    jnp.ones(2, F16),
    {"w": jnp.ones(2, BF16)},
    c=np.ones(2, np.float16),  # numpy's float16 too
    n=jnp.arange(2),
    key=key,
    s=0.5,
  )
  assert out.dtype == F32
  assert (seen["a"], seen["b"], seen["c"]) == (F32, F32, F32)
  assert seen["n"] == jnp.int32 and seen["key"] is key and seen["s"] == 0.5


def test_float32_and_float64_inputs_are_not_touched():
  x = jnp.ones(2, F32)
  assert fs.float32(lambda a: a)(x) is x
  y = np.ones(2, np.float64)  # float64 without jax's x64 mode: numpy's
  assert fs.float32(lambda a: a)(y) is y


def test_half_outputs_are_widened_too():
  const = jnp.ones(2, F16)
  out = fs.float32(lambda a: (a, const, jnp.arange(2)))(jnp.ones(2, F32))
  assert [o.dtype for o in out] == [F32, F32, jnp.int32]


def test_keep_dtype_rounds_the_float32_result_once():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)) * 8, F16)
  wide = fs.float32(jax.nn.log_softmax)(x)
  kept = fs.float32(jax.nn.log_softmax, keep_dtype=True)(x)
  assert kept.dtype == F16
  # Bit for bit the float32 result, rounded to float16 once.
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(wide.astype(F16)))
  bf = fs.float32(jax.nn.softmax, keep_dtype=True)(x.astype(BF16))
  assert bf.dtype == BF16
  # Both half dtypes in: float32 out, as JAX promotes them.
  both = fs.float32(lambda a, b: a + b, keep_dtype=True)
  assert both(x, x.astype(BF16)).dtype == F32


def test_decorator_forms():
  @fs.float32
  def f(a):
    return jnp.exp(a)

  @fs.float32(keep_dtype=True)
  def g(a):
    """Doc."""
    return jnp.exp(a)

  x = jnp.ones(2, F16)
  assert f(x).dtype == F32 and g(x).dtype == F16
  assert g.__name__ == "g" and g.__doc__ == "Doc."


def test_gradients_flow_through_the_casts_in_the_inputs_dtype():
  # d/dx sum(log_softmax(x)) = 1 - n * softmax(x); in float32 inside, the
  # cotangent cast back to float16 at the input.
  x = jnp.asarray([0.5, 1.0, 3.0], F16)
  g = jax.grad(lambda a: jnp.sum(fs.float32(jax.nn.log_softmax)(a)))(x)
  assert g.dtype == F16
  x64 = np.asarray(x, np.float64)
  p = np.exp(x64 - x64.max()) / np.exp(x64 - x64.max()).sum()
  # One float16 rounding of a float32-accurate value: 2**-11 relative.
  np.testing.assert_allclose(np.asarray(g, np.float64), 1 - 3 * p, rtol=2**-11)


def test_under_jit_and_vmap():
  f = jax.jit(jax.vmap(fs.float32(jax.nn.logsumexp)))
  assert f(jnp.ones((3, 4), F16)).dtype == F32


def test_bad_arguments_are_named():
  with pytest.raises(TypeError, match="fn must be a function"):
    fs.float32(3)
  with pytest.raises(TypeError, match="keep_dtype must be True or False"):
    fs.float32(jnp.exp, keep_dtype="yes")


def test_a_norm_of_float16_values_of_300_overflows_unless_wrapped():
  x = jnp.full((1000,), 300.0, F16)  # each square, 90,000, is past 65504
  assert jnp.isinf(jnp.linalg.norm(x))
  wide = fs.float32(jnp.linalg.norm)(x)
  # sqrt(1000) * 300 = 9486.83; float32 sums of 1000 exact squares (9e4
  # each, exact in float32): relative error under 1000 * 2**-24.
  np.testing.assert_allclose(float(wide), np.sqrt(1000.0) * 300, rtol=1e-4)


@pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="XLA's CPU SVD refuses float16"
)
def test_the_cpu_svd_refuses_float16_and_runs_wrapped():
  x = jnp.eye(3, dtype=F16)

  def nuc(a):
    return jnp.linalg.norm(a, "nuc")

  with pytest.raises(Exception, match="float16"):
    jax.jit(nuc)(x)
  # The nuclear norm of the identity is its size; float32 SVD rounding.
  np.testing.assert_allclose(float(fs.float32(nuc)(x)), 3.0, rtol=1e-6)


# ---------------------------------------------------------------------------
# The page's table, row by row, on the jaxpr.


def _prims(cell):
  """The backquoted primitive names of a table cell."""
  return re.findall(r"`(\w+)`", cell)


def _ops_rows():
  """``[(torch op cell, JAX code, float16 prims, float32 prims, out, wrap)]``
  of the page's op table (the rows whose JAX cell is code)."""
  rows = []
  for first, cells in helpers.table_rows(PAGE.read_text()).items():
    if len(cells) == 5 and cells[0].startswith("`"):
      code, half, wide, out, wrap = cells
      rows.append(
        (first, code.strip("`"), _prims(half), _prims(wide), out, wrap)
      )
  return rows


def test_the_table_has_its_rows():
  # One row per op family of torch 2.13.0's lists plus the attention rows;
  # tests/peers/test_float32_ops_list.py checks the list against torch's
  # header.
  assert len(_ops_rows()) == 56


# Every equation of a jaxpr and of the jaxprs inside its equations (jit,
# custom_jvp, scan bodies).
_eqns = helpers.jaxpr_eqns


def _namespace():
  nn = pytest.importorskip("flax.linen")
  nnx = pytest.importorskip("flax.nnx")

  def linen(module, x):
    return module.apply(module.init(jax.random.key(0), x), x)

  return dict(
    jax=jax, jnp=jnp, lax=lax, optax=optax, nn=nn, nnx=nnx, linen=linen
  )


def _inputs():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.uniform(0.1, 0.9, size=(2, 4, 4, 8)), F16)
  y = jnp.asarray(rng.uniform(0.1, 0.9, size=(2, 4, 4, 8)), F16)
  labels = jnp.asarray(rng.integers(0, 8, size=(2, 4, 4)), jnp.int32)
  return x, y, labels


def _floating_operands(e):
  return {
    v.aval.dtype
    for v in e.invars
    if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)
  }


def _operands_of(eqns, prim):
  """The floating operand dtypes of each ``prim`` equation that has
  floating operands (an ``add`` of integer indices is not the row's)."""
  got = [_floating_operands(e) for e in eqns if e.primitive.name == prim]
  return [g for g in got if g]


def _read(code, wrap):
  """The jaxpr's equations and the output dtype of ``code`` on the float16
  inputs, run in fs.float32 when ``wrap``."""
  ns = _namespace()

  def f(x, y, labels):
    return eval(code, ns, dict(x=x, y=y, labels=labels))

  jaxpr = jax.make_jaxpr(fs.float32(f) if wrap else f)(*_inputs())
  (out,) = jaxpr.out_avals
  return _eqns(jaxpr.jaxpr, []), out.dtype


@pytest.mark.parametrize("row", _ops_rows(), ids=lambda r: r[0][:40])
def test_each_rows_claim_holds_on_the_jaxpr(row):
  _, code, half, wide, out, wrap = row
  try:
    eqns, dtype = _read(code, wrap=False)
  except TypeError as e:  # newer JAX refuses it when tracing, not XLA
    assert "float16" in str(e) and "refuses float16" in wrap, (code, e)
    eqns, dtype = None, None
  # A listed primitive may be spelled otherwise by another JAX (0.12 has a
  # log2 primitive where 0.10 has log and div): each cell's primitives
  # that are in the jaxpr run in its dtype, and at least one of them is.
  if eqns is not None:
    assert dtype == jnp.dtype(out), (code, dtype)
    for prims, want in ((half, F16), (wide, F32)):
      found = [g for prim in prims for g in _operands_of(eqns, prim)]
      assert found or not prims, f"{code}: none of {prims} in the jaxpr"
      assert all(g == {want} for g in found), (code, prims, found)
  # Under fs.float32 every listed primitive runs in float32, out in float32.
  eqns, dtype = _read(code, wrap=True)
  assert dtype == F32
  found = [g for prim in half + wide for g in _operands_of(eqns, prim)]
  assert found and all(g == {F32} for g in found), (code, found)
  # The advice follows the reading: wrap what runs in float16 (unless it
  # is exact), not what JAX already runs in float32.
  if not half:
    assert wrap.startswith("no"), row
  elif wrap.startswith("no"):
    assert "exact" in wrap, row
  else:
    assert wrap.startswith("yes"), row


def test_the_row_check_can_fail():
  # A row that claims float32 for a float16 exp is caught by the reading.
  eqns, _ = _read("jnp.exp(x)", wrap=False)
  (e,) = [e for e in eqns if e.primitive.name == "exp"]
  assert _floating_operands(e) == {F16}


def wrapped(**kwargs):
  return fs.float32(jax.nn.log_softmax, **kwargs)


def test_log_softmax_runs_exp_and_log_in_float32_when_wrapped():
  x = jnp.zeros((4, 16), F16)
  for f, want in ((jax.nn.log_softmax, F16), (wrapped(), F32)):
    eqns = _eqns(jax.make_jaxpr(f)(x).jaxpr, [])
    for prim in ("exp", "log"):
      got = _operands_of(eqns, prim)
      assert got and all(g == {want} for g in got), (prim, got)


# ---------------------------------------------------------------------------
# The page's measured errors.


def _errors(std):
  """Max and mean |error| against float64 of log_softmax on float16 logits
  (8, 32000), normal with ``std``: plain, wrapped, wrapped with keep_dtype."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 32000)) * std, F16)
  x64 = np.asarray(x, np.float64)
  top = x64.max(-1, keepdims=True)
  ref = x64 - top - np.log(np.exp(x64 - top).sum(-1, keepdims=True))
  out = []
  for f in (jax.nn.log_softmax, wrapped(), wrapped(keep_dtype=True)):
    err = np.abs(np.asarray(jax.jit(f)(x), np.float64) - ref)
    out += [err.max(), err.mean()]
  return np.array(out)


@pytest.mark.parametrize("std", [4, 16])
def test_measured_log_softmax_errors_are_the_pages(std):
  errors = _errors(std)
  plain_max, plain_mean, wide_max, wide_mean, kept_max, kept_mean = errors
  # Wrapped is far closer to float64 than the float16 computation...
  assert wide_max * 1000 < plain_max and wide_mean * 1000 < plain_mean
  # ...and handed back in float16 it is never worse.
  assert kept_max <= plain_max and kept_mean <= plain_mean
  print(f"std {std}: " + " ".join(f"{e:.3g}" for e in errors))
  page = helpers.table_rows(PAGE.read_text())[f"std {std}"]
  page = np.array([float(c) for c in page])
  # The figures are the backend's exp and log roundings (3 digits printed);
  # another CPU's implementation may round a few elements differently: a
  # factor of 1.5 leaves that and still catches a stale page (the columns
  # differ by factors of 1,000 or more, plain against wrapped).
  within = np.all(errors < page * 1.5) and np.all(errors > page / 1.5)
  assert within, (errors, page)


def test_page_code_runs():
  pytest.importorskip("flax.nnx")
  ns = {}
  assert docs_snippets.run_page("float32-ops.md", ns) == 2
  # The page's NNX attention: projections in float16, the attention's
  # products and softmax in float32, float16 out.
  nnx = ns["nnx"]

  def read(module):  # a new function per module: make_jaxpr caches by it
    graphdef, state = nnx.split(module)

    def run(st, x):
      return nnx.merge(graphdef, st)(x, deterministic=False)

    return jax.make_jaxpr(run)(state, ns["tokens"])

  jaxpr = read(ns["mha"])
  eqns = _eqns(jaxpr.jaxpr, [])
  assert jaxpr.out_avals[0].dtype == F16
  assert _operands_of(eqns, "exp") == [{F32}]
  dots = _operands_of(eqns, "dot_general")
  assert dots.count({F32}) == 2 and dots.count({F16}) == 4, dots
  # Without the wrapper's dtype=None the softmax is float16 again.
  plain = nnx.MultiHeadAttention(
    num_heads=4,
    in_features=16,
    dtype=F16,
    dropout_rate=0.1,
    attention_fn=fs.float32(nnx.dot_product_attention, keep_dtype=True),
    decode=False,
    rngs=nnx.Rngs(0),
  )
  eqns = _eqns(read(plain).jaxpr, [])
  assert _operands_of(eqns, "exp") == [{F16}]
