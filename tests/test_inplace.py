"""The skip's early selects: same values as a select after the update, and a
donated step that XLA runs in place, with no more memory traffic than plain
optax. Any failure of the JAX internals the rewrite uses falls back to the
select after the update, with one warning."""

import functools
import importlib.util
import pathlib
import re
import warnings

from helpers import bits as _bits
from helpers import strip_bookkeeping as _inner
import hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs
from fp16_scaling import _guard
from fp16_scaling import _inplace
from fp16_scaling._states import ClipState
from fp16_scaling._states import LossScaleState

U, S, K, F = (
  _inplace.UPDATE,
  _inplace.SELECT,
  _inplace.KEEP,
  _inplace.OVERFLOW,
)


def _selecting(fn, args, labels, olds):
  """call_selecting on a ``fn`` that returns a flat tuple whose leading
  ``UPDATE`` outputs are the updates and the rest the state; returns the
  flat tuple."""
  n = next((i for i, lab in enumerate(labels) if lab != U), len(labels))

  def split(*args):
    out = fn(*args)
    return tuple(out[:n]), tuple(out[n:])

  state_tree = jax.tree.structure(jax.eval_shape(split, *args)[1])
  updates, state = _inplace.call_selecting(
    split,
    args,
    _inplace.StateLabels(state_tree, labels[n:], olds[n:]),
  )
  return updates + state


def _run(fn, args, labels, olds_of_args):
  """call_selecting with fixed labels; ``olds_of_args(args)`` gives olds."""

  def jitted(*args):
    return _selecting(fn, args, labels, olds_of_args(args))

  return jax.jit(jitted)(*args)


def _toy(x, a, b, flag):
  # Outputs: (update, a_new, b_new, shared_1, shared_2, passed, book, flag)
  early = a + 1.0  # a state leaf computed before the flag exists
  flag = flag | jnp.isnan(x).any()
  b_new = b * 2.0 + x
  update = early * b_new  # reads two new state leaves
  book = b_new + 0.5  # bookkeeping must see the unselected b_new
  shared = x * 3.0  # one value returned as two state leaves
  return update, early, b_new, shared, shared, a, book, flag


_LABELS = [U, S, S, S, S, S, K, F]


def _olds(args):
  x, a, b, _ = args
  return [None, a, b, a, b, a, None, None]


@pytest.mark.parametrize("overflow", [False, True])
def test_toy_values_match_a_select_after_the_call(overflow):
  x = jnp.array([1.0, 2.0]) if not overflow else jnp.array([1.0, jnp.nan])
  a, b = jnp.array([10.0, 20.0]), jnp.array([-1.0, -2.0])
  got = _run(_toy, (x, a, b, jnp.bool_(False)), _LABELS, _olds)
  raw = _toy(x, a, b, jnp.bool_(False))
  if not overflow:
    expected = raw
  else:
    expected = (jnp.full(2, -0.0), a, b, a, b, a, raw[6], raw[7])
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
  if overflow:
    # -0.0, not 0.0: params + update keeps the sign of a zero parameter.
    assert np.signbit(np.asarray(got[0])).all()
    # bookkeeping from the unselected leaf: b*2 + x, not b + 0.5
    assert np.asarray(got[6])[0] == -1.0 * 2 + 1.0 + 0.5


def _counter_toy(x, count, flag):
  # Outputs: (update, count_new, flag). The update divides by the new count,
  # which is 0 at the old count of a fresh state (Adam's bias correction).
  flag = flag | jnp.isnan(x).any()
  count_new = jnp.where(count < 7, count + 1, count)
  return x / count_new.astype(jnp.float32), count_new, flag


def test_a_counter_is_selected_in_place_its_readers_see_the_new_count():
  def step(x, count):
    update, count, _ = _selecting(
      _counter_toy,
      (x, count, jnp.bool_(False)),
      [U, S, F],
      [None, count, None],
    )
    return jnp.sum(update), count

  x, count = jnp.array([1.0, jnp.nan]), jnp.int32(0)
  # On the overflow step the count keeps its old value, and the gradient
  # through the discarded update is 0: the division read the new count (1),
  # not the selected old one (0), which would make 0 / 0.
  (_, kept), grad = jax.value_and_grad(step, has_aux=True)(x, count)
  assert int(kept) == 0
  np.testing.assert_array_equal(np.asarray(grad), [0.0, 0.0])
  (total, moved), _ = jax.value_and_grad(step, has_aux=True)(x[:1], count)
  assert int(moved) == 1 and float(total) == 1.0
  # The select is the one reader of the donated count: no copy of it.
  compiled = jax.jit(step, donate_argnums=1).lower(x, count).compile()
  assert hlo.entry_copies(compiled.as_text()) == []


