"""fs.keras: Keras 3's compile and fit with an fs.chain, checked against
expectations made without it. The oracle of the variables is the custom loop
of docs/frameworks.md (fs.value_and_grad, tx.update and
fs.select_on_overflow around Keras's stateless_call): fit must reach its
variables bit for bit. Keras's own fit with its LossScaleOptimizer is the
baseline the issue measured (poisoned BatchNorm statistics). A skipped
step's batch logs must equal the step's before (its metric variables kept),
and a skipped step keeps every variable's bits."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import helpers  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import fp16_scaling as fs  # noqa: E402
from fp16_scaling import _loss_scale  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
  pytest.skip(
    f"keras was imported with {keras.backend.backend()} first",
    allow_module_level=True,
  )

EPOCHS, BATCH = 15, 64
TRAIN = 1437  # digits' 1797 rows: 80% to train, the last 360 to test
BAD_ROW = 100  # in the second batch of every epoch, times 1e5
STEPS = EPOCHS * -(-TRAIN // BATCH)  # 23 batches an epoch
FORWARD = fs.OVERFLOW_KINDS.index("forward")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def digits():
  datasets = pytest.importorskip("sklearn.datasets")
  x, y = datasets.load_digits(return_X_y=True)
  order = np.random.default_rng(0).permutation(len(x))
  x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int32)
  train = x[:TRAIN].copy()
  train[BAD_ROW] *= 1e5  # beyond float16's 65504: the forward pass overflows
  return train, y[:TRAIN], x[TRAIN:], y[TRAIN:]


@pytest.fixture
def mixed_float16():
  """Keras's global mixed_float16 policy for one test, then the one
  before."""
  before = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_float16")
  yield
  keras.mixed_precision.set_global_policy(before)


class Classifier(fs.keras.KeepStateOnSkip, keras.Sequential):
  """A Sequential whose train_step keeps a skipped step's model state."""


def _model(cls=keras.Sequential):
  """Dense, BatchNorm, Dense on digits, its weights drawn from seed 0:
  every model made here starts from the same values."""
  keras.utils.set_random_seed(0)
  return cls(
    [
      keras.Input((64,)),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.BatchNormalization(),
      keras.layers.Dense(10, dtype="float32"),
    ]
  )


def _tx(optimizer=None):
  return fs.chain(
    fs.fp16_loss_scale(fs.keras_scaler()), optimizer or optax.adam(1e-3)
  )


def _values(variables):
  return [np.asarray(v.value) for v in variables]


def _finite(arrays):
  return all(np.isfinite(a).all() for a in arrays)


def _accuracy(model, x, y):
  pred = model.predict(x, batch_size=len(x), verbose=0)
  return float(np.mean(np.argmax(pred, -1) == y)), pred


def _custom_loop(model, tx, x, y):
  """docs/frameworks.md's Keras loop, on fit's batches in fit's order; the
  trained values are written into ``model``. Returns the optax state and
  each epoch's ``(loss, rows)`` of its applied steps."""

  def loss_fn(trainable, non_trainable, xb, yb):
    pred, non_trainable = model.stateless_call(
      trainable, non_trainable, xb, training=True
    )
    return LOSS(yb, pred), non_trainable

  @jax.jit
  def step(trainable, non_trainable, opt_state, xb, yb):
    (loss, new), grads = fs.value_and_grad(loss_fn, opt_state, has_aux=True)(
      trainable, non_trainable, xb, yb
    )
    updates, opt_state = tx.update(grads, opt_state, trainable, value=loss)
    non_trainable = fs.select_on_overflow(opt_state, new=new, old=non_trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    skipped = fs.scale_metrics(opt_state)["overflow"]
    return new_trainable, non_trainable, opt_state, (loss, skipped)

  trainable = [v.value for v in model.trainable_variables]
  non_trainable = [v.value for v in model.non_trainable_variables]
  opt_state = tx.init(trainable)
  applied = []
  for _ in range(EPOCHS):
    applied.append([])
    for i in range(0, len(x), BATCH):
      trainable, non_trainable, opt_state, (loss, skipped) = step(
        trainable, non_trainable, opt_state, x[i : i + BATCH], y[i : i + BATCH]
      )
      if not skipped:
        applied[-1].append((float(loss), len(x[i : i + BATCH])))
  for v, value in zip(model.trainable_variables, trainable):
    v.assign(value)
  for v, value in zip(model.non_trainable_variables, non_trainable):
    v.assign(value)
  return opt_state, applied


def _fit(model, x, y, **kwargs):
  batches = []
  record = keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda _, logs: batches.append(dict(logs))
  )
  history = model.fit(
    x,
    y,
    batch_size=kwargs.pop("batch_size", BATCH),
    shuffle=False,
    verbose=0,
    callbacks=[record, *kwargs.pop("callbacks", [])],
    **kwargs,
  )
  return history.history, batches


