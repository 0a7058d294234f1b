"""The loss-scale state as plain values, and the peers' scaler states.

``scaler_state_dict`` reads the scaler out of an optax state as Python numbers;
``load_scaler_state_dict`` writes one back, from fp16_scaling's own dict or
from a PyTorch peer's, recognised by its keys:

* ``torch.amp.GradScaler.state_dict()``: ``scale``, ``growth_factor``,
  ``backoff_factor``, ``growth_interval``, ``_growth_tracker``;
* Megatron-core ``DynamicGradScaler.state_dict()``: ``scale``,
  ``growth_tracker``, ``hysteresis_tracker``;
* DeepSpeed ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer.state_dict()``:
  ``dynamic_loss_scale``, ``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
  ``scale_factor``, ``scale_window``, and ``cur_hysteresis`` from DeepSpeed
  releases after 0.19.8;
* a ZeRO checkpoint's ``loss_scaler`` (DeepSpeed's ``DynamicLossScaler``, or
  its attributes as a dict), or a dict holding it under ``loss_scaler``.

The peers count differently from :class:`ScalerState`; each mapping below is
exact, so that a run continued here takes the same decisions as the peer:

* DeepSpeed grows when ``cur_iter - last_overflow_iter - 1`` (``k`` for the
  next step) is a positive multiple of ``scale_window``; here the tracker is
  ``-1`` when ``k == 0`` and ``(k - 1) % scale_window`` otherwise.
  ``cur_hysteresis`` (1 to ``delayed_shift``) is ``hysteresis_left + 1``.
* Megatron's ``hysteresis_tracker`` goes on falling below 1 while it backs
  off; every value <= 1 backs off on the next overflow, as
  ``hysteresis_left == 0`` does here.
* torch's ``_growth_tracker`` is the tracker here; torch has no hysteresis.

The scaler's configuration is not part of the optax state (it is the
:class:`Scaler` the transformation was built with), so these functions take
that ``scaler``: the peer's configuration is checked against it, and
:func:`scaler_from_state_dict` builds the preset a peer's state describes.
"""

import dataclasses
import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _lookup
from fp16_scaling import _validate
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import deepspeed_scaler
from fp16_scaling._scaler import static_scaler
from fp16_scaling._scaler import torch_scaler

FORMAT = "fp16_scaling"
PEERS = ("torch", "megatron", "deepspeed")

_TORCH = frozenset(
  {
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
  }
)
_MEGATRON = frozenset({"scale", "growth_tracker", "hysteresis_tracker"})
_DS_OPTIMIZER = frozenset({"dynamic_loss_scale", "cur_scale", "cur_iter"})
_DS_SCALER = frozenset(
  {
    "cur_scale",
    "cur_iter",
    "last_overflow_iter",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "cur_hysteresis",
    "consecutive_hysteresis",
  }
)
_DS_STATIC = frozenset({"cur_scale", "dynamic"})


def _config(scaler: Scaler) -> dict:
  """Every field of ``scaler``: a field added to :class:`Scaler` is saved and
  checked on load without a change here."""
  return {f.name: getattr(scaler, f.name) for f in dataclasses.fields(Scaler)}


# fp16_scaling's own format is read off the state: one key per array of the
# LossScaleState, named by its field. A nested NamedTuple's fields are
# flattened in, with this prefix (its field name and "_" when not listed).
# A field that is None (grad_range off) is left out, and so is one that holds
# no arrays (leaf_paths, static in the treedef): the target state keeps its
# own. A field added to the states is saved and loaded with no change here.
_NESTED_PREFIX = {"scaler": "", "grad_range": "grad_"}

# Every dict the format ever saved holds these; fields added since are
# optional on load (older dicts lack them, and the state's own are kept).
_FIRST_KEYS = frozenset(
  {
    "loss_scale",
    "prev_loss_scale",
    "growth_tracker",
    "hysteresis_left",
    "min_scale_errors",
    "skipped_steps",
    "overflow",
    "grad_norm",
  }
)

# Checked on load as loss scales: positive, normal, finite float32.
_SCALES = ("loss_scale", "prev_loss_scale")


