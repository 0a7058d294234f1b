"""_provenance: records kept by identity, and what made a loss-scale state.

The refusals built on it (a stale or second sync, a set scale a sync would
undo, another chain's state) are tested where they are refused:
test_slips.py, test_shared_scale.py, test_checkpoints.py, test_chain.py.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp16_scaling as fs
from fp16_scaling import _provenance
from fp16_scaling._provenance import Made
from fp16_scaling._provenance import Records


def test_a_record_is_found_by_identity_not_by_value():
  records = Records()
  a, b = jnp.zeros(3), jnp.zeros(3)  # equal values, two objects
  records.put(a, "a")
  assert records.get(a) == "a"
  assert records.get(b) is None
  records.put(a, "again")  # replaces
  assert records.get(a) == "again"
  records.clear()
  assert records.get(a) is None


def test_a_record_is_dropped_with_its_object():
  records = Records()
  a = np.zeros(3)
  records.put(a, "a")
  entries = records._entries
  assert len(entries) == 1
  del a
  gc.collect()
  assert not entries  # nothing kept alive, nothing left behind


def test_a_tuple_key_needs_every_object_alive_and_the_same():
  records = Records()
  a, b, c = np.zeros(1), np.zeros(1), np.zeros(1)
  records.put((a, b), "ab")
  assert records.get((a, b)) == "ab"
  assert records.get((a, c)) is None and records.get((b, a)) is None
  assert records.get(a) is None
  del b
  gc.collect()
  assert not records._entries


def test_an_object_with_no_identity_to_keep_is_not_recorded():
  records = Records()
  for x in (np.float32(1.0), 1.0, 3):
    records.put(x, "x")
    assert records.get(x) is None
  records.put((np.zeros(1), np.int32(0)), "pair")
  assert not records._entries


def test_what_made_each_state_of_a_synced_step():
  scaler = fs.torch_scaler(init_scale=8.0)
  tx0, tx1 = (
    fs.chain(fs.fp16_loss_scale(scaler), optax.sgd(1.0)) for _ in range(2)
  )
  p = jnp.ones(2)
  s0, s1 = tx0.init(p), tx1.init(p)
  config0 = tx0.config.scale
  init = Made(by=config0, stepped=False, scale_set=False, consumed=False)
  stepped = init._replace(stepped=True)
  assert _provenance.made(s0[0]) == init
  _, n0 = tx0.update(jnp.ones(2), s0, p)
  _, n1 = tx1.update(jnp.ones(2), s1, p)
  assert _provenance.made(s0[0]).consumed  # from before the update
  assert _provenance.made(n0[0]) == stepped
  set0 = fs.set_loss_scale(n0, 16.0)
  assert _provenance.made(set0[0]) == stepped._replace(scale_set=True)
  assert _provenance.made(n0[0]).scale_set is False  # not the one set
  m0, m1 = fs.sync_loss_scales(n0, n1)
  # One new scale for both, told apart by their own skipped-step counts.
  assert m0[0].scaler.loss_scale is m1[0].scaler.loss_scale
  assert _provenance.made(m0[0]) == init  # synced: not stepped since
  assert _provenance.made(m1[0]).by is tx1.config.scale


def test_a_state_across_a_jit_boundary_is_unknown():
  tx = fs.chain(fs.fp16_loss_scale(fs.torch_scaler()), optax.sgd(1.0))
  p = jnp.ones(2)
  state = tx.init(p)
  seen = []

  def step(state):
    seen.append(_provenance.made(state[0]))
    return tx.update(jnp.ones(2), state, p)[1]

  out = jax.jit(step)(state)
  assert seen == [Made()]  # inside the trace: a new object
  assert _provenance.made(out[0]) == Made()  # a jitted call's result
  assert _provenance.made(step(state)[0]).stepped  # eager: known