def test_exactly_one_overflow_output_is_required():
  with pytest.raises(ValueError, match="one overflow output"):
    _run(lambda x: (x, x), (jnp.ones(2),), [U, U], lambda args: [None, None])


def _reference_skip(inner):
  """skip_on_overflow as a plain select after the update."""

  def update(updates, state, params=None):
    with _guard.guarded():
      new_updates, new_state = inner.update(updates, state, params)
    overflow = fs.scale_metrics(new_state)["overflow"]
    book = (LossScaleState, ClipState)

    def keep(new, old):
      return new if isinstance(new, book) else jnp.where(overflow, old, new)

    new_state = jax.tree.map(
      keep, new_state, state, is_leaf=lambda x: isinstance(x, book)
    )
    new_updates = jax.tree.map(
      lambda u: jnp.where(overflow, -0.0, u), new_updates
    )
    return new_updates, new_state

  def init(params):
    with _guard.guarded():
      return inner.init(params)

  return optax.GradientTransformation(init, update)


_OPTIMIZERS = {
  "adamw+schedule": lambda: optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20), weight_decay=0.1
  ),
  "sgd nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
  "lion": lambda: optax.lion(1e-3),
  "adafactor": lambda: optax.adafactor(1e-2),
  "inject_hyperparams adam": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=1e-3
  ),
  "MultiSteps adam": lambda: optax.MultiSteps(
    optax.adam(1e-3), 2
  ).gradient_transformation(),
}


_STEPS = 8
# The gradients of each of the steps below before the loss scale, stacked.
# Drawn here rather than by jax.random inside the step, which compiled the
# sampler into every chain's step (most of the test's time).
_RNG = np.random.default_rng(1)
_UNIT_GRADS = {
  name: _RNG.standard_normal((_STEPS, *shape), np.float32)
  for name, shape in {"w": (8, 4), "b": (4,)}.items()
}


def _same_bits_chain(name):
  return optax.chain(
    fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)),
    fs.clip_by_unscaled_norm(1.0),
    _OPTIMIZERS[name](),
  )


def _same_bits_step(tx, params, state, units, i):
  scale = fs.current_scale(state)
  grads = jax.tree.map(lambda g: (g[i] * scale).astype(jnp.float16), units)
  # Steps 3 and 4 overflow.
  poison = (i == 3) | (i == 4)
  grads["w"] = (
    grads["w"].at[0, 0].set(jnp.where(poison, jnp.inf, grads["w"][0, 0]))
  )
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.fixture(scope="module")
def same_bits_runs():
  """``{optimizer: (ours, reference)}``: the (params, state) after each step
  of skip_on_overflow and of :func:`_reference_skip` around the optimizer's
  chain. One jit per side steps the chains of every optimizer: a jit per
  chain took twice the CPU time, compiling again what the chains share."""
  params = {
    "w": jax.random.normal(jax.random.PRNGKey(0), (8, 4)),
    "b": jnp.array([0.0, -0.0, 1.0, 2.0]),
  }
  names = sorted(_OPTIMIZERS)
  sides = []
  for wrap in (fs.skip_on_overflow, _reference_skip):
    txs = [wrap(_same_bits_chain(name)) for name in names]

    @jax.jit
    def step_all(runs, units, i):
      return [_same_bits_step(tx, *run, units, i) for tx, run in zip(txs, runs)]

    runs = [(params, tx.init(params)) for tx in txs]
    traces = [[] for _ in names]
    for i in range(_STEPS):
      runs = step_all(runs, _UNIT_GRADS, i)
      for trace, run in zip(traces, runs):
        trace.append(tuple(run))
    sides.append(traces)
  return {name: pair for name, pair in zip(names, zip(*sides))}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_same_bits_as_a_select_after_the_update(name, same_bits_runs):
  ours_run, ref_run = same_bits_runs[name]
  for run in (ours_run, ref_run):
    assert int(fs.scale_metrics(run[-1][1])["skipped_steps"]) == 2
  # On the overflow steps the parameters and every inner state leaf keep
  # their bits (only the bookkeeping moves).
  for i in (3, 4):
    before, after = ours_run[i - 1], ours_run[i]
    assert fs.scale_metrics(after[1])["overflow"]
    assert _bits(after[0]) == _bits(before[0])
    assert _bits(_inner(after[1])) == _bits(_inner(before[1]))
  # Everywhere else the same values as the select after the update. XLA
  # fuses the two dataflows differently, so a compiled update may round
  # differently in the last place.
  for ours_step, ref_step in zip(ours_run, ref_run):
    for a, b in zip(jax.tree.leaves(ours_step), jax.tree.leaves(ref_step)):
      np.testing.assert_allclose(
        np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
      )


