"""Stacked (scanned) layers: ``stacked_axes`` names each stacked leaf's layer
axis, and the state's per-leaf records become per *unit*: an unstacked leaf,
or one layer of a stacked leaf (docs/stacked.md).

A :class:`Layout` is ``stacked_axes`` resolved on the params, once, by
``tx.init`` (``ScaleConfig.layout``), and held, hashable, in the state's
treedef with what it names (``LeafPaths``: the layout, the units' paths
and sizes, and each stacked leaf's first unit); each update measures by
it. The units are in leaf order, a stacked leaf's L layers in layer order;
a state built without ``stacked_axes`` has one unit per leaf.
"""

import dataclasses
import difflib
from numbers import Integral
from typing import Any, Optional

import jax
import numpy as np

from fp16_scaling import _sharding
from fp16_scaling import _validate

_WHAT = (
  "stacked_axes must be a pytree prefix of the params with an int (the "
  "stacked leaves' layer axis) or None (not stacked) at each leaf, or a "
  "callable mapping the params to one (as fs.stacked_under(...) makes)"
)


def _is_none(x) -> bool:
  return x is None


def _leaves(prefix, what: str) -> list:
  """The prefix's leaves (None included), each an int or None."""
  leaves = jax.tree.leaves(prefix, is_leaf=_is_none)
  for a in leaves:
    if a is not None and (isinstance(a, bool) or not isinstance(a, Integral)):
      raise TypeError(f"{what}: {_WHAT}; got a leaf {a!r}")
  return leaves


def check(stacked_axes, what: str) -> Any:
  """``stacked_axes`` checked at construction; returns its equality key."""
  if stacked_axes is None or callable(stacked_axes):
    return stacked_axes
  treedef = jax.tree.structure(stacked_axes, is_leaf=_is_none)
  return (tuple(_leaves(stacked_axes, what)), treedef)


@dataclasses.dataclass(frozen=True)
class Layout:
  """``stacked_axes`` resolved on a tree.

  Attributes:
    axes: per leaf, its layer axis (normalised, >= 0), or None.
    layers: L, the number of layers of every stacked leaf (0 if none).
    names: the leaves' paths (``jax.tree_util.keystr``), an nnx
      ``Variable``'s with its ``.value``, as :func:`per_leaf` names them.
  """

  axes: tuple
  layers: int
  names: tuple


def resolve(stacked_axes, tree, partition_specs, what: str) -> Layout:
  """``stacked_axes`` (not None) on ``tree``: each layer axis within its
  leaf's ndim and where its partition names (if any) put ``"layers"``, one
  L for all, and (under ``shard_map``) not split over a mesh axis; a
  :class:`StackedUnder` whose names match no leaf is refused."""
  under = isinstance(stacked_axes, StackedUnder)
  try:
    prefix = stacked_axes(tree) if callable(stacked_axes) else stacked_axes
  except ValueError as e:
    if not under:
      raise
    raise ValueError(f"{what}: stacked_axes: {e}") from None
  values = _leaves(prefix, what)
  try:
    per_leaf = _sharding.broadcast_prefix(values, prefix, tree, _is_none)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what}: {_WHAT}: {e}") from None
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  names = [jax.tree_util.keystr(p) for p, _ in with_paths]
  specs = _sharding.leaf_specs(partition_specs, tree, what)
  boxes = _sharding.partition_names(tree, len(names))
  layer_names = {"layers", *(stacked_axes.names if under else ())}
  axes, found = [], {}
  for name, (_, x), a, spec, box in zip(
    names, with_paths, per_leaf, specs, boxes
  ):
    if a is not None:
      a = _leaf_axis(name, np.ndim(x), a, spec, what)
      _check_named_axis(name, a, box, layer_names, what)
      found[name] = np.shape(x)[a]
    axes.append(a)
  if len(set(found.values())) > 1:
    sizes = ", ".join(f"{n} has {L}" for n, L in found.items())
    raise ValueError(
      f"{what}: stacked_axes: every stacked leaf must have the same number "
      f"of layers on its layer axis; {sizes}"
    )
  _warn_if_axis_zero_fits(tree, axes, boxes, layer_names, what)
  return Layout(
    axes=tuple(axes),
    layers=next(iter(found.values()), 0),
    names=tuple(names),
  )


