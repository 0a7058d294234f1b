"""``fp16_loss_scale``: detect overflow, unscale, and step the loss scale.

The state keeps the scale the current gradients were made with
(``prev_loss_scale`` after the update) apart from the scale for the next
backward pass (``loss_scale``). Unscaling always divides by the former; a
growth or back-off decided on this step changes only the latter. DeepSpeed's
fp16 optimizers (0.19) update the scale before unscaling and so apply half
the gradient on every growth step; here that ordering cannot be written.
"""

import sys
from typing import Any, Callable, NamedTuple, Optional, Tuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp16_scaling import _donation
from fp16_scaling import _guard
from fp16_scaling import _norm
from fp16_scaling import _validate
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import ScalerState

# LossScaleState.overflow_kind codes, indexes into KINDS.
NONE, UNKNOWN, FORWARD, BACKWARD, PERSISTENT = range(5)
KINDS = ("none", "unknown", "forward", "backward", "persistent")


@jax.tree_util.register_pytree_node_class
class LeafPaths:
  """The gradient tree's leaf names and sizes, held statically in the
  state's treedef.

  A pytree node with no children: the paths (``jax.tree_util.keystr``
  strings, in tree order) and element counts live in the tree structure,
  not in arrays. They cost nothing per step, survive ``jit``, ``scan`` and
  ``jax.tree.map``, and come back from any checkpoint restored into a target
  built by ``tx.init(params)`` (the restore that keeps the state's types).
  Paths built from a tree without leaves (``optax.tree_map_params``'
  placeholder) compare equal to any, so specs laid out that way match.
  """

  def __init__(self, paths: Tuple[str, ...], sizes: Tuple[int, ...]):
    self.paths = tuple(paths)
    self.sizes = tuple(int(n) for n in sizes)

  def tree_flatten(self):
    # The node itself is the treedef's metadata, compared by __eq__ below.
    return (), self

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return aux

  def __eq__(self, other):
    # Empty paths come from an init without leaves: optax.tree_map_params
    # calls init with a placeholder to lay a state's specs out, and then
    # matches that state against the real one. They match any paths.
    if self is other:  # every call of a jitted step: no per-leaf work
      return True
    return isinstance(other, LeafPaths) and (
      not self.paths
      or not other.paths
      or (self.paths == other.paths and self.sizes == other.sizes)
    )

  def __hash__(self):
    return hash(LeafPaths)  # equal objects must hash equal; see __eq__

  def __len__(self):
    return len(self.paths)

  def __repr__(self):
    return f"LeafPaths({len(self.paths)} leaves)"


def _register_with_flax() -> None:
  """Lets ``flax.serialization`` save a state holding :class:`LeafPaths`.

  It saves nothing for it and restores the target's paths. Done only when
  the user has loaded flax: fp16_scaling does not import it.
  """
  serialization = sys.modules.get("flax.serialization")
  if serialization is not None:
    serialization.register_serialization_state(
      LeafPaths, lambda _: {}, lambda target, _: target, override=True
    )


class GradRange(NamedTuple):
  """Per-leaf gradient range of the last step (opt-in telemetry).

  Attributes:
    max_abs: float32 vector, per leaf the largest finite ``|g|`` of the
      unscaled gradient (0.0 for an all-zero or all-non-finite leaf).
    zero_fraction: float32 vector, per leaf the fraction of the scaled
      gradient's elements (float16 in fp16 training) that are exactly zero:
      an underflow proxy.
  """

  max_abs: jax.Array
  zero_fraction: jax.Array


class LossScaleState(NamedTuple):
  """State of :func:`fp16_loss_scale`.

  Attributes:
    scaler: the loss-scale machine's state; ``scaler.loss_scale`` is the scale
      for the next backward pass (also available as ``.loss_scale``).
    prev_loss_scale: float32 scale the last step's gradients were made with
      and divided by.
    overflow: bool, whether the last step's gradients had an inf or NaN (and
      so were skipped by :func:`skip_on_overflow`).
    skipped_steps: int32 total of overflowing steps so far.
    grad_norm: float32 true (unscaled) global 2-norm of the last step's
      gradients, before clipping; 0.0 on an overflow step, where no norm
      exists (``overflow`` says so). Never NaN.
    leaf_nonfinite: bool vector, one entry per gradient leaf in tree order:
      whether that leaf held an inf or NaN on the last step.
    leaf_nonfinite_steps: int32 vector, per leaf the number of steps so far
      on which it held an inf or NaN.
    overflow_kind: int32 code of the last step's overflow, an index into
      ``KINDS``: "none", "unknown" (no loss given), "forward" (the loss given
      as ``value`` was not finite), "backward" (finite loss, non-finite
      gradients), "persistent" (overflowed with the scale at its floor).
    grad_range: a :class:`GradRange` with ``grad_range=True``, else None.
    leaf_paths: :class:`LeafPaths`, static: the leaves' names.
  """

  scaler: ScalerState
  prev_loss_scale: jax.Array
  overflow: jax.Array
  skipped_steps: jax.Array
  grad_norm: jax.Array
  leaf_nonfinite: jax.Array
  leaf_nonfinite_steps: jax.Array
  overflow_kind: jax.Array
  grad_range: Optional[GradRange]
  leaf_paths: LeafPaths

  @property
  def loss_scale(self) -> jax.Array:
    return self.scaler.loss_scale