def _chain():
  return fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(
        fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)
      ),
      fs.clip_by_unscaled_norm(1.0),
      optax.adamw(1e-2, weight_decay=0.1),
    )
  )


def _grads(scale, poison):
  g = {"w": jnp.arange(12.0).reshape(3, 4) / 7 - 0.5, "b": jnp.ones(4)}
  g = jax.tree.map(lambda x: (x * scale).astype(jnp.float16), g)
  g["b"] = g["b"].at[2].set(jnp.where(poison, jnp.inf, g["b"][2]))
  return g


def test_rewritten_jaxpr_typechecks():
  # jax_enable_checks typechecks every jaxpr JAX builds or binds, the
  # rewritten one included (select_n's operand types, variable scoping).
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  tx = _chain()
  with jax.enable_checks(True):
    state = tx.init(params)
    for poison in (False, True, False):
      updates, state = jax.jit(tx.update)(
        _grads(fs.current_scale(state), poison), state, params
      )
      params = optax.apply_updates(params, updates)
  assert int(fs.scale_metrics(state)["skipped_steps"]) == 1


def _run_steps(tx, update=None):
  """Four steps, the second overflowing: [(params, state)] after each."""
  params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
  state = tx.init(params)
  update = update or jax.jit(tx.update)
  out = []
  for poison in (False, True, False, False):
    updates, state = update(
      _grads(fs.current_scale(state), poison), state, params
    )
    params = optax.apply_updates(params, updates)
    out.append((params, state))
  return out


@functools.lru_cache(maxsize=None)
def _reference_steps(early_select):
  """:func:`_run_steps` of ``_chain_with(early_select)``, run once for every
  test that compares with it (each takes it before patching anything)."""
  return _run_steps(_chain_with(early_select))


def _assert_skipped_and_close(run, reference):
  assert _bits(run[1][0]) == _bits(run[0][0])  # the overflow step
  assert _bits(_inner(run[1][1])) == _bits(_inner(run[0][1]))
  for a, b in zip(jax.tree.leaves(run), jax.tree.leaves(reference)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
    )


def _chain_with(early_select):
  return fs.skip_on_overflow(
    optax.chain(
      fs.fp16_loss_scale(
        fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)
      ),
      fs.clip_by_unscaled_norm(1.0),
      optax.adamw(1e-2, weight_decay=0.1),
    ),
    early_select=early_select,
  )


def _fallback_warnings(record):
  return [
    w
    for w in record
    if issubclass(w.category, RuntimeWarning)
    and "in-place rewrite failed" in str(w.message)
  ]


def test_unexpected_jaxpr_shape_falls_back_to_selecting_after(monkeypatch):
  # If a future JAX traces the inner update differently, the skip must
  # stay exact (only slower): same parameters, same skipped step.
  fast = _reference_steps(True)
  monkeypatch.setattr(_inplace, "_single_jit_call", lambda closed: None)
  monkeypatch.setattr(_inplace, "_warned", False)
  with pytest.warns(RuntimeWarning, match="not one jit call"):
    slow = _run_steps(_chain())
  _assert_skipped_and_close(slow, fast)


def _raise(*args, **kwargs):
  raise TypeError("this JAX changed its internals")