def test_the_issue_table(digits, mixed_float16):
  x, y, x_test, y_test = digits
  rows = {}
  # Keras's own: compile wraps Adam in its LossScaleOptimizer (mixed_float16).
  keras_model = _model()
  init = helpers.bits(_values(keras_model.variables))
  keras_model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
  lso = keras_model.optimizer
  assert isinstance(lso, keras.optimizers.LossScaleOptimizer)
  history, _ = _fit(keras_model, x, y, epochs=EPOCHS)
  accuracy, pred = _accuracy(keras_model, x_test, y_test)
  stats = _values(keras_model.non_trainable_variables)
  skipped = STEPS - int(lso.iterations.value)  # the inner Adam's steps
  rows["keras fit + LossScaleOptimizer"] = (
    accuracy,
    _finite(stats),
    skipped,
    float(lso.dynamic_scale.value),
  )
  # Poisoned for good: every prediction NaN (argmax 0), every epoch's loss
  # NaN; one forward overflow an epoch skipped, 2**15 halved 15 times.
  assert np.isnan(pred).all() and accuracy == float(np.mean(y_test == 0))
  assert np.isnan(history["loss"]).all()
  assert not _finite(stats) and skipped == EPOCHS
  assert float(lso.dynamic_scale.value) == 1.0

  tx = _tx()
  loop_model = _model()
  assert helpers.bits(_values(loop_model.variables)) == init
  loop_state, applied = _custom_loop(loop_model, tx, x, y)
  loop_accuracy, _ = _accuracy(loop_model, x_test, y_test)
  m = fs.scale_metrics(loop_state)
  rows["custom loop"] = (
    loop_accuracy,
    _finite(_values(loop_model.non_trainable_variables)),
    int(m["skipped_steps"]),
    float(m["loss_scale"]),
  )
  assert rows["custom loop"][1:] == (True, EPOCHS, 1.0)
  assert loop_accuracy > 0.95

  model = _model(Classifier)
  model.compile(optimizer=tx, loss=LOSS)
  assert type(model.optimizer) is fs.keras.Optimizer  # no Keras wrapper
  history, batches = _fit(model, x, y, epochs=EPOCHS)
  accuracy, _ = _accuracy(model, x_test, y_test)
  opt_state = model.optimizer.opt_state
  m = fs.scale_metrics(opt_state)
  rows["KeepStateOnSkip + compile(optimizer=tx) + fit"] = (
    accuracy,
    _finite(_values(model.non_trainable_variables)),
    int(m["skipped_steps"]),
    float(m["loss_scale"]),
  )
  for name, row in rows.items():
    print(
      f"{name}: accuracy {row[0]:.4f}, statistics finite {row[1]}, "
      f"skipped {row[2]}, final scale {row[3]}"
    )
  # The custom loop's variables and optimizer state, bit for bit.
  assert helpers.bits(_values(model.variables)) == (
    helpers.bits(_values(loop_model.variables))
  )
  assert helpers.bits(opt_state) == helpers.bits(loop_state)
  assert accuracy == loop_accuracy
  # iterations counts the applied steps, as Keras's LossScaleOptimizer.
  assert int(model.optimizer.iterations.value) == STEPS - EPOCHS
  # History: a finite loss each epoch, the scale and the skips.
  assert np.isfinite(history["loss"]).all()
  # Each epoch's loss, the loop's mean over the applied steps (each weighted
  # by its rows, as Keras's loss tracker): a sum of 22 positive float32
  # terms, then a division, each order within 23 roundings of 2**-24.
  means = []
  for epoch in applied:
    losses, rows = zip(*epoch)
    means.append(np.average(losses, weights=rows))
  assert all(len(epoch) == 22 for epoch in applied)
  np.testing.assert_allclose(history["loss"], means, rtol=23 * 2.0**-24)
  assert history["skipped_steps"] == list(range(1, EPOCHS + 1))
  assert history["loss_scale"] == [2.0 ** (14 - e) for e in range(EPOCHS)]
  # The skipped step's batch logs: a forward overflow, and the loss of the
  # step before it (its loss tracker's variables kept).
  bad = [i for i, logs in enumerate(batches) if logs["overflow_kind"]]
  assert bad == [e * 23 + BAD_ROW // BATCH for e in range(EPOCHS)]
  for i in bad:
    assert batches[i]["overflow_kind"] == FORWARD
    assert batches[i]["loss"] == batches[i - 1]["loss"]


# --- fit's callbacks, metrics, validation and History, on 512 rows -----------


def _small(digits, rows=512):
  x, y, x_val, y_val = digits
  return x[:rows], y[:rows], x_val[:128], y_val[:128]


def test_fit_runs_the_callbacks_metrics_and_validation(
  digits, mixed_float16, tmp_path
):
  x, y, x_val, y_val = _small(digits)  # 8 batches, the second one bad
  rate = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  tx = _tx(rate)
  model = _model(Classifier)
  model.compile(optimizer=tx, loss=LOSS, metrics=["accuracy"])
  stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=1e9)
  checkpoints = str(tmp_path / "epoch{epoch}.keras")
  history, batches = _fit(
    model,
    x,
    y,
    epochs=4,
    validation_data=(x_val, y_val),
    callbacks=[
      keras.callbacks.TerminateOnNaN(),
      keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5),
      # Halves the rate when the loss did not fall by 1e9: after epoch 2.
      keras.callbacks.ReduceLROnPlateau("loss", 0.5, patience=0, min_delta=1e9),
      keras.callbacks.ModelCheckpoint(checkpoints),
      stopper,
    ],
  )
  # EarlyStopping read the epochs' losses: the first sets the best, the
  # second fails to beat it by min_delta and stops (patience 0).
  assert len(history["loss"]) == 2 and stopper.stopped_epoch == 1
  # TerminateOnNaN did not stop at a skipped step: its loss is finite.
  assert set(history) == {
    "loss",
    "accuracy",
    "val_loss",
    "val_accuracy",
    "loss_scale",
    "skipped_steps",
    "overflow_kind",
    "learning_rate",
  }
  for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
    assert np.isfinite(history[key]).all(), key
  assert history["skipped_steps"] == [1.0, 2.0]
  assert history["loss_scale"] == [2.0**14, 2.0**13]
  # LearningRateScheduler halved the chain's rate as each epoch began (the
  # logged rates), and ReduceLROnPlateau once more after the second.
  rate = np.float32(1e-2)
  assert history["learning_rate"] == [float(rate / 2), float(rate / 4)]
  assert model.optimizer.learning_rate == rate / 8
  hyperparams = model.optimizer.opt_state[1].hyperparams
  assert hyperparams["learning_rate"] == rate / 8
  # Each skipped step's logs: the metrics of the step before it, kept.
  for i in (1, 9):
    assert batches[i]["overflow_kind"] == FORWARD
    for key in ("loss", "accuracy"):
      assert batches[i][key] == batches[i - 1][key], (i, key)
  # evaluate: the last validation's figures, the same weights and program.
  scores = model.evaluate(
    x_val, y_val, batch_size=BATCH, return_dict=True, verbose=0
  )
  assert scores["loss"] == history["val_loss"][-1]
  assert scores["accuracy"] == history["val_accuracy"][-1]
  assert _finite([model.predict(x_val, verbose=0)])
  # ModelCheckpoint saved each epoch; the last is the model, bit for bit.
  saved = keras.models.load_model(
    checkpoints.format(epoch=2),
    custom_objects={"Classifier": Classifier, "fp16_scaling>tx": tx},
  )
  assert helpers.bits(_values(saved.variables)) == (
    helpers.bits(_values(model.variables))
  )
  assert helpers.bits(_values(saved.optimizer.variables)) == (
    helpers.bits(_values(model.optimizer.variables))
  )


