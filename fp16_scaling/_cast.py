"""``cast_report``: what casting a checkpoint to float16, bfloat16 or a
float8 type would do to each leaf, read on the host before training.
"""

from typing import Any, Dict, NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from fp16_scaling import _validate

# The targets, as jax.numpy names them.
CAST_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
CAST_DTYPES += ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz")


class LeafCast(NamedTuple):
  """What the cast does to one floating leaf.

  Attributes:
    size: the leaf's number of elements.
    to_inf: finite values the cast makes non-finite: those past the
      largest finite value by half its last step or more (65520 for
      float16; values between round to the largest finite). They become
      inf in float16, bfloat16 and float8_e5m2, and NaN in the float8 types
      without an inf (``e4m3fn``, the ``fnuz`` ones): a plain cast does not
      saturate. A saturating float8 cast would clamp them to the largest
      finite value instead; they are counted either way, as lost.
    to_subnormal: values the cast makes subnormal (nonzero, below the
      dtype's smallest normal): they keep fewer significant bits.
    to_zero: nonzero values the cast flushes to zero.
    max_abs: the largest finite magnitude in the leaf, before the cast.
    nonfinite: values already inf or NaN, before any cast: a checkpoint
      that holds one is broken whatever the dtype.
  """

  size: int
  to_inf: int
  to_subnormal: int
  to_zero: int
  max_abs: float
  nonfinite: int = 0


class CastReport(NamedTuple):
  """What a cast of a parameter tree would do; see :func:`cast_report`.

  Attributes:
    dtype: the target dtype's name, one of ``CAST_DTYPES``.
    max_finite: the target's largest finite value (65504 for float16).
    leaves: path -> :class:`LeafCast`, for every floating leaf (integer and
      boolean leaves are not cast and not listed): those already holding an
      inf or NaN first, then the most values past the range, then the
      largest magnitude.
    overflowing: the paths of the leaves with ``to_inf > 0``, in that
      order.
    top: how many leaves ``str()`` lists.
    nonfinite: the paths of the leaves that already hold an inf or NaN
      (``LeafCast.nonfinite > 0``), in that order.
  """

  dtype: str
  max_finite: float
  leaves: Dict[str, LeafCast]
  overflowing: Tuple[str, ...]
  top: int = 10
  nonfinite: Tuple[str, ...] = ()

  def __str__(self) -> str:
    inf, sub, zero, bad = (
      sum(getattr(c, field) for c in self.leaves.values())
      for field in ("to_inf", "to_subnormal", "to_zero", "nonfinite")
    )
    lines = []
    if self.nonfinite:
      lines.append(
        f"NOT CLEAN: {bad} values are already inf or NaN, before any cast, "
        f"in {len(self.nonfinite)} of {len(self.leaves)} leaves."
      )
    lines += [
      f"Cast to {self.dtype} (largest finite {self.max_finite:g}): {inf} "
      f"values past the range in {len(self.overflowing)} of "
      f"{len(self.leaves)} leaves, {sub} subnormal, {zero} flushed to zero.",
      f"Per leaf, overflowing first (top {self.top}): to inf, to subnormal, "
      "to zero, max |x|" + (", already inf/NaN" if self.nonfinite else ""),
    ]
    for p, c in list(self.leaves.items())[: self.top]:
      extra = f" {c.nonfinite:>7}" if self.nonfinite else ""
      counts = f"{c.to_inf:>7} {c.to_subnormal:>7} {c.to_zero:>7}"
      lines.append(f"  {counts} {c.max_abs:>10.3g}{extra}  {p}")
    if len(self.leaves) > self.top:
      lines.append(f"  ... and {len(self.leaves) - self.top} more leaves")
    if self.nonfinite:
      lines.append(
        "What to do: the checkpoint already holds inf or NaN values (listed "
        "first): no dtype or loss scale trains from it. Restore an earlier "
        "checkpoint, or find the step or conversion that wrote them."
      )
    if self.overflowing:
      lines.append(
        f"What to do: values past {self.max_finite:g} overflow the forward "
        "pass at any loss scale; rescale those leaves or keep their layers "
        f"out of {self.dtype}."
      )
    return "\n".join(lines)


