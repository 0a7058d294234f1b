"""Float16 training of a small Flax MLP with dynamic loss scaling.

float32 master parameters, float16 compute, on scikit-learn's digits (8x8
images, 10 classes; no download). The run starts from a deliberately high
loss scale (2**24): the first steps overflow in float16, are skipped and the
scale backs off; with a short growth window it then grows again, overflows,
backs off, and so on.

    pip install -e ".[examples]"   # from the repository root
    python examples/train_mlp.py --preset torch --window 50 --plot /tmp/mlp.png
    python examples/train_mlp.py --accumulate 4   # 4 microbatches per step
"""

import argparse
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")  # headless: write the plot to a file
import matplotlib.pyplot as plt
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import trange

import fp16_scaling as fs

# The dynamic presets, built from --init-scale and --window.
PRESETS = {
  "deepspeed": lambda s, w: fs.deepspeed_scaler(init_scale=s, scale_window=w),
  "torch": lambda s, w: fs.torch_scaler(init_scale=s, growth_interval=w),
  "megatron": lambda s, w: fs.megatron_scaler(
    initial_scale=s, growth_interval=w
  ),
  "flax": lambda s, w: fs.flax_scaler(scale=s, growth_interval=w),
  # Sets the scale from the measured gradient range; no growth window.
  "headroom": lambda s, w: fs.headroom_scaler(init_scale=s),
}


class MLP(nn.Module):
  """Parameters are stored in float32; Dense casts them and computes in
  float16.
  """

  @nn.compact
  def __call__(self, x):
    for width in (128, 128):
      x = nn.relu(
        nn.Dense(width, dtype=jnp.float16, param_dtype=jnp.float32)(x)
      )
    return nn.Dense(10, dtype=jnp.float16, param_dtype=jnp.float32)(x)


def fmt_scale(s):
  """2^k for a power of two, else %g."""
  k = math.log2(s)
  return f"2^{int(k)}" if k == int(k) else f"{s:g}"


