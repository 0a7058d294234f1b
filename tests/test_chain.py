"""fs.chain: the order checked at construction, each piece honest on its own,
a clip anywhere after the scale equal to optax's, no state search inside
``update``, and a checkpoint of the state ``skip_on_overflow`` made before
``fs.chain`` existed restored and continued bit for bit.

Expectations are independent of the code under test: optax's own
``clip_by_global_norm`` and ``adam`` on the true gradients, and a run
recorded by the code before ``fs.chain`` (tests/data).
"""

import functools
import pathlib

from helpers import SQRT_ULPS
from helpers import U16
from helpers import U32
from helpers import bits
from helpers import first_order_bound
from helpers import float_sites
from helpers import gamma
from helpers import is_float
from helpers import on_cpu
from helpers import times
from helpers import times_floats
import jax
import jax.numpy as jnp
from jax.tree_util import tree_flatten_with_path as flatten_with_path
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import fp16_scaling as fs
from fp16_scaling import _lookup
from fp16_scaling import _loss_scale

DATA = pathlib.Path(__file__).parent / "data"
# Made at scale 8: true [1, 2, -1, .5].
GRADS = jnp.array([8.0, 16.0, -8.0, 4.0])


def every_leaf(params):
  """An optax.masked mask that selects every leaf of ``params``."""
  return jax.tree.map(lambda _: True, params)


def _step(tx, grads=GRADS, params=None):
  params = jnp.zeros(4) if params is None else params
  state = tx.init(params)
  return jax.jit(tx.update)(grads, state, params)


def _scale():
  return fs.fp16_loss_scale(fs.static_scaler(8.0))


# --------------------------------------------------------------------------
# The order, checked at construction from the arguments.


@pytest.mark.parametrize(
  "args, match",
  [
    ((), "first element must be fs.fp16_loss_scale"),
    ((optax.adam(1e-3),), "first element must be fs.fp16_loss_scale"),
    (
      (fs.clip_by_unscaled_norm(1.0), _scale()),
      "first element must be fs.fp16_loss_scale",
    ),
    ((_scale(), optax.sgd(1.0), _scale()), "element 2 is an fp16_loss_scale"),
    (
      (_scale(), fs.chain(_scale(), optax.sgd(1.0))),
      "element 1 is an fs.chain",
    ),
    (
      (_scale(), fs.accumulate_gradients(fs.chain(_scale()), 2)),
      "element 1 is an fs.accumulate_gradients",
    ),
    (
      (_scale(), fs.clip_by_unscaled_norm(1.0, partition_specs={"w": None})),
      "Pass partition_specs to fs.fp16_loss_scale only",
    ),
  ],
)
def test_a_wrong_order_is_refused_at_construction(args, match):
  with pytest.raises(ValueError, match=match) as e:
    fs.chain(*args)
  assert "fs." in str(e.value)  # each message names the call to write


def test_an_element_that_is_not_a_transformation_is_refused():
  with pytest.raises(TypeError, match="element 1 is a float, not an optax"):
    fs.chain(_scale(), 1.0)


def test_fp16_loss_scale_outside_fs_chain_is_refused_at_init():
  for tx in (_scale(), optax.chain(_scale(), optax.adam(1e-3))):
    with pytest.raises(RuntimeError, match=r"Write fs\.chain\(fs\.fp16_los"):
      tx.init(jnp.zeros(4))
  # Under optax.masked too: nothing there would skip the optimizer.
  with pytest.raises(RuntimeError, match="first element of fs.chain"):
    optax.masked(_scale(), every_leaf).init(jnp.zeros(4))


def test_accumulate_gradients_takes_an_fs_chain_only():
  bare = optax.chain(optax.sgd(1.0))
  with pytest.raises(TypeError, match=r"tx must be the step fs\.chain"):
    fs.accumulate_gradients(bare, 2)


# --------------------------------------------------------------------------
# A clip after the optimizer, under optax.masked: the wrong update.


