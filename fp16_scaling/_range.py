"""``grad_range``'s records: per unit (a leaf, or a layer of a stacked
leaf), across its mesh axes, the largest finite magnitude and the fraction
of zero elements, read in the one pass's form for the platform (a
reduction per leaf, or ``_segments``' batches on a GPU).
"""

from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp

from fp16_scaling import _segments
from fp16_scaling._norm import widen
from fp16_scaling._sharding import leaf_vector
from fp16_scaling._stacked import summed_axes


def _finite_abs(x):
  """``|x|`` of :func:`widen`'s ``x`` where finite, else 0."""
  w = widen(x)
  zero = jnp.zeros([], w.dtype)
  finite = lax.is_finite(w)
  return jnp.where(finite, jnp.abs(w), zero)


def _abs32(x):
  """:func:`_finite_abs` in float32."""
  magnitude = _finite_abs(x)
  return magnitude.astype(jnp.float32)


def _nonzero(x):
  """1.0 where ``x`` is not zero, else 0.0."""
  nonzero = x != 0
  return nonzero.astype(jnp.float32)


def _local_range(leaves, layer_axes):
  """``(peaks, zeros)``, per leaf (per layer) on this device: the largest
  finite ``|x|`` and the count of zero elements, both float32."""

  def per_leaf(leaves):
    peaks = []
    zeros = []
    for x, a in zip(leaves, layer_axes):
      axes = summed_axes(x, a)
      peak = jnp.max(_finite_abs(x), axes, initial=0)
      peaks.append(peak.astype(jnp.float32))
      zero = x == 0
      zeros.append(jnp.sum(zero, axes, dtype=jnp.float32))
    return tuple(peaks), tuple(zeros)

  def segmented(leaves):
    peaks = _segments.unit_reduce(leaves, layer_axes, _abs32, jnp.max)
    counts = _segments.unit_reduce(leaves, layer_axes, _nonzero, jnp.sum)
    zeros = []
    for x, peak, count in zip(leaves, peaks, counts):
      units = max(peak.size, 1)
      zeros.append(x.size / units - count)
    return peaks, tuple(zeros)

  return _segments.per_platform(leaves, per_leaf, segmented)


def leaf_range(
  leaves: Sequence[jax.Array], leaf_axes, layer_axes=None
) -> tuple:
  """Per leaf (per layer, for a leaf with a layer axis) across its mesh
  axes, the largest finite ``|x|`` and the fraction of zero elements.

  Args:
    leaves: the gradient leaves.
    leaf_axes: per leaf, the mesh axes it is split over.
    layer_axes: per leaf, its layer axis or None; None: no leaf stacked.

  Returns:
    ``(max_abs, zero_fraction)``, float32 vectors, one entry per unit.
  """
  layer_axes = tuple(layer_axes or (None,) * len(leaves))
  peaks, zeros = _local_range(tuple(leaves), layer_axes)
  sizes = []  # per unit, the elements it holds
  for x, peak in zip(leaves, peaks):
    units = max(peak.size, 1)
    size = jnp.full(peak.shape, x.size / units, jnp.float32)
    sizes.append(size)
  peaks = leaf_vector(peaks, leaf_axes, lax.pmax)
  zeros = leaf_vector(zeros, leaf_axes, lax.psum)
  sizes = leaf_vector(sizes, leaf_axes, lax.psum)
  fraction = zeros / jnp.maximum(sizes, 1.0)
  return peaks, fraction
