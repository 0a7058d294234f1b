"""One loss scale for two optimizers (fs.shared_loss_scale), with
``torch.amp.GradScaler``'s semantics for several optimizers.

Each optimizer measures and skips on its own gradients: a one-sided
overflow leaves that optimizer's parameters and inner state bit for bit and
lets the other step as plain optax would. The shared scale steps once per
step, from the OR of the optimizers' overflows: checked against
``Scaler.update`` on that OR (the machine the presets' peer tests check) for
every preset over a long random sequence, and by hand for torch's rule.
tests/peers/test_torch_shared.py runs torch's own GradScaler as the oracle.
"""

import helpers
from helpers import bits
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

O, C = True, False


def _pair(shared, opt0=None, opt1=None):
  """Two guarded chains sharing ``shared``: Adam and sgd with momentum, so
  that a skipped step has inner state to keep."""
  opt0 = opt0 or optax.adam(2.0**-6)
  opt1 = opt1 or optax.sgd(2.0**-3, momentum=0.5)
  return (
    fs.skip_on_overflow(optax.chain(fs.fp16_loss_scale(shared), opt0)),
    fs.skip_on_overflow(optax.chain(fs.fp16_loss_scale(shared), opt1)),
  )


def linear(p, v):
  """A loss whose gradient is ``v``."""
  return jnp.sum(p * v)


def _poison(g, bad, value=jnp.inf):
  return g.at[1].set(jnp.where(bad, value, g[1]))


# ------------------------------------------------------ one-sided overflows


def test_a_one_sided_overflow_skips_only_that_optimizer():
  """torch's rule by hand (growth every 2 clean steps): a step on which
  either or both optimizers overflowed halves the scale once; only steps
  with no overflow count toward growth."""
  shared = fs.shared_loss_scale(
    fs.torch_scaler(init_scale=2.0**10, growth_interval=2)
  )
  tx0, tx1 = _pair(shared)
  opt0, opt1 = optax.adam(2.0**-6), optax.sgd(2.0**-3, momentum=0.5)
  p0, p1 = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.25, 3.0, -1.0])

  @jax.jit
  def step(p0, p1, s0, s1, scale_state, v0, v1, bad0, bad1):
    _, g0 = fs.value_and_grad(linear, scale_state)(p0, v0)
    _, g1 = fs.value_and_grad(linear, scale_state)(p1, v1)
    u0, s0 = tx0.update(_poison(g0, bad0), s0, p0, loss_scale=scale_state)
    u1, s1 = tx1.update(
      _poison(g1, bad1, jnp.nan), s1, p1, loss_scale=scale_state
    )
    scale_state = shared.update(scale_state, s0, s1)
    return p0 + u0, p1 + u1, s0, s1, scale_state

  state = (p0, p1, tx0.init(p0), tx1.init(p1), shared.init())
  plain = [(p0, opt0.init(p0)), (p1, opt1.init(p1))]
  flags = [(C, C), (O, C), (C, O), (O, O), (C, C), (C, C), (C, C)]
  scales = []
  rng = np.random.default_rng(helpers.SEED)
  for bad in flags:
    v = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
    scales.append(float(fs.current_scale(state[4])))
    new = step(*state, *v, *bad)
    for i in range(2):
      s_old, s_new = state[2 + i], new[2 + i]
      assert bool(s_new[0].overflow) == bad[i]
      assert float(s_new[0].prev_loss_scale) == scales[-1]
      if bad[i]:  # parameters and inner state keep every bit
        assert bits(new[i]) == bits(state[i])
        assert bits(s_new[1]) == bits(s_old[1])
      else:  # the other steps as plain optax on the true gradients
        opt = (opt0, opt1)[i]
        p, s = plain[i]
        u, s = opt.update(v[i], s, p)
        plain[i] = (p + u, s)
        np.testing.assert_allclose(new[i], plain[i][0], rtol=1e-6)
        assert bits(new[i]) != bits(state[i])
    state = new
  # By hand: 1024 (1 clean), 1024 -> 512 (one-sided), 256 (the other
  # side), 128 (both: once, not twice), 2 clean steps grow it to 256.
  assert scales == [1024, 1024, 512, 256, 128, 128, 256]
  final = state[4]
  assert float(final.loss_scale) == 256 and int(final.growth_tracker) == 1
  assert [int(s[0].skipped_steps) for s in state[2:4]] == [2, 2]


