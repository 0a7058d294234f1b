"""One loss scale for two optimizers, against ``torch.amp.GradScaler``.

PyTorch's AMP examples page ("Working with multiple models, losses, and
optimizers") steps two models with one scaler::

    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.step(optimizer0)
    scaler.step(optimizer1)
    scaler.update()

Each ``scaler.step`` skips its optimizer alone when that optimizer's own
gradients hold an inf or NaN; the one ``update`` backs off once if any did,
else counts a clean step. Here the same two models (linear layers, float32
parameters; SGD with momentum and Adam in both frameworks) run 300 steps of
that recipe with an inf, -inf or NaN injected into one model's gradients at
random steps, sometimes both, and a growth interval of 3 so that the scale
grows and backs off many times. fp16_scaling runs ``fs.value_and_grad``
per loss, one ``tx.update`` per optimizer and one ``fs.sync_loss_scales``
of both states at the end of the step, in one ``lax.scan``. At every step
the scale (both optimizers'), torch's growth tracker and each
optimizer's skip (torch: its parameters unchanged) must be equal, and the
parameters within float32 tolerance. The GAN case takes the second loss
through the first model after its optimizer stepped, then updates the scale
once.
"""

from helpers import SEED
import jax
import jax.numpy as jnp
import numpy as np
import optax
import oracles
import pytest

import fp16_scaling as fs

torch = oracles.require("torch")

