"""Where a value came from, known by its identity: the history that a few
slips show and a state's arrays do not (docs/history.md).

A :class:`Records` table maps objects, by identity, to what the library
knows of them, for as long as each object lives (a weak reference keeps
nothing alive). It is read and written while Python runs: at each eager
call, and once a trace under ``jit``, so the compiled step, a state's
treedef and a checkpoint hold none of it. A value that crossed a ``jit``
boundary (an argument seen from inside the trace, or a jitted call's
result) is a new object with no record: it is unknown, and no check
refuses what it does not know.

:data:`LOSS_SCALE` holds a :class:`Made` for each loss-scale state the
library made, keyed by its :func:`token`. Its makers and readers:

- ``tx.init`` and ``tx.update`` of :func:`chain` record what they return
  (``_loss_scale``), and the update marks the state it was given as
  ``consumed``; its first update of a state made by another configuration
  compares the two (``_loss_scale.check_state``).
- :func:`sync_loss_scales` refuses a state that did not step since
  ``tx.init`` or the last sync, or that ``tx.update`` consumed, and one
  whose scale was set while another's was not; it records what it returns
  as synced.
- :func:`set_loss_scale` and :func:`load_scaler_state_dict` record what
  they return as set; the latter checks the scaler given against ``by``.

``_select`` keeps two tables of its own: the states :func:`value_and_grad`
was given and what its forward pass wrote, for :func:`select_on_overflow`.
"""

import operator
from typing import Any, NamedTuple, Optional
import weakref


class Records:
  """Records kept by the identity of a key, an object or a tuple of
  objects; each dropped when an object of its key is freed."""

  def __init__(self):
    self._entries = {}

  def put(self, key: Any, record: Any) -> None:
    """Records ``record`` for ``key``, in place of any earlier one; nothing
    for a key that holds an object with no identity to keep (a Python
    number, a numpy scalar)."""
    objects = key if isinstance(key, tuple) else (key,)
    ids = tuple(map(id, objects))

    def forget(ref):
      refs = self._entries.get(ids, ((), None))[0]
      if any(r is ref for r in refs):
        del self._entries[ids]

    try:
      refs = tuple(weakref.ref(x, forget) for x in objects)
    except TypeError:
      return
    self._entries[ids] = (refs, record)

  def get(self, key: Any) -> Any:
    """The record of ``key``, or None."""
    objects = key if isinstance(key, tuple) else (key,)
    refs, record = self._entries.get(tuple(map(id, objects)), ((), None))
    alive = tuple(ref() for ref in refs)
    if len(alive) == len(objects) and all(map(operator.is_, alive, objects)):
      return record
    return None

  def clear(self) -> None:
    """Forgets every record."""
    self._entries.clear()


class Made(NamedTuple):
  """What made a loss-scale state, and what has happened to it since.

  Attributes:
    by: the ``ScaleConfig`` of the ``fp16_loss_scale`` whose ``tx.init``
      or ``tx.update`` made it (or made the state it was set or synced
      from), or None where that is not known.
    stepped: True when ``tx.update`` made it, False when ``tx.init`` or a
      sync did, None where that is not known.
    scale_set: whether its scale was set (``set_loss_scale``,
      ``load_scaler_state_dict``) since ``tx.init`` or the last sync; None
      where that is not known.
    consumed: whether it was given to ``tx.update``: a state from before
      the update, whose successor the update returned.
  """

  by: Any = None
  stepped: Optional[bool] = None
  scale_set: Optional[bool] = None
  consumed: bool = False


LOSS_SCALE = Records()


def token(ls: Any) -> tuple:
  """The identity of a loss-scale state, two of its arrays: its next scale,
  which every maker of a state writes anew (a sync one for all the states
  it returns), and its count of skipped steps, which ``tx.init`` and
  ``tx.update`` write anew and the others keep, and which tells apart the
  states one sync returns."""
  return (ls.scaler.loss_scale, ls.skipped_steps)


def made(ls: Any) -> Made:
  """What :data:`LOSS_SCALE` knows of the loss-scale state ``ls``:
  ``Made()``, all unknown, where it holds nothing."""
  return LOSS_SCALE.get(token(ls)) or Made()


def record(ls: Any, what: Made) -> None:
  """Records ``what`` made the loss-scale state ``ls``."""
  LOSS_SCALE.put(token(ls), what)
