"""``fs.jmp_scaler`` against jmp's ``DynamicLossScale`` and ``fs.keras_scaler``
against Keras 3's ``LossScaleOptimizer`` (JAX backend): the peers' own code.

Each step hands a run the gradients its own scale makes: ``g * s`` rounded to
float16 (an element at or above 65520 becomes inf, so the overflows follow
the scale, as in training), with a NaN injected on some steps (a forward
overflow that no scale avoids). jmp runs its documented loop (``unscale``,
``all_finite``, ``select_tree``, ``adjust``), Keras its ``stateless_apply``,
fp16_scaling ``fs.chain(fs.fp16_loss_scale(scaler), optax.sgd(lr))``, each in
a jitted ``lax.scan``. Compared after every step: the scale before and after,
the skip and the parameters, bit for bit (the unscale is the same float32
arithmetic where the scale is a power of two), and Keras's inner iteration
count against the steps fp16_scaling applied. Then the designed differences
(jmp#44 under jit; Keras's 0 and inf at float32's ends), and each preset's
state into the peer and back.
"""

import dataclasses
import functools
import os

os.environ["KERAS_BACKEND"] = "jax"  # before keras is first imported

from helpers import SEED  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import oracles  # noqa: E402
import pytest  # noqa: E402

import fp16_scaling as fs  # noqa: E402

jmp = oracles.require("jmp")
keras = oracles.require("keras")
if keras.backend.backend() != "jax":
  pytest.skip(
    "keras was imported with another backend", allow_module_level=True
  )

STEPS = 3000
LR = 2.0**-6
BASE = np.array([1.0, -0.75, 0.5, 0.3125], np.float32)

# id: (preset arguments, log10 range of the gradient's magnitude, NaN rate).
# Four runs of STEPS steps per peer: 12,000 steps each.
JMP_RUNS = {
  "grow_every_step": (dict(loss_scale=2.0**15, period=1), (-3, 1), 0.02),
  "factor_4": (dict(loss_scale=2.0**15, period=5, factor=4), (-2, 3), 0.05),
  # Gradients so large that the floor overflows too: jmp's floor.
  "at_the_floor": (
    dict(loss_scale=8.0, period=2, min_loss_scale=2.0**-3),
    (-1, 5),
    0.3,
  ),
  # Gradients so small that the scale reaches 2**127, where growing by 8
  # gives inf and jmp keeps the scale (its first_finite).
  "at_the_top": (
    dict(loss_scale=2.0**100, period=3, factor=8, min_loss_scale=2.0**80),
    (-37, -29),
    0.01,
  ),
}
KERAS_RUNS = {
  "grow_every_step": (dict(dynamic_growth_steps=1), (-3, 1), 0.02),
  "growth_50": (dict(dynamic_growth_steps=50), (-2, 3), 0.005),
  "not_a_power_of_two": (
    dict(initial_scale=1000.0, dynamic_growth_steps=3),
    (-3, 2),
    0.1,
  ),
  "slow_growth": (
    dict(initial_scale=2.0**20, dynamic_growth_steps=200),
    (-2, 0),
    0.001,
  ),
}


def sequence(name, log10_range, nan_rate, steps=STEPS):
  """Gradient magnitudes (float32) and NaN flags, one per step."""
  rng = np.random.default_rng([SEED, sum(map(ord, name))])
  mags = (10 ** rng.uniform(*log10_range, steps)).astype(np.float32)
  nans = rng.random(steps) < nan_rate
  return jnp.asarray(mags), jnp.asarray(nans)


def present(mag, nan, scale):
  """What a float16 backward at ``scale`` hands over: float16(g * scale),
  NaN in its first element on a ``nan`` step; as float32."""
  g = (jnp.asarray(BASE) * mag * scale).astype(jnp.float16)
  first = jnp.arange(BASE.size) == 0
  g = jnp.where(nan & first, jnp.nan, g)
  return g.astype(jnp.float32)


def fs_tx(scaler):
  return fs.chain(fs.fp16_loss_scale(scaler), optax.sgd(LR))