def test_a_masked_clip_after_the_optimizer_clips_what_reaches_it():
  """The second clip clips Adam's output, as optax's clip would: before
  fs.chain this step returned the clipped raw gradients, uphill."""

  def tail(clip):
    return optax.adam(1e-3), optax.masked(clip, every_leaf)

  head = (_scale(), fs.clip_by_unscaled_norm(1.0))
  ours, _ = _step(fs.chain(*head, *tail(fs.clip_by_unscaled_norm(0.5))))
  theirs, _ = _step(fs.chain(*head, *tail(optax.clip_by_global_norm(0.5))))
  # Adam's first step is -lr * sign(g), but for float32's 1 - 0.999 in its
  # bias correction (relative error up to 2**-24 / 0.001, 6e-5); the clip
  # lets it by.
  np.testing.assert_array_equal(ours, theirs)
  np.testing.assert_allclose(ours, -1e-3 * np.sign(GRADS), rtol=1e-4)


def test_a_partially_masked_clip_right_after_the_scale_is_optax_clip():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  grads = {"a": jnp.array([24.0, 32.0]), "b": jnp.array([8.0, -8.0])}
  mask = {"a": True, "b": False}

  def run(clip):
    tx = fs.chain(_scale(), optax.masked(clip, mask), optax.sgd(1.0))
    return _step(tx, grads, params)[0]

  ours, theirs = (
    run(fs.clip_by_unscaled_norm(1.0)),
    run(optax.clip_by_global_norm(1.0)),
  )
  # "a" is [3, 4] unscaled (norm 5) clipped to norm 1; "b" passes unclipped.
  np.testing.assert_allclose(ours["a"], [-0.6, -0.8], rtol=1e-6)
  np.testing.assert_array_equal(ours["b"], [-1.0, 1.0])
  for k in params:
    np.testing.assert_allclose(ours[k], theirs[k], rtol=2**-22)


def test_the_clip_alone_is_optax_clip_by_global_norm():
  """Outside fs.chain it measures its input; no expert mask: optax's clip
  (one float32 sum of squares in another order: a few ulps)."""
  key = jax.random.PRNGKey(0)
  grads = {"w": jax.random.normal(key, (5, 3)) * 3, "b": jnp.arange(3.0)}
  for max_norm in (0.5, 100.0):
    ours = fs.clip_by_unscaled_norm(max_norm)
    theirs = optax.clip_by_global_norm(max_norm)
    a, _ = ours.update(grads, ours.init(grads))
    b, _ = theirs.update(grads, theirs.init(grads))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(x, y, rtol=2**-20)
  labels = {"w": "clip", "b": "sgd"}
  multi = optax.multi_transform(
    {"clip": fs.clip_by_unscaled_norm(0.5), "sgd": optax.sgd(1.0)}, labels
  )
  out, _ = multi.update(grads, multi.init(grads))
  # Only "w" is the clip's: its own norm n clipped to 0.5 * n / (n + eps).
  n = np.linalg.norm(np.asarray(grads["w"], np.float64))
  got = np.linalg.norm(np.asarray(out["w"], np.float64))
  np.testing.assert_allclose(got, 0.5 * n / (n + 1e-6), rtol=2**-20)


# --------------------------------------------------------------------------
# The state is optax.chain's layout, and update searches nothing in it.


def test_the_clip_under_with_extra_args_support_keeps_its_configuration():
  """optax.with_extra_args_support returns the clip as it is (it takes extra
  arguments already): right after the scale it still clips by the true
  norm, 5 for GRADS over 8 doubled, to 1, and records that norm."""
  clip = fs.clip_by_unscaled_norm(1.0)
  wrapped = optax.with_extra_args_support(clip)
  assert wrapped is clip
  grads = GRADS * 2.0  # true [2, 4, -2, 1], norm 5
  ours, state = _step(fs.chain(_scale(), wrapped, optax.sgd(1.0)), grads)
  np.testing.assert_allclose(ours, -np.array([2, 4, -2, 1]) / 5, rtol=1e-6)
  assert float(state[1].grad_norm) == 5.0
  # Extra arguments reach it, and it ignores them, alone as in the chain.
  alone, _ = clip.update(grads, clip.init(grads), value=jnp.float32(1.0))
  np.testing.assert_allclose(alone, grads * (1.0 / (40.0 + 1e-6)), rtol=1e-6)


def test_the_state_is_a_tuple_of_the_elements_states():
  tx = fs.chain(_scale(), fs.clip_by_unscaled_norm(1.0), optax.adam(1e-3))
  state = tx.init(jnp.zeros(4))
  assert type(state) is tuple and len(state) == 3
  assert isinstance(state[0], fs.LossScaleState)
  assert isinstance(state[1], fs.ClipState)
  adam = optax.adam(1e-3).init(jnp.zeros(4))
  assert jax.tree.structure(state[2]) == jax.tree.structure(adam)


