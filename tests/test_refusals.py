"""One program, eager or jitted (issue 53): every check reads types, static
structure or traced values, so each slip gets one answer wherever
``jax.jit`` sits. Each case below runs in the three placements a new user
tries: all eager, inside one jitted step, and with the action jitted and
its setup (``tx.init``, a set scale) eager, the usual loop. The answer, a
refusal's type and message or the values a documented slip gives, is
compared across the three.

The table of issue 53, re-run (each row one case):

| slip | answer in every placement |
|---|---|
| sync of the states given to ``tx.update`` | documented: the step is dropped |
| another chain's state (another ``Scaler``) | refused, naming the field |
| a scale set into one of two states, then a sync | the set scale is kept |
| ``tx.update`` of a state it already consumed | documented: same result |

and the other checks: mismatched specs, a sync of other scalers, the
swapped keyword, live nnx Variables, a foreign scaler at load,
``optax.masked`` around ``fs.chain``, the loss scaled twice (refused inside
``fun``, documented when closed over).
"""

import os
import subprocess
import sys

from helpers import ROOT
from helpers import bits
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

P = jax.sharding.PartitionSpec
PARAMS = {"w": jnp.array([1.0, 2.0])}
GRADS = {"w": jnp.array([8.0, 16.0])}
BAD = {"w": jnp.array([8.0, jnp.inf])}


def chain(scaler=None, **kw):
  scaler = scaler or fs.torch_scaler(init_scale=2.0**10, growth_interval=2)
  return fs.chain(fs.fp16_loss_scale(scaler, **kw), optax.adam(0.1))


TX_A = chain()
TX_B = chain(fs.torch_scaler(init_scale=2.0**10, growth_interval=7))
TX_SPECS = chain(partition_specs=P())
TX_1 = chain()


def _scales(*states):
  return [fs.current_scale(s) for s in states]


# Each case: (setup, action, what a refusal's message holds, or None).
# setup() makes the arguments eagerly (or inside the one jitted step);
# action(*args) is the call that the user would jit.


def _another_chain():
  return (GRADS, TX_A.init(PARAMS), PARAMS)


def _sync_set_into_one():
  return (fs.set_loss_scale(TX_A.init(PARAMS), 2.0**14), TX_1.init(PARAMS))


def _updated_and_synced(s0, s1):
  _, s0 = TX_A.update(GRADS, s0, PARAMS)
  _, s1 = TX_1.update(BAD, s1, PARAMS)
  return _scales(*fs.sync_loss_scales(s0, s1))


def _stale_sync(s0, s1):
  """The states given to tx.update synced (not the ones it returned)."""
  TX_A.update(BAD, s0, PARAMS)
  TX_1.update(GRADS, s1, PARAMS)
  s0, s1 = fs.sync_loss_scales(s0, s1)
  metrics = fs.scale_metrics(s0)
  return _scales(s0, s1) + [metrics["skipped_steps"], s0[1][0].count]


def _consumed(s):
  _, first = TX_A.update(GRADS, s, PARAMS)
  _, again = TX_A.update(GRADS, s, PARAMS)
  return first, again


def _twice_inside(s):
  def fun(p):
    return jnp.sum(p["w"] ** 2) * fs.current_scale(s)

  return fs.value_and_grad(fun, s)(PARAMS)


def _twice_closed_over(s):
  scale = fs.current_scale(s)
  return fs.value_and_grad(lambda p: jnp.sum(p["w"] ** 2) * scale, s)(PARAMS)


# A saved scale (made on the host, as scaler_state_dict is).
SAVED = {**fs.scaler_state_dict(TX_A.init(PARAMS)), "loss_scale": 64.0}


def _loaded(s):
  other = fs.torch_scaler(growth_interval=3)
  return fs.load_scaler_state_dict(s, SAVED, other)


MASKED = optax.masked(TX_A, {"w": False, "b": True})


def _live():
  nnx = pytest.importorskip("flax.nnx")
  stats = nnx.state(nnx.BatchNorm(2, rngs=nnx.Rngs(0)), nnx.BatchStat)
  return TX_A.init(PARAMS), stats


_STARTED = (TX_A.init(PARAMS), TX_1.init(PARAMS))

