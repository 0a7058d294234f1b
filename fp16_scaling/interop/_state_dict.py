"""The loss-scale state as plain values, read off the state's NamedTuples,
and the peers' scaler states recognised by their keys (docs/checkpoints.md).
"""

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _lookup
from fp16_scaling import _validate
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import check_scaler
from fp16_scaling.interop import _jax_peers
from fp16_scaling.interop import _peers

FORMAT = "fp16_scaling"

# Every peer, tried in order (the PyTorch peers first, as before), and
# to_peer_state_dict's names.
_PEERS = _peers.PEERS + _jax_peers.PEERS
_EXPORTS = {**_peers.EXPORTS, **_jax_peers.EXPORTS}

# The own format has one key per array of the LossScaleState, named by its
# field; a nested NamedTuple's fields get this prefix (default: name + "_").
_NESTED_PREFIX = {"scaler": "", "grad_range": "grad_"}

# Every dict the format ever saved holds these; fields added since are
# optional on load. Written out, not derived from _fields, on purpose: a
# field added later must not become required.
_FIRST_KEYS = frozenset(
  (
    "loss_scale prev_loss_scale growth_tracker hysteresis_left "
    "min_scale_errors skipped_steps overflow grad_norm"
  ).split()
)

# Fields of the LossScaleState that are not the scaler's state, and so not
# in the format: scale_set marks a scale set since the last sync (a load
# sets it).
_NOT_SAVED = frozenset({"scale_set"})

# Checked on load as loss scales: positive, normal, finite float32.
_SCALES = ("loss_scale", "prev_loss_scale")


def _own_fields(state: tuple, prefix: str = "", path: tuple = ()) -> dict:
  """``{key: (path, array)}`` for every array of ``state`` (a NamedTuple),
  in field order; ``path`` is the field names down to the array."""
  out = {}
  for name, value in zip(state._fields, state):
    if value is None or not jax.tree.leaves(value) or name in _NOT_SAVED:
      continue  # an optional part that is off, static metadata, a mark
    if hasattr(value, "_fields"):
      nested = prefix + _NESTED_PREFIX.get(name, name + "_")
      out.update(_own_fields(value, nested, path + (name,)))
    else:
      out[prefix + name] = (path + (name,), value)
  return out


def _own_dict(state: tuple) -> dict:
  """The own format's entries of ``state``, as Python numbers."""
  fields = _own_fields(jax.device_get(state))
  return {key: np.asarray(x).tolist() for key, (_, x) in fields.items()}


def _per_leaf(fields: Mapping) -> dict:
  """The fields with one entry per gradient leaf: an axis more than the
  scalars (which carry only the batch axes of a batched state)."""
  batch = min(np.ndim(x) for _, x in fields.values())
  return {k: v for k, v in fields.items() if np.ndim(v[1]) > batch}


def _put_own(state: tuple, fields: Mapping, values: Mapping) -> tuple:
  """``state`` with each field of ``fields`` that ``values`` holds set to its
  value, broadcast to the field's shape and dtype; the others are kept."""
  for key, (path, x) in fields.items():
    if key in values:
      v = jnp.asarray(values[key], x.dtype)
      state = _replace_at(state, path, jnp.broadcast_to(v, x.shape))
  return state


def _replace_at(node: tuple, path: tuple, value: Any) -> tuple:
  """``node`` with the field at ``path`` (field names) set to ``value``."""
  head, rest = path[0], path[1:]
  if rest:
    value = _replace_at(getattr(node, head), rest, value)
  return node._replace(**{head: value})


def _recognise(state_dict: Any) -> tuple:
  """``(peer, dict)`` of ``state_dict``; peer None for the own format."""
  if not isinstance(state_dict, Mapping):
    attrs = getattr(state_dict, "__dict__", None)
    # A DeepSpeed loss scaler, a jmp DynamicLossScale, a built Keras
    # LossScaleOptimizer: the object's attributes are its state.
    if isinstance(attrs, Mapping) and (
      "cur_scale" in attrs or _peers.recognise(attrs, _PEERS) is not None
    ):
      return _recognise(dict(attrs))
    raise TypeError(
      "state_dict must be a dict (or DeepSpeed's loss scaler, jmp's "
      "DynamicLossScale, a built Keras LossScaleOptimizer), got "
      f"{type(state_dict).__name__}"
    )
  if state_dict.get("format") == FORMAT:
    return None, state_dict
  if "loss_scaler" in state_dict:
    return _recognise(state_dict["loss_scaler"])
  peer = _peers.recognise(state_dict, _PEERS)
  if peer is None:
    _unknown(set(map(str, state_dict)))
  return peer, state_dict