STEPS = 300
BATCH = 8
INIT_SCALE = 2.0**8
GROWTH_INTERVAL = 3
SCALER_ARGS = dict(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
# float32 values (see test_torch.py): optax and torch then form Adam's bias
# corrections alike.
SGD_LR = 2.0**-5
MOMENTUM = 0.5
ADAM_LR = 2.0**-7
BETAS = (0.875, 1 - 2.0**-10)
EPS = 1e-8
BAD_VALUES = (np.inf, -np.inf, np.nan)
# Parameters: float32 operation order only (the frameworks sum the squared
# errors' gradients in different orders), random-walking over the steps.
# Measured over 4 seeds: within 1.3e-6 of each model's largest |parameter|
# (two_losses, step 300), 2.3e-7 in GAN order.
PARAM_RTOL_OF_MAX = 4e-6

# in, out features of each case's two models.
SHAPES = {"two_losses": ((4, 3), (4, 3)), "gan_order": ((4, 1), (4, 4))}


def _optimizers_torch(params0, params1):
  sgd = torch.optim.SGD(params0, lr=SGD_LR, momentum=MOMENTUM, foreach=False)
  adam = torch.optim.Adam(
    params1, lr=ADAM_LR, betas=BETAS, eps=EPS, foreach=False
  )
  return sgd, adam


def _optimizers_optax():
  sgd = optax.sgd(SGD_LR, momentum=MOMENTUM)
  adam = optax.adam(ADAM_LR, b1=BETAS[0], b2=BETAS[1], eps=EPS)
  return sgd, adam


class Case:
  """One case's data: initial parameters, batches and injections."""

  def __init__(self, name):
    self.name = name
    rng = np.random.default_rng([SEED, name == "gan_order"])
    self.params = [
      {
        "weight": rng.standard_normal((o, i)).astype(np.float32) * 0.5,
        "bias": rng.standard_normal(o).astype(np.float32) * 0.1,
      }
      for i, o in SHAPES[name]
    ]
    n_in = SHAPES[name][0][0]
    self.x = rng.standard_normal((STEPS, BATCH, n_in)).astype(np.float32)
    # Targets (two_losses) or the real samples D sees (gan_order).
    n_y = SHAPES[name][0][1] if name == "two_losses" else n_in
    self.y = rng.standard_normal((STEPS, BATCH, n_y)).astype(np.float32)
    both = rng.random(STEPS) < 0.03
    self.bad = [(rng.random(STEPS) < 0.07) | both for _ in range(2)]
    # Where each model's injected value goes: leaf, flat index, value.
    self.where = []
    for p in self.params:
      leaf = rng.integers(2, size=STEPS)  # 0: weight, 1: bias
      sizes = np.array([p["weight"].size, p["bias"].size])
      index = (rng.random(STEPS) * sizes[leaf]).astype(int)
      value = np.asarray(BAD_VALUES)[rng.integers(3, size=STEPS)]
      self.where.append((leaf, index, value.astype(np.float32)))


# ------------------------------------------------------------------- torch


def _linear(p):
  o, i = p["weight"].shape
  m = torch.nn.Linear(i, o)
  with torch.no_grad():
    m.weight.copy_(torch.tensor(p["weight"]))
    m.bias.copy_(torch.tensor(p["bias"]))
  return m


def _inject(model, case, i, t):
  if not case.bad[i][t]:
    return
  leaf, index, value = (w[t] for w in case.where[i])
  param = (model.weight, model.bias)[leaf]
  with torch.no_grad():
    param.grad.view(-1)[index] = float(value)


_LEAVES = ("weight", "bias")


def _copied(model):
  """Copies of ``model``'s parameters."""
  return [p.detach().clone() for p in model.parameters()]


def _unchanged(old, model):
  """Whether ``model``'s parameters equal ``old``, a copy of them."""
  return all(map(torch.equal, old, model.parameters()))


def _numpy_params(model):
  """A ``Linear``'s weight and bias, copied out as numpy."""
  return {k: getattr(model, k).detach().numpy().copy() for k in _LEAVES}


def run_torch(case):
  """The AMP examples page's recipe for ``case``; per step the scale and
  growth tracker after ``scaler.update()``, whether each model's parameters
  stayed unchanged, and the parameters."""
  models = [_linear(p) for p in case.params]
  opts = _optimizers_torch(models[0].parameters(), models[1].parameters())
  scaler = torch.amp.GradScaler("cpu", **SCALER_ARGS)
  mse = torch.nn.MSELoss()
  out = dict(scale=[], tracker=[], skipped=[], params=[])
  for t in range(STEPS):
    x = torch.tensor(case.x[t])
    y = torch.tensor(case.y[t])
    before = [_copied(m) for m in models]
    for opt in opts:
      opt.zero_grad()
    if case.name == "two_losses":
      out0 = models[0](x)
      out1 = models[1](x)
      loss0 = mse(2 * out0 + 3 * out1, y)
      loss1 = mse(3 * out0 - 5 * out1, y)
      scaler.scale(loss0).backward(retain_graph=True)
      scaler.scale(loss1).backward()
      _inject(models[0], case, 0, t)
      _inject(models[1], case, 1, t)
      scaler.step(opts[0])
      scaler.step(opts[1])
    else:  # GAN order: D = models[0], G = models[1]
      d, g = models
      ones = torch.ones(BATCH, 1)
      zeros = torch.zeros(BATCH, 1)
      fake = g(x).detach()
      loss_d = mse(d(y), ones) + mse(d(fake), zeros)
      scaler.scale(loss_d).backward()
      _inject(d, case, 0, t)
      scaler.step(opts[0])
      loss_g = mse(d(g(x)), ones)  # through the updated D
      scaler.scale(loss_g).backward()
      _inject(g, case, 1, t)
      scaler.step(opts[1])
    scaler.update()
    out["scale"].append(scaler.get_scale())
    out["tracker"].append(scaler.state_dict()["_growth_tracker"])
    kept = [_unchanged(old, m) for old, m in zip(before, models)]
    out["skipped"].append(kept)
    out["params"].append([_numpy_params(m) for m in models])
  return out


# -------------------------------------------------------------------- jax


def _apply(p, x):
  return x @ p["weight"].T + p["bias"]


def mse(a, b):
  return jnp.mean((a - b) ** 2)


def loss0(p0, p1, x, y):
  return mse(2 * _apply(p0, x) + 3 * _apply(p1, x), y)


def loss1(p0, p1, x, y):
  return mse(3 * _apply(p0, x) - 5 * _apply(p1, x), y)


def loss_d(pd, pg, x, y):
  ones = jnp.ones((BATCH, 1))
  zeros = jnp.zeros((BATCH, 1))
  fake = _apply(pg, x)
  return mse(_apply(pd, y), ones) + mse(_apply(pd, fake), zeros)


def loss_g(pd, pg, x):
  fake = _apply(pg, x)
  return mse(_apply(pd, fake), jnp.ones((BATCH, 1)))


def _injected(grads, bad, where):
  leaf, index, value = where

  def put(k, g):
    flat = g.reshape(-1)
    at_index = jnp.arange(flat.size) == index
    hit = bad & (leaf == k) & at_index
    return jnp.where(hit, value, flat).reshape(g.shape)

  return {"weight": put(0, grads["weight"]), "bias": put(1, grads["bias"])}


def run_ours(case_names):
  """Every case's fp16_scaling run, one ``lax.scan`` each in one jit."""
  cases = [Case(n) for n in case_names]
  scaler = fs.torch_scaler(**SCALER_ARGS)
  txs = [fs.chain(fs.fp16_loss_scale(scaler), o) for o in _optimizers_optax()]

  def run_one(name, params, xs):
    def body(carry, x):
      p0, p1, s0, s1 = carry
      x, y, bad0, bad1, where0, where1 = x
      # Both states hold the step's scale (synced at the last step's end);
      # s1's, as s0's moves when optimizer 0 steps first.

      def vg(f, **kw):
        return fs.value_and_grad(f, s1, **kw)

      injections = ((bad0, where0), (bad1, where1))

      def step(i, grads, state, params):
        """Optimizer ``i``'s step on ``grads``, its injection put in."""
        grads = _injected(grads, *injections[i])
        updates, state = txs[i].update(grads, state, params)
        return optax.apply_updates(params, updates), state

      if name == "two_losses":  # .grad sums the two backward passes
        _, (g0a, g1a) = vg(loss0, argnums=(0, 1))(p0, p1, x, y)
        _, (g0b, g1b) = vg(loss1, argnums=(0, 1))(p0, p1, x, y)
        g0 = jax.tree.map(jnp.add, g0a, g0b)
        g1 = jax.tree.map(jnp.add, g1a, g1b)
        p0, s0 = step(0, g0, s0, p0)
        p1, s1 = step(1, g1, s1, p1)
      else:
        _, gd = vg(loss_d)(p0, p1, x, y)
        p0, s0 = step(0, gd, s0, p0)
        _, gg = vg(loss_g, argnums=1)(p0, p1, x)  # the updated D
        p1, s1 = step(1, gg, s1, p1)
      s0, s1 = fs.sync_loss_scales(s0, s1)  # scaler.update()
      out = dict(
        scale=jnp.stack([fs.current_scale(s) for s in (s0, s1)]),
        tracker=jnp.stack([s[0].scaler.growth_tracker for s in (s0, s1)]),
        overflow=jnp.stack([s0[0].overflow, s1[0].overflow]),
        params=(p0, p1),
      )
      return (p0, p1, s0, s1), out

    p0, p1 = params
    init = (p0, p1, txs[0].init(p0), txs[1].init(p1))
    return jax.lax.scan(body, init, xs)[1]

  @jax.jit
  def run_all(params, xs):
    return [run_one(n, p, x) for n, p, x in zip(case_names, params, xs)]

  params = [tuple(c.params) for c in cases]
  xs = [(c.x, c.y, *c.bad, *c.where) for c in cases]
  return cases, jax.tree.map(np.asarray, run_all(params, xs))


@pytest.fixture(scope="module")
def runs():
  names = sorted(SHAPES)
  cases, ours = run_ours(names)
  runs = {}
  for name, case, our_run in zip(names, cases, ours):
    runs[name] = (case, run_torch(case), our_run)
  return runs


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_one_scaler_two_optimizers_match_torch_amp(name, runs):
  case, peer, ours = runs[name]
  skipped = np.array(peer["skipped"])
  # torch skipped exactly the injected steps, each optimizer on its own.
  np.testing.assert_array_equal(skipped, np.stack(case.bad, axis=1))
  np.testing.assert_array_equal(ours["overflow"], skipped)
  for i in range(2):  # both optimizers hold torch's one scale
    np.testing.assert_array_equal(
      ours["scale"][:, i], np.float32(peer["scale"])
    )
    np.testing.assert_array_equal(ours["tracker"][:, i], peer["tracker"])
  for t in range(STEPS):
    for i in range(2):
      theirs = peer["params"][t][i]
      largest = max(np.abs(v).max() for v in theirs.values())
      tol = PARAM_RTOL_OF_MAX * largest
      for k in ("weight", "bias"):
        np.testing.assert_allclose(
          ours["params"][i][k][t],
          theirs[k],
          rtol=0,
          atol=tol,
          err_msg=f"step {t} model {i} {k}",
        )
  # Ours skipped bit for bit where torch's parameters did not move.
  for i in range(2):
    for k in ("weight", "bias"):
      p = ours["params"][i][k]
      same = p[1:] == p[:-1]  # per step, each element as the step before
      kept = np.all(same, axis=tuple(range(1, p.ndim)))
      np.testing.assert_array_equal(kept, skipped[1:, i])
  # The run exercised the rule: one-sided and two-sided overflows, and the
  # scale moved both ways many times.
  bad0, bad1 = case.bad
  assert (bad0 & ~bad1).sum() >= 10
  assert (bad1 & ~bad0).sum() >= 10
  assert (bad0 & bad1).sum() >= 3
  scale = np.concatenate([[INIT_SCALE], peer["scale"]])
  grew = (np.diff(scale) > 0).sum()
  fell = (np.diff(scale) < 0).sum()
  assert grew >= 10, (grew, fell)
  assert fell >= 10, (grew, fell)