def run_fs(scaler, mags, nans, state=None):
  """fp16_scaling over the sequence: per step (scale before, skipped, scale
  after, parameters), and the final (params, optimizer state)."""
  tx = fs_tx(scaler)
  params = jnp.zeros(BASE.size, jnp.float32)
  if state is None:
    state = tx.init(params)

  def step(carry, xs):
    params, state = carry
    before = fs.current_scale(state)
    updates, state = tx.update(present(*xs, before), state, params)
    params = optax.apply_updates(params, updates)
    m = fs.scale_metrics(state)
    out = (before, m["overflow"], m["loss_scale"], params)
    return (params, state), out

  scan = jax.jit(functools.partial(jax.lax.scan, step))
  final, out = scan((params, state), (mags, nans))
  return jax.tree.map(np.asarray, out), final


def run_jmp(kw, mags, nans, start=None):
  """jmp's loop: per step (scale before, skipped, scale after, params), and
  the final DynamicLossScale. The DynamicLossScale is rebuilt from the
  carried scale and counter each step with its ``min_loss_scale``, which
  the carry would lose (jmp#44); ``start`` is a DynamicLossScale."""
  period, factor = kw.get("period", 2000), kw.get("factor", 2)
  floor = jnp.float32(kw.get("min_loss_scale", 1.0))
  if start is None:
    start = jmp.DynamicLossScale(jnp.float32(kw["loss_scale"]))

  def step(carry, xs):
    scale, counter, params = carry
    ls = jmp.DynamicLossScale(scale, counter, period, factor, floor)
    grads = ls.unscale(present(*xs, ls.loss_scale))
    finite = jmp.all_finite(grads)
    params = jmp.select_tree(finite, params - LR * grads, params)
    ls = ls.adjust(finite)
    out = (scale, ~finite, ls.loss_scale, params)
    return (ls.loss_scale, ls.counter, params), out

  carry = (
    jnp.asarray(start.loss_scale, jnp.float32),
    jnp.asarray(start.counter, jnp.int32),
    jnp.zeros(BASE.size, jnp.float32),
  )
  scan = jax.jit(functools.partial(jax.lax.scan, step))
  (scale, counter, _), out = scan(carry, (mags, nans))
  end = jmp.DynamicLossScale(scale, counter, period, factor, floor)
  return jax.tree.map(np.asarray, out), end


class KerasRun:
  """A LossScaleOptimizer over SGD(LR) and one variable, stepped with
  ``stateless_apply`` in a jitted scan."""

  def __init__(self, kw):
    self.opt = keras.optimizers.LossScaleOptimizer(
      keras.optimizers.SGD(LR), **kw
    )
    self.var = keras.Variable(np.zeros(BASE.size, np.float32))
    self.opt.build([self.var])
    variables = self.opt.variables
    self.names = [v.name for v in variables]
    self.scale_at = self.names.index("dynamic_scale")
    inner = self.opt.inner_optimizer.iterations
    self.iter_at = [v is inner for v in variables].index(True)
    self.values = [v.value for v in variables]

  def run(self, mags, nans):
    """Per step (scale before, skipped, scale after, params, inner
    iterations); the optimizer variables advance to the run's end."""
    opt = self.opt
    at = self.scale_at

    def step(carry, xs):
      tv, ov = carry
      before = ov[at]
      tv, ov = opt.stateless_apply(ov, [present(*xs, before)], tv)
      out = (before, ov[at], tv[0], ov[self.iter_at])
      return (tv, ov), out

    scan = jax.jit(functools.partial(jax.lax.scan, step))
    start = int(self.values[self.iter_at])
    carry = ([self.var.value], list(self.values))
    (_, self.values), out = scan(carry, (mags, nans))
    before, after, params, iters = map(np.asarray, out)
    # Keras's own record of a skip: its inner optimizer did not step.
    skipped = np.diff(iters, prepend=start) == 0
    return before, skipped, after, params, iters - start

  def state_dict(self):
    return dict(zip(self.names, self.values))


def prefix(mags, nans):
  """The sequence's first 23 steps, ending in an overflow (step 20) and two
  clean steps: the growth tracker is 2 after them, mid-interval."""
  mags = mags[:23].at[21:].set(1e-6)
  nans = nans[:23].at[20].set(True).at[21:].set(False)
  return mags, nans


def assert_same(ours, peer, *, params=True):
  """Step by step: scale before, skip, scale after (and the parameters)."""
  names = ("scale before", "skip", "scale after", "parameters")
  compared = 4 if params else 3
  for name, a, b in list(zip(names, ours, peer))[:compared]:
    np.testing.assert_array_equal(a, b, err_msg=name)


