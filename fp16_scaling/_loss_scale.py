"""``fp16_loss_scale``: its configuration, and what :func:`chain` does with
it each step: record the overflow, the norm and the kind from the one
measurement, and step the loss scale for the next step (docs/design.md,
"State").
"""

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from fp16_scaling import _diagnostics
from fp16_scaling import _donation
from fp16_scaling import _measure
from fp16_scaling import _norm
from fp16_scaling import _range
from fp16_scaling import _sharding
from fp16_scaling import _stacked
from fp16_scaling import _validate
from fp16_scaling._lookup import refuse_masked
from fp16_scaling._measure import Measurement
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import check_scaler
from fp16_scaling._states import BACKWARD
from fp16_scaling._states import FORWARD
from fp16_scaling._states import NONE
from fp16_scaling._states import PERSISTENT
from fp16_scaling._states import UNKNOWN
from fp16_scaling._states import Built
from fp16_scaling._states import GradRange
from fp16_scaling._states import LeafPaths
from fp16_scaling._states import LossScaleState
from fp16_scaling._states import StackedRange
from fp16_scaling._states import register_with_flax

_UNGUARDED = (
  "fp16_loss_scale runs only as the first element of fs.chain: alone, or "
  "in a plain optax.chain, nothing would skip the optimizer on an overflow "
  "step, and its momentum would move the parameters. Write "
  "fs.chain(fs.fp16_loss_scale(scaler), fs.clip_by_unscaled_norm(max_norm), "
  "optimizer) in place of optax.chain(...)."
)


def _gradient_tree(params):
  """The part of ``params`` the gradients have the tree of."""
  return params.fast if isinstance(params, optax.LookaheadParams) else params


def _leaf_fitter(paths: LeafPaths, leaves) -> Callable:
  """Maps a per-leaf vector of ``leaves`` onto the state's leaves: the
  identity, or zeros with a warning when the leaf counts differ."""
  n = len(paths)
  if len(leaves) == n:
    return lambda x: x
  _validate.warn(
    f"fp16_loss_scale: the gradients have {len(leaves)} leaves, the params "
    f"its init saw had {n}: a wrapper whose params are not the gradients' "
    "tree. Overflow detection, the scale and the norms are unaffected, but "
    "per-leaf attribution is off (overflow_report names no leaves). Build "
    "the state with tx.init(params) from params of the gradients' tree to "
    "have it.",
  )
  return lambda x: jnp.zeros(x.shape[:-1] + (n,), x.dtype)


def _warn_float16_params(leaves) -> None:
  """Warns of float16 parameters: they have no float32 master copy."""
  if any(jnp.result_type(x) == jnp.float16 for x in leaves):
    _validate.warn(
      "fp16_loss_scale: some params are float16, so the optimizer updates "
      "float16 weights and small updates round away (no float32 master "
      "weights). Keep the params in float32 and compute in float16: Flax "
      "nnx.Linear(..., dtype=jnp.float16, param_dtype=jnp.float32), Linen "
      "nn.Dense(..., dtype=jnp.float16), or cast in the forward pass.",
    )


def _warn_bfloat16_grads(leaves, scaler: Scaler) -> None:
  """bfloat16 has float32's exponent range: a loss scale only costs."""
  scaled = scaler.dynamic or scaler.init_scale != 1.0
  if scaled and any(jnp.result_type(x) == jnp.bfloat16 for x in leaves):
    _validate.warn(
      "fp16_loss_scale: the gradients are bfloat16, which has float32's "
      "exponent range and needs no loss scaling; a scale other than 1 "
      "only risks overflow. Use fs.no_scaler() (non-finite steps are still "
      "skipped), or from_deepspeed_config with fp16.enabled false.",
    )


def _names(tree) -> list:
  """The leaves' names: their paths, an nnx ``Variable``'s without its
  ``.value``, and ``<root>`` for a bare array."""
  names = []
  for path, _ in jax.tree_util.tree_leaves_with_path(tree):
    last = path[-1] if path else None
    if len(path) > 1 and getattr(last, "name", None) == "value":
      path = path[:-1]
    names.append(jax.tree_util.keystr(path) or "<root>")
  return names


