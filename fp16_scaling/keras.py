"""``fs.keras``: Keras 3's ``compile`` and ``fit`` with an :func:`chain`, on
Keras's JAX backend (docs/frameworks.md, "Keras 3").

:class:`Optimizer` is a Keras optimizer whose step is an ``fs.chain``;
:class:`KeepStateOnSkip` (a model mixin) and :func:`keep_state_on_skip` (for
a model built elsewhere) make Keras's own JAX ``train_step`` keep the
non-trainable variables (BatchNorm's statistics) and the metrics of a skipped
step, and log the scale. This module imports Keras: ``import fp16_scaling``
does not import it, ``fs.keras`` does, when first used. Imported before
Keras is, it sets ``KERAS_BACKEND=jax`` unless the variable is set: Keras
reads it once, and would come up on TensorFlow.
"""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax

if "keras" not in sys.modules:
  os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402

from fp16_scaling import _chain
from fp16_scaling import _lookup
from fp16_scaling import _loss_scale
from fp16_scaling._metrics import current_scale
from fp16_scaling._metrics import scale_metrics
from fp16_scaling._select import select_on_overflow

__all__ = ["KeepStateOnSkip", "Optimizer", "keep_state_on_skip"]

# The custom_objects key under which keras.models.load_model takes the chain
# of a saved Optimizer: a chain is code, which a saved model does not hold.
_TX_KEY = "fp16_scaling>tx"

_BACKEND = (
  "{} runs on Keras's JAX backend, and keras was imported with the {!r} "
  "backend. Set KERAS_BACKEND=jax before keras is first imported: "
  "os.environ['KERAS_BACKEND'] = 'jax', then import keras."
)
_NOT_A_CHAIN = (
  "fs.keras.Optimizer takes an fs.chain: fs.keras.Optimizer(fs.chain("
  "fs.fp16_loss_scale(scaler), ..., optimizer)); got {}"
)
_TWICE = (
  "fs.keras.Optimizer scales the loss by its chain's scale: it takes no "
  "loss_scale_factor, and Keras's LossScaleOptimizer, which compile wraps "
  "it in under the mixed_float16 policy, would scale the loss a second time "
  "and skip steps on its own scale. Compile with auto_scale_loss=False: "
  "model.compile(optimizer=fs.keras.Optimizer(tx), ..., "
  "auto_scale_loss=False); a model made with fs.keras.KeepStateOnSkip or "
  "fs.keras.keep_state_on_skip compiles so by itself (load a model saved "
  "from a plain one with keras.models.load_model(path, compile=False), "
  "then wrap and compile it)."
)
_NO_MIXIN = (
  "fs.keras.Optimizer: the model's train_step is Keras's own, which keeps "
  "the non-trainable variables (BatchNorm's statistics) and the metrics "
  "that a skipped step's forward pass wrote, inf or NaN. Make the model "
  "with the mixin, class Model(fs.keras.KeepStateOnSkip, keras.Model) (its "
  "first base), or wrap one built elsewhere: "
  "model = fs.keras.keep_state_on_skip(model)."
)
_NOT_OURS = (
  "fs.keras: the model's optimizer is a {}; only an fs.chain's step tells "
  "which steps were skipped. Compile with one: model.compile(optimizer=tx, "
  "...), tx = fs.chain(fs.fp16_loss_scale(scaler), ..., optimizer)."
)
_ORDER = (
  "class {0}: fs.keras.KeepStateOnSkip comes after keras.Model in its "
  "bases, so Keras's train_step runs instead of the one that wraps it. List "
  "it first: class {0}(fs.keras.KeepStateOnSkip, {1})."
)
_LOAD = (
  "A saved model holds the chain's state, not the "
  "chain, which is code. Pass the chain it was saved with: "
  "keras.models.load_model(path, custom_objects={'fp16_scaling>tx': tx, "
  "...}), or load the model alone with compile=False."
)
_NO_LEARNING_RATE = (
  "fs.keras.Optimizer: its chain holds no learning rate to read or set. "
  "Build the optimizer with one in its state: "
  "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
)