_UNGUARDED = (
  "fp16_loss_scale ran outside skip_on_overflow. In a bare optax.chain the "
  "optimizer after it still runs on an overflow step and its momentum moves "
  "the parameters. Wrap the whole chain: skip_on_overflow(optax.chain("
  "fp16_loss_scale(...), clip_by_unscaled_norm(...), optimizer))."
)


def _gradient_tree(params):
  """The part of ``params`` the gradients have the tree of.

  ``optax.lookahead``'s init gets ``LookaheadParams`` (fast and slow
  weights), its gradients are the fast weights only.
  """
  if isinstance(params, optax.LookaheadParams):
    return params.fast
  return params


def _leaf_fitter(paths: LeafPaths, leaves) -> Callable:
  """Maps a per-leaf vector of ``leaves`` onto the state's leaves.

  When the gradients have the leaves ``init`` saw, the identity. Otherwise
  (a wrapper whose params are not the gradients' tree) per-leaf attribution
  is off, with one warning at trace time: vectors become zeros of the
  state's length, and overflow, scale and norms are unaffected.
  """
  n = len(paths)
  if len(leaves) == n:
    return lambda x: x
  warnings.warn(
    f"fp16_loss_scale: the gradients have {len(leaves)} leaves, the params "
    f"its init saw had {n}: a wrapper whose params are not the gradients' "
    "tree. Overflow detection, the scale and the norms are unaffected, but "
    "per-leaf attribution is off (overflow_report names no leaves). Build "
    "the state with tx.init(params) from params of the gradients' tree to "
    "have it.",
    stacklevel=4,
  )
  return lambda x: jnp.zeros(x.shape[:-1] + (n,), x.dtype)


def _warn_float16_params(leaves) -> None:
  """Float16 parameters have no float32 master copy: updates below half an
  ulp of a weight round away, whatever the scale."""
  if any(jnp.result_type(x) == jnp.float16 for x in leaves):
    warnings.warn(
      "fp16_loss_scale: some params are float16, so the optimizer updates "
      "float16 weights and small updates round away (no float32 master "
      "weights). Keep the params in float32 and compute in float16: Flax "
      "nnx.Linear(..., dtype=jnp.float16, param_dtype=jnp.float32), Linen "
      "nn.Dense(..., dtype=jnp.float16), or cast in the forward pass.",
      stacklevel=4,
    )


def _warn_bfloat16_grads(leaves, scaler: Scaler) -> None:
  """bfloat16 has float32's exponent range: a loss scale only costs."""
  scaled = scaler.dynamic or scaler.init_scale != 1.0
  if scaled and any(jnp.result_type(x) == jnp.bfloat16 for x in leaves):
    warnings.warn(
      "fp16_loss_scale: the gradients are bfloat16, which has float32's "
      "exponent range and needs no loss scaling; a scale other than 1 "
      "only risks overflow. Use fs.no_scaler() (non-finite steps are still "
      "skipped), or from_deepspeed_config with fp16.enabled false.",
      stacklevel=4,
    )


def _leaf_paths(tree) -> LeafPaths:
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  return LeafPaths(
    [jax.tree_util.keystr(path) for path, _ in with_paths],
    [jnp.size(x) for _, x in with_paths],
  )


def _scalar_value(value) -> jax.Array:
  """The loss passed as ``value=``, checked to be one scalar."""
  try:
    value = jnp.asarray(value)
  except TypeError as e:
    raise TypeError(
      f"fp16_loss_scale: value (the loss, tx.update(grads, state, params, "
      f"value=loss)) must be a scalar array: {e}"
    ) from None
  if value.shape != ():
    raise ValueError(
      "fp16_loss_scale: value (the loss, tx.update(grads, state, params, "
      f"value=loss)) must be a scalar, got shape {value.shape}; pass the "
      "mean loss, not per-example losses"
    )
  return value


def _overflow_kind(overflow, value, at_floor) -> jax.Array:
  if value is None:
    cause = jnp.int32(UNKNOWN)
  else:
    cause = jnp.where(
      jnp.isfinite(_norm.widen(value)), jnp.int32(BACKWARD), jnp.int32(FORWARD)
    )
  # A non-finite loss is the finding whatever the scale: no scale fixes it.
  kind = jnp.where((cause != FORWARD) & at_floor, jnp.int32(PERSISTENT), cause)
  return jnp.where(overflow, kind, jnp.int32(NONE))


