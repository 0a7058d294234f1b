"""Overflow diagnostics: per-leaf attribution, overflow kind, floor signal,
gradient range, the report, the host log, and jax_debug_nans."""

import flax.serialization
from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

# A three-level nested Flax-style parameter tree.
PARAMS = {
  "params": {
    "encoder": {
      "Dense_0": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)},
      "Dense_1": {"kernel": jnp.ones((3, 3)), "bias": jnp.zeros(3)},
    },
    "head": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)},
  }
}
POISONED = "['params']['encoder']['Dense_1']['kernel']"


def _tx(scaler, **kwargs):
  clip = fs.clip_by_unscaled_norm(1.0)
  return guarded(scaler, clip, optax.adamw(1e-3), **kwargs)


def _true_grads(step):
  key = jax.random.key(step)
  leaves, treedef = jax.tree.flatten(PARAMS)
  keys = jax.random.split(key, len(leaves))
  drawn = [0.01 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, drawn)


_STEPS = {}


def _make_step(tx, poison_path=POISONED):
  """The jitted step of ``tx``, compiled once per ``tx`` (the entry keeps
  ``tx`` alive, so no id is reused)."""
  key = (id(tx), poison_path)
  if key not in _STEPS:
    _STEPS[key] = (tx, jax.jit(_step_of(tx, poison_path)))
  return _STEPS[key][1]


def _step_of(tx, poison_path):
  def step(params, state, true_grads, poison, loss):
    scale = fs.current_scale(state)

    def poisoned(path, g):
      bad = poison & (jax.tree_util.keystr(path) == poison_path)
      inf = jnp.where(bad, jnp.inf, 1.0).astype(jnp.float16)
      return (g * scale).astype(jnp.float16) * inf

    grads = jax.tree_util.tree_map_with_path(poisoned, true_grads)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state

  return step


def _run(tx, steps, poisoned_steps, start=None):
  step = _make_step(tx)
  params, state = start or (PARAMS, tx.init(PARAMS))
  loss = jnp.float32(1.0)
  for i in range(steps):
    poison = i in poisoned_steps
    params, state = step(params, state, _true_grads(i), poison, loss)
  return params, state


def _run_each(txs, steps, poisoned_steps):
  """``[_run(tx, steps, poisoned_steps) for tx in txs]``, with one jit
  stepping every chain: a jit each took twice the CPU time."""
  bodies = [_step_of(tx, POISONED) for tx in txs]

  @jax.jit
  def step(runs, true_grads, poison, loss):
    return [b(*run, true_grads, poison, loss) for b, run in zip(bodies, runs)]

  runs = [(PARAMS, tx.init(PARAMS)) for tx in txs]
  for i in range(steps):
    runs = step(runs, _true_grads(i), i in poisoned_steps, jnp.float32(1.0))
  return runs


def test_report_names_exactly_the_poisoned_leaf_with_its_count():
  tx = _tx(fs.deepspeed_scaler(init_scale=2.0**10, scale_window=100))
  params, state = _run(tx, 9, {3, 7, 8})
  report = fs.overflow_report(state)
  assert report.step_overflowed  # step 8 was the last
  assert report.nonfinite_leaves == (POISONED,)
  assert report.counts == {POISONED: 3}
  assert report.kind == "backward"  # value=1.0 was finite
  assert report.skipped_steps == 3
  # Step 8 overflowed at the scale that step 7's back-off left.
  assert report.scale == 2.0**8
  assert report.next_scale == 2.0**7
  text = str(report)
  assert POISONED in text
  assert "OVERFLOWED (backward)" in text
  assert "2^8" in text
  assert "What to do" in text

  _, state = _run(tx, 1, set(), start=(params, state))  # one clean step
  report = fs.overflow_report(state)
  assert not report.step_overflowed
  assert report.nonfinite_leaves == ()
  assert report.counts == {POISONED: 3}
  assert report.kind == "none"


def test_leaf_vectors_are_in_tree_order_and_skip_keeps_the_optimizer():
  tx = _tx(fs.static_scaler(4.0))
  _, clean = _run(tx, 2, set())
  params, state = _run(tx, 3, {2})
  ls = state[0]
  paths = jax.tree_util.tree_leaves_with_path(PARAMS)
  want = np.array([jax.tree_util.keystr(p) == POISONED for p, _ in paths])
  np.testing.assert_array_equal(ls.leaf_nonfinite, want)
  np.testing.assert_array_equal(ls.leaf_nonfinite_steps, want.astype(int))
  # The bookkeeping moved; Adam's state did not.
  for new, old in zip(jax.tree.leaves(state[2]), jax.tree.leaves(clean[2])):
    np.testing.assert_array_equal(new, old)


