"""fp16_scaling._lookup: finding the loss-scale, clip and accumulation states
inside a nested optax state, the one place every host helper, the guard and
accumulate_gradients look them up.

What it promises, checked on states built by hand: exactly one LossScaleState
is found at any depth; none and two are errors that say which (the two by
their paths); a state restored without its types (plain dicts and lists) gets
the message that says how to restore it; nnx Variables come back unwrapped and
go back in as Variables of the same kind; host helpers refuse tracers.
"""

from flax import nnx
import flax.serialization
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling import _lookup

PARAMS = {"w": jnp.ones(2)}
NONE_FOUND = (
  "no fp16_loss_scale state found in opt_state, {}. Pass the optimizer "
  "state that tx.init(params) or tx.update returned, of a chain built with "
  "fp16_loss_scale(...)"
)
UNTYPED = "opt_state holds a loss-scale state that lost its types"


def _tx(scaler=None):
  return helpers.guarded(
    scaler or fs.static_scaler(8.0),
    fs.clip_by_unscaled_norm(1.0),
    optax.sgd(0.1),
  )


def _state(scaler=None):
  return _tx(scaler).init(PARAMS)


def _is_variable(x):
  return isinstance(x, nnx.Variable)


def _same(a, b):
  """Whether ``a`` holds the very leaves of ``b`` (Variables as leaves)."""
  la = jax.tree.leaves(a, is_leaf=_is_variable)
  lb = jax.tree.leaves(b, is_leaf=_is_variable)
  return len(la) == len(lb) > 0 and all(x is y for x, y in zip(la, lb))


def test_one_state_is_found_at_any_depth():
  state = _state()
  ls = state[0]
  assert isinstance(ls, fs.LossScaleState)
  assert _same(_lookup.loss_scale_state(state), ls)
  deeper = {"outer": [optax.EmptyState(), (state, {"step": jnp.int32(3)})]}
  assert _same(_lookup.loss_scale_state(deeper), ls)


def test_no_state_says_to_add_fp16_loss_scale():
  for state, what in (
    (optax.adam(1e-3).init(PARAMS), "a tuple"),
    ((), "a tuple"),
    ({"a": jnp.zeros(2)}, "a dict with keys ['a']"),
    (optax.adam(1e-3), "which is the optimizer (tx) itself, not its state"),
    (1.0, "a float"),
  ):
    with pytest.raises(ValueError) as err:
      _lookup.loss_scale_state(state)
    assert str(err.value) == NONE_FOUND.format(what)
  with pytest.raises(
    ValueError, match="^no fp16_loss_scale state found in my "
  ):
    _lookup.loss_scale_state((), what="my state")


def test_two_states_are_named_by_their_paths():
  ls = _state()[0]
  with pytest.raises(ValueError) as err:
    _lookup.loss_scale_state((ls, {"b": ls}))
  assert str(err.value).startswith(
    "opt_state holds 2 fp16_loss_scale states (at [0]; at [1]['b']); "
    "expected exactly one. Pass each optimizer's state alone"
  )
  # Two guarded chains side by side (optax.multi_transform's way): the fix
  # is one chain around multi_transform.
  with pytest.raises(ValueError) as err:
    _lookup.loss_scale_state({"a": _state(), "b": _state()})
  msg = str(err.value)
  assert "(at ['a'][0]; at ['b'][0])" in msg
  assert "fs.chain(fs.fp16_loss_scale(scaler), optax.multi_transform(" in msg


def _untyped(state):
  """What a restore without a target gives: the state as plain containers."""
  return flax.serialization.to_state_dict(state)


def test_a_state_that_lost_its_types_says_how_to_restore():
  state = _state()
  plain = _untyped(state)
  assert isinstance(plain, dict) and set(plain) == {"0", "1", "2"}
  hand_made = [{"scaler": {}, "prev_loss_scale": 8.0, "skipped_steps": 0}]
  for restored in (plain, {"run": plain}, hand_made, (hand_made,)):
    with pytest.raises(ValueError) as err:
      _lookup.loss_scale_state(restored)
    text = str(err.value)
    assert text.startswith(UNTYPED), text
    assert "checkpointer.restore(path, target=tx.init(params))" in text
    assert "flax.serialization.from_state_dict(tx.init(params), " in text
  # The three keys the message keys on are LossScaleState's own fields.
  assert {"scaler", "prev_loss_scale", "skipped_steps"} <= set(
    fs.LossScaleState._fields
  )
  # Any two of them are not a loss-scale state: the plain message.
  for drop in ("scaler", "prev_loss_scale", "skipped_steps"):
    partial = {k: v for k, v in hand_made[0].items() if k != drop}
    with pytest.raises(ValueError) as err:
      _lookup.loss_scale_state([partial])
    assert str(err.value) == NONE_FOUND.format("a list")


