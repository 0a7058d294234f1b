"""The state types of fp16_scaling's transformations, and their constants.

Every transformation module builds one of these, ``_lookup`` finds them in
a nested optax state, and the host helpers read them: defined here, apart
from the code that computes them, so that each of those imports only the
types (no module imports a transformation to learn its state's shape).

:class:`ScalerState`, the loss-scale machine's own state, lives beside
:class:`Scaler` in ``_scaler``.
"""

import dataclasses
import sys
from typing import Any, NamedTuple, Optional

import jax

from fp16_scaling._scaler import ScalerState

# LossScaleState.overflow_kind codes, indexes into KINDS.
NONE, UNKNOWN, FORWARD, BACKWARD, PERSISTENT = range(5)
KINDS = ("none", "unknown", "forward", "backward", "persistent")


def _is_spec(x) -> bool:
  return x is None or isinstance(x, jax.sharding.PartitionSpec)


@jax.tree_util.register_pytree_node_class
class LeafPaths:
  """Static facts of a :class:`LossScaleState`, held in its treedef.

  A pytree node with no children: nothing here is an array, so it costs
  nothing per step and survives ``jit``, ``scan`` and ``jax.tree.map``; a
  checkpoint restored into ``tx.init(params)`` takes the target's.

  Attributes:
    paths: the gradient leaves' names (``jax.tree_util.keystr``), in tree
      order, for the reports.
    sizes: their element counts.
    scaler: the :class:`Scaler` of the ``fp16_loss_scale`` that built it.
    shared: whether that ``fp16_loss_scale`` shares its scale (the scale
      then lives in the caller's state, passed as ``loss_scale=``).
    partition_specs: the gradients' ``PartitionSpec`` pytree it was given.

  Equality and hash are those of ``(scaler, shared, partition_specs)``: the
  configuration the state was built for, which decides how a step is
  traced. The names do not take part: they follow from the gradient tree,
  which the step's other arguments already key, and a tree without leaves
  (``optax.tree_map_params``' placeholder) must match the real one.
  """

  def __init__(self, paths, sizes, scaler=None, shared=False, specs=None):
    self.paths = tuple(paths)
    self.sizes = tuple(int(n) for n in sizes)
    self.scaler = scaler
    self.shared = bool(shared)
    # Hashable: the specs' leaves and treedef, not the (maybe dict) pytree.
    self._specs = jax.tree.flatten(specs, is_leaf=_is_spec)
    self._specs = (tuple(self._specs[0]), self._specs[1])

  @property
  def partition_specs(self):
    return jax.tree.unflatten(self._specs[1], self._specs[0])

  def _key(self):
    # The initial scale does not matter once a run is under way.
    scaler = self.scaler
    if scaler is not None:
      scaler = dataclasses.replace(scaler, init_scale=1.0)
    return (scaler, self.shared, self._specs)

  def tree_flatten(self):
    return (), self  # the node itself is the treedef's metadata

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return aux

  def __eq__(self, other):
    return isinstance(other, LeafPaths) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __len__(self):
    return len(self.paths)

  def __repr__(self):
    return f"LeafPaths({len(self.paths)} leaves)"


def register_with_flax() -> None:
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


SHARED, EXPERT = 0, 1


class ClipState(NamedTuple):
  """Norms measured by :func:`clip_by_unscaled_norm` on the last step.

  Attributes:
    grad_norm: float32 global 2-norm of the unscaled gradients before
      clipping, expert and shared leaves together.
    expert_grad_norm: float32 2-norm of the expert leaves alone.
    shared_grad_norm: float32 2-norm of the other leaves.

  A norm over a leaf that held an inf or NaN does not exist and is reported
  as 0.0 (never NaN); on an overflow step a group that stayed finite still
  reports its true norm.
  """

  grad_norm: jax.Array
  expert_grad_norm: jax.Array
  shared_grad_norm: jax.Array


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: int32, microbatches of the current window accumulated so far
      (0 right after a window ended).
    windows: int32, windows ended so far: optimizer steps taken or skipped.
    acc_grads: float32 pytree of the params' structure: the sum of the
      current window's microbatch gradients, each divided by the window's
      length (the clean ones only, under ``"drop_microbatch"``).
    clean_in_window: int32, microbatches of the current window that were
      accumulated (all of them under ``"skip_step"``).
    inner_state: the state of the wrapped guarded chain.
    microbatches: int32 total of microbatches seen.
    applied_steps: int32 total of windows whose optimizer step was applied.
    dropped_microbatches: int32 total of microbatches left out of a mean for
      an inf or NaN (``"drop_microbatch"`` only; 0 otherwise).
    window_ended: bool, whether the last call ended a window (ran the inner
      chain once on the window's mean).
    loss_sum: float32, the sum of the current window's losses passed as
      ``value=``, each divided by the window's length (the accumulated
      microbatches only, as ``acc_grads``); 0.0 without ``value=``.
    loss_nonfinite: bool, whether any microbatch of the current window,
      dropped ones included, was passed a ``value=`` that is not finite.
  """

  mini_step: jax.Array
  windows: jax.Array
  acc_grads: Any
  clean_in_window: jax.Array
  inner_state: Any
  microbatches: jax.Array
  applied_steps: jax.Array
  dropped_microbatches: jax.Array
  window_ended: jax.Array
  loss_sum: jax.Array
  loss_nonfinite: jax.Array