def _leaf_cast(x: np.ndarray, dtype, smallest_normal) -> LeafCast:
  """``x``'s :class:`LeafCast` for a cast to ``dtype``."""
  finite = np.isfinite(x)
  with np.errstate(over="ignore", invalid="ignore"):  # counted below
    y = np.abs(x.astype(dtype).astype(np.float64))
  return LeafCast(
    size=int(x.size),
    to_inf=int(np.sum(finite & ~np.isfinite(y))),
    to_subnormal=int(np.sum((y > 0) & (y < smallest_normal))),
    to_zero=int(np.sum(finite & (x != 0) & (y == 0))),
    max_abs=float(np.max(np.abs(x[finite]), initial=0.0)),
    nonfinite=int(np.sum(~finite)),
  )


def cast_report(params: Any, dtype: Any, *, top: int = 10) -> CastReport:
  """What casting every floating leaf of ``params`` to ``dtype`` would do.

  A host function, for a checkpoint before training: a bfloat16-trained
  checkpoint may hold values past float16's 65504, which overflow the
  forward pass whatever the loss scale. The cast is the plain one
  (round to nearest even, as ``x.astype(dtype)`` and XLA do). Values
  already inf or NaN are counted apart (``LeafCast.nonfinite``), their
  leaves listed first, and the printed report opens with ``NOT CLEAN``.

  Args:
    params: a pytree of arrays (numpy or JAX, on the host or a device).
    dtype: the target, by name or type: one of ``CAST_DTYPES``
      (``"float16"``, ``"bfloat16"`` and the float8 types).
    top: how many leaves the printed report lists; an integer >= 1.

  Returns:
    A :class:`CastReport`; ``print`` it for a readable summary.

  Raises:
    ValueError: a ``dtype`` not in ``CAST_DTYPES``; a bad ``top``.
    TypeError: called inside ``jit`` (``params`` holds tracers).

  Examples:
    >>> import numpy as np, fp16_scaling as fs
    >>> params = {"w": np.array([1.0, 7e4, 1e-9], np.float32)}
    >>> report = fs.cast_report(params, "float16")
    >>> report.overflowing, report.leaves["['w']"].to_zero
    (("['w']",), 1)
  """
  name = getattr(dtype, "__name__", str(dtype))  # a type, a dtype, a name
  name = _validate.choice("dtype", name, CAST_DTYPES)
  top = _validate.count("top", top)
  _require_host(params)
  info = jnp.finfo(getattr(jnp, name))
  host = jax.tree.map(np.asarray, params)
  leaves = {
    jax.tree_util.keystr(path): _leaf_cast(x, info.dtype, info.smallest_normal)
    for path, x in jax.tree_util.tree_flatten_with_path(host)[0]
    if jnp.issubdtype(x.dtype, jnp.floating)
  }
  # Already non-finite first, then the most past the range, then max_abs.
  leaves = dict(
    sorted(
      leaves.items(),
      key=lambda kv: (-kv[1].nonfinite, -kv[1].to_inf, -kv[1].max_abs),
    )
  )
  overflowing = tuple(p for p, c in leaves.items() if c.to_inf)
  nonfinite = tuple(p for p, c in leaves.items() if c.nonfinite)
  return CastReport(
    dtype=name,
    max_finite=float(info.max),
    leaves=leaves,
    overflowing=overflowing,
    top=top,
    nonfinite=nonfinite,
  )


def _require_host(params: Any) -> None:
  """Raises TypeError when ``params`` holds tracers."""
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
    raise TypeError(
      "cast_report runs on the host, outside jit: it reads a parameter "
      "tree's concrete values, and here params holds tracers (it was "
      "called inside a jitted, vmapped or scanned function). Call it on "
      "the checkpoint once it is loaded, before training: "
      "print(fs.cast_report(params, jnp.float16))."
    )
