"""fp16_scaling._validate: every constructor's argument checks, and the
checks of values read from data (a DeepSpeed config, a peer's state).

Each validator accepts its range's edges, gives back the value as the state
will hold it, and rejects a value outside its range with a message that
names the parameter, the range allowed and the value received (a bool or a
string where a number belongs is a TypeError that names its type). The
ranges and messages are derived by hand from float32's limits: the smallest
normal 2**-126 = 1.17549e-38, the largest 3.40282e+38. In data, a value of
the wrong type is a ValueError too, as DeepSpeed's config raises.
"""

import math
import types

from helpers import F32_MAX
from helpers import TINY
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs
from fp16_scaling import _validate

INF, NAN = math.inf, math.nan
TINY_TEXT, MAX_TEXT = "1.17549e-38", "3.40282e+38"
TOO_LONG = (
  f"must be within float32's range (at most {MAX_TEXT}), got an integer "
  "with 401 digits"
)
NOT_FINITE = "must be a finite number (not inf, -inf or nan), got "


def _message(check, value, *args):
  with pytest.raises((ValueError, TypeError)) as err:
    check("knob", value, *args)
  return err.type, str(err.value)


# (validator, extra args, values rejected, what the message says it must)
REJECTS = [
  (
    _validate.scale,
    (),
    [0.0, -1.0, 2.0**-127, 1e39, INF, NAN],
    f"be a positive, finite, normal float32 in [{TINY_TEXT}, {MAX_TEXT}]",
  ),
  (
    _validate.above_one,
    (),
    # 1 + 1e-8 rounds to 1.0 in float32: a factor that never changes.
    [1.0, 1.00000001, 0.5, -2.0, INF, NAN],
    "be a finite float above 1 (in float32, the state's dtype)",
  ),
  (
    _validate.open_unit,
    (),
    # 0.99999999 rounds to 1.0 and 1e-46 to 0.0 in float32.
    [0.0, 1.0, 0.99999999, 1e-46, -0.5, 1.5, INF, NAN],
    "lie in the open interval (0, 1) (in float32, the state's dtype)",
  ),
  (
    _validate.positive,
    (),
    [0.0, -1.0, 1e39, INF, NAN],
    f"be positive and at most float32's maximum ({MAX_TEXT})",
  ),
  (
    _validate.non_negative,
    (),
    [-TINY, -1.0, 1e39, INF, NAN],
    f"be >= 0 and at most float32's maximum ({MAX_TEXT})",
  ),
  (_validate.count, (), [0, -3, 2**31 - 1], "be an integer in [1, 2147483646]"),
  (
    _validate.in_range,
    (0.5, 8.0),
    [0.25, 9.0, -INF, INF, NAN],
    "lie in [0.5, 8]",
  ),
]


@pytest.mark.parametrize(
  "check, args, values, allowed",
  REJECTS,
  ids=[r[0].__name__ for r in REJECTS],
)
def test_out_of_range_names_the_parameter_and_the_range(
  check, args, values, allowed
):
  for value in values:
    kind, text = _message(check, value, *args)
    assert kind is ValueError, (value, text)
    assert text == f"knob must {allowed}, got {value!r}"


@pytest.mark.parametrize(
  "name",
  ["real", "scale", "above_one", "open_unit", "positive", "non_negative"],
)
def test_a_number_must_be_a_real_number(name):
  check = getattr(_validate, name)
  for value, described in [
    (True, "True (bool)"),
    ("2", "'2' (str)"),
    (None, "None (NoneType)"),
    (1j, "1j (complex)"),
  ]:
    kind, text = _message(check, value)
    assert kind is TypeError
    assert text == f"knob must be a real number, got {described}"


def test_a_count_must_be_an_integer():
  for value, described in [
    (True, "True (bool)"),
    (2.0, "2.0 (float)"),
    ("4", "'4' (str)"),
  ]:
    kind, text = _message(_validate.count, value)
    assert kind is TypeError
    assert text == f"knob must be an integer >= 1, got {described}"