def test_update_walks_no_state_tree(monkeypatch):
  """Every search of a state goes through optax.tree_utils'
  tree_get_all_with_path (``_lookup.all_with_path``): update never calls
  it, traced or eager, with accumulation and a masked clip too."""
  tx = fs.chain(
    _scale(),
    fs.clip_by_unscaled_norm(1.0),
    optax.adam(1e-3),
    optax.masked(fs.clip_by_unscaled_norm(0.5), every_leaf),
  )
  txs = (tx, fs.accumulate_gradients(tx, 2))
  states = [t.init(jnp.zeros(4)) for t in txs]

  def refuse(*args, **kwargs):
    raise AssertionError("a state was searched inside update")

  monkeypatch.setattr(_lookup, "all_with_path", refuse)
  monkeypatch.setattr(optax.tree_utils, "tree_get_all_with_path", refuse)
  for t, state in zip(txs, states):
    for update in (t.update, jax.jit(t.update)):
      update(GRADS, state, jnp.zeros(4))


def test_update_compares_the_record_in_the_treedef_and_never_retraces():
  """The update compares the state's record (its treedef's ``Built``) with
  its own configuration on every call, eager or traced: a chain's own
  states hold its own record object (nothing compared field by field), a
  chain of an equal configuration (another initial scale) has an equal
  record, one treedef, and reuses the trace; the jitted update traces
  once over many steps."""
  tx = fs.chain(_scale(), optax.sgd(1.0))
  other = fs.chain(fs.fp16_loss_scale(fs.static_scaler(2.0)), optax.sgd(1.0))
  state = tx.init(jnp.zeros(4))
  assert state[0].leaf_paths.built is tx.config.scale.built
  assert other.config.scale.built == tx.config.scale.built
  traces = []

  @jax.jit
  def step(state):
    traces.append(1)
    return tx.update(GRADS, state, jnp.zeros(4))[1]

  for _ in range(3):
    state = step(state)
  state = step(other.init(jnp.zeros(4)))
  assert len(traces) == 1
  assert _loss_scale.check_state(tx.config.scale, state[0]) is None


def test_the_plan_is_resolved_by_init_and_the_clip_groups_join_it(
  monkeypatch,
):
  """The measurement's plan (each leaf's spec and the stacked layout) is
  resolved once, by ``tx.init``, into the state's treedef: no update
  resolves it again, eager or traced, accumulated or not (two dtypes: two
  traces). The clip's groups come from the chain's own expert mask where
  it runs: a state given to a chain that differs only in its mask is its
  own (one treedef), and each chain's norms follow its own groups (the
  true gradients are ones: 12 expert elements, 2 shared)."""
  from jax.sharding import PartitionSpec as P

  from fp16_scaling import _measure

  params = {"layers": {"w": jnp.zeros((3, 2, 2))}, "head": jnp.zeros(2)}

  def tx(expert):
    scale = fs.fp16_loss_scale(
      fs.static_scaler(8.0),
      partition_specs={"layers": P(), "head": P()},
      stacked_axes=fs.stacked_under("layers"),
    )
    mask = {"layers": expert, "head": not expert}
    clip = fs.clip_by_unscaled_norm(1e9, expert_mask=mask)
    return fs.chain(scale, clip, optax.sgd(1.0))

  calls = []
  plan_of = _measure.plan_of

  def counted(*args, **kwargs):
    calls.append(args)
    return plan_of(*args, **kwargs)

  monkeypatch.setattr(_measure, "plan_of", counted)
  experts, shared = tx(True), tx(False)
  txs = (
    experts,
    fs.accumulate_gradients(
      experts, 2, on_microbatch_overflow="drop_microbatch"
    ),
  )
  states = [t.init(params) for t in txs]
  assert len(calls) == 2  # one per tx.init
  plan = states[0][0].leaf_paths.plan
  assert plan == experts.config.scale.plan(params) and hash(plan)
  assert plan.groups is None and plan.layer_axes == (None, 0)
  del calls[:]
  for dtype in (jnp.float32, jnp.float16):
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 8, dtype), params)
    for t, state in zip(txs, states):
      for update in (t.update, jax.jit(t.update)):
        update(grads, state, params)
  assert not calls
  # Sums of squares of 8s are exact, the scale a power of two: each norm
  # rounds once, at its root (1 ulp, 2**-23 relative).
  for t, norms in ((experts, (12, 2)), (shared, (2, 12))):
    clip = jax.jit(t.update)(grads, states[0], params)[1][1]
    got = [clip.expert_grad_norm, clip.shared_grad_norm]
    np.testing.assert_allclose(got, np.sqrt(norms), rtol=2**-23)