def _own_fields(state: tuple, prefix: str = "", path: tuple = ()) -> dict:
  """``{key: (path, array)}`` for every array of ``state`` (a NamedTuple),
  in field order; ``path`` is the field names down to the array."""
  out = {}
  for name, value in zip(state._fields, state):
    if value is None or not jax.tree.leaves(value):
      continue  # an optional part that is off, or static metadata
    if hasattr(value, "_fields"):
      nested = prefix + _NESTED_PREFIX.get(name, name + "_")
      out.update(_own_fields(value, nested, path + (name,)))
    else:
      out[prefix + name] = (path + (name,), value)
  return out


def _own_dict(state: tuple) -> dict:
  """The own format's entries of ``state``, as Python numbers."""
  return {key: _plain(x) for key, (_, x) in _own_fields(state).items()}


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
  head, rest = path[0], path[1:]
  if rest:
    value = _replace_at(getattr(node, head), rest, value)
  return node._replace(**{head: value})


def _same(mine: Any, value: Any) -> bool:
  """Whether a scaler field equals a saved one (floats as float32)."""
  if mine is None or value is None:
    return mine is None and value is None
  if isinstance(mine, float) and not isinstance(value, bool):
    return bool(np.float32(mine) == np.float32(value))
  return mine == value


def _plain(x: Any) -> Any:
  """A host copy of ``x`` as Python numbers (nested lists when batched)."""
  return np.asarray(jax.device_get(x)).tolist()


def _number(x: Any) -> float:
  """A Python float from a number, a one-element tensor or array."""
  if hasattr(x, "detach"):  # a torch tensor, read without importing torch
    x = x.detach().cpu().numpy()
  a = np.asarray(x)
  if a.size != 1:
    raise ValueError(f"expected one number, got an array of shape {a.shape}")
  return float(a.reshape(()))


def _integer(field: str, x: Any) -> int:
  v = _number(x)
  if not math.isfinite(v) or v != int(v):
    raise ValueError(f"state_dict[{field!r}] must be an integer, got {x!r}")
  return int(v)


def _scale(field: str, x: Any) -> float:
  return _validate.scale(f"state_dict[{field!r}]", _number(x))


def _check(scaler: Scaler, source: str, expected: Mapping[str, Any]) -> None:
  """Raises if ``scaler``'s fields differ from what the peer state implies."""
  have = _config(scaler)
  for field, value in expected.items():
    if field not in have:
      raise ValueError(
        f"{source} state holds a scaler field this version does not know: "
        f"{field}={value!r}. Load it with the fp16_scaling version that "
        f"saved it, or delete state_dict['config'][{field!r}] if it does not "
        "matter to this run."
      )
    mine = have[field]
    if not _same(mine, value):
      fix = (
        "Build the optimizer with the scaler the dict was saved with (its "
        "state_dict['config']), or load into a matching scaler."
        if source == "fp16_scaling"
        else "Build the optimizer with the peer's configuration "
        "(fs.scaler_from_state_dict(state_dict) gives it as a preset) or "
        "load into a matching scaler."
      )
      raise ValueError(
        f"{source} state disagrees with the scaler on {field}: the state "
        f"implies {value!r}, the scaler has {mine!r}. {fix}"
      )


def _source(state_dict: Any) -> tuple:
  """(name, dict) of a state dict's source, recognised by its keys."""
  if not isinstance(state_dict, Mapping):
    attrs = getattr(state_dict, "__dict__", None)
    if isinstance(attrs, Mapping) and {"cur_scale"} <= set(attrs):
      return _source(dict(attrs))  # a DeepSpeed loss scaler object
    raise TypeError(
      "state_dict must be a dict (or DeepSpeed's loss scaler), got "
      f"{type(state_dict).__name__}"
    )
  keys = set(map(str, state_dict))
  if state_dict.get("format") == FORMAT:
    return "fp16_scaling", state_dict
  if "loss_scaler" in keys:
    return _source(state_dict["loss_scaler"])
  if _DS_SCALER <= keys:
    return "deepspeed_scaler", state_dict
  if _DS_STATIC <= keys and not state_dict["dynamic"]:
    return "deepspeed_static", state_dict
  if _DS_OPTIMIZER <= keys:
    return "deepspeed_optimizer", state_dict
  if _TORCH <= keys:
    return "torch", state_dict
  if _MEGATRON <= keys:
    return "megatron", state_dict
  if _lookup._UNTYPED_KEYS <= keys:
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
  raise ValueError(
    f"state_dict with keys {sorted(keys)} is not a known scaler state. "
    "Accepted: fp16_scaling's scaler_state_dict(), torch GradScaler."
    "state_dict(), Megatron DynamicGradScaler.state_dict(), DeepSpeed "
    "FP16_Optimizer / FP16_UnfusedOptimizer.state_dict(), a ZeRO "
    "checkpoint's loss_scaler."
  )


