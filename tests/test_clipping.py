"""clip_by_unscaled_norm: torch/DeepSpeed's clip formula, MoE norms, one
pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs


def _grads(seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return {
    "experts": {
      "w1": jnp.asarray(rng.normal(size=(4, 8, 3)) * scale, jnp.float32)
    },
    "shared": {
      "w": jnp.asarray(rng.normal(size=(8, 3)) * scale, jnp.float32),
      "b": jnp.asarray(rng.normal(size=(16,)) * scale, jnp.float32),
    },
  }


EXPERT_MASK = {"experts": {"w1": True}, "shared": {"w": False, "b": False}}


def _np_norm(leaves):
  return float(
    np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves))
  )


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_formula_matches_torch(max_norm):
  grads = _grads()
  tx = fs.clip_by_unscaled_norm(max_norm)
  updates, state = jax.jit(tx.update)(grads, tx.init(grads))
  norm = _np_norm(jax.tree.leaves(grads))
  # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped
  # at 1.0, multiplied in.
  coef = min(1.0, max_norm / (norm + 1e-6))
  assert float(state.grad_norm) == pytest.approx(norm, rel=1e-6)
  for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
    np.testing.assert_allclose(u, np.asarray(g) * coef, rtol=1e-6)


MASKS = {
  "full": EXPERT_MASK,
  "full callable": lambda g: {
    "experts": {"w1": True},
    "shared": {"w": False, "b": False},
  },
  # A prefix of the tree, as optax.masked takes: one bool per subtree.
  "prefix": {"experts": True, "shared": False},
  "prefix callable": lambda g: {"experts": True, "shared": False},
}


@pytest.fixture(scope="module")
def masked_updates():
  """``{mask: (updates, state)}``: each spelling's clip of the gradients
  below, all traced into one jit (a jit each compiled the same clip four
  times over)."""
  grads = _grads(1, scale=3.0)
  txs = {
    k: fs.clip_by_unscaled_norm(1.0, expert_mask=m) for k, m in MASKS.items()
  }

  @jax.jit
  def update_all(grads, states):
    return {k: tx.update(grads, states[k]) for k, tx in txs.items()}

  return update_all(grads, {k: tx.init(grads) for k, tx in txs.items()})


@pytest.mark.parametrize("mask", MASKS)
def test_expert_and_shared_norms_reported_apart_and_clipped_together(
  mask, masked_updates
):
  grads = _grads(1, scale=3.0)
  updates, state = masked_updates[mask]
  expert = _np_norm([grads["experts"]["w1"]])
  shared = _np_norm([grads["shared"]["w"], grads["shared"]["b"]])
  total = np.hypot(expert, shared)
  assert float(state.expert_grad_norm) == pytest.approx(expert, rel=1e-6)
  assert float(state.shared_grad_norm) == pytest.approx(shared, rel=1e-6)
  assert float(state.grad_norm) == pytest.approx(total, rel=1e-6)
  # DeepSpeed's unfused path would clip by the shared norm alone; the clipped
  # gradients here have total norm 1.
  assert _np_norm(jax.tree.leaves(updates)) == pytest.approx(1.0, rel=1e-5)


def test_expert_mask_over_a_list_of_leaves():
  grads = [jnp.full((2,), 3.0), jnp.full((3,), 4.0), jnp.full((1,), 12.0)]
  tx = fs.clip_by_unscaled_norm(1e9, expert_mask=[True, False, True])
  _, state = jax.jit(tx.update)(grads, tx.init(grads))
  assert float(state.expert_grad_norm) == pytest.approx(np.sqrt(18 + 144))
  assert float(state.shared_grad_norm) == pytest.approx(np.sqrt(48))


def test_inside_the_chain_norms_are_of_unscaled_gradients():
  true = _grads(2)
  tx = fs.chain(
    fs.fp16_loss_scale(fs.static_scaler(2.0**12)),
    fs.clip_by_unscaled_norm(0.1, expert_mask=EXPERT_MASK),
  )
  state = tx.init(true)
  scaled = jax.tree.map(lambda g: g * 2.0**12, true)
  updates, state = jax.jit(tx.update)(scaled, state)
  m = fs.scale_metrics(state)
  total = _np_norm(jax.tree.leaves(true))
  assert float(m["grad_norm"]) == pytest.approx(total, rel=1e-6)
  assert float(m["expert_grad_norm"]) == pytest.approx(
    _np_norm([true["experts"]["w1"]]), rel=1e-6
  )
  for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(true)):
    np.testing.assert_allclose(
      u, np.asarray(g) * 0.1 / (total + 1e-6), rtol=1e-6
    )


def test_bad_arguments():
  with pytest.raises(ValueError, match="max_norm"):
    fs.clip_by_unscaled_norm(0.0)
  with pytest.raises(ValueError, match="max_norm"):
    fs.clip_by_unscaled_norm(-1.0)
  with pytest.raises(ValueError, match="eps"):
    fs.clip_by_unscaled_norm(1.0, eps=-1.0)
  with pytest.raises(TypeError, match="expert_mask"):
    fs.clip_by_unscaled_norm(1.0, expert_mask={"a": 1})
  tx = fs.clip_by_unscaled_norm(1.0, expert_mask={"experts": True})
  with pytest.raises(ValueError, match="expert_mask.*prefix"):
    tx.init(_grads())
  # Deeper than the gradients: a bool where the gradients have a leaf holds
  # a subtree.
  tx = fs.clip_by_unscaled_norm(
    1.0,
    expert_mask={
      "experts": {"w1": {"a": True}},
      "shared": {"w": False, "b": False},
    },
  )
  with pytest.raises(ValueError, match="expert_mask"):
    tx.init(_grads())
  with pytest.raises(TypeError, match="floating point"):
    fs.clip_by_unscaled_norm(1.0).init({"w": jnp.zeros(3, jnp.int32)})


def test_stacked_expert_norms_past_the_float32_rescue_are_each_groups_own():
  """Stacked layers, an expert mask and a sum of squares past 2**96 (the
  norm's float32 rescue, which reads the gradients again): the expert and
  shared norms are those of their own leaves (float64 reference; the
  rescue rescales before squaring, a few float32 roundings: 2**-20)."""
  big = 2.0**49  # squares of 2**98: past the rescue's 2**96
  grads = {
    "blocks": {"W": jnp.arange(1.0, 13.0).reshape(3, 4) * big},
    "expert": jnp.array([3.0, 4.0]) * big,
    "shared": jnp.array([1.0, 2.0]) * big,
  }
  tx = fs.chain(
    fs.fp16_loss_scale(fs.no_scaler(), stacked_axes=fs.stacked_under("blocks")),
    fs.clip_by_unscaled_norm(
      1e30, expert_mask={"blocks": False, "expert": True, "shared": False}
    ),
  )
  _, state = jax.jit(tx.update)(grads, tx.init(grads))
  m = fs.scale_metrics(state)
  g = {
    "W": np.asarray(grads["blocks"]["W"], np.float64),
    "e": np.asarray(grads["expert"], np.float64),
    "s": np.asarray(grads["shared"], np.float64),
  }
  want_expert = np.linalg.norm(g["e"])
  want_shared = np.sqrt(np.sum(g["W"] ** 2) + np.sum(g["s"] ** 2))
  np.testing.assert_allclose(m["expert_grad_norm"], want_expert, rtol=2**-20)
  np.testing.assert_allclose(m["shared_grad_norm"], want_shared, rtol=2**-20)
  np.testing.assert_allclose(
    m["grad_norm"], np.hypot(want_expert, want_shared), rtol=2**-20
  )
