"""fs.cast_report: its counts against thresholds derived by hand from each
format's bits (float16, bfloat16), against numpy's own cast for float8, and
a checkpoint with one value past 65504 named by its leaf."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp16_scaling as fs

# (largest finite, smallest normal, smallest subnormal) from the bits:
# float16 has 10 mantissa bits and exponents -14..15; bfloat16 has 7 and
# -126..127. A value rounds to inf from max + half its last step (the tie
# rounds to the even 2^(emax+1)); to zero up to half the smallest subnormal
# (the tie rounds to the even 0); to a subnormal below the smallest normal
# less half a subnormal step (the tie rounds to the even smallest normal).
FORMATS = {
  "float16": (65504.0, 2.0**-14, 2.0**-24),
  "bfloat16": ((2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133),
}
MANTISSA_BITS = {"float16": 10, "bfloat16": 7}


def _top_step(fmt):
  """The spacing of ``fmt``'s values just below its largest."""
  big = FORMATS[fmt][0]
  return 2.0 ** (np.floor(np.log2(big)) - MANTISSA_BITS[fmt])


def _reference(x, fmt):
  """(to_inf, to_subnormal, to_zero) of a float32 array, in float64 from
  the thresholds alone: no cast."""
  big, normal, sub = FORMATS[fmt]
  step = _top_step(fmt)
  a = np.abs(x.astype(np.float64))
  finite = np.isfinite(a)
  to_inf = finite & (a >= big + step / 2)
  to_zero = finite & (a > 0) & (a <= sub / 2)
  to_sub = (a > sub / 2) & (a < normal - sub / 2)
  return int(to_inf.sum()), int(to_sub.sum()), int(to_zero.sum())


def _sample(fmt, n=20_000, seed=0):
  """float32 values over the whole range, with the boundaries and their
  float32 neighbours."""
  big, normal, sub = FORMATS[fmt]
  rng = np.random.default_rng(seed)
  lo = np.log2(sub) - 3
  hi = min(np.log2(big) + 2, 127.9)
  mags = 2.0 ** rng.uniform(lo, hi, n)
  step = _top_step(fmt)
  edges = np.array(
    [big, big + step / 2, normal, normal - sub / 2, sub, sub / 2, 0.0, 1.0]
  ).astype(np.float32)
  near = np.concatenate(
    [
      np.nextafter(edges, np.float32(np.inf)),
      edges,
      np.nextafter(edges, np.float32(0)),
    ]
  )
  signs = rng.choice([-1.0, 1.0], n)
  x = np.concatenate([(signs * mags).astype(np.float32), near, -near])
  return np.concatenate([x, [np.inf, np.nan]]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_counts_match_thresholds_derived_from_the_format(fmt):
  x = _sample(fmt)
  want = _reference(x, fmt)
  assert all(want), want  # the sample reaches each case
  report = fs.cast_report({"x": x}, fmt)
  leaf = report.leaves["['x']"]
  assert (leaf.to_inf, leaf.to_subnormal, leaf.to_zero) == want
  assert leaf.size == x.size
  assert leaf.max_abs == float(np.max(np.abs(x[np.isfinite(x)])))
  assert report.max_finite == FORMATS[fmt][0]


@pytest.mark.parametrize(
  "fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"]
)
def test_float8_counts_match_numpys_cast(fmt):
  # ml_dtypes' cast, elementwise: e4m3fn and e4m3fnuz have no inf, so a
  # value past 448 (240) becomes NaN and counts as past the range.
  t = getattr(ml_dtypes, fmt)
  info = ml_dtypes.finfo(t)
  rng = np.random.default_rng(1)
  x = (rng.choice([-1, 1], 5000) * 2.0 ** rng.uniform(-25, 18, 5000)).astype(
    np.float32
  )
  with np.errstate(over="ignore", invalid="ignore"):
    y = np.abs(x.astype(t).astype(np.float64))
  want = (
    int((~np.isfinite(y)).sum()),
    int(((y > 0) & (y < float(info.smallest_normal))).sum()),
    int((y == 0).sum()),
  )
  assert all(want), want
  leaf = fs.cast_report([x], getattr(jnp, fmt)).leaves["[0]"]
  assert (leaf.to_inf, leaf.to_subnormal, leaf.to_zero) == want
  # e4m3fn: 464, 448 plus half its step of 32, is a tie that rounds to the
  # even 448 (the next code, 480, is NaN); anything above it is past.
  if fmt == "float8_e4m3fn":
    edge = np.array([448, 464, 464.5, 1e4], np.float32)
    assert fs.cast_report({"e": edge}, fmt).leaves["['e']"].to_inf == 2