# --------------------------------------------------------------------------
# A checkpoint of the state skip_on_overflow(optax.chain(...)) made.


# test_checkpoints' run: its params, and which steps overflow before and
# after the cut.
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
BEFORE = [False, False, False, True, False, False, False, True]
AFTER = [True, False, False, False, True, True] + [False] * 4


def _after_grads(key, params):
  return jax.tree.map(
    lambda p, k: jax.random.normal(k, p.shape), params, {"w": key, "b": key}
  )


# How far a float leaf of the continued run may be from the recording, on
# another backend than XLA:CPU's (two programs, n = 9 gradient elements):
# - the gradients: jax.random.normal's bits come from integer arithmetic,
#   but its inverse error function is a float32 polynomial with a log and a
#   square root, which FMA contraction and XLA:GPU's approximations round
#   differently: 16 roundings of u in each program;
# - the clip's factor (the same formula on both): a sum of 9 squares in its
#   own order (gamma_8, halved by the square root), the square root
#   (SQRT_ULPS ulp) and a division, in each program;
# - adamw's values (each state leaf, the update) and apply_updates' sum: 16
#   roundings of u each, in each program.
# Propagated through adamw's derivatives (helpers.first_order_bound), with
# 2 u of the values for the terms in u**2. The bookkeeping's float leaves
# (the norms, each leaf's peak and fraction of zeros) are a sum of squares
# and a square root, or a max or a count, of those gradients: relative
# _BOOK_REL. The loss scale and every integer and bool leaf: bit for bit.
_AFTER_N = 9
_GRAD_REL = 2 * 16 * U32
_CLIP_REL = 2 * (gamma(_AFTER_N - 1) / 2 + (2 * SQRT_ULPS + 1) * U32)
_STEP_REL = 2 * 16 * U32
_BOOK_REL = _GRAD_REL + _CLIP_REL


def _adamw_from(params, adam_state, grads, sites):
  """optax's clip and adamw(1e-2) from ``params`` and ``adam_state`` over
  the clean steps' ``grads``, each value at a site of ``sites`` multiplied
  by ``1 + `` its perturbation: ``(params, adamw's state)``."""
  clip, opt = optax.clip_by_global_norm(1.0), optax.adamw(1e-2)
  state = adam_state
  for g, e in zip(grads, sites):
    g, _ = clip.update(times(g, e["grads"]), clip.init(params))
    state = times_floats(state, e["state"])
    updates, state = opt.update(times(g, e["clipped"]), state, params)
    params = times(params, e["params"])
    params = optax.apply_updates(params, times(updates, e["update"]))
  return params, state


def _after_bound(params, adam_state):
  """The first-order bound on ``(params, adamw's state)`` after the AFTER
  steps, between two backends (the list above)."""
  clean = [i for i, flag in enumerate(AFTER) if not flag]
  grads = [
    _after_grads(jax.random.PRNGKey(len(BEFORE) + i), params) for i in clean
  ]
  zeros = jax.tree.map(jnp.zeros_like, params)
  site = dict(
    grads=zeros,
    clipped=zeros,
    state=float_sites(adam_state),
    params=zeros,
    update=zeros,
  )
  rel = dict(
    grads=jax.tree.map(lambda _: _GRAD_REL, zeros),
    clipped=jax.tree.map(lambda _: _CLIP_REL, zeros),
    state=[_STEP_REL] * len(site["state"]),
    params=jax.tree.map(lambda _: _STEP_REL, zeros),
    update=jax.tree.map(lambda _: _STEP_REL, zeros),
  )
  run = functools.partial(_adamw_from, params, adam_state, grads)
  return first_order_bound(run, [site] * len(clean), [rel] * len(clean))