def main(argv=None):
  """Trains, prints a summary, saves the plot; returns the run's key numbers."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--preset", choices=sorted(PRESETS), default="deepspeed")
  p.add_argument("--init-scale", type=float, default=2.0**24)
  p.add_argument(
    "--window", type=int, default=100, help="clean steps between growths"
  )
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument(
    "--accumulate",
    type=int,
    default=1,
    help="microbatches per optimizer step (--steps counts microbatches)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--plot", default="examples/train_mlp.png")
  args = p.parse_args(argv)

  # Data: pixels 0..16 -> [0, 1], stratified 80/20 split.
  x, y = load_digits(return_X_y=True)
  x_tr, x_te, y_tr, y_te = train_test_split(
    (x / 16.0).astype(np.float32),
    y,
    test_size=0.2,
    stratify=y,
    random_state=args.seed,
  )

  model = MLP()
  params = model.init(
    jax.random.key(args.seed), jnp.zeros((1, 64))
  )  # float32 masters
  tx = fs.chain(
    fs.fp16_loss_scale(PRESETS[args.preset](args.init_scale, args.window)),
    fs.clip_by_unscaled_norm(1.0),  # clip by the *unscaled* global norm
    optax.adamw(1e-3, weight_decay=1e-4),
  )
  if args.accumulate > 1:  # one guarded step per window of microbatches
    tx = fs.accumulate_gradients(tx, args.accumulate)
  opt_state = tx.init(params)

  def loss_fn(params, xb, yb):
    logits = model.apply(params, xb.astype(jnp.float16))  # float16 forward
    return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), yb
    ).mean()  # softmax/CE in float32

  @jax.jit
  def train_step(params, opt_state, xb, yb):
    # The loss, and the backward of the loss times the scale read from
    # opt_state: float16 gradients are multiplied by the scale so that small
    # ones do not flush to zero. Too large a scale overflows: at 2**24 the
    # logits' gradient is already 2**24 / 128 * (p - y), and float16 tops
    # out at 65504 (~2**16).
    loss, grads = fs.value_and_grad(loss_fn, opt_state)(params, xb, yb)
    # Unscale, detect overflow, clip, AdamW. On an overflow the parameters and
    # AdamW's state are left exactly as they were; only the scale moves.
    # value=: the loss tells a forward overflow from a backward one.
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(fs.scale_metrics(opt_state), loss=loss)

  @jax.jit
  def accuracy(params, xs, ys):
    return (model.apply(params, xs).argmax(-1) == ys).mean()

  rng = np.random.default_rng(args.seed)
  history = []  # per-step metric dicts, still on device: no sync per step
  # disable=None: no bar when stderr is not a terminal (a log file, CI).
  bar = trange(args.steps, desc=f"{args.preset} fp16", disable=None)
  for step in bar:
    idx = rng.choice(len(x_tr), args.batch_size, replace=False)
    params, opt_state, m = train_step(params, opt_state, x_tr[idx], y_tr[idx])
    history.append(m)
    if step % 50 == 0:
      bar.set_postfix(
        scale=fmt_scale(float(m["loss_scale"])), loss=f"{float(m['loss']):.3f}"
      )
  h = {k: np.stack([m[k] for m in jax.device_get(history)]) for k in history[0]}
  if args.accumulate > 1:  # from here on, a step is an optimizer step
    h = {k: v[h["window_ended"]] for k, v in h.items()}
  num_steps = len(h["overflow"])

  # Scale trajectory: each step whose outcome moved the scale, and the new
  # scale.
  used, nxt = (
    h["prev_loss_scale"],
    h["loss_scale"],
  )  # this step's scale, the next's
  changes = [(int(i), float(nxt[i])) for i in np.flatnonzero(nxt != used)]
  print(
    f"loss scale from {fmt_scale(args.init_scale)}, step:new scale ->",
    " ".join(f"{i}:{fmt_scale(s)}" for i, s in changes) or "unchanged",
  )
  print(f"  {np.sum(nxt < used)} back-offs, {np.sum(nxt > used)} growths")
  skipped = int(h["skipped_steps"][-1])
  leading = (
    int(np.argmin(h["overflow"])) if not h["overflow"].all() else num_steps
  )
  print(
    f"skipped steps: {skipped}/{num_steps}, of which the first {leading} in "
    f"a row"
  )
  # The norm is 0.0 on a skipped step (none exists): mean over clean ones.
  last_n = h["grad_norm"][-100:][~h["overflow"][-100:]]
  print(
    f"true grad norm: last {h['grad_norm'][-1]:.4f}, "
    f"mean of last {len(last_n)} clean steps {np.mean(last_n):.4f}"
  )
  acc = float(accuracy(params, x_te, y_te))
  print(f"final train loss {h['loss'][-1]:.4f}, test accuracy {acc:.4f}")
  if skipped:
    print(fs.overflow_report(opt_state))  # which leaves overflowed, and why
  if args.preset == "deepspeed":
    fs.raise_if_min_scale_reached(opt_state)  # fail where DeepSpeed would raise

  # Plot: the loss scale each step used (overflows marked) and the true grad
  # norm.
  steps = np.arange(num_steps)
  fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5))
  ax1.step(steps, used, where="post", label="loss scale used")
  ovf = h["overflow"]
  ax1.plot(
    steps[ovf], used[ovf], "rx", label=f"overflow, step skipped ({skipped})"
  )
  ax1.set_yscale("log", base=2)
  ax1.set(
    ylabel="loss scale",
    title=f"{args.preset} preset, init "
    f"{fmt_scale(args.init_scale)}, window {args.window}; test accuracy "
    f"{acc:.3f}",
  )
  ax1.legend(loc="lower right")
  # A skipped step has no norm (0.0 in the metrics): a gap, not a point at
  # 0 on a log axis.
  plotted_norm = np.where(ovf, np.nan, h["grad_norm"])
  ax2.plot(steps, plotted_norm, lw=0.8, label="true (unscaled) grad norm")
  ax2.axhline(1.0, color="gray", ls="--", lw=0.8, label="clip threshold")
  ax2.set(yscale="log", xlabel="step", ylabel="grad norm")
  ax2.legend(loc="lower left")
  fig.tight_layout()
  fig.savefig(args.plot, dpi=110)
  plt.close(fig)
  print(f"plot saved to {args.plot}")

  return {
    "skipped_steps": skipped,
    "overflow": h["overflow"],
    "scale_history": used,
    "scale_changes": changes,
    "accuracy": acc,
    "grad_norm": h["grad_norm"],
    "plotted_grad_norm": plotted_norm,
    "init_scale": args.init_scale,
    "report": fs.overflow_report(opt_state),
  }


if __name__ == "__main__":
  main()
