"""_sharding: per-leaf mesh axes from PartitionSpecs, and the per-leaf vector
that combines each leaf's scalar across exactly its axes. Under plain jit
(no manual axes) the specs call for no collective; shard_map itself is
covered in tests/mesh."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from fp16_scaling import _sharding


@pytest.mark.parametrize(
  "spec, axes",
  [
    (None, ()),
    (P(), ()),
    (P("data"), ("data",)),
    (P(None, "model"), ("model",)),
    (P(("data", "model"), None), ("data", "model")),
    (P("model", "data", "model"), ("data", "model")),
  ],
)
def test_spec_axes_are_the_sorted_named_axes(spec, axes):
  assert _sharding.spec_axes(spec) == axes


def test_broadcast_prefix_gives_each_leaf_its_subtree_value():
  tree = {"a": {"x": 1, "y": 2}, "b": [3, 4, 5]}
  prefix = {"a": "A", "b": ["B0", "B1", "B2"]}
  values = jax.tree.leaves(prefix)
  want = ("A", "A", "B0", "B1", "B2")
  assert _sharding.broadcast_prefix(values, prefix, tree) == want
  with pytest.raises(ValueError):
    _sharding.broadcast_prefix([1, 2], {"a": 1, "c": 2}, tree)


def _tagging_collective(v, axes):
  # Marks each combined group: +1000 per axis name's length, so the test
  # sees which leaves went through which collective.
  return v + 1000.0 * sum(len(a) for a in axes)


@pytest.mark.parametrize(
  "leaf_axes",
  [
    ((), (), ()),
    (("d",), ("d",), ("d",)),
    ((), ("mm",), (), ("d",), ("mm",)),
  ],
)
def test_leaf_vector_keeps_leaf_order_and_combines_each_group_once(leaf_axes):
  values = [jnp.float32(i) for i in range(len(leaf_axes))]
  calls = []

  def prepare(v):
    calls.append(v.shape)
    return v * 2.0

  out = _sharding.leaf_vector(values, leaf_axes, _tagging_collective, prepare)
  expected = [
    2.0 * i + 1000.0 * sum(len(a) for a in axes)
    for i, axes in enumerate(leaf_axes)
  ]
  np.testing.assert_array_equal(np.asarray(out), expected)
  # prepare runs once per distinct set of axes, on that group's vector.
  assert sorted(calls) == sorted(
    (leaf_axes.count(a),) for a in dict.fromkeys(leaf_axes)
  )


def test_outside_shard_map_specs_call_for_no_collective():
  # Under plain jit the arrays are global: a spec that splits a leaf over
  # "data" still gives it no axes to sum over.
  tree = {"w": jnp.zeros((4, 2)), "b": jnp.zeros(2)}
  specs = {"w": P("data"), "b": P()}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with jax.set_mesh(mesh):
    axes = _sharding.leaf_axes_from_specs(specs, tree, "test")
  assert axes == ((), ())


def test_specs_that_do_not_fit_the_tree_name_the_caller():
  tree = {"w": jnp.zeros(2), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match="clip: partition_specs"):
    _sharding.leaf_axes_from_specs({"w": P()}, tree, "clip")
  with pytest.raises(TypeError, match="clip: partition_specs"):
    _sharding.leaf_axes_from_specs({"w": P(), "b": "x"}, tree, "clip")


def test_a_spec_naming_an_axis_the_mesh_lacks_is_refused():
  tree = {"w": jnp.zeros(2)}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="'model'.*has axes"):
      _sharding.leaf_axes_from_specs({"w": P("model")}, tree, "clip")


def test_leaf_vector_runs_one_collective_per_set_of_axes():
  calls = []

  def collective(v, axes):
    calls.append((axes, np.asarray(v).tolist()))
    return v * 10

  values = [jnp.float32(v) for v in (1, 2, 3, 4, 5)]
  axes = [(), ("data",), ("data", "model"), ("data",), ()]
  out = _sharding.leaf_vector(values, axes, collective)
  np.testing.assert_array_equal(out, [1, 20, 30, 40, 5])
  assert calls == [(("data",), [2.0, 4.0]), (("data", "model"), [3.0])]
  # No leaves: an empty float32 vector.
  empty = _sharding.leaf_vector([], [], collective)
  assert empty.shape == (0,) and empty.dtype == jnp.float32
