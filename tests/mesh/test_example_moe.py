"""examples/train_moe.py: its shard_map'ed MoE step reports the norms one
device computes.

The example's own train step (experts split over the expert axis, gradients
reduced by shard_map's autodiff) runs from scale 2**24; on every step the same
step is recomputed on one device with the whole model and the whole batch, and
the overflow decision and the norms it reports are compared with numpy's norms
of those single-device gradients. Float16 rounding differs between the two (the
experts' outputs are summed in a different order), hence the 1% tolerance:
counting a replicated leaf once per device, or an expert shard only once, would
be off by far more.
"""

import runpy

from helpers import ROOT
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import fp16_scaling as fs

pytest.importorskip("flax")

EXAMPLE = ROOT / "examples" / "train_moe.py"
BATCH = 256
STEPS = 8


@pytest.fixture(scope="module")
def example():
  return runpy.run_path(str(EXAMPLE))  # not run as __main__: no training yet


def test_moe_step_matches_single_device(example):
  ex = example
  mesh = jax.make_mesh(ex["MESH_SHAPE"], (ex["DATA"], ex["EXPERT"]))
  full_model = ex["Model"]()

  @jax.jit
  def single_device_grads(params, x, y, scale):
    def loss(p):
      logits = full_model.apply({"params": p}, x).astype(jnp.float32)
      nll = -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1)
      )
      return nll * scale

    return jax.grad(loss)(params)

  with jax.set_mesh(mesh):
    params, tx, specs, state_specs, train_step, place, _ = ex["build"](
      mesh, 2.0**24, 20, 1.0, 3e-3
    )
    state = place(jax.jit(tx.init)(params), state_specs)
    params = place(params, specs)
  xs, ys = ex["make_data"](STEPS * BATCH, seed=1)
  batch = NamedSharding(mesh, P((ex["DATA"], ex["EXPERT"])))
  overflows, clean_checked = [], 0
  for i in range(STEPS):
    x, y = xs[i * BATCH : (i + 1) * BATCH], ys[i * BATCH : (i + 1) * BATCH]
    scale = float(fs.current_scale(state))
    ref = single_device_grads(
      jax.device_put(jax.device_get(params), jax.devices()[0]), x, y, scale
    )
    flat = jax.tree_util.tree_leaves_with_path(ref)
    g64 = [np.asarray(g, np.float64) for _, g in flat]
    expert = [ex["is_expert"](path) for path, _ in flat]
    ref_overflow = not all(np.isfinite(g).all() for g in g64)

    with jax.set_mesh(mesh):
      params, state, _ = train_step(
        params, state, jax.device_put(x, batch), jax.device_put(y, batch)
      )
    m = {k: float(v) for k, v in fs.scale_metrics(state).items()}
    assert bool(m["overflow"]) == ref_overflow, f"step {i}"
    overflows.append(ref_overflow)
    if ref_overflow:
      assert m["grad_norm"] == 0.0 and m["loss_scale"] == scale / 2
      continue
    sq = [np.sum(g * g) for g in g64]
    want = {
      "grad_norm": np.sqrt(sum(sq)),
      "expert_grad_norm": np.sqrt(sum(s for s, e in zip(sq, expert) if e)),
      "shared_grad_norm": np.sqrt(sum(s for s, e in zip(sq, expert) if not e)),
    }
    for k, v in want.items():
      np.testing.assert_allclose(
        m[k], v / scale, rtol=1e-2, err_msg=f"step {i} {k}"
      )
    clean_checked += 1
  assert (
    overflows[0] and clean_checked >= 2
  )  # the run overflows first, then trains
  assert (
    sum(expert) == 2 and len(expert) > 2
  )  # w_in and w_out are experts, the rest shared
