"""fs.select_on_overflow: the model state follows the optimizer's skip.

The expectations are hand-derived (which calls overflow is chosen by the
test) or a second run of the same model with the bad batch left out, which
on a static scale must agree with the skipped run bit for bit.
"""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

BAD = float("inf")


def _tx(*, k=None, drop=False):
  tx = helpers.guarded(fs.static_scaler(4.0), optax.sgd(1.0))
  if k is None:
    return tx
  policy = "drop_microbatch" if drop else "skip_step"
  return fs.accumulate_gradients(tx, k, on_microbatch_overflow=policy)


# Old and new with distinct bits everywhere, an integer leaf and signed zeros
# included, so that a select of the wrong side cannot pass.
OLD = {"mean": jnp.array([-0.0, 1.5]), "count": jnp.int32(7)}
NEW = {"mean": jnp.array([0.0, jnp.nan]), "count": jnp.int32(8)}


@functools.partial(jax.jit, static_argnums=0)
def _step(tx, opt_state, grad):
  params = {"w": jnp.zeros(2)}
  _, opt_state = tx.update({"w": grad}, opt_state, params)
  return opt_state, fs.select_on_overflow(opt_state, new=NEW, old=OLD)


def _run(tx, bad_calls):
  """Which calls returned OLD (bit for bit), for a run whose calls in
  ``bad_calls`` carry an inf gradient."""
  state = tx.init({"w": jnp.zeros(2)})
  kept = []
  for i in range(max(bad_calls) + 4):
    grad = jnp.array([BAD if i in bad_calls else 1.0, 2.0], jnp.float16)
    state, out = _step(tx, state, grad)
    if helpers.bits(out) == helpers.bits(OLD):
      kept.append(True)
    else:
      assert helpers.bits(out) == helpers.bits(NEW), i
      kept.append(False)
  return kept


def test_old_on_an_overflow_step_new_otherwise_under_jit():
  assert _run(_tx(), {1, 2, 5}) == [0, 1, 1, 0, 0, 1, 0, 0, 0]


def test_accumulation_keeps_old_from_the_windows_first_bad_microbatch():
  # Windows of 3: [clean clean clean] [clean bad clean] [clean clean bad]
  # [bad clean clean]: the skipped windows' end, and every call from the
  # first bad microbatch of a window to its end.
  kept = _run(_tx(k=3), {4, 8, 9})
  assert kept == [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0]


def test_accumulation_dropping_microbatches():
  # "drop_microbatch": [clean bad clean] is applied, its middle call kept;
  # [bad bad bad] is skipped; a dropped last microbatch of an applied
  # window ([clean clean bad]) is not in the state: that call keeps new.
  kept = _run(_tx(k=3, drop=True), {4, 6, 7, 8, 11})
  assert kept == [0, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]


def test_the_window_end_without_overflow_after_one_is_new():
  # The accumulator is reset with the window: the next window's calls are
  # new again.
  kept = _run(_tx(k=2), {0})
  assert kept == [1, 1, 0, 0]


def _bad_second(grads_ok):
  return jnp.where(jnp.arange(3)[:, None] == 1, BAD, grads_ok)


def test_under_vmap_each_instance_follows_its_own_skip():
  tx = _tx()
  params = {"w": jnp.zeros((3, 2))}
  state = jax.vmap(tx.init)(params)
  grads = {"w": _bad_second(jnp.ones((3, 2))).astype(jnp.float16)}
  old = {"s": jnp.zeros((3, 4))}
  new = {"s": jnp.ones((3, 4))}

  def one(state, g, p, n, o):
    _, state = tx.update(g, state, p)
    return state, fs.select_on_overflow(state, new=n, old=o)

  state, out = jax.jit(jax.vmap(one))(state, grads, params, new, old)
  np.testing.assert_array_equal(out["s"][:, 0], [1.0, 0.0, 1.0])
  # A batched state, read outside vmap: its batch axis leads the leaves.
  out = jax.jit(fs.select_on_overflow)(state, new=new, old=old)
  np.testing.assert_array_equal(out["s"][:, 0], [1.0, 0.0, 1.0])
  with pytest.raises(ValueError, match="batch axes"):
    fs.select_on_overflow(state, new=jnp.ones(()), old=jnp.zeros(()))