CASES = {
  "another chain's state": (
    _another_chain,
    TX_B.update,
    "built with another scaler (growth_interval=2, here 7)",
  ),
  "mismatched specs": (
    _another_chain,
    TX_SPECS.update,
    "built with other partition_specs",
  ),
  "a sync of other scalers": (
    lambda: (TX_A.init(PARAMS), TX_B.init(PARAMS)),
    fs.sync_loss_scales,
    "state 1 was built with another Scaler",
  ),
  "a foreign scaler at load": (
    lambda: (TX_A.init(PARAMS),),
    _loaded,
    "disagrees with the scaler on growth_interval",
  ),
  "the swapped keyword": (
    lambda: (TX_A.init(PARAMS), PARAMS, GRADS),
    lambda s, new, old: fs.select_on_overflow(s, new, old),
    "positional argument",
  ),
  "live nnx Variables": (
    _live,
    lambda s, stats: fs.select_on_overflow(s, new=stats, old=stats),
    "holds live nnx.Variable objects",
  ),
  "optax.masked around fs.chain": (
    lambda: (PARAMS["w"],),
    lambda w: MASKED.init({"w": w, "b": w}),
    "optax.masked(optimizer, mask)",
  ),
  "the loss scaled twice inside fun": (
    lambda: (TX_A.init(PARAMS),),
    _twice_inside,
    "scaled twice",
  ),
  # Not refused: the same values in every placement.
  "a scale set into one of two states, then a sync": (
    _sync_set_into_one,
    _updated_and_synced,
    None,
  ),
  "sync of the states given to tx.update": (
    lambda: _STARTED,
    _stale_sync,
    None,
  ),
  "tx.update of a state it already consumed": (
    lambda: (TX_A.init(PARAMS),),
    _consumed,
    None,
  ),
  "the loss scaled twice, the scale closed over": (
    lambda: (TX_A.init(PARAMS),),
    _twice_closed_over,
    None,
  ),
}

PLACEMENTS = {
  "all eager": lambda setup, action: action(*setup()),
  "inside one jitted step": lambda setup, action: jax.jit(
    lambda: action(*setup())
  )(),
  "action jitted, setup eager": lambda setup, action: jax.jit(action)(*setup()),
}


def _answer(case, placement):
  """What ``placement`` gives for ``case``: the refusal's type and
  message, or the bits of the values returned."""
  setup, action, _ = CASES[case]
  try:
    out = PLACEMENTS[placement](setup, action)
  except (ValueError, TypeError) as e:
    return type(e).__name__, str(e)
  return "values", bits(out)


@pytest.mark.parametrize("case", list(CASES))
def test_every_slip_gets_one_answer_wherever_jit_sits(case):
  answers = {p: _answer(case, p) for p in PLACEMENTS}
  kinds = {kind for kind, _ in answers.values()}
  expected = CASES[case][2]
  assert len(kinds) == 1, answers
  if expected is None:
    assert kinds == {"values"}
    assert len({tuple(v) for _, v in answers.values()}) == 1
  else:
    assert kinds <= {"ValueError", "TypeError"}
    for _, message in answers.values():
      assert expected in message, message


def test_the_documented_slips_give_what_their_docstrings_say():
  """The values behind the rows that are not refused, by hand."""
  eager = PLACEMENTS["all eager"]
  # A scale set into one of two states wins the sync (2^14), though the
  # other overflowed.
  scales = eager(*CASES["a scale set into one of two states, then a sync"][:2])
  assert [float(x) for x in scales] == [2.0**14, 2.0**14]
  # The stale sync drops the step: no back-off though state 0 overflowed,
  # no skip counted, Adam's count still 0.
  out = eager(*CASES["sync of the states given to tx.update"][:2])
  assert [float(x) for x in out] == [2.0**10, 2.0**10, 0.0, 0.0]
  # A consumed state, updated again, gives the same state again.
  first, again = eager(*CASES["tx.update of a state it already consumed"][:2])
  assert bits(first) == bits(again)
  # The scale closed over: the value comes back S times the loss (5), and
  # the gradients S * S times the true ones (2, 4).
  value, grads = eager(
    *CASES["the loss scaled twice, the scale closed over"][:2]
  )
  assert float(value) == 5.0 * 2.0**10
  np.testing.assert_array_equal(grads["w"], np.array([2.0, 4.0]) * 2.0**20)


def test_another_chains_state_is_refused_under_jit_of_its_update():
  """The issue's own line: ``jax.jit(tx_b.update)(g, tx_a.init(p), p)``."""
  with pytest.raises(ValueError) as e:
    jax.jit(TX_B.update)(GRADS, TX_A.init(PARAMS), PARAMS)
  msg = str(e.value)
  assert "growth_interval=2, here 7" in msg
  assert "fs.load_scaler_state_dict" in msg


