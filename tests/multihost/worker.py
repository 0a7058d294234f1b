"""One process of the two-process test (tests/multihost/test_multihost.py).

    python worker.py PORT PROCESS_ID OUT_JSON CKPT_DIR

Each process has 2 CPU devices; with jax.distributed over loopback the global
mesh has 4. It runs the guarded chain twice over the same gradients, under
jit on global arrays and under shard_map with partition_specs, with an inf in
a block only process 1 holds; then saves an orbax checkpoint mid-run from
both processes, restores it and continues. It writes what it saw as JSON.
"""

import functools
import json
import os
import sys

# This process's own devices, whatever the launching pytest had set.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import fp16_scaling as fs  # noqa: E402

STEPS, INJECT, CUT = 6, 3, 4
ROWS = 8  # w is (ROWS, 3), split over the 4 devices by rows
INF_ROW = 7  # on the last device, which process 1 holds
SPECS = {"w": P("data"), "b": P()}


def make_tx(partition_specs):
  scaler = fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)
  return fs.chain(
    fs.fp16_loss_scale(scaler, partition_specs=partition_specs),
    fs.clip_by_unscaled_norm(1.0),
    optax.sgd(0.1),
  )


def host_grads(t):
  """Unscaled gradients of step t, the same in every process."""
  rng = np.random.default_rng(t)
  g = {"w": rng.normal(size=(ROWS, 3)).astype(np.float32)}
  g["b"] = rng.normal(size=3).astype(np.float32)
  if t == INJECT:
    g["w"][INF_ROW, 1] = np.inf
  return g


def place(tree, mesh):
  return {
    k: jax.make_array_from_callback(
      v.shape, NamedSharding(mesh, SPECS[k]), lambda idx, v=v: v[idx]
    )
    for k, v in tree.items()
  }


def local(x):
  """This process's blocks of a global array, as numpy (bitwise compare)."""
  return [np.asarray(s.data) for s in x.addressable_shards]


def record(state):
  m = fs.scale_metrics(state)
  return {k: float(np.asarray(v)) for k, v in m.items()}


def main():
  port, pid, out, ckpt_dir = sys.argv[1], int(sys.argv[2]), *sys.argv[3:5]
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid
  )
  assert jax.device_count() == 4 and jax.local_device_count() == 2
  mesh = jax.make_mesh((4,), ("data",))
  w = np.linspace(-1, 1, ROWS * 3, dtype=np.float32).reshape(ROWS, 3)
  params0 = {"w": w, "b": np.zeros(3, np.float32)}
  result = {"process": pid}

  # Under jit over the global mesh: no partition_specs needed.
  tx = make_tx(None)
  jit_step = jax.jit(functools.partial(jit_step_inner, tx))

  # Under shard_map: each device sees its block; partition_specs say how
  # the norm is summed across the mesh.
  tx_sm = make_tx(SPECS)
  state_specs = jax.tree.map(lambda _: P(), tx_sm.init(params0))
  inner = functools.partial(jit_step_inner, tx_sm)
  sm_step = jax.jit(
    jax.shard_map(
      inner,
      mesh=mesh,
      in_specs=(SPECS, state_specs, SPECS),
      out_specs=(SPECS, state_specs),
    )
  )

  def run(step, txn, first, last, params=None, state=None):
    with jax.set_mesh(mesh):
      if params is None:
        params = place(params0, mesh)
        state = txn.init(params)
      records = []
      for t in range(first, last):
        g = host_grads(t)
        scale = float(np.asarray(fs.current_scale(state)))
        f32 = np.float32(scale)
        scaled = {k: (v * f32).astype(np.float32) for k, v in g.items()}
        grads = place(scaled, mesh)
        if t == INJECT:
          blocks = local(grads["w"])
          result["holds_inf"] = any(not np.isfinite(b).all() for b in blocks)
        before = jax.tree.map(local, params)
        params, state = step(params, state, grads)
        rec = record(state)
        after = jax.tree.leaves(jax.tree.map(local, params))
        pairs = zip(jax.tree.leaves(before), after)
        rec["params_unchanged"] = all(_blocks_equal(x, y) for x, y in pairs)
        squares = [np.sum(v.astype(np.float64) ** 2) for v in g.values()]
        rec["numpy_norm"] = float(np.sqrt(sum(squares)))
        records.append(rec)
    return params, state, records

  _, _, result["jit"] = run(jit_step, tx, 0, STEPS)
  _, _, result["shard_map"] = run(sm_step, tx_sm, 0, STEPS)

  # Checkpoint mid-run (after the overflow, hysteresis and tracker in
  # flight), from both processes; restore onto the same shardings.
  params, state, _ = run(jit_step, tx, 0, CUT)
  ckpt = ocp.StandardCheckpointer()
  path = os.path.join(ckpt_dir, "mid")
  ckpt.save(path, {"params": params, "opt_state": state})
  ckpt.wait_until_finished()
  with jax.set_mesh(mesh):
    target = {"params": place(params0, mesh)}
    target["opt_state"] = tx.init(place(params0, mesh))
  restored = ckpt.restore(path, target)
  p1, s1, r1 = run(jit_step, tx, CUT, STEPS, params, state)
  resume = (restored["params"], restored["opt_state"])
  p2, s2, r2 = run(jit_step, tx, CUT, STEPS, *resume)
  result["resumed"] = r2
  result["resume_bitwise"] = all(
    all(a.tobytes() == b.tobytes() for a, b in zip(local(x), local(y)))
    for x, y in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2)))
  ) and r1 == [dict(r) for r in r2]
  with open(out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


def _blocks_equal(x, y):
  """Whether two lists of a leaf's device blocks are equal, block by block."""
  return all(np.array_equal(a, b) for a, b in zip(x, y))


def jit_step_inner(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


if __name__ == "__main__":
  main()
