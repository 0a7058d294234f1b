"""The MoE-aware norm against DeepSpeed's, with expert parameter groups (one
rank).

``oracles.ds_moe_norm`` runs the norm ``FP16_Optimizer.step`` (0.19) computes
when a parameter group is an expert group: the shared gradients' norm from
``get_flattened_grad_norm``, the expert gradients' from
``get_norm_with_moe_layers``, combined. ``clip_by_unscaled_norm(...,
expert_mask=...)`` must report the same global norm, expert and shared leaves
together; its expert part alone equals DeepSpeed's norm of the expert gradients
alone.

Tolerance: both sides sum float32 squares, in different orders and groupings
(torch's vectorised per-tensor reductions, then DeepSpeed combines the group
norms through float32 tensors and Python floats; XLA sums each leaf, then the
leaves). The bound of any order: a sum of N float32 squares, each square
rounded once, is within N * 2**-24 of the exact sum, relative (first order:
each of the N - 1 additions rounds a partial sum no larger than the total,
and the terms are positive); the square root halves that and rounds once,
and combining the expert and shared parts (their squares, a sum, a root)
adds 4 roundings. So each side is within (N / 2 + 5) * 2**-24 of the exact
norm, and the two within (N + 10) * 2**-24, N the elements of the largest
structure (513): 3.1e-5, NORM_RTOL. Measured differences are ~2e-7; a wrong
grouping or a norm of the scaled gradients is off by far more.
"""

import functools

from helpers import SEED
from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

import fp16_scaling as fs

oracles.require("torch")
oracles.init_deepspeed()

# the static loss scale of the chained run: the float16 casts stay finite
SCALE = 2.0**10
# (expert leaf shapes, shared leaf shapes): a few leaves each, up to a few
# hundred elements.
STRUCTURES = [
  ([(8, 16), (16,), (3, 5, 7)], [(32, 8), (8,)]),
  ([(64,)], [(5, 5), (11,), (2, 3, 4), (1,)]),
]
# The bound above, for the largest structure (513 elements): 3.1e-5.
NORM_RTOL = (
  max(sum(int(np.prod(s)) for s in e + sh) for e, sh in STRUCTURES) + 10
) * 2.0**-24
DRAWS = 4  # gradient sets per structure (one compile per structure)
SETS = [(s, d) for s in range(len(STRUCTURES)) for d in range(DRAWS)]


def _gradient_set(structure, rng):
  """Random expert and shared leaves, magnitudes from 1e-4 to 10; the two
  groups within a decade
  of each other, so that leaving either out of the norm would show."""
  expert_shapes, shared_shapes = STRUCTURES[structure]
  e = rng.uniform(-4, 1)
  m_expert = 10**e
  m_shared = 10 ** rng.uniform(max(-4, e - 1), min(1, e + 1))
  expert = [
    (rng.standard_normal(s) * m_expert).astype(np.float32)
    for s in expert_shapes
  ]
  shared = [
    (rng.standard_normal(s) * m_shared).astype(np.float32)
    for s in shared_shapes
  ]
  return expert, shared


def _mask(structure):
  expert, shared = STRUCTURES[structure]
  return {"experts": [True] * len(expert), "shared": [False] * len(shared)}


def _tree(expert, shared):
  return {
    "experts": [jnp.asarray(g) for g in expert],
    "shared": [jnp.asarray(g) for g in shared],
  }


@functools.cache
def _clip_alone_fn(structure):
  clip = fs.clip_by_unscaled_norm(1.0, expert_mask=_mask(structure))
  return jax.jit(lambda grads: clip.update(grads, clip.init(grads))[1])


@functools.cache
def _chained_fn(structure):
  clip = fs.clip_by_unscaled_norm(1.0, expert_mask=_mask(structure))
  tx = guarded(fs.static_scaler(SCALE), clip)

  def run(grads):
    params = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), grads)
    _, state = tx.update(grads, tx.init(params), params)
    return fs.scale_metrics(state)

  return jax.jit(run)


def _clip_alone(structure, expert, shared):
  """ClipState of clip_by_unscaled_norm on its own, on float32 gradients."""
  return jax.device_get(_clip_alone_fn(structure)(_tree(expert, shared)))


def _chained(structure, expert16, shared16):
  """scale_metrics of the usual chain, fed float16 gradients made at the static
  scale SCALE.
  """
  return jax.device_get(_chained_fn(structure)(_tree(expert16, shared16)))


@pytest.mark.parametrize("structure,draw", SETS)
def test_norm_with_expert_groups_matches_deepspeed(structure, draw):
  rng = np.random.default_rng([SEED, structure, draw])
  expert, shared = _gradient_set(structure, rng)
  state = _clip_alone(structure, expert, shared)
  expert_only = oracles.ds_moe_norm(expert, [])
  both = oracles.ds_moe_norm(expert, shared)
  # Both groups count: leaving either out would move the norm by far more than
  # NORM_RTOL.
  assert 0.02 < expert_only / both < 1 - 1e-4
  np.testing.assert_allclose(float(state.grad_norm), both, rtol=NORM_RTOL)
  np.testing.assert_allclose(
    float(state.expert_grad_norm), expert_only, rtol=NORM_RTOL
  )


@pytest.mark.parametrize("structure,draw", SETS)
def test_chained_norm_with_expert_groups_matches_deepspeed(structure, draw):
  # As in training: float16 gradients at a loss scale. DeepSpeed takes the norm
  # of the scaled gradients (upcast to float32) and divides by the scale; the
  # scale is a power of two, so the division is exact and the comparison is that
  # of the norms.
  rng = np.random.default_rng([SEED, structure, draw, 1])
  expert, shared = _gradient_set(structure, rng)
  expert16 = [(g * SCALE).astype(np.float16) for g in expert]
  shared16 = [(g * SCALE).astype(np.float16) for g in shared]
  assert all(np.isfinite(g).all() for g in expert16 + shared16)
  metrics = _chained(structure, expert16, shared16)
  expert32 = [g.astype(np.float32) for g in expert16]
  shared32 = [g.astype(np.float32) for g in shared16]
  np.testing.assert_allclose(
    float(metrics["grad_norm"]),
    oracles.ds_moe_norm(expert32, shared32) / SCALE,
    rtol=NORM_RTOL,
  )
  np.testing.assert_allclose(
    float(metrics["expert_grad_norm"]),
    oracles.ds_moe_norm(expert32, []) / SCALE,
    rtol=NORM_RTOL,
  )


def test_non_finite_expert_gradient():
  # DeepSpeed answers its sentinel -1.0 (and its step skips); fp16_scaling
  # reports an overflow (and fs.chain skips), 0.0 for the norms that
  # do not exist, and the true norm of the shared leaves, which stayed finite.
  rng = np.random.default_rng([SEED, 99])
  expert, shared = _gradient_set(0, rng)
  expert[1].reshape(-1)[3] = np.inf
  assert oracles.ds_moe_norm(expert, shared) == -1.0
  metrics = _chained(
    0, *([g.astype(np.float16) for g in gs] for gs in (expert, shared))
  )
  assert bool(metrics["overflow"])
  assert float(metrics["grad_norm"]) == 0.0
  assert float(metrics["expert_grad_norm"]) == 0.0
  np.testing.assert_allclose(
    float(metrics["shared_grad_norm"]),
    np.sqrt(sum(np.sum(np.float64(g.astype(np.float16)) ** 2) for g in shared))
    / SCALE,
    rtol=NORM_RTOL,
  )