_SCHEDULE = (
  "fs.keras.Optimizer: optimizer.learning_rate sets a number, in a chain "
  "that holds one as a number (optax.inject_hyperparams(optax.adam)("
  "learning_rate=1e-3)). A schedule goes into the chain as an optax "
  "schedule (learning_rate=optax.cosine_decay_schedule(1e-3, 10_000)), "
  "which sets the rate at every step: a rate set here would not last."
)


def _check_backend(what: str) -> None:
  """Raises RuntimeError, naming the fix, when Keras runs another backend
  than JAX."""
  if keras.backend.backend() != "jax":
    raise RuntimeError(_BACKEND.format(what, keras.backend.backend()))


class _FromMixin(list):
  """The optimizer variables that a :class:`KeepStateOnSkip` ``train_step``
  hands to Keras's: a list whose type tells :meth:`Optimizer.stateless_apply`
  that the step's skip reaches the model state."""


@keras.saving.register_keras_serializable(package="fp16_scaling")
class Optimizer(keras.optimizers.Optimizer):
  """A Keras optimizer whose step is an :func:`fp16_scaling.chain`.

  Keras's JAX trainer multiplies the loss by :meth:`scale_loss` (the chain's
  current scale) and steps with :meth:`stateless_apply` (the chain's update,
  which unscales, clips, skips an overflowing step exactly and steps the
  scale). The model's ``train_step`` must be :class:`KeepStateOnSkip`'s,
  which keeps a skipped step's model state and metrics.

  The chain's state lives in Keras variables: ``variables`` is
  ``iterations``, then the state's arrays in ``jax.tree.leaves`` order, so
  ``fit``, ``model.save`` and callbacks carry it; :attr:`opt_state` reads it
  back as the optax state, for ``fs.scale_metrics`` and
  ``fs.overflow_report``. ``iterations`` counts the applied steps, as under
  Keras's ``LossScaleOptimizer``. ``learning_rate`` reads the chain's
  learning rate where its state holds one, and sets it where it holds a
  number (``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``), as
  ``LearningRateScheduler`` and ``ReduceLROnPlateau`` do; a schedule goes
  into the chain as an optax schedule.

  A saved model holds the state; ``keras.models.load_model`` takes the chain
  back as ``custom_objects={"fp16_scaling>tx": tx}``.

  Args:
    tx: an :func:`fp16_scaling.chain`.
    name: the optimizer's name, Keras's.

  Raises:
    TypeError: ``tx`` is not an ``fs.chain``.
    RuntimeError: Keras runs another backend than JAX.
    ValueError: set ``loss_scale_factor``, or wrapped in Keras's
      ``LossScaleOptimizer`` (compile without ``auto_scale_loss=False``
      under ``mixed_float16``); stepped under a model whose ``train_step``
      is not :class:`KeepStateOnSkip`'s.
    AttributeError: ``learning_rate`` of a chain that holds none.
    TypeError: ``learning_rate`` set to a schedule, or in a chain whose
      rate follows an optax schedule.

  Examples:
    >>> import keras, optax, fp16_scaling as fs
    >>> tx = fs.chain(fs.fp16_loss_scale(fs.keras_scaler(initial_scale=8.0)),
    ...               optax.sgd(0.1))
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> optimizer = fs.keras.Optimizer(tx)
    >>> optimizer.build(model.trainable_variables)
    >>> print(fs.current_scale(optimizer.opt_state))
    8.0
  """

  def __init__(self, tx, name=None):
    _check_backend("fs.keras.Optimizer")
    if not isinstance(tx, _chain.Step):
      raise TypeError(_NOT_A_CHAIN.format(type(tx).__name__))
    # The chain holds the learning rate: Keras's stays unread, no variable.
    super().__init__(learning_rate=lambda: None, name=name)
    self.tx = tx

  @property
  def loss_scale_factor(self):
    """None: the chain scales the loss."""
    return None

  @loss_scale_factor.setter
  def loss_scale_factor(self, value):
    # Keras's own __init__ sets None first; anyone after it is refused.
    if "tx" in vars(self):
      raise ValueError(_TWICE)

  def build(self, var_list):
    """Creates the variables: ``iterations``, then the state that
    ``tx.init`` makes from ``var_list``'s values."""
    if self.built:
      return
    super().build(var_list)
    state = self.tx.init([v.value for v in var_list])
    paths, self._treedef = jax.tree_util.tree_flatten_with_path(state)
    for path, leaf in paths:
      self.add_variable(
        shape=leaf.shape,
        dtype=leaf.dtype,
        initializer=leaf,  # an array: Keras's initializer of that value
        name=re.sub(r"\W+", "_", jax.tree_util.keystr(path)).strip("_"),
      )

  def stateless_opt_state(self, optimizer_variables):
    """The optax state that ``optimizer_variables`` (values in
    ``variables`` order) hold; traceable."""
    if not self.built:
      raise ValueError(
        "fs.keras.Optimizer is not built: it builds with the model "
        "(fit, or optimizer.build(model.trainable_variables))"
      )
    return jax.tree.unflatten(self._treedef, list(optimizer_variables)[1:])

  @property
  def opt_state(self):
    """The optax state the variables hold now (inside Keras's
    ``StatelessScope``, the values it maps them to)."""
    return self.stateless_opt_state([v.value for v in self.variables])

  def scale_loss(self, loss):
    """``loss`` in float32 times the chain's current scale."""
    return jnp.asarray(loss).astype(jnp.float32) * current_scale(self.opt_state)

  def stateless_apply(self, optimizer_variables, grads, trainable_variables):
    """One step of the chain on the scaled ``grads``: the new trainable
    and optimizer variables (on a skipped step the trainable ones and the
    optimizer's own state keep every bit)."""
    if not isinstance(optimizer_variables, _FromMixin):
      raise ValueError(_NO_MIXIN)
    params = list(trainable_variables)
    state = self.stateless_opt_state(optimizer_variables)
    updates, state = self.tx.update(list(grads), state, params)
    count = optimizer_variables[0]
    applied = ~_lookup.loss_scale_state(state).overflow
    count = count + applied.astype(count.dtype)
    return optax.apply_updates(params, updates), [
      count,
      *jax.tree.leaves(state),
    ]

  def _with_loss(self, optimizer_variables, loss):
    """``optimizer_variables`` after :meth:`stateless_apply`, whose update
    was given no loss (Keras's trainer computes it but passes it on only
    after the step), with the overflow kind the step's loss ``loss`` tells
    (``"forward"`` for a non-finite loss, ``"backward"`` for a finite
    one)."""
    state = self.stateless_opt_state(optimizer_variables)
    ls = _loss_scale.with_value(_lookup.loss_scale_state(state), loss)
    state = _lookup.replace_loss_scale_state(state, ls)
    return [optimizer_variables[0], *jax.tree.leaves(state)]

  @property
  def learning_rate(self):
    """The learning rate in the chain's state (AttributeError, naming the
    fix, when it holds none)."""
    rate = optax.tree_utils.tree_get(
      self.opt_state, "learning_rate", filtering=_is_array
    )
    if rate is None:
      raise AttributeError(_NO_LEARNING_RATE)
    return rate

  @learning_rate.setter
  def learning_rate(self, value):
    state = self.opt_state
    found = optax.tree_utils.tree_get_all_with_path(state, "learning_rate")
    if not found:
      raise AttributeError(_NO_LEARNING_RATE)
    # A Keras schedule given, or an optax one in the chain (inject_hyperparams
    # names its state as the rate it sets).
    if callable(value) or not all(_is_array(*pair) for pair in found):
      raise TypeError(_SCHEDULE)
    state = optax.tree_utils.tree_set(state, learning_rate=value)
    for variable, leaf in zip(self.variables[1:], jax.tree.leaves(state)):
      variable.assign(leaf)

  def load_own_variables(self, store):
    """Keras's load, refused (ValueError) for a state of another chain."""
    if self.built and len(store.keys()) != len(self.variables):
      raise ValueError(
        f"fs.keras.Optimizer: this chain's state has {len(self.variables)} "
        f"arrays and the saved one {len(store.keys())}, another chain's. "
        + _LOAD
      )
    super().load_own_variables(store)

  def get_config(self):
    """The name: the chain is code, passed back on load."""
    return {"name": self.name}

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """The optimizer from ``config`` and the chain given to
    ``keras.models.load_model`` as ``custom_objects["fp16_scaling>tx"]``
    (ValueError, naming it, without one)."""
    tx = keras.saving.get_registered_object(_TX_KEY, custom_objects)
    if tx is None:
      raise ValueError(f"fs.keras.Optimizer: {_LOAD}")
    return cls(tx, **config)