def _listed(names) -> str:
  """The first names, for a message."""
  return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _check_gradient_tree(updates, params) -> None:
  """Raises when ``params`` are given and the gradients are not of their
  tree (of its fast weights under ``optax.lookahead``)."""
  if params is None:
    return
  params = _gradient_tree(params)
  if jax.tree.structure(updates) == jax.tree.structure(params):
    return
  grads, names = _names(updates), _names(params)
  if grads != names:
    raise ValueError(
      f"fp16_loss_scale: the gradients are not of the params' tree: "
      f"{len(grads)} leaves ({_listed(grads)}) for {len(names)} params "
      f"({_listed(names)}). A "
      "gradient with argnums=(0, 1), or of the batch, holds more than the "
      "params': take the gradient with respect to the params alone "
      "(argnums=0, or the argnums of the params), and pass that."
    )


def _overflow_kind(overflow, value, at_floor) -> jax.Array:
  """The step's kind code, an index into ``_states.KINDS``.

  Args:
    overflow: bool scalar, whether the step's gradients overflowed.
    value: the loss passed as ``value=``, or None.
    at_floor: bool scalar, whether the scale that made the gradients sat at
      its floor (``Scaler.at_floor``).

  Returns:
    int32: NONE on a clean step; else FORWARD for a non-finite loss (at any
    scale: no scale fixes it), PERSISTENT at the floor, and otherwise
    BACKWARD (a finite loss) or UNKNOWN (no loss given).
  """
  if value is None:
    cause = jnp.int32(UNKNOWN)
  else:
    cause = jnp.where(
      jnp.isfinite(_norm.widen(value)), jnp.int32(BACKWARD), jnp.int32(FORWARD)
    )
  # A non-finite loss is the finding whatever the scale: no scale fixes it.
  kind = jnp.where((cause != FORWARD) & at_floor, jnp.int32(PERSISTENT), cause)
  return jnp.where(overflow, kind, jnp.int32(NONE))


def with_value(state: LossScaleState, value) -> LossScaleState:
  """``state``, from an update given no ``value=``, with the overflow kind
  that update records given the loss ``value`` (a floating scalar,
  traceable): given no loss, an overflow's kind is PERSISTENT exactly when
  its scale sat at the floor, the one other thing the kind reads.

  Raises:
    TypeError: ``value`` is not a floating scalar.
  """
  at_floor = state.overflow_kind == PERSISTENT
  value = _validate.scalar_loss(value)
  kind = _overflow_kind(state.overflow, value, at_floor)
  return state._replace(overflow_kind=kind)


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
  """What :func:`fp16_loss_scale` was given, checked; :func:`chain` runs it.

  Attributes:
    scaler: the :class:`Scaler`.
    partition_specs: the gradients' ``PartitionSpec`` pytree, or None.
    grad_range: whether each leaf's :class:`GradRange` is recorded.
    log_overflows: whether overflow steps print a line.
    stacked_axes: the ``stacked_axes`` given, or None.
    built: the :class:`Built` record of all this, as the states it makes
      hold it in their treedef (their ``leaf_paths.built``).
  """

  scaler: Scaler
  partition_specs: Any = None
  grad_range: bool = False
  log_overflows: bool = False
  stacked_axes: Any = None
  built: Built = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    specs = self.partition_specs
    if specs is not None:
      leaves, treedef = jax.tree.flatten(specs, is_leaf=_sharding.is_spec)
      specs = (tuple(leaves), treedef)
    built = Built(
      scaler=_without_init_scale(self.scaler),
      partition_specs=specs,
      stacked_axes=_stacked.check(self.stacked_axes, "fp16_loss_scale"),
    )
    object.__setattr__(self, "built", built)  # frozen: set once, here

  def layout(self, tree) -> Optional[_stacked.Layout]:
    """``stacked_axes`` resolved on ``tree`` (the params), or None without
    them: ``tx.init`` resolves them once and keeps the layout in the
    state's treedef (``leaf_paths.layout``), which each update reads.

    Raises:
      ValueError: ``stacked_axes`` do not fit ``tree``.
    """
    if self.stacked_axes is None:
      return None
    return _stacked.resolve(
      self.stacked_axes, tree, self.partition_specs, "fp16_loss_scale"
    )

  def plan(self, tree) -> _measure.Plan:
    """The measurement's :class:`~fp16_scaling._measure.Plan` of ``tree``
    (the params, or gradients of their tree): each leaf's partition spec
    and the stacked layout, resolved on it; the clip adds its groups where
    the step runs. ``tx.init`` resolves it once into the state's treedef
    (``leaf_paths.plan``), which each update reads (:meth:`state_plan`).

    Raises:
      TypeError, ValueError: ``partition_specs`` or ``stacked_axes`` do
        not fit ``tree``.
    """
    # A tree without leaves (tree_map_params' placeholder) has none to lay
    # out.
    layout = self.layout(tree) if jax.tree.leaves(tree) else None
    return _measure.plan_of(tree, self.partition_specs, layout)

  def state_plan(self, state: LossScaleState, grads) -> _measure.Plan:
    """The plan ``state``'s treedef holds, for its update's ``grads``; one
    resolved on ``grads`` here only where they have another number of
    leaves than the params ``tx.init`` resolved it on (a wrapper whose
    params are not the gradients' tree, as ``_leaf_fitter`` warns).

    Raises:
      ValueError: ``state`` was made by another configuration
        (:func:`check_state`), before its plan is read.
    """
    check_state(self, state)
    plan = state.leaf_paths.plan
    if plan.treedef.num_leaves == len(jax.tree.leaves(grads)):
      return plan
    return self.plan(grads)

  def refuse(self, *args, **kwargs):
    """``init`` and ``update`` anywhere but in :func:`chain`: raises
    RuntimeError."""
    del args, kwargs
    raise RuntimeError(_UNGUARDED)


