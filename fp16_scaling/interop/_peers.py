"""The PyTorch peers' scaler states: one record per peer.

Each :class:`Peer` says how a peer's saved state is recognised (the keys it
always holds), what configuration it implies (checked against the
:class:`Scaler` it is loaded into), how its counters map to the
:class:`ScalerState` here (``to_own``) and back (``from_own``, for
``to_peer_state_dict``), and which preset it describes
(``scaler_from_state_dict``). The peers:

* ``torch.amp.GradScaler.state_dict()``: ``scale``, ``growth_factor``,
  ``backoff_factor``, ``growth_interval``, ``_growth_tracker``;
* Megatron-core ``DynamicGradScaler.state_dict()``: ``scale``,
  ``growth_tracker``, ``hysteresis_tracker``;
* DeepSpeed ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer.state_dict()``:
  ``dynamic_loss_scale``, ``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
  ``scale_factor``, ``scale_window``, and ``cur_hysteresis`` from DeepSpeed
  releases after 0.19.8;
* a ZeRO checkpoint's ``loss_scaler`` (DeepSpeed's ``DynamicLossScaler``, or
  its attributes as a dict);
* DeepSpeed's static scale: its ``LossScaler`` (``dynamic`` false), or an fp16
  optimizer's ``state_dict()`` with ``dynamic_loss_scale`` false.

The peers count differently from :class:`ScalerState`; each mapping below is
exact, so that a run continued here takes the same decisions as the peer:

* DeepSpeed grows when ``cur_iter - last_overflow_iter - 1`` (``k`` for the
  next step) is a positive multiple of ``scale_window``; here the tracker is
  ``-1`` when ``k == 0`` and ``(k - 1) % scale_window`` otherwise. Going back,
  the iteration counter restarts: ``cur_iter`` is ``k`` and
  ``last_overflow_iter`` is -1. ``cur_hysteresis`` (1 to ``delayed_shift``) is
  ``hysteresis_left + 1``.
* Megatron's ``hysteresis_tracker`` goes on falling below 1 while it backs
  off; every value <= 1 backs off on the next overflow, as
  ``hysteresis_left == 0`` does here.
* torch's ``_growth_tracker`` is the tracker here; torch has no hysteresis.
"""

import dataclasses
import math
from typing import (
  Any,
  Callable,
  FrozenSet,
  Mapping,
  NamedTuple,
  Optional,
  Tuple,
)

import numpy as np

from fp16_scaling import _validate
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import deepspeed_scaler
from fp16_scaling._scaler import static_scaler
from fp16_scaling._scaler import torch_scaler

# ---------------------------------------------------------------- values


def number(x: Any) -> float:
  """A Python float from a number, a one-element tensor or array."""
  if hasattr(x, "detach"):  # a torch tensor, read without importing torch
    x = x.detach().cpu().numpy()
  a = np.asarray(x)
  if a.size != 1:
    raise ValueError(f"expected one number, got an array of shape {a.shape}")
  return float(a.reshape(()))


def integer(field: str, x: Any) -> int:
  v = number(x)
  if not math.isfinite(v) or v != int(v):
    raise ValueError(f"state_dict[{field!r}] must be an integer, got {x!r}")
  return int(v)


def scale(field: str, x: Any) -> float:
  return _validate.scale(f"state_dict[{field!r}]", number(x))


def _tracker(field: str, d: Mapping, scaler: Scaler) -> int:
  value = integer(field, d[field])
  if not -scaler.growth_delay <= value < scaler.growth_interval:
    raise ValueError(
      f"state_dict[{field!r}] must lie in [{-scaler.growth_delay}, "
      f"{scaler.growth_interval - 1}] for growth_interval "
      f"{scaler.growth_interval}, got {value}"
    )
  return value


# ---------------------------------------------------------- configuration


def config(scaler: Scaler) -> dict:
  """Every field of ``scaler``: a field added to :class:`Scaler` is saved and
  checked on load without a change here."""
  return {f.name: getattr(scaler, f.name) for f in dataclasses.fields(Scaler)}


def _same(mine: Any, value: Any) -> bool:
  """Whether a scaler field equals a saved one (floats as float32)."""
  if mine is None or value is None:
    return mine is None and value is None
  if isinstance(mine, float) and not isinstance(value, bool):
    return bool(np.float32(mine) == np.float32(value))
  return mine == value


PEER_FIX = (
  "Build the optimizer with the peer's configuration "
  "(fs.scaler_from_state_dict(state_dict) gives it as a preset) or load "
  "into a matching scaler."
)