def test_keras_own_fit_stops_at_the_skip_under_terminate_on_nan(
  digits, mixed_float16
):
  # The baseline of the test above: Keras's epoch loss averages the skipped
  # step's NaN, and TerminateOnNaN stops at it (its second batch).
  x, y, _, _ = _small(digits)
  model = _model()
  model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
  _, batches = _fit(
    model, x, y, epochs=2, callbacks=[keras.callbacks.TerminateOnNaN()]
  )
  assert len(batches) == 2 and np.isnan(batches[1]["loss"])


def test_an_optax_schedule_counts_the_applied_steps(digits, mixed_float16):
  x, y, _, _ = _small(digits, rows=256)  # 4 batches, the second one bad
  schedule = optax.exponential_decay(1e-2, transition_steps=1, decay_rate=0.5)
  model = _model(Classifier)
  model.compile(
    optimizer=_tx(optax.inject_hyperparams(optax.adam)(learning_rate=schedule)),
    loss=LOSS,
  )
  _fit(model, x, y, epochs=1)
  # The chain keeps the skipped step's Adam state, its count too: the rate
  # of the third applied step (inject_hyperparams reads the count first).
  assert model.optimizer.learning_rate == schedule(2)
  # A rate set here would not last: the schedule sets it at every step.
  with pytest.raises(TypeError, match="optax schedule"):
    model.optimizer.learning_rate = 0.1
  keras_schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 1, 0.5)
  with pytest.raises(TypeError, match="optax schedule"):
    model.optimizer.learning_rate = keras_schedule