def test_mismatched_trees_are_refused_by_name():
  state = _tx().init({"w": jnp.zeros(2)})
  with pytest.raises(ValueError, match="same tree structure"):
    fs.select_on_overflow(state, new={"a": 1.0}, old={"b": 1.0})
  with pytest.raises(ValueError, match=r"\['a'\]: float32\[2\] and float16"):
    fs.select_on_overflow(
      state, new={"a": jnp.zeros(2)}, old={"a": jnp.zeros(2, jnp.float16)}
    )
  with pytest.raises(ValueError, match="fp16_loss_scale|LossScaleState"):
    fs.select_on_overflow(optax.sgd(1.0).init({}), new=OLD, old=OLD)


# --- BatchNorm steps on sklearn's digits, one forward overflow --------------

BATCH, STEPS, BAD_STEP = 50, 90, 40


@pytest.fixture(scope="module")
def digits():
  datasets = pytest.importorskip("sklearn.datasets")
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return x[:1500], y[:1500].astype(np.int32), x[1500:], y[1500:]


def _batches(digits, *, leave_out_bad=False):
  """The training batches; the bad one (step BAD_STEP) times 6e4, whose
  first float16 layer overflows in the forward pass."""
  x, y, _, _ = digits
  out = []
  for i in range(STEPS):
    j = (i * BATCH) % len(x)
    bx, by = x[j : j + BATCH], y[j : j + BATCH]
    if i == BAD_STEP:
      if leave_out_bad:
        continue
      bx = bx * 6e4
    out.append((jnp.asarray(bx), jnp.asarray(by)))
  return out


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), y
  ).mean()


def _guarded():
  # A static scale: the run that skips the bad batch then equals, bit for
  # bit, the run that never saw it.
  return helpers.guarded(fs.static_scaler(2.0**10), optax.adam(1e-2))


def _flags(opt_state):
  m = fs.scale_metrics(opt_state)
  return {"overflow": m["overflow"], "overflow_kind": m["overflow_kind"]}


def _all_finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def _linen_run(digits, *, select=True, leave_out_bad=False):
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      x = nn.Dense(64, dtype=jnp.float16)(x)
      x = nn.BatchNorm(use_running_average=not train, dtype=jnp.float32)(x)
      return nn.Dense(10, dtype=jnp.float16)(nn.relu(x))

  model, tx = MLP(), _guarded()
  variables = model.init(jax.random.PRNGKey(0), digits[0][:2], train=False)
  params, stats = variables["params"], variables["batch_stats"]
  ema = params
  opt_state = tx.init(params)

  @jax.jit
  def step(params, stats, ema, opt_state, x, y):
    def loss_fn(params):
      logits, upd = model.apply(
        {"params": params, "batch_stats": stats},
        x,
        train=True,
        mutable=["batch_stats"],
      )
      return _xent(logits, y), upd["batch_stats"]

    (loss, new_stats), grads = fs.value_and_grad(
      loss_fn, opt_state, has_aux=True
    )(params)
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = optax.apply_updates(params, updates)
    new_ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, params)
    if select:
      new_stats = fs.select_on_overflow(opt_state, new=new_stats, old=stats)
      new_ema = fs.select_on_overflow(opt_state, new=new_ema, old=ema)
    return params, new_stats, new_ema, opt_state, _flags(opt_state)

  history = []
  for x, y in _batches(digits, leave_out_bad=leave_out_bad):
    before = (stats, ema)
    params, stats, ema, opt_state, m = step(params, stats, ema, opt_state, x, y)
    history.append((before, (stats, ema), m))
  logits = model.apply(
    {"params": params, "batch_stats": stats}, digits[2], train=False
  )
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == digits[3]))
  return (params, stats, ema), accuracy, history