def test_the_edges_of_each_range_are_accepted_as_the_state_holds_them():
  # Scales and factors become float32: 0.1 is held as float32's 0.1.
  assert _validate.scale("s", TINY) == TINY
  assert _validate.scale("s", F32_MAX) == F32_MAX
  assert _validate.scale("s", 0.1) == float(np.float32(0.1)) != 0.1
  assert _validate.scale("s", 2**10) == 1024.0  # an int
  assert _validate.above_one("g", F32_MAX) == F32_MAX
  assert _validate.above_one("g", 1.5) == 1.5
  assert _validate.open_unit("b", 0.75) == 0.75
  assert _validate.open_unit("b", 0.1) == float(np.float32(0.1))
  # Norms and margins are kept as given (clipping compares them in float32).
  assert _validate.positive("p", 0.1) == 0.1
  assert _validate.positive("p", F32_MAX) == F32_MAX
  assert _validate.non_negative("n", 0.0) == 0.0
  assert _validate.non_negative("n", F32_MAX) == F32_MAX
  assert _validate.in_range("r", 0.5, 0.5, 8.0) == 0.5
  assert _validate.in_range("r", 8, 0.5, 8.0) == 8.0
  assert _validate.real("x", np.float32(0.5)) == 0.5
  assert _validate.real("x", -(2**100)) == -(2.0**100)
  for value in (1, 2**31 - 2, np.int64(7)):
    got = _validate.count("c", value)
    assert got == int(value) and type(got) is int
  assert _validate.flag("f", np.bool_(True)) is True
  assert _validate.flag("f", False) is False
  assert _validate.choice("c", "drop", ("skip", "drop")) == "drop"


def test_flag_and_choice_name_what_they_got():
  for value, described in [(1, "1 (int)"), ("yes", "'yes' (str)")]:
    kind, text = _message(_validate.flag, value)
    assert kind is TypeError
    assert text == f"knob must be a bool, got {described}"
  for value, described in [("Skip", "'Skip' (str)"), (0, "0 (int)")]:
    kind, text = _message(_validate.choice, value, ("skip", "drop"))
    assert kind is ValueError
    assert text == f"knob must be one of 'skip', 'drop', got {described}"


def test_an_integer_beyond_float_range_says_how_long_it_is():
  kind, text = _message(_validate.real, 10**400)
  assert kind is ValueError
  assert text == f"knob {TOO_LONG}"
  assert _message(_validate.scale, -(10**400))[1].endswith("401 digits")


@pytest.mark.parametrize(
  "make, name",
  [
    (lambda v: fs.deepspeed_scaler(init_scale=v), "init_scale"),
    (lambda v: fs.torch_scaler(growth_factor=v), "growth_factor"),
    (lambda v: fs.megatron_scaler(min_scale=v), "min_scale"),
    (lambda v: fs.static_scaler(v), "scale"),
    (lambda v: fs.clip_by_unscaled_norm(v), "max_norm"),
  ],
)
def test_a_huge_python_int_is_named(make, name):
  # Through the public constructors: the parameter's own name reaches the
  # message.
  with pytest.raises(ValueError, match=f"^{name} must be within float32"):
    make(10**400)


def _scale_from_data(name, value):
  return _validate.from_data(_validate.scale, name, value)


