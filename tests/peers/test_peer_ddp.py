"""docs/porting-ddp.md's ``shard_map`` DDP port against torch's
``DistributedDataParallel``, two ranks on CPU (gloo).

DDP: each rank takes the mean loss of its own rows under float16 autocast,
backward makes the scaled gradients of that mean, DDP averages them across
ranks, and each rank's GradScaler skips the step if the average holds an
inf. The port: ``shard_map`` over two devices, ``fs.value_and_grad`` of each
device's rows' mean, ``lax.pmean`` for the average, the guarded chain with
``check_vma=False``. Batch 3 makes rank 0's float16 backward overflow
alone: both skip it. At every step the scale and the skips are equal, and
the weights agree to float16's precision.
"""

from functools import partial
import socket

import fp16_bounds as fb
from helpers import SEED
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import oracles

import fp16_scaling as fs

oracles.require("torch")
import oracles_ddp  # noqa: E402

WORLD, ROWS, STEPS, INIT_SCALE, LR = 2, 4, 8, 2.0**10, 1e-2
BAD = 3


def _data():
  rng = np.random.default_rng([SEED, 41])
  x = rng.standard_normal((STEPS, WORLD * ROWS, 8)).astype(np.float32)
  y = x @ rng.standard_normal(8).astype(np.float32)
  y[BAD, :ROWS] *= 1e4  # rank 0's rows: its float16 backward overflows
  params = {
    "hidden": (rng.standard_normal((8, 32)) * 0.3).astype(np.float32),
    "out": (rng.standard_normal((32, 1)) * 0.3).astype(np.float32),
  }
  return x, y, params


def mse(params, x, y):
  h = jax.nn.relu(x.astype(jnp.float16) @ params["hidden"].astype(jnp.float16))
  pred = (h @ params["out"].astype(jnp.float16))[:, 0]
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def run_ours(x, y, params):
  scaler = fs.torch_scaler(init_scale=INIT_SCALE, growth_interval=2)
  tx = fs.chain(fs.fp16_loss_scale(scaler), optax.adam(LR))
  mesh = Mesh(np.array(jax.devices()[:WORLD]), ("data",))

  @jax.jit
  @partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(), P(), P("data"), P("data")),
    out_specs=P(),
    check_vma=False,
  )
  def ddp_step(params, opt_state, x, y):  # as in docs/porting-ddp.md
    loss, grads = fs.value_and_grad(mse, opt_state)(params, x, y)
    grads, loss = jax.lax.pmean((grads, loss), "data")
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    return optax.apply_updates(params, updates), opt_state

  state = (params, tx.init(params))
  out = dict(scale=[], overflow=[], hidden=[], out=[])
  for t in range(STEPS):
    state = ddp_step(*state, x[t], y[t])
    m = fs.scale_metrics(state[1])
    out["scale"].append(float(m["loss_scale"]))
    out["overflow"].append(bool(m["overflow"]))
    for k in ("hidden", "out"):
      out[k].append(np.asarray(state[0][k]))
  return out


def _tree(hidden, out):
  return {"hidden": {"kernel": hidden}, "out": {"kernel": out}}


def _assert_within_the_fp16_bound(x, y, params, ours, theirs):
  """The weights within tests/peers/fp16_bounds.py's bound, step by step:
  each rank's float16 backward and XLA's make gradients that differ by at
  most R * 2**-10 of the absolute gradient (R = 6: the 5 float16 roundings
  of x@W1, h@w2, the cotangent's cast, dh and dW, and the float32 sums',
  DDP's average of two rank means included, as a sixth); Adam divides that
  by the gradient's root mean square (fp16_bounds.adam_step_bounds). A
  skipped step taken moves a weight by about LR: far above the median
  bound (asserted)."""

  def at(run, t):
    """A run's weights after step ``t``, as a parameter tree."""
    return _tree(run["hidden"][t], run["out"][t])

  start = _tree(params["hidden"], params["out"])
  steps, medians = [], []
  for t in range(STEPS):
    mine, peer = (
      (start, start) if t == 0 else (at(ours, t - 1), at(theirs, t - 1))
    )
    d = fb.gap(peer, mine)
    if t == BAD:
      bound = d  # both skipped: neither moved
    else:
      scale = INIT_SCALE if t == 0 else ours["scale"][t - 1]
      # R = 6; a subnormal float16 rounding: 2**-25 absolute, scaled, over 8
      # rows.
      eps, hess, g = fb.mlp_bounds(mine, x[t], y[t], 6, scale)
      steps.append((d, eps, hess, fb.flat(at(ours, t)), g))
      bound = fb.adam_step_bounds(steps, LR)[-1]
      medians.append(np.median(bound))
    diff = fb.gap(at(theirs, t), at(ours, t))
    assert (diff <= bound).all(), (t, diff.max(), bound[diff.argmax()])
  assert max(medians) < LR / 4


def test_shard_map_port_matches_torch_ddp(tmp_path):
  x, y, params = _data()
  np.savez(
    tmp_path / "data.npz", x=x, y=y, lr=LR, init_scale=INIT_SCALE, **params
  )
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  theirs = oracles_ddp.run(str(tmp_path), WORLD, port)
  ours = run_ours(x, y, params)
  np.testing.assert_array_equal(ours["scale"], theirs["scale"])
  assert ours["overflow"] == [t == BAD for t in range(STEPS)]
  _assert_within_the_fp16_bound(x, y, params, ours, theirs)
  for k in ("hidden", "out"):
    # The skipped step kept torch's weights as ours: every bit.
    np.testing.assert_array_equal(theirs[k][BAD], theirs[k][BAD - 1])
  # The scale grew and backed off on the way.
  scales = ours["scale"]
  assert max(scales) > INIT_SCALE and min(scales) < max(scales)
