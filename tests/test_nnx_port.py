"""Flax NNX ports: ``nnx.Optimizer`` around the accumulating guarded chain.

``nnx.Optimizer`` keeps every array of its optax state in an nnx Variable;
the host helpers must give plain arrays back for every key, the accumulation
keys included, with the values a count by hand gives.
"""

from helpers import guarded
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

nnx = pytest.importorskip("flax.nnx")

K = 4


def _optimizer():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = fs.accumulate_gradients(
    guarded(fs.torch_scaler(), optax.adamw(1e-3)), every_k_schedule=K
  )
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_accumulation_metrics_are_plain_arrays_under_nnx_optimizer():
  model, opt = _optimizer()
  m = fs.scale_metrics(opt.opt_state)
  for key, value in m.items():
    assert isinstance(value, jax.Array), (key, type(value))
  assert not bool(m["window_ended"])
  grads = nnx.state(model, nnx.Param)
  ones = jax.tree.map(lambda g: jnp.ones(g.shape, jnp.float32), grads)
  ended = []
  for _ in range(K + 1):
    opt.update(model, ones)
    m = fs.scale_metrics(opt.opt_state)
    ended.append(bool(m["window_ended"]))
  assert ended == [False, False, False, True, False]
  assert (int(m["microbatches"]), int(m["applied_steps"])) == (K + 1, 1)
  assert int(m["dropped_microbatches"]) == 0
  assert np.shape(m["window_ended"]) == ()