_TXS = {}


def _kind_after(scaler, losses, poisoned, value=True):
  # One chain per scaler: the calls with the same scaler share its step.
  tx = _TXS.setdefault(id(scaler), (scaler, _tx(scaler)))[1]
  step = _make_step(tx)
  params = PARAMS
  state = tx.init(PARAMS)
  kinds = []
  for i, loss in enumerate(losses):
    true = _true_grads(i)
    if value:
      params, state = step(params, state, true, i in poisoned, loss)
    else:
      scale = fs.current_scale(state)
      grads = jax.tree.map(lambda g: g * scale, true)
      if i in poisoned:
        head = grads["params"]["head"]
        head["bias"] = head["bias"] * jnp.inf
      _, state = jax.jit(tx.update)(grads, state, params)
    kinds.append(fs.overflow_report(state).kind)
  return kinds, state


def test_forward_backward_persistent_unknown():
  ds = fs.deepspeed_scaler(
    init_scale=4.0,
    min_scale=1.0,
    scale_window=100,
    raise_error_at_min_scale=False,
  )
  one = jnp.float32(1.0)
  inf = jnp.float32(jnp.inf)
  # Finite loss, non-finite grads: backward (4 -> 2, 2 -> 1), then at the
  # floor of 1.0: persistent. A clean step: none.
  kinds, state = _kind_after(ds, [one, one, one, one], {0, 1, 2})
  assert kinds == ["backward", "backward", "persistent", "none"]
  assert int(fs.scale_metrics(state)["floor_overflows"]) == 1
  # A non-finite loss: forward, whatever the scale (even at the floor).
  kinds, _ = _kind_after(ds, [inf, one, jnp.float32(jnp.nan)], {0, 1, 2})
  assert kinds == ["forward", "backward", "forward"]
  # Without value: unknown, except at the floor where it is persistent.
  kinds, _ = _kind_after(ds, [one] * 3, {0, 1, 2}, value=False)
  assert kinds == ["unknown", "unknown", "persistent"]


def test_advice_agrees_with_the_next_scale_when_hysteresis_absorbs():
  """Megatron's hysteresis of 2 absorbs the first overflow: the scale stays,
  so the advice must not say it backed off; the second one backs off."""
  one = jnp.float32(1.0)
  scaler = fs.megatron_scaler(initial_scale=8.0)
  for overflows, next_scale in [({0}, 8.0), ({0, 1}, 4.0)]:
    _, state = _kind_after(scaler, [one] * len(overflows), overflows)
    report = fs.overflow_report(state)
    assert report.kind == "backward"
    assert report.next_scale == next_scale
    said_backed_off = "has backed off" in report.advice()
    assert said_backed_off == (next_scale < report.scale), str(report)
    if next_scale == report.scale:
      assert "hysteresis" in report.advice()


def test_every_preset_counts_overflows_at_its_floor():
  # torch's floor is float32's smallest normal: start one halving above it.
  presets = {
    "torch": fs.torch_scaler(init_scale=2.0**-125),
    "flax": fs.flax_scaler(scale=2.0**-125),
    "megatron": fs.megatron_scaler(initial_scale=2.0, min_scale=1.0),
    "deepspeed": fs.deepspeed_scaler(init_scale=2.0, min_scale=1.0),
    "headroom": fs.headroom_scaler(init_scale=2.0, min_scale=1.0),
  }
  runs = _run_each([_tx(s) for s in presets.values()], 6, set(range(6)))
  for name, (_, state) in zip(presets, runs):
    m = fs.scale_metrics(state)
    # 6 overflows: the first backs off to the floor, 5 hit it. Megatron's
    # hysteresis of 2 absorbs the first; it refills only on growth.
    want = {"megatron": 4}.get(name, 5)
    assert int(m["floor_overflows"]) == want, name
    with pytest.raises(fs.MinLossScaleError) as err:
      fs.raise_if_min_scale_reached(state, max_floor_overflows=2)
    assert POISONED in str(err.value)
    assert "persistent" in str(err.value)
    if name != "deepspeed":  # only DeepSpeed raises by default
      fs.raise_if_min_scale_reached(state)


