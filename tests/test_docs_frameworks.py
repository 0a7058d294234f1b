"""docs/frameworks.md: each framework's step, run as written (the page's first
block, then that framework's section, in a fresh namespace), then stepped
once more from where its loop ended. Checked against what the skip must do,
independent of the page's own loop: on the overflowing batch (times 6e4,
float16's forward pass overflows) the parameters and the model state
(batch_stats, BatchStat, Haiku's state, Keras's non-trainable variables)
keep every bit and torch_scaler halves the scale; on a clean batch both
change and the scale stays."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import docs_snippets  # noqa: E402
import helpers  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fp16_scaling as fs  # noqa: E402

PAGE = "frameworks.md"
BAD_BATCH = 5  # the page's batch times 6e4


def _run(heading):
  """The page's first block and the blocks under ``heading``, in one fresh
  namespace; checks the page's loop skipped its bad batch and no other."""
  ns = {}
  (setup,) = docs_snippets.section_blocks(PAGE, "## The data and the optimizer")
  code = [setup, *docs_snippets.section_blocks(PAGE, heading)]
  for i, block in enumerate(code):
    exec(compile(block, f"{PAGE} {heading} block {i}", "exec"), ns)
  return ns


def _check_skip_and_step(opt_state_of, step, state, batches, model_state):
  """Steps ``state`` once on the bad batch and once on a clean one.

  ``step(state, x, y)`` returns the state after the step;
  ``opt_state_of(state)`` its optax state; ``model_state(state)`` its
  ``(params, model state)`` as arrays."""
  m = fs.scale_metrics(opt_state_of(state))
  # The page's loop: 12 steps, the bad batch skipped and no other.
  assert int(m["skipped_steps"]) == 1, m
  assert not bool(m["overflow"])
  scale = float(fs.current_scale(opt_state_of(state)))
  before = helpers.bits(model_state(state))
  params_before, stats_before = model_state(state)

  bad = step(state, *batches[BAD_BATCH])
  m = fs.scale_metrics(opt_state_of(bad))
  assert bool(m["overflow"]) and int(m["skipped_steps"]) == 2
  assert helpers.bits(model_state(bad)) == before  # every bit kept
  assert float(fs.current_scale(opt_state_of(bad))) == scale / 2

  clean = step(state, *batches[0])
  m = fs.scale_metrics(opt_state_of(clean))
  assert not bool(m["overflow"]) and int(m["skipped_steps"]) == 1
  assert float(fs.current_scale(opt_state_of(clean))) == scale
  params, stats = model_state(clean)
  for old, new in [(params_before, params), (stats_before, stats)]:
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
      assert np.isfinite(b).all()
      assert not np.array_equal(a, b)  # every leaf moved
  return bad, clean


def test_plain_jax():
  ns = _run("## Plain JAX")

  def step(state, x, y):
    params, opt_state, _ = ns["jax_step"](*state, x, y)
    return params, opt_state

  _check_skip_and_step(
    lambda s: s[1],
    step,
    (ns["params"], ns["opt_state"]),
    ns["batches"],
    lambda s: (jax.device_get(s[0]), {}),
  )
  assert ns["loss"].dtype == np.float32  # "o=f32": a float32 loss
  # The policy casts inside the differentiated function: float32 gradients.
  x, y = ns["batches"][0]
  _, grads = fs.value_and_grad(
    ns["mlp_loss"], ns["opt_state"], policy="p=f32,c=f16,o=f32", cast_args=(1,)
  )(ns["params"], x, y)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype("float32")}


def test_flax_linen():
  pytest.importorskip("flax.linen")
  ns = _run("## Flax Linen")
  linen = ns["linen"]
  assert set(linen.batch_stats["BatchNorm_0"]) == {"mean", "var"}
  bad, clean = _check_skip_and_step(
    lambda s: s.opt_state,
    lambda s, x, y: ns["linen_step"](s, x, y)[0],
    linen,
    ns["batches"],
    lambda s: jax.device_get((s.params, s.batch_stats)),
  )
  # apply_gradients counts every call in state.step, the skip included.
  assert int(linen.step) == 12 and int(clean.step) == 13
  # apply_gradients passes no value=: the kind of the overflow is unknown.
  assert fs.overflow_report(bad.opt_state).kind == "unknown"


def test_flax_nnx():
  nnx = pytest.importorskip("flax.nnx")
  ns = _run("## Flax NNX")
  model, opt = ns["model"], ns["opt"]

  def pure_split(tree):
    graphdef, variables = nnx.split(tree)
    return graphdef, nnx.as_pure(variables)

  def step(state, x, y):
    # nnx_step updates the model and the optimizer in place: each step
    # here runs on a copy, merged from pure arrays.
    model, opt = nnx.merge(*state)
    ns["nnx_step"](model, opt, x, y)
    return pure_split((model, opt))

  def model_state(state):
    model, _ = nnx.merge(*state)
    stats = nnx.as_pure(nnx.state(model, nnx.BatchStat))
    assert jax.tree.leaves(stats)  # the BatchNorm's mean and var
    return jax.device_get((nnx.as_pure(nnx.state(model, nnx.Param)), stats))

  _check_skip_and_step(
    lambda s: nnx.merge(*s)[1].opt_state,
    step,
    pure_split((model, opt)),
    ns["batches"],
    model_state,
  )
  # opt.step counts every update, the skipped one included; value= tells
  # the overflow's kind.
  assert int(opt.step.get_value()) == len(ns["batches"]) == 12
  bad = nnx.merge(*step(pure_split((model, opt)), *ns["batches"][BAD_BATCH]))
  assert fs.overflow_report(bad[1].opt_state).kind == "forward"


