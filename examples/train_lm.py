"""Float16 training of a small decoder-only transformer, a character-level LM.

The corpus is the Python standard library's own top-level source files (found
with ``sysconfig``; every Python install has them, no download), split by file
into train and validation: a file goes to validation when the CRC-32 of its
name is 0 mod 10. Characters are ASCII codes; every non-ASCII character is one
extra token.

Master parameters are float32. Each step casts them to float16, runs the
forward and backward pass in float16 (the gradients come out in float16, as
in DeepSpeed's or Apex's fp16 training) and hands those gradients to

    chain(fp16_loss_scale(scaler),
                           clip_by_unscaled_norm(1.0), adamw)

which unscales them by the scale they were made with, skips the step on an
overflow and updates the float32 masters. ``--precision fp32`` runs the same
model, data and optimizer in float32 (with ``no_scaler()``) as the reference.

Besides the loss, every step records the fraction of gradient elements that
are exactly zero (in float16 that is mostly underflow: products too small for
float16, which flush to zero; in float32 it is close to 0).

    pip install -e ".[examples]"   # from the repository root
    python examples/train_lm.py                       # default size, ~2 min
    python examples/train_lm.py --size tiny --steps 100
    python examples/train_lm.py --scaler none         # fp16 without scaling
    # the blocks stacked and applied by nn.scan: overflows named by layer
    python examples/train_lm.py --scan
    # each step's loss / 128 (DeepSpeed's accumulation recipe), one
    # microbatch per step: unscaled fp16 loses a third of its gradients
    python examples/train_lm.py --scaler none --accumulate 128 --microbatches 1
"""

import argparse
import dataclasses
import functools
import math
import pathlib
import sysconfig
import time
from typing import Optional
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import fp16_scaling as fs

VOCAB = 129  # ASCII 0..127, and 128 for every other character
VAL_MOD = 10  # a file is validation when crc32(name) % VAL_MOD == 0

# Model and batch sizes. "small" is the default: 300 steps took 104 s wall on
# 2 shared CPUs.
SIZES = {
  "tiny": dict(layers=2, d_model=32, heads=2, seq_len=32, batch=16, steps=100),
  "small": dict(layers=4, d_model=64, heads=4, seq_len=64, batch=32, steps=300),
  "medium": dict(
    layers=6, d_model=128, heads=4, seq_len=128, batch=32, steps=2000
  ),
}

