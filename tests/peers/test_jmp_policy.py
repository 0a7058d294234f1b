"""fs.get_policy against jmp.get_policy (jmp 0.0.4) for every spec of jmp's
grammar, fs.Policy's casts against jmp.Policy's, and an fs.Policy in Haiku's
hk.mixed_precision.set_policy training an MLP with no jmp in its code."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling import _policy

jmp = pytest.importorskip("jmp")

KEY_ALIASES = (("p", "params"), ("c", "compute"), ("o", "output"))
DTYPE_NAMES = ("full", "f32", "float32", "f16", "float16", "bf16")
DTYPE_NAMES += ("bfloat16", "half", "f64", "float64")


def _jmp_half_is_float16() -> bool:
  # jmp's half asks the first local device: bfloat16 on TPU only.
  return jax.local_devices()[0].platform != "tpu"


def _comparable(specs):
  """``specs``, less those naming ``half`` where jmp's half is bfloat16 (a
  TPU): there the one designed difference parts the two."""
  return [s for s in specs if _jmp_half_is_float16() or "half" not in s]


def _every_spec():
  """Every spec of jmp's grammar: one dtype name alone, and every non-empty
  set of keys (each under each of its aliases, in every order) with every
  dtype name for each."""
  yield from DTYPE_NAMES
  for n in (1, 2, 3):
    for keys in itertools.combinations(range(3), n):
      for aliases in itertools.product(*(KEY_ALIASES[k] for k in keys)):
        orders = itertools.permutations(aliases) if n < 3 else [aliases]
        for order in orders:
          for names in itertools.product(DTYPE_NAMES, repeat=n):
            yield ",".join(f"{k}={v}" for k, v in zip(order, names))
  # Three keys in every order (each dtype name set once per order).
  for order in itertools.permutations(("params", "c", "output")):
    for names in itertools.product(("f16", "bf16", "full"), repeat=3):
      yield ",".join(f"{k}={v}" for k, v in zip(order, names))


def _dtypes(policy):
  return tuple(
    jnp.dtype(getattr(policy, f))
    for f in ("param_dtype", "compute_dtype", "output_dtype")
  )


def test_every_spec_gives_jmps_three_dtypes():
  specs = list(_every_spec())
  assert len(specs) > 9000  # 10 + 3*2*10 + 3*4*2*100 + 8*1000 + 6*27
  for spec in _comparable(specs):
    assert _dtypes(fs.get_policy(spec)) == _dtypes(jmp.get_policy(spec)), spec


def test_the_string_form_is_jmps():
  for spec in _comparable(_every_spec()):
    assert str(fs.get_policy(spec)) == str(jmp.get_policy(spec)), spec


def test_half_is_the_one_designed_difference():
  # jmp's half follows the platform (bfloat16 on TPU); fs's is float16
  # everywhere. Where jmp's half_dtype says bfloat16 the two part.
  half = jnp.dtype(jmp.half_dtype())
  assert _dtypes(fs.get_policy("half")) == (jnp.dtype(jnp.float16),) * 3
  assert (half == jnp.float16) == _jmp_half_is_float16()


@pytest.mark.parametrize(
  "spec", ["q=f16", "c=f8", "float", "", "c=f16,bf16", "params=half,out=f32"]
)
def test_what_jmp_refuses_fs_refuses(spec):
  # jmp raises ValueError on each; fs too, naming the key or the dtype.
  with pytest.raises(ValueError):
    jmp.get_policy(spec)
  with pytest.raises(ValueError):
    fs.get_policy(spec)


def test_casts_match_jmps_on_a_mixed_tree():
  tree = {
    "w": jnp.linspace(-3, 70000, 7),  # past float16's range: inf as in jmp
    "b": np.linspace(0, 1, 3),
    "n": jnp.arange(3),
    "key": jax.random.PRNGKey(0),
    "none": None,
  }
  for spec in ("p=f32,c=f16,o=f32", "p=bf16,c=f32,o=f16", "f16"):
    ours, theirs = fs.get_policy(spec), jmp.get_policy(spec)
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
      a = getattr(ours, method)(tree)
      b = getattr(theirs, method)(tree)
      assert jax.tree.structure(a) == jax.tree.structure(b)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and type(x) is type(y), (spec, method)
        np.testing.assert_array_equal(x, y)


def test_a_jmp_policy_is_read_as_an_fs_policy():
  for spec in ("p=f32,c=f16,o=f32", "p=bf16,c=f32", "c=f16"):
    assert _policy.as_policy(jmp.get_policy(spec)) == fs.get_policy(spec)
  spec = "p=f32,c=bf16,o=f32"
  ours = fs.get_policy(spec).with_output_dtype(jnp.float16)
  theirs = jmp.get_policy(spec).with_output_dtype(jnp.float16)
  assert _dtypes(ours) == _dtypes(theirs)
  assert str(ours) == str(theirs) == "p=full,c=bf16,o=f16"


def test_value_and_grad_takes_a_jmp_policy_as_an_fs_policy():
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
  x = jnp.linspace(0.0, 2.0, 6).reshape(2, 3)
  tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(2.0**8)), optax.sgd(0.1))
  state = tx.init(params)

  def loss(p, x):
    return jnp.mean(jnp.tanh(x.astype(p["w"].dtype) @ p["w"] + p["b"]) ** 2)

  spec = "p=f32,c=f16,o=f32"

  def run(policy):
    def grad(p, s, x):
      return fs.value_and_grad(loss, s, policy=policy)(p, x)

    return jax.jit(grad)(params, state, x)

  results = [run(p) for p in (jmp.get_policy(spec), fs.get_policy(spec), spec)]
  for value, grads in results[1:]:
    assert _bits(value) == _bits(results[0][0])
    assert _bits(grads) == _bits(results[0][1])
  assert {g.dtype for g in jax.tree.leaves(results[0][1])} == {
    jnp.dtype(jnp.float32)
  }


def _bits(tree):
  return [(x.dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


# ---------------------------------------------------------------------------
# Haiku: hk.mixed_precision.set_policy takes an fs.Policy.


def _train_haiku_mlp(policy, steps=8):
  """A Haiku MLP trained with ``policy`` on its hk.Linear layers, through
  fs.chain and fs.value_and_grad: the user's code, with no jmp in it.
  Returns the parameters, the loss per step and the jaxpr of the forward
  pass."""
  hk = pytest.importorskip("haiku")
  hk.mixed_precision.set_policy(hk.Linear, policy)
  try:
    net = hk.without_apply_rng(
      hk.transform(lambda x: hk.nets.MLP([32, 32, 4])(x))
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, size=64))
    params = net.init(jax.random.key(0), x)
    tx = fs.chain(
      fs.fp16_loss_scale(fs.torch_scaler(init_scale=2.0**15)), optax.adam(1e-2)
    )
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
      logits = net.apply(params, x)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y
      ).mean()

    @jax.jit
    def step(params, opt_state, x, y):
      loss, grads = fs.value_and_grad(loss_fn, opt_state)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
      params, opt_state, loss = step(params, opt_state, x, y)
      losses.append(float(loss))
    jaxpr = jax.make_jaxpr(net.apply)(params, x)
    return params, np.array(losses), jaxpr, net.apply(params, x)
  finally:
    hk.mixed_precision.clear_policy(hk.Linear)


def test_haiku_trains_with_an_fs_policy_as_with_jmps():
  policy = fs.get_policy("p=f32,c=f16,o=f32")
  params, losses, jaxpr, out = _train_haiku_mlp(policy)
  # Haiku computes each hk.Linear in float16 and hands float32 out...
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 3
  for e in dots:
    assert all(v.aval.dtype == jnp.float16 for v in e.invars + e.outvars)
  assert out.dtype == jnp.float32
  # ...with float32 parameters, trained: the loss falls.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  # jmp's own policy, in the same place, gives the same bits.
  ref_params, ref_losses, _, _ = _train_haiku_mlp(
    jmp.get_policy("p=f32,c=f16,o=f32")
  )
  np.testing.assert_array_equal(losses, ref_losses)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_array_equal(a, b)