def _unknown(keys: set) -> None:
  """Raises for a state dict with ``keys`` that no peer's holds."""
  if _lookup.looks_like_loss_scale_state(keys):
    raise ValueError(
      "state_dict is an fp16_scaling optimizer state that lost its types "
      "(restored without a target), not a scaler state_dict: restore the "
      "optimizer state with target=tx.init(params), or save "
      "fs.scaler_state_dict(opt_state) instead"
    )
  if not keys:
    raise ValueError(
      "state_dict is empty; torch's GradScaler saves {} when it is disabled "
      "(there is no scale to load)"
    )
  accepted = "; ".join(p.saved_by for p in _PEERS)
  raise ValueError(
    f"state_dict with keys {sorted(keys)} is not a known scaler state. "
    f"Accepted: fp16_scaling's scaler_state_dict(); {accepted}."
  )


def scaler_state_dict(opt_state: Any, scaler: Optional[Scaler] = None) -> dict:
  """The loss-scale state of ``opt_state`` as plain Python values.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    scaler: the :class:`Scaler` the optimizer was built with, stored under
      ``"config"`` so that a load checks it.

  Returns:
    A dict: ``format``, then one entry per array of the
    :class:`LossScaleState` named by its field, as Python numbers.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> scaler = fs.torch_scaler(init_scale=1024.0)
    >>> tx = fs.chain(fs.fp16_loss_scale(scaler))
    >>> d = fs.scaler_state_dict(tx.init(jnp.zeros(2)), scaler)
    >>> d["loss_scale"], d["growth_tracker"], d["config"]["growth_interval"]
    (1024.0, 0, 2000)
  """
  _validate.require_host(opt_state, "scaler_state_dict")
  ls = _lookup.loss_scale_state(opt_state)
  out = {"format": FORMAT, **_own_dict(ls)}
  if scaler is not None:
    out["config"] = _peers.config(check_scaler(scaler))
  return out


_OWN_FIX = (
  "Build the optimizer with the scaler the dict was saved with (its "
  "state_dict['config']), or load into a matching scaler."
)


def _from_own(d: Mapping, scaler: Scaler) -> Mapping:
  """fp16_scaling's own dict ``d``, checked against ``scaler``."""
  if "config" in d:
    # The initial scale does not matter once a run is under way.
    config = {k: v for k, v in d["config"].items() if k != "init_scale"}
    _peers.check(scaler, "fp16_scaling", config, _OWN_FIX)
  missing = sorted(_FIRST_KEYS - set(d))
  if missing:
    raise ValueError(
      f"fp16_scaling state_dict lacks {', '.join(map(repr, missing))}: every "
      f"scaler_state_dict() holds them ({', '.join(sorted(_FIRST_KEYS))})"
    )
  for field in _SCALES:
    for v in np.ravel(d[field]).tolist():
      _validate.from_data(_validate.scale, f"state_dict[{field!r}]", v)
  return d


def _from_peer(peer: _peers.Peer, d: Mapping, scaler: Scaler) -> dict:
  """The own entries a peer's state ``d`` sets, checked against ``scaler``."""
  values = peer.load(d, scaler)._asdict()
  # No peer keeps these: the last step's scale was the loaded one.
  values.update(prev_loss_scale=values["loss_scale"], min_scale_errors=0)
  return values


def _check_leaf_counts(values: Mapping, fields: Mapping) -> None:
  """Raises unless every per-leaf field holds as many entries (on its last
  axis) as the state's: a dict of another model must not be broadcast."""
  per_leaf = _per_leaf(fields)
  for field, (_, x) in per_leaf.items():
    if field not in values:
      continue
    shape, leaves = np.shape(values[field]), np.shape(x)[-1]
    if shape[-1:] != (leaves,):
      saved = shape[-1] if shape else "no"
      raise ValueError(
        f"state_dict[{field!r}] holds {saved} gradient leaves, the optimizer "
        f"state {leaves}: the dict was saved for a model with other "
        "parameters. Load it into the optimizer state of the model it was "
        "saved from, or delete its per-leaf fields "
        f"({', '.join(f for f in per_leaf if f in values)}) to take only "
        "the scale and its counters."
      )


def _built_with(state: Any, scaler: Optional[Scaler]) -> Scaler:
  """The :class:`Scaler` ``state`` (a LossScaleState) was built with, as its
  treedef records it (its initial scale aside, which does not matter once
  a run is under way); ``scaler``, when given, must agree with it, or
  ValueError names the first field that differs: the counters loaded
  follow the rules of the scaler that built the state."""
  built = state.leaf_paths.built.scaler
  if scaler is None:
    return built
  scaler = check_scaler(scaler)
  recorded = _peers.config(built)
  del recorded["init_scale"]
  _peers.check(
    scaler,
    "the optimizer's",
    recorded,
    "Pass the Scaler its fs.fp16_loss_scale was built with, or none (the "
    "state records it), or build the optimizer with this one.",
  )
  return scaler


