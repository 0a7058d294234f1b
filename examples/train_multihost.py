"""Data-parallel float16 training across processes with jax.distributed.

A linear regression in float16 compute with float32 master parameters; the
batch is split over every device of every process (a global mesh), and the
guarded chain runs under jit on the global arrays, so overflow, scale and
norm are decided once for all processes. The run starts at a scale of 2**20,
which overflows float16; the first steps are skipped and the scale backs off.
Every process prints the same numbers; process 0 prints them.

Two processes with 2 CPU devices each, on one machine (loopback):

    python examples/train_multihost.py --cpu-devices 2 \\
      --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 &
    python examples/train_multihost.py --cpu-devices 2 \\
      --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1

On a cluster, leave the three flags out: ``jax.distributed.initialize()``
reads the coordinator, process count and id from SLURM (run one process per
task with ``srun``) or from the Cloud TPU environment.
"""

import argparse
import os


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--coordinator", help="host:port of process 0")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  p.add_argument(
    "--cpu-devices", type=int, help="simulate this many CPU devices per process"
  )
  p.add_argument("--steps", type=int, default=200)
  return p.parse_args(argv)


def main(argv=None):
  args = parse(argv)
  if args.cpu_devices:  # before jax is imported
    os.environ["XLA_FLAGS"] = (
      f"--xla_force_host_platform_device_count={args.cpu_devices}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  if args.cpu_devices:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.coordinator:
    jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
    )
  else:
    jax.distributed.initialize()  # SLURM, Cloud TPU, ... auto-detected

  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax

  import fp16_scaling as fs

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch = 16 * jax.device_count()
  true_w = np.linspace(-2.0, 2.0, 8, dtype=np.float32)

  def global_batch(step):
    """The same global batch in every process; each keeps its rows."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(batch, 8)).astype(np.float32)
    y = x @ true_w
    shard = NamedSharding(mesh, P("data"))
    return tuple(
      jax.make_array_from_callback(a.shape, shard, lambda i, a=a: a[i])
      for a in (x, y)
    )

  scaler = fs.deepspeed_scaler(init_scale=2.0**20, scale_window=50)
  tx = fs.chain(
    fs.fp16_loss_scale(scaler),
    fs.clip_by_unscaled_norm(10.0),
    optax.adam(0.05),
  )

  def loss_fn(w, x, y, scale):
    pred = x.astype(jnp.float16) @ w.astype(jnp.float16)
    loss = jnp.mean((pred - y.astype(jnp.float16)) ** 2)
    return loss * scale.astype(jnp.float16), loss

  @jax.jit
  def step(w, state, x, y):
    grads, loss = jax.grad(loss_fn, has_aux=True)(
      w, x, y, fs.current_scale(state)
    )
    updates, state = tx.update(grads, state, w)
    return optax.apply_updates(w, updates), state, loss

  with jax.set_mesh(mesh):
    w = jnp.zeros(8, jnp.float32)
    state = tx.init(w)
    for t in range(args.steps):
      w, state, loss = step(w, state, *global_batch(t))
      # Wait for each step: XLA:CPU's gloo collectives can deadlock when a
      # process runs steps ahead (without this wait two runs here hung
      # after 5 to 50 steps; with it 200 steps take about 10 s).
      loss.block_until_ready()
      if t < 5 or t % 50 == 0:
        # Every process calls the host helpers: on global arrays they run
        # a computation all processes must join.
        m = fs.scale_metrics(state)
        if jax.process_index() == 0:
          print(
            f"step {t}: loss {float(loss):.4g} scale "
            f"{float(m['loss_scale']):g} skipped {int(m['skipped_steps'])}"
          )
    m = fs.scale_metrics(state)
    final = (
      f"process {jax.process_index()}/{jax.process_count()}: final loss "
      f"{float(loss):.4g}, scale {float(m['loss_scale']):g}, skipped "
      f"{int(m['skipped_steps'])}, |w - w*| "
      f"{float(np.abs(np.asarray(w) - true_w).max()):.3g}"
    )
    print(final, flush=True)
  jax.distributed.shutdown()
  return final


if __name__ == "__main__":
  main()
