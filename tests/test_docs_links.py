"""Every relative link and anchor in the repository's Markdown resolves.

A link ``[text](path#anchor)`` (or an image, or a ``[name]: path``
definition) outside code names a file that exists, relative to the page,
and an anchor that a heading of that file makes, spelled as GitHub spells
it: the heading's text without its Markdown, lowercased, every character
but letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``,
and a repeated heading numbered ``-1``, ``-2``. An anchor
``#fp16_scaling.NAME`` is the API reference's entry for a public name
(docs/api.md; the site resolves it, tests/test_docs_site.py checks that
it is there). A reference in prose, ``docs/page.md, "A heading"``, names a
heading of that page.

What the pages render also reads as written: a power outside code is
``2^N`` (Markdown reads the stars of two ``2**N`` in one paragraph as
bold, the digits between them run together), and once a page's shell
block has made ``.venv``, its commands run ``.venv/bin/pip`` and
``.venv/bin/python``, not whichever ``pip`` is on the PATH.
"""

import pathlib
import re

import pytest

import fp16_scaling as fs
import fp16_scaling.interop

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(
  [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks/README.md"]
  + list((ROOT / "docs").glob("*.md"))
)
PUBLIC = {f"fp16_scaling.{name}" for name in fs.__all__} | {
  f"fp16_scaling.interop.{name}" for name in fp16_scaling.interop.__all__
}

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
# [text](target) and ![alt](target); the target may be <...>, and may be
# followed by a "title".
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?")
_DEFINITION = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_PROSE = re.compile(r"([\w./-]+\.md),? \"([^\"]+)\"")
_POWER = re.compile(r"\d\*\*-?\d+")
_SHELL = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)


def _blank(match):
  return "\n" * match.group(0).count("\n")


def _prose(text):
  """``text`` without fenced blocks and code spans (what renders as text),
  its lines where they were."""
  return _CODE_SPAN.sub(_blank, _FENCE.sub(_blank, text))


def _heading_text(heading):
  """A heading as it renders: links by their text, no code ticks, no
  emphasis marks."""
  heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  heading = heading.replace("`", "")
  return re.sub(r"(\*\*|__|\*|(?<!\w)_|_(?!\w))", "", heading)


def slug(heading):
  """GitHub's anchor of a heading (without the duplicate number)."""
  text = _heading_text(heading).strip().lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path):
  """The headings of a Markdown file, outside fenced blocks, in order."""
  return [
    m.group(2) for m in _HEADING.finditer(_FENCE.sub("", path.read_text()))
  ]


def anchors(path):
  """The anchors GitHub makes for the headings of ``path``."""
  seen, out = {}, set()
  for heading in headings(path):
    base = slug(heading)
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f"{base}-{n}")
  return out


def _found(pattern, text):
  """(match, line) of each match of ``pattern`` in ``text``."""
  return [
    (m, text.count("\n", 0, m.start()) + 1) for m in pattern.finditer(text)
  ]


def broken(path, root=ROOT):
  """What each broken link of ``path`` points to, and why; prose paths
  are relative to the page or to ``root``."""
  text = _prose(path.read_text())
  problems = []
  for m, line in _found(_INLINE, text) + _found(_DEFINITION, text):
    target = m.group(1)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or not target:
      continue  # https:, mailto:, ...: not a relative link
    file_part, _, anchor = target.partition("#")
    where = f"{path.name}:{line}: {target}"
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
      problems.append(f"{where}: no file {file_part}")
      continue
    if not anchor:
      continue
    if anchor.startswith("fp16_scaling."):
      if anchor not in PUBLIC:
        problems.append(f"{where}: {anchor} is no public name")
      continue
    if dest.suffix != ".md" or anchor not in anchors(dest):
      problems.append(f"{where}: no heading makes #{anchor} in {dest.name}")
  for m, line in _found(_PROSE, text):
    page, title = m.groups()
    where = f"{path.name}:{line}: {m.group(0)}"
    dest = next(
      (d for d in (path.parent / page, root / page) if d.exists()), None
    )
    if dest is None:
      problems.append(f"{where}: no file {page}")
    elif not any(
      _heading_text(h).lower().startswith(title.lower()) for h in headings(dest)
    ):
      problems.append(f"{where}: no heading {title!r} in {page}")
  return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
  assert broken(path) == []


def test_the_check_finds_what_it_is_for(tmp_path):
  # A known page: each kind of broken link is reported, each good one is
  # not (the anchors spelled by hand from GitHub's rule).
  page = tmp_path / "page.md"
  (tmp_path / "other.md").write_text(
    "# Other\n\n## The step: `fs.chain(a, b)`\n\n## Twice\n\n## Twice\n"
  )
  page.write_text(
    "# Page\n\n"
    "[ok](other.md#the-step-fschaina-b) [ok](other.md#twice-1)\n"
    "[ok](#page) [ok](#fp16_scaling.chain) [ok](https://example.com/x#y)\n"
    "[no file](missing.md) [no anchor](other.md#twice-2)\n"
    "[no name](#fp16_scaling.no_such_name)\n"
    "`[in code](missing.md)`\n\n"
    "```\n[in a block](missing.md)\n```\n\n"
    'See other.md, "The step" and other.md, "Three times".\n'
  )
  assert broken(page, root=tmp_path) == [
    "page.md:5: missing.md: no file missing.md",
    "page.md:5: other.md#twice-2: no heading makes #twice-2 in other.md",
    "page.md:6: #fp16_scaling.no_such_name: fp16_scaling.no_such_name is no"
    " public name",
    "page.md:13: other.md, \"Three times\": no heading 'Three times' in"
    " other.md",
  ]


def powers(path):
  """``page:line: 2**N`` for each power written with ``**`` outside code."""
  text = _prose(path.read_text())
  return [
    f"{path.name}:{line}: {m.group(0)}" for m, line in _found(_POWER, text)
  ]


def bare_tools(path):
  """``page:line: command`` for each ``pip`` or ``python`` a shell block
  runs bare after a command of the page made ``.venv`` (but one that makes
  a venv: the system's Python does that)."""
  text, made, found = path.read_text(), False, []
  for block in _SHELL.finditer(text):
    first = text.count("\n", 0, block.start(1)) + 1
    for number, line in enumerate(block.group(1).splitlines(), first):
      for command in re.split(r"&&|\|\||;", line):
        words = command.split() or [""]
        makes = "-m venv" in command
        if (
          made
          and not makes
          and words[0] in ("pip", "pip3", "python", "python3")
        ):
          found.append(f"{path.name}:{number}: {words[0]}")
        made = made or "-m venv .venv" in command
  return found


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_powers_and_commands_read_as_written(path):
  assert (powers(path), bare_tools(path)) == ([], [])


def test_the_reading_checks_find_what_they_are_for(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
    "Scales from 2**16 to 2**24, in `2**15` code, 2^10 as written.\n\n"
    "```bash\npip install x && python -m venv .venv && .venv/bin/pip i\n"
    "```\n\n```python\nx = 2**3  # code\n```\n\n"
    "```bash\n.venv/bin/python a.py && pip install -e . ; python -m pytest\n"
    "python3 -m venv .venv && .venv/bin/pip install -e .\n"
    "```\n"
  )
  assert powers(page) == ["page.md:1: 2**16", "page.md:1: 2**24"]
  assert bare_tools(page) == ["page.md:12: pip", "page.md:12: python"]