def _is_array(path, value) -> bool:
  """Whether ``value`` is an array: a learning rate, not the state of the
  schedule that sets it (optax names both ``learning_rate``)."""
  del path
  return isinstance(value, jax.Array)


def _compile(compile_, optimizer="rmsprop", *args, **kwargs):
  """Keras's ``compile_``, with an ``fs.chain`` taken as an
  :class:`Optimizer` and ``auto_scale_loss`` off for one."""
  if isinstance(optimizer, _chain.Step):
    optimizer = Optimizer(optimizer)
  if isinstance(optimizer, Optimizer):
    kwargs.setdefault("auto_scale_loss", False)
  return compile_(optimizer, *args, **kwargs)


def _loss_tracker(model):
  """Keras's loss tracker, a ``keras.metrics.Mean`` named ``loss`` that
  Keras lists first in ``model.metrics`` (so its variables come first in
  ``model.metrics_variables``), or None where a model lists another
  first."""
  first = model.metrics[0] if model.metrics else None
  if isinstance(first, keras.metrics.Mean) and first.name == "loss":
    return first
  return None


def _train_step(model, train_step, state, data):
  """Keras's ``train_step`` (``train_step``), with the non-trainable and
  metric variables of a skipped step kept and the scale logged."""
  optimizer = model.optimizer
  if not isinstance(optimizer, Optimizer):
    raise ValueError(_NOT_OURS.format(type(optimizer).__name__))
  trainable, non_trainable, optimizer_variables, metrics = state
  tracker = _loss_tracker(model)
  # The loss tracker's variables (the first) from zero: after Keras's step
  # they hold this step's loss alone, which tells the overflow's kind; the
  # epoch's are then the old plus the step's.
  n = 0 if tracker is None else len(tracker.variables)
  fresh = [*map(jnp.zeros_like, metrics[:n]), *metrics[n:]]
  state = (trainable, non_trainable, _FromMixin(optimizer_variables), fresh)
  logs, (trainable, new_non_trainable, optimizer_variables, new_metrics) = (
    train_step(state, data)
  )
  if tracker is not None:
    mapping = list(zip(tracker.variables, new_metrics))
    with keras.StatelessScope(state_mapping=mapping):
      loss = tracker.result()
    optimizer_variables = optimizer._with_loss(optimizer_variables, loss)
  # A Mean's update adds to its total and count, as this adds the old.
  added = [old + step for old, step in zip(metrics[:n], new_metrics[:n])]
  new_metrics = [*added, *new_metrics[n:]]
  opt_state = optimizer.stateless_opt_state(optimizer_variables)
  non_trainable, metrics = select_on_overflow(
    opt_state,
    new=(new_non_trainable, new_metrics),
    old=(non_trainable, metrics),
  )
  mapping = list(zip(model.metrics_variables, metrics))
  with keras.StatelessScope(state_mapping=mapping):
    logs = {**logs, **model.get_metrics_result()}
  m = scale_metrics(opt_state)
  for key in ("loss_scale", "skipped_steps", "overflow_kind"):
    logs[key] = m[key]
  return logs, (trainable, non_trainable, optimizer_variables, metrics)


