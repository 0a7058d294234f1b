"""docs/porting-keras.md's blocks, run as written: the Keras 3 custom JAX
loop with LossScaleOptimizer and its fp16_scaling port over the same 60
batches, one of which overflows the float16 forward pass; and the MPX
unscale-order block. Checked: the same scale and skips after every step, the
same trainable variables bit for bit, and BatchNorm's moving statistics,
non-finite in Keras's loop and kept in the port."""

import os

os.environ["KERAS_BACKEND"] = "jax"  # before keras is first imported

import docs_snippets  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import oracles  # noqa: E402

import fp16_scaling as fs  # noqa: E402

keras = oracles.require("keras")

PAGE = "porting-keras.md"
BAD = 40  # the batch whose float16 forward pass overflows


def _batches():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((8, 1)).astype(np.float32)
  out = []
  for i in range(60):
    x = rng.standard_normal((32, 8)).astype(np.float32)
    if i == BAD:
      x = x * 6e4  # float16's max is 65504: the first Dense overflows
    out.append((jnp.asarray(x), jnp.asarray(x @ w)))
  return out


def _replay(step, state, batches, scale_of):
  """The page's jitted ``step`` again from ``state``: per step the scale
  after it, the trainable and the non-trainable variables."""
  log = []
  for x, y in batches:
    _, *state = step(*state, x, y)
    scale = float(scale_of(state[2]))
    trainable = [np.asarray(a) for a in state[0]]
    non_trainable = [np.asarray(a) for a in state[1]]
    log.append((scale, trainable, non_trainable))
  return log


def test_porting_keras_page_runs_and_the_loops_agree():
  blocks = docs_snippets.blocks(PAGE)
  assert len(blocks) == 5
  batches = _batches()
  ns = {"batches": batches}
  for i, code in enumerate(blocks):
    exec(compile(code, f"{PAGE} block {i}", "exec"), ns)
    if i == 0:
      start = (ns["trainable"], ns["non_trainable"])
  # Each loop once more, step by step, with the page's own jitted steps.
  optimizer = ns["optimizer"]
  tx = ns["tx"]
  at = [v.name for v in optimizer.variables].index("dynamic_scale")
  opt_vars = [v.value for v in optimizer.variables]
  theirs = _replay(
    ns["keras_step"], (*start, opt_vars), batches, lambda o: o[at]
  )
  ours = _replay(
    ns["fs_step"], (*start, tx.init(start[0])), batches, fs.current_scale
  )
  assert len(theirs) == len(ours) == 60
  # The same scale after every step, hence the same skips.
  scales = [t[0] for t in theirs]
  assert scales == [o[0] for o in ours]
  skips = [t < s for s, t in zip([2.0**15] + scales, scales)]
  print(f"\n{len(scales)} steps, skipped: {list(np.flatnonzero(skips))}")
  assert skips[BAD]
  assert 2 <= sum(skips) <= 10, sum(skips)
  # The same trainable variables, bit for bit, after every step.
  for t, o in zip(theirs, ours):
    for a, b in zip(t[1], o[1]):
      np.testing.assert_array_equal(a, b)
  # BatchNorm's moving mean and variance: Keras's non-finite from the bad
  # step on, the port's equal to those before it.
  assert not all(np.isfinite(a).all() for a in theirs[BAD][2])
  assert all(np.isfinite(a).all() for o in ours for a in o[2])
  for a, b in zip(ours[BAD][2], ours[BAD - 1][2]):
    np.testing.assert_array_equal(a, b)
  # Inference with those statistics: NaN for Keras's run, finite for ours.
  model = ns["model"]
  x = ns["batches"][0][0]
  trainable, non_trainable, _ = ns["state"]
  pred = model.stateless_call(trainable, non_trainable, x)[0]
  k_trainable, k_non_trainable, _ = ns["keras_state"]
  k_pred = model.stateless_call(k_trainable, k_non_trainable, x)[0]
  assert np.isfinite(np.asarray(pred)).all()
  assert np.isnan(np.asarray(k_pred)).all()
  # The state block: Keras's scale and counter in fp16_scaling, and back.
  sd = fs.scaler_state_dict(ns["opt_state"])
  assert sd["loss_scale"] == scales[-1]
  back = ns["back"]
  assert back["dynamic_scale"] == scales[-1]
  assert back["step_counter"] == int(ns["by_name"]["step_counter"])
  assert back["dynamic_growth_steps"] == 10
  assert jax.tree.leaves(ns["mpx_order"])