def scaler_state_dict(opt_state: Any, scaler: Optional[Scaler] = None) -> dict:
  """The loss-scale state of ``opt_state`` as plain Python values.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState` (also
      batched, or inside ``nnx.Optimizer``).
    scaler: the :class:`Scaler` the optimizer was built with; its
      configuration is stored under ``"config"`` so that a load checks it.

  Returns:
    A dict: ``format`` (``"fp16_scaling"``), one entry per array of the
    :class:`LossScaleState` named by its field: the :class:`ScalerState`'s
    (``loss_scale``, ``growth_tracker``, ...), then ``prev_loss_scale``,
    ``skipped_steps`` and the others, per gradient leaf ``leaf_nonfinite``
    and ``leaf_nonfinite_steps`` (with ``grad_range`` also ``grad_max_abs``
    and ``grad_zero_fraction``), as Python numbers (nested lists for a
    batched state); and with ``scaler``, ``config``.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> scaler = fs.torch_scaler(init_scale=1024.0)
    >>> tx = fs.skip_on_overflow(optax.chain(fs.fp16_loss_scale(scaler)))
    >>> d = fs.scaler_state_dict(tx.init(jnp.zeros(2)), scaler)
    >>> d["loss_scale"], d["growth_tracker"], d["config"]["growth_interval"]
    (1024.0, 0, 2000)
  """
  _lookup.require_host(opt_state, "scaler_state_dict")
  ls = _lookup.loss_scale_state(opt_state)
  out = {"format": FORMAT, **_own_dict(ls)}
  if scaler is not None:
    out["config"] = _config(_scaler_arg(scaler))
  return out


def _scaler_arg(scaler: Any) -> Scaler:
  if not isinstance(scaler, Scaler):
    raise TypeError(
      "scaler must be the Scaler the optimizer was built with (from a preset "
      f"such as fs.torch_scaler()), got {type(scaler).__name__}"
    )
  return scaler


def _from_own(d: Mapping, scaler: Scaler) -> dict:
  if "config" in d:
    # The initial scale does not matter once a run is under way.
    config = {k: v for k, v in d["config"].items() if k != "init_scale"}
    _check(scaler, "fp16_scaling", config)
  missing = sorted(_FIRST_KEYS - set(d))
  if missing:
    raise ValueError(
      f"fp16_scaling state_dict lacks {', '.join(map(repr, missing))}: every "
      f"scaler_state_dict() holds them ({', '.join(sorted(_FIRST_KEYS))})"
    )
  return dict(d)


def _check_leaf_counts(values: Mapping, fields: Mapping) -> None:
  """Raises unless every per-leaf field holds as many entries (on its last
  axis) as the state's: a dict saved for another model must not be broadcast
  onto this one."""
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


def _tracker(field: str, value: int, scaler: Scaler) -> int:
  if not -scaler.growth_delay <= value < scaler.growth_interval:
    raise ValueError(
      f"state_dict[{field!r}] must lie in [{-scaler.growth_delay}, "
      f"{scaler.growth_interval - 1}] for growth_interval "
      f"{scaler.growth_interval}, got {value}"
    )
  return value


def _from_torch(d: Mapping, scaler: Scaler) -> dict:
  _check(
    scaler,
    "torch GradScaler",
    {
      "growth_factor": float(d["growth_factor"]),
      "backoff_factor": float(d["backoff_factor"]),
      "growth_interval": int(d["growth_interval"]),
      "growth_delay": 0,
      "hysteresis": 1,
    },
  )
  return {
    "loss_scale": _scale("scale", d["scale"]),
    "growth_tracker": _tracker(
      "_growth_tracker",
      _integer("_growth_tracker", d["_growth_tracker"]),
      scaler,
    ),
    "hysteresis_left": 0,
  }