@pytest.mark.parametrize(
  "internal", ["Var", "new_jaxpr_eqn", "ClosedJaxpr", "bind"]
)
def test_a_broken_jax_internal_falls_back_and_warns_once(monkeypatch, internal):
  # jax.extend.core has no compatibility guarantee. With any piece of it
  # that the rewrite uses raising, the step must still return the values of
  # the plain select after the update, and say so once, naming the version.
  reference = _reference_steps(False)
  if internal == "bind":
    # Only the rewrite's own bind: JAX's other jit calls keep working.
    real_finish = _inplace._finish

    def finish(outs, treedef, labels_olds, done):
      if done is not None:
        raise TypeError("this JAX changed jit_p's parameters")
      return real_finish(outs, treedef, labels_olds, done)

    monkeypatch.setattr(_inplace, "_finish", finish)
  else:
    monkeypatch.setattr(_inplace.jex_core, internal, _raise)
  monkeypatch.setattr(_inplace, "_warned", False)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # Two chains: two traces, two fallbacks, one warning.
    runs = [_run_steps(_chain()), _run_steps(_chain())]
  (warning,) = _fallback_warnings(record)
  assert f"JAX {jax.__version__}" in str(warning.message)
  for run in runs:
    _assert_skipped_and_close(run, reference)


def test_errors_of_the_inner_update_are_raised_not_swallowed(monkeypatch):
  # The fallback is for JAX's internals: a user's own error (here the
  # update's state changes structure) comes out as it is, with no warning.
  monkeypatch.setattr(_inplace, "_warned", False)

  inner = optax.chain(
    fs.fp16_loss_scale(fs.static_scaler(1.0)),
    optax.GradientTransformation(
      lambda p: {"n": jnp.zeros([])},
      lambda u, s, p=None: (u, {"n": s["n"], "extra": s["n"]}),
    ),
  )
  tx = fs.skip_on_overflow(inner)
  params = {"w": jnp.zeros(3)}
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    with pytest.raises(ValueError, match="structure differs"):
      jax.jit(tx.update)(params, tx.init(params), params)
  assert not _fallback_warnings(record)


def test_early_select_false_uses_no_jax_internals(monkeypatch):
  reference = _reference_steps(True)

  def no_tracing(*args, **kwargs):
    raise AssertionError("traced the inner update to a jaxpr")

  monkeypatch.setattr(jax, "make_jaxpr", no_tracing)
  monkeypatch.setattr(_inplace, "_warned", False)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    plain = _run_steps(_chain_with(early_select=False))
  assert not _fallback_warnings(record)
  _assert_skipped_and_close(plain, reference)


def test_early_select_must_be_a_bool():
  with pytest.raises(TypeError, match="early_select"):
    fs.skip_on_overflow(optax.sgd(1.0), early_select="yes")


def test_eager_update_runs_op_by_op_and_skips_exactly(monkeypatch):
  # Outside jit there is no donated buffer to reuse; tracing and binding a
  # jit call would compile the whole update on every eager call.
  params0 = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}

  def run(update):
    tx, params = _chain(), params0
    state = tx.init(params)
    out = []
    for poison in (False, True, False):
      updates, state = update(tx)(
        _grads(fs.current_scale(state), poison), state, params
      )
      params = optax.apply_updates(params, updates)
      out.append((params, state))
    return out

  jitted = run(lambda tx: jax.jit(tx.update))

  def no_tracing(*args, **kwargs):
    raise AssertionError("traced an eager update")

  monkeypatch.setattr(jax, "make_jaxpr", no_tracing)
  eager = run(lambda tx: tx.update)
  assert _bits(eager[1][0]) == _bits(eager[0][0])  # the overflow step
  assert _bits(_inner(eager[1][1])) == _bits(_inner(eager[0][1]))
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
    )


# --------------------------------------------------------------------------
# The compiled step: no copy of a state buffer, no more bytes than optax.

