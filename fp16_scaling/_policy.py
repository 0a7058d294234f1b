"""``Policy`` and ``get_policy``: which dtype the parameters, the computation
and the output are in, and the casts between them, as jmp's ``Policy`` with
jmp's string grammar (jmp itself is not imported).
"""

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

# jmp's names for each dtype, its string form's name first.
_NAMES = {
  jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
  jnp.dtype(jnp.float16): ("f16", "float16"),
  jnp.dtype(jnp.float32): ("full", "f32", "float32"),
  jnp.dtype(jnp.float64): ("f64", "float64"),
}
_DTYPE_OF = {name: d for d, names in _NAMES.items() for name in names}
_DTYPE_OF["half"] = jnp.dtype(jnp.float16)  # on every device (get_policy)
DTYPE_NAMES = tuple(_DTYPE_OF)  # what get_policy reads as a dtype
# jmp's keys, each with the dtype it names (of the param, compute or output).
_FIELD_OF = {
  "p": "param",
  "params": "param",
  "c": "compute",
  "compute": "compute",
  "o": "output",
  "output": "output",
}
KEYS = tuple(_FIELD_OF)  # what get_policy reads as a key
_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


def is_floating_array(x) -> bool:
  """Whether ``x`` is a JAX or numpy array (a tracer included) of a floating
  dtype: not an integer, bool or PRNG-key array, nor a Python scalar."""
  return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(
    x.dtype, jnp.floating
  )


def cast_floating(tree: T, dtype: Any) -> T:
  """``tree`` with every floating array leaf cast to ``dtype``.

  Integer, bool and PRNG-key arrays (typed keys and uint32 raw keys),
  Python scalars (weakly typed: they take the dtype of the array they
  meet), ``None``, functions and any other non-array leaf are returned as
  they are, as are an Equinox module's static fields (not leaves at all).
  The same rule as jmp's casts.
  """
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
    lambda x: x.astype(dtype) if is_floating_array(x) else x, tree
  )


def _floating_dtype(name: str, value) -> np.dtype:
  """``value`` (a dtype, a type, or a name: numpy's or jmp's) as one of the
  four floating ``np.dtype``s jmp names; a ValueError naming ``name``."""
  if isinstance(value, str) and value in _DTYPE_OF:
    return _DTYPE_OF[value]
  try:  # np.dtype(None) is float64
    dtype = None if value is None else jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype not in _NAMES:  # np.dtype("f16") is float128
    raise ValueError(
      f"Policy: {name} must be float16, bfloat16, float32 or float64 (a "
      f"dtype, or a name such as 'f16'), got {value!r}"
    )
  return dtype


@dataclasses.dataclass(frozen=True)
class Policy:
  """The dtypes of a mixed-precision model: a frozen, hashable value.

  The same three attributes and methods as ``jmp.Policy``, so it goes where
  a jmp policy goes: ``hk.mixed_precision.set_policy(hk.Linear, policy)``
  (Haiku reads ``param_dtype`` and calls ``cast_to_compute`` and
  ``cast_to_output``). Each cast converts floating arrays only (see
  :func:`cast_floating`); the dtypes are stored as ``np.dtype``.

  Attributes:
    param_dtype: the parameters' dtype (what the optimizer updates).
    compute_dtype: the dtype the model computes in.
    output_dtype: the dtype of the model's output (the loss's input).

  Raises:
    ValueError: a dtype other than float16, bfloat16, float32 and float64
      (given as dtypes, types, or names: numpy's or jmp's, ``"f16"`` being
      float16 here, not numpy's float128), naming the attribute.

  Examples:
    >>> import jax, jax.numpy as jnp, fp16_scaling as fs
    >>> policy = fs.Policy(jnp.float32, jnp.float16, jnp.float32)
    >>> print(policy)
    p=full,c=f16,o=full
    >>> tree = {"w": jnp.ones(2), "step": jnp.array(3)}
    >>> jax.tree.map(lambda x: x.dtype.name, policy.cast_to_compute(tree))
    {'step': 'int32', 'w': 'float16'}
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    for field in _FIELDS:
      value = _floating_dtype(field, getattr(self, field))
      object.__setattr__(self, field, value)

  def cast_to_param(self, x: T) -> T:
    """``x`` with its floating arrays cast to ``param_dtype``."""
    return cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """``x`` with its floating arrays cast to ``compute_dtype``."""
    return cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """``x`` with its floating arrays cast to ``output_dtype``."""
    return cast_floating(x, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> "Policy":
    """This policy with ``output_dtype`` replaced."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    """jmp's string form, ``p=full,c=f16,o=full``: :func:`get_policy`
    reads it back."""
    names = [_NAMES[getattr(self, f)][0] for f in _FIELDS]
    return "p={},c={},o={}".format(*names)


def _dtype(spec: str, key: str, value: str) -> np.dtype:
  """The dtype jmp's grammar names ``value``; ``half`` is float16."""
  if value not in _DTYPE_OF:
    where = f" for key {key!r}" if key else ""
    raise ValueError(
      f"get_policy({spec!r}): unknown dtype {value!r}{where}; the dtypes are "
      f"{', '.join(DTYPE_NAMES)}" + ("" if key else _whole_spec_hint(spec))
    )
  return _DTYPE_OF[value]


