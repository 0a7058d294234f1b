"""Sphinx configuration of the fp16_scaling docs: the API reference from the
docstrings (autodoc, napoleon for their Google style), the pages as MyST.

Built offline, every cross-reference resolved and no warning allowed (CI's
docs step, docs/development.md):

  sphinx-build -W -n --keep-going -b html docs <out>
"""

import pathlib
import sys

from docutils import nodes

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fp16_scaling  # noqa: E402

project = "fp16_scaling"
author = "fp16_scaling authors"
copyright = "fp16_scaling authors"
release = version = fp16_scaling.__version__

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "myst_parser",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: GitHub-style anchors for the pages' headings, so that the links the
# pages write for GitHub (`page.md#a-heading`) resolve in the site too.
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence"]

# Docstrings are Google style (Args:, Returns:, Raises:, Examples:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False
# Returns sections are prose ("A dict: ``format``, then ..."): their first
# words are shown as written, not cross-referenced as a return type (the
# signature carries the type).
napoleon_use_rtype = False

# Nothing is fetched at build time (no intersphinx): the names of other
# libraries that signatures and docstrings mention are not cross-referenced.
# Each entry below is such an external name; a name of fp16_scaling itself
# must resolve (`-n`), and tests/test_docs_site.py checks that every public
# name is in the built objects.inv.
nitpick_ignore_regex = [
  # JAX, optax, NumPy, Flax, PyTorch and the standard library's types.
  (r"py:.*", r"(jax|jaxlib|optax|numpy|np|chex|flax|torch|keras)(\..*)?"),
  (r"py:.*", r"(typing|collections\.abc|collections|enum|dataclasses)\..*"),
  (r"py:class", r"(Any|Callable|Sequence|Mapping|Iterable|NamedTuple)"),
  (r"py:class", r"(int|float|bool|str|tuple|dict|list|object|bytes)"),
  (r"py:class", r"os\.PathLike"),
  # Files outside docs/ that the pages and README link to on GitHub (the
  # benchmarks' README, the changelog); in the site they are plain text.
  # tests/test_docs_links.py checks that each exists.
  (r"myst", r"(.*/)?benchmarks/README(\.md)?"),
  (r"myst", r"CHANGELOG\.md"),
]

# Private names that public signatures and docstrings mention: the classes
# that fp16_loss_scale, clip_by_unscaled_norm, chain, stacked_under,
# cast_report and overflow_report return or hold, the pytree alias and the
# type variable of the signatures. Their contract is the public docstring
# that names them (Returns, Attributes); the site documents public names
# only. A private name that a new docstring mentions fails the build until
# it is listed here or made public.
PRIVATE = {
  "_chain": ["Step", "OwnsStep"],
  "_loss_scale": ["LossScale"],
  "_clipping": ["UnscaledClip"],
  "_stacked": ["StackedUnder"],
  "_cast": ["CastReport"],
  "_diagnostics": ["LeafRange"],
  "_states": ["LeafPaths"],
  "_policy": ["T", "cast_floating"],
}
nitpick_ignore = [("py:class", "ArrayTree")]
# A reference to an underscore name (a private module's, method's or
# function's) is not checked either: the site documents none of them.
nitpick_ignore_regex += [(r"py:.*", r"(.*\.)?_[A-Za-z]\w*")]
for module, names in PRIVATE.items():
  for name in names:
    for role in ("py:class", "py:func"):
      nitpick_ignore += [(role, name), (role, f"fp16_scaling.{module}.{name}")]


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
  """A NamedTuple's fields are documented once, by its docstring's
  Attributes section; ``:members:`` would document each again (as
  "Alias for field number N")."""
  del app, what, name, options
  if type(obj).__name__ == "_tuplegetter":
    return True
  return skip


def _no_builtin_docstring(app, what, name, obj, options, lines):
  """A constant's entry says what it holds (in docs/api.md), not what its
  type is: autodoc would show ``tuple``'s own docstring for
  ``OVERFLOW_KINDS``."""
  del app, name, options
  if what == "data" and lines:
    builtin = (type(obj).__doc__ or "").strip()
    if (
      "\n".join(lines).strip() == builtin or lines[0] == builtin.split("\n")[0]
    ):
      lines[:] = []


def _interop_aliases(app, doctree):
  """``fp16_scaling.interop.NAME`` is the very object ``fp16_scaling.NAME``
  (fp16_scaling re-exports the interop wing): the API page documents it
  once, as ``fp16_scaling.NAME``, and this enters the interop path into the
  Python domain (and so objects.inv) as an alias of that entry, as
  ``:canonical:`` does for a class."""
  del doctree
  env = app.env
  if env.docname != "api":
    return
  import fp16_scaling.interop

  py = env.get_domain("py")
  for name in fp16_scaling.interop.__all__:
    entry = py.objects.get(f"fp16_scaling.{name}")
    if entry is not None:
      py.note_object(
        f"fp16_scaling.interop.{name}",
        entry.objtype,
        entry.node_id,
        aliased=True,
      )


def _file_links_as_text(app, doctree, docname):
  """A link into a Markdown file the site does not hold renders as its
  text, as on every page: MyST leaves README's (included from the root)
  an in-page anchor, ``#benchmarks/README.md``, that leads nowhere."""
  del app, docname
  for ref in list(doctree.findall(nodes.reference)):
    if ref.get("refid", "").endswith(".md"):  # written as href="#..."
      ref.replace_self(ref.children)


def setup(app):
  app.connect("autodoc-skip-member", _skip_namedtuple_fields)
  app.connect("autodoc-process-docstring", _no_builtin_docstring)
  app.connect("doctree-read", _interop_aliases)
  app.connect("doctree-resolved", _file_links_as_text)


html_theme = "sphinx_book_theme"
html_title = "fp16_scaling"
html_theme_options = {"show_toc_level": 2}
