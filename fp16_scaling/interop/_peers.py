"""The PyTorch peers' scaler states, one :class:`Peer` record each: how it is
recognised, what it implies, and its counters both ways, exactly.
"""

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np

from fp16_scaling import _validate
from fp16_scaling._scaler import Scaler
from fp16_scaling._scaler import deepspeed_scaler
from fp16_scaling._scaler import static_scaler
from fp16_scaling._scaler import torch_scaler


def read_entry(d: Mapping, key: str, check: Callable = _validate.number, **kw):
  """``d[key]`` (a number, or an array or tensor of one) through a
  :mod:`_validate` check (``kw`` its range), named ``state_dict[key]``."""
  name = f"state_dict[{key!r}]"
  value = _validate.one_element(name, d[key])
  return _validate.from_data(check, name, value, **kw)


def read_scale(d: Mapping, key: str) -> float:
  """``d[key]``, checked to be a loss scale."""
  return read_entry(d, key, _validate.scale)


def read_int(d: Mapping, key: str, **kw) -> int:
  """``d[key]``, an integer (``kw``: ``low``, ``high``, ``why``)."""
  return read_entry(d, key, _validate.integer, **kw)


def read_tracker(d: Mapping, key: str, scaler: Scaler) -> int:
  """A growth tracker, in the range ``scaler`` counts it in."""
  low, high = -scaler.growth_delay, scaler.growth_interval - 1
  why = f" for growth_interval {scaler.growth_interval}"
  return read_int(d, key, low=low, high=high, why=why)


def read_config(d: Mapping, table: tuple) -> dict:
  """The configuration entries of ``table`` that ``d`` holds, checked, by
  the peer's names; a row of ``table`` is (the peer's name, the Scaler field
  it sets, its check, the check's range)."""
  return {
    key: read_entry(d, key, check, **kw)
    for key, _, check, kw in table
    if key in d
  }


def implied(d: Mapping, table: tuple) -> dict:
  """:func:`read_config`'s entries by the Scaler fields they set."""
  config = read_config(d, table)
  return {field: config[key] for key, field, _, _ in table if key in config}


def config(scaler: Scaler) -> dict:
  """Every field of ``scaler``, by name."""
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
  """Raises if ``scaler`` differs from what a ``source`` state implies."""
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


class Counters(NamedTuple):
  """The :class:`ScalerState` values a peer's state carries."""

  loss_scale: float
  growth_tracker: int
  hysteresis_left: int

  @classmethod
  def of(cls, state: Any) -> "Counters":
    """The counters of one (unbatched) host :class:`ScalerState`."""
    return cls(*(np.asarray(getattr(state, f)).item() for f in cls._fields))


@dataclasses.dataclass(frozen=True)
class Peer:
  """One peer's saved scaler state: its ``keys``, the fields it ``implies``,
  its counters both ways, what ``from_own`` ``needs``, its ``preset``."""

  name: str
  saved_by: str
  keys: frozenset
  implies: Callable[[Mapping], dict]
  to_own: Callable[[Mapping, Scaler], Counters]
  from_own: Callable[[Counters, Scaler], dict]
  needs: tuple  # of (field, value, why)
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


# torch.amp.GradScaler: its tracker is the one here; no hysteresis.
_TORCH_CONFIG = {
  "growth_factor": _validate.number,
  "backoff_factor": _validate.number,
  "growth_interval": _validate.integer,
}


def _torch_config(d: Mapping) -> dict:
  return {
    key: read_entry(d, key, check) for key, check in _TORCH_CONFIG.items()
  }


def _torch_from_own(c: Counters, scaler: Scaler) -> dict:
  return {
    "scale": c.loss_scale,
    **{key: getattr(scaler, key) for key in _TORCH_CONFIG},
    "_growth_tracker": c.growth_tracker,
  }