def test_deepspeed_raise_semantics_unchanged():
  loud = fs.deepspeed_scaler(init_scale=2.0, min_scale=1.0)
  quiet = fs.deepspeed_scaler(
    init_scale=2.0, min_scale=1.0, raise_error_at_min_scale=False
  )
  (_, loud), (_, quiet) = _run_each([_tx(loud), _tx(quiet)], 2, {0, 1})
  with pytest.raises(fs.MinLossScaleError, match="minimum") as err:
    fs.raise_if_min_scale_reached(loud)
  assert POISONED in str(err.value)
  fs.raise_if_min_scale_reached(quiet)  # floor_overflows == 1 alone: no
  with pytest.raises(ValueError, match="max_floor_overflows"):
    fs.raise_if_min_scale_reached(quiet, max_floor_overflows=0)


def test_bad_value_and_missing_state_are_clear_errors():
  tx = _tx(fs.static_scaler(2.0))
  state = tx.init(PARAMS)
  with pytest.raises(TypeError, match=r"value .*floating scalar.*\[3\]"):
    tx.update(PARAMS, state, PARAMS, value=jnp.ones(3))
  with pytest.raises(ValueError, match="no fp16_loss_scale"):
    fs.overflow_report(optax.adam(1e-3).init(PARAMS))
  with pytest.raises(ValueError, match="top"):
    fs.overflow_report(state, top=0)
  with pytest.raises(TypeError, match="grad_range"):
    fs.fp16_loss_scale(fs.static_scaler(2.0), grad_range=1)


def test_report_of_a_batched_state_says_how_to_pick_a_member():
  """D1: a vmapped state holds one report per member; the report refuses
  it, naming the member pick, and that pick gives each member's report."""
  tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(4.0)), optax.sgd(1.0))
  state = jax.vmap(tx.init)(jnp.ones((2, 3)))
  pick = r"fs\.overflow_report\(jax\.tree\.map\(lambda x: x\[i\], opt_state\)\)"
  with pytest.raises(ValueError, match=r"batched \(shape \(2,\).*" + pick):
    fs.overflow_report(state)
  # Member 1 overflows, member 0 does not.
  grads = jnp.array([[4.0, 4.0, 4.0], [4.0, jnp.inf, 4.0]])
  _, state = jax.vmap(lambda g, s: tx.update(g, s))(grads, state)
  with pytest.raises(ValueError, match="batched"):
    fs.overflow_report(state)
  clean = fs.overflow_report(jax.tree.map(lambda x: x[0], state))
  bad = fs.overflow_report(jax.tree.map(lambda x: x[1], state))
  assert not clean.step_overflowed
  assert clean.counts == {}
  # A bare array's leaf is named <root>, not the empty string.
  assert bad.step_overflowed
  assert bad.counts == {"<root>": 1}
  assert bad.nonfinite_leaves == ("<root>",)
  assert bad.skipped_steps == 1
  assert bad.scale == bad.next_scale == 4.0


def test_grad_range_is_exact():
  tx = _tx(fs.static_scaler(2.0**4), grad_range=True)
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  # head.kernel: largest |g| 0.5 unscaled; 4 of its 6 elements are zero.
  grads["params"]["head"]["kernel"] = jnp.array(
    [[0.0, -0.5], [0.25, 0.0], [0.0, 0.0]]
  )
  grads["params"]["encoder"]["Dense_0"]["bias"] = jnp.array([2.0, 1.0, 0.0])
  scaled = jax.tree.map(lambda g: (g * 16.0).astype(jnp.float16), grads)
  _, state = jax.jit(tx.update)(scaled, state, PARAMS)
  report = fs.overflow_report(state)
  head = report.grad_range["['params']['head']['kernel']"]
  assert head.max_abs == 0.5
  assert head.zero_fraction == pytest.approx(4 / 6)
  # log2(65504 / (0.5 * 16)) = log2(8188)
  assert head.headroom_bits == pytest.approx(np.log2(8188.0), rel=1e-6)
  bias = report.grad_range["['params']['encoder']['Dense_0']['bias']"]
  assert bias.max_abs == 2.0
  assert bias.headroom_bits == pytest.approx(np.log2(65504 / 32), rel=1e-6)
  zero = report.grad_range["['params']['head']['bias']"]
  assert zero.max_abs == 0.0
  assert zero.headroom_bits == np.inf
  m = fs.scale_metrics(state)
  assert float(m["grad_max_abs"]) == 2.0
  assert float(m["min_headroom_bits"]) == pytest.approx(np.log2(65504 / 32))
  total = sum(x.size for x in jax.tree.leaves(PARAMS))
  nonzero = 2 + 2
  assert float(m["zero_fraction"]) == pytest.approx((total - nonzero) / total)
  assert "Gradient range" in str(report)
  # Off by default: no range in the state, none in the metrics.
  plain = _tx(fs.static_scaler(2.0)).init(PARAMS)
  assert "grad_max_abs" not in fs.scale_metrics(plain)