def _from_megatron(d: Mapping, scaler: Scaler) -> dict:
  # Megatron's state holds no configuration; its counters imply only these.
  _check(scaler, "Megatron DynamicGradScaler", {"growth_delay": 0})
  tracker = _integer("hysteresis_tracker", d["hysteresis_tracker"])
  if tracker > scaler.hysteresis:
    raise ValueError(
      f"state_dict['hysteresis_tracker'] ({tracker}) exceeds the scaler's "
      f"hysteresis ({scaler.hysteresis})"
    )
  return {
    "loss_scale": _scale("scale", d["scale"]),
    "growth_tracker": _tracker(
      "growth_tracker", _integer("growth_tracker", d["growth_tracker"]), scaler
    ),
    "hysteresis_left": max(tracker - 1, 0),
  }


def _ds_counters(d: Mapping, scaler: Scaler, source: str) -> dict:
  factor = _number(d["scale_factor"])
  expected = {
    "growth_factor": factor,
    "backoff_factor": 1.0 / factor,
    "growth_interval": _integer("scale_window", d["scale_window"]),
    "growth_delay": 1,
  }
  if source == "deepspeed_scaler":
    expected.update(
      min_scale=_number(d["min_scale"]),
      hysteresis=_integer("delayed_shift", d["delayed_shift"]),
      consecutive_hysteresis=bool(d["consecutive_hysteresis"]),
    )
    if "raise_error_at_min_scale" in d:
      expected["raise_at_min_scale"] = bool(d["raise_error_at_min_scale"])
  _check(scaler, f"DeepSpeed {source[10:]}", expected)
  since = (
    _integer("cur_iter", d["cur_iter"])
    - _integer("last_overflow_iter", d["last_overflow_iter"])
    - 1
  )
  if since < 0:
    raise ValueError(
      "state_dict['last_overflow_iter'] must be below state_dict['cur_iter'], "
      f"got {d['last_overflow_iter']} and {d['cur_iter']}"
    )
  window = scaler.growth_interval
  # A 0.19.8 FP16_Optimizer keeps no hysteresis; DeepSpeed after 0.19.8
  # loads such a checkpoint with its hysteresis full, and so does this.
  cur = d.get("cur_hysteresis", scaler.hysteresis)
  cur = _integer("cur_hysteresis", cur)
  if not 1 <= cur <= scaler.hysteresis:
    raise ValueError(
      f"state_dict['cur_hysteresis'] must lie in [1, {scaler.hysteresis}] "
      f"for the scaler's hysteresis, got {cur}"
    )
  return {
    "loss_scale": _scale("cur_scale", d["cur_scale"]),
    "growth_tracker": -1 if since == 0 else (since - 1) % window,
    "hysteresis_left": cur - 1,
  }


def _from_ds_static(d: Mapping, scaler: Scaler) -> dict:
  scale = _scale("cur_scale", d["cur_scale"])
  if scaler.dynamic:
    raise ValueError(
      "DeepSpeed state disagrees with the scaler on dynamic: the state holds "
      f"a static loss scale ({scale!r}), the scaler is dynamic. Use "
      "fs.static_scaler(...) (fs.scaler_from_state_dict(state_dict))."
    )
  return {"loss_scale": scale, "growth_tracker": 0, "hysteresis_left": 0}


def _peer_values(source: str, d: Mapping, scaler: Scaler) -> dict:
  if source == "fp16_scaling":
    return _from_own(d, scaler)
  if source == "torch":
    return _from_torch(d, scaler)
  if source == "megatron":
    return _from_megatron(d, scaler)
  if source == "deepspeed_optimizer" and not d["dynamic_loss_scale"]:
    return _from_ds_static(d, scaler)
  if source == "deepspeed_static":
    return _from_ds_static(d, scaler)
  return _ds_counters(d, scaler, source)