def check(
  scaler: Scaler, source: str, expected: Mapping[str, Any], fix: str
) -> None:
  """Raises if ``scaler``'s fields differ from what a ``source`` state
  implies; ``fix`` says what to do about it."""
  have = config(scaler)
  for field, value in expected.items():
    if field not in have:
      raise ValueError(
        f"{source} state holds a scaler field this version does not know: "
        f"{field}={value!r}. Load it with the fp16_scaling version that "
        f"saved it, or delete state_dict['config'][{field!r}] if it does not "
        "matter to this run."
      )
    if not _same(have[field], value):
      raise ValueError(
        f"{source} state disagrees with the scaler on {field}: the state "
        f"implies {value!r}, the scaler has {have[field]!r}. {fix}"
      )


# ---------------------------------------------------------------- records


class Counters(NamedTuple):
  """The :class:`ScalerState` values a peer's state carries."""

  loss_scale: float
  growth_tracker: int
  hysteresis_left: int


@dataclasses.dataclass(frozen=True)
class Peer:
  """One peer's saved scaler state.

  Attributes:
    name: the peer in messages.
    saved_by: what saves such a state, for the message on an unknown one.
    keys: a state holding all of these is this peer's (when ``when`` agrees).
    implies: the :class:`Scaler` fields a state implies, checked on load.
    to_own: a state's counters (after the check), as :class:`Counters`.
    from_own: :class:`Counters` as a state the peer loads.
    needs: ``(field, value, why)``: the scaler ``from_own`` needs.
    preset: ``(state, overrides)`` to the preset the state describes.
    when: whether a state with ``keys`` is this peer's.
  """

  name: str
  saved_by: str
  keys: FrozenSet[str]
  implies: Callable[[Mapping], dict]
  to_own: Callable[[Mapping, Scaler], Counters]
  from_own: Callable[[Counters, Scaler], dict]
  needs: Tuple[Tuple[str, Any, str], ...]
  preset: Callable[[Mapping, dict], Scaler]
  when: Callable[[Mapping], bool] = lambda d: True

  def recognises(self, d: Mapping) -> bool:
    return self.keys <= set(map(str, d)) and self.when(d)

  def load(self, d: Mapping, scaler: Scaler) -> Counters:
    """The counters of the peer's state ``d``, checked against ``scaler``."""
    check(scaler, self.name, self.implies(d), PEER_FIX)
    return self.to_own(d, scaler)

  def save(self, counters: Counters, scaler: Scaler) -> dict:
    """``counters`` as the peer's state, for a run that continues there."""
    have = config(scaler)
    for field, value, why in self.needs:
      if have[field] != value:
        raise ValueError(
          f"{self.name} cannot continue this state: it needs "
          f"{field}={value!r} ({why}), the scaler has {have[field]!r}"
        )
    return self.from_own(counters, scaler)


# torch.amp.GradScaler


def _torch_implies(d: Mapping) -> dict:
  return {
    "growth_factor": float(d["growth_factor"]),
    "backoff_factor": float(d["backoff_factor"]),
    "growth_interval": int(d["growth_interval"]),
    "growth_delay": 0,
    "hysteresis": 1,
  }


def _torch_to_own(d: Mapping, scaler: Scaler) -> Counters:
  tracker = _tracker("_growth_tracker", d, scaler)
  return Counters(scale("scale", d["scale"]), tracker, 0)


def _torch_from_own(c: Counters, scaler: Scaler) -> dict:
  return {
    "scale": c.loss_scale,
    "growth_factor": scaler.growth_factor,
    "backoff_factor": scaler.backoff_factor,
    "growth_interval": scaler.growth_interval,
    "_growth_tracker": c.growth_tracker,
  }


def _torch_preset(d: Mapping, overrides: dict) -> Scaler:
  kw = dict(
    init_scale=scale("scale", d["scale"]),
    growth_factor=float(d["growth_factor"]),
    backoff_factor=float(d["backoff_factor"]),
    growth_interval=int(d["growth_interval"]),
  )
  return torch_scaler(**{**kw, **overrides})


TORCH = Peer(
  name="torch GradScaler",
  saved_by="torch GradScaler.state_dict()",
  keys=frozenset(
    {
      "scale",
      "growth_factor",
      "backoff_factor",
      "growth_interval",
      "_growth_tracker",
    }
  ),
  implies=_torch_implies,
  to_own=_torch_to_own,
  from_own=_torch_from_own,
  needs=(
    ("growth_delay", 0, "torch grows after growth_interval clean steps"),
    ("hysteresis", 1, "torch has no hysteresis"),
  ),
  preset=_torch_preset,
)


# Megatron-core DynamicGradScaler


def _megatron_to_own(d: Mapping, scaler: Scaler) -> Counters:
  tracker = integer("hysteresis_tracker", d["hysteresis_tracker"])
  if tracker > scaler.hysteresis:
    raise ValueError(
      f"state_dict['hysteresis_tracker'] ({tracker}) exceeds the scaler's "
      f"hysteresis ({scaler.hysteresis})"
    )
  growth = _tracker("growth_tracker", d, scaler)
  return Counters(scale("scale", d["scale"]), growth, max(tracker - 1, 0))