def _one_epoch(model, x, y, **compile_kwargs):
  model.compile(optimizer=_tx(), loss=LOSS, **compile_kwargs)
  history, _ = _fit(model, x, y, epochs=1)
  assert history["skipped_steps"] == [1.0]
  assert _finite(_values(model.non_trainable_variables))
  return helpers.bits(_values(model.variables))


def test_steps_per_execution_functional_and_wrapped_models(
  digits, mixed_float16
):
  x, y, _, _ = _small(digits, rows=256)
  reference = _one_epoch(_model(Classifier), x, y)
  assert _one_epoch(_model(Classifier), x, y, steps_per_execution=2) == (
    reference
  )
  # A model built elsewhere, wrapped: the same train_step and compile.
  assert _one_epoch(fs.keras.keep_state_on_skip(_model()), x, y) == reference

  class Functional(fs.keras.KeepStateOnSkip, keras.Model):
    """The functional API: Model(inputs, outputs)."""

  keras.utils.set_random_seed(0)
  inputs = keras.Input((64,))
  hidden = keras.layers.Dense(64, activation="relu")(inputs)
  outputs = keras.layers.Dense(10, dtype="float32")(
    keras.layers.BatchNormalization()(hidden)
  )
  assert _one_epoch(Functional(inputs, outputs), x, y) == reference


def test_run_eagerly_keeps_every_bit_of_a_skipped_step(digits, mixed_float16):
  x, y, _, _ = digits
  model = _model(Classifier)
  model.compile(optimizer=_tx(), loss=LOSS, run_eagerly=True)
  before = helpers.bits(_values(model.variables))
  bad = slice(BATCH, 2 * BATCH)  # the batch of BAD_ROW
  logs = model.train_on_batch(x[bad], y[bad], return_dict=True)
  assert helpers.bits(_values(model.variables)) == before
  assert logs["skipped_steps"] == 1 and logs["loss_scale"] == 2.0**14
  assert logs["overflow_kind"] == FORWARD


# --- saving and loading ------------------------------------------------------


def test_a_saved_model_loads_with_its_chain_and_trains_on(
  digits, mixed_float16, tmp_path
):
  x, y, _, _ = _small(digits, rows=256)
  tx = _tx()
  model = _model(Classifier)
  model.compile(optimizer=tx, loss=LOSS)
  _fit(model, x, y, epochs=1)
  path = str(tmp_path / "model.keras")
  model.save(path)
  with pytest.raises(ValueError, match="'fp16_scaling>tx': tx.*compile=False"):
    keras.models.load_model(path, custom_objects={"Classifier": Classifier})
  other = fs.chain(fs.fp16_loss_scale(fs.keras_scaler()), optax.sgd(0.1))
  with pytest.raises(ValueError, match="another chain's"):
    keras.models.load_model(
      path, custom_objects={"Classifier": Classifier, "fp16_scaling>tx": other}
    )
  weights_only = keras.models.load_model(
    path, custom_objects={"Classifier": Classifier}, compile=False
  )
  assert helpers.bits(_values(weights_only.variables)) == (
    helpers.bits(_values(model.variables))
  )
  loaded = keras.models.load_model(
    path, custom_objects={"Classifier": Classifier, "fp16_scaling>tx": tx}
  )
  # compile=True under mixed_float16: the mixin's compile, no Keras wrapper.
  assert type(loaded.optimizer) is fs.keras.Optimizer
  assert helpers.bits(_values(loaded.optimizer.variables)) == (
    helpers.bits(_values(model.optimizer.variables))
  )
  # One more epoch each: the same variables, bit for bit.
  _fit(model, x, y, epochs=1)
  history, _ = _fit(loaded, x, y, epochs=1)
  assert history["skipped_steps"] == [2.0]
  assert helpers.bits(_values(loaded.variables)) == (
    helpers.bits(_values(model.variables))
  )