# The checks of values read from data (a DeepSpeed config, a peer's saved
# state): every bad value, whatever its type, is a ValueError that names the
# field and what it must be.
DATA_REJECTS = [
  (_validate.number, {}, True, "must be a finite number, not a bool: True"),
  (_validate.number, {}, "x", "must be a finite number, got 'x' (str)"),
  (_validate.number, {}, None, "must be a finite number, got None (NoneType)"),
  (_validate.number, {}, INF, NOT_FINITE + "inf"),
  (_validate.number, {}, 10**400, TOO_LONG),
  (_validate.integer, {}, 2.5, "must be an integer, got 2.5"),
  (_validate.integer, dict(low=0, high=3), 0.5, "must be an integer in [0, 3]"),
  (_validate.integer, dict(low=0, high=3), 4, "must lie in [0, 3], got 4"),
  (_validate.integer, dict(low=1), 0.0, "must be >= 1, got 0"),
  (_validate.integer, dict(low=1), NAN, NOT_FINITE + "nan"),
  (
    _validate.integer,
    dict(high=3, why=" (the limit)"),
    4,
    "must be <= 3 (the limit), got 4",
  ),
  (_validate.boolean, {}, 1, "must be a bool, got 1 (int)"),
  (_validate.boolean, {}, "true", "must be a bool, got 'true' (str)"),
  (_scale_from_data, {}, "8", "must be a real number, got '8' (str)"),
  (
    _validate.one_element,
    {},
    np.zeros((1, 2)),
    "must be one number, got an array of shape (1, 2)",
  ),
]


@pytest.mark.parametrize(
  "check, kwargs, value, says",
  DATA_REJECTS,
  ids=[f"{r[0].__name__}-{r[2]!r:.12}" for r in DATA_REJECTS],
)
def test_data_checks_raise_value_errors_naming_the_field(
  check, kwargs, value, says
):
  with pytest.raises(ValueError) as err:
    check("knob", value, **kwargs)
  assert str(err.value).startswith(f"knob {says}")


def _tensor(array):
  """What one_element reads of a torch tensor: detach().cpu().numpy()."""
  tensor = types.SimpleNamespace(numpy=lambda: array)
  tensor.detach = tensor.cpu = lambda: tensor
  return tensor


def test_data_checks_accept_their_edges_as_python_values():
  assert _validate.number("n", np.float32(0.5)) == 0.5
  assert _validate.number("n", "2.5") == 2.5
  for value in (3, 3.0, np.int32(3)):
    got = _validate.integer("i", value, low=3, high=3)
    assert got == 3 and type(got) is int
  assert _validate.integer("i", -(2**40)) == -(2**40)
  assert _validate.boolean("b", np.bool_(False)) is False
  for value in (4.0, np.array([[4.0]]), _tensor(np.array([4.0], np.float32))):
    got = _validate.one_element("e", value)
    assert got == 4.0 and type(got) is float
  assert type(_validate.one_element("e", np.array([7]))) is int


def _host_state():
  tx = fs.chain(fs.fp16_loss_scale(fs.torch_scaler()))
  return tx.init({"w": jnp.ones(2)})


def test_require_host_names_the_helper_and_the_way_out():
  state = _host_state()
  _validate.require_host(state, "some_helper")  # concrete arrays: fine

  def inside(s):
    _validate.require_host(s, "some_helper")
    return s

  with pytest.raises(TypeError) as err:
    jax.jit(inside)(state)
  text = str(err.value)
  assert text.startswith("some_helper runs on the host, outside jit")
  assert "then some_helper(opt_state)" in text
  assert "fs.scale_metrics(opt_state), which is traceable" in text
  # vmap and scan trace too.
  with pytest.raises(TypeError, match="^some_helper runs on the host"):
    jax.vmap(inside)(jax.tree.map(lambda x: jnp.stack([x, x]), state))


@pytest.mark.parametrize(
  "helper",
  [
    lambda s: fs.overflow_report(s),
    lambda s: fs.raise_if_min_scale_reached(s, max_floor_overflows=1),
    lambda s: fs.scaler_state_dict(s),
    lambda s: fs.to_peer_state_dict(s, "torch", fs.torch_scaler()),
  ],
  ids=["overflow_report", "raise_if_min", "state_dict", "to_peer"],
)
def test_host_helpers_under_jit_say_they_run_on_the_host(helper):
  state = _host_state()
  helper(state)  # on the host: fine
  with pytest.raises(TypeError, match="runs on the host, outside jit") as e:
    jax.jit(lambda s: helper(s) and None)(state)
  assert "the state the step returned" in str(e.value)
