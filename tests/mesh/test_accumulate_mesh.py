"""drop_microbatch under shard_map: with partition_specs, every device drops
the microbatch whose inf only one device holds."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import fp16_scaling as fs

SPECS = {"shard": P("data"), "rep": P()}


def test_every_device_drops_the_same_microbatch():
  mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
  params = {"shard": jnp.zeros(8), "rep": jnp.zeros(3)}
  tx = fs.accumulate_gradients(
    fs.chain(
      fs.fp16_loss_scale(fs.static_scaler(1.0), partition_specs=SPECS),
      optax.sgd(1.0),
    ),
    2,
    on_microbatch_overflow="drop_microbatch",
  )
  state = tx.init(params)
  # Leaves of the parameters' length are split like them; the rest is
  # replicated.
  state_specs = jax.tree.map(
    lambda x: P("data") if x.shape == (8,) else P(), state
  )

  def local(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(SPECS, state_specs, SPECS),
      out_specs=(SPECS, state_specs),
    )
  )

  def place(tree, specs):
    return jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )

  clean = {"shard": jnp.ones(8), "rep": jnp.ones(3)}
  # float32 like clean, not weak-typed: the step compiles once for both.
  f32 = jnp.float32
  bad = {
    "shard": jnp.full(8, 3.0, f32).at[7].set(jnp.inf),
    "rep": jnp.full(3, 3.0, f32),
  }
  with jax.set_mesh(mesh):
    params = place(params, SPECS)
    state = place(state, state_specs)
    for grads in (clean, bad):
      params, state = step(place(grads, SPECS), state, params)
  # Only the last device holds the inf; every device left the microbatch out.
  for leaf in jax.tree.leaves(params):
    np.testing.assert_array_equal(leaf, -1.0)
  m = fs.scale_metrics(state)
  assert int(m["dropped_microbatches"]) == 1 and int(m["applied_steps"]) == 1