class LossScale(optax.GradientTransformationExtraArgs):
  """What :func:`fp16_loss_scale` returns, for :func:`chain`: its ``init``
  and ``update`` are its :class:`ScaleConfig`'s ``refuse``, which raises
  anywhere else, and :attr:`config` reads that configuration back."""

  @property
  def config(self) -> ScaleConfig:
    """The :class:`ScaleConfig` :func:`chain` runs."""
    return self.init.__self__


def fp16_loss_scale(
  scaler: Scaler,
  *,
  partition_specs: Optional[Any] = None,
  grad_range: bool = False,
  log_overflows: bool = False,
  stacked_axes: Optional[Any] = None,
) -> LossScale:
  """Loss scaling for float16 training, the first element of :func:`chain`.

  In ``fs.chain(fp16_loss_scale(scaler), ...)``, each step takes the
  gradients of ``loss * current_scale(opt_state)``, measures them once,
  passes them on unscaled (at least float32), records the overflowing
  leaves, the true norm and the overflow's kind (pass ``value=loss`` to
  tell forward from backward), and steps ``scaler``. Outside
  :func:`chain` (alone, or in a plain ``optax.chain``) ``init`` raises:
  nothing there would skip the optimizer on an overflow step.

  Args:
    scaler: a :class:`Scaler` from a preset (several optimizers keep one
      scale with :func:`sync_loss_scales`).
    partition_specs: under ``shard_map``, the gradients' ``PartitionSpec``
      pytree, so that overflow and norm are global. The clip right after
      it and :func:`accumulate_gradients` use these too.
    grad_range: also record each leaf's :class:`GradRange` (two more
      reductions per leaf).
    log_overflows: print a DeepSpeed-style ``OVERFLOW! Skipping step`` line
      from inside the step; for debugging only (docs/diagnostics.md).
    stacked_axes: for scanned (stacked) layers, each stacked leaf's layer
      axis: a pytree prefix of the params with an int or None at each leaf,
      or a callable mapping the params to one (:func:`stacked_under`). The
      per-leaf records are then per layer, and with ``grad_range`` each
      layer's norm too (docs/stacked.md).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` for :func:`chain`, which
    reads its configuration; there, its state is a :class:`LossScaleState`.

  Raises:
    TypeError: ``scaler`` is not a :class:`Scaler`; a flag is not a bool;
      ``stacked_axes`` holds other than ints and None.
    RuntimeError: from ``init`` or ``update``, outside :func:`chain`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.chain(
    ...     fs.fp16_loss_scale(fs.torch_scaler(init_scale=1024.0)),
    ...     optax.sgd(1.0))
    >>> params = jnp.array([1.0, 2.0])
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p**2)
    >>> grads = jax.grad(lambda p: loss(p) * fs.current_scale(state))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates)  # the true gradient, times -1 for sgd(1.0)
    [-2. -4.]
    >>> bad = jnp.array([4.0, jnp.inf], jnp.float16)  # an overflow
    >>> _, state = tx.update(bad, state, params, value=jnp.float32(1.0))
    >>> print(fs.overflow_report(state).kind)  # finite loss: scale too high
    backward

  References:
    Micikevicius et al., Mixed Precision Training, ICLR 2018.
  """
  check_scaler(scaler)
  config = ScaleConfig(
    scaler=scaler,
    partition_specs=partition_specs,
    grad_range=_validate.flag("grad_range", grad_range),
    log_overflows=_validate.flag("log_overflows", log_overflows),
    stacked_axes=stacked_axes,
  )
  return LossScale(config.refuse, config.refuse)


