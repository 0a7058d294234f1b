"""Runs the Python blocks of a docs page in order, in one namespace."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
NEEDS = re.compile(r"^# needs: (\w+)")


def blocks(page):
  text = (DOCS / page).read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_page(page, namespace, *, available=()):
  """Executes every block whose ``# needs:`` line (if any) names a module in
  ``available``; returns how many ran."""
  ran = 0
  for code in blocks(page):
    need = NEEDS.match(code)
    if need and need.group(1) not in available:
      continue
    exec(compile(code, f"{page} block {ran}", "exec"), namespace)
    ran += 1
  return ran


def section_blocks(page, heading):
  """The Python blocks of the section of ``page`` under ``heading`` (a
  ``## `` line, its subsections included), up to the next ``## ``."""
  text = (DOCS / page).read_text()
  start = text.index(f"\n{heading}\n")
  end = text.find("\n## ", start + len(heading) + 2)
  section = text[start : end if end >= 0 else None]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)