def _warn_if_axis_zero_fits(tree, axes, boxes, layer_names, what) -> None:
  """Warns when a layer axis other than 0 is given while axis 0 has one
  size on every stacked leaf too, a size no unstacked leaf has: the shapes
  cannot tell which axis holds the layers (a wrong one of matching size
  would pass every check), and ``jax.lax.scan``, ``nn.scan`` and
  ``nnx.scan`` stack them on axis 0. An axis 0 whose size an unstacked
  leaf shares (the head's or the embedding's width, as in MaxText's
  ``[embed, layers, mlp]``) reads as a model dimension: no warning; nor
  when partition names name the layer axis (``boxes``)."""
  if any(box and set(box) & layer_names for box in boxes):
    return  # the names place the layers, checked by _check_named_axis
  shapes = [np.shape(x) for x in jax.tree.leaves(tree)]
  stacked = [(shape, a) for shape, a in zip(shapes, axes) if a is not None]
  off_zero = [(shape, a) for shape, a in stacked if a != 0]
  zero_sizes = {shape[0] for shape, _ in stacked}
  unstacked = [shape for shape, a in zip(shapes, axes) if a is None]
  model_widths = {n for shape in unstacked for n in shape}
  if off_zero and len(zero_sizes) == 1 and not zero_sizes & model_widths:
    shape, a = off_zero[0]
    _validate.warn(
      f"{what}: stacked_axes gives the layer axis {a} (size {shape[a]}), "
      "but axis 0 has one size on every stacked leaf too "
      f"({zero_sizes.pop()}): the shapes cannot tell which holds the "
      "layers, and a wrong axis would report an inf in one layer as "
      "another's. jax.lax.scan, nn.scan(variable_axes={'params': 0}) and "
      "nnx.scan stack the layers on axis 0: if yours are there, pass axis 0 "
      "(fs.stacked_under(..., axis=0))"
    )


def _leaf_axis(name, ndim, a, spec, what) -> int:
  """Leaf ``name``'s layer axis ``a``, normalised and checked."""
  if not -ndim <= a < ndim:
    raise ValueError(
      f"{what}: stacked_axes gives leaf {name} (ndim {ndim}) the layer axis "
      f"{a}; it must lie in [{-ndim}, {ndim - 1}]"
    )
  a %= ndim
  split = spec[a] if spec is not None and a < len(spec) else None
  if split is not None:
    raise ValueError(
      f"{what}: stacked_axes: leaf {name}'s layer axis {a} is split over "
      f"mesh axis {split!r} by its PartitionSpec {spec} (pipeline stages): "
      "each device would hold other layers, so its per-layer records would "
      "mix them. Keep the layer axis unsharded (None in its spec), or leave "
      "the leaf out of stacked_axes"
    )
  return a


def _check_named_axis(name, a: int, names, layer_names, what) -> None:
  """Raises when leaf ``name``'s partition names put the layers elsewhere
  than its layer axis ``a`` (as ``nn.scan``'s ``metadata_params`` and
  MaxText name it)."""
  if names is None or len(names) <= a:
    return
  at = [i for i, n in enumerate(names) if n in layer_names]
  if len(at) == 1 and at[0] != a:
    named = at[0]
    raise ValueError(
      f"{what}: stacked_axes gives leaf {name} the layer axis {a}, but its "
      f"partition names {names} put {names[named]!r} on axis {named}: the "
      "layer axis is taken from the wrong dimension (an inf in one layer "
      f"would be reported in another). Pass axis={named} (e.g. "
      f"fs.stacked_under(..., axis={named}))"
    )