def test_equinox():
  eqx = pytest.importorskip("equinox")
  ns = _run("## Equinox")

  def step(state, x, y):
    mlp, opt_state, _ = ns["eqx_step"](*state, x, y)
    return mlp, opt_state

  _check_skip_and_step(
    lambda s: s[1],
    step,
    (ns["mlp"], ns["eqx_state"]),
    ns["batches"],
    lambda s: (jax.device_get(eqx.filter(s[0], eqx.is_inexact_array)), {}),
  )


def test_haiku():
  pytest.importorskip("haiku")
  ns = _run("## Haiku")

  def step(state, x, y):
    return ns["hk_step"](*state, x, y)[:3]

  assert all(
    a.dtype == np.float32
    for a in jax.tree.leaves(ns["hk_state"])
    if np.issubdtype(a.dtype, np.floating)
  )  # the state keeps its float32 under the policy
  _check_skip_and_step(
    lambda s: s[2],
    step,
    (ns["hk_params"], ns["hk_state"], ns["hk_opt"]),
    ns["batches"],
    lambda s: jax.device_get((s[0], s[1])),
  )


@pytest.fixture(scope="module")
def keras_section():
  """The Keras section run once (its two blocks, fit's and the loop's), for
  the two tests below."""
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported with {keras.backend.backend()} first")
  return _run("## Keras 3 (JAX backend)")


def test_keras(keras_section):
  ns = keras_section

  def step(state, x, y):
    return ns["keras_step"](*state, x, y)[:3]

  state = (ns["trainable"], ns["non_trainable"], ns["keras_opt"])
  _check_skip_and_step(
    lambda s: s[2],
    step,
    state,
    ns["batches"],
    lambda s: jax.device_get(s[:2]),
  )
  # The trained values were written back: the model holds them, bit for
  # bit, and computes with them.
  model = ns["keras_model"]
  assert helpers.bits([v.value for v in model.trainable_variables]) == (
    helpers.bits(ns["trainable"])
  )
  assert helpers.bits([v.value for v in model.non_trainable_variables]) == (
    helpers.bits(ns["non_trainable"])
  )
  x = ns["batches"][0][0]
  pred, _ = model.stateless_call(ns["trainable"], ns["non_trainable"], x)
  # A call runs the same ops on the values the model holds, eagerly as
  # stateless_call does: the same bits. (model.predict compiles another
  # program, whose float32 sums XLA may order otherwise: a few ulps apart.)
  np.testing.assert_array_equal(model(x, training=False), pred)


def test_keras_fit(keras_section):
  ns = keras_section
  model, history = ns["fit_model"], ns["history"].history
  # One epoch of the page's twelve batches: the bad one skipped, torch's
  # scale halved once, the logged loss finite (the skip left out).
  assert history["skipped_steps"] == [1.0]
  assert history["loss_scale"] == [2.0**9]
  assert np.isfinite(history["loss"]).all()
  optimizer = model.optimizer
  assert isinstance(optimizer, fs.keras.Optimizer)
  weights = list(model.weights)

  def step(state, x, y):
    # From the values ``state`` holds, one train_on_batch, read back. The
    # variables get copies: train_on_batch donates their buffers.
    for v, value in zip([*weights, *optimizer.variables], state):
      v.assign(np.array(value))
    model.train_on_batch(x, y)
    return [v.value for v in [*weights, *optimizer.variables]]

  def model_state(state):
    values = jax.device_get(state[: len(weights)])
    params = [a for v, a in zip(weights, values) if v.trainable]
    stats = [a for v, a in zip(weights, values) if not v.trainable]
    assert len(stats) == 2  # BatchNorm's moving mean and variance
    return params, stats

  _check_skip_and_step(
    lambda s: optimizer.stateless_opt_state(s[len(weights) :]),
    step,
    [v.value for v in [*weights, *optimizer.variables]],
    ns["batches"],
    model_state,
  )


def test_every_section_is_run_here():
  text = (docs_snippets.DOCS / PAGE).read_text()
  headings = [h for h in text.splitlines() if h.startswith("## ")]
  assert headings == [
    "## The data and the optimizer",
    "## Plain JAX",
    "## Flax Linen",
    "## Flax NNX",
    "## Equinox",
    "## Haiku",
    "## Keras 3 (JAX backend)",
  ]
  # One block a section, and Keras's two (compile + fit, then the custom
  # loop): every block is one of those the tests above run.
  keras = "## Keras 3 (JAX backend)"
  assert len(docs_snippets.blocks(PAGE)) == len(headings) + 1
  for heading in headings:
    count = len(docs_snippets.section_blocks(PAGE, heading))
    assert count == 1 + (heading == keras), heading
