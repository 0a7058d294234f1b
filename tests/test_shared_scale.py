"""One loss scale for two optimizers (fs.sync_loss_scales), with
``torch.amp.GradScaler``'s semantics for several optimizers.

Each optimizer keeps, measures and skips on its own scale: a one-sided
overflow leaves that optimizer's parameters and inner state bit for bit and
lets the other step as plain optax would. ``sync_loss_scales`` at the end
of each step sets both to one scale, decided on the OR of their overflows:
checked against ``Scaler.update`` on that OR (the machine the presets' peer
tests check) for every preset over a long random sequence, and by hand for
torch's rule. tests/peers/test_torch_shared.py runs torch's own GradScaler
as the oracle. The last part takes each lifecycle mistake in turn: refused
(the message checked) or harmless (the trajectory checked).
"""

import helpers
from helpers import bits
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

O = True  # the step overflowed
C = False  # the step was clean


def _pair(scaler, opt0=None, opt1=None):
  """Two guarded chains built with ``scaler``: Adam and sgd with momentum,
  so that a skipped step has inner state to keep."""
  opt0 = opt0 or optax.adam(2.0**-6)
  opt1 = opt1 or optax.sgd(2.0**-3, momentum=0.5)
  return (
    fs.chain(fs.fp16_loss_scale(scaler), opt0),
    fs.chain(fs.fp16_loss_scale(scaler), opt1),
  )


def linear(p, v):
  """A loss whose gradient is ``v``."""
  return jnp.sum(p * v)


def _stepped(tx, p, grads=None, **extra):
  """``tx``'s state after one update from ``tx.init(p)`` on ``grads`` (ones
  by default)."""
  grads = jnp.ones_like(p) if grads is None else grads
  _, state = tx.update(grads, tx.init(p), p, **extra)
  return state


def _poison(g, bad, value=jnp.inf):
  return g.at[1].set(jnp.where(bad, value, g[1]))


# ------------------------------------- every preset against Scaler.update


