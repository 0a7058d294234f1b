"""The API reference documents every public name (docs/api.md, docs/conf.py).

The static check reads docs/api.md and needs no Sphinx. The built check
reads the site's ``objects.inv`` (every object Sphinx documented, by its
full name): from the build that ``FP16_SCALING_DOCS_BUILD`` names (CI's
docs step builds once and points here), else from a build it runs with
``-W -n`` (no warning, every cross-reference resolved) into a temporary
folder, where Sphinx is installed (``pip install -e ".[docs]"``).
"""

import html
import os
import pathlib
import posixpath
import re
import subprocess
import sys
import urllib.parse
import zlib

import pytest

import fp16_scaling as fs
import fp16_scaling.interop
import fp16_scaling.keras  # Keras, on its JAX backend unless set otherwise

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
_HREF = re.compile(r'<a\b[^>]*?\bhref="([^"]*)"')
_ID = re.compile(r'\bid="([^"]*)"')
_DIRECTIVE = re.compile(
  r"^\.\. auto(function|class|exception|data):: fp16_scaling\.(\w+)$", re.M
)


_KERAS_DIRECTIVE = re.compile(
  r"^\.\. auto(function|class):: fp16_scaling\.keras\.(\w+)$", re.M
)


def public_names():
  """Every public name's full path, ``fp16_scaling.interop.*`` and
  ``fp16_scaling.keras.*`` included."""
  return (
    {f"fp16_scaling.{n}" for n in fs.__all__}
    | {f"fp16_scaling.interop.{n}" for n in fp16_scaling.interop.__all__}
    | {f"fp16_scaling.keras.{n}" for n in fp16_scaling.keras.__all__}
  )


def read_inventory(path):
  """{name: (domain:role, uri)} of a Sphinx version-2 ``objects.inv``: four
  header lines, then zlib-compressed lines ``name domain:role priority uri
  display-name`` (a ``$`` in the uri stands for the name)."""
  data = path.read_bytes()
  header = data.split(b"\n", 4)
  assert header[0] == b"# Sphinx inventory version 2", header[0]
  assert b"zlib" in header[3], header[3]
  entries = {}
  for line in zlib.decompress(header[4]).decode().splitlines():
    m = re.match(r"(.+?)\s+(\S+:\S+)\s+(-?\d+)\s+(\S+)\s+(.*)", line)
    assert m, line
    name, role, _, uri, _ = m.groups()
    entries[name] = (role, uri.replace("$", name) if uri.endswith("$") else uri)
  return entries


def test_the_api_page_documents_every_public_name_once():
  documented = [m.group(2) for m in _DIRECTIVE.finditer(API.read_text())]
  assert sorted(documented) == sorted(set(documented)), "documented twice"
  assert sorted(documented) == sorted(fs.__all__)
  # The interop names are documented as the top-level objects they are.
  assert set(fp16_scaling.interop.__all__) <= set(documented)


def test_the_api_page_documents_each_keras_name_once_by_its_kind():
  kinds = [m.groups() for m in _KERAS_DIRECTIVE.finditer(API.read_text())]
  assert sorted(name for _, name in kinds) == sorted(fp16_scaling.keras.__all__)
  for kind, name in kinds:
    obj = getattr(fp16_scaling.keras, name)
    assert kind == ("class" if isinstance(obj, type) else "function"), name


def test_the_api_page_documents_each_with_the_directive_of_its_kind():
  kinds = dict(
    (m.group(2), m.group(1)) for m in _DIRECTIVE.finditer(API.read_text())
  )
  for name, kind in kinds.items():
    obj = getattr(fs, name)
    if isinstance(obj, type) and issubclass(obj, BaseException):
      assert kind == "exception", name
    elif isinstance(obj, type):
      assert kind == "class", name
    elif callable(obj):
      assert kind == "function", name
    else:
      assert kind == "data", name


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
  """The folder of a built site: CI's, or one built here, in a process of
  its own: autodoc (``autodoc_preserve_defaults``) rewrites the documented
  functions' signatures, which the tests run after it in this process
  read (tests/peers/test_signatures.py compares defaults)."""
  given = os.environ.get("FP16_SCALING_DOCS_BUILD")
  if given:
    return pathlib.Path(given)
  pytest.importorskip("sphinx.cmd.build")
  pytest.importorskip("myst_parser")
  out = tmp_path_factory.mktemp("site")
  args = ["-W", "-n", "--keep-going", "-q", "-E", "-b", "html"]
  build = [sys.executable, "-m", "sphinx", *args, str(ROOT / "docs"), str(out)]
  done = subprocess.run(build, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-4000:]
  return out