def test_headroom_scaler_rule():
  # Largest unscaled |g| = 2**-4, headroom 4 bits: the target is the largest
  # power of two below 65504 / (2**-4 * 2**4) = 65504, i.e. 2**15. From 2**10
  # it grows by at most 2x per step, then stays. (No growth margin here.)
  scaler = fs.headroom_scaler(
    init_scale=2.0**10, headroom_bits=4.0, growth_margin_bits=0.0
  )
  tx = _tx(scaler)
  state = tx.init(PARAMS)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-4), PARAMS)
  update = jax.jit(tx.update)
  seen = []
  for _ in range(7):
    scale = fs.current_scale(state)
    scaled = jax.tree.map(lambda g: (g * scale).astype(jnp.float16), grads)
    _, state = update(scaled, state, PARAMS)
    seen.append(float(fs.current_scale(state)))
  assert seen == [2.0**11, 2.0**12, 2.0**13, 2.0**14, 2.0**15, 2.0**15, 2.0**15]
  # Larger gradients lower the scale at once, before any overflow.
  big = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-1), PARAMS)
  scaled = jax.tree.map(lambda g: (g * 2.0**15).astype(jnp.float16), big)
  _, state = update(scaled, state, PARAMS)
  assert float(fs.current_scale(state)) == 2.0**12
  # An overflow backs off by the factor. (Float16 as above, so that the
  # compiled update is reused.)
  scaled = jax.tree.map(lambda g: (g * jnp.inf).astype(jnp.float16), grads)
  _, state = update(scaled, state, PARAMS)
  assert float(fs.current_scale(state)) == 2.0**11


def test_headroom_scaler_grows_only_with_the_margin():
  # Target 2**15 as above. With a 2-bit margin it grows from 2**10 while the
  # target is >= 4x the scale: to 2**11, ..., 2**14, then stops at 2**14, one
  # bit below the target.
  scaler = fs.headroom_scaler(init_scale=2.0**10, growth_margin_bits=2.0)
  state = scaler.init()
  seen = []
  for _ in range(5):
    state = scaler.update(state, jnp.bool_(False), jnp.float32(2.0**-4))
    seen.append(float(state.loss_scale))
  assert seen == [2.0**11, 2.0**12, 2.0**13, 2.0**14, 2.0**14]
  # A target below the scale is followed at once: 65504 / (2**-1 * 16).
  state = scaler.update(state, jnp.bool_(False), jnp.float32(2.0**-1))
  assert float(state.loss_scale) == 2.0**12


def test_headroom_scaler_arguments_are_checked():
  # Each error names its argument.
  with pytest.raises(ValueError, match="headroom_bits"):
    fs.headroom_scaler(headroom_bits=-1.0)
  with pytest.raises(ValueError, match="growth_margin_bits"):
    fs.headroom_scaler(growth_margin_bits=30)
  with pytest.raises(ValueError, match="max_growth"):
    fs.headroom_scaler(max_growth=1.0)
  with pytest.raises(ValueError, match="max_scale"):
    fs.headroom_scaler(init_scale=2.0**16, max_scale=2.0**10)
  with pytest.raises(ValueError, match="min_scale"):
    fs.headroom_scaler(init_scale=2.0, min_scale=4.0)
  with pytest.raises(TypeError):
    fs.headroom_scaler(2.0**16)  # keyword-only


def test_host_log_on_overflow_steps_only(capfd):
  tx = _tx(fs.deepspeed_scaler(init_scale=2.0**10), log_overflows=True)
  _run(tx, 4, {1})
  jax.effects_barrier()
  out = capfd.readouterr().out
  lines = [line for line in out.splitlines() if "OVERFLOW!" in line]
  assert len(lines) == 1
  assert "scale: 1024, reducing to 512" in lines[0]
  assert POISONED in lines[0]


