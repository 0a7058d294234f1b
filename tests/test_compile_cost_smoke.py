"""benchmarks/compile_cost.py runs, and its summary says what it measured."""

import pathlib
import sys

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_BENCH))

import compile_cost  # noqa: E402


def _rows(argv, capsys, shape):
  """compile_cost.main on ``argv`` (split at spaces): (its output, the rows
  of ``shape``'s table, their recipe names)."""
  compile_cost.main(argv.split())
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith(f"| {shape} |")]
  return out, rows, [r.split("|")[2].strip() for r in rows]


def test_summary_ratios_are_of_the_medians_and_paired_per_round():
  # CPU seconds (lower, compile, wall): floor totals 2, 4, 3; fp16 3, 4, 6.
  times = {
    "floor": [(1.0, 1.0, 9.0), (1.0, 3.0, 9.0), (1.0, 2.0, 9.0)],
    "fp16": [(1.0, 2.0, 9.0), (2.0, 2.0, 18.0), (3.0, 3.0, 9.0)],
  }
  lines, per_round, median_ratio = compile_cost.summary("S", times)
  assert lines[0].startswith("| S | floor | 1.00 | 2.00 | 3.00 | 1.000x |")
  # fp16: median lower 2, compile 2, total 4 -> 4 / 3; wall 9 / 9.
  assert (
    lines[1] == "| S | fp16 | 2.00 | 2.00 | 4.00 | 1.333x | 9.00 | 1.000x |"
  )
  # Paired per round: 3/2, 4/4, 6/3 -> median 1.5.
  assert median_ratio == pytest.approx(1.5)
  assert per_round == (
    "S: per-round fp16/floor of total CPU time, median 1.500x "
    "[1.000, 2.000] over 3 rounds"
  )


def test_one_round_at_a_tiny_shape(capsys):
  argv = "--shape 4K/4 --rounds 1 --recipes floor,fp16,apply_if_finite"
  out, rows, names = _rows(argv, capsys, "4K/4")
  assert names == ["floor", "fp16", "apply_if_finite"]
  assert rows[0].split("|")[6].strip() == "1.000x"
  for row in rows[1:]:
    assert 0.2 < float(row.split("|")[6].strip().rstrip("x")) < 20
  for key in names[1:]:
    assert f"4K/4: per-round {key}/floor of total CPU time, median" in out


@pytest.mark.parametrize("recipes", ["fp16,floor", "floor", "floor,nope"])
def test_bad_recipe_lists_are_refused(recipes):
  with pytest.raises(SystemExit):
    compile_cost.main(["--recipes", recipes])


COPY_OPTION = "xla_cpu_copy_insertion_use_region_analysis"


def test_compiler_options_reach_every_worker(monkeypatch, capsys):
  # step_cost's smoke test checks that a worker compiles with the options it
  # is given; here, that compile_cost gives them to every one.
  given = []
  compile_in_worker = compile_cost.step_cost.compile_in_worker

  def spy(*args, **kwargs):
    given.append(kwargs.get("compiler_options"))
    return compile_in_worker(*args, **kwargs)

  monkeypatch.setattr(compile_cost.step_cost, "compile_in_worker", spy)
  argv = f"--shape 4K/4 --rounds 1 --compiler-option {COPY_OPTION}=true"
  out, _, names = _rows(argv, capsys, "4K/4")
  assert given == [{COPY_OPTION: True}] * 2
  assert f"Compiler options: {COPY_OPTION}=true" in out.splitlines()
  assert names == ["floor", "fp16"]


@pytest.mark.parametrize(
  "option, error",
  [
    (COPY_OPTION, "argument --compiler-option: expected KEY=VALUE"),
    (f"{COPY_OPTION}s=true", "--compiler-option: XLA refused it"),
  ],
)
def test_bad_compiler_options_are_refused(option, error, capsys):
  with pytest.raises(SystemExit):
    compile_cost.main(["--shape", "4K/4", "--compiler-option", option])
  assert error in capsys.readouterr().err


def test_one_round_of_train_lms_whole_step(capsys):
  """``lm:tiny``: the whole train step of examples/train_lm.py --size tiny,
  built by train_step_cost.py, with plain optax (the floor), with
  fp16_scaling and with optax.apply_if_finite; jmp has no train step and
  is left out."""
  assert "lm:medium" in compile_cost.DEFAULT_SHAPES
  steps = compile_cost.lm_steps()
  names = [steps[k].__name__ for k in ("floor", "fp16")]
  assert names == ["plain_step", "scaled_step"]
  assert steps["fp16"].__module__ == "train_step_cost"
  argv = "--shape lm:tiny --rounds 1 --recipes floor,fp16,apply_if_finite,jmp"
  out, rows, names = _rows(argv, capsys, "lm:tiny")
  assert names == ["floor", "fp16", "apply_if_finite"]
  assert rows[0].split("|")[6].strip() == "1.000x"
  for cell in rows[1].split("|")[3:6]:  # trace + lower, compile, total
    assert float(cell) > 0
  assert 0.2 < float(rows[1].split("|")[6].strip().rstrip("x")) < 20
  assert "lm:tiny: per-round fp16/floor of total CPU time, median" in out
  assert "lm:tiny: per-round apply_if_finite/floor" in out
  assert "jmp not compiled" in out


@pytest.mark.parametrize("shape", ["lm:huge", "lm:"])
def test_unknown_train_lm_sizes_are_refused(shape, capsys):
  with pytest.raises(SystemExit):
    compile_cost.main(["--shape", shape])
  assert "train_lm.py's sizes are lm:medium" in capsys.readouterr().err