def counts(ours, nans):
  before, skipped, after, _ = ours
  nans = np.asarray(nans)
  return dict(
    steps=len(before),
    skips=int(skipped.sum()),
    scale_overflows=int((skipped & ~nans).sum()),
    growths=int((after > before).sum()),
    floor_steps=int((after == before)[skipped].sum()),
  )


@pytest.mark.parametrize("run", sorted(JMP_RUNS))
def test_jmp_scaler_matches_dynamic_loss_scale(run):
  kw, log10_range, nan_rate = JMP_RUNS[run]
  mags, nans = sequence(f"jmp {run}", log10_range, nan_rate)
  ours, _ = run_fs(fs.jmp_scaler(**kw), mags, nans)
  theirs, _ = run_jmp(kw, mags, nans)
  # At the top the updates are float32 subnormals (LR times gradients near
  # 1e-37), which XLA flushes to zero in one fusion and not in another: the
  # parameters are compared on the other runs.
  assert_same(ours, theirs, params=run != "at_the_top")
  c = counts(ours, nans)
  print(f"\njmp {run}: {c}, 0 differences")
  # The scale moved both ways, and the scale itself made overflows.
  assert c["growths"] >= 5, c
  assert c["scale_overflows"] >= 5, c
  if run == "at_the_floor":
    assert c["floor_steps"] >= 100, c
    assert ours[2].min() == 2.0**-3, c
  if run == "at_the_top":  # growths refused: period clean steps at the top
    top = (ours[0] == 2.0**127) & ~ours[1]
    assert ours[2].max() == 2.0**127, c
    assert top.sum() >= kw["period"], c


def test_jmp_loop_traced_is_jmp_eager():
  # run_jmp rebuilds the DynamicLossScale each step under the scan; jmp's
  # own eager loop, 60 steps of the floor run, gives the same decisions.
  kw, log10_range, nan_rate = JMP_RUNS["at_the_floor"]
  mags, nans = sequence("at_the_floor", log10_range, nan_rate, steps=60)
  traced, _ = run_jmp(kw, mags, nans)
  ls = jmp.DynamicLossScale(
    jnp.float32(kw["loss_scale"]),
    period=kw["period"],
    min_loss_scale=jnp.float32(kw["min_loss_scale"]),
  )
  scales, skips = [], []
  for mag, nan in zip(mags, nans):
    finite = jmp.all_finite(ls.unscale(present(mag, nan, ls.loss_scale)))
    ls = ls.adjust(finite)
    scales.append(float(ls.loss_scale))
    skips.append(not bool(finite))
  np.testing.assert_array_equal(traced[2], scales)
  np.testing.assert_array_equal(traced[1], skips)
  assert 10 <= sum(skips) <= 50
  assert min(scales) == kw["min_loss_scale"]


@pytest.mark.parametrize("run", sorted(KERAS_RUNS))
def test_keras_scaler_matches_loss_scale_optimizer(run):
  kw, log10_range, nan_rate = KERAS_RUNS[run]
  mags, nans = sequence(f"keras {run}", log10_range, nan_rate)
  ours, _ = run_fs(fs.keras_scaler(**kw), mags, nans)
  keras_run = KerasRun(kw)
  *theirs, iters = keras_run.run(mags, nans)
  # Keras divides by its scale, fp16_scaling multiplies by 1 / scale: the
  # same float32 number when the scale is a power of two, else within one
  # rounding of the gradient, so the parameters are compared only then.
  powers = run != "not_a_power_of_two"
  assert_same(ours, theirs, params=powers)
  # A skipped step does not advance the inner optimizer's iterations: they
  # count the steps fp16_scaling applied.
  np.testing.assert_array_equal(iters, np.cumsum(~ours[1]))
  # Within float32's normal range throughout, where the two agree.
  assert 2.0**-126 <= ours[2].min()
  assert ours[2].max() <= 2.0**127
  c = counts(ours, nans)
  print(f"\nkeras {run}: {c}, 0 differences")
  assert c["growths"] >= 5, c
  assert c["scale_overflows"] >= 5, c


# Designed differences.