def _megatron_from_own(c: Counters, scaler: Scaler) -> dict:
  del scaler
  import torch  # only for this peer, whose load calls scale.cuda()

  return {
    "scale": torch.tensor([c.loss_scale], dtype=torch.float32),
    "growth_tracker": c.growth_tracker,
    "hysteresis_tracker": c.hysteresis_left + 1,
  }


def _megatron_preset(d: Mapping, overrides: dict) -> Scaler:
  del d, overrides
  raise ValueError(
    "a Megatron DynamicGradScaler state holds no configuration to build a "
    "scaler from; use fs.megatron_scaler(...) with the run's arguments"
  )


MEGATRON = Peer(
  name="Megatron DynamicGradScaler",
  saved_by="Megatron DynamicGradScaler.state_dict()",
  keys=frozenset({"scale", "growth_tracker", "hysteresis_tracker"}),
  # Megatron's state holds no configuration; its counters imply only this.
  implies=lambda d: {"growth_delay": 0},
  to_own=_megatron_to_own,
  from_own=_megatron_from_own,
  needs=(
    ("growth_delay", 0, "Megatron grows after growth_interval clean steps"),
  ),
  preset=_megatron_preset,
)


# DeepSpeed's DynamicLossScaler, also inside the fp16 optimizers' state


def _ds_implies(d: Mapping) -> dict:
  factor = number(d["scale_factor"])
  return {
    "growth_factor": factor,
    "backoff_factor": 1.0 / factor,
    "growth_interval": integer("scale_window", d["scale_window"]),
    "growth_delay": 1,
  }


def _ds_scaler_implies(d: Mapping) -> dict:
  """A ZeRO ``loss_scaler`` also holds the floor and the hysteresis."""
  out = _ds_implies(d)
  out.update(
    min_scale=number(d["min_scale"]),
    hysteresis=integer("delayed_shift", d["delayed_shift"]),
    consecutive_hysteresis=bool(d["consecutive_hysteresis"]),
  )
  if "raise_error_at_min_scale" in d:
    out["raise_at_min_scale"] = bool(d["raise_error_at_min_scale"])
  return out


def _ds_to_own(d: Mapping, scaler: Scaler) -> Counters:
  since = (
    integer("cur_iter", d["cur_iter"])
    - integer("last_overflow_iter", d["last_overflow_iter"])
    - 1
  )
  if since < 0:
    raise ValueError(
      "state_dict['last_overflow_iter'] must be below state_dict['cur_iter'], "
      f"got {d['last_overflow_iter']} and {d['cur_iter']}"
    )
  # A 0.19.8 FP16_Optimizer keeps no hysteresis; DeepSpeed after 0.19.8
  # loads such a checkpoint with its hysteresis full, and so does this.
  cur = integer("cur_hysteresis", d.get("cur_hysteresis", scaler.hysteresis))
  if not 1 <= cur <= scaler.hysteresis:
    raise ValueError(
      f"state_dict['cur_hysteresis'] must lie in [1, {scaler.hysteresis}] "
      f"for the scaler's hysteresis, got {cur}"
    )
  tracker = -1 if since == 0 else (since - 1) % scaler.growth_interval
  return Counters(scale("cur_scale", d["cur_scale"]), tracker, cur - 1)


def _ds_from_own(c: Counters, scaler: Scaler) -> dict:
  """The fp16 optimizers' loss-scale entries and ``cur_hysteresis``, with the
  ``DynamicLossScaler`` attributes a ZeRO ``loss_scaler`` holds."""
  return {
    "dynamic_loss_scale": True,
    "cur_scale": c.loss_scale,
    "cur_iter": 0 if c.growth_tracker < 0 else c.growth_tracker + 1,
    "last_overflow_iter": -1,
    "scale_factor": 2.0,
    "scale_window": scaler.growth_interval,
    "cur_hysteresis": c.hysteresis_left + 1,
    "min_scale": scaler.min_scale,
    "delayed_shift": scaler.hysteresis,
    "consecutive_hysteresis": scaler.consecutive_hysteresis,
    "raise_error_at_min_scale": scaler.raise_at_min_scale,
  }


_DS_NEEDS = (
  ("growth_delay", 1, "DeepSpeed's first growth is one step later"),
  ("growth_factor", 2.0, "DeepSpeed's scale_factor is 2"),
  ("backoff_factor", 0.5, "DeepSpeed divides by its scale_factor"),
)