def _log_overflow(paths, skipped, kind, old, new, nonfinite):
  # Plain numpy first: iterating a jax.Array dispatches a computation, which
  # inside a host callback can deadlock the runtime that called it.
  nonfinite = np.asarray(nonfinite)
  leaves = [p for p, bad in zip(paths, nonfinite.tolist()) if bad]
  shown = ", ".join(leaves[:10]) + (" ..." if len(leaves) > 10 else "")
  print(
    f"[fp16_scaling] OVERFLOW! Skipping step ({int(skipped)} skipped so "
    f"far, {KINDS[int(kind)]}). Attempted loss scale: {float(old):g}, "
    f"reducing to {float(new):g}; non-finite gradient leaves "
    f"({len(leaves)}): {shown or '(none)'}"
  )


def fp16_loss_scale(
  scaler: Scaler,
  *,
  partition_specs: Optional[Any] = None,
  grad_range: bool = False,
  log_overflows: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Loss scaling for float16 training, as the first element of a chain.

  ``update`` receives the gradients of ``loss * current_scale(opt_state)``.
  In one pass over them it decides overflow (any inf or NaN anywhere), which
  leaves overflowed, and the squared norm; it returns the gradients divided
  by the scale they were made with (promoted to at least float32) and steps
  ``scaler``. It must come first in a chain wrapped by
  :func:`skip_on_overflow`, which discards the step when it overflowed:
  ``init`` raises outside the wrapper, and ``update`` raises at trace time
  when something before it changed the gradients or a second
  ``fp16_loss_scale`` runs.

  Pass the loss by optax's extra-args convention, ``tx.update(grads, state,
  params, value=loss)`` (unscaled, or scaled in float32), and an overflow is
  told apart as "forward" (the loss itself is not finite: no scale helps) or
  "backward" (the scale was too high: normal). Without it the kind is
  "unknown"; with the scale at its floor it is "persistent". See
  :func:`overflow_report`.

  Args:
    scaler: a :class:`Scaler` from a preset (``deepspeed_scaler``,
      ``torch_scaler``, ``megatron_scaler``, ``flax_scaler``,
      ``headroom_scaler``, ``static_scaler``, ``no_scaler``).
    partition_specs: under ``shard_map``, the gradients' ``PartitionSpec``
      pytree (as given to ``shard_map``); each leaf's squared norm is summed
      across the mesh axes it is split over, so overflow and norm are global.
    grad_range: also record, per leaf, the largest finite unscaled ``|g|``
      and the fraction of zero elements (:class:`GradRange`), reported by
      :func:`scale_metrics` and :func:`overflow_report`. Off by default: it
      adds two reductions per leaf, which XLA:CPU runs as passes of their
      own (+35% bytes accessed at 20M/200; benchmarks/README.md).
    log_overflows: print a DeepSpeed-style ``OVERFLOW! Skipping step`` line,
      with the scale change and the non-finite leaves, from inside the step
      through ``jax.debug.callback``, on overflow steps only. For debugging:
      the callback is an effect, and JAX dispatches a step with effects
      through Python on every call (7.8x the step time at 500 tiny leaves
      on XLA:CPU; docs/diagnostics.md). In training, print
      :func:`overflow_report` on the host instead.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`LossScaleState`.

  Raises:
    TypeError: ``scaler`` is not a :class:`Scaler`; a flag is not a bool.
    RuntimeError: from ``init`` or ``update`` outside
      :func:`skip_on_overflow`.
    ValueError: when the update is traced, if a transformation before it
      changed the gradients, a second ``fp16_loss_scale`` runs, or ``value``
      is not a scalar.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(optax.chain(
    ...     fs.fp16_loss_scale(fs.torch_scaler(init_scale=1024.0)),
    ...     optax.sgd(1.0)))
    >>> params = jnp.array([1.0, 2.0])
    >>> state = tx.init(params)
    >>> loss = lambda p: jnp.sum(p**2)
    >>> grads = jax.grad(lambda p: loss(p) * fs.current_scale(state))(params)
    >>> print(grads)  # made at scale 1024
    [2048. 4096.]
    >>> updates, state = tx.update(grads, state, params)
    >>> print(updates)  # the true gradient, times -1 for sgd(1.0)
    [-2. -4.]
    >>> bad = jnp.array([4.0, jnp.inf], jnp.float16)  # an overflow
    >>> _, state = tx.update(bad, state, params, value=jnp.float32(1.0))
    >>> print(fs.overflow_report(state).kind)  # finite loss: scale too high
    backward

  References:
    Micikevicius et al., `Mixed Precision Training
    <https://arxiv.org/abs/1710.03740>`_, ICLR 2018; the scale update is the
    one of the peer ``scaler`` mimics.
  """
  if not isinstance(scaler, Scaler):
    raise TypeError(
      f"scaler must be a Scaler from a preset such as deepspeed_scaler(), "
      f"got {type(scaler).__name__}"
    )
  grad_range = _validate.flag("grad_range", grad_range)
  log_overflows = _validate.flag("log_overflows", log_overflows)
  measure_range = grad_range or scaler.needs_grad_max

  def init_fn(params):
    _register_with_flax()
    params = _gradient_tree(params)
    leaves = jax.tree.leaves(params)
    _norm.check_float_leaves(leaves, "fp16_loss_scale params")
    _warn_float16_params(leaves)
    _norm.leaf_axes_from_specs(partition_specs, params, "fp16_loss_scale")
    if _guard.current() is None:
      raise RuntimeError(_UNGUARDED)
    state = scaler.init()
    n = len(leaves)
    zeros = lambda: jnp.zeros([n], jnp.float32)
    # Every field its own buffer: a donating step gives each field's buffer
    # to its successor, and one buffer cannot be donated twice.
    return LossScaleState(
      scaler=state,
      prev_loss_scale=jnp.array(state.loss_scale, copy=True),
      overflow=jnp.bool_(False),
      skipped_steps=jnp.zeros([], jnp.int32),
      grad_norm=jnp.zeros([], jnp.float32),
      leaf_nonfinite=jnp.zeros([n], jnp.bool_),
      leaf_nonfinite_steps=jnp.zeros([n], jnp.int32),
      overflow_kind=jnp.int32(NONE),
      grad_range=GradRange(zeros(), zeros()) if grad_range else None,
      leaf_paths=_leaf_paths(params),
    )

  def update_fn(updates, state, params=None, *, value=None, **extra_args):
    del params, extra_args
    guard = _guard.current()
    if guard is None:
      raise RuntimeError(_UNGUARDED)
    if value is not None:
      value = _scalar_value(value)
    leaves, treedef = jax.tree.flatten(updates)
    guard.check_loss_scale_input(leaves)
    _norm.check_float_leaves(leaves, "fp16_loss_scale gradients")
    _warn_bfloat16_grads(leaves, scaler)
    fit = _leaf_fitter(state.leaf_paths, leaves)
    leaf_axes = _norm.leaf_axes_from_specs(
      partition_specs, updates, "fp16_loss_scale"
    )
    scale = state.scaler.loss_scale
    inv_scale = 1.0 / scale
    sums = _norm.leaf_sums(leaves)
    norms = _norm.reduce_norms(sums, leaves, leaf_axes=leaf_axes)
    # Differentiated, an overflow step's gradients are zeros before the
    # multiply: gradients through the discarded step stay finite.
    safe = _norm.discard_if(
      norms.overflow,
      [x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in leaves],
    )
    outputs = tuple(x * inv_scale for x in safe)
    guard.record(
      _guard.UnscaledGrads(outputs, tuple(leaves), inv_scale, tuple(sums), safe)
    )
    overflow = norms.overflow
    new_range, grad_max = None, None
    if measure_range:
      peaks, zero_fraction = _norm.leaf_range(leaves, leaf_axes)
      max_abs = peaks * inv_scale
      grad_max = jnp.max(max_abs, initial=0.0)
      if grad_range:
        new_range = GradRange(fit(max_abs), fit(zero_fraction))
    leaf_nonfinite = fit(norms.leaf_nonfinite)
    new_scaler = scaler.update(state.scaler, overflow, grad_max)
    kind = _overflow_kind(overflow, value, scaler.at_floor(scale))
    new_state = LossScaleState(
      scaler=new_scaler,
      prev_loss_scale=scale,
      overflow=overflow,
      skipped_steps=state.skipped_steps + overflow.astype(jnp.int32),
      grad_norm=norms.norm * inv_scale,
      leaf_nonfinite=leaf_nonfinite,
      leaf_nonfinite_steps=state.leaf_nonfinite_steps
      + leaf_nonfinite.astype(jnp.int32),
      overflow_kind=kind,
      grad_range=new_range,
      leaf_paths=state.leaf_paths,
    )
    if log_overflows:
      paths = state.leaf_paths.paths

      def log(skipped, kind, old, new, nonfinite):
        _log_overflow(paths, skipped, kind, old, new, nonfinite)

      jax.lax.cond(
        overflow,
        lambda: jax.debug.callback(
          log,
          new_state.skipped_steps,
          kind,
          scale,
          new_scaler.loss_scale,
          leaf_nonfinite,
        ),
        lambda: None,
      )
    return jax.tree.unflatten(treedef, outputs), _donation.written_over(
      state, new_state
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
