"""accumulate_gradients: one guarded step per window on the float32 mean of
its microbatches; a bad microbatch skips its window exactly and backs the
scale off once; the next window starts clean."""

import functools

from helpers import bits as _bits
from helpers import guarded
from helpers import nested_params as _params
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

K = 4
_DEFAULT = None


def _default_tx():
  """One accumulating chain for the tests that share it (one compile)."""
  global _DEFAULT
  if _DEFAULT is None:
    _DEFAULT = fs.accumulate_gradients(_guarded(), K)
  return _DEFAULT


def _guarded(scaler=None, inner=None):
  scaler = scaler or fs.deepspeed_scaler(init_scale=2.0**10, scale_window=3)
  inner = inner or optax.adamw(1e-2, weight_decay=0.1)
  return guarded(scaler, fs.clip_by_unscaled_norm(2.0), inner)


def _true_grads(t):
  key = jax.random.PRNGKey(100 + t)
  return jax.tree.map(
    lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape),
    _params(),
  )


def _microbatch(t, scale, bad):
  """float16 gradients of ``loss * scale``; ``bad`` puts an inf in one."""
  grads = jax.tree.map(
    lambda g: (g * scale).astype(jnp.float16), _true_grads(t)
  )
  factor = jnp.where(bad, jnp.inf, 1.0)
  grads["out"] = grads["out"].at[1].multiply(factor)
  return grads


_STEPS = {}


def _run(tx, bad, calls):
  """Runs ``calls`` microbatches, one jitted call each (compiled once per
  ``tx``); returns per-call records (grads, params, state, metrics)."""
  params = _params()
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return grads, params, state, fs.scale_metrics(state)

  # Keyed by identity; the entry keeps ``tx`` alive, so no id is reused.
  _, step = _STEPS.setdefault(id(tx), (tx, jax.jit(step)))
  records = []
  for t in range(calls):
    # Made by a jitted call of their own: the float16 arrays the step reads
    # are the ones the tests' numpy oracles read. Made inside the step, a
    # backend that keeps float16 values in float32 (XLA:GPU's excess
    # precision) would hand the step unrounded gradients.
    grads = _make_microbatch(t, fs.current_scale(state), t in bad)
    records.append(step(params, state, grads))
    _, params, state, _ = records[-1]
  return records


_make_microbatch = jax.jit(_microbatch)


def test_one_bad_microbatch_skips_its_window_exactly():
  w = 1  # the window with the bad microbatch (call 6 of 0..11)
  records = _run(_default_tx(), {w * K + 2}, 3 * K)

  def end(i):
    """The record of window ``i``'s last call."""
    return records[i * K + K - 1]

  # Window w: parameters and the inner optimizer state bit for bit as after
  # window w - 1, at every call of the window.
  for t in range(w * K, (w + 1) * K):
    assert _bits(records[t][1]) == _bits(end(w - 1)[1])
  adam_after = end(w)[2].inner_state[2]
  adam_before = end(w - 1)[2].inner_state[2]
  assert _bits(adam_after) == _bits(adam_before)
  # The scale backed off exactly once, at the window's end, and not inside.
  scales = [float(r[3]["loss_scale"]) for r in records]
  backed_off_at = (w + 1) * K - 1  # the call that ends window w
  assert scales[:backed_off_at] == [2.0**10] * backed_off_at
  assert scales[backed_off_at:] == [2.0**9] * (K + 1)
  m = end(w)[3]
  assert bool(m["overflow"])
  assert bool(m["window_ended"])
  assert int(m["skipped_steps"]) == 1
  assert int(m["applied_steps"]) == 1
  # Window w + 1 trains: the parameters move.
  assert _bits(end(w + 1)[1]) != _bits(end(w)[1])
  m = end(w + 1)[3]
  assert not bool(m["overflow"])
  assert int(m["applied_steps"]) == 2
  assert np.isfinite(float(m["grad_norm"]))
  for leaf in jax.tree.leaves(end(w + 1)[2].acc_grads):
    np.testing.assert_array_equal(leaf, 0.0)


