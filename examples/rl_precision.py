"""float16 against bfloat16 for RL fine-tuning: the sampler-trainer mismatch.

Qi et al., "Defeating the Training-Inference Mismatch via FP16" (arXiv
2510.26788), trace the instability of RL fine-tuning to bfloat16's rounding:
the sampler (an inference engine, KV-cache decoding) and the trainer (a
full-sequence forward pass) compute the same policy with different kernels,
so in bfloat16 they disagree on every token's probability. float16 has 3
more mantissa bits, so the same kernels disagree 8 times less per value;
its narrow range needs loss scaling, which fp16_scaling supplies.

This script shows it on a tiny model, end to end:

1. A two-layer transformer is pretrained in float32 on a verifiable task,
   adding two 2-digit numbers (the sum's 3 digits written least significant
   first), and saved as a bfloat16 checkpoint (``.npz``, the bits as
   uint16), as bfloat16-trained models ship. Its layers are stacked, as
   scanned models keep them: one ``[L, ...]`` leaf per parameter kind under
   ``"layers"``, applied with ``lax.scan`` by the trainer and by the
   sampler, which carries each layer's KV cache through that scan.
2. The checkpoint is audited with ``fs.cast_report(params, jnp.float16)``
   before any float16 run. A copy with one weight past 65504 (as in
   Qwen3#868) is audited too, and one float16 window on it shows the
   overflow reported as ``forward``: no loss scale can fix it.
3. The checkpoint is fine-tuned with a policy gradient, GRPO style: G
   samples per prompt, the reward the fraction of correct digits, the
   advantage the reward less its group's mean. The sampler decodes with a
   KV cache and normalises attention after the value product (as
   flash-decoding does) and splits each matmul's contraction in two
   (split-K, each half rounded), as inference GEMMs do; the trainer runs the
   full sequence, normalises before the value product and contracts in one
   go. Both keep a float32 residual stream and compute every matmul, the
   attention and the weights in the run's dtype, each value rounded to it
   as stored. Three runs from the same checkpoint and the same prompts:

     bfloat16   fs.no_scaler(): bfloat16 needs no scaling
     float16    fs.torch_scaler(growth_interval=400), verl's FSDP recipe
     float32    fs.no_scaler(): the reference

   Each step's mini-batch is split into micro-batches that go through
   ``fs.value_and_grad`` and ``fs.accumulate_gradients`` with ``value=``;
   ``stacked_axes=fs.stacked_under("layers")`` makes the overflow report
   and ``scale_metrics`` count per layer.

Per run it prints the per-token KL between the sampler's and the trainer's
next-token distributions (on the sampled responses, before each update),
the mean |log p_sampler - log p_trainer| of the sampled tokens, the reward
and the scale metrics. What it does not show: the collapse of large models'
RL runs that the paper traces to the mismatch; a model this small, trained
this briefly, does not collapse in any dtype.

    pip install -e ".[examples]"   # from the repository root
    python examples/rl_precision.py                 # 90 s of CPU time
    python examples/rl_precision.py --plot docs/images/rl_precision.png
    python examples/rl_precision.py --quick         # the test's size
"""

import argparse
import dataclasses
import os
import pathlib
import tempfile
import time

# Every value rounds to the run's dtype as stored, as a GPU kernel's outputs
# do: XLA's CPU compiler otherwise keeps some float16 and bfloat16
# intermediates in float32 (docs/design.md). Read when JAX starts.
_STRICT = "--xla_allow_excess_precision=false"
if _STRICT not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_STRICT}"

import jax  # noqa: E402
from jax import lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fp16_scaling as fs  # noqa: E402

