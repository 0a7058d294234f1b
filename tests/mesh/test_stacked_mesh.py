"""stacked_axes under shard_map: a stack of 8 layers split over 8 devices on
a feature axis, the layer axis unsharded, with an inf in layer 5 that one
device alone holds: every device names layer 5. A spec that splits the
layer axis is refused by name."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import fp16_scaling as fs

L, D = 8, 16


def run(axis):
  shape = [4, 4]
  shape.insert(axis, L)  # W: [L, 4, D'] or [4, L, D']
  shape[-1] = D
  params = {"W": jnp.ones(shape), "b": jnp.ones((L, D))}
  specs = {"W": P(None, None, "model"), "b": P(None, "model")}
  tx = fs.chain(
    fs.fp16_loss_scale(
      fs.static_scaler(2.0),
      partition_specs=specs,
      stacked_axes={"W": axis, "b": 0},
      grad_range=True,
    ),
    optax.sgd(0.1),
  )
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0, jnp.float16), params)
  # Column 3 lives on device 1 of 8 (two columns each).
  at = [0, 0, 3]
  at[axis] = 5
  grads["W"] = grads["W"].at[tuple(at)].set(jnp.inf)
  mesh = jax.make_mesh((8,), ("model",))
  st_specs = jax.tree.map(lambda _: P(), state)

  def local(g, s):
    _, s = tx.update(g, s)
    return s, fs.scale_metrics(s)["nonfinite_layers"][None]

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(specs, st_specs),
      out_specs=(st_specs, P("model")),
    )
  )

  def put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  with jax.set_mesh(mesh):
    grads = jax.tree.map(put, grads, specs)
    return step(grads, jax.tree.map(put, state, st_specs))


@pytest.mark.parametrize("axis", [0, 1])
def test_shard_map_names_layer_5_on_every_device(axis):
  state, per_device = run(axis)
  report = fs.overflow_report(state)
  assert report.nonfinite_leaves == ("['W'][5]",)
  assert report.nonfinite_layers == (5,) and report.layer_counts == {5: 1}
  assert per_device.tolist() == [1] * 8
  # The clean layers' norms are the global ones: 16 columns of 4 (or of
  # 4 rows) elements of 1.0 (2.0 at scale 2).
  norms = np.asarray(fs.layer_grad_norms(state)["['b']"])
  np.testing.assert_allclose(norms, [4.0] * 8, rtol=1e-6)


def test_a_sharded_layer_axis_is_refused_by_name():
  tx = fs.chain(
    fs.fp16_loss_scale(
      fs.static_scaler(2.0),
      partition_specs={"W": P("model")},
      stacked_axes={"W": 0},
    )
  )
  with pytest.raises(ValueError, match=r"\['W'\]'s layer axis 0 is split"):
    with jax.set_mesh(jax.make_mesh((8,), ("model",))):
      tx.init({"W": jnp.ones((L, D))})