def init_state(config: ScaleConfig, params) -> LossScaleState:
  """The :class:`LossScaleState` before the first step, for ``params``.

  Raises:
    TypeError: a params leaf is not floating.
    ValueError: ``partition_specs`` or ``stacked_axes`` do not fit; params
      masked by ``optax.masked`` or ``optax.multi_transform``.
  """
  register_with_flax()
  params = _gradient_tree(params)
  refuse_masked(params)
  leaves = jax.tree.leaves(params)
  _norm.check_float_leaves(leaves, "fp16_loss_scale params", params)
  _warn_float16_params(leaves)
  # Resolved once, here, and kept in the state's treedef: each update
  # measures by it, and its layout names the units.
  plan = config.plan(params)
  plan.leaf_axes(params, "fp16_loss_scale")  # the specs against the mesh
  sizes = [jnp.size(x) for x in leaves]
  names = _names(params)
  names, sizes, stacks = _stacked.unit_names(plan.layout, names, sizes)
  paths = LeafPaths(names, sizes, stacks, plan=plan, built=config.built)
  # The range's kind follows the configuration, not the leaves: the
  # placeholder optax.tree_map_params inits (no leaves, so no layout) must
  # build the state's structure.
  stacked = config.stacked_axes is not None
  return _initial_state(config.scaler.init(), paths, config.grad_range, stacked)


def step_state(
  config: ScaleConfig,
  state: LossScaleState,
  measurement,
  updates,
  params,
  value,
) -> LossScaleState:
  """The state after a step whose scaled gradients ``updates`` the
  ``measurement`` read; ``value`` is the loss (``value=``), or None.

  Raises:
    ValueError: gradients of another tree than ``params``'.
    TypeError: a ``value`` that is not a floating scalar.
  """
  scaler = config.scaler
  _check_gradient_tree(updates, params)
  if value is not None:
    value = _validate.scalar_loss(value)
  leaves = measurement.grads
  _warn_bfloat16_grads(leaves, scaler)
  grad_range_now = None
  if config.grad_range or scaler.needs_grad_max:
    stacked = state.leaf_paths.layers is not None
    grad_range_now = _grad_range(leaves, measurement, stacked)
  new_state = _next_state(
    scaler,
    state,
    measurement,
    value,
    grad_range_now,
    keep_range=config.grad_range,
  )
  if config.log_overflows:
    _diagnostics.log_if_overflow(state, new_state)
  # Write-only fields read their old values: each keeps its donated buffer.
  return _donation.written_over(state, new_state)


def check_state(config: ScaleConfig, state: LossScaleState) -> None:
  """Raises ValueError when ``state`` was made by another configuration
  (its treedef's :class:`Built` record differs from ``config``'s), before
  anything is read with ``config``: at trace time, eager and under ``jit``
  alike, naming what differs. Its initial scale aside: that does not
  matter once a run is under way."""
  theirs, mine = state.leaf_paths.built, config.built
  if theirs == mine:
    return
  if theirs.scaler != mine.scaler:
    what = f"another scaler ({_differences(theirs.scaler, mine.scaler)})"
  elif theirs.partition_specs != mine.partition_specs:
    what = "other partition_specs"
  else:
    what = "other stacked_axes"
  raise ValueError(
    f"fp16_loss_scale: this state was built with {what}: its counters follow "
    "that configuration's rules, not this one's. Build the state with this "
    "chain's tx.init(params), and move a saved scale across with "
    "fs.scaler_state_dict / fs.load_scaler_state_dict, which check it."
  )