def _ds_preset(d: Mapping, overrides: dict, zero: dict) -> Scaler:
  """``deepspeed_scaler`` from the optimizer's entries, then ``zero`` (what a
  ZeRO loss_scaler adds), then ``overrides``."""
  if number(d["scale_factor"]) != 2.0:
    raise ValueError(
      "DeepSpeed's DynamicLossScaler scales by 2; state_dict['scale_factor']"
      f" is {d['scale_factor']!r}"
    )
  kw = dict(
    init_scale=scale("cur_scale", d["cur_scale"]),
    scale_window=integer("scale_window", d["scale_window"]),
    raise_error_at_min_scale=False,
  )
  kw.update(zero)
  kw.update(overrides)
  kw["min_scale"] = min(kw.get("min_scale", 1.0), kw["init_scale"])
  return deepspeed_scaler(**kw)


def _ds_loss_scaler_preset(d: Mapping, overrides: dict) -> Scaler:
  zero = dict(
    min_scale=number(d["min_scale"]),
    delayed_shift=integer("delayed_shift", d["delayed_shift"]),
    consecutive_hysteresis=bool(d["consecutive_hysteresis"]),
    raise_error_at_min_scale=bool(d.get("raise_error_at_min_scale", True)),
  )
  return _ds_preset(d, overrides, zero)


_DS_OPTIMIZER_KEYS = frozenset({"dynamic_loss_scale", "cur_scale", "cur_iter"})

DS_LOSS_SCALER = Peer(
  name="DeepSpeed DynamicLossScaler",
  saved_by="a ZeRO checkpoint's loss_scaler",
  keys=frozenset(
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
  ),
  implies=_ds_scaler_implies,
  to_own=_ds_to_own,
  from_own=_ds_from_own,
  needs=_DS_NEEDS,
  preset=_ds_loss_scaler_preset,
)

DS_OPTIMIZER = Peer(
  name="DeepSpeed FP16_Optimizer",
  saved_by="DeepSpeed FP16_Optimizer / FP16_UnfusedOptimizer.state_dict()",
  keys=_DS_OPTIMIZER_KEYS,
  implies=_ds_implies,
  to_own=_ds_to_own,
  from_own=_ds_from_own,
  needs=_DS_NEEDS,
  preset=lambda d, overrides: _ds_preset(d, overrides, {}),
  when=lambda d: bool(d["dynamic_loss_scale"]),
)


# DeepSpeed's static scale


def _ds_static(d: Mapping) -> bool:
  """A ``LossScaler``'s attributes (``dynamic`` false), or an fp16
  optimizer's state with ``dynamic_loss_scale`` false."""
  if "dynamic" in d and not d["dynamic"]:
    return True
  return _DS_OPTIMIZER_KEYS <= set(d) and not d["dynamic_loss_scale"]


def _ds_static_to_own(d: Mapping, scaler: Scaler) -> Counters:
  loss_scale = scale("cur_scale", d["cur_scale"])
  if scaler.dynamic:
    raise ValueError(
      "DeepSpeed state disagrees with the scaler on dynamic: the state holds "
      f"a static loss scale ({loss_scale!r}), the scaler is dynamic. Use "
      "fs.static_scaler(...) (fs.scaler_from_state_dict(state_dict))."
    )
  return Counters(loss_scale, 0, 0)


DS_STATIC = Peer(
  name="DeepSpeed static loss scale",
  saved_by=(
    "DeepSpeed's static LossScaler, or an fp16 optimizer's state_dict() with "
    "dynamic_loss_scale false"
  ),
  keys=frozenset({"cur_scale"}),
  implies=lambda d: {},  # to_own checks that the scaler is static
  to_own=_ds_static_to_own,
  from_own=lambda c, scaler: {
    "dynamic_loss_scale": False,
    "cur_scale": c.loss_scale,
    "cur_iter": 0,
  },
  needs=(),
  preset=lambda d, overrides: static_scaler(scale("cur_scale", d["cur_scale"])),
  when=_ds_static,
)


# Tried in this order; the first that recognises a state is its peer (the
# dict to_peer_state_dict writes for DeepSpeed holds the keys of both
# DeepSpeed's loss_scaler and its optimizer).
PEERS = (DS_LOSS_SCALER, DS_STATIC, DS_OPTIMIZER, TORCH, MEGATRON)

# to_peer_state_dict's names.
EXPORTS = {"torch": TORCH, "megatron": MEGATRON, "deepspeed": DS_OPTIMIZER}


def recognise(d: Mapping) -> Optional[Peer]:
  """The first peer in :data:`PEERS` whose state ``d`` is, or None."""
  return next((peer for peer in PEERS if peer.recognises(d)), None)


def exported(name: str, scaler: Scaler) -> Peer:
  """The peer that ``to_peer_state_dict(..., name, scaler)`` writes for:
  DeepSpeed's static form for a static scaler."""
  peer = EXPORTS[name]
  if peer is DS_OPTIMIZER and not scaler.dynamic:
    return DS_STATIC
  return peer
