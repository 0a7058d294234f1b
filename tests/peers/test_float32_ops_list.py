"""docs/float32-ops.md has a row for every op on torch.autocast's float32
lists, read from the installed torch's own header (aten's
autocast_mode.h)."""

import pathlib
import re

import helpers
import pytest

torch = pytest.importorskip("torch")

HEADER = pathlib.Path(torch.__file__).parent / "include/ATen/autocast_mode.h"
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "float32-ops.md"


def _macro(text, name):
  """The ops a ``#define name(_)`` list names: ``_(op)`` or ``_(op, overload)``
  entries, and ``ADD_NS(op)`` in the redispatch list."""
  start = text.index(f"#define {name}(_)")
  end = text.find("#define", start + 1)
  body = text[start:end]
  return set(re.findall(r"_\((?:ADD_NS\()?(\w+)", body)) - {"_"}


def _torch_float32_ops():
  if not HEADER.exists():
    pytest.skip(f"torch {torch.__version__} ships no {HEADER.name}")
  text = HEADER.read_text()
  ops = set()
  for name in (
    "AT_FORALL_FP32",
    "AT_FORALL_FP32_SET_OPT_DTYPE",
    "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE",
  ):
    ops |= _macro(text, name)
  return ops


def _page_ops():
  """The torch ops named in the first column of the page's op table."""
  ops = set()
  for first, cells in helpers.table_rows(PAGE.read_text()).items():
    if len(cells) == 5 and cells[0].startswith("`"):
      ops |= set(re.findall(r"`(\w+)`", first))
  return ops


def test_every_torch_float32_op_has_a_row():
  ops = _torch_float32_ops()
  # torch 2.13.0 names 65 ops: 56 float32 ones, 8 set-dtype ones (softmax,
  # cumsum, sum...) and norm; the reader must see them all.
  assert {"exp", "log_softmax", "cumsum", "norm", "mse_loss"} <= ops
  assert len(ops) >= 65, sorted(ops)
  missing = ops - _page_ops()
  assert not missing, sorted(missing)


def test_the_page_names_no_op_torch_does_not_list():
  # The page's extra rows (a layer norm in core JAX, the attention softmax)
  # name no torch op in backticks, except cross_entropy, which torch runs as
  # log_softmax and nll_loss.
  extra = _page_ops() - _torch_float32_ops()
  assert extra == {"cross_entropy"}, sorted(extra)