_TRAFFIC = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _hlo_traffic():
  spec = importlib.util.spec_from_file_location(
    "hlo_traffic", _TRAFFIC / "hlo_traffic.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_SIZES = (4096, 2048, 1024, 512)
_COPY = re.compile(r"=\s*(\S+)\s+copy\(")


def _compiled_step(tx, grad_dtype, cast_to_f32=False):
  """The jitted, donated step of benchmarks/step_cost.py, compiled."""
  params = [jnp.full((n,), 0.5, jnp.float32) for n in _SIZES]
  grads = [jnp.full((n,), 1.0, grad_dtype) for n in _SIZES]

  def step(params, state, grads):
    if cast_to_f32:
      grads = [g.astype(jnp.float32) for g in grads]
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(step, donate_argnums=(0, 1))
  return jitted.lower(params, tx.init(params), grads).compile()


def _array_copies(compiled, traffic):
  """``copy`` instructions of more than one element (scalar copies of the
  loss-scale state cost nothing)."""
  return [
    line.strip()
    for line in compiled.as_text().splitlines()
    if (m := _COPY.search(line)) and traffic.shape_bytes(m.group(1)) > 8
  ]


def _bytes_accessed(compiled):
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device
    cost = cost[0]
  return cost["bytes accessed"]


def _common_path_bytes(compiled, traffic, small=0):
  """hlo_traffic's count of the entry computation without the norm's rescue
  ``lax.cond`` branches, which only a finite float32 square overflowing
  float32 enters (XLA's ``bytes accessed`` counts them as if every step ran
  them), and without the scalar instructions (see :func:`_scalar_bytes`)."""
  table = traffic.breakdown(compiled.as_text())
  common = sum(b for key, (_, b) in table.items() if "/" not in key)
  return common - _scalar_bytes(compiled, traffic, small)


def _scalar_bytes(compiled, traffic, small):
  """Bytes of the entry instructions whose result and operands each hold at
  most ``small`` elements (0: none counted)."""
  if not small:
    return 0
  entry = hlo.computations(compiled.as_text())["ENTRY"]
  shapes = {i["name"]: i["shape"] for i in entry}
  total = 0
  for inst in entry:
    if inst["op"] in ("parameter", "constant", "tuple", "get-tuple-element"):
      continue
    if inst["op"] in ("conditional", "while", "call", "bitcast"):
      continue
    touched = [inst["shape"]] + [shapes.get(o, "") for o in inst["operands"]]
    counts = [traffic.shape_bytes(t) for t in touched]
    elements = [_elements(t) for t in touched]
    if max(elements) <= small:
      total += sum(counts)
  return total


def _elements(shape):
  dims = re.findall(r"\[([\d,]*)\]", shape)
  n = 0
  for d in dims:
    k = 1
    for x in filter(None, d.split(",")):
      k *= int(x)
    n = max(n, k)
  return n


def _bookkeeping(state):
  book = (LossScaleState, ClipState)
  return [
    x
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, book))
    if isinstance(x, book)
  ]


@pytest.mark.parametrize("grad_dtype", [jnp.float16, jnp.float32])
def test_donated_step_holds_no_copy_and_moves_no_more_bytes_than_optax(
  grad_dtype,
):
  traffic = _hlo_traffic()

  def ours(early_select):
    return fs.skip_on_overflow(
      optax.chain(
        fs.fp16_loss_scale(fs.deepspeed_scaler(init_scale=2.0**16)),
        fs.clip_by_unscaled_norm(1.0),
        optax.adamw(1e-3, weight_decay=1e-4),
      ),
      early_select=early_select,
    )

  plain = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4)
  )
  floor = _compiled_step(plain, grad_dtype, cast_to_f32=True)
  early = _compiled_step(ours(True), grad_dtype)
  after = _compiled_step(ours(False), grad_dtype)

  assert not _array_copies(floor, traffic)
  assert not _array_copies(early, traffic)
  # The control: selected after the update, XLA:CPU copies both Adam
  # moments of every leaf before overwriting them. So the check can fail.
  if jax.default_backend() == "cpu":
    assert len(_array_copies(after, traffic)) == 2 * len(_SIZES)

  # Array traffic: no more than plain optax's, on every backend. Scalar
  # traffic (instructions whose operands and result hold at most one value
  # per leaf: the scale machine, the norms, the flags) differs by backend:
  # XLA:GPU fuses scalars differently from XLA:CPU (215,449 bytes against
  # the floor's 215,144 on an H200). Each bookkeeping value is written once
  # and read by a few scalar instructions: bounded by 16 accesses of every
  # bookkeeping byte.
  small = len(_SIZES)
  assert _common_path_bytes(early, traffic, small) <= _common_path_bytes(
    floor, traffic, small
  )
  state = ours(True).init([jnp.zeros(n) for n in _SIZES])
  book = sum(x.nbytes for x in jax.tree.leaves(_bookkeeping(state)))
  assert _scalar_bytes(early, traffic, small) <= 16 * book
  if grad_dtype == jnp.float16:
    # No rescue branch is traced for float16 gradients (their squares
    # cannot overflow a float32 sum): XLA's own count applies as it is.
    assert "conditional" not in early.as_text()
    assert _bytes_accessed(early) <= _bytes_accessed(floor)
    assert _bytes_accessed(after) > _bytes_accessed(floor)