def load_scaler_state_dict(
  opt_state: Any, state_dict: Any, scaler: Optional[Scaler] = None
) -> Any:
  """``opt_state`` with its loss-scale state taken from ``state_dict``.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    state_dict: :func:`scaler_state_dict`'s dict, or a peer's scaler state
      (docs/checkpoints.md), recognised by its keys.
    scaler: optional: the :class:`Scaler` the optimizer was built with,
      which the state's treedef records already (its initial scale
      aside); given, it must agree with that record. The configuration
      ``state_dict`` holds or implies must agree with it.

  Returns:
    The new optax state (a peer's sets the scale and its counters only),
    marked as one whose scale was set (``scale_set``, an array):
    :func:`sync_loss_scales` keeps its scale over those of the states
    whose scale was not set.

  Raises:
    ValueError: an unknown state, a scale that is not a normal float32, a
      configuration that disagrees with the scaler, or a ``scaler`` other
      than the one the optimizer state was built with (read from its
      treedef: the same eager and under ``jit``).
  """
  old = _lookup.loss_scale_state(opt_state)
  scaler = _built_with(old, scaler)
  peer, d = _recognise(state_dict)
  values = _from_own(d, scaler) if peer is None else _from_peer(peer, d, scaler)
  fields = _own_fields(old)
  _check_leaf_counts(values, fields)
  new = _put_own(old, fields, values)
  return _lookup.replace_set_scale(opt_state, new)


def scaler_from_state_dict(state_dict: Any, **overrides: Any) -> Scaler:
  """The preset whose configuration a peer's scaler state holds (build the
  optimizer with it, then :func:`load_scaler_state_dict`).

  Args:
    state_dict: a state accepted by :func:`load_scaler_state_dict`, other
      than Megatron's (which holds no configuration).
    **overrides: keyword arguments of the preset for what the state does not
      hold: ``min_scale`` for DeepSpeed's optimizer states, hysteresis
      for those DeepSpeed 0.19.8 saves, ``dynamic_growth_steps`` for Keras's
      variables (the optimizer object holds it).

  Returns:
    A :class:`Scaler` whose initial scale is the state's scale.

  Raises:
    ValueError: for Megatron's or our own state, Keras's variables without
      ``dynamic_growth_steps``, or an unknown state.
  """
  peer, d = _recognise(state_dict)
  if peer is None:
    raise ValueError(
      "an fp16_scaling state holds no peer configuration to build a scaler "
      "from: load it into the scaler it was saved with (state_dict['config'])"
    )
  return peer.preset(d, overrides)


def to_peer_state_dict(opt_state: Any, peer: str, scaler: Scaler) -> dict:
  """The loss-scale state of ``opt_state`` in a peer's own format.

  Args:
    opt_state: an optax state holding one unbatched :class:`LossScaleState`.
    peer: ``"torch"`` (for ``GradScaler.load_state_dict``), ``"megatron"``
      (``DynamicGradScaler.load_state_dict``; ``scale`` a torch tensor),
      ``"deepspeed"`` (entries to merge into ``FP16_Optimizer.state_dict()``,
      with the attributes of a ZeRO ``loss_scaler``), ``"jmp"``
      (``jmp.DynamicLossScale(**d)``) or ``"keras"`` (``dynamic_scale`` and
      ``step_counter``, to assign to the ``LossScaleOptimizer``'s variables
      of those names, and its ``dynamic_growth_steps``).
    scaler: the :class:`Scaler` the optimizer was built with.

  Returns:
    A dict the peer loads, and that continues exactly as this state would
    (DeepSpeed's iteration counter restarts).

  Raises:
    ValueError: an unknown peer, a batched state, or a configuration the
      peer cannot run.
  """
  scaler = check_scaler(scaler)
  if peer not in _EXPORTS:
    raise ValueError(f"peer must be one of {tuple(_EXPORTS)}, got {peer!r}")
  _validate.require_host(opt_state, "to_peer_state_dict")
  state = _lookup.scaler_state(opt_state)
  if np.ndim(state.loss_scale):
    raise ValueError(
      "to_peer_state_dict needs one state, got a batched one of shape "
      f"{np.shape(state.loss_scale)}: index one member first"
    )
  counters = _peers.Counters.of(jax.device_get(state))
  return _peers.exported(peer, scaler, _EXPORTS).save(counters, scaler)