def load_scaler_state_dict(
  opt_state: Any, state_dict: Any, scaler: Scaler
) -> Any:
  """``opt_state`` with its loss-scale state taken from ``state_dict``.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState` (for
      instance ``tx.init(params)``); batched states get the values
      broadcast, nnx-wrapped ones keep their Variables.
    state_dict: :func:`scaler_state_dict`'s dict, or a peer's scaler state
      (see the module docstring), recognised by its keys.
    scaler: the :class:`Scaler` the optimizer was built with. The state's
      configuration (what it holds or implies: intervals, factors, growth
      delay, hysteresis, floor) must agree with it.

  Returns:
    The new optax state. A peer's state sets the scale, the growth tracker
    and hysteresis; the previous scale becomes the loaded scale and the
    other counters of ``opt_state`` (``skipped_steps``, ``grad_norm``) are
    kept, since no peer stores them.

  Raises:
    ValueError: the state comes from no known source, holds a scale that is
      not a positive normal finite float32, or disagrees with ``scaler``
      (the message names the field; to take the peer's configuration build
      the optimizer with ``scaler_from_state_dict(state_dict)``).
  """
  scaler = _scaler_arg(scaler)
  old = _lookup.loss_scale_state(opt_state)
  source, d = _source(state_dict)
  values = _peer_values(source, d, scaler)
  fields = _own_fields(old)
  _check_leaf_counts(values, fields)
  if source == "fp16_scaling":
    for field in _SCALES:
      for v in np.ravel(values[field]):
        _validate.scale(f"state_dict[{field!r}]", float(v))
  else:
    # No peer keeps these: the last step's scale was the loaded one.
    values["prev_loss_scale"] = values["loss_scale"]
    values["min_scale_errors"] = 0
  new = _put_own(old, fields, values)
  return _lookup.replace_loss_scale_state(opt_state, new)


def scaler_from_state_dict(state_dict: Any, **overrides: Any) -> Scaler:
  """The preset whose configuration a peer's scaler state holds.

  For taking the peer's configuration rather than checking against one:
  build the optimizer with this scaler, then :func:`load_scaler_state_dict`.

  Args:
    state_dict: a state accepted by :func:`load_scaler_state_dict`, other
      than Megatron's (which holds no configuration: use
      :func:`megatron_scaler` with the run's arguments).
    **overrides: keyword arguments of the preset for what the state does not
      hold: DeepSpeed's optimizer states lack ``min_scale`` (the engine's
      ``min_loss_scale``, 1 by default) and, as saved by DeepSpeed 0.19.8,
      hysteresis; torch's lacks nothing.

  Returns:
    A :class:`Scaler` (``torch_scaler``, ``deepspeed_scaler`` or
    ``static_scaler``) whose initial scale is the state's scale.

  Raises:
    ValueError: for Megatron's or our own state, or an unknown one.
  """
  source, d = _source(state_dict)
  if source == "torch":
    kw = dict(
      init_scale=_scale("scale", d["scale"]),
      growth_factor=float(d["growth_factor"]),
      backoff_factor=float(d["backoff_factor"]),
      growth_interval=int(d["growth_interval"]),
    )
    return torch_scaler(**{**kw, **overrides})
  if source == "deepspeed_static" or (
    source == "deepspeed_optimizer" and not d["dynamic_loss_scale"]
  ):
    return static_scaler(_scale("cur_scale", d["cur_scale"]))
  if source.startswith("deepspeed"):
    if _number(d["scale_factor"]) != 2.0:
      raise ValueError(
        "DeepSpeed's DynamicLossScaler scales by 2; state_dict['scale_factor']"
        f" is {d['scale_factor']!r}"
      )
    kw = dict(
      init_scale=_scale("cur_scale", d["cur_scale"]),
      scale_window=_integer("scale_window", d["scale_window"]),
      raise_error_at_min_scale=False,
    )
    if source == "deepspeed_scaler":
      kw.update(
        min_scale=_number(d["min_scale"]),
        delayed_shift=_integer("delayed_shift", d["delayed_shift"]),
        consecutive_hysteresis=bool(d["consecutive_hysteresis"]),
        raise_error_at_min_scale=bool(d.get("raise_error_at_min_scale", True)),
      )
    kw.update(overrides)
    kw["min_scale"] = min(kw.get("min_scale", 1.0), kw["init_scale"])
    return deepspeed_scaler(**kw)
  raise ValueError(
    f"a {source} state holds no configuration to build a scaler from"
    + (
      "; use fs.megatron_scaler(...) with the run's arguments"
      if source == "megatron"
      else ""
    )
  )


