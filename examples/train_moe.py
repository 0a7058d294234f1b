"""Float16 mixture-of-experts training under shard_map on 8 simulated devices.

A small Flax model: a shared embedding and LayerNorm, one mixture-of-experts
layer (8 experts, top-2 routing) and a shared head, on a 2 x 4 mesh of
simulated CPU devices. The experts are split over the ``expert`` axis (2 per
device); the shared layers are replicated and trained data-parallel; the batch
is split over every device. Parameters are float32 masters, compute is
float16. Inside ``shard_map`` each device holds only its experts' gradients,
so ``fp16_loss_scale`` and ``clip_by_unscaled_norm`` are given the gradients'
PartitionSpecs: they sum the squared norm of expert leaves across the expert
axis and count each replicated shared leaf once, and every device takes the
same overflow decision. The run starts from a scale of 2**24, which overflows
float16 on the first steps.

    pip install -e ".[examples]"   # from the repository root
    python examples/train_moe.py --steps 60
"""

import os

# Eight CPU devices; XLA reads this when jax is first imported.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from jax import lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fp16_scaling as fs  # noqa: E402

DATA, EXPERT = "data", "expert"
MESH_SHAPE = (2, 4)  # data x expert
NUM_EXPERTS = 8
IN_DIM, WIDTH, EXPERT_HIDDEN, CLASSES = 16, 64, 128, 4
EXPERT_LEAVES = ("w_in", "w_out")


class MoE(nn.Module):
  """Top-k mixture of experts; under shard_map, this device's experts only.

  Attributes:
    num_experts: experts in the whole layer (the router's outputs).
    local_experts: experts whose weights this module holds: all of them
      outside shard_map, ``num_experts / expert_axis_size`` inside.
    expert_axis: mesh axis the experts are split over (None: not split).
  """

  num_experts: int
  local_experts: int
  hidden: int
  expert_axis: Optional[str] = None
  top_k: int = 2

  @nn.compact
  def __call__(self, x):
    dim = x.shape[-1]
    probs = jax.nn.softmax(
      nn.Dense(self.num_experts, dtype=jnp.float32, name="router")(x), -1
    )
    top, idx = lax.top_k(probs, self.top_k)
    gates = jnp.einsum(
      "tk,tke->te",
      top / top.sum(-1, keepdims=True),
      jax.nn.one_hot(idx, self.num_experts),
    )
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    w_in = self.param("w_in", init, (self.local_experts, dim, self.hidden))
    w_out = self.param("w_out", init, (self.local_experts, self.hidden, dim))
    if self.expert_axis is not None:
      # Every token of the expert group visits this device's experts...
      x = lax.all_gather(x, self.expert_axis, axis=0, tiled=True)
      gates = lax.all_gather(gates, self.expert_axis, axis=0, tiled=True)
      first = lax.axis_index(self.expert_axis) * self.local_experts
    else:
      first = 0
    gates = lax.dynamic_slice_in_dim(gates, first, self.local_experts, axis=1)
    h = nn.gelu(jnp.einsum("td,edh->eth", x, w_in.astype(x.dtype)))
    y = jnp.einsum("eth,ehd->etd", h, w_out.astype(x.dtype))
    y = jnp.einsum("etd,te->td", y, gates.astype(x.dtype))
    if self.expert_axis is not None:
      # ...and the experts' outputs are summed and sent back to their tokens.
      y = lax.psum_scatter(y, self.expert_axis, scatter_dimension=0, tiled=True)
    return y


class Model(nn.Module):
  """Shared embedding, LayerNorm and head around one MoE layer; float16."""

  local_experts: int = NUM_EXPERTS
  expert_axis: Optional[str] = None

  @nn.compact
  def __call__(self, x):
    dense = lambda n, name: nn.Dense(
      n, dtype=jnp.float16, param_dtype=jnp.float32, name=name
    )
    x = nn.gelu(dense(WIDTH, "embed")(x.astype(jnp.float16)))
    h = nn.LayerNorm(dtype=jnp.float16, param_dtype=jnp.float32)(x)
    x = x + MoE(
      NUM_EXPERTS,
      self.local_experts,
      EXPERT_HIDDEN,
      self.expert_axis,
      name="moe",
    )(h)
    return dense(CLASSES, "head")(x)


def make_data(n, seed):
  """Inputs and the labels a fixed random teacher gives them."""
  rng = np.random.default_rng(seed)
  teacher = np.random.default_rng(0)
  w1 = teacher.standard_normal((IN_DIM, 32))
  w2 = teacher.standard_normal((32, CLASSES))
  x = rng.standard_normal((n, IN_DIM)).astype(np.float32)
  return x, np.argmax(np.tanh(x @ w1) @ w2, -1).astype(np.int32)


def is_expert(path) -> bool:
  return getattr(path[-1], "key", None) in EXPERT_LEAVES