# Scalers by name. Each takes the run's Config. A new preset (for instance a
# headroom scaler) is one more entry here, and it joins --compare runs by
# adding its name to compare_precision.DYNAMIC.
SCALERS = {
  "none": lambda c: fs.no_scaler(),
  "static": lambda c: fs.static_scaler(c.static_scale),
  "deepspeed": lambda c: fs.deepspeed_scaler(
    init_scale=c.init_scale, scale_window=c.window
  ),
  "torch": lambda c: fs.torch_scaler(
    init_scale=c.init_scale, growth_interval=c.window
  ),
  "megatron": lambda c: fs.megatron_scaler(
    initial_scale=c.init_scale, growth_interval=c.window
  ),
  "flax": lambda c: fs.flax_scaler(
    scale=c.init_scale, growth_interval=c.window
  ),
  # Sets the scale from the gradients' measured range, not a step count.
  "headroom": lambda c: fs.headroom_scaler(init_scale=c.init_scale),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """One run: model size, optimizer, precision and scaler."""

  layers: int = 4
  d_model: int = 64
  heads: int = 4
  seq_len: int = 64
  batch: int = 32
  steps: int = 300
  lr: float = 1e-3
  init_std: float = 0.02  # normal init of every weight matrix and embedding
  max_norm: float = 1.0
  # Gradient accumulation as DeepSpeed's engine (gradient_accumulation_steps),
  # Megatron's schedules (num_microbatches) and torch's AMP recipe (loss /
  # iters_to_accumulate) do it: each microbatch's loss is divided by
  # `accumulate` before its backward pass, so each of its float16 gradients is
  # that many times smaller, and the step sums the microbatch gradients in
  # float32. `microbatches` of them are run per step (0: all `accumulate`);
  # fewer gives every microbatch the same float16 gradients as the full
  # recipe at a fraction of the compute (and of the batch).
  accumulate: int = 1
  microbatches: int = 0
  precision: str = "fp16"  # "fp16" or "fp32"
  scaler: str = "deepspeed"  # a key of SCALERS
  # Dynamic scalers start high (as DeepSpeed's own default, 2**32, does) and
  # back off on the first, overflowing, steps.
  init_scale: float = 2.0**24
  window: int = 200  # dynamic scalers' clean steps between growths
  static_scale: float = 2.0**12  # static_scaler's scale
  eval_every: int = 50
  eval_batches: int = 8
  seed: int = 0
  # Stack the blocks' params on a layer axis and apply them with nn.scan;
  # fp16_loss_scale(stacked_axes=...) then records overflows per layer.
  scan: bool = False
  # Compute each block's attention in float32 (its logits, q . k, leave
  # float16's range when q and k grow): the fix of docs/locate-overflow.md's
  # worked case, where fs.locate_overflow names the attention's logits.
  float32_attention: bool = False

  def __post_init__(self):
    if self.accumulate < 1:
      raise ValueError(f"accumulate must be >= 1, got {self.accumulate}")
    if not 0 <= self.microbatches <= self.accumulate:
      raise ValueError(
        f"microbatches must be in [0, accumulate={self.accumulate}], got "
        f"{self.microbatches}"
      )

  @property
  def micro(self) -> int:
    """Microbatches run per step."""
    return self.microbatches or self.accumulate

  @property
  def dtype(self):
    return jnp.float16 if self.precision == "fp16" else jnp.float32


# --------------------------------------------------------------------------
# Data


def encode(text: str) -> np.ndarray:
  codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
  return np.minimum(codes, VOCAB - 1).astype(np.uint8)


def load_corpus(max_chars: Optional[int] = None):
  """(train, validation) token arrays from the stdlib's top-level .py files.

  Files are read in sorted order and split by the CRC-32 of their name, so the
  split is the same on every run and machine with the same Python.
  ``max_chars`` truncates each part (for quick runs).
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  parts = {True: [], False: []}
  for path in sorted(root.glob("*.py")):
    text = path.read_text(encoding="utf-8", errors="replace")
    parts[zlib.crc32(path.name.encode()) % VAL_MOD == 0].append(text)
  train, val = ("\n".join(parts[v]) for v in (False, True))
  if max_chars is not None:
    train, val = train[:max_chars], val[:max_chars]
  if not train or not val:
    raise RuntimeError(f"no standard library sources under {root}")
  return encode(train), encode(val)


def batches(tokens, cfg: Config, rng: np.random.Generator):
  """Random windows of seq_len + 1 tokens: inputs and next-token targets,
  shaped (batch, seq_len), or (microbatches, batch, seq_len) with more than one.
  """
  n = cfg.batch * cfg.micro
  starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, n)
  idx = starts[:, None] + np.arange(cfg.seq_len + 1)
  win = tokens[idx].astype(np.int32)
  if cfg.micro > 1:
    win = win.reshape(cfg.micro, cfg.batch, -1)
  return win[..., :-1], win[..., 1:]


def val_set(tokens, cfg: Config):
  """Fixed validation windows, evenly spaced over the validation text."""
  n = cfg.eval_batches * cfg.batch
  starts = np.linspace(0, len(tokens) - cfg.seq_len - 1, n).astype(np.int64)
  win = tokens[starts[:, None] + np.arange(cfg.seq_len + 1)].astype(np.int32)
  return win[:, :-1], win[:, 1:]


# --------------------------------------------------------------------------
# Model


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  heads: int
  init_std: float
  out_std: float
  dtype: jnp.dtype
  float32_attention: bool = False

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
    attention_dtype = jnp.float32 if self.float32_attention else self.dtype
    h = nn.LayerNorm(**kw)(x)
    attention = nn.MultiHeadDotProductAttention(
      self.heads,
      kernel_init=nn.initializers.normal(self.init_std),
      out_kernel_init=nn.initializers.normal(self.out_std),
      force_fp32_for_softmax=True,
      dtype=attention_dtype,
      param_dtype=jnp.float32,
    )
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], bool))
    x = x + attention(h, mask=mask).astype(x.dtype)
    h = nn.LayerNorm(**kw)(x)
    h = nn.Dense(
      4 * d, kernel_init=nn.initializers.normal(self.init_std), **kw
    )(h)
    h = nn.Dense(d, kernel_init=nn.initializers.normal(self.out_std), **kw)(
      nn.gelu(h)
    )
    return x + h


class ScannedBlock(nn.Module):
  """A :class:`Block` as ``nn.scan`` calls it: ``(carry, _) -> (carry, _)``."""

  heads: int
  init_std: float
  out_std: float
  dtype: jnp.dtype
  float32_attention: bool = False

  @nn.compact
  def __call__(self, x, _):
    args = (self.heads, self.init_std, self.out_std, self.dtype)
    block = Block(*args, self.float32_attention)
    return block(x), None


class Transformer(nn.Module):
  """Decoder-only LM; the token embedding is tied to the output head."""

  layers: int
  d_model: int
  heads: int
  seq_len: int
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float16
  scan: bool = False  # the blocks stacked under "blocks", axis 0
  float32_attention: bool = False  # each block's attention in float32

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(self.init_std)
    embed = nn.Embed(VOCAB, self.d_model, embedding_init=init, dtype=self.dtype)
    pos = self.param("pos", init, (self.seq_len, self.d_model))
    x = embed(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
    # GPT-2's scaling of the residual projections: 1 / sqrt(2 * layers).
    out_std = self.init_std / math.sqrt(2 * self.layers)
    args = (self.heads, self.init_std, out_std, self.dtype)
    args += (self.float32_attention,)
    if self.scan:
      blocks = nn.scan(
        ScannedBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=self.layers,
      )
      x, _ = blocks(*args, name="blocks")(x, None)
    for _ in range(0 if self.scan else self.layers):
      x = Block(*args)(x)
    x = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32)(x)
    return embed.attend(x)  # logits, in the compute dtype


def make_model(cfg: Config, dtype=None) -> Transformer:
  return Transformer(
    cfg.layers,
    cfg.d_model,
    cfg.heads,
    cfg.seq_len,
    cfg.init_std,
    cfg.dtype if dtype is None else dtype,
    cfg.scan,
    cfg.float32_attention,
  )


def init_params(cfg: Config):
  """float32 master parameters.

  They do not depend on the compute dtype (every parameter is created in
  float32), so they come from the float32 model for every precision: runs
  of both precisions then share the eager init's op compiles.
  """
  tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
  model = make_model(cfg, jnp.float32)
  return model.init(jax.random.key(cfg.seed), tokens)["params"]


def loss_fn(model, params, x, y):
  """Mean next-character cross-entropy; softmax in float32."""
  logits = model.apply({"params": params}, x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# --------------------------------------------------------------------------
# Training


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  scaler = SCALERS[cfg.scaler](cfg)
  stacked = fs.stacked_under("blocks") if cfg.scan else None
  return fs.chain(
    fs.fp16_loss_scale(scaler, stacked_axes=stacked),
    fs.clip_by_unscaled_norm(cfg.max_norm),  # by the *unscaled* norm
    optax.adamw(cfg.lr, weight_decay=1e-4),
  )


def make_grad_fn(cfg: Config):
  """(half_params, x, y, scale) -> (loss, grads, zero_frac).

  The gradients of ``loss / accumulate * scale`` with respect to the
  compute-dtype parameters: of one batch, or of each of ``microbatches``
  microbatches (``x`` and ``y`` then have a leading microbatch axis), summed
  in float32. ``loss`` is the mean (microbatch) loss; ``zero_frac`` the
  fraction of compute-dtype gradient elements that are exactly zero.
  """
  model = make_model(cfg)

  def one(half, x, y, scale):
    def scaled_loss(p):
      loss = loss_fn(model, p, x, y)
      return loss / cfg.accumulate * scale, loss

    (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(half)
    zeros = sum(jnp.sum(g == 0) for g in jax.tree.leaves(grads))
    return loss, grads, zeros

  def grad_fn(half, x, y, scale):
    n = sum(p.size for p in jax.tree.leaves(half)) * cfg.micro
    if cfg.micro == 1:
      loss, grads, zeros = one(half, x, y, scale)
      return loss, grads, zeros / n

    def micro(carry, xy):
      total, acc, zeros = carry
      loss, g, z = one(half, *xy, scale)
      acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
      return (total + loss, acc, zeros + z), None

    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), half)
    (total, grads, zeros), _ = jax.lax.scan(
      micro, (jnp.float32(0), acc, jnp.int32(0)), (x, y)
    )
    return total / cfg.micro, grads, zeros / n

  return grad_fn


def make_train_step(cfg: Config, tx, *, measure_zeros: bool = True):
  """The jitted, donated step: (params, opt_state, x, y) -> (params,
  opt_state, metrics).

  With ``measure_zeros`` the metrics include ``zero_frac``, the fraction of
  gradient elements (in the compute dtype) that are exactly zero; it costs one
  extra pass over the gradients, so benchmarks turn it off.
  """
  grad_fn = make_grad_fn(cfg)

  def step(params, opt_state, x, y):
    scale = fs.current_scale(opt_state)
    # The compute-dtype copy of the model: gradients come out in that dtype.
    half = jax.tree.map(lambda p: p.astype(cfg.dtype), params)
    loss, grads, zero_frac = grad_fn(half, x, y, scale)
    metrics = {"loss": loss}
    if measure_zeros:
      metrics["zero_frac"] = zero_frac
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(fs.scale_metrics(opt_state), **metrics)

  return jax.jit(step, donate_argnums=(0, 1))


def make_eval(cfg: Config):
  """Validation loss of the float32 masters, computed in float32 for every
  run so that runs compare on what they learned.
  """
  shape = (cfg.layers, cfg.d_model, cfg.heads, cfg.seq_len, cfg.init_std)
  return _eval_fn(*shape, cfg.scan)


@functools.lru_cache(maxsize=None)
def _eval_fn(*shape):
  # One jitted function per model shape: runs that differ only in precision
  # or scaler share its compilation.
  *shape, scan = shape
  model = Transformer(*shape, dtype=jnp.float32, scan=scan)
  return jax.jit(lambda params, x, y: loss_fn(model, params, x, y))


def train(cfg: Config, data, *, desc: Optional[str] = None, bar=True):
  """Trains one run; returns its history as numpy arrays.

  Returns:
    A dict: ``eval_steps`` and ``val_loss`` (validation loss after that many
    steps, from step 0), per step ``loss``, ``loss_scale`` (the scale the
    step's gradients were made with), ``overflow``, ``zero_frac``, and
    ``skipped_steps``, ``step_time`` (median seconds per step, compile
    excluded) and ``config``.
  """
  train_tokens, val_tokens = data
  vx, vy = val_set(val_tokens, cfg)
  vx = vx.reshape(cfg.eval_batches, cfg.batch, -1)
  vy = vy.reshape(cfg.eval_batches, cfg.batch, -1)
  params = init_params(cfg)
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  step = make_train_step(cfg, tx)
  evaluate = make_eval(cfg)
  rng = np.random.default_rng(cfg.seed)  # the same batches in every run

  def val_loss(params):
    return float(np.mean([evaluate(params, a, b) for a, b in zip(vx, vy)]))

  eval_steps, val_losses, history, seg_times = [0], [val_loss(params)], [], []
  pbar = tqdm(
    total=cfg.steps,
    desc=desc or f"{cfg.precision} {cfg.scaler}",
    disable=None if bar else True,  # None: off when not a terminal
    leave=False,
  )
  i = 0
  while i < cfg.steps:
    n = min(cfg.eval_every, cfg.steps - i)
    t0 = time.perf_counter()
    for _ in range(n):
      x, y = batches(train_tokens, cfg, rng)
      params, opt_state, m = step(params, opt_state, x, y)
      history.append(m)
    jax.block_until_ready(params)
    if i > 0:  # the first segment includes the compile
      seg_times.append((time.perf_counter() - t0) / n)
    i += n
    eval_steps.append(i)
    val_losses.append(val_loss(params))
    pbar.update(n)
    pbar.set_postfix(
      val=f"{val_losses[-1]:.3f}",
      scale=f"{float(m['loss_scale']):g}",
      zero=f"{float(m['zero_frac']):.3f}",
    )
  pbar.close()
  h = {k: np.stack([m[k] for m in jax.device_get(history)]) for k in history[0]}
  return {
    "config": cfg,
    "eval_steps": np.array(eval_steps),
    "val_loss": np.array(val_losses),
    "loss": h["loss"],
    "loss_scale": h["prev_loss_scale"],
    "overflow": h["overflow"],
    "zero_frac": h["zero_frac"],
    "skipped_steps": int(h["skipped_steps"][-1]),
    "step_time": float(np.median(seg_times)) if seg_times else float("nan"),
  }


def summary(r) -> str:
  c = r["config"]
  finite = r["val_loss"][np.isfinite(r["val_loss"])]
  return (
    f"{c.precision} {c.scaler}: val loss {r['val_loss'][0]:.3f} -> "
    f"{r['val_loss'][-1]:.3f} (best {finite.min() if finite.size else 0:.3f})"
    f", skipped {r['skipped_steps']}/{c.steps}, zero grads "
    f"{np.mean(r['zero_frac'][-50:]):.2%} (last 50 steps), "
    f"{1e3 * r['step_time']:.0f} ms/step"
  )


def add_config_args(p: argparse.ArgumentParser):
  """The flags that make a Config; --size picks the defaults they override."""
  p.add_argument("--size", choices=sorted(SIZES), default="small")
  for f in dataclasses.fields(Config):
    if f.name in ("precision", "scaler"):
      continue
    if f.name == "scan":
      help = "stack the blocks, apply them with nn.scan"
      p.add_argument("--scan", action="store_const", const=True, help=help)
      continue
    if f.name == "float32_attention":
      help = "compute each block's attention in float32"
      flag = "--float32-attention"
      p.add_argument(flag, action="store_const", const=True, help=help)
      continue
    p.add_argument(
      "--" + f.name.replace("_", "-"),
      type=type(f.default),
      default=None,
      help=f"default {f.default} (or the --size's)",
    )
  p.add_argument(
    "--max-chars",
    type=int,
    default=None,
    help="truncate train and validation text (quick runs)",
  )


def config_from_args(args, **overrides) -> Config:
  kw = dict(SIZES[args.size])
  for f in dataclasses.fields(Config):
    v = getattr(args, f.name, None)
    if v is not None:
      kw[f.name] = v
  kw.update(overrides)
  return Config(**kw)


def main(argv=None):
  """Trains one run and prints its summary; returns its history."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
  p.add_argument("--scaler", choices=sorted(SCALERS), default="deepspeed")
  add_config_args(p)
  args = p.parse_args(argv)
  scaler = "none" if args.precision == "fp32" else args.scaler
  cfg = config_from_args(args, precision=args.precision, scaler=scaler)
  data = load_corpus(args.max_chars)
  print(
    f"corpus: {len(data[0]):,} train / {len(data[1]):,} validation chars; {cfg}"
  )
  r = train(cfg, data)
  print(summary(r))
  return r


if __name__ == "__main__":
  main()