# --- refusals, each naming the fix --------------------------------------------


def _unchanged_after(model, call):
  before = helpers.bits(_values(model.variables))
  call()
  assert helpers.bits(_values(model.variables)) == before


def test_the_mixin_after_keras_model_in_the_bases_is_refused():
  with pytest.raises(
    TypeError, match=r"class Wrong\(fs.keras.KeepStateOnSkip, Sequential\)"
  ):

    class Wrong(keras.Sequential, fs.keras.KeepStateOnSkip):
      """Keras's train_step first in the MRO."""


def test_keras_loss_scale_optimizer_around_it_is_refused(
  digits, mixed_float16, tmp_path
):
  tx = _tx()
  # A plain model under mixed_float16: compile would wrap the optimizer.
  with pytest.raises(ValueError, match="auto_scale_loss=False"):
    _model().compile(optimizer=fs.keras.Optimizer(tx), loss=LOSS)
  with pytest.raises(ValueError, match="auto_scale_loss=False"):
    _model(Classifier).compile(optimizer=tx, loss=LOSS, auto_scale_loss=True)
  with pytest.raises(ValueError, match="auto_scale_loss=False"):
    keras.optimizers.LossScaleOptimizer(fs.keras.Optimizer(tx))
  with pytest.raises(ValueError, match="no loss_scale_factor"):
    fs.keras.Optimizer(tx).loss_scale_factor = 128.0
  plain = _model()
  plain.compile(
    optimizer=fs.keras.Optimizer(tx), loss=LOSS, auto_scale_loss=False
  )
  assert type(plain.optimizer) is fs.keras.Optimizer
  # A wrapped model compiles with it itself; saved, it loads as the plain
  # model it is, which compile=True wraps: refused, naming compile=False.
  wrapped = fs.keras.keep_state_on_skip(_model())
  wrapped.compile(optimizer=tx, loss=LOSS)
  assert type(wrapped.optimizer) is fs.keras.Optimizer
  wrapped.save(path := str(tmp_path / "wrapped.keras"))
  with pytest.raises(ValueError, match="compile=False"):
    keras.models.load_model(path, custom_objects={"fp16_scaling>tx": tx})


def test_the_optimizer_and_the_mixin_each_refuse_to_run_alone(digits):
  x, y, _, _ = _small(digits, rows=BATCH)
  plain = _model()
  plain.compile(optimizer=fs.keras.Optimizer(_tx()), loss=LOSS)
  with pytest.raises(ValueError, match="fs.keras.keep_state_on_skip"):
    _unchanged_after(plain, lambda: plain.fit(x, y, verbose=0))
  mixin = _model(Classifier)
  mixin.compile(optimizer="adam", loss=LOSS)
  with pytest.raises(ValueError, match=r"Adam; .*model.compile\(optimizer=tx"):
    _unchanged_after(mixin, lambda: mixin.fit(x, y, verbose=0))


def test_bad_arguments_are_refused_with_the_fix():
  with pytest.raises(TypeError, match=r"takes an fs.chain.*got"):
    fs.keras.Optimizer(optax.adam(1e-3))
  with pytest.raises(TypeError, match="wraps a keras.Model"):
    fs.keras.keep_state_on_skip(keras.layers.Dense(1))
  optimizer = fs.keras.Optimizer(_tx())
  with pytest.raises(ValueError, match=r"not built.*optimizer.build"):
    _ = optimizer.opt_state
  optimizer.build(_model().trainable_variables)
  with pytest.raises(AttributeError, match="inject_hyperparams"):
    _ = optimizer.learning_rate
  with pytest.raises(AttributeError, match="inject_hyperparams"):
    optimizer.learning_rate = 0.1