def test_a_skip_on_overflow_checkpoint_restores_into_fs_chain_bit_for_bit():
  """tests/data/skip_chain_orbax is orbax's checkpoint of the state of
  ``skip_on_overflow(optax.chain(fp16_loss_scale(deepspeed_scaler(
  init_scale=2**8, scale_window=2, delayed_shift=2), grad_range=True),
  clip_by_unscaled_norm(1.0), adamw(1e-2)))``, written by the code just
  before fs.chain, after test_checkpoints' BEFORE steps;
  skip_chain_after.npz holds params and state after its AFTER steps, run
  by that code. Both were recorded on XLA:CPU.

  fs.chain of the same elements restores and continues to the same bits on
  XLA:CPU. On any backend: the same skips and loss scales, and every
  integer and bool leaf, bit for bit; each float leaf within the bound
  derived above (_after_bound, _BOOK_REL; an H200 was 1 ulp off on some
  params), a bound below float16's rounding of the values.

  The checkpoint predates the state's ``scale_set`` field: orbax's plain
  restore refuses it ("Target: MISSING"), and CHANGELOG.md's one-line
  migration (orbax's restore with ``transforms={}``) takes that field,
  absent from the checkpoint, from the target."""
  scaler = fs.deepspeed_scaler(
    init_scale=2.0**8, scale_window=2, delayed_shift=2
  )
  tx = fs.chain(
    fs.fp16_loss_scale(scaler, grad_range=True),
    fs.clip_by_unscaled_norm(1.0),
    optax.adamw(1e-2),
  )
  target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
  path = (DATA / "skip_chain_orbax").resolve()
  with pytest.raises(ValueError, match=r"scale_set:[\s\S]*Target: MISSING"):
    ocp.StandardCheckpointer().restore(path, target)
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  restored = ocp.PyTreeCheckpointer().restore(
    path,
    args=ocp.args.PyTreeRestore(
      target, restore_args=restore_args, transforms={}
    ),
  )
  assert jax.tree.structure(restored) == jax.tree.structure(target)
  assert not bool(restored["opt_state"][0].scale_set)

  @jax.jit
  def step(params, state, key, overflow):
    grads = _after_grads(key, params)
    grads["w"] = grads["w"].at[0, 0].set(jnp.where(overflow, jnp.inf, 0.5))
    scaled = jax.tree.map(lambda g: g * fs.current_scale(state), grads)
    updates, state = tx.update(scaled, state, params)
    return optax.apply_updates(params, updates), state

  params, state = restored["params"], restored["opt_state"]
  for i, flag in enumerate(AFTER):
    key = jax.random.PRNGKey(len(BEFORE) + i)
    params, state = step(params, state, key, jnp.bool_(flag))
  want = np.load(DATA / "skip_chain_after.npz")
  assert not bool(state[0].scale_set)  # recorded before the field existed
  got = {"params": params, "opt_state": (state[0]._replace(scale_set=None),)}
  got["opt_state"] += tuple(state[1:])
  paths = [jax.tree_util.keystr(p) for p, _ in flatten_with_path(got)[0]]
  assert len(paths) == len(want.files)
  want = [want[f"arr_{i}"] for i in range(len(paths))]
  if on_cpu():
    assert bits(got) == [x.tobytes() for x in want]
  restored_params, restored_state = restored["params"], restored["opt_state"]
  bound = _after_bound(restored_params, restored_state[2])
  bound = {"params": bound[0], "opt_state": (None, None, bound[1])}
  bounds = {jax.tree_util.keystr(p): b for p, b in flatten_with_path(bound)[0]}
  assert len(bounds) == 7 and set(bounds) < set(paths)
  for path, x, w in zip(paths, jax.tree.leaves(got), want):
    x, w = np.asarray(x), np.asarray(w)
    assert x.dtype == w.dtype and x.shape == w.shape, path
    if not is_float(w) or "loss_scale" in path:
      assert x.tobytes() == w.tobytes(), path
      continue
    w64 = np.abs(w.astype(np.float64))
    if path in bounds:
      limit = bounds[path] + 2 * U32 * w64
    else:
      limit = _BOOK_REL * w64
    assert np.all(np.abs(x.astype(np.float64) - w) <= limit), path
    # Tight enough to matter: under float16's rounding, above float32's.
    spacing = np.spacing(np.abs(w)).astype(np.float64)
    assert np.all(limit < U16 * np.maximum(w64, spacing)), path
    assert np.all((limit >= spacing) | (w == 0)), path