TORCH = Peer(
  name="torch GradScaler",
  saved_by="torch GradScaler.state_dict()",
  keys=frozenset({"scale", "_growth_tracker", *_TORCH_CONFIG}),
  implies=lambda d: {**_torch_config(d), "growth_delay": 0, "hysteresis": 1},
  to_own=lambda d, scaler: Counters(
    read_scale(d, "scale"), read_tracker(d, "_growth_tracker", scaler), 0
  ),
  from_own=_torch_from_own,
  needs=(
    ("growth_delay", 0, "torch grows after growth_interval clean steps"),
    ("hysteresis", 1, "torch has no hysteresis"),
  ),
  preset=lambda d, overrides: torch_scaler(
    **{"init_scale": read_scale(d, "scale"), **_torch_config(d), **overrides}
  ),
)


# Megatron-core DynamicGradScaler: its hysteresis_tracker keeps falling
# below 1 while it backs off, as hysteresis_left == 0 does here.
def _megatron_to_own(d: Mapping, scaler: Scaler) -> Counters:
  why = " (the scaler's hysteresis)"
  tracker = read_int(d, "hysteresis_tracker", high=scaler.hysteresis, why=why)
  growth = read_tracker(d, "growth_tracker", scaler)
  return Counters(read_scale(d, "scale"), growth, max(tracker - 1, 0))


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


# DeepSpeed's DynamicLossScaler, also inside the fp16 optimizers' state:
# with k = cur_iter - last_overflow_iter - 1, the tracker here is -1 when
# k == 0, else (k - 1) % scale_window; cur_hysteresis is hysteresis_left + 1.

# What a ZeRO loss_scaler adds: (attribute, Scaler field, check, the check's
# range), a read_config table. Old releases lack raise_error_at_min_scale.
_DS_ZERO = (
  ("min_scale", "min_scale", _validate.number, {}),
  ("delayed_shift", "hysteresis", _validate.integer, {}),
  ("consecutive_hysteresis", "consecutive_hysteresis", _validate.boolean, {}),
  ("raise_error_at_min_scale", "raise_at_min_scale", _validate.boolean, {}),
)


def _ds_implies(d: Mapping) -> dict:
  factor = read_entry(d, "scale_factor", _validate.positive)
  return {
    "growth_factor": factor,
    "backoff_factor": 1.0 / factor,
    "growth_interval": read_int(d, "scale_window"),
    "growth_delay": 1,
  }


def _ds_loss_scaler_implies(d: Mapping) -> dict:
  zero = implied(d, _DS_ZERO)
  return {**_ds_implies(d), **zero}


def _ds_to_own(d: Mapping, scaler: Scaler) -> Counters:
  cur_iter = read_int(d, "cur_iter")
  why = " (below state_dict['cur_iter'])"
  last = read_int(d, "last_overflow_iter", high=cur_iter - 1, why=why)
  since = cur_iter - last - 1
  # A 0.19.8 FP16_Optimizer keeps no hysteresis; DeepSpeed after 0.19.8
  # loads such a checkpoint with its hysteresis full, and so does this.
  cur = scaler.hysteresis
  if "cur_hysteresis" in d:
    why = " for the scaler's hysteresis"
    cur = read_int(d, "cur_hysteresis", low=1, high=scaler.hysteresis, why=why)
  tracker = -1 if since == 0 else (since - 1) % scaler.growth_interval
  return Counters(read_scale(d, "cur_scale"), tracker, cur - 1)


def _ds_from_own(c: Counters, scaler: Scaler) -> dict:
  """The fp16 optimizers' entries, with a ZeRO ``loss_scaler``'s."""
  return {
    "dynamic_loss_scale": True,
    "cur_scale": c.loss_scale,
    "cur_iter": 0 if c.growth_tracker < 0 else c.growth_tracker + 1,
    "last_overflow_iter": -1,
    "scale_factor": 2.0,
    "scale_window": scaler.growth_interval,
    "cur_hysteresis": c.hysteresis_left + 1,
    **{key: getattr(scaler, field) for key, field, _, _ in _DS_ZERO},
  }


_DS_NEEDS = (
  ("growth_delay", 1, "DeepSpeed's first growth is one step later"),
  ("growth_factor", 2.0, "DeepSpeed's scale_factor is 2"),
  ("backoff_factor", 0.5, "DeepSpeed divides by its scale_factor"),
)