def param_specs(params):
  """Experts split over the expert axis; everything else replicated."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: P(EXPERT) if is_expert(path) else P(), params
  )


def build(mesh, init_scale, window, max_norm, lr):
  """The optimizer, its state specs and the shard_map'ed train step."""
  params = jax.jit(Model().init)(jax.random.key(0), jnp.zeros((1, IN_DIM)))[
    "params"
  ]
  specs = param_specs(params)
  expert_mask = jax.tree_util.tree_map_with_path(
    lambda p, _: is_expert(p), params
  )
  tx = fs.chain(
    fs.fp16_loss_scale(
      fs.deepspeed_scaler(init_scale=init_scale, scale_window=window),
      partition_specs=specs,
    ),
    fs.clip_by_unscaled_norm(max_norm, expert_mask=expert_mask),
    optax.adamw(lr, weight_decay=1e-4),
  )
  state_specs = optax.tree_map_params(
    tx,
    lambda _, spec: spec,
    tx.init(params),
    specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda s: isinstance(s, P),
  )
  local = Model(NUM_EXPERTS // mesh.shape[EXPERT], EXPERT)
  batch_spec = P((DATA, EXPERT))

  def step(params, opt_state, x, y):
    """One device's step: its tokens, its experts, the shared layers."""
    scale = fs.current_scale(opt_state)
    num_tokens = x.shape[0] * mesh.size

    def loss_fn(p):
      logits = local.apply({"params": p}, x).astype(jnp.float32)
      nll = (
        -jnp.sum(
          jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1)
        )
        / num_tokens
      )
      return nll * scale, nll

    # check_vma: gradients of replicated leaves arrive summed over the mesh,
    # expert gradients summed over the data axis and split over the expert one.
    grads, nll = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, lax.psum(nll, (DATA, EXPERT))

  train_step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(specs, state_specs, batch_spec, batch_spec),
      out_specs=(specs, state_specs, P()),
    ),
    donate_argnums=(0, 1),
  )

  def place(tree, tree_specs):
    # Specs padded to each array's rank, as the step's outputs spell them, so
    # that the second call does not compile again.
    def put(a, s):
      s = P(*s, *[None] * (jnp.ndim(a) - len(s)))
      return jax.device_put(a, NamedSharding(mesh, s))

    return jax.tree.map(
      put, tree, tree_specs, is_leaf=lambda s: isinstance(s, P)
    )

  return params, tx, specs, state_specs, train_step, place, local


def fmt_scale(s):
  k = math.log2(s)
  return f"2^{int(k)}" if k == int(k) else f"{s:g}"


def main(argv=None):
  """Trains and prints; returns the per-step metrics."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--batch", type=int, default=256, help="global batch")
  p.add_argument("--init-scale", type=float, default=2.0**24)
  p.add_argument(
    "--window", type=int, default=20, help="clean steps between growths"
  )
  p.add_argument("--max-norm", type=float, default=1.0)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--print-every", type=int, default=10)
  args = p.parse_args(argv)

  mesh = jax.make_mesh(MESH_SHAPE, (DATA, EXPERT))
  with jax.set_mesh(mesh):
    params, tx, specs, state_specs, train_step, place, _ = build(
      mesh, args.init_scale, args.window, args.max_norm, args.lr
    )
    opt_state = place(jax.jit(tx.init)(params), state_specs)
    params = place(params, specs)
    x_all, y_all = make_data(args.steps * args.batch, seed=1)
    x_test, y_test = make_data(2048, seed=2)
    batch_sharding = NamedSharding(mesh, P((DATA, EXPERT)))
    print(
      f"mesh {dict(mesh.shape)}, {NUM_EXPERTS} experts "
      f"({NUM_EXPERTS // mesh.shape[EXPERT]} per expert shard), "
      f"global batch {args.batch}, float16 compute"
    )
    print(
      f"{'step':>4} {'loss':>7} {'scale':>6} {'skip':>4} "
      f"{'|g|':>9} {'|g_exp|':>9} {'|g_sh|':>9}  next"
    )
    keys = (
      "loss",
      "prev_loss_scale",
      "loss_scale",
      "overflow",
      "grad_norm",
      "expert_grad_norm",
      "shared_grad_norm",
    )
    history = {k: [] for k in keys}
    start = time.time()
    for i in range(args.steps):
      sl = slice(i * args.batch, (i + 1) * args.batch)
      x = jax.device_put(x_all[sl], batch_sharding)
      y = jax.device_put(y_all[sl], batch_sharding)
      params, opt_state, loss = train_step(params, opt_state, x, y)
      m = {k: float(v) for k, v in fs.scale_metrics(opt_state).items()}
      m["loss"] = float(loss)
      for k in keys:
        history[k].append(m[k])
      changed = m["loss_scale"] != m["prev_loss_scale"]
      if (
        m["overflow"]
        or changed
        or i % args.print_every == 0
        or (i == args.steps - 1)
      ):
        print(
          f"{i:4d} {m['loss']:7.4f} {fmt_scale(m['prev_loss_scale']):>6} "
          f"{'yes' if m['overflow'] else '':>4} {m['grad_norm']:9.4f} "
          f"{m['expert_grad_norm']:9.4f} {m['shared_grad_norm']:9.4f}  "
          f"{fmt_scale(m['loss_scale'])}"
        )
    elapsed = time.time() - start

    # Accuracy of the trained model on one device, with all experts.
    full = jax.device_get(params)
    logits = jax.jit(Model().apply)({"params": full}, x_test)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))

  history = {k: np.asarray(v) for k, v in history.items()}
  trajectory = [(0, history["prev_loss_scale"][0])] + [
    (i + 1, s)
    for i, (s, prev) in enumerate(
      zip(history["loss_scale"], history["prev_loss_scale"])
    )
    if s != prev
  ]
  print(
    "scale trajectory (step: scale from then on): "
    + ", ".join(f"{i}: {fmt_scale(s)}" for i, s in trajectory)
  )
  print(
    f"skipped {int(history['overflow'].sum())} of {args.steps} steps; "
    f"test accuracy {accuracy:.3f} (chance {1 / CLASSES:.2f}); "
    f"{elapsed:.1f}s for the steps"
  )
  history.update(
    accuracy=accuracy,
    skipped_steps=int(float(fs.scale_metrics(opt_state)["skipped_steps"])),
  )
  return history


if __name__ == "__main__":
  main()