def test_another_backend_is_refused_by_name():
  # Keras reads its backend once, when first imported: a fresh process.
  script = textwrap.dedent(
    """
    import keras, optax
    import fp16_scaling as fs
    tx = fs.chain(fs.fp16_loss_scale(fs.keras_scaler()), optax.sgd(0.1))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    calls = [
      lambda: fs.keras.Optimizer(tx),
      lambda: type("M", (fs.keras.KeepStateOnSkip, keras.Model), {}),
      lambda: fs.keras.keep_state_on_skip(model),
    ]
    for call in calls:
      try:
        call()
        print("not refused")
      except RuntimeError as e:
        print(e)
    """
  )
  env = {**os.environ, "KERAS_BACKEND": "numpy"}
  out = subprocess.run(
    [sys.executable, "-c", script],
    env=env,
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.splitlines()
  assert len(out) == 3, out
  for what, line in zip(
    ["Optimizer", "KeepStateOnSkip", "keep_state_on_skip"], out
  ):
    assert line.startswith(f"fs.keras.{what} runs on Keras's JAX backend")
    assert "'numpy' backend" in line and "KERAS_BACKEND=jax" in line


# --- the overflow kind, told after the update ---------------------------------


@pytest.mark.parametrize("scaler", [fs.keras_scaler(), fs.static_scaler(8.0)])
def test_with_value_is_the_kind_the_update_records_given_the_loss(scaler):
  # The oracle: the same update, given value= at once. keras_scaler is off
  # its floor (forward, backward); static_scaler always at it (persistent).
  tx = fs.chain(fs.fp16_loss_scale(scaler), optax.sgd(0.1))
  params = np.ones(3, np.float32)

  @jax.jit
  def given(grads, loss):
    return tx.update(grads, tx.init(params), params, value=loss)[1][0]

  @jax.jit
  def told(grads, loss):
    without = tx.update(grads, tx.init(params), params)[1][0]
    return _loss_scale.with_value(without, loss)

  kinds = set()
  for grads in (np.ones(3, np.float32), np.array([1.0, np.inf, 0.0])):
    for loss in (np.float32(2.0), np.float32(np.nan)):
      expected, got = given(grads, loss), told(grads, loss)
      assert helpers.bits(got) == helpers.bits(expected)
      kinds.add(fs.OVERFLOW_KINDS[int(got.overflow_kind)])
  floor = scaler.backoff_factor == 1.0
  assert kinds == {"none", "forward", "persistent" if floor else "backward"}


def _inf_loss_then_backward_overflow(cls, **compile_kwargs):
  """The kinds of one epoch of two batches of 8 rows under a ``cls`` model.

  Batch 1 is applied with an inf loss: a monitoring term no weight moves
  (its gradient is zero), so Keras's running mean of the epoch's loss is inf
  from then on. Batch 2's loss is finite and its float16 backward pass
  overflows: its loss's gradient, 2 * 600 / 8 times 2**15, is past 65504.
  """

  def loss(y, pred):
    monitor = jax.lax.stop_gradient(jnp.where(y[0, 0] < 0, jnp.inf, 0.0))
    return jnp.mean((pred - y) ** 2) + monitor

  model = cls(
    [
      keras.Input((2,)),
      keras.layers.Dense(1, kernel_initializer="ones", dtype="mixed_float16"),
    ]
  )
  model.compile(optimizer=_tx(optax.sgd(1e-6)), loss=loss, **compile_kwargs)
  x = np.repeat(np.float32([[0.1, 0.1], [300.0, 300.0]]), 8, axis=0)
  y = np.repeat(np.float32([[-0.1], [0.0]]), 8, axis=0)
  history, batches = _fit(model, x, y, batch_size=8, epochs=1)
  assert history["skipped_steps"] == [1.0]
  return [fs.OVERFLOW_KINDS[int(logs["overflow_kind"])] for logs in batches]


def test_a_later_overflow_is_told_by_its_own_loss_not_the_epochs():
  # Backward, as the step's own loss tells; the epoch's mean would say
  # forward.
  assert _inf_loss_then_backward_overflow(Classifier) == ["none", "backward"]

  class TrackerLast(Classifier):
    """Lists its metrics with Keras's loss tracker last, not first."""

    @property
    def metrics(self):
      return super().metrics[::-1]

  # No loss tracker where Keras puts it: the kind is unknown, not guessed
  # from another metric (here the compiled ones, first).
  kinds = _inf_loss_then_backward_overflow(TrackerLast, metrics=["mae"])
  assert kinds == ["none", "unknown"]