def test_window_step_is_the_guarded_chain_on_the_float32_mean():
  """Against the guarded chain alone fed each window's mean, summed in
  float32 by numpy in the same order: the same parameters, bit for bit."""
  bad = {5}
  records = _run(_default_tx(), bad, 3 * K)
  tx = _guarded()
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for w in range(3):
    acc = None
    for t in range(w * K, (w + 1) * K):
      part = jax.tree.map(
        lambda g: np.asarray(g, np.float32) / np.float32(K), records[t][0]
      )
      with np.errstate(invalid="ignore"):
        acc = part if acc is None else jax.tree.map(np.add, acc, part)
    updates, state = update(acc, state, params)
    params = optax.apply_updates(params, updates)
    window_end = records[(w + 1) * K - 1]
    assert _bits(params) == _bits(window_end[1])
    assert float(fs.current_scale(state)) == float(window_end[3]["loss_scale"])


def test_metrics_between_windows_are_not_news():
  records = _run(_default_tx(), {1}, 2 * K)
  ended = [bool(r[3]["window_ended"]) for r in records]
  assert ended == [False, False, False, True] * 2
  overflow = [bool(r[3]["overflow"]) for r in records]
  assert overflow == [False, False, False, True] + [False] * K
  assert [int(r[3]["microbatches"]) for r in records] == list(range(1, 9))
  # Between windows, the scale the microbatch was made with is the current.
  for r in records[K : 2 * K - 1]:
    assert float(r[3]["prev_loss_scale"]) == float(r[3]["loss_scale"])
  assert int(records[-1][3]["dropped_microbatches"]) == 0


def test_thousand_windows_with_a_fifth_of_microbatches_bad_never_stall():
  windows, k = 1000, K
  n = windows * k
  bad = np.random.default_rng(0).random(n) < 0.2
  tx = fs.accumulate_gradients(
    _guarded(fs.deepspeed_scaler(init_scale=2.0**12, scale_window=2)), k
  )
  params = _params()

  @jax.jit
  def run(params, state, bad):
    def step(carry, xs):
      params, state = carry
      t, is_bad = xs
      scale = fs.current_scale(state)
      grads = jax.tree.map(
        lambda g: (g * scale * (1 + t % 7)).astype(jnp.float16),
        _true_grads(0),
      )
      grads["out"] = grads["out"].at[1].set(jnp.where(is_bad, jnp.nan, 1.0))
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      m = fs.scale_metrics(state)
      out = (m["window_ended"], m["overflow"], m["loss_scale"], scale)
      return (params, state), out

    return jax.lax.scan(step, (params, state), (jnp.arange(n), bad))

  (params, state), (ended, overflow, after, before) = jax.tree.map(
    np.asarray, run(params, tx.init(params), jnp.asarray(bad))
  )
  window_bad = bad.reshape(windows, k).any(axis=1)
  np.testing.assert_array_equal(ended, np.tile([0, 0, 0, 1], windows))
  np.testing.assert_array_equal(overflow[ended], window_bad)
  assert not overflow[~ended].any()
  # The scale moves only where a window ends.
  assert (after[~ended] == before[~ended]).all()
  m = fs.scale_metrics(state)
  assert int(m["skipped_steps"]) == window_bad.sum()
  assert int(m["applied_steps"]) == windows - window_bad.sum() >= 300
  # Clean windows in the last hundred still train, the state stays finite.
  assert (~window_bad[-100:]).sum() >= 20
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.acc_grads))