def test_a_bfloat16_checkpoint_with_one_value_past_65504_is_named():
  rng = np.random.default_rng(2)
  ckpt = {
    "embed": rng.normal(0, 1, (64, 8)),
    "layers": [
      {"w": rng.normal(0, 0.02, (8, 8)), "b": np.zeros(8)},
      {"w": rng.normal(0, 0.02, (8, 8)), "b": np.zeros(8)},
    ],
    "step": np.int32(1000),  # not cast, not listed
  }
  ckpt["layers"][1]["w"][3, 4] = 7.0e4  # bfloat16 holds it; float16 cannot
  ckpt = jax.tree.map(
    lambda a: a if a.dtype.kind == "i" else a.astype(jnp.bfloat16), ckpt
  )
  report = fs.cast_report(ckpt, jnp.float16)
  assert report.overflowing == ("['layers'][1]['w']",)
  leaf = report.leaves["['layers'][1]['w']"]
  assert leaf.to_inf == 1
  assert leaf.max_abs == float(jnp.bfloat16(7e4))
  assert "['step']" not in report.leaves
  assert len(report.leaves) == 5
  lines = str(report).splitlines()
  assert "1 values past the range in 1 of 5 leaves" in lines[0]
  # Named first in the per-leaf table, with its count; then the advice.
  assert lines[1].startswith("Per leaf, overflowing first")
  assert lines[2].split()[0] == "1"
  assert lines[2].endswith("['layers'][1]['w']")
  assert lines[-1].startswith("What to do: values past 65504 overflow")
  # The same checkpoint in bfloat16 itself (or float32) overflows nothing.
  assert fs.cast_report(ckpt, "bfloat16").overflowing == ()


def test_the_report_lists_top_leaves_overflowing_first():
  tree = {f"l{i}": np.full(3, 1e5 if i in (7, 9) else 1.0) for i in range(12)}
  tree["l9"][:2] = 1.0  # l9 has one value past the range, l7 three
  report = fs.cast_report(tree, "float16", top=3)
  assert report.overflowing == ("['l7']", "['l9']")
  rows = str(report).splitlines()
  assert [r.split()[-1] for r in rows[2:5]] == ["['l7']", "['l9']", "['l0']"]
  assert rows[5] == "  ... and 9 more leaves"
  # A clean cast gives no advice.
  clean = str(fs.cast_report({"w": np.ones(2)}, "float16")).splitlines()
  assert len(clean) == 3
  assert not clean[-1].startswith("What to do")


def test_bad_arguments_name_the_parameter():
  with pytest.raises(ValueError, match="dtype must be one of 'float16'"):
    fs.cast_report({"w": np.ones(2)}, "float32")
  with pytest.raises(ValueError, match="dtype must be one of .*int8"):
    fs.cast_report({"w": np.ones(2)}, np.int8)
  with pytest.raises(ValueError, match="top must be an integer in"):
    fs.cast_report({"w": np.ones(2)}, "float16", top=0)
  with pytest.raises(TypeError, match="cast_report runs on the host"):
    jax.jit(lambda p: fs.cast_report(p, "float16").max_finite)(
      {"w": jnp.ones(2)}
    )