# ------------------------------------- every preset against Scaler.update


def _same_bits(a, b):
  """Traced: whether two trees hold the same bits (-0.0 is not 0.0)."""

  def as_int(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.lax.bitcast_convert_type(x, jnp.int32)
    return x

  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return jnp.all(jnp.stack([jnp.all(as_int(x) == as_int(y)) for x, y in pairs]))


STEPS = 500
PRESETS = {
  "deepspeed": fs.deepspeed_scaler(
    init_scale=2.0**10, scale_window=3, delayed_shift=2
  ),
  "torch": fs.torch_scaler(init_scale=2.0**10, growth_interval=3),
  "megatron": fs.megatron_scaler(
    initial_scale=2.0**10, growth_interval=3, hysteresis=2
  ),
  "flax": fs.flax_scaler(scale=2.0**10, growth_interval=2),
  "static": fs.static_scaler(2.0**6),
  "headroom": fs.headroom_scaler(
    init_scale=2.0**10, growth_margin_bits=1.0, max_scale=2.0**20
  ),
}


def _sequence():
  """Flags with every combination (a fifth of the steps both), and
  gradients whose size moves over four decades (for headroom)."""
  rng = np.random.default_rng([helpers.SEED, 27])
  both = rng.random(STEPS) < 0.06
  bad0 = (rng.random(STEPS) < 0.12) | both
  bad1 = (rng.random(STEPS) < 0.12) | both
  size = 10 ** rng.uniform(-2, 2, (STEPS, 1))
  v = (rng.standard_normal((2, STEPS, 4)) * size).astype(np.float32)
  return v[0], v[1], bad0, bad1


@pytest.fixture(scope="module")
def preset_runs():
  """Every preset's run in one jit, one ``lax.scan`` each: per step the
  shared scale state after it, the oracle's, each optimizer's overflow and
  prev_loss_scale, and whether its parameters and inner state kept every
  bit."""
  v0, v1, bad0, bad1 = _sequence()

  def run_one(scaler, xs):
    shared = fs.shared_loss_scale(scaler)
    tx0, tx1 = _pair(shared)
    p0, p1 = jnp.zeros(4), jnp.ones(4)

    def body(carry, x):
      p0, p1, s0, s1, scale_state, oracle = carry
      v0, v1, bad0, bad1 = x
      _, g0 = fs.value_and_grad(linear, scale_state)(p0, v0)
      _, g1 = fs.value_and_grad(linear, scale_state)(p1, v1)
      u0, n0 = tx0.update(_poison(g0, bad0), s0, p0, loss_scale=scale_state)
      u1, n1 = tx1.update(
        _poison(g1, bad1, jnp.nan), s1, p1, loss_scale=scale_state
      )
      new_scale = shared.update(scale_state, n0, n1)
      grad_max = jnp.maximum(jnp.max(jnp.abs(v0)), jnp.max(jnp.abs(v1)))
      oracle = scaler.update(oracle, bad0 | bad1, grad_max)
      out = dict(
        scale=new_scale,
        oracle=oracle,
        overflow=(n0[0].overflow, n1[0].overflow),
        prev=(n0[0].prev_loss_scale, n1[0].prev_loss_scale),
        before=scale_state.loss_scale,
        kept=(
          _same_bits((p0 + u0, n0[1]), (p0, s0[1])),
          _same_bits((p1 + u1, n1[1]), (p1, s1[1])),
        ),
        skipped=(n0[0].skipped_steps, n1[0].skipped_steps),
      )
      return (p0 + u0, p1 + u1, n0, n1, new_scale, oracle), out

    init = (p0, p1, tx0.init(p0), tx1.init(p1), shared.init(), scaler.init())
    return jax.lax.scan(body, init, xs)[1]

  @jax.jit
  def run_all(xs):
    return {name: run_one(s, xs) for name, s in PRESETS.items()}

  xs = tuple(map(jnp.asarray, (v0, v1, bad0, bad1)))
  return jax.tree.map(np.asarray, run_all(xs)), (bad0, bad1)


def test_the_sequence_has_every_case():
  _, _, bad0, bad1 = _sequence()
  assert (bad0 & ~bad1).sum() >= 30 and (bad1 & ~bad0).sum() >= 30
  assert (bad0 & bad1).sum() >= 20 and (~bad0 & ~bad1).sum() >= 200


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shared_scale_is_scaler_update_on_the_or(name, preset_runs):
  runs, (bad0, bad1) = preset_runs
  out = runs[name]
  for field in fs.ScalerState._fields:
    np.testing.assert_array_equal(
      getattr(out["scale"], field), getattr(out["oracle"], field), field
    )
  # Each optimizer decided on its own gradients, made at the shared scale.
  for i, bad in enumerate((bad0, bad1)):
    np.testing.assert_array_equal(out["overflow"][i], bad)
    np.testing.assert_array_equal(out["prev"][i], out["before"])
    np.testing.assert_array_equal(out["kept"][i], bad)
    np.testing.assert_array_equal(out["skipped"][i], np.cumsum(bad))
  # The runs exercised the rule: the scale moved both ways (but static).
  after, before = out["scale"].loss_scale, out["before"]
  grew, fell = (after > before).sum(), (after < before).sum()
  if name == "static":
    assert grew == fell == 0
  else:
    assert grew >= 10 and fell >= 10, (grew, fell)
  if name in ("deepspeed", "megatron"):  # hysteresis absorbed some
    absorbed = (bad0 | bad1) & (after == before)
    assert absorbed.sum() >= 10


# ------------------------------------------------- GAN order, one call


def _d(pd, x):
  return jnp.tanh(x @ pd["w"] + pd["b"])


def _g(pg, z):
  return z * pg["scale"] + pg["shift"]


def loss_d(pd, pg, z, real):
  fake = _g(pg, z)
  return jnp.mean((_d(pd, real) - 1.0) ** 2) + jnp.mean(_d(pd, fake) ** 2)


def loss_g(pd, pg, z):
  return jnp.mean((_d(pd, _g(pg, z)) - 1.0) ** 2)


PD = {"w": jnp.array([0.5, -0.25, 1.0]), "b": jnp.float32(0.1)}
PG = {"scale": jnp.array([1.0, 0.5, -0.5]), "shift": jnp.zeros(3)}


def _batches(n):
  rng = np.random.default_rng([helpers.SEED, 3])
  z = rng.standard_normal((n, 8, 3)).astype(np.float32)
  real = (rng.standard_normal((n, 8, 3)) * 0.5 + 1.0).astype(np.float32)
  return z, real


def _tree_poison(tree, bad):
  return jax.tree.map(lambda g: g * jnp.where(bad, jnp.inf, 1.0), tree)


def test_gan_order_against_plain_optax():
  """The discriminator steps, then the generator's loss is taken through
  the updated discriminator, then the scale steps once: each side's
  parameters are plain optax's on the true gradients taken in that order,
  over steps with overflows on either side and both."""
  scaler = fs.torch_scaler(init_scale=2.0**8, growth_interval=2)
  shared = fs.shared_loss_scale(scaler)
  opt_d, opt_g = optax.adam(2.0**-5), optax.sgd(2.0**-4, momentum=0.5)
  tx_d, tx_g = _pair(shared, opt_d, opt_g)

  @jax.jit
  def step(carry, x):
    pd, pg, sd, sg, scale_state = carry
    z, real, bad_d, bad_g = x
    _, gd = fs.value_and_grad(loss_d, scale_state)(pd, pg, z, real)
    ud, sd = tx_d.update(
      _tree_poison(gd, bad_d), sd, pd, loss_scale=scale_state
    )
    pd = optax.apply_updates(pd, ud)
    _, gg = fs.value_and_grad(loss_g, scale_state, argnums=1)(pd, pg, z)
    ug, sg = tx_g.update(
      _tree_poison(gg, bad_g), sg, pg, loss_scale=scale_state
    )
    pg = optax.apply_updates(pg, ug)
    scale_state = shared.update(scale_state, sd, sg)
    return (pd, pg, sd, sg, scale_state), (pd, pg, scale_state.loss_scale)

  @jax.jit
  def plain(carry, x):
    pd, pg, sd, sg, oracle = carry
    z, real, bad_d, bad_g = x
    gd = jax.grad(loss_d)(pd, pg, z, real)
    ud, new_sd = opt_d.update(gd, sd, pd)
    keep = lambda bad, old, new: jax.tree.map(
      lambda a, b: jnp.where(bad, a, b), old, new
    )
    pd = keep(bad_d, pd, optax.apply_updates(pd, ud))
    sd = keep(bad_d, sd, new_sd)
    gg = jax.grad(loss_g, argnums=1)(pd, pg, z)
    ug, new_sg = opt_g.update(gg, sg, pg)
    pg = keep(bad_g, pg, optax.apply_updates(pg, ug))
    sg = keep(bad_g, sg, new_sg)
    oracle = scaler.update(oracle, bad_d | bad_g)
    return (pd, pg, sd, sg, oracle), (pd, pg, oracle.loss_scale)

  n = 12
  z, real = _batches(n)
  bad_d = np.zeros(n, bool)
  bad_g = np.zeros(n, bool)
  bad_d[[2, 7]] = True
  bad_g[[4, 7, 9]] = True
  xs = (z, real, bad_d, bad_g)
  ours = jax.lax.scan(
    step, (PD, PG, tx_d.init(PD), tx_g.init(PG), shared.init()), xs
  )[1]
  theirs = jax.lax.scan(
    plain, (PD, PG, opt_d.init(PD), opt_g.init(PG), scaler.init()), xs
  )[1]
  np.testing.assert_array_equal(ours[2], theirs[2])
  for a, b in zip(jax.tree.leaves(ours[:2]), jax.tree.leaves(theirs[:2])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # The scale halved on each of the 4 steps with an overflow (7: both).
  assert list(np.asarray(ours[2])) == [
    256,
    512,
    256,
    256,
    128,
    128,
    256,
    128,
    128,
    64,
    64,
    128,
  ]


def test_both_gradients_from_one_value_and_grad_call():
  """Two parameter sets in one loss (actor-critic): one call with
  ``argnums=(0, 1)`` gives both gradients; each goes to its optimizer as it
  is, and a one-sided overflow skips that side alone."""
  shared = fs.shared_loss_scale(fs.torch_scaler(init_scale=2.0**6))
  tx0, tx1 = _pair(shared)
  opt0, opt1 = optax.adam(2.0**-6), optax.sgd(2.0**-3, momentum=0.5)

  def joint(pa, pb, x):
    return jnp.mean((x @ pa) ** 2) + jnp.mean((x @ pb - x @ pa) ** 2)

  @jax.jit
  def step(pa, pb, sa, sb, scale_state, x, bad_a):
    value, (ga, gb) = fs.value_and_grad(joint, scale_state, argnums=(0, 1))(
      pa, pb, x
    )
    ua, sa = tx0.update(_poison(ga, bad_a), sa, pa, loss_scale=scale_state)
    ub, sb = tx1.update(gb, sb, pb, loss_scale=scale_state)
    scale_state = shared.update(scale_state, sa, sb)
    return value, pa + ua, pb + ub, sa, sb, scale_state

  pa, pb = jnp.array([0.5, -1.0]), jnp.array([1.0, 0.25])
  x = jnp.array([[1.0, 2.0], [-0.5, 0.25], [0.75, -1.5]])
  state = (pa, pb, tx0.init(pa), tx1.init(pb), shared.init())
  plain_a, plain_b = (pa, opt0.init(pa)), (pb, opt1.init(pb))
  for bad_a in [False, True, False]:
    ga, gb = jax.grad(joint, argnums=(0, 1))(plain_a[0], plain_b[0], x)
    expected = float(joint(plain_a[0], plain_b[0], x))
    value, *state = step(*state, x, bad_a)
    assert float(value) == pytest.approx(expected, rel=1e-6)
    if not bad_a:
      u, s = opt0.update(ga, plain_a[1], plain_a[0])
      plain_a = (plain_a[0] + u, s)
    u, s = opt1.update(gb, plain_b[1], plain_b[0])
    plain_b = (plain_b[0] + u, s)
    np.testing.assert_allclose(state[0], plain_a[0], rtol=1e-6)
    np.testing.assert_allclose(state[1], plain_b[0], rtol=1e-6)
  assert float(state[4].loss_scale) == 2.0**5  # one back-off


def test_the_whole_step_is_one_jitted_function():
  """Traceable: gradients, both updates, the shared update, a scale set
  from inside the step and the metrics are one jitted function, traced
  once whatever the flags and the scale."""
  scaler = fs.deepspeed_scaler(
    init_scale=2.0**4, scale_window=1, delayed_shift=2
  )
  shared = fs.shared_loss_scale(scaler)
  tx0, tx1 = _pair(shared)
  traces = []

  @jax.jit
  def step(p0, p1, s0, s1, scale_state, v, bad0, bad1, reset):
    traces.append(1)
    scale_state = jax.lax.cond(
      reset,
      lambda s: fs.set_loss_scale(s, jnp.float32(2.0**9)),
      lambda s: s,
      scale_state,
    )
    _, g0 = fs.value_and_grad(linear, scale_state)(p0, v)
    _, g1 = fs.value_and_grad(linear, scale_state)(p1, -v)
    u0, s0 = tx0.update(_poison(g0, bad0), s0, p0, loss_scale=scale_state)
    u1, s1 = tx1.update(_poison(g1, bad1), s1, p1, loss_scale=scale_state)
    new_scale = shared.update(scale_state, s0, s1)
    metrics = (fs.scale_metrics(s0), fs.scale_metrics(s1))
    return (p0 + u0, p1 + u1, s0, s1, new_scale), metrics

  p = jnp.array([1.0, 2.0, 3.0])
  state = (p, p, tx0.init(p), tx1.init(p), shared.init())
  oracle = scaler.init()
  v = jnp.array([0.5, -1.0, 2.0])
  flags = [(C, C), (C, C), (O, C), (C, O), (O, O), (C, C), (C, C)]
  for i, bad in enumerate(flags):
    reset = i == 5
    state, metrics = step(*state, v, *map(jnp.bool_, bad), reset)
    if reset:
      oracle = oracle._replace(loss_scale=jnp.float32(2.0**9))
    oracle = scaler.update(oracle, bad[0] | bad[1])
    assert bits(state[4]) == bits(oracle)
    for m, b in zip(metrics, bad):
      assert "loss_scale" not in m  # the shared state's, not theirs
      assert bool(m["overflow"]) == b
  assert len(traces) == 1
  # By hand (DeepSpeed: first growth one clean step late): 16, grown to 32
  # (hysteresis refilled), absorbed, backed off to 16, to 8 (both: once);
  # set to 512 and grown to 1024.
  assert float(state[4].loss_scale) == 2.0**10


# ------------------------------------------------------------------ errors


def test_errors_say_what_to_do():
  scaler = fs.torch_scaler(init_scale=8.0)
  shared = fs.shared_loss_scale(scaler)
  p = jnp.ones(2)
  tx_shared = _pair(shared)[0]
  tx_owned = helpers.guarded(scaler, optax.sgd(0.1))
  s_shared, s_owned, scale_state = (
    tx_shared.init(p),
    tx_owned.init(p),
    (shared.init()),
  )
  g = jnp.ones(2)
  # Traced only (eval_shape): the errors are raised while tracing.
  with pytest.raises(ValueError, match=r"has no scale of its own.*loss_scale="):
    jax.eval_shape(tx_shared.update, g, s_shared, p)
  with pytest.raises(ValueError, match=r"owns its scale, and was passed loss_"):
    jax.eval_shape(
      lambda g, s, p, l: tx_owned.update(g, s, p, loss_scale=l),
      g,
      s_owned,
      p,
      scale_state,
    )
  not_built = "not built with this shared scale"
  with pytest.raises(ValueError, match=not_built):  # an owned scale
    shared.update(scale_state, s_shared, s_owned)
  other = fs.shared_loss_scale(
    fs.torch_scaler(init_scale=8.0, growth_interval=7)
  )
  with pytest.raises(ValueError, match=not_built):  # another scaler
    other.update(scale_state, s_shared)
  with pytest.raises(ValueError, match="needs the optimizer states"):
    shared.update(scale_state)
  with pytest.raises(
    ValueError, match=r"shares its loss scale.*current_scale\(scale_state\)"
  ):
    fs.current_scale(s_shared)
  with pytest.raises(TypeError, match="takes a Scaler"):
    fs.shared_loss_scale(shared)
  # Under accumulate_gradients: refused by shared.update.
  acc = fs.accumulate_gradients(tx_shared, 2)
  with pytest.raises(ValueError, match="under accumulate_gradients is not"):
    shared.update(scale_state, acc.init(p))


# ------------------------------------- helpers on a shared chain's state
#
# A shared chain's optimizer state holds a copy of the scale its last step
# was made with, never the next one (current_scale refuses it for that
# reason). The host helpers below read or edit that copy as if it were the
# scale: each test accepts a refusal, or the behaviour the helper's
# docstring promises.


def _after_a_one_sided_overflow():
  """A shared torch scale at 8, one optimizer's step overflowed: the
  shared scale backed off to 4, the optimizer state still holds 8."""
  shared = fs.shared_loss_scale(fs.torch_scaler(init_scale=8.0))
  tx = _pair(shared)[1]
  p = jnp.ones(2)
  scale_state = shared.init()
  _, state = tx.update(
    jnp.array([8.0, jnp.inf]),
    tx.init(p),
    p,
    loss_scale=scale_state,
    value=jnp.float32(1.0),
  )
  scale_state = shared.update(scale_state, state)
  assert float(scale_state.loss_scale) == 4.0
  return shared, tx, p, state, scale_state


# A shared optimizer's state holds the scale of its last step; what needs
# the scale machine's state (the next scale, its counters) takes the shared
# state, and refuses the optimizer's, as current_scale does.


def test_overflow_report_of_a_shared_chain_takes_the_shared_state():
  _, _, _, state, scale_state = _after_a_one_sided_overflow()
  with pytest.raises(ValueError, match="shares its loss scale"):
    fs.overflow_report(state)
  report = fs.overflow_report(state, loss_scale=scale_state)
  assert report.step_overflowed and report.kind == "backward"
  assert (report.scale, report.next_scale) == (8.0, 4.0)
  assert "was not lowered" not in report.advice()
  owned = fs.skip_on_overflow(fs.fp16_loss_scale(fs.torch_scaler()))
  with pytest.raises(ValueError, match="loss_scale= is for a shared scale"):
    fs.overflow_report(owned.init(jnp.ones(2)), loss_scale=scale_state)


def test_torch_export_of_a_shared_scale_continues_as_the_run_would():
  shared, _, _, state, scale_state = _after_a_one_sided_overflow()
  with pytest.raises(ValueError, match="shares its loss scale"):
    fs.to_peer_state_dict(state, "torch", shared.scaler)
  sd = fs.to_peer_state_dict(scale_state, "torch", shared.scaler)
  assert sd["scale"] == 4.0 and sd["_growth_tracker"] == 0
  # And back: a torch GradScaler's state loads into a shared scale.
  sd["scale"], sd["_growth_tracker"] = 16.0, 3
  loaded = fs.load_scaler_state_dict(scale_state, sd, shared.scaler)
  assert float(loaded.loss_scale) == 16.0 and int(loaded.growth_tracker) == 3


def test_set_loss_scale_sets_the_shared_state_not_an_optimizers_copy():
  _, tx, p, state, scale_state = _after_a_one_sided_overflow()
  with pytest.raises(ValueError, match="shares its loss scale"):
    fs.set_loss_scale(state, 64.0)
  scale_state = fs.set_loss_scale(scale_state, 64.0)
  _, after = tx.update(jnp.ones(2), state, p, loss_scale=scale_state)
  assert float(after[0].prev_loss_scale) == 64.0


def test_a_shared_deepspeed_scale_at_its_floor_raises_where_deepspeed_does():
  shared = fs.shared_loss_scale(
    fs.deepspeed_scaler(init_scale=1.0, min_scale=1.0)
  )
  tx = _pair(shared)[1]
  p = jnp.ones(2)
  scale_state = shared.init()
  _, state = tx.update(
    jnp.array([1.0, jnp.inf]), tx.init(p), p, loss_scale=scale_state
  )
  scale_state = shared.update(scale_state, state)
  assert int(scale_state.min_scale_errors) == 1  # DeepSpeed raises here
  with pytest.raises(fs.MinLossScaleError, match="already at minimum"):
    fs.raise_if_min_scale_reached(scale_state)
  with pytest.raises(ValueError, match="shares its loss scale"):
    fs.raise_if_min_scale_reached(state)