def test_drop_microbatch_averages_the_clean_ones():
  tx = fs.accumulate_gradients(
    _guarded(inner=optax.sgd(1.0)), K, on_microbatch_overflow="drop_microbatch"
  )
  # Window 0: microbatch 2 bad, dropped. Window 1: all bad, skipped.
  bad = {2, 4, 5, 6, 7}
  records = _run(tx, bad, 2 * K)
  clean = [
    jax.tree.map(lambda g: np.asarray(g, np.float32), records[t][0])
    for t in (0, 1, 3)
  ]
  mean = jax.tree.map(lambda a, b, c: (a + b + c) / 3 / 2.0**10, *clean)
  norm = np.sqrt(
    sum(np.sum(x.astype(np.float64) ** 2) for x in jax.tree.leaves(mean))
  )
  coef = min(1.0, 2.0 / (norm + 1e-6))
  m = records[K - 1][3]
  assert not bool(m["overflow"])
  assert int(m["dropped_microbatches"]) == 1
  assert int(m["applied_steps"]) == 1
  # float32 sums of the 18 squares and of each element's 3 terms, in any
  # order, against numpy's float64: within (18 + 3) float32 roundings.
  n = sum(x.size for x in jax.tree.leaves(mean))
  np.testing.assert_allclose(
    float(m["grad_norm"]), norm, rtol=(n + 3) * 2.0**-24
  )
  for p0, p1, g in zip(
    jax.tree.leaves(_params()),
    jax.tree.leaves(records[K - 1][1]),
    jax.tree.leaves(mean),
  ):
    np.testing.assert_allclose(p1, p0 - coef * g, rtol=1e-5, atol=1e-6)
  assert float(m["loss_scale"]) == 2.0**10  # a dropped microbatch: no back-off
  m = records[-1][3]
  assert bool(m["overflow"])
  assert int(m["dropped_microbatches"]) == 5
  assert int(m["skipped_steps"]) == 1
  assert float(m["loss_scale"]) == 2.0**9
  assert _bits(records[-1][1]) == _bits(records[K - 1][1])


def test_extra_args_reach_the_inner_chain_and_schedules_vary_k():
  inner = guarded(fs.static_scaler(1.0), _times_value(), optax.sgd(1.0))
  tx = fs.accumulate_gradients(inner, lambda w: jnp.where(w < 1, 2, 3))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(
    lambda s: tx.update({"w": jnp.full(2, 6.0)}, s, params, value=0.5)
  )
  ends = []
  for _ in range(8):
    updates, state = step(state)
    ends.append(bool(state.window_ended))
    if ends[-1]:
      np.testing.assert_array_equal(updates["w"], [-3.0, -3.0])
    else:
      assert np.signbit(updates["w"]).all() and not updates["w"].any()
  assert ends == [False, True, False, False, True, False, False, True]


@pytest.mark.parametrize("k", [0, -1])
def test_every_k_schedule_below_one(k):
  with pytest.raises(ValueError, match="every_k_schedule"):
    fs.accumulate_gradients(_guarded(), k)
  with pytest.raises(ValueError, match="every_k_schedule"):
    fs.accumulate_gradients(_guarded(), lambda w: k)


@pytest.mark.parametrize("k", [True, 2.5, "4"])
def test_every_k_schedule_not_an_integer(k):
  with pytest.raises(TypeError, match="every_k_schedule"):
    fs.accumulate_gradients(_guarded(), k)


def test_unknown_policy():
  with pytest.raises(ValueError, match="on_microbatch_overflow"):
    fs.accumulate_gradients(_guarded(), 2, on_microbatch_overflow="drop")


def test_gradients_whose_tree_differs_from_the_params():
  tx = fs.accumulate_gradients(_guarded(), 2)
  params = _params()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  with pytest.raises(ValueError, match="tree structure"):
    tx.update({"dense": grads["dense"]}, state, params)
  grads["out"] = jnp.ones(4)
  with pytest.raises(ValueError, match="leaf shapes"):
    tx.update(grads, state, params)


def test_tx_without_a_loss_scale():
  # Refused when built: the window's step must be an fs.chain.
  with pytest.raises(TypeError, match=r"fs\.chain\(fs\.fp16_loss_scale"):
    fs.accumulate_gradients(optax.sgd(1.0), 2)


def test_float32_microbatches_keep_the_norm_rescue():
  """float32 microbatch gradients may hold values beyond float16's range:
  squares that overflow float32 are no overflow, and the norm is right."""
  tx = fs.accumulate_gradients(
    _guarded(fs.static_scaler(1.0), optax.sgd(0.0)), 2
  )
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  for _ in range(2):
    _, state = step({"w": jnp.full(4, 1e30, jnp.float32)}, state, params)
  m = fs.scale_metrics(state)
  assert not bool(m["overflow"])
  assert int(m["applied_steps"]) == 1
  np.testing.assert_allclose(float(m["grad_norm"]), 2e30, rtol=1e-6)


