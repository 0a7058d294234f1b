"""fp16_scaling's own state dict is derived from the state NamedTuples.

A field added to ``LossScaleState`` or ``ScalerState`` must be saved by
``scaler_state_dict`` and loaded by ``load_scaler_state_dict`` with no edit to
fp16_scaling/interop/_state_dict.py. These tests build states with a field the
library does not have and run them through the same derivation, and compare
the saved keys with what the NamedTuples' fields imply, so that a hand-written
list of fields that drifts from the types fails here.
"""

import dataclasses
import json
from typing import NamedTuple

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs
from fp16_scaling import _lookup
from fp16_scaling.interop import _state_dict

SCALER = fs.deepspeed_scaler(init_scale=2.0**10, scale_window=3)
PARAMS = {"a": jnp.zeros(2), "b": jnp.zeros(3)}


# A scaler whose state has the optional parts (headroom_scaler's window).
WINDOWED = fs.headroom_scaler(init_scale=2.0**10, history=3)


def opt_state(grad_range=False, params=PARAMS, scaler=SCALER):
  tx = guarded(scaler, grad_range=grad_range)
  return tx.init(params)


def implied_keys(grad_range, windowed=False):
  """The own format's keys, from the NamedTuples' fields: the scaler's
  flattened in, the gradient range's with ``grad_``, leaf_paths (static),
  scale_set (a mark of a scale set since the last sync, not the scaler's
  state: a load sets it) and an absent grad_range left out, and a windowed
  headroom scaler's WindowedScalerState fields in place of ScalerState's."""
  scaler = fs.WindowedScalerState if windowed else fs.ScalerState
  keys = set(scaler._fields) | set(fs.LossScaleState._fields)
  keys -= {"scaler", "grad_range", "leaf_paths", "scale_set"}
  if grad_range:
    keys |= {f"grad_{f}" for f in fs.GradRange._fields}
  return keys | {"format", "config"}


CASES = [(False, SCALER), (True, SCALER), (False, WINDOWED)]


@pytest.mark.parametrize("grad_range, scaler", CASES)
def test_saved_keys_are_the_state_fields(grad_range, scaler):
  d = fs.scaler_state_dict(opt_state(grad_range, scaler=scaler), scaler)
  assert set(d) == implied_keys(grad_range, windowed=scaler is WINDOWED)
  assert set(d["config"]) == {f.name for f in dataclasses.fields(fs.Scaler)}


@pytest.mark.parametrize("grad_range, scaler", CASES)
def test_every_saved_field_is_loaded(grad_range, scaler):
  """Each field, changed in the dict alone, comes back changed."""
  state = opt_state(grad_range, scaler=scaler)
  d = fs.scaler_state_dict(state, scaler)
  keys = implied_keys(grad_range, scaler is WINDOWED) - {"format", "config"}
  for key in keys:
    changed = dict(d)
    x = np.asarray(d[key])
    if x.dtype == bool:
      changed[key] = np.logical_not(x).tolist()
    else:
      changed[key] = (x + 1).tolist()
    back = fs.scaler_state_dict(
      fs.load_scaler_state_dict(state, changed, scaler), scaler
    )
    assert back == changed, key


# A version of the states with a field each that fp16_scaling does not have.
ScalerStatePlus = NamedTuple(
  "ScalerStatePlus",
  [(f, jax.Array) for f in fs.ScalerState._fields] + [("new_count", jax.Array)],
)
LossScaleStatePlus = NamedTuple(
  "LossScaleStatePlus",
  [(f, object) for f in fs.LossScaleState._fields]
  + [("new_total", jax.Array), ("new_per_leaf", jax.Array)],
)


def plus(ls, count, total, per_leaf):
  return LossScaleStatePlus(
    *ls._replace(scaler=ScalerStatePlus(*ls.scaler, jnp.int32(count))),
    jnp.float32(total),
    jnp.asarray(per_leaf, jnp.int32),
  )


@pytest.mark.parametrize("grad_range", [False, True])
def test_a_new_field_round_trips_with_no_edit(grad_range):
  ls = _lookup.loss_scale_state(opt_state(grad_range))
  saved = plus(ls, count=5, total=2.5, per_leaf=[3, 4])
  d = json.loads(json.dumps(_state_dict._own_dict(saved)))
  assert (d["new_count"], d["new_total"], d["new_per_leaf"]) == (5, 2.5, [3, 4])
  assert set(d) == implied_keys(grad_range) - {"format", "config"} | {
    "new_count",
    "new_total",
    "new_per_leaf",
  }

  target = plus(ls, count=0, total=0.0, per_leaf=[0, 0])
  fields = _state_dict._own_fields(target)
  assert "new_per_leaf" in _state_dict._per_leaf(fields)
  back = _state_dict._put_own(target, fields, d)
  assert jax.tree.structure(back) == jax.tree.structure(saved)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)
  # A dict saved before the field existed keeps the state's own.
  old = {k: v for k, v in d.items() if not k.startswith("new_")}
  kept = _state_dict._put_own(saved, fields, old)
  assert int(kept.scaler.new_count) == 5 and float(kept.new_total) == 2.5


def test_a_new_per_leaf_field_is_checked_against_the_model():
  ls = _lookup.loss_scale_state(opt_state())
  target = plus(ls, count=0, total=0.0, per_leaf=[0, 0])
  with pytest.raises(ValueError, match=r"'new_per_leaf'\] holds 3 gradient"):
    _state_dict._check_leaf_counts(
      {"new_per_leaf": [1, 2, 3]}, _state_dict._own_fields(target)
    )


def test_a_dict_from_before_a_field_existed_loads():
  state = opt_state()
  d = fs.scaler_state_dict(state, SCALER)
  for key in ("floor_overflows", "overflow_kind", "leaf_nonfinite_steps"):
    del d[key]
  d["loss_scale"] = 64.0
  back = fs.load_scaler_state_dict(state, d, SCALER)
  assert float(fs.current_scale(back)) == 64.0
  del d["growth_tracker"]
  with pytest.raises(ValueError, match="lacks 'growth_tracker'"):
    fs.load_scaler_state_dict(state, d, SCALER)


def test_an_untyped_state_is_told_by_the_state_s_own_field_names():
  # Every field, or scaler and any two others (a checkpoint from before a
  # field was added), is a LossScaleState that lost its types; fewer is not.
  fields = list(fs.LossScaleState._fields)
  assert _lookup.looks_like_loss_scale_state(fields)
  others = [f for f in fields if f != "scaler"]
  for a, b in zip(others, others[1:]):
    assert _lookup.looks_like_loss_scale_state(["scaler", a, b])
    assert not _lookup.looks_like_loss_scale_state(["scaler", a])
    assert not _lookup.looks_like_loss_scale_state([a, b, "unrelated"])
  scaler_state = fs.ScalerState(*range(len(fs.ScalerState._fields)))
  assert set(_state_dict._own_fields(scaler_state)) == set(
    fs.ScalerState._fields
  )