def unit_names(layout: Optional[Layout], names, sizes) -> tuple:
  """``(paths, sizes, stacks)`` per unit: a stacked leaf's layer ``l`` is its
  path with ``[l]`` appended, of its size over L; ``stacks`` holds each
  stacked leaf's path as the layout names it and its first unit
  (``LeafPaths.stacks``)."""
  if layout is None:
    return tuple(names), tuple(sizes), ()
  paths = []
  unit_sizes = []
  stacks = []
  for name, size, a, keyed in zip(names, sizes, layout.axes, layout.names):
    if a is None:
      paths.append(name)
      unit_sizes.append(size)
    else:
      stacks.append((keyed, len(paths)))
      paths += [f"{name}[{k}]" for k in range(layout.layers)]
      unit_sizes += [size // layout.layers] * layout.layers
  return tuple(paths), tuple(unit_sizes), tuple(stacks)


def summed_axes(x, axis: Optional[int]) -> tuple:
  """The axes of ``x`` a per-unit sum reduces: all but the layer axis."""
  return tuple(i for i in range(np.ndim(x)) if i != axis)


def _key_name(k) -> Any:
  """A path entry's name: a dict key, an attribute or a field (else None)."""
  return getattr(k, "key", getattr(k, "name", None))


def _flat_names(names) -> tuple:
  """``names`` as given to :func:`stacked_under`, lists and tuples opened."""
  out = []
  for n in names:
    if isinstance(n, (list, tuple, set, frozenset)):
      out += _flat_names(n)
    elif isinstance(n, str):
      out.append(n)
    else:
      raise TypeError(
        "stacked_under: each name must be a str (the dict key, attribute or "
        f"field that holds the stack), or a list of them; got {n!r}"
      )
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class StackedUnder:
  """``stacked_axes`` for every leaf under a key named one of ``names``
  (what :func:`stacked_under` returns). Two are equal, and hash equal, when
  they name the same keys and axis, so that every ``stacked_under("layers")``
  is one spec.

  Attributes:
    names: the keys, sorted, each once.
    axis: the stacked leaves' layer axis.
  """

  names: tuple
  axis: int

  def __call__(self, params) -> Any:
    """The full ``stacked_axes`` tree of ``params``.

    Raises:
      ValueError: no leaf of ``params`` is under a key named one of
        ``names``; the message lists the keys the params have.
    """
    wanted = set(self.names)
    found = set()  # every key name on the params' paths

    def axis_of(path, _):
      keys = {_key_name(k) for k in path} - {None}
      found.update(k for k in keys if isinstance(k, str))
      return self.axis if keys & wanted else None

    axes = jax.tree_util.tree_map_with_path(axis_of, params)
    if not found & wanted:  # no leaf under a key named one of names
      raise ValueError(self._no_match(sorted(found)))
    return axes

  def _no_match(self, found: list) -> str:
    """The message for params that have no key named one of ``names``."""
    close = []
    for n in self.names:
      close += difflib.get_close_matches(n, found, n=2, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    shown = ", ".join(repr(k) for k in found[:16])
    shown += ", ..." if len(found) > 16 else ""
    return (
      f"{self!r} matches no leaf of the params: no dict key, attribute or "
      f"field on their paths is named {' or '.join(map(repr, self.names))}, "
      "so no layer would be recorded. The keys they have: "
      f"{shown or '(none)'}.{hint} Name the key that holds the stack, e.g. "
      f"fs.stacked_under({(close or found or ['layers'])[0]!r}), or leave "
      "stacked_axes out if no leaf is stacked"
    )

  def __repr__(self) -> str:
    args = ", ".join(map(repr, self.names))
    return f"fs.stacked_under({args}, axis={self.axis})"


def stacked_under(*names: Any, axis: int = 0) -> StackedUnder:
  """``stacked_axes`` for every leaf under a key named one of ``names``.

  ``fs.stacked_under("layers")`` gives layer axis ``axis`` to each leaf whose
  path holds a dict key, attribute or field named ``"layers"`` (a Linen
  ``nn.scan``'s module, an NNX or Equinox stacked attribute), None to the
  others. Two calls with the same names and axis make equal specs.

  Args:
    *names: the keys under which the params are stacked, as strings or
      lists of strings; at least one.
    axis: their layer axis (MaxText stacks on axis 1).

  Returns:
    A frozen callable (``StackedUnder``) mapping the params to a full
    ``stacked_axes`` tree.

  Raises:
    ValueError: no name; from the callable (at ``tx.init``), no leaf of the
      params under any of the names (the message lists the keys they have).
    TypeError: a name that is not a string, or an ``axis`` not an int.

  Example:
    >>> import jax.numpy as jnp, fp16_scaling as fs
    >>> params = {"layers": {"w": jnp.zeros((8, 4, 4))}, "head": jnp.zeros(4)}
    >>> fs.stacked_under("layers")(params)
    {'head': None, 'layers': {'w': 0}}
    >>> fs.stacked_under(["layers"]) == fs.stacked_under("layers")
    True
  """
  flat = _flat_names(names)
  if not flat:
    raise ValueError(
      "stacked_under needs the name of the key, attribute or field that "
      'holds the stack, e.g. fs.stacked_under("layers")'
    )
  if isinstance(axis, bool) or not isinstance(axis, Integral):
    raise TypeError(f"stacked_under: axis must be an int; got {axis!r}")
  return StackedUnder(tuple(sorted(set(flat))), int(axis))


def count_nonfinite(flags, units) -> tuple:
  """``(leaves, layers)``: of the per-unit ``flags`` (batch axes first),
  how many leaves held an inf or NaN, and how many layers did in any
  stacked leaf; ``units`` is the state's ``LeafPaths``."""
  layer_units = units.layer_units()
  stacked = flags[..., layer_units]  # [..., stacked leaves, L]
  unstacked = np.setdiff1d(np.arange(flags.shape[-1]), layer_units)
  leaves = stacked.any(-1).sum(-1) + flags[..., unstacked].sum(-1)
  layers = stacked.any(-2).sum(-1)
  return leaves.astype(np.int32), layers.astype(np.int32)


def per_leaf(values, units) -> dict:
  """``{path: values[..., L]}`` per stacked leaf, of a per-unit vector;
  ``units`` is the state's ``LeafPaths``."""
  names = [name for name, _ in units.stacks]
  rows = [values[..., row] for row in units.layer_units()]
  return dict(zip(names, rows))


def by_layer(counts, flags, units) -> tuple:
  """``({layer: most steps of any of its stacked leaves}, layers flagged on
  the last step)`` from the per-unit counts and flags (host numpy);
  ``units`` is the state's ``LeafPaths``. ``({}, ())`` without stacked
  leaves."""
  rows = units.layer_units()
  most = np.asarray(counts)[rows].max(0, initial=0)
  flagged = np.asarray(flags, bool)[rows].any(0)
  most_by_layer = {k: int(n) for k, n in enumerate(most) if n}
  return most_by_layer, tuple(np.flatnonzero(flagged).tolist())
