"""A DeepSpeed fp16 recipe ported to a Flax NNX model
(docs/porting-deepspeed.md).

A ``ds_config`` with ZeRO stage 2, 4 microbatches per step and clipping;
float16 compute with float32 master weights; ``nnx.Optimizer.update(model,
grads, value=loss)``; an injected overflow that hysteresis absorbs, read
with ``overflow_report``; an orbax save, a resume into a fresh model, and a
check that the resumed run continues bit for bit. Runs in seconds on CPU.

    pip install -e ".[examples]"   # from the repository root
    python examples/port_deepspeed_nnx.py --steps 40 --bad 9
"""

import argparse
import json
import pathlib
import tempfile
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import fp16_scaling as fs

DS_CONFIG = {
  "train_batch_size": 32,
  "train_micro_batch_size_per_gpu": 8,
  "gradient_clipping": 1.0,
  "fp16": {
    "enabled": True,
    "initial_scale_power": 12,
    "loss_scale_window": 100,
    "hysteresis": 2,
    "min_loss_scale": 1,
  },
  "zero_optimization": {"stage": 2},
}
LR, WEIGHT_DECAY = 1e-2, 0.01  # DeepSpeed's "optimizer" section, in optax


class MLP(nnx.Module):
  """float32 parameters (the masters), float16 compute."""

  def __init__(self, rngs):
    kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
    self.hidden = nnx.Linear(8, 32, **kw)
    self.out = nnx.Linear(32, 1, **kw)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))[:, 0]


def loss_fn(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


@nnx.jit
def train_step(model, opt, x, y):
  """One microbatch; the optimizer steps on each window's last one."""
  # The loss, and the gradients of loss * S, S read from opt inside the step.
  loss, grads = fs.value_and_grad(loss_fn, opt)(model, x, y)
  opt.update(model, grads, value=loss)
  return loss, fs.scale_metrics(opt.opt_state)


def batch(i, bad=False):
  """A regression batch; ``bad`` makes the float16 gradients overflow."""
  key = jax.random.PRNGKey(0)
  w_true = jax.random.normal(key, (8,))
  x = jax.random.normal(jax.random.fold_in(key, i + 1), (8, 8))
  y = x @ w_true
  return x, y * 1e4 if bad else y


def build(ds, seed):
  model = MLP(nnx.Rngs(seed))
  tx = ds.optimizer(optax.adamw(LR, weight_decay=WEIGHT_DECAY))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=200, help="microbatches")
  p.add_argument("--bad", type=int, default=9, help="microbatch to poison")
  p.add_argument("--ckpt-dir", default=None, help="default: a temp folder")
  args = p.parse_args(argv)

  workdir = pathlib.Path(args.ckpt_dir or tempfile.mkdtemp())
  (workdir / "ds_config.json").write_text(json.dumps(DS_CONFIG))
  ds = fs.from_deepspeed_config(workdir / "ds_config.json")
  k = ds.gradient_accumulation_steps
  print(
    f"scaler: init 2^{int(np.log2(ds.scaler.init_scale))}, window "
    f"{ds.scaler.growth_interval}, hysteresis {ds.scaler.hysteresis}; clip "
    f"{ds.max_norm}; {k} microbatches per step"
  )
  model, opt = build(ds, seed=0)
  half = (args.steps // 2) // k * k  # save at a window's end
  losses, report = [], None
  for i in range(half):
    loss, m = train_step(model, opt, *batch(i, bad=i == args.bad))
    losses.append(float(loss))
    if bool(m["window_ended"]) and bool(m["overflow"]):
      report = fs.overflow_report(opt.opt_state)  # on the host
      print(f"microbatch {i}: window skipped\n{report}")
  fs.raise_if_min_scale_reached(opt.opt_state)

  ckpt = ocp.StandardCheckpointer()
  path = (workdir / f"step_{half}").resolve()
  ckpt.save(path, {"model": nnx.state(model), "opt": nnx.state(opt)})
  ckpt.wait_until_finished()
  resumed, resumed_opt = build(ds, seed=1)
  target = {"model": nnx.state(resumed), "opt": nnx.state(resumed_opt)}
  restored = ckpt.restore(path, target)
  nnx.update(resumed, restored["model"])
  nnx.update(resumed_opt, restored["opt"])

  identical = True
  for i in range(half, args.steps):
    loss, m = train_step(model, opt, *batch(i))
    loss2, _ = train_step(resumed, resumed_opt, *batch(i))
    identical &= float(loss) == float(loss2)
    losses.append(float(loss))
  identical &= all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(resumed))
    )
  )
  print(
    f"resumed from step_{half}: continues bit for bit: {identical}; "
    f"applied steps {int(m['applied_steps'])}, skipped "
    f"{int(m['skipped_steps'])}; loss {np.mean(losses[:k]):.3f} -> "
    f"{np.mean(losses[-k:]):.3f}"
  )
  return {
    "losses": losses,
    "report": report,
    "metrics": jax.device_get(m),
    "identical": identical,
  }


if __name__ == "__main__":
  with warnings.catch_warnings():
    warnings.simplefilter("default")
    main()