def _check_skipped_run(run, digits):
  """Checks ``run``'s skip against its run without the bad batch; gives
  its run without the select."""
  final, accuracy, history = run(digits)
  final_lo, accuracy_lo, _ = run(digits, leave_out_bad=True)
  skipped = [i for i, (_, _, m) in enumerate(history) if bool(m["overflow"])]
  assert skipped == [BAD_STEP]  # the forward overflow, and no other
  before, after, m = history[BAD_STEP]
  assert int(m["overflow_kind"]) == fs.OVERFLOW_KINDS.index("forward")
  assert helpers.bits(after) == helpers.bits(before)
  assert all(_all_finite(after) for _, after, _ in history)
  # The skipped run is the run without the bad batch, bit for bit.
  assert helpers.bits(final) == helpers.bits(final_lo)
  assert accuracy == accuracy_lo and accuracy > 0.8
  return run(digits, select=False)


def test_linen_batch_stats_and_ema_follow_the_skip(digits):
  (_, stats, _), accuracy_raw, _ = _check_skipped_run(_linen_run, digits)
  # Without the select the forward pass's NaN stays in batch_stats.
  assert not _all_finite(stats) and accuracy_raw < 0.2


def _nnx_run(digits, *, select=True, leave_out_bad=False):
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(64, 64, dtype=jnp.float16, rngs=rngs)
      self.bn = nnx.BatchNorm(64, dtype=jnp.float32, rngs=rngs)
      self.out = nnx.Linear(64, 10, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.bn(self.hidden(x))))

  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, _guarded(), wrt=nnx.Param)

  def loss_fn(model, x, y):
    return _xent(model(x), y)

  # docs/porting.md's step, with the snapshot and the select.
  @nnx.jit
  def train_step(model, opt, x, y):
    old_stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))  # a snapshot
    loss, grads = fs.value_and_grad(loss_fn, opt)(model, x, y)
    opt.update(model, grads, value=loss)
    new_stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    nnx.update(
      model, fs.select_on_overflow(opt.opt_state, new=new_stats, old=old_stats)
    )
    return fs.scale_metrics(opt.opt_state)

  @nnx.jit
  def plain_step(model, opt, x, y):
    loss, grads = fs.value_and_grad(loss_fn, opt)(model, x, y)
    opt.update(model, grads, value=loss)
    return _flags(opt.opt_state)

  history = []
  for x, y in _batches(digits, leave_out_bad=leave_out_bad):
    before = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    m = (train_step if select else plain_step)(model, opt, x, y)
    history.append((before, nnx.as_pure(nnx.state(model, nnx.BatchStat)), m))
  model.eval()
  logits = model(digits[2])
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == digits[3]))
  return nnx.as_pure(nnx.state(model)), accuracy, history


def test_nnx_batch_stats_follow_the_skip(digits):
  final_raw, accuracy_raw, _ = _check_skipped_run(_nnx_run, digits)
  assert not _all_finite(final_raw) and accuracy_raw < 0.2


# --- The slips around the select (issues 48, 53) ----------------------------
#
# Live nnx Variables are refused (a type check); new and old go by keyword
# (a swap by position is a TypeError); the state from before tx.update is
# documented behaviour (select_on_overflow's docstring), tested here.


def _stateful_loss(params, state, x):
  """A Haiku-style ``apply``: the loss and the model state it wrote (a
  running mean of the batch, as BatchNorm keeps)."""
  new_state = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(x, axis=0)}
  return jnp.sum((x @ params["w"]) ** 2), new_state


def _stateful_step(tx, *, pre_update=False, writes=True):
  """docs/porting-haiku.md's step, or its slip: the state from before
  ``tx.update`` given to the select."""

  def step(params, state, opt_state, x):
    loss_fn = (
      _stateful_loss if writes else lambda p, s, x: (0.0 * p["w"].sum(), s)
    )
    (loss, new_state), grads = fs.value_and_grad(
      loss_fn, opt_state, has_aux=True
    )(params, state, x)
    before = opt_state
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    params = optax.apply_updates(params, updates)
    which = before if pre_update else opt_state
    kept = fs.select_on_overflow(which, new=new_state, old=state)
    return params, kept, opt_state

  return step