def _ds_preset(d: Mapping, overrides: dict, zero: dict) -> Scaler:
  """``deepspeed_scaler`` from the optimizer's entries, then ``zero`` (what
  a ZeRO loss_scaler adds), then ``overrides``."""
  if read_entry(d, "scale_factor") != 2.0:
    raise ValueError(
      "DeepSpeed's DynamicLossScaler scales by 2; state_dict['scale_factor']"
      f" is {d['scale_factor']!r}"
    )
  kw = {
    "init_scale": read_scale(d, "cur_scale"),
    "scale_window": read_int(d, "scale_window"),
    "raise_error_at_min_scale": False,  # the fp16 optimizers never raise
    **zero,
    **overrides,
  }
  kw["min_scale"] = min(kw.get("min_scale", 1.0), kw["init_scale"])
  return deepspeed_scaler(**kw)


_DS_OPTIMIZER_KEYS = frozenset({"dynamic_loss_scale", "cur_scale", "cur_iter"})

DS_LOSS_SCALER = Peer(
  name="DeepSpeed DynamicLossScaler",
  saved_by="a ZeRO checkpoint's loss_scaler",
  keys=frozenset(
    (
      "cur_scale cur_iter last_overflow_iter scale_factor scale_window "
      "min_scale delayed_shift cur_hysteresis consecutive_hysteresis"
    ).split()
  ),
  implies=_ds_loss_scaler_implies,
  to_own=_ds_to_own,
  from_own=_ds_from_own,
  needs=_DS_NEEDS,
  preset=lambda d, overrides: _ds_preset(
    d, overrides, {"raise_error_at_min_scale": True, **read_config(d, _DS_ZERO)}
  ),
)

# The fp16 optimizers' state: the loss scaler's counters, as it reads them.
DS_OPTIMIZER = dataclasses.replace(
  DS_LOSS_SCALER,
  name="DeepSpeed FP16_Optimizer",
  saved_by="DeepSpeed FP16_Optimizer / FP16_UnfusedOptimizer.state_dict()",
  keys=_DS_OPTIMIZER_KEYS,
  implies=_ds_implies,
  preset=lambda d, overrides: _ds_preset(d, overrides, {}),
  when=lambda d: bool(d["dynamic_loss_scale"]),
)


def _ds_static(d: Mapping) -> bool:
  """A ``LossScaler``'s attributes (``dynamic`` false), or an fp16
  optimizer's state with ``dynamic_loss_scale`` false."""
  if "dynamic" in d and not d["dynamic"]:
    return True
  return _DS_OPTIMIZER_KEYS <= set(d) and not d["dynamic_loss_scale"]


def _ds_static_to_own(d: Mapping, scaler: Scaler) -> Counters:
  loss_scale = read_scale(d, "cur_scale")
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
  preset=lambda d, overrides: static_scaler(read_scale(d, "cur_scale")),
  when=_ds_static,
)


# Tried in order, the first to recognise a state wins (the DeepSpeed dict
# to_peer_state_dict writes has both DeepSpeed key sets).
PEERS = (DS_LOSS_SCALER, DS_STATIC, DS_OPTIMIZER, TORCH, MEGATRON)

# to_peer_state_dict's names.
EXPORTS = {"torch": TORCH, "megatron": MEGATRON, "deepspeed": DS_OPTIMIZER}


def recognise(d: Mapping, peers: tuple = PEERS) -> Optional[Peer]:
  """The first peer in ``peers`` (:data:`PEERS`) whose state ``d`` is, or
  None."""
  return next((peer for peer in peers if peer.recognises(d)), None)


def exported(name: str, scaler: Scaler, exports: Mapping = EXPORTS) -> Peer:
  """The peer that ``to_peer_state_dict`` writes ``name``'s state for, of
  ``exports`` (:data:`EXPORTS`)."""
  peer = exports[name]
  if peer is DS_OPTIMIZER and not scaler.dynamic:
    return DS_STATIC
  return peer
