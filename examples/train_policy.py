"""Float16 training of a plain JAX MLP with a precision policy, no jmp.

The parameters stay float32; ``fs.value_and_grad(..., policy=)`` casts them
and the images to the policy's compute dtype inside the differentiated
function, so the gradients come back float32; ``fs.float32`` runs the
cross-entropy in float32 on the float16 logits. scikit-learn's digits (8x8
images, 10 classes; no download).

    pip install -e ".[examples]"   # from the repository root
    python examples/train_policy.py --policy p=f32,c=f16,o=f32
    python examples/train_policy.py --policy full   # float32 throughout
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import fp16_scaling as fs


def init(key, sizes=(64, 128, 10)):
  """A float32 MLP: ``{"w0": ..., "b0": ..., ...}``."""
  params = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(sub, (m, n)) / np.sqrt(m)
    params[f"b{i}"] = jnp.zeros(n)
  return params


def forward(params, images):
  """Logits, in the dtype of the parameters and images it is given."""
  x = images
  layers = len(params) // 2
  for i in range(layers):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < layers - 1:
      x = jax.nn.relu(x)
  return x


@fs.float32  # float16 logits in, a float32 loss out
def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(argv=None):
  """Trains; returns the figures the run shows."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--policy", default="p=f32,c=f16,o=f32", help="jmp's grammar")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  policy = fs.get_policy(args.policy)  # a ValueError names a bad spec

  images, labels = load_digits(return_X_y=True)
  images = jnp.asarray(images / 16.0, jnp.float32)
  labels = jnp.asarray(labels)
  test = slice(0, 300)  # the first 300 digits are held out
  train_x, train_y = images[300:], labels[300:]

  tx = fs.chain(
    fs.fp16_loss_scale(fs.torch_scaler(init_scale=2.0**15)),
    fs.clip_by_unscaled_norm(1.0),
    optax.adam(3e-3),
  )
  params = init(jax.random.key(args.seed))
  opt_state = tx.init(params)
  seen = {}

  def loss_fn(params, images, labels):
    seen["compute"] = params["w0"].dtype
    return cross_entropy(forward(params, images), labels)

  @jax.jit
  def step(params, opt_state, images, labels):
    loss, grads = fs.value_and_grad(
      loss_fn,
      opt_state,
      policy=policy,
      cast_args=(1,),  # the images too
    )(params, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, grads

  rng = np.random.default_rng(args.seed)
  losses = []
  for _ in range(args.steps):
    idx = rng.integers(0, len(train_y), size=args.batch_size)
    params, opt_state, loss, grads = step(
      params, opt_state, train_x[idx], train_y[idx]
    )
    losses.append(float(loss))

  logits = forward(
    policy.cast_to_compute(params), images[test].astype(policy.compute_dtype)
  )
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == labels[test]))
  metrics = fs.scale_metrics(opt_state)
  result = {
    "policy": str(policy),
    "accuracy": accuracy,
    "losses": np.array(losses),
    "loss_dtype": loss.dtype,
    "grad_dtypes": {g.dtype for g in jax.tree.leaves(grads)},
    "param_dtypes": {x.dtype for x in jax.tree.leaves(params)},
    "compute_dtype": seen["compute"],
    "skipped_steps": int(metrics["skipped_steps"]),
    "loss_scale": float(metrics["loss_scale"]),
  }
  print(
    f"policy {result['policy']}: test accuracy {accuracy:.3f} after "
    f"{args.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
    f"computed in {seen['compute']}, gradients in "
    f"{sorted(d.name for d in result['grad_dtypes'])}, "
    f"{result['skipped_steps']} skipped, scale {result['loss_scale']:g}"
  )
  return result


if __name__ == "__main__":
  main()
