"""Which mesh axes each gradient leaf is split over, and the collectives
that combine per-leaf scalars across them: the user's ``partition_specs``
(a pytree of specs, or a prefix of the gradients' tree) become static
per-leaf axes, checked against the mesh. Flax's partition names (of an
``nn.Partitioned`` or an NNX ``Variable``) are read here too.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

AxisNames = tuple  # tuple[str, ...], sorted; () for an unsharded leaf


def leaf_vector(values, leaf_axes, collective, prepare=None) -> jax.Array:
  """Per-leaf scalars as one vector, each combined across its mesh axes:
  one ``prepare`` and one ``collective`` per distinct set of axes."""
  if not values:
    return jnp.zeros([0], jnp.float32)
  by_axes = {}
  for i, axes in enumerate(leaf_axes):
    by_axes.setdefault(axes, []).append(i)
  # A vector value (a stacked leaf's, per layer) gives one entry per element.
  starts = np.cumsum([0] + [np.size(v) for v in values])
  parts = []
  order = []  # the entries of each part, as positions in the vector
  for axes, idx in by_axes.items():
    part = jnp.concatenate([jnp.reshape(values[i], [-1]) for i in idx])
    if prepare is not None:
      part = prepare(part)
    if axes:
      part = collective(part, axes)
    parts.append(part)
    for i in idx:
      order.extend(range(starts[i], starts[i + 1]))
  if len(parts) == 1:
    return parts[0]
  return jnp.concatenate(parts)[np.argsort(order)]


def spec_axes(spec) -> AxisNames:
  """Mesh axes a ``PartitionSpec`` splits an array over."""
  names = set()
  for entry in () if spec is None else spec:
    if entry is not None:
      names.update(entry if isinstance(entry, tuple) else (entry,))
  return tuple(sorted(names))


def is_spec(s) -> bool:
  """Whether ``s`` is a leaf of a ``PartitionSpec`` pytree."""
  return s is None or isinstance(s, jax.sharding.PartitionSpec)


def varying_axes(t, *, unreduced: bool = False) -> AxisNames:
  """Manual mesh axes over which a value of type ``t`` may differ (and with
  ``unreduced``, hold partial sums), as ``shard_map``'s ``check_vma`` says."""
  mat = getattr(t, "manual_axis_type", None)
  if mat is None:  # a ShapeDtypeStruct made outside shard_map
    return ()
  axes = set(mat.varying) | (set(mat.unreduced) if unreduced else set())
  return tuple(sorted(axes))


def leaf_specs(partition_specs, tree, what: str) -> list:
  """The ``PartitionSpec`` (or None) of each leaf of ``tree``, in leaf order;
  all None without ``partition_specs``, or for a tree without leaves
  (optax.tree_map_params' placeholder)."""
  n = len(jax.tree.leaves(tree))
  if partition_specs is None or not n:
    return [None] * n
  specs = jax.tree.leaves(partition_specs, is_leaf=is_spec)
  for spec in specs:
    if not is_spec(spec):
      raise TypeError(
        f"{what}: partition_specs must hold a jax.sharding.PartitionSpec or "
        f"None at each leaf, got {spec!r} ({type(spec).__name__})"
      )
  try:
    return list(broadcast_prefix(specs, partition_specs, tree, is_spec))
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"{what}: partition_specs must have the structure of the gradients "
      f"(or a prefix of it), with a PartitionSpec or None at each leaf: "
      f"{e}"
    ) from None


def _box_names(x) -> Optional[tuple]:
  """The axis names a Flax ``nn.Partitioned`` (``names``) or an NNX
  ``Variable`` (``out_sharding`` metadata) gives its array, else None."""
  if hasattr(x, "unbox") and hasattr(x, "names"):  # linen AxisMetadata
    names = x.names
  elif hasattr(x, "get_metadata") and hasattr(x, "get_value"):  # nnx
    names = x.get_metadata("out_sharding", None)
  else:
    return None
  ok = isinstance(names, (tuple, list)) and all(
    n is None or isinstance(n, str) for n in names
  )
  return tuple(names) if ok else None


def partition_names(tree, n: int) -> list:
  """Per leaf of ``tree``, its box's axis names, or None; all None when
  the boxes are not one per leaf."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: _box_names(x) is not None)
  if len(leaves) != n:
    return [None] * n
  return [_box_names(x) for x in leaves]


def broadcast_prefix(values, prefix, tree, is_leaf=None) -> tuple:
  """One of ``values`` (one per leaf of ``prefix``, a prefix of ``tree`` as in
  ``optax.masked``) per leaf of ``tree``."""
  given = iter(values)
  out = []

  def repeat(_, subtree):
    value = next(given)
    out.extend([value] * len(jax.tree.leaves(subtree)))

  jax.tree.map(repeat, prefix, tree, is_leaf=is_leaf)
  return tuple(out)


def leaf_axes_from_specs(partition_specs, tree, what: str) -> tuple:
  """Static per-leaf mesh axes to sum each leaf's squares over: the manual
  (``shard_map``'s) axes its spec names, checked against the mesh."""
  specs = leaf_specs(partition_specs, tree, what)
  return leaf_axes(specs, partition_specs is not None, tree, what)


def leaf_axes(specs, given: bool, tree, what: str) -> tuple:
  """:func:`leaf_axes_from_specs` of the specs :func:`leaf_specs` made,
  one per leaf of ``tree``; ``given``: the user gave ``partition_specs``
  (without them, a leaf that varies over a manual axis is refused)."""
  mesh = jax.sharding.get_abstract_mesh()
  mesh_axes = tuple(mesh.axis_names)
  manual = frozenset(mesh.manual_axes)
  with_paths = jax.tree_util.tree_leaves_with_path(tree)
  axes = []
  for (path, x), spec in zip(with_paths, specs):
    leaf = jax.tree_util.keystr(path)
    varying = varying_axes(jax.typeof(x), unreduced=True)
    if not given and varying:
      raise ValueError(
        f"{what}: under shard_map, gradient leaf {leaf} varies over mesh "
        f"axis {varying[0]!r}, and no partition_specs were given, so its sum "
        "of squares would be this device's alone. Pass partition_specs= "
        "(the gradients' PartitionSpecs, as given to shard_map), so that "
        "each leaf's sum is reduced over the axes it is split over, or "
        f"reduce the gradients over {varying[0]!r} first (lax.pmean)."
      )
    named = spec_axes(spec)
    missing = [a for a in named if a not in mesh_axes]
    if mesh_axes and missing:
      raise ValueError(
        f"{what}: partition_specs give gradient leaf {leaf} the spec {spec}, "
        f"which names mesh axis {missing[0]!r}; the mesh has axes {mesh_axes}"
      )
    unnamed = sorted(set(varying) - set(named))
    if unnamed:
      raise ValueError(
        f"{what}: partition_specs give gradient leaf {leaf} the spec {spec}, "
        f"replicated over mesh axis {unnamed[0]!r}, but under shard_map it "
        f"varies over that axis: reduce it over {unnamed[0]!r} first "
        f"(lax.psum or lax.pmean) or name {unnamed[0]!r} in its PartitionSpec"
      )
    axes.append(tuple(a for a in named if a in manual))
  return tuple(axes)