def _stateful_run(tx, step, steps=4, bad=2):
  params = {"w": jnp.ones((3, 2))}
  state = {"mean": jnp.zeros(3)}
  opt_state = tx.init(params)
  for i in range(steps):
    x = jnp.full((4, 3), BAD if i == bad else 1.0)
    params, state, opt_state = step(params, state, opt_state, x)
  return state, opt_state


@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("jit", [True, False])
def test_the_documented_select_is_unchanged_and_keeps_old_on_the_skip(k, jit):
  """The documented step, jitted and eager, with and without
  accumulation: the bad batch's NaN mean never enters the state (static
  scale 4, so step 2's forward overflow skips)."""
  tx = _tx(k=k)
  step = _stateful_step(tx)
  state, opt_state = _stateful_run(tx, jax.jit(step) if jit else step)
  assert np.isfinite(np.asarray(state["mean"])).all()
  assert int(fs.scale_metrics(opt_state)["skipped_steps"]) == 1
  quiet = _stateful_step(tx, writes=False)
  _stateful_run(tx, jax.jit(quiet) if jit else quiet)


@pytest.mark.parametrize("jit", [True, False])
def test_the_state_from_before_the_update_lags_one_step_as_documented(jit):
  """``fs.select_on_overflow(opt_state_before_update, ...)``: not refused
  (nothing in the state tells it from the one tx.update returned); its
  overflow flag is the last step's, so the bad step keeps the bad batch's
  inf mean, and the next step keeps it as the old state, eager and jitted
  alike, as select_on_overflow's docstring says."""
  tx = _tx()
  step = _stateful_step(tx, pre_update=True)
  state, opt_state = _stateful_run(tx, jax.jit(step) if jit else step)
  assert int(fs.scale_metrics(opt_state)["skipped_steps"]) == 1
  assert not np.isfinite(np.asarray(state["mean"])).any()


@pytest.mark.parametrize("jit", [True, False])
def test_new_and_old_by_position_are_refused(jit):
  """``new`` and ``old`` are keyword-only: a call by position (a swap
  cannot be seen in the values) is a TypeError, eager and jitted."""
  state = _tx().init({"w": jnp.zeros(2)})
  select = fs.select_on_overflow
  call = jax.jit(lambda s, n, o: select(s, n, o)) if jit else select
  with pytest.raises(TypeError, match="positional argument"):
    call(state, NEW, OLD)


def _nnx_bn_step(slip):
  """docs/porting.md's NNX step on a BatchNorm model, or its slip: ``live``
  takes both snapshots without nnx.as_pure."""
  nnx = pytest.importorskip("flax.nnx")

  @nnx.jit
  def step(model, opt, x):
    snap = (lambda s: s) if slip == "live" else nnx.as_pure
    old = snap(nnx.state(model, nnx.BatchStat))
    loss, grads = fs.value_and_grad(lambda m: jnp.sum(m(x) ** 2), opt)(model)
    opt.update(model, grads, value=loss)
    new = snap(nnx.state(model, nnx.BatchStat))
    nnx.update(model, fs.select_on_overflow(opt.opt_state, new=new, old=old))

  model = nnx.Sequential(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(1))
  )
  opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  return step, model, opt


@pytest.mark.parametrize("slip", ["live", None])
def test_nnx_snapshots_that_alias_the_variables_are_refused(slip):
  nnx = pytest.importorskip("flax.nnx")
  step, model, opt = _nnx_bn_step(slip)
  x = jnp.ones((2, 3))
  if slip is None:  # the documented step: a bad batch keeps the old stats
    step(model, opt, x)
    before = helpers.bits(nnx.as_pure(nnx.state(model, nnx.BatchStat)))
    step(model, opt, jnp.full((2, 3), BAD))
    after = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    assert helpers.bits(after) == before
    return
  with pytest.raises(ValueError) as e:
    step(model, opt, x)
  msg = str(e.value)
  assert "holds live nnx.Variable objects" in msg
  assert "nnx.as_pure(nnx.state(model, nnx.BatchStat))" in msg