def test_two_models_report_their_own_names_through_a_jitted_identity():
  """Two models of equal structure (one leaf each) and other names: a
  jitted identity, and a jitted update, give each its own names (a static
  node equal to every other used to return the first model's)."""
  identity = jax.jit(lambda s: s)
  sgd = optax.sgd(1.0)
  identity(sgd.init({"alpha": jnp.zeros(2)}))  # another chain, traced first
  step = jax.jit(TX_A.update)
  for name in ("alpha", "beta"):
    params = {name: jnp.zeros(2)}
    state = identity(TX_A.init(params))
    assert state[0].leaf_paths.paths == (f"['{name}']",)
    _, state = step({name: BAD["w"]}, state, params)
    assert fs.overflow_report(state).nonfinite_leaves == (f"['{name}']",)


_COUNT = """
import flax.serialization as serialization
import jax, jax.numpy as jnp, optax
calls = []
register = serialization.register_serialization_state
def counted(ty, *args, **kwargs):
  calls.append(ty.__name__)
  return register(ty, *args, **kwargs)
serialization.register_serialization_state = counted
import fp16_scaling as fs
params = {"w": jnp.ones(2)}
for scale in (1.0, 2.0, 4.0):
  tx = fs.chain(fs.fp16_loss_scale(fs.static_scaler(scale)), optax.sgd(1.0))
  state = tx.init(params)
  jax.jit(tx.init)(params)
back = serialization.from_bytes(state, serialization.to_bytes(state))
assert back[0].leaf_paths == state[0].leaf_paths
print(calls.count("LeafPaths"), len(calls))
"""


def test_flax_serialization_registration_happens_once_per_process():
  """``register_serialization_state`` is called once in a fresh process,
  however many states are built, and msgpack round-trips the state."""
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  out = subprocess.run(
    [sys.executable, "-c", _COUNT],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["1", "1"]


def test_masked_fs_chain_is_refused_and_the_fix_is_exact():
  """``optax.masked(fs.chain(...), mask)`` passed the masked-out leaves'
  scaled gradients on as updates (+1024 g at a static scale of 1024); it
  is refused at ``tx.init``, naming the fix, and so is
  ``optax.multi_transform`` of two chains. The fixes (the mask inside the
  chain, one chain around multi_transform) give plain optax's updates on
  the true gradients."""
  scale = fs.fp16_loss_scale(fs.static_scaler(1024.0))
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  mask = {"a": True, "b": False}
  labels = {"a": "sgd", "b": "adam"}
  with pytest.raises(ValueError) as e:
    optax.masked(fs.chain(scale, optax.sgd(0.1)), mask).init(params)
  assert "fs.chain(fs.fp16_loss_scale(scaler), ..., " in str(e.value)
  two = {"sgd": fs.chain(scale, optax.sgd(0.1)), "adam": chain()}
  with pytest.raises(ValueError) as e:
    optax.multi_transform(two, labels).init(params)
  assert "one fs.chain around optax.multi_transform" in str(e.value)
  true = {"a": jnp.array([0.5, -1.0]), "b": jnp.array([2.0, 0.25, -4.0])}
  scaled = jax.tree.map(lambda g: g * 1024.0, true)
  inner = {"sgd": optax.sgd(0.1), "adam": optax.adam(0.1)}
  fixes = [
    (optax.masked(optax.sgd(0.1), mask), optax.masked(optax.sgd(0.1), mask)),
    (
      optax.multi_transform(inner, labels),
      optax.multi_transform(inner, labels),
    ),
  ]
  for inside, plain in fixes:
    tx = fs.chain(scale, inside)
    got, _ = tx.update(scaled, tx.init(params), params)
    want, _ = plain.update(true, plain.init(params), params)
    assert bits(got) == bits(want)


def _module_containers() -> dict:
  """Every module-level list, dict and set of the package, by module and
  name, as its repr."""
  out = {}
  for name, module in sorted(sys.modules.items()):
    if name.split(".")[0] != "fp16_scaling":
      continue
    for attr, value in vars(module).items():
      if isinstance(value, (list, dict, set)) and not attr.startswith("__"):
        out[f"{name}.{attr}"] = repr(value)
  return out


def test_no_module_level_container_changes_and_no_guard_outlives_a_call():
  """Running every case above, in every placement, leaves each module-level
  list, dict and set of the package as it was (the tables of constants are
  read, never written), and the per-call guard of fs.value_and_grad reset."""
  from fp16_scaling import _metrics

  before = _module_containers()
  assert before  # the package's constant tables are seen
  for case in CASES:
    for placement in PLACEMENTS:
      _answer(case, placement)
  assert _module_containers() == before
  assert getattr(_metrics._IN_FUN, "scales", ()) == ()
