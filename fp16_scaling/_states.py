"""The state types of fp16_scaling's transformations, and their constants,
apart from the code that computes them (docs/design.md, "State").
"""

import dataclasses
import sys
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import ScalerState

# LossScaleState.overflow_kind codes, indexes into KINDS.
NONE, UNKNOWN, FORWARD, BACKWARD, PERSISTENT = range(5)
KINDS = ("none", "unknown", "forward", "backward", "persistent")


@dataclasses.dataclass(frozen=True)
class Built:
  """What made a :class:`LossScaleState`, held in its treedef (in its
  :class:`LeafPaths`) and compared by value, as jmp keeps ``period`` and
  ``factor``: the ``fp16_loss_scale`` configuration a state's counters and
  units follow.

  Attributes:
    scaler: the :class:`Scaler`, its ``init_scale`` set to 1.0: the first
      scale does not matter once a run is under way.
    partition_specs: the ``partition_specs`` given, made hashable: ``(their
      leaves, their treedef)``, a spec or None at each leaf; or None.
    stacked_axes: the ``stacked_axes`` given, made hashable (as
      ``_stacked.check`` keys them), or None.
  """

  scaler: Scaler
  partition_specs: Any = None
  stacked_axes: Any = None


@jax.tree_util.register_pytree_node_class
class LeafPaths:
  """The static part of a :class:`LossScaleState`, held in its treedef and
  compared by value: what its reports read of its leaves, the plan the
  update measures by, and what made it.

  Attributes:
    paths: the units' paths (``jax.tree_util.keystr``), in tree order. A
      unit is a gradient leaf, or one layer of a leaf that ``stacked_axes``
      names (its path ends in the layer's index, ``['layers']['W'][5]``).
    sizes: the units' element counts, in the same order.
    stacks: per stacked leaf in tree order, ``(its path, the index of its
      first unit)``: its L units follow in layer order.
    plan: the measurement's plan of the params, resolved by ``tx.init``
      (a ``_measure.Plan``, hashable: each leaf's partition spec and the
      stacked layout): each update measures by it, the clip's groups
      joined.
    built: the :class:`Built` record of the configuration that made the
      state; an update of another configuration refuses the state.

  Equal, and so one treedef, when all of these are: correct use never
  retraces (they are constant along a chain's states), and ``jit`` tells
  two models, or a state of another configuration, apart. One built from a
  tree without leaves (``optax.tree_map_params``' placeholder) equals every
  one of the same ``built``, so that the placeholder's state maps onto the
  real one. The hash is ``built``'s, computed once.
  """

  def __init__(self, paths, sizes, stacks=(), *, plan, built=None):
    self.paths = tuple(paths)
    self.sizes = tuple(int(n) for n in sizes)
    self.stacks = tuple(stacks)
    self.plan = plan
    self.built = built
    self._hash = hash((LeafPaths, built))

  @property
  def layout(self) -> Any:
    """``stacked_axes`` resolved on the params by ``tx.init`` (the plan's
    ``_stacked.Layout``, hashable), or None without them."""
    return self.plan.layout

  @property
  def layers(self) -> Optional[int]:
    """L, the layers of each stacked leaf (0 if ``stacked_axes`` name no
    leaf), or None for a state built without ``stacked_axes``."""
    return None if self.layout is None else self.layout.layers

  def layer_units(self) -> np.ndarray:
    """[stacked leaves, L] int32: the units of each stacked leaf."""
    firsts = np.array([first for _, first in self.stacks], np.int32)
    return firsts.reshape(-1, 1) + np.arange(self.layers or 0, dtype=np.int32)

  def tree_flatten(self):
    return (), self  # the node itself is the treedef's metadata

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return aux

  def _compared(self) -> tuple:
    return (self.paths, self.sizes, self.stacks, self.plan)

  def __eq__(self, other):
    # A chain's states share one node, which jax's treedef compare (and
    # so jit's cache) takes as equal without calling this.
    if not isinstance(other, LeafPaths) or self.built != other.built:
      return False
    if not self.paths or not other.paths:
      return True  # tree_map_params' placeholder
    return self._compared() == other._compared()

  def __hash__(self):
    return self._hash

  def __len__(self):
    return len(self.paths)

  def __repr__(self):
    return f"LeafPaths({len(self.paths)} leaves)"