def to_peer_state_dict(opt_state: Any, peer: str, scaler: Scaler) -> dict:
  """The loss-scale state of ``opt_state`` in a peer's own format.

  Args:
    opt_state: an optax state holding one unbatched :class:`LossScaleState`.
    peer: ``"torch"`` (for ``GradScaler.load_state_dict``), ``"megatron"``
      (``DynamicGradScaler.load_state_dict``; ``scale`` is a one-element
      float32 torch tensor, as Megatron saves it) or ``"deepspeed"`` (the
      loss-scale entries of ``FP16_Optimizer.state_dict()``, to merge into
      one before ``load_state_dict``, together with ``cur_hysteresis`` and the
      ``DynamicLossScaler`` attributes a ZeRO checkpoint's ``loss_scaler``
      holds).
    scaler: the :class:`Scaler` the optimizer was built with.

  Returns:
    A dict the peer loads, and that continues exactly as this state would.
    DeepSpeed's iteration counter restarts: ``cur_iter`` is the number of
    clean steps counted since the last overflow and ``last_overflow_iter`` is
    -1.

  Raises:
    ValueError: an unknown peer, a batched state, or a configuration the
      peer cannot run (for instance hysteresis for torch, or a growth delay
      other than the peer's).
  """
  scaler = _scaler_arg(scaler)
  if peer not in PEERS:
    raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")
  _lookup.require_host(opt_state, "to_peer_state_dict")
  ls = _lookup.loss_scale_state(opt_state)
  if np.ndim(ls.scaler.loss_scale):
    raise ValueError(
      "to_peer_state_dict needs one state, got a batched one of shape "
      f"{np.shape(ls.scaler.loss_scale)}: index one member first"
    )
  scale = float(jax.device_get(ls.scaler.loss_scale))
  tracker = int(jax.device_get(ls.scaler.growth_tracker))
  left = int(jax.device_get(ls.scaler.hysteresis_left))

  def need(field, value, why):
    if _config(scaler)[field] != value:
      raise ValueError(
        f"{peer} cannot continue this state: it needs {field}={value!r} "
        f"({why}), the scaler has {_config(scaler)[field]!r}"
      )

  if peer == "torch":
    need("growth_delay", 0, "torch grows after growth_interval clean steps")
    need("hysteresis", 1, "torch has no hysteresis")
    return {
      "scale": scale,
      "growth_factor": scaler.growth_factor,
      "backoff_factor": scaler.backoff_factor,
      "growth_interval": scaler.growth_interval,
      "_growth_tracker": tracker,
    }
  if peer == "megatron":
    import torch  # only for this peer, whose load calls scale.cuda()

    need("growth_delay", 0, "Megatron grows after growth_interval clean steps")
    return {
      "scale": torch.tensor([scale], dtype=torch.float32),
      "growth_tracker": tracker,
      "hysteresis_tracker": left + 1,
    }
  if not scaler.dynamic:
    return {"dynamic_loss_scale": False, "cur_scale": scale, "cur_iter": 0}
  need("growth_delay", 1, "DeepSpeed's first growth is one step later")
  need("growth_factor", 2.0, "DeepSpeed's scale_factor is 2")
  need("backoff_factor", 0.5, "DeepSpeed divides by its scale_factor")
  since = 0 if tracker < 0 else tracker + 1
  return {
    "dynamic_loss_scale": True,
    "cur_scale": scale,
    "cur_iter": since,
    "last_overflow_iter": -1,
    "scale_factor": 2.0,
    "scale_window": scaler.growth_interval,
    "cur_hysteresis": left + 1,
    "min_scale": scaler.min_scale,
    "delayed_shift": scaler.hysteresis,
    "consecutive_hysteresis": scaler.consecutive_hysteresis,
    "raise_error_at_min_scale": scaler.raise_at_min_scale,
  }


def set_loss_scale(opt_state: Any, scale: float) -> Any:
  """``opt_state`` with the loss scale for the next step set to ``scale``.

  The growth tracker and hysteresis are left as they are.

  Args:
    opt_state: an optax state holding one :class:`LossScaleState`.
    scale: the new scale, a positive normal finite float32.

  Returns:
    The new optax state.

  Raises:
    ValueError: ``scale`` is negative, zero, subnormal, inf or NaN.

  Examples:
    >>> import jax.numpy as jnp, optax, fp16_scaling as fs
    >>> tx = fs.skip_on_overflow(
    ...     optax.chain(fs.fp16_loss_scale(fs.torch_scaler())))
    >>> state = fs.set_loss_scale(tx.init(jnp.zeros(2)), 512.0)
    >>> float(fs.current_scale(state))
    512.0
  """
  scale = _validate.scale("scale", scale)
  old = _lookup.loss_scale_state(opt_state)
  loss_scale = jnp.full_like(old.scaler.loss_scale, scale)
  new = old._replace(scaler=old.scaler._replace(loss_scale=loss_scale))
  return _lookup.replace_loss_scale_state(opt_state, new)