def _whole_spec_hint(spec: str) -> str:
  """For a spec read as one dtype: what a policy string looks like, with
  the ``key=dtype`` spelling of a ``key:dtype`` part."""
  hint = (
    ". A policy string is one dtype for all three, or key=dtype parts "
    f"such as 'p=f32,c=f16,o=f32' (the keys are {', '.join(KEYS)})"
  )
  if ":" in spec:
    hint += f": write {spec.replace(':', '=')!r}"
  return hint


def get_policy(spec: str) -> Policy:
  """The :class:`Policy` a jmp policy string names, read as
  ``jmp.get_policy`` reads it.

  The string is either one dtype for all three (``"half"``, ``"f32"``) or
  comma-separated ``key=dtype`` parts, the keys ``p``/``params``,
  ``c``/``compute`` and ``o``/``output``, the dtypes ``full``, ``f32``/
  ``float32``, ``f16``/``float16``, ``bf16``/``bfloat16``, ``f64``/
  ``float64`` and ``half``. A missing key takes jmp's default: params
  float32, compute follows params, output follows compute (``"c=f16"`` is
  ``p=f32,c=f16,o=f16``). A key given twice keeps its last value, as in jmp;
  spaces around keys and values are ignored (jmp refuses them).

  ``half`` is float16, on every device: this is a float16 library, and a
  policy's dtypes do not depend on where it runs. jmp's ``half`` is float16
  on CPU and GPU but bfloat16 on TPU (it asks the first local device); write
  ``bf16`` for bfloat16.

  Args:
    spec: the policy string.

  Returns:
    The :class:`Policy`.

  Raises:
    ValueError: an unknown key or dtype, or a part without ``=``, naming it
      and the allowed ones.

  Examples:
    >>> import fp16_scaling as fs
    >>> print(fs.get_policy("params=float32,compute=float16,output=float32"))
    p=full,c=f16,o=full
    >>> print(fs.get_policy("c=half"))  # output follows compute
    p=full,c=f16,o=f16
  """
  if not isinstance(spec, str):
    raise TypeError(
      f"get_policy: spec must be a string such as 'p=f32,c=f16,o=f32', got "
      f"a {type(spec).__name__}"
    )
  if "=" not in spec:
    dtype = _dtype(spec, "", spec.strip())
    return Policy(dtype, dtype, dtype)
  got = {}
  for part in spec.split(","):
    key, eq, value = (s.strip() for s in part.partition("="))
    if not eq or "=" in value:
      raise ValueError(
        f"get_policy({spec!r}): the part {part!r} is not key=dtype; the keys "
        f"are {', '.join(KEYS)}"
      )
    if key not in _FIELD_OF:
      raise ValueError(
        f"get_policy({spec!r}): unknown key {key!r}; the keys are "
        f"{', '.join(KEYS)}"
      )
    got[_FIELD_OF[key]] = _dtype(spec, key, value)
  param = got.get("param", jnp.dtype(jnp.float32))
  compute = got.get("compute", param)
  return Policy(param, compute, got.get("output", compute))


def as_policy(policy: Any, name: str = "policy") -> Policy:
  """``policy`` as a :class:`Policy`: a Policy, a jmp policy string, or any
  object with the three dtype attributes (a ``jmp.Policy``, read without
  importing jmp).

  Raises:
    TypeError: anything else, naming ``name``.
  """
  if isinstance(policy, Policy):
    return policy
  if isinstance(policy, str):
    return get_policy(policy)
  if all(hasattr(policy, f) for f in _FIELDS):
    return Policy(*(getattr(policy, f) for f in _FIELDS))
  raise TypeError(
    f"{name} must be an fs.Policy, a jmp.Policy (or any object with "
    "param_dtype, compute_dtype and output_dtype) or a policy string such "
    f"as 'p=f32,c=f16,o=f32', got a {type(policy).__name__}"
  )