def test_jmp_loses_min_loss_scale_under_jit():
  # jmp#44: DynamicLossScale's pytree holds the scale and the counter only
  # and rebuilds min_loss_scale as 1.0, so any jit or scan resets the floor.
  # fs.jmp_scaler keeps it, as jmp's eager loop does.
  adjust = jax.jit(lambda ls, finite: ls.adjust(finite))
  for floor, jitted in [(2.0**-3, [2, 1, 1, 1, 1, 1]), (2.0, [2, 1, 1, 1])]:
    eager = jmp.DynamicLossScale(
      jnp.float32(4.0), period=2, min_loss_scale=jnp.float32(floor)
    )
    through_jit = eager
    scaler = fs.jmp_scaler(loss_scale=4.0, period=2, min_loss_scale=floor)
    state, update = scaler.init(), jax.jit(scaler.update)
    got = {"eager": [], "jit": [], "fs": []}
    for _ in jitted:
      eager = eager.adjust(jnp.bool_(False))
      through_jit = adjust(through_jit, jnp.bool_(False))
      state = update(state, jnp.bool_(True))
      got["eager"].append(float(eager.loss_scale))
      got["jit"].append(float(through_jit.loss_scale))
      got["fs"].append(float(state.loss_scale))
    assert got["jit"] == jitted  # the floor became 1.0, above or below
    assert got["fs"] == got["eager"] != got["jit"]
    assert min(got["fs"]) == floor
    # What jmp does under jit is fs.jmp_scaler with min_loss_scale=1.
    one = fs.jmp_scaler(loss_scale=4.0, period=2)
    state = one.init()
    for want in jitted:
      state = one.update(state, True)
      assert float(state.loss_scale) == want


def _keras_and_fs(kw, mags, nans):
  keras_run = KerasRun(kw)
  before, skipped, after, _, _ = keras_run.run(mags, nans)
  ours, _ = run_fs(fs.keras_scaler(**kw), mags, nans)
  return (before, skipped, after), ours[:3]


def test_keras_goes_to_zero_below_float32s_normals_where_fs_stops():
  # NaN on every step, halving from 2**-124: Keras reaches 2**-126, then
  # 0.0 (XLA flushes the subnormal 2**-127); fp16_scaling stays at 2**-126.
  mags, nans = jnp.ones(5, jnp.float32), jnp.ones(5, bool)
  theirs, ours = _keras_and_fs(
    dict(initial_scale=2.0**-124, dynamic_growth_steps=1), mags, nans
  )
  tiny = 2.0**-126
  np.testing.assert_array_equal(theirs[2], [2.0**-125, tiny, 0, 0, 0])
  np.testing.assert_array_equal(ours[2], [2.0**-125, tiny, tiny, tiny, tiny])
  assert theirs[1].all()
  assert ours[1].all()