def register_with_flax() -> None:
  """Lets a loaded ``flax.serialization`` save :class:`LeafPaths` (as {},
  restored as the target's): registered once in a process, the first time
  a state is built after flax.serialization was imported."""
  serialization = sys.modules.get("flax.serialization")
  if serialization is None or serialization.is_serializable(LeafPaths):
    return
  serialization.register_serialization_state(
    LeafPaths, lambda _: {}, lambda target, _: target
  )


class GradRange(NamedTuple):
  """Per-leaf gradient range of the last step (opt-in telemetry).

  Attributes:
    max_abs: float32 vector, per leaf the largest finite unscaled ``|g|``.
    zero_fraction: float32 vector, per leaf the fraction of the scaled
      gradient's elements that are exactly zero: an underflow proxy.
  """

  max_abs: jax.Array
  zero_fraction: jax.Array


class StackedRange(NamedTuple):
  """:class:`GradRange` per unit of a ``stacked_axes`` build, with each
  unit's norm (``grad_range=True``; docs/stacked.md).

  Attributes:
    max_abs: float32 vector, per unit the largest finite unscaled ``|g|``.
    zero_fraction: float32 vector, per unit the fraction of zero elements.
    unit_norm: float32 vector, per unit the true (unscaled) 2-norm of its
      gradient; 0.0 for a unit that held an inf or NaN.
  """

  max_abs: jax.Array
  zero_fraction: jax.Array
  unit_norm: jax.Array


class LossScaleState(NamedTuple):
  """State of :func:`fp16_loss_scale`.

  Attributes:
    scaler: the :class:`ScalerState`, with the next ``loss_scale``.
    prev_loss_scale: float32 scale the last step's gradients were made with.
    overflow: bool, whether the last step's gradients had an inf or NaN.
    skipped_steps: int32 total of overflowing steps so far.
    consecutive_skipped_steps: int32 overflowing steps in a row up to the
      last one; 0 after a clean step.
    grad_norm: float32 true global 2-norm of the last step's gradients,
      before clipping; 0.0 on an overflow step.
    leaf_nonfinite: bool vector, per leaf: held an inf or NaN last step.
      Built with ``stacked_axes``, per unit: a stacked leaf has one entry
      per layer (``leaf_paths.paths`` names them ``...[l]``).
    leaf_nonfinite_steps: int32 vector, per leaf (per unit, likewise): its
      non-finite steps so far.
    overflow_kind: int32 index into ``KINDS`` of the last step's overflow.
    scale_set: bool, whether the scale was set (:func:`set_loss_scale`,
      :func:`load_scaler_state_dict`) since ``tx.init`` or the last
      :func:`sync_loss_scales`, which keeps a set scale over the others.
    grad_range: a :class:`GradRange` with ``grad_range=True`` (a
      :class:`StackedRange` with ``stacked_axes`` too), else None.
    leaf_paths: :class:`LeafPaths`, static: the leaves' names and sizes,
      the stacked layout and what made the state.
  """

  scaler: ScalerState
  prev_loss_scale: jax.Array
  overflow: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped_steps: jax.Array
  grad_norm: jax.Array
  leaf_nonfinite: jax.Array
  leaf_nonfinite_steps: jax.Array
  overflow_kind: jax.Array
  scale_set: jax.Array
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
      clipping (0.0 over a leaf that held an inf or NaN, never NaN).
    expert_grad_norm: float32 2-norm of the expert leaves alone.
    shared_grad_norm: float32 2-norm of the other leaves.
  """

  grad_norm: jax.Array
  expert_grad_norm: jax.Array
  shared_grad_norm: jax.Array


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: int32, microbatches of the current window so far.
    windows: int32, windows ended so far: optimizer steps taken or skipped.
    acc_grads: float32 sum of the window's microbatch gradients over ``k``.
    clean_in_window: int32, microbatches of the window accumulated.
    inner_state: the state of the wrapped guarded chain.
    microbatches: int32 total of microbatches seen.
    applied_steps: int32 total of windows whose optimizer step was applied.
    dropped_microbatches: int32 total of microbatches left out of a mean.
    window_ended: bool, whether the last call ended a window.
    loss_sum: float32 sum of the window's ``value=`` losses over ``k``.
    loss_nonfinite: bool, whether any ``value=`` of the window was not finite.
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