VOCAB = 12  # digits 0-9, "+" (10) and "=" (11)
PLUS, EQUALS = 10, 11
DIGITS = 2  # each addend; the sum has DIGITS + 1 digits
PROMPT = 2 * DIGITS + 2  # "12+34="
ANSWER = DIGITS + 1
SEQ = PROMPT + ANSWER
SPLIT = 2  # the sampler's split-K
DTYPES = {
  "bfloat16": jnp.bfloat16,
  "float16": jnp.float16,
  "float32": jnp.float32,
}
SCALERS = {  # the RL frameworks' float16 recipes: docs/porting-rl.md
  "bfloat16": lambda: fs.no_scaler(),
  "float16": lambda: fs.torch_scaler(growth_interval=400),  # verl FSDP
  "float32": lambda: fs.no_scaler(),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """The model, the pretraining and the RL runs' sizes."""

  d_model: int = 32
  heads: int = 2
  layers: int = 2
  pretrain_steps: int = 600
  pretrain_batch: int = 64
  pretrain_lr: float = 3e-3
  rl_steps: int = 30
  prompts: int = 16  # per step
  group: int = 8  # samples per prompt
  micro: int = 4  # micro-batches per mini-batch
  lr: float = 5e-4
  seed: int = 0


QUICK = Config(
  layers=1, pretrain_steps=100, rl_steps=3, prompts=8, group=4, micro=2
)


# --------------------------------------------------------------------------
# The task


def problems(rng, n):
  """``n`` prompts "ab+cd=" as tokens, and their answers: the sum's
  digits, least significant first."""
  a, b = rng.integers(0, 10**DIGITS, (2, n))
  digits = lambda x, k: (x[:, None] // 10 ** np.arange(k)) % 10
  prompt = np.concatenate(
    [
      digits(a, DIGITS)[:, ::-1],
      np.full((n, 1), PLUS),
      digits(b, DIGITS)[:, ::-1],
      np.full((n, 1), EQUALS),
    ],
    axis=1,
  )
  return prompt.astype(np.int32), digits(a + b, ANSWER).astype(np.int32)


def reward(answers, truth):
  """The fraction of the answer's digits that are right, per sequence."""
  return (answers == truth).mean(axis=1)


# --------------------------------------------------------------------------
# The model: a float32 residual stream, everything else in the run's dtype


def init_params(cfg: Config):
  """float32 parameters, drawn with numpy (no per-shape compiles)."""
  d, rng = cfg.d_model, np.random.default_rng(cfg.seed)
  normal = lambda shape, std=0.02: (std * rng.standard_normal(shape)).astype(
    np.float32
  )
  norm = lambda: {
    "scale": np.ones(d, np.float32),
    "bias": np.zeros(d, np.float32),
  }
  out_std = 0.02 / np.sqrt(2 * cfg.layers)
  layers = [
    {
      "ln1": norm(),
      "qkv": normal((d, 3 * d)),
      "proj": normal((d, d), out_std),
      "ln2": norm(),
      "up": normal((d, 4 * d)),
      "down": normal((4 * d, d), out_std),
    }
    for _ in range(cfg.layers)
  ]
  # Stacked, as scanned models keep them: one leaf per kind, [L, ...].
  layers = jax.tree.map(lambda *xs: np.stack(xs), *layers)
  return {
    "embed": normal((VOCAB, d)),
    "pos": normal((SEQ, d)),
    "layers": layers,
    "ln_f": norm(),
    "head": normal((d, VOCAB)),
  }


def layer_norm(h, p):
  """In float32, whatever the dtype of ``p``."""
  mu = h.mean(-1, keepdims=True)
  var = ((h - mu) ** 2).mean(-1, keepdims=True)
  scale, bias = p["scale"].astype(jnp.float32), p["bias"].astype(jnp.float32)
  return (h - mu) * lax.rsqrt(var + 1e-5) * scale + bias


def matmul(x, w, split=1):
  """``x @ w`` in their dtype; ``split`` > 1 splits the contraction (split-K,
  as inference GEMMs do), each partial product rounded to the dtype."""
  if split == 1:
    return x @ w
  c = w.shape[0] // split
  parts = [
    x[..., i * c : (i + 1) * c] @ w[i * c : (i + 1) * c] for i in range(split)
  ]
  return sum(parts[1:], parts[0])


def _heads(x, heads):
  return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def _mlp(h, lp, split):
  x = layer_norm(h, lp["ln2"]).astype(lp["up"].dtype)
  up = jax.nn.gelu(matmul(x, lp["up"], split))
  return h + matmul(up, lp["down"], split).astype(jnp.float32)


def _logits(h, p, split):
  x = layer_norm(h, p["ln_f"]).astype(p["head"].dtype)
  return matmul(x, p["head"], split).astype(jnp.float32)


def trainer_logits(p, tokens, heads):
  """The full-sequence forward pass: (batch, SEQ) -> (batch, SEQ, VOCAB).
  Attention is normalised before the value product."""
  t = tokens.shape[1]
  h = (p["embed"][tokens] + p["pos"][:t]).astype(jnp.float32)
  causal = jnp.tril(jnp.ones((t, t), bool))

  def layer(h, lp):  # one layer of the stack
    x = layer_norm(h, lp["ln1"]).astype(lp["qkv"].dtype)
    q, k, v = (_heads(a, heads) for a in jnp.split(x @ lp["qkv"], 3, -1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(causal, s, -jnp.inf)
    e = jnp.exp(s - s.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape)
    return _mlp(h + (o @ lp["proj"]).astype(jnp.float32), lp, 1), None

  h, _ = lax.scan(layer, h, p["layers"])
  return _logits(h, p, 1)


def sample(p, prompts, key, heads):
  """KV-cache decoding, one token at a time: the prompt is fed in, then
  ANSWER tokens are drawn. Attention is normalised after the value product,
  and each matmul splits its contraction in SPLIT. Each token scans the
  layer stack, each layer carrying its own slice of the cache.

  Returns:
    (tokens (batch, SEQ), logits (batch, ANSWER, VOCAB)): the sampler's
    logits for each drawn token, in float32.
  """
  b, dtype = prompts.shape[0], p["head"].dtype
  d = p["embed"].shape[1]
  n_layers = p["layers"]["qkv"].shape[0]
  cache = jnp.zeros((n_layers, 2, b, SEQ, heads, d // heads), dtype)
  tokens = jnp.zeros((b, SEQ), jnp.int32).at[:, :PROMPT].set(prompts)

  def step(carry, t):
    tokens, cache = carry

    def layer(h, xs):  # one layer of the stack and its [2, b, SEQ, ...] cache
      lp, kv = xs
      x = layer_norm(h, lp["ln1"]).astype(dtype)
      qkv = matmul(x, lp["qkv"], SPLIT)
      q, k, v = (_heads(a, heads) for a in jnp.split(qkv, 3, -1))
      kv = kv.at[0, :, t].set(k).at[1, :, t].set(v)
      s = jnp.einsum("bhd,bkhd->bhk", q, kv[0]) / np.sqrt(q.shape[-1])
      s = jnp.where(jnp.arange(SEQ) <= t, s, -jnp.inf)
      e = jnp.exp(s - s.max(-1, keepdims=True))
      o = jnp.einsum("bhk,bkhd->bhd", e, kv[1]) / e.sum(-1)[..., None]
      o = matmul(o.reshape(x.shape), lp["proj"], SPLIT)
      return _mlp(h + o.astype(jnp.float32), lp, SPLIT), kv

    h = (p["embed"][tokens[:, t]] + p["pos"][t]).astype(jnp.float32)
    h, cache = lax.scan(layer, h, (p["layers"], cache))
    logits = _logits(h, p, SPLIT)
    drawn = jax.random.categorical(jax.random.fold_in(key, t), logits)
    nxt = jnp.where(t + 1 < PROMPT, tokens[:, t + 1], drawn)
    return (tokens.at[:, t + 1].set(nxt), cache), logits

  (tokens, _), logits = lax.scan(step, (tokens, cache), jnp.arange(SEQ - 1))
  return tokens, jnp.moveaxis(logits, 0, 1)[:, PROMPT - 1 :]


# --------------------------------------------------------------------------
# Pretraining in float32, the bfloat16 checkpoint and its audit


def pretrain(cfg: Config):
  params = init_params(cfg)
  schedule = optax.cosine_decay_schedule(cfg.pretrain_lr, cfg.pretrain_steps)
  tx = optax.adamw(schedule)
  rng = np.random.default_rng(cfg.seed)

  def loss_fn(params, tokens):
    logits = trainer_logits(params, tokens, cfg.heads)[:, PROMPT - 1 : -1]
    labels = tokens[:, PROMPT:]
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  @jax.jit
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  for _ in range(cfg.pretrain_steps):
    prompt, answer = problems(rng, cfg.pretrain_batch)
    tokens = np.concatenate([prompt, answer], axis=1)
    params, opt_state, loss = step(params, opt_state, tokens)
  return params, float(loss)


def save_bf16(params, path):
  """A bfloat16 checkpoint: each leaf's bfloat16 bits as uint16."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  bits = {
    jax.tree_util.keystr(k): np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
    for k, x in flat
  }
  np.savez(path, **bits)


def load_bf16(path, like):
  """The checkpoint's bfloat16 leaves, in ``like``'s tree."""
  with np.load(path) as f:
    flat = jax.tree_util.tree_flatten_with_path(like)
    leaves = [f[jax.tree_util.keystr(k)].view(jnp.bfloat16) for k, _ in flat[0]]
  return jax.tree.unflatten(flat[1], leaves)


def cast_layers(params, dtype):
  """Per layer, the values of the stacked leaves that the cast to ``dtype``
  makes inf: ``fs.cast_report`` counts per leaf, and a stacked leaf holds
  every layer."""
  with np.errstate(over="ignore"):  # the overflow is what is counted
    inf = [
      np.isinf(np.asarray(x).astype(dtype))
      for x in jax.tree.leaves(params["layers"])
    ]
  per_layer = sum(x.reshape(len(x), -1).sum(1) for x in inf)
  return "Past the range, by layer of ['layers']: " + ", ".join(
    f"layer {i}: {n}" for i, n in enumerate(per_layer)
  )


# --------------------------------------------------------------------------
# RL fine-tuning


def make_optimizer(cfg: Config, name: str):
  # The layer axis of every leaf under "layers": overflows, counts and
  # scale_metrics' nonfinite_layers are per layer (docs/stacked.md).
  stacked = fs.stacked_under("layers")
  tx = fs.chain(
    fs.fp16_loss_scale(SCALERS[name](), stacked_axes=stacked),
    optax.adam(cfg.lr),
  )
  return fs.accumulate_gradients(tx, cfg.micro)


def make_steps(cfg: Config, tx, dtype):
  """(sampler, micro-batch step), jitted, for one run's dtype."""

  def policy_loss(half, tokens, adv):
    logits = trainer_logits(half, tokens, cfg.heads)[:, PROMPT - 1 : -1]
    logp = jax.nn.log_softmax(logits)
    taken = jnp.take_along_axis(logp, tokens[:, PROMPT:, None], -1)[..., 0]
    return -jnp.mean(adv[:, None] * taken), logits

  @jax.jit
  def sampler(params, prompts, key):
    half = jax.tree.map(lambda x: x.astype(dtype), params)
    return sample(half, prompts, key, cfg.heads)

  @jax.jit
  def micro_step(params, opt_state, tokens, adv):
    half = jax.tree.map(lambda x: x.astype(dtype), params)
    grad_fn = fs.value_and_grad(policy_loss, opt_state, has_aux=True)
    (loss, logits), grads = grad_fn(half, tokens, adv)
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = optax.apply_updates(params, updates)
    return params, opt_state, logits, fs.scale_metrics(opt_state)

  return sampler, micro_step


def mismatch(sampler_logits, trainer_logits, tokens):
  """(per-token KL(sampler || trainer), mean |delta log p| of the sampled
  tokens), in float64 from the float32 logits."""
  ls, lt = (np.asarray(x, np.float64) for x in (sampler_logits, trainer_logits))
  ls = ls - np.logaddexp.reduce(ls, -1, keepdims=True)
  lt = lt - np.logaddexp.reduce(lt, -1, keepdims=True)
  kl = np.sum(np.exp(ls) * (ls - lt), -1)
  idx = tokens[:, PROMPT:, None]
  delta = np.take_along_axis(ls, idx, -1) - np.take_along_axis(lt, idx, -1)
  return float(kl.mean()), float(np.abs(delta).mean())


def run(cfg: Config, name: str, params32):
  """One RL run; its history per step."""
  tx = make_optimizer(cfg, name)
  sampler, micro_step = make_steps(cfg, tx, DTYPES[name])
  params, opt_state = params32, tx.init(params32)
  rng, key = np.random.default_rng(cfg.seed + 1), jax.random.key(cfg.seed + 1)
  keys = ("kl", "dlogp", "reward", "loss_scale", "skipped", "bad_layers")
  hist = {k: [] for k in keys}
  t0 = time.perf_counter()
  for i in range(cfg.rl_steps):
    prompt, truth = problems(rng, cfg.prompts)
    prompt, truth = (np.repeat(x, cfg.group, axis=0) for x in (prompt, truth))
    tokens, s_logits = sampler(params, prompt, jax.random.fold_in(key, i))
    tokens = np.asarray(tokens)
    r = reward(tokens[:, PROMPT:], truth).reshape(cfg.prompts, cfg.group)
    adv = (r - r.mean(axis=1, keepdims=True)).reshape(-1).astype(np.float32)
    t_logits = []
    for tok, a in zip(*(np.split(x, cfg.micro) for x in (tokens, adv))):
      params, opt_state, logits, m = micro_step(params, opt_state, tok, a)
      t_logits.append(logits)
    kl, dlogp = mismatch(s_logits, np.concatenate(t_logits), tokens)
    hist["kl"].append(kl)
    hist["dlogp"].append(dlogp)
    hist["reward"].append(float(r.mean()))
    hist["loss_scale"].append(float(m["prev_loss_scale"]))
    hist["skipped"].append(int(m["skipped_steps"]))
    hist["bad_layers"].append(int(m["nonfinite_layers"]))
  hist = {k: np.array(v) for k, v in hist.items()}
  hist["seconds"] = time.perf_counter() - t0
  hist["applied"] = int(m["applied_steps"])
  return hist, (micro_step, opt_state)


def forward_overflow_demo(cfg: Config, micro_step, opt_state, poisoned):
  """One float16 window on the poisoned checkpoint: the report says
  ``forward``."""
  rng = np.random.default_rng(7)
  prompt, answer = problems(rng, cfg.prompts * cfg.group)
  tokens = np.concatenate([prompt, answer], axis=1)
  adv = np.ones(len(tokens), np.float32)
  params = jax.tree.map(lambda x: x.astype(jnp.float32), poisoned)
  for tok, a in zip(*(np.split(x, cfg.micro) for x in (tokens, adv))):
    params, opt_state, _, _ = micro_step(params, opt_state, tok, a)
  return fs.overflow_report(opt_state)


def table(results) -> str:
  head = (
    f"{'run':<9} {'KL(sampler||trainer)':>20} {'|dlogp|':>9} "
    f"{'reward':>15} {'loss scale':>10} {'skipped':>7}"
  )
  lines = [head, "-" * len(head)]
  for name, h in results.items():
    k = max(1, min(5, len(h["reward"]) // 2))  # first and last k steps
    lines.append(
      f"{name:<9} {h['kl'].mean():>20.2e} {h['dlogp'].mean():>9.2e} "
      f"{h['reward'][:k].mean():>6.3f} -> {h['reward'][-k:].mean():.3f} "
      f"{h['loss_scale'][-1]:>10g} {h['skipped'][-1]:>7d}"
    )
  return "\n".join(lines)


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
  colors = {"bfloat16": "tab:red", "float16": "tab:blue", "float32": "black"}
  for name, h in results.items():
    steps = np.arange(1, len(h["kl"]) + 1)
    kw = dict(color=colors[name], label=name)
    axes[0].semilogy(steps, np.maximum(h["kl"], 1e-16), **kw)
    axes[1].semilogy(steps, np.maximum(h["dlogp"], 1e-16), **kw)
    axes[2].plot(steps, h["reward"], **kw)
  titles = ("per-token KL(sampler || trainer)", "mean |delta log p|", "reward")
  for ax, title in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=80)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="the test's size")
  parser.add_argument("--rl-steps", type=int, default=None)
  parser.add_argument("--plot", default=None, help="write the figure here")
  args = parser.parse_args(argv)
  cfg = QUICK if args.quick else Config()
  if args.rl_steps:
    cfg = dataclasses.replace(cfg, rl_steps=args.rl_steps)

  t0 = time.perf_counter()
  params32, loss = pretrain(cfg)
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "checkpoint_bf16.npz"
    save_bf16(params32, path)
    ckpt = load_bf16(path, params32)
  print(
    f"pretrained in float32 (loss {loss:.3f}, {time.perf_counter() - t0:.1f}"
    " s); saved as bfloat16"
  )
  audit = fs.cast_report(ckpt, jnp.float16)
  print(audit)
  poisoned = jax.tree.map(np.copy, ckpt)
  poisoned["layers"]["up"][0, 3, 5] = 7e4  # layer 0; bfloat16 holds it
  poisoned_audit = fs.cast_report(poisoned, jnp.float16)
  print("\nThe same checkpoint with one weight set to 7e4:")
  print(poisoned_audit)
  print(cast_layers(poisoned, jnp.float16))

  start = jax.tree.map(lambda x: x.astype(jnp.float32), ckpt)
  results, kept = {}, {}
  for name in DTYPES:
    results[name], kept[name] = run(cfg, name, start)
    h = results[name]
    print(
      f"{name}: {h['seconds']:.1f} s; most layers with a non-finite"
      f" gradient in one step (nonfinite_layers): {h['bad_layers'].max()}"
    )
  report = forward_overflow_demo(cfg, *kept["float16"], poisoned)
  print("\nOne float16 window on the poisoned checkpoint:")
  print(report)
  print()
  print(table(results))
  if args.plot:
    plot(results, args.plot)
  return {
    "results": results,
    "audit": audit,
    "poisoned_audit": poisoned_audit,
    "forward_report": report,
    "table": table(results),
    "config": cfg,
  }


if __name__ == "__main__":
  main()