def _same_bits(a, b):
  """Traced: whether two trees hold the same bits (-0.0 is not 0.0)."""

  def as_int(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.lax.bitcast_convert_type(x, jnp.int32)
    return x

  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  same = [jnp.all(as_int(x) == as_int(y)) for x, y in pairs]
  return jnp.all(jnp.stack(same))


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
    init_scale=2.0**10, growth_margin_bits=1.0, max_scale=2.0**20, history=1
  ),
  "headroom_window": fs.headroom_scaler(
    init_scale=2.0**10, growth_margin_bits=1.0, max_scale=2.0**20, history=4
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
    tx0, tx1 = _pair(scaler)
    p0 = jnp.zeros(4)
    p1 = jnp.ones(4)

    def body(carry, x):
      p0, p1, s0, s1, oracle = carry
      v0, v1, bad0, bad1 = x
      _, g0 = fs.value_and_grad(linear, s0)(p0, v0)
      _, g1 = fs.value_and_grad(linear, s1)(p1, v1)
      g0 = _poison(g0, bad0)
      g1 = _poison(g1, bad1, jnp.nan)
      u0, n0 = tx0.update(g0, s0, p0)
      u1, n1 = tx1.update(g1, s1, p1)
      n0, n1 = fs.sync_loss_scales(n0, n1)
      # The loss-scale pieces' states after the sync, and the new parameters.
      scale0 = n0[0]
      scale1 = n1[0]
      new_p0 = p0 + u0
      new_p1 = p1 + u1
      grad_max = jnp.maximum(jnp.max(jnp.abs(v0)), jnp.max(jnp.abs(v1)))
      oracle = scaler.update(oracle, bad0 | bad1, grad_max)
      out = dict(
        scale=scale0.scaler,
        same=_same_bits(scale0.scaler, scale1.scaler),
        oracle=oracle,
        overflow=(scale0.overflow, scale1.overflow),
        prev=(scale0.prev_loss_scale, scale1.prev_loss_scale),
        before=s0[0].scaler.loss_scale,
        kept=(
          _same_bits((new_p0, n0[1]), (p0, s0[1])),
          _same_bits((new_p1, n1[1]), (p1, s1[1])),
        ),
        skipped=(scale0.skipped_steps, scale1.skipped_steps),
      )
      return (new_p0, new_p1, n0, n1, oracle), out

    init = (p0, p1, tx0.init(p0), tx1.init(p1), scaler.init())
    _, per_step = jax.lax.scan(body, init, xs)
    return per_step

  @jax.jit
  def run_all(xs):
    return {name: run_one(s, xs) for name, s in PRESETS.items()}

  xs = tuple(map(jnp.asarray, (v0, v1, bad0, bad1)))
  runs = jax.tree.map(np.asarray, run_all(xs))
  return runs, (bad0, bad1)


def test_the_sequence_has_every_case():
  _, _, bad0, bad1 = _sequence()
  assert (bad0 & ~bad1).sum() >= 30
  assert (bad1 & ~bad0).sum() >= 30
  assert (bad0 & bad1).sum() >= 20
  assert (~bad0 & ~bad1).sum() >= 200


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shared_scale_is_scaler_update_on_the_or(name, preset_runs):
  runs, (bad0, bad1) = preset_runs
  out = runs[name]
  assert out["same"].all()  # both optimizers hold the one scale state
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
  after = out["scale"].loss_scale
  before = out["before"]
  grew = (after > before).sum()
  fell = (after < before).sum()
  if name == "static":
    assert grew == fell == 0
  else:
    assert grew >= 10, (grew, fell)
    assert fell >= 10, (grew, fell)
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
  real_loss = jnp.mean((_d(pd, real) - 1.0) ** 2)
  fake_loss = jnp.mean(_d(pd, fake) ** 2)
  return real_loss + fake_loss


def loss_g(pd, pg, z):
  fake = _g(pg, z)
  return jnp.mean((_d(pd, fake) - 1.0) ** 2)


PD = {"w": jnp.array([0.5, -0.25, 1.0]), "b": jnp.float32(0.1)}
PG = {"scale": jnp.array([1.0, 0.5, -0.5]), "shift": jnp.zeros(3)}


def _batches(n):
  rng = np.random.default_rng([helpers.SEED, 3])
  z = rng.standard_normal((n, 8, 3)).astype(np.float32)
  real = (rng.standard_normal((n, 8, 3)) * 0.5 + 1.0).astype(np.float32)
  return z, real


def _tree_poison(tree, bad):
  factor = jnp.where(bad, jnp.inf, 1.0)
  return jax.tree.map(lambda g: g * factor, tree)


def test_gan_order_against_plain_optax():
  """The discriminator steps, then the generator's loss is taken through
  the updated discriminator, then the scale steps once: each side's
  parameters are plain optax's on the true gradients taken in that order,
  over steps with overflows on either side and both."""
  scaler = fs.torch_scaler(init_scale=2.0**8, growth_interval=2)
  opt_d = optax.adam(2.0**-5)
  opt_g = optax.sgd(2.0**-4, momentum=0.5)
  tx_d, tx_g = _pair(scaler, opt_d, opt_g)

  @jax.jit
  def step(carry, x):
    pd, pg, sd, sg = carry
    z, real, bad_d, bad_g = x
    _, gd = fs.value_and_grad(loss_d, sd)(pd, pg, z, real)
    gd = _tree_poison(gd, bad_d)
    ud, sd = tx_d.update(gd, sd, pd)
    pd = optax.apply_updates(pd, ud)
    # sg still holds the step's scale (sd's may have moved already).
    _, gg = fs.value_and_grad(loss_g, sg, argnums=1)(pd, pg, z)
    gg = _tree_poison(gg, bad_g)
    ug, sg = tx_g.update(gg, sg, pg)
    pg = optax.apply_updates(pg, ug)
    sd, sg = fs.sync_loss_scales(sd, sg)
    return (pd, pg, sd, sg), (pd, pg, fs.current_scale(sg))

  @jax.jit
  def plain(carry, x):
    pd, pg, sd, sg, oracle = carry
    z, real, bad_d, bad_g = x
    gd = jax.grad(loss_d)(pd, pg, z, real)
    ud, new_sd = opt_d.update(gd, sd, pd)

    def keep(bad, old, new):
      return jax.tree.map(lambda a, b: jnp.where(bad, a, b), old, new)

    new_pd = optax.apply_updates(pd, ud)
    pd = keep(bad_d, pd, new_pd)
    sd = keep(bad_d, sd, new_sd)
    gg = jax.grad(loss_g, argnums=1)(pd, pg, z)
    ug, new_sg = opt_g.update(gg, sg, pg)
    new_pg = optax.apply_updates(pg, ug)
    pg = keep(bad_g, pg, new_pg)
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
  our_start = (PD, PG, tx_d.init(PD), tx_g.init(PG))
  _, (our_pd, our_pg, our_scale) = jax.lax.scan(step, our_start, xs)
  their_start = (PD, PG, opt_d.init(PD), opt_g.init(PG), scaler.init())
  _, (their_pd, their_pg, their_scale) = jax.lax.scan(plain, their_start, xs)
  np.testing.assert_array_equal(our_scale, their_scale)
  ours = jax.tree.leaves((our_pd, our_pg))
  theirs = jax.tree.leaves((their_pd, their_pg))
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # The scale halved on each of the 4 steps with an overflow (7: both).
  want = [256, 512, 256, 256, 128, 128, 256, 128, 128, 64, 64, 128]
  assert list(np.asarray(our_scale)) == want


def test_both_gradients_from_one_value_and_grad_call():
  """Two parameter sets in one loss (actor-critic): one call with
  ``argnums=(0, 1)`` gives both gradients; each goes to its optimizer as it
  is, and a one-sided overflow skips that side alone."""
  tx0, tx1 = _pair(fs.torch_scaler(init_scale=2.0**6))
  opt0 = optax.adam(2.0**-6)
  opt1 = optax.sgd(2.0**-3, momentum=0.5)

  def joint(pa, pb, x):
    a_fits_zero = jnp.mean((x @ pa) ** 2)
    b_fits_a = jnp.mean((x @ pb - x @ pa) ** 2)
    return a_fits_zero + b_fits_a

  @jax.jit
  def step(pa, pb, sa, sb, x, bad_a):
    value, (ga, gb) = fs.value_and_grad(joint, sa, argnums=(0, 1))(pa, pb, x)
    ga = _poison(ga, bad_a)
    ua, sa = tx0.update(ga, sa, pa)
    ub, sb = tx1.update(gb, sb, pb)
    sa, sb = fs.sync_loss_scales(sa, sb)
    return value, pa + ua, pb + ub, sa, sb

  x = jnp.array([[1.0, 2.0], [-0.5, 0.25], [0.75, -1.5]])
  pa = jnp.array([0.5, -1.0])
  pb = jnp.array([1.0, 0.25])
  sa = tx0.init(pa)
  sb = tx1.init(pb)
  # Plain optax on the true gradients, side a skipping its overflowed step.
  plain_pa = pa
  plain_pb = pb
  plain_sa = opt0.init(pa)
  plain_sb = opt1.init(pb)
  for bad_a in [False, True, False]:
    ga, gb = jax.grad(joint, argnums=(0, 1))(plain_pa, plain_pb, x)
    expected = float(joint(plain_pa, plain_pb, x))
    value, pa, pb, sa, sb = step(pa, pb, sa, sb, x, bad_a)
    assert float(value) == pytest.approx(expected, rel=1e-6)
    if not bad_a:
      ua, plain_sa = opt0.update(ga, plain_sa, plain_pa)
      plain_pa = plain_pa + ua
    ub, plain_sb = opt1.update(gb, plain_sb, plain_pb)
    plain_pb = plain_pb + ub
    np.testing.assert_allclose(pa, plain_pa, rtol=1e-6)
    np.testing.assert_allclose(pb, plain_pb, rtol=1e-6)
  assert float(fs.current_scale(sa)) == 2.0**5  # one back-off
  assert float(fs.current_scale(sb)) == 2.0**5


def test_the_whole_step_is_one_jitted_function():
  """Traceable: gradients, both updates, the shared update, a scale set
  from inside the step and the metrics are one jitted function, traced
  once whatever the flags and the scale."""
  scaler = fs.deepspeed_scaler(
    init_scale=2.0**4, scale_window=1, delayed_shift=2
  )
  tx0, tx1 = _pair(scaler)
  traces = []

  @jax.jit
  def step(p0, p1, s0, s1, v, bad0, bad1, reset):
    traces.append(1)

    def set_to_512(states):
      return tuple(fs.set_loss_scale(x, jnp.float32(2.0**9)) for x in states)

    s0, s1 = jax.lax.cond(reset, set_to_512, lambda s: s, (s0, s1))
    _, g0 = fs.value_and_grad(linear, s0)(p0, v)
    _, g1 = fs.value_and_grad(linear, s1)(p1, -v)
    g0 = _poison(g0, bad0)
    g1 = _poison(g1, bad1)
    u0, s0 = tx0.update(g0, s0, p0)
    u1, s1 = tx1.update(g1, s1, p1)
    s0, s1 = fs.sync_loss_scales(s0, s1)
    metrics = (fs.scale_metrics(s0), fs.scale_metrics(s1))
    return (p0 + u0, p1 + u1, s0, s1), metrics

  p0 = jnp.array([1.0, 2.0, 3.0])
  p1 = p0
  s0 = tx0.init(p0)
  s1 = tx1.init(p1)
  oracle = scaler.init()
  v = jnp.array([0.5, -1.0, 2.0])
  flags = [(C, C), (C, C), (O, C), (C, O), (O, O), (C, C), (C, C)]
  for i, (bad0, bad1) in enumerate(flags):
    reset = i == 5
    bad = (jnp.bool_(bad0), jnp.bool_(bad1))
    (p0, p1, s0, s1), metrics = step(p0, p1, s0, s1, v, *bad, reset)
    if reset:
      oracle = oracle._replace(loss_scale=jnp.float32(2.0**9))
    oracle = scaler.update(oracle, bad0 | bad1)
    assert bits(s0[0].scaler) == bits(oracle)
    assert bits(s1[0].scaler) == bits(oracle)
    for m, b in zip(metrics, (bad0, bad1)):
      assert float(m["loss_scale"]) == float(oracle.loss_scale)
      assert bool(m["overflow"]) == b
  assert len(traces) == 1
  # By hand (DeepSpeed: first growth one clean step late): 16, grown to 32
  # (hysteresis refilled), absorbed, backed off to 16, to 8 (both: once);
  # set to 512 and grown to 1024.
  assert float(fs.current_scale(s0)) == 2.0**10


# ------------------------------------------------------ lifecycle mistakes
#
# Each mistake a user can make with one scale for two optimizers, in turn:
# refused with a message that names the fix, or harmless, with the
# trajectory it gives checked.

TORCH = fs.torch_scaler(init_scale=2.0**10, growth_interval=2)
FLAGS = [(C, C), (O, C), (C, O), (C, C), (C, C), (O, O), (C, C), (C, O)]


def _run(flags, sync, tx=None):
  """The one-sided recipe over ``flags``; ``sync(s0, s1)`` ends each step
  (the mistakes replace it). Per step both optimizers' scale states and
  parameters."""
  tx0, tx1 = tx or _pair(TORCH)

  @jax.jit
  def step(p0, p1, s0, s1, v, bad0, bad1):
    _, g0 = fs.value_and_grad(linear, s0)(p0, v)
    _, g1 = fs.value_and_grad(linear, s1)(p1, -v)
    g0 = _poison(g0, bad0)
    g1 = _poison(g1, bad1)
    u0, s0 = tx0.update(g0, s0, p0)
    u1, s1 = tx1.update(g1, s1, p1)
    s0, s1 = sync(s0, s1)
    return p0 + u0, p1 + u1, s0, s1

  p0 = jnp.array([1.0, 2.0, 3.0])
  p1 = p0
  s0 = tx0.init(p0)
  s1 = tx1.init(p1)
  v = jnp.array([0.5, -1.0, 2.0])
  out = []
  for bad0, bad1 in flags:
    p0, p1, s0, s1 = step(p0, p1, s0, s1, v, bad0, bad1)
    after = (s0[0].scaler, s1[0].scaler, (p0, p1))
    out.append(jax.tree.map(np.asarray, after))
  return out


def _own_scales(out):
  """Checks that each optimizer's scale in ``out`` is Scaler.update's on
  that side's own flags; those scales."""
  own = []
  for i in range(2):
    state = TORCH.init()
    own_i = []
    for bad in FLAGS:
      state = TORCH.update(state, bad[i])
      own_i.append(float(state.loss_scale))
    assert [float(o[i].loss_scale) for o in out] == own_i
    own.append(own_i)
  return own


def test_sync_forgotten_leaves_independent_scales_that_train():
  """Harmless: each optimizer's scale follows its own overflows, as two
  owned scales do (torch refuses to step twice; here nothing freezes)."""
  out = _run(FLAGS, lambda s0, s1: (s0, s1))
  _own_scales(out)
  # Both trained: each moved on its clean steps, and only on them.
  for i in range(2):
    params = [bits(o[2][i]) for o in out]
    for t in range(1, len(FLAGS)):
      moved = params[t] != params[t - 1]
      assert moved == (not FLAGS[t][i]), (i, t)


def test_sync_called_twice_is_the_sync_once():
  """Harmless, so not refused: the second call on the first's results
  changes nothing (every state holds the one scale state already)."""
  once = _run(FLAGS, fs.sync_loss_scales)

  def sync_twice(s0, s1):
    return fs.sync_loss_scales(*fs.sync_loss_scales(s0, s1))

  assert bits(_run(FLAGS, sync_twice)) == bits(once)


def test_one_state_left_out_keeps_that_optimizers_own_scale():
  """Harmless: ``sync_loss_scales(s0)`` alone syncs nothing; model 1's
  scale still backs off for model 1's overflows (its own scale)."""

  def sync_the_first_alone(s0, s1):
    (s0,) = fs.sync_loss_scales(s0)
    return s0, s1

  out = _run(FLAGS, sync_the_first_alone)
  own = _own_scales(out)
  assert own[1][2] < own[1][1]  # backed off on model 1's overflow


def test_states_of_another_scaler_are_refused():
  """Refused (an owned scale refuses another scaler's state alike)."""
  tx0 = _pair(TORCH)[0]
  other = _pair(fs.torch_scaler(init_scale=2.0**10, growth_interval=7))[1]
  p = jnp.ones(3)
  with pytest.raises(
    ValueError,
    match=r"state 1 was built with another "
    r"Scaler.*growth_interval=7.*same Scaler",
  ):
    fs.sync_loss_scales(_stepped(tx0, p), _stepped(other, p))


def test_what_is_not_an_optimizer_state_is_refused():
  """Refused, naming what was passed: a Scaler's own state, the params,
  the optimizer itself, no state at all, an accumulating state."""
  tx0, tx1 = _pair(TORCH)
  p = jnp.ones(3)
  s0 = _stepped(tx0, p)  # stepped: may be synced
  wrong_states = [
    (TORCH.init(), "a ScalerState"),
    ({"w": p}, "a dict with keys"),
    (tx1, r"which is the optimizer \(tx\) itself"),
  ]
  for wrong, what in wrong_states:
    message = f"found in sync_loss_scales' optimizer state 1, {what}"
    with pytest.raises(ValueError, match=message):
      fs.sync_loss_scales(s0, wrong)
  with pytest.raises(ValueError, match="needs the optimizer states"):
    fs.sync_loss_scales()
  acc = fs.accumulate_gradients(tx1, 2)
  with pytest.raises(ValueError, match="under accumulate_gradients"):
    fs.sync_loss_scales(s0, acc.init(p))


def _after_a_one_sided_overflow():
  """Two optimizers at torch's scale 8, one overflowed, synced: both
  states hold the backed-off scale 4."""
  scaler = fs.torch_scaler(init_scale=8.0)
  tx0, tx1 = _pair(scaler)
  p = jnp.ones(2)
  s0 = _stepped(tx0, p)
  overflowed = jnp.array([8.0, jnp.inf])
  s1 = _stepped(tx1, p, overflowed, value=jnp.float32(1.0))
  return scaler, (tx0, tx1), p, fs.sync_loss_scales(s0, s1)


def _clean_step(txs, states, p):
  """Each optimizer's state after a clean step (gradients of ones) from its
  state in ``states``."""
  after = []
  for tx, state in zip(txs, states):
    _, stepped = tx.update(jnp.ones(2), state, p)
    after.append(stepped)
  return after


def _scales(states):
  """The current scale of each state in ``states``."""
  return [float(fs.current_scale(s)) for s in states]


def test_every_helper_works_on_every_optimizers_state():
  """No helper tells one optimizer's state from the other's but by what
  that optimizer measured itself."""
  scaler, _, _, states = _after_a_one_sided_overflow()
  for i, s in enumerate(states):
    assert float(fs.current_scale(s)) == 4.0
    m = fs.scale_metrics(s)
    assert float(m["loss_scale"]) == 4.0
    assert bool(m["overflow"]) == (i == 1)
    report = fs.overflow_report(s)
    assert report.scale == 8.0
    assert report.next_scale == 4.0
    assert report.kind == ("backward" if i else "none")
    d = fs.scaler_state_dict(s, scaler)
    assert d["loss_scale"] == 4.0
    assert d["growth_tracker"] == 0
    sd = fs.to_peer_state_dict(s, "torch", scaler)
    assert sd["scale"] == 4.0
    assert sd["_growth_tracker"] == 0
    fs.raise_if_min_scale_reached(s)  # not at a floor: no error
  assert fs.scaler_state_dict(states[0])["skipped_steps"] == 0
  assert fs.scaler_state_dict(states[1])["skipped_steps"] == 1


def test_a_loaded_or_set_scale_wins_the_sync():
  """A torch GradScaler state (or a scale set by hand) loaded into each
  optimizer's state is the scale both use next; loaded into one alone, the
  next sync keeps it for both (a set scale wins over the more cautious,
  lower, scale of the other), and once synced the marks are cleared."""
  scaler, txs, p, states = _after_a_one_sided_overflow()
  sd = fs.to_peer_state_dict(states[0], "torch", scaler)
  sd["scale"] = 16.0
  sd["_growth_tracker"] = 0
  loaded = [fs.load_scaler_state_dict(s, sd, scaler) for s in states]
  set_by_hand = [fs.set_loss_scale(s, 16.0) for s in states]
  for state in loaded + set_by_hand:
    assert bool(state[0].scale_set)
  for pair in (loaded, set_by_hand):
    after = _clean_step(txs, pair, p)
    assert [float(s[0].prev_loss_scale) for s in after] == [16.0, 16.0]
    assert _scales(fs.sync_loss_scales(*after)) == [16.0, 16.0]
  loaded_into_one = [loaded[0], states[1]]
  set_into_one = [states[0], set_by_hand[1]]
  for one in (loaded_into_one, set_into_one):
    after = _clean_step(txs, one, p)
    assert sorted(_scales(after)) == [4.0, 16.0]  # the other kept 4
    synced = fs.sync_loss_scales(*after)
    assert _scales(synced) == [16.0, 16.0]
    for state in synced:
      assert not bool(state[0].scale_set)
    # Synced, the marks are cleared: the next step syncs as any other.
    after = _clean_step(txs, synced, p)
    assert _scales(fs.sync_loss_scales(*after)) == [16.0, 16.0]


def test_a_checkpointed_scale_set_into_one_of_two_states_is_not_undone():
  """2^24 set (from a checkpoint) into one of two states at 2^20 used to
  end at 2^20 in both after the sync (the more cautious); now the set
  scale wins: both step on at 2^24, the same eager and under jit. Among
  several set scales, the usual rule picks (an overflowed one, else the
  lowest)."""
  scaler = fs.torch_scaler(init_scale=2.0**20)
  txs = _pair(scaler)
  p = jnp.ones(2)
  states = [tx.init(p) for tx in txs]

  def step(s0, s1):
    s0 = fs.set_loss_scale(s0, jnp.float32(2.0**24))
    return fs.sync_loss_scales(*_clean_step(txs, (s0, s1), p))

  for run in (step, jax.jit(step)):
    assert _scales(run(*states)) == [2.0**24, 2.0**24]
  both = [
    fs.set_loss_scale(states[0], 2.0**24),
    fs.set_loss_scale(states[1], 2.0**22),
  ]
  synced = fs.sync_loss_scales(*_clean_step(txs, both, p))
  assert _scales(synced) == [2.0**22, 2.0**22]


def test_unequal_states_take_an_overflowed_one_then_the_lowest():
  """From unequal states (a sync left out): an optimizer that overflowed
  sets the scale (the lowest of those), else the lowest scale of all; the
  first of equals. Batched states choose per member."""
  scaler = fs.torch_scaler(init_scale=8.0)
  tx = _pair(scaler)[0]
  p = jnp.ones(2)

  def at(scale, overflow):
    s = fs.set_loss_scale(tx.init(p), scale)
    g = jnp.array([1.0, jnp.where(overflow, jnp.inf, 1.0)])
    _, stepped = tx.update(g, s, p)
    return stepped

  def synced(*states):
    first, *_ = fs.sync_loss_scales(*states)
    return float(fs.current_scale(first))

  assert synced(at(64.0, False), at(16.0, False), at(32.0, False)) == 16.0
  assert synced(at(64.0, True), at(16.0, False), at(32.0, True)) == 16.0
  assert synced(at(64.0, False), at(16.0, True)) == 8.0
  assert synced(at(16.0, False), at(64.0, True)) == 32.0
  batched = jax.vmap(at)
  a = batched(jnp.array([64.0, 16.0]), jnp.array([False, True]))
  b = batched(jnp.array([32.0, 32.0]), jnp.array([True, False]))
  synced_a, _ = fs.sync_loss_scales(a, b)
  scales = synced_a[0].scaler.loss_scale
  np.testing.assert_array_equal(scales, [16.0, 8.0])


def test_a_synced_deepspeed_scale_at_its_floor_raises_on_every_state():
  """DeepSpeed raises when any optimizer's overflow hits the floor of the
  one scale: after the sync every optimizer's state says so."""
  scaler = fs.deepspeed_scaler(init_scale=1.0, min_scale=1.0)
  tx0, tx1 = _pair(scaler)
  p = jnp.ones(2)
  s0 = _stepped(tx0, p)
  s1 = _stepped(tx1, p, jnp.array([1.0, jnp.inf]))
  fs.raise_if_min_scale_reached(s0)  # before the sync: its own, clean
  for s in fs.sync_loss_scales(s0, s1):
    assert int(s[0].scaler.min_scale_errors) == 1
    with pytest.raises(fs.MinLossScaleError, match="already at minimum"):
      fs.raise_if_min_scale_reached(s)
