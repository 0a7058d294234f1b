"""fs.Policy and fs.get_policy: the dtypes, the casts (floating arrays only),
the string form and the errors. tests/peers/test_jmp_policy.py checks them
against jmp's own functions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs

F16, BF16, F32 = (jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, "float32"))


def _fn(x):
  return x


def _tree():
  return {
    "f32": jnp.ones(3, jnp.float32),
    "bf16": jnp.ones(2, jnp.bfloat16),
    "np": np.ones(2, np.float64),
    "int": jnp.arange(3),
    "bool": jnp.array([True]),
    "raw_key": jax.random.PRNGKey(0),
    "typed_key": jax.random.key(1),
    "none": None,
    "scalar": 2.5,
    "fn": _fn,
  }


def test_casts_only_floating_arrays():
  policy = fs.Policy(F32, F16, F32)
  tree = _tree()
  out = policy.cast_to_compute(tree)
  for name in ("f32", "bf16", "np"):
    assert out[name].dtype == F16, name
  np.testing.assert_array_equal(out["np"], np.ones(2, np.float16))
  # Everything else is the very same object.
  for name in ("int", "bool", "raw_key", "typed_key", "scalar", "fn"):
    assert out[name] is tree[name], name
  assert out["none"] is None
  assert out["raw_key"].dtype == jnp.uint32
  assert jnp.issubdtype(out["typed_key"].dtype, jax.dtypes.prng_key)
  back = policy.cast_to_param(out)
  assert back["bf16"].dtype == F32 and back["int"] is tree["int"]


def test_casts_under_jit():
  policy = fs.get_policy("p=f32,c=bf16,o=f16")
  tree = {"w": jnp.ones(2), "n": jnp.arange(2)}
  out = jax.jit(policy.cast_to_output)(tree)
  assert out["w"].dtype == F16 and out["n"].dtype == jnp.int32


def test_equinox_static_fields_and_functions_pass_unchanged():
  eqx = pytest.importorskip("equinox")

  class Model(eqx.Module):
    weight: jax.Array
    steps: jax.Array
    activation: callable
    name: str = eqx.field(static=True)
    scale: float = eqx.field(static=True)

  model = Model(jnp.ones(2), jnp.arange(2), jax.nn.relu, "m", 0.5)
  out = fs.Policy(F32, F16, F32).cast_to_compute(model)
  assert out.weight.dtype == F16
  assert out.steps is model.steps and out.activation is jax.nn.relu
  assert (out.name, out.scale) == ("m", 0.5)  # static: not leaves at all
  # An eqx.nn layer: its float weights cast, its static fields kept.
  linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
  half = fs.Policy(F32, F16, F32).cast_to_compute(linear)
  assert half.weight.dtype == F16 and half.bias.dtype == F16
  assert (half.in_features, half.out_features) == (3, 2)


def test_policy_is_a_frozen_hashable_value():
  policy = fs.Policy(jnp.float32, "float16", np.float32)
  assert (policy.param_dtype, policy.compute_dtype) == (F32, F16)
  assert policy == fs.get_policy("p=f32,c=f16,o=f32")
  assert hash(policy) == hash(fs.get_policy("p=f32,c=f16,o=f32"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.compute_dtype = F32
  other = policy.with_output_dtype(jnp.float16)
  assert other.output_dtype == F16 and policy.output_dtype == F32
  # Hashable and not a pytree: a static argument of jit.
  f = jax.jit(lambda x, p: p.cast_to_compute(x), static_argnums=1)
  assert f(jnp.ones(2), policy).dtype == F16


@pytest.mark.parametrize(
  "spec, text",
  [
    ("p=f32,c=f16,o=f32", "p=full,c=f16,o=full"),
    ("params=bfloat16", "p=bf16,c=bf16,o=bf16"),
    ("c=half", "p=full,c=f16,o=f16"),
    ("o=f16", "p=full,c=full,o=f16"),
    ("full", "p=full,c=full,o=full"),
    ("half", "p=f16,c=f16,o=f16"),
  ],
)
def test_string_form_is_jmps_and_reads_back(spec, text):
  # The expected strings are jmp 0.0.4's (its __str__ names float32 "full").
  policy = fs.get_policy(spec)
  assert str(policy) == text
  assert fs.get_policy(str(policy)) == policy


def test_half_is_float16_on_every_device():
  # The designed difference from jmp, which picks bfloat16 on TPU.
  assert fs.get_policy("half").compute_dtype == F16
  assert fs.get_policy("c=half").compute_dtype == F16


def test_spaces_are_ignored_and_the_last_of_a_repeated_key_wins():
  assert fs.get_policy(" p = f32 , c = f16 ") == fs.get_policy("c=f16")
  assert fs.get_policy("c=bf16,c=f16").compute_dtype == F16


@pytest.mark.parametrize(
  "spec, words",
  [
    ("q=f16", ["'q'", "p, params, c, compute, o, output"]),
    ("c=f8", ["'f8'", "for key 'c'", "full, f32", "half"]),
    ("float", ["'float'", "bf16"]),
    ("", ["''", "half"]),
    ("c=f16,bf16", ["'bf16'", "not key=dtype"]),
    ("c=f16=f32", ["not key=dtype"]),
  ],
)
def test_bad_spec_names_the_part_and_the_allowed(spec, words):
  with pytest.raises(ValueError) as info:
    fs.get_policy(spec)
  for word in words:
    assert word in str(info.value), (word, str(info.value))


def test_bad_dtypes_and_types_are_refused_by_name():
  allowed = "must be float16, bfloat16, float32 or float64"
  with pytest.raises(ValueError, match="compute_dtype " + allowed):
    fs.Policy(jnp.float32, jnp.int32, jnp.float32)
  with pytest.raises(ValueError, match="param_dtype " + allowed):
    fs.Policy(None, jnp.float16, jnp.float32)
  with pytest.raises(ValueError, match="output_dtype " + allowed):
    fs.Policy(jnp.float32, jnp.float16, jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="output_dtype " + allowed):
    fs.Policy(jnp.float32, jnp.float16, "float128")
  # jmp's names are read as jmp reads them: "f16" is float16 (numpy's
  # np.dtype("f16") is float128).
  assert fs.Policy("full", "f16", "half") == fs.get_policy("p=f32,c=f16,o=f16")
  with pytest.raises(TypeError, match="spec must be a string"):
    fs.get_policy(jnp.float16)


def test_any_object_with_the_three_dtypes_is_read_as_a_policy():
  from fp16_scaling import _policy

  class Duck:  # as a jmp.Policy: three attributes holding dtypes
    param_dtype = jnp.float32
    compute_dtype = jnp.bfloat16
    output_dtype = jnp.float32

  assert _policy.as_policy(Duck()) == fs.get_policy("p=f32,c=bf16,o=f32")
  assert _policy.as_policy("c=f16") == fs.get_policy("c=f16")
  with pytest.raises(TypeError, match="policy must be an fs.Policy"):
    _policy.as_policy(jnp.float16)
