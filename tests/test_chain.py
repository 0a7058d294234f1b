"""fs.chain: the order checked at construction, each piece honest on its own,
a clip anywhere after the scale equal to optax's, no state search inside
``update``, and a checkpoint of the state ``skip_on_overflow`` made before
``fs.chain`` existed restored and continued bit for bit.

Expectations are independent of the code under test: optax's own
``clip_by_global_norm`` and ``adam`` on the true gradients, and a run
recorded by the code before ``fs.chain`` (tests/data).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import fp16_scaling as fs
from fp16_scaling import _lookup

DATA = pathlib.Path(__file__).parent / "data"
GRADS = jnp.array(
  [8.0, 16.0, -8.0, 4.0]
)  # made at scale 8: true [1, 2, -1, .5]
ALL = lambda p: jax.tree.map(lambda _: True, p)


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
    optax.masked(_scale(), ALL).init(jnp.zeros(4))


def test_accumulate_gradients_takes_an_fs_chain_only():
  bare = optax.chain(optax.sgd(1.0))
  with pytest.raises(TypeError, match=r"tx must be the step fs\.chain"):
    fs.accumulate_gradients(bare, 2)


# --------------------------------------------------------------------------
# A clip after the optimizer, under optax.masked: the wrong update.


def test_a_masked_clip_after_the_optimizer_clips_what_reaches_it():
  """The second clip clips Adam's output, as optax's clip would: before
  fs.chain this step returned the clipped raw gradients, uphill."""
  tail = lambda clip: (optax.adam(1e-3), optax.masked(clip, ALL))
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
    optax.masked(fs.clip_by_unscaled_norm(0.5), ALL),
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


# --------------------------------------------------------------------------
# A checkpoint of the state skip_on_overflow(optax.chain(...)) made.


# test_checkpoints' run: its params, and which steps overflow before and
# after the cut.
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
BEFORE = [False, False, False, True, False, False, False, True]
AFTER = [True, False, False, False, True, True] + [False] * 4


def test_a_skip_on_overflow_checkpoint_restores_into_fs_chain_bit_for_bit():
  """tests/data/skip_chain_orbax is orbax's checkpoint of the state of
  ``skip_on_overflow(optax.chain(fp16_loss_scale(deepspeed_scaler(
  init_scale=2**8, scale_window=2, delayed_shift=2), grad_range=True),
  clip_by_unscaled_norm(1.0), adamw(1e-2)))``, written by the code just
  before fs.chain, after test_checkpoints' BEFORE steps;
  skip_chain_after.npz holds params and state after its AFTER steps, run
  by that code. fs.chain of the same elements restores and continues to
  the same bits."""
  scaler = fs.deepspeed_scaler(
    init_scale=2.0**8, scale_window=2, delayed_shift=2
  )
  tx = fs.chain(
    fs.fp16_loss_scale(scaler, grad_range=True),
    fs.clip_by_unscaled_norm(1.0),
    optax.adamw(1e-2),
  )
  target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
  restored = ocp.StandardCheckpointer().restore(
    (DATA / "skip_chain_orbax").resolve(), target
  )
  assert jax.tree.structure(restored) == jax.tree.structure(target)

  @jax.jit
  def step(params, state, key, overflow):
    grads = jax.tree.map(
      lambda p, k: jax.random.normal(k, p.shape), params, {"w": key, "b": key}
    )
    grads["w"] = grads["w"].at[0, 0].set(jnp.where(overflow, jnp.inf, 0.5))
    scaled = jax.tree.map(lambda g: g * fs.current_scale(state), grads)
    updates, state = tx.update(scaled, state, params)
    return optax.apply_updates(params, updates), state

  params, state = restored["params"], restored["opt_state"]
  for i, flag in enumerate(AFTER):
    key = jax.random.PRNGKey(len(BEFORE) + i)
    params, state = step(params, state, key, jnp.bool_(flag))
  want = np.load(DATA / "skip_chain_after.npz")
  got = jax.tree.leaves({"params": params, "opt_state": state})
  assert len(got) == len(want.files)
  for i, x in enumerate(got):
    assert np.asarray(x).tobytes() == want[f"arr_{i}"].tobytes()