class KeepStateOnSkip:
  """A Keras model mixin: Keras's own JAX ``train_step``, with a skipped
  step's model state and metrics kept, and the scale logged.

  Keras's ``train_step`` returns the non-trainable variables (BatchNorm's
  moving statistics, any stateful layer's) and the metric variables that
  the forward pass wrote, whether or not the optimizer skipped the step: an
  overflowing batch writes inf or NaN into them for good. This one calls
  Keras's (``super().train_step``), then keeps their old values where the
  :class:`Optimizer`'s chain skipped the step (``fs.select_on_overflow``),
  so the epoch's loss and metrics leave a skipped step out. Its logs, in
  ``History`` and the progress bar, add ``loss_scale`` (the next step's),
  ``skipped_steps`` and ``overflow_kind`` (a code into
  ``fp16_scaling.OVERFLOW_KINDS``: forward or backward as the step's own
  loss tells, which Keras's loss tracker, run from zero for the step,
  records; unknown where the model lists another metric first).

  ``compile`` takes an ``fs.chain`` as the optimizer (and an
  :class:`Optimizer`), and compiles with ``auto_scale_loss=False`` unless
  told otherwise, so that Keras does not wrap it in its
  ``LossScaleOptimizer`` under ``mixed_float16`` (a saved model loads
  compiled so too).

  Use it as the model's first base::

    class Model(fs.keras.KeepStateOnSkip, keras.Model): ...

  Raises:
    TypeError: at the class statement, listed after ``keras.Model`` in the
      bases (Keras's ``train_step`` would run instead of its).
    RuntimeError: at the class statement, Keras runs another backend than
      JAX.
    ValueError: at ``fit``, the model was compiled with another optimizer
      than an ``fs.chain``.

  Examples:
    >>> import keras, numpy as np, optax, fp16_scaling as fs
    >>> class Model(fs.keras.KeepStateOnSkip, keras.Sequential):
    ...   pass
    >>> model = Model([keras.Input((2,)),
    ...                keras.layers.Dense(1, dtype="mixed_float16")])
    >>> tx = fs.chain(fs.fp16_loss_scale(fs.keras_scaler(initial_scale=8.0)),
    ...               optax.sgd(0.1))
    >>> model.compile(optimizer=tx, loss="mse")
    >>> x = np.full((4, 2), 1e5, np.float32)  # float16's forward overflows
    >>> logs = model.train_on_batch(x, np.zeros(4), return_dict=True)
    >>> kind = fs.OVERFLOW_KINDS[int(logs["overflow_kind"])]
    >>> print(logs["skipped_steps"], logs["loss_scale"], kind)
    1.0 4.0 forward
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _check_backend("fs.keras.KeepStateOnSkip")
    mro = cls.__mro__
    if keras.Model in mro and mro.index(keras.Model) < mro.index(
      KeepStateOnSkip
    ):
      bases = ", ".join(
        b.__name__ for b in cls.__bases__ if b is not KeepStateOnSkip
      )
      raise TypeError(_ORDER.format(cls.__name__, bases))

  def compile(self, optimizer="rmsprop", *args, **kwargs):
    """Keras's ``compile``, with an ``fs.chain`` as the optimizer taken as
    an :class:`Optimizer`, and ``auto_scale_loss=False`` for one."""
    return _compile(super().compile, optimizer, *args, **kwargs)

  def compile_from_config(self, config):
    """Keras's, through this ``compile`` (Keras's skips a model whose
    ``compile`` is its own)."""
    self.compile(**keras.saving.deserialize_keras_object(config))
    if self.built:
      self.optimizer.build(self.trainable_variables)

  def train_step(self, state, data):
    """Keras's JAX ``train_step``, with a skipped step's non-trainable and
    metric variables kept; logs ``loss_scale``, ``skipped_steps`` and
    ``overflow_kind`` too."""
    return _train_step(self, super().train_step, state, data)


def keep_state_on_skip(model):
  """:class:`KeepStateOnSkip` for a model built elsewhere (a
  ``keras.Sequential``, a loaded or a library's model).

  Sets the instance's ``train_step`` and ``compile`` to the mixin's, around
  the ones it had. A saved model does not keep them: wrap it again after
  ``keras.models.load_model``.

  Args:
    model: a ``keras.Model``.

  Returns:
    ``model`` itself, its ``train_step`` and ``compile`` wrapped (unchanged
    when it is a :class:`KeepStateOnSkip` already).

  Raises:
    TypeError: ``model`` is not a ``keras.Model``.
    RuntimeError: Keras runs another backend than JAX.

  Examples:
    >>> import keras, optax, fp16_scaling as fs
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model = fs.keras.keep_state_on_skip(model)
    >>> model.compile(optimizer=fs.chain(fs.fp16_loss_scale(fs.keras_scaler()),
    ...                                  optax.sgd(0.1)), loss="mse")
    >>> type(model.optimizer) is fs.keras.Optimizer
    True
  """
  _check_backend("fs.keras.keep_state_on_skip")
  if not isinstance(model, keras.Model):
    raise TypeError(
      "fs.keras.keep_state_on_skip wraps a keras.Model; got "
      f"{type(model).__name__}"
    )
  if not isinstance(model, KeepStateOnSkip):
    model.train_step = functools.partial(_train_step, model, model.train_step)
    model.compile = functools.partial(_compile, model.compile)
  return model