# --------------------------------------------------------------------------
# Every output aliases a donated input: the step allocates nothing per call.


def _guarded_with(scaler, *, clip=True, expert_mask=None, **options):
  parts = [fs.fp16_loss_scale(scaler, **options)]
  if clip:
    parts.append(fs.clip_by_unscaled_norm(1.0, expert_mask=expert_mask))
  return fs.skip_on_overflow(optax.chain(*parts, optax.adamw(1e-3)))


_IN_PLACE = {
  "plain optax": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
  ),
  "deepspeed": lambda: _guarded_with(fs.deepspeed_scaler(delayed_shift=2)),
  "torch": lambda: _guarded_with(fs.torch_scaler()),
  "megatron": lambda: _guarded_with(fs.megatron_scaler()),
  "flax": lambda: _guarded_with(fs.flax_scaler()),
  "headroom": lambda: _guarded_with(fs.headroom_scaler()),
  "static": lambda: _guarded_with(fs.static_scaler(128.0)),
  "no_scaler, no clip": lambda: _guarded_with(fs.no_scaler(), clip=False),
  "expert mask": lambda: _guarded_with(
    fs.deepspeed_scaler(), expert_mask=[True, False, True, False]
  ),
  "grad_range": lambda: _guarded_with(fs.torch_scaler(), grad_range=True),
  "log_overflows": lambda: _guarded_with(fs.torch_scaler(), log_overflows=True),
  "accumulate": lambda: fs.accumulate_gradients(
    _guarded_with(fs.deepspeed_scaler()), 3
  ),
  "accumulate, drop": lambda: fs.accumulate_gradients(
    _guarded_with(fs.deepspeed_scaler()),
    3,
    on_microbatch_overflow="drop_microbatch",
  ),
}

# No copy either on XLA:CPU, as in plain optax's step: XLA copies a buffer
# when an output is written over it while another fusion still has to read
# its old value, or when one value is returned as two outputs. The library
# avoids each case: the loss scale is read once, through prev_loss_scale
# (_donation.snapshot); the scale machine's counters are written after
# their readers (_donation.after); Adam's count is selected where XLA
# writes it in place (_inplace.select_counters); the loss-scale state's
# norm is a value of its own, not the clip's; an accumulation window's end
# is computed once, as window_ended.


@pytest.mark.parametrize("name", sorted(_IN_PLACE))
def test_every_output_aliases_a_donated_input(name):
  tx = _IN_PLACE[name]()
  n = len(_SIZES)
  params = [jnp.full((k,), 0.5, jnp.float32) for k in _SIZES]
  dtype = jnp.float32 if name == "plain optax" else jnp.float16

  def grads(scale):
    return [jnp.full((k,), 2.0**-20 * scale, dtype) for k in _SIZES]

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(step, donate_argnums=(0, 1))
  state = tx.init(params)
  text = jitted.lower(params, state, grads(1.0)).compile().as_text()
  outputs = len(jax.tree.leaves((params, state)))
  assert hlo.output_count(text) == outputs
  aliased = hlo.aliased_outputs(text)
  assert sorted(aliased) == list(range(outputs)), name
  # Positional: each output is written over its own input's buffer.
  assert all(o == p for o, p in aliased.items()), aliased
  copies = hlo.entry_copies(text)
  if jax.default_backend() == "cpu":
    assert copies == [], name
  else:  # not measured on other backends: no copy larger than a scalar
    assert all(re.search(r"= [a-z]+\d*\[\] copy\(", c) for c in copies)
  # And it runs: every state buffer is its own (one buffer cannot be
  # donated twice), and the parameters move.
  for _ in range(3 if name.startswith("accumulate") else 1):
    scale = 1.0 if name == "plain optax" else fs.current_scale(state)
    params, state = jitted(params, state, grads(scale))
  assert all(float(p[0]) != 0.5 for p in params), n