def test_jax_debug_nans_quiet_on_an_inf_overflow_step():
  tx = _tx(fs.deepspeed_scaler(init_scale=2.0**10), grad_range=True)
  step = _make_step(tx)

  @jax.jit
  def metrics(state):
    return fs.scale_metrics(state)

  with jax.debug_nans(True):
    params, state = step(
      PARAMS, tx.init(PARAMS), _true_grads(0), True, jnp.float32(1.0)
    )
    m = metrics(state)
  assert bool(m["overflow"])
  assert float(m["grad_norm"]) == 0.0
  for x in jax.tree.leaves((params, state, m)):
    assert not np.isnan(np.asarray(x, np.float64)).any()


def test_jax_debug_nans_points_at_the_users_nan():
  tx = _tx(fs.static_scaler(8.0))

  def users_model(params, x):
    return jnp.sum(jnp.log(x @ params["params"]["head"]["kernel"]))

  @jax.jit
  def step(params, state, x):
    scale = fs.current_scale(state)

    def scaled(p):
      return users_model(p, x) * scale

    loss, grads = jax.value_and_grad(scaled)(params)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state, loss

  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError, match="log") as err:
      step(PARAMS, tx.init(PARAMS), -jnp.ones((2, 3)))
  frames = [f.name for f in err.traceback]
  assert "users_model" in frames


def test_paths_survive_jit_and_flax_serialization():
  tx = _tx(fs.static_scaler(2.0))
  _, state = _run(tx, 2, {1})
  raw = flax.serialization.to_bytes(state)  # msgpack of the state dict
  restored = flax.serialization.from_bytes(tx.init(PARAMS), raw)
  assert fs.overflow_report(restored).counts == {POISONED: 1}


def test_fixed_scale_runs_stop_after_five_skipped_steps_in_a_row():
  """no_scaler() and static_scaler(S) cannot back off, so they are always
  at their floor: each overflow with a finite loss is a floor overflow of
  kind persistent (no longer backward), and the streak of skipped steps is
  counted. Five non-finite steps in a row stop the run at
  raise_if_min_scale_reached(max_consecutive_errors=5), whose message names
  the limit; four do not, and a clean step restarts the streak."""
  presets = {"none": fs.no_scaler(), "static": fs.static_scaler(2.0**8)}
  txs = [_tx(s) for s in presets.values()]
  # Steps 1-4: four in a row; step 5 clean; steps 6-10: five in a row.
  poisoned = {1, 2, 3, 4, 6, 7, 8, 9, 10}
  for steps, streak in [(5, 4), (6, 0), (11, 5)]:
    for name, (_, state) in zip(presets, _run_each(txs, steps, poisoned)):
      m = fs.scale_metrics(state)
      assert int(m["consecutive_skipped_steps"]) == streak, name
      skipped = len(poisoned & set(range(steps)))
      assert int(m["floor_overflows"]) == skipped == int(m["skipped_steps"])
      if streak < 5:
        fs.raise_if_min_scale_reached(state, max_consecutive_errors=5)
        continue
      assert fs.overflow_report(state).kind == "persistent"
      with pytest.raises(fs.MinLossScaleError) as err:
        fs.raise_if_min_scale_reached(state, max_consecutive_errors=5)
      text = str(err.value)
      assert "5 steps in a row were skipped (max_consecutive_errors=5)" in text
      assert POISONED in text, text
      assert "persistent" in text, text
      assert "cannot back off" in text
      # The floor count stops it too, and a bad limit is named.
      with pytest.raises(fs.MinLossScaleError, match="max_floor_overflows=3"):
        fs.raise_if_min_scale_reached(state, max_floor_overflows=3)
      with pytest.raises(ValueError, match="max_consecutive_errors"):
        fs.raise_if_min_scale_reached(state, max_consecutive_errors=0)


def test_an_overflow_report_says_the_model_state_select_is_unseen():
  """Issue 48: on a skipped step the report says that model state outside
  optax follows the skip only through fs.select_on_overflow, which it
  cannot see; a clean step's report does not."""
  tx = guarded(fs.static_scaler(4.0), optax.sgd(1.0))
  p = {"w": jnp.ones(2)}
  _, clean = tx.update({"w": jnp.ones(2)}, tx.init(p), p)
  _, skipped = tx.update({"w": jnp.array([jnp.inf, 1.0])}, clean, p)
  note = "is kept only by fs.select_on_overflow(opt_state, new=..., old=...)"
  assert note not in str(fs.overflow_report(clean))
  text = str(fs.overflow_report(skipped))
  assert note in text
  assert "cannot see whether it was called" in text