def _without_init_scale(scaler: Scaler) -> Scaler:
  """``scaler`` with its initial scale set aside: it does not matter once a
  run is under way."""
  return dataclasses.replace(scaler, init_scale=1.0)


def _differences(theirs: Scaler, mine: Scaler) -> str:
  """The fields (but the initial scale) in which two scalers differ."""
  theirs, mine = dataclasses.asdict(theirs), dataclasses.asdict(mine)
  return "; ".join(
    f"{k}={theirs[k]!r}, here {mine[k]!r}"
    for k in mine
    if k != "init_scale" and theirs[k] != mine[k]
  )


def _initial_state(
  scaler_state, paths, grad_range: bool, stacked: bool
) -> LossScaleState:
  n = len(paths)
  rng = None
  if grad_range and not stacked:
    rng = GradRange(
      max_abs=jnp.zeros([n], jnp.float32),
      zero_fraction=jnp.zeros([n], jnp.float32),
    )
  elif grad_range:
    rng = StackedRange(
      max_abs=jnp.zeros([n], jnp.float32),
      zero_fraction=jnp.zeros([n], jnp.float32),
      unit_norm=jnp.zeros([n], jnp.float32),
    )
  # Every field its own buffer: a donating step gives each field's buffer
  # to its successor, and one buffer cannot be donated twice.
  return LossScaleState(
    scaler=scaler_state,
    prev_loss_scale=jnp.array(scaler_state.loss_scale, copy=True),
    overflow=jnp.bool_(False),
    skipped_steps=jnp.zeros([], jnp.int32),
    consecutive_skipped_steps=jnp.zeros([], jnp.int32),
    grad_norm=jnp.zeros([], jnp.float32),
    leaf_nonfinite=jnp.zeros([n], jnp.bool_),
    leaf_nonfinite_steps=jnp.zeros([n], jnp.int32),
    overflow_kind=jnp.int32(NONE),
    scale_set=jnp.bool_(False),
    grad_range=rng,
    leaf_paths=paths,
  )


def _grad_range(leaves, measurement: Measurement, stacked: bool) -> GradRange:
  """Per leaf (per unit) the largest finite unscaled ``|g|`` and the zero
  fraction; when ``stacked``, each unit's norm too, from the sums."""
  m = measurement
  peaks, zero_fraction = _range.leaf_range(leaves, m.leaf_axes, m.layer_axes)
  if not stacked:
    return GradRange(peaks * m.inv_scale, zero_fraction)
  sums = jnp.maximum(m.norms.leaf_sums, 0.0)  # a non-finite unit's is -inf
  norm = _norm.safe_sqrt(sums) * m.inv_scale
  return StackedRange(peaks * m.inv_scale, zero_fraction, norm)


def _next_state(scaler, state, measurement, value, grad_range, *, keep_range):
  """The state after a step whose scaled gradients ``measurement`` read;
  ``grad_range`` is None when not measured, kept when ``keep_range``."""
  scale, norms = measurement.scale, measurement.norms
  overflow = norms.overflow
  fit = _leaf_fitter(state.leaf_paths, norms.leaf_nonfinite)
  grad_max = None
  if grad_range is not None:
    grad_max = jnp.max(grad_range.max_abs, initial=0.0)
  leaf_nonfinite = fit(norms.leaf_nonfinite)
  return LossScaleState(
    scaler=scaler.update(state.scaler, overflow, grad_max),
    prev_loss_scale=scale,
    overflow=overflow,
    skipped_steps=state.skipped_steps + overflow.astype(jnp.int32),
    consecutive_skipped_steps=jnp.where(
      overflow, state.consecutive_skipped_steps + 1, 0
    ),
    grad_norm=norms.norm * measurement.inv_scale,
    leaf_nonfinite=leaf_nonfinite,
    leaf_nonfinite_steps=state.leaf_nonfinite_steps
    + leaf_nonfinite.astype(jnp.int32),
    overflow_kind=_overflow_kind(overflow, value, scaler.at_floor(scale)),
    scale_set=state.scale_set,
    grad_range=jax.tree.map(fit, grad_range) if keep_range else None,
    leaf_paths=state.leaf_paths,
  )