def test_the_built_inventory_has_every_public_name(built_site):
  inventory = read_inventory(built_site / "objects.inv")
  missing = sorted(public_names() - set(inventory))
  assert missing == []
  for name in public_names():
    role, uri = inventory[name]
    assert role.startswith("py:"), (name, role)
    # Each resolves to its entry on the API page; an interop name to the
    # entry of the same object at the top level.
    short = name.replace("fp16_scaling.interop.", "fp16_scaling.")
    assert uri == f"api.html#{short}", (name, uri)
    assert (built_site / "api.html").exists()


def test_the_inventory_reader_reads_what_sphinx_writes(tmp_path):
  # An inventory written by hand in Sphinx's format: the reader gives
  # back its names, roles and uris ("$" expanded).
  body = (
    "fp16_scaling.chain py:function 1 api.html#$ -\n"
    "fp16_scaling.Policy py:class 1 api.html#fp16_scaling.Policy -\n"
    "api std:doc -1 api.html API reference\n"
  )
  (tmp_path / "objects.inv").write_bytes(
    b"# Sphinx inventory version 2\n# Project: p\n# Version: 0\n"
    b"# The remainder of this file is compressed using zlib.\n"
    + zlib.compress(body.encode())
  )
  assert read_inventory(tmp_path / "objects.inv") == {
    "fp16_scaling.chain": ("py:function", "api.html#fp16_scaling.chain"),
    "fp16_scaling.Policy": ("py:class", "api.html#fp16_scaling.Policy"),
    "api": ("std:doc", "api.html"),
  }


def dead_links(site):
  """``page: href`` for each link of the built site's pages to a file the
  site does not hold, or to an id its page does not hold (links with a
  scheme, ``https:`` and the like, are not followed)."""
  pages = {p.relative_to(site).as_posix(): p for p in site.rglob("*.html")}
  ids, dead = {}, []
  for name, path in sorted(pages.items()):
    for href in _HREF.findall(path.read_text()):
      href = urllib.parse.unquote(html.unescape(href))
      if href in ("", "#") or re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I):
        continue
      file_part, _, fragment = href.partition("#")
      file_part = file_part.partition("?")[0]
      target = name
      if file_part:
        target = posixpath.join(posixpath.dirname(name), file_part)
        target = posixpath.normpath(target)
      if target not in pages:
        if not (site / target).exists():
          dead.append(f"{name}: {href}")
        continue
      if target not in ids:
        ids[target] = set(_ID.findall(pages[target].read_text()))
      if fragment and fragment not in ids[target]:
        dead.append(f"{name}: {href}")
  return dead


def test_no_link_of_the_built_site_is_dead(built_site):
  assert dead_links(built_site) == []


def test_the_dead_link_check_finds_what_it_is_for(tmp_path):
  # A site written by hand: each kind of dead link is reported (a missing
  # page, an id no element of the page holds, here or there), each good
  # one is not.
  (tmp_path / "_static").mkdir()
  (tmp_path / "_static" / "s.css").write_text("")
  (tmp_path / "api.html").write_text('<section id="chain"><p id="x"></p>')
  (tmp_path / "index.html").write_text(
    '<a href="api.html#chain">ok</a> <a class="r" href="#top">ok</a>'
    '<p id="top"></p><a href="_static/s.css?v=1">ok</a>'
    '<a href="https://example.com/#y">ok</a> <a href="#">ok</a>'
    '<a href="api.html#module-fp16_scaling.interop">no id</a>'
    '<a href="#benchmarks/README.md">no id here</a>'
    '<a href="benchmarks.html">no page</a>'
  )
  assert dead_links(tmp_path) == [
    "index.html: api.html#module-fp16_scaling.interop",
    "index.html: #benchmarks/README.md",
    "index.html: benchmarks.html",
  ]