def test_clip_and_accumulation_states():
  state = _state()
  assert _same(_lookup.clip_state(state), state[1])
  assert _lookup.clip_state(optax.adam(1e-3).init(PARAMS)) is None
  # The first of two clip states.
  assert _same(_lookup.clip_state((state, _state())), state[1])
  assert _lookup.accumulation_state(state) is None
  acc = fs.accumulate_gradients(_tx(), 2).init(PARAMS)
  found = _lookup.accumulation_state(acc)
  assert isinstance(found, fs.AccumulationState)
  assert int(found.microbatches) == 0 and not bool(found.window_ended)
  with pytest.raises(ValueError) as err:
    _lookup.accumulation_state([acc, acc])
  assert str(err.value).startswith(
    "opt_state holds 2 accumulate_gradients states ([0]"
  )
  assert str(err.value).endswith("expected at most one")


def _nnx_state():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  return nnx.Optimizer(model, _tx(), wrt=nnx.Param).opt_state


def _variables(tree):
  return [
    x
    for x in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if isinstance(x, nnx.Variable)
  ]


def test_nnx_variables_come_back_unwrapped():
  wrapped = _nnx_state()
  assert _variables(wrapped[0])  # every array of it sits in a Variable
  ls = _lookup.loss_scale_state(wrapped)
  assert isinstance(ls, fs.LossScaleState) and not _variables(ls)
  assert isinstance(ls.scaler.loss_scale, jax.Array)
  assert float(ls.scaler.loss_scale) == 8.0
  assert not _variables(_lookup.clip_state(wrapped))
  # unwrap takes the value out of each Variable and leaves the rest alone.
  var = nnx.Param(jnp.arange(3.0))
  tree = {"v": var, "a": jnp.ones(1), "n": None}
  out = _lookup.unwrap(tree)
  np.testing.assert_array_equal(out["v"], [0.0, 1.0, 2.0])
  assert out["a"] is tree["a"] and out["n"] is None


class _LooksWrapped:
  """Has ``get_value``, but is not flax's: left as it is."""

  def get_value(self):
    raise AssertionError("not a flax Variable: must not be unwrapped")


def test_only_flax_variables_are_unwrapped():
  thing = _LooksWrapped()
  assert _lookup.unwrap([thing])[0] is thing


def test_replace_writes_into_variables_of_the_same_kind():
  wrapped = _nnx_state()
  old = _lookup.loss_scale_state(wrapped)
  new = old._replace(
    scaler=old.scaler._replace(loss_scale=jnp.float32(32.0)),
    skipped_steps=jnp.int32(5),
  )
  out = _lookup.replace_loss_scale_state(wrapped, new)
  kinds = {type(v) for v in _variables(wrapped[0])}
  assert {type(v) for v in _variables(out[0])} == kinds
  got = _lookup.loss_scale_state(out)
  assert float(got.scaler.loss_scale) == 32.0 and int(got.skipped_steps) == 5
  # The rest of the state holds the same arrays, in the same kinds.
  assert _same(_lookup.unwrap(out[1:]), _lookup.unwrap(wrapped[1:]))
  assert {type(v) for v in _variables(out[1:])} == kinds
  # Plain states take plain arrays.
  plain = _state()
  new = plain[0]._replace(scaler=plain[0].scaler._replace(loss_scale=32.0))
  out = _lookup.replace_loss_scale_state(plain, new)
  assert out[0] is not plain[0] and not _variables(out)
  assert float(out[0].scaler.loss_scale) == 32.0
  with pytest.raises(ValueError, match="^no fp16_loss_scale"):
    _lookup.replace_loss_scale_state(optax.sgd(1.0).init(PARAMS), new)