def _times_value():
  """Multiplies the updates by the ``value=`` it is passed."""
  return optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(),
    lambda u, s, p=None, *, value: (jax.tree.map(lambda x: x * value, u), s),
  )


@functools.cache
def _sgd_window():
  """An accumulating sgd chain on ``{"w": 2 elements}``, its first state and
  its jitted ``update(grads, state, value)``: one compile for the tests of
  the overflow kind."""
  tx = fs.accumulate_gradients(_guarded(inner=optax.sgd(1.0)), K)
  params = {"w": jnp.zeros(2)}

  @jax.jit
  def update(grads, state, value):
    return tx.update(grads, state, params, value=value)[1]

  return tx.init(params), update


@pytest.mark.parametrize("bad_at", range(K))
def test_a_nonfinite_loss_on_any_microbatch_is_a_forward_overflow(bad_at):
  """A NaN loss (and NaN gradients) on microbatch ``bad_at`` of the window:
  the kind is "forward" wherever it sits, not only on the last one."""
  state, update = _sgd_window()
  for t in range(K):
    bad = t == bad_at
    grads = {"w": jnp.full(2, jnp.nan if bad else 1.0, jnp.float16)}
    state = update(grads, state, jnp.float32(jnp.nan if bad else 0.5))
  report = fs.overflow_report(state)
  assert report.step_overflowed
  assert report.kind == "forward"
  # The next window, clean with finite losses, is clean: the flag was reset.
  for _ in range(K):
    state = update({"w": jnp.ones(2, jnp.float16)}, state, jnp.float32(0.5))
  assert fs.overflow_report(state).kind == "none"


def test_a_finite_loss_with_overflowing_gradients_stays_backward():
  state, update = _sgd_window()
  for t in range(K):
    grads = {"w": jnp.full(2, jnp.inf if t == 0 else 1.0, jnp.float16)}
    state = update(grads, state, jnp.float32(0.5))
  assert fs.overflow_report(state).kind == "backward"


def test_value_on_only_some_microbatches_reads_only_those():
  """docs/accumulation.md: a NaN loss on a microbatch passed without
  ``value=`` is not seen, so the overflow reads "backward"; without
  ``value=`` on the window's last microbatch the kind is "unknown"."""
  tx = fs.accumulate_gradients(_guarded(inner=optax.sgd(1.0)), K)
  params = {"w": jnp.zeros(2)}
  with_value = jax.jit(lambda g, s, v: tx.update(g, s, params, value=v)[1])
  without = jax.jit(lambda g, s: tx.update(g, s, params)[1])
  nan = {"w": jnp.full(2, jnp.nan, jnp.float16)}
  ones = {"w": jnp.ones(2, jnp.float16)}
  state = without(nan, tx.init(params))  # its NaN loss is not passed
  for _ in range(K - 1):
    state = with_value(ones, state, jnp.float32(0.5))
  assert fs.overflow_report(state).kind == "backward"
  state = with_value(nan, state, jnp.float32(jnp.nan))
  for _ in range(K - 2):
    state = with_value(ones, state, jnp.float32(0.5))
  state = without(ones, state)  # the window's last microbatch
  report = fs.overflow_report(state)
  assert report.step_overflowed
  assert report.kind == "unknown"


@pytest.mark.parametrize("policy", ["skip_step", "drop_microbatch"])
def test_the_inner_chain_is_passed_the_windows_mean_loss(policy):
  inner = fs.chain(fs.fp16_loss_scale(fs.static_scaler(1.0)), _times_value())
  tx = fs.accumulate_gradients(inner, K, on_microbatch_overflow=policy)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(lambda g, s, v: tx.update(g, s, params, value=v))
  losses = [1.0, 2.0, 4.0, 8.0]
  for t, loss in enumerate(losses):
    bad = policy == "drop_microbatch" and t == 1
    grads = {"w": jnp.full(2, jnp.nan if bad else 1.0)}
    updates, state = update(grads, state, jnp.float32(loss))
  kept = [x for t, x in enumerate(losses) if policy == "skip_step" or t != 1]
  # The window's mean gradient is 1.0, so the updates are the value passed.
  np.testing.assert_allclose(
    updates["w"], [sum(kept) / len(kept)] * 2, rtol=1e-6
  )