def test_keras_goes_to_inf_past_float32s_max_where_fs_stops():
  # Zero gradients, growing every step from 2**125: Keras reaches 2**127,
  # then inf, where every step is skipped (0 * inf is NaN) and the scale
  # stays inf; fp16_scaling stays at 2**127 and keeps stepping.
  mags, nans = jnp.zeros(5, jnp.float32), jnp.zeros(5, bool)
  theirs, ours = _keras_and_fs(
    dict(initial_scale=2.0**125, dynamic_growth_steps=1), mags, nans
  )
  inf = np.inf
  np.testing.assert_array_equal(theirs[2], [2.0**126, 2.0**127, inf, inf, inf])
  np.testing.assert_array_equal(theirs[1], [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(ours[2], [2.0**126] + [2.0**127] * 4)
  assert not ours[1].any()


# Each preset's state into the peer and back.


def test_jmp_state_into_jmp_and_back():
  kw = dict(loss_scale=2.0**15, period=5, factor=4)
  scaler = fs.jmp_scaler(**kw)
  mags, nans = sequence("jmp round trip", (-2, 3), 0.05, steps=1500)
  # fp16_scaling's first 23 steps, then jmp from its state.
  _, (_, state) = run_fs(scaler, *prefix(mags, nans))
  tracker = fs.scaler_state_dict(state)["growth_tracker"]
  sd = fs.to_peer_state_dict(state, "jmp", scaler)
  ls = jmp.DynamicLossScale(**sd)
  assert float(ls.loss_scale) == float(fs.current_scale(state))
  assert int(ls.counter) == tracker
  # The preset jmp's state holds: its configuration, its scale.
  expected = fs.jmp_scaler(**{**kw, "loss_scale": float(ls.loss_scale)})
  assert fs.scaler_from_state_dict(ls) == expected
  ours, (_, state) = run_fs(scaler, mags[23:], nans[23:], state)
  theirs, ls = run_jmp(kw, mags[23:], nans[23:], ls)
  assert_same(ours[:3], theirs[:3], params=False)
  # And back: jmp's state after those steps into fp16_scaling, as an
  # object and as its fields.
  for given in (ls, vars(ls)):
    loaded = fs.load_scaler_state_dict(state, given, scaler)
    sd = fs.scaler_state_dict(loaded)
    assert sd["loss_scale"] == float(ls.loss_scale)
    assert sd["growth_tracker"] == int(ls.counter)
  ours_again = run_fs(scaler, mags, nans, loaded)[0]
  jmp_again = run_jmp(kw, mags, nans, ls)[0]
  assert_same(ours_again[:3], jmp_again[:3], params=False)
  assert tracker == 2


def test_keras_state_into_keras_and_back():
  kw = dict(dynamic_growth_steps=7)
  scaler = fs.keras_scaler(**kw)
  mags, nans = sequence("keras round trip", (-2, 3), 0.05, steps=1500)
  _, (_, state) = run_fs(scaler, *prefix(mags, nans))
  tracker = fs.scaler_state_dict(state)["growth_tracker"]
  sd = fs.to_peer_state_dict(state, "keras", scaler)
  assert sd["dynamic_growth_steps"] == 7
  keras_run = KerasRun(kw)
  # Into Keras's optimizer variables, by name.
  keras_run.values = [
    jnp.asarray(sd[v.name], v.dtype) if v.name in sd else x
    for v, x in zip(keras_run.opt.variables, keras_run.values)
  ]
  theirs = keras_run.run(mags[23:], nans[23:])
  ours, (_, state) = run_fs(scaler, mags[23:], nans[23:], state)
  assert_same(ours[:3], theirs[:3], params=False)
  # And back: the variables by name, then the optimizer itself.
  vs = keras_run.state_dict()
  loaded = fs.load_scaler_state_dict(state, vs, scaler)
  sd = fs.scaler_state_dict(loaded)
  assert sd["loss_scale"] == float(vs["dynamic_scale"])
  assert sd["growth_tracker"] == int(vs["step_counter"])
  for v, x in zip(keras_run.opt.variables, keras_run.values):
    v.assign(x)
  from_opt = fs.load_scaler_state_dict(state, keras_run.opt, scaler)
  assert fs.scaler_state_dict(from_opt) == sd
  expected = fs.keras_scaler(**kw, initial_scale=float(vs["dynamic_scale"]))
  assert fs.scaler_from_state_dict(keras_run.opt) == expected
  ours_again = run_fs(scaler, mags, nans, loaded)[0]
  keras_again = keras_run.run(mags, nans)
  assert_same(ours_again[:3], keras_again[:3], params=False)
  assert tracker == 2


def test_a_float16_loss_scale_runs_in_float32():
  # jmp#47: a float16 loss_scale (jmp's own docstring suggests the half
  # dtype) fails in adjust, where min_loss_scale is float32. fs.jmp_scaler
  # takes its value and runs the scale in float32.
  with pytest.raises(TypeError, match="lax.select requires"):
    jmp.DynamicLossScale(jnp.float16(2**15)).adjust(jnp.bool_(True))
  assert fs.jmp_scaler(loss_scale=jnp.float16(2**15)) == fs.jmp_scaler()


_params = oracles.signature_params


def test_presets_take_the_peers_names_and_defaults():
  # jmp: DynamicLossScale's fields; its defaults, and for loss_scale (which
  # jmp requires) the 2**15 of its docstring.
  ours = _params(fs.jmp_scaler)
  fields = {f.name: f for f in dataclasses.fields(jmp.DynamicLossScale)}
  assert set(ours) == set(fields)
  assert all(p.kind is p.KEYWORD_ONLY for p in ours.values())
  assert ours["period"].default == fields["period"].default
  assert ours["factor"].default == fields["factor"].default
  assert ours["counter"].default == fields["counter"].default_factory()
  floor = fields["min_loss_scale"].default_factory()
  assert ours["min_loss_scale"].default == floor
  assert ours["loss_scale"].default == 2.0**15
  # Keras: LossScaleOptimizer's scale arguments, with its defaults.
  ours = _params(fs.keras_scaler)
  theirs = _params(
    keras.optimizers.LossScaleOptimizer.__init__,
    ("inner_optimizer", "name", "kwargs"),
  )
  assert set(ours) == set(theirs)
  assert all(p.kind is p.KEYWORD_ONLY for p in ours.values())
  for name, p in ours.items():
    assert p.default == theirs[name].default, name
