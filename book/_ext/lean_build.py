"""Sphinx extension: the same site with less repeated work (issue 40). No change alters a byte of
the output; each does once what Sphinx does again and again.

- The sidebar. sphinx-book-theme draws the book's navigation on every page from Sphinx's
  global toctree with `titles_only=True`. For each of the ~45 pages Sphinx deep-copies every
  document's whole table of contents (every heading of every chapter), then throws away all but
  the document titles and the sub-toctrees: 3,600 nodes copied per page, about a sixth of the
  build's CPU. Here that call reads tables of contents already reduced, once per build, the way
  `titles_only` reduces them (`titles_only_tocs`); what Sphinx then does with them is unchanged.
  A document whose reduction could depend on the page or the tags (a `tocdepth`, an `only` node,
  an unusual shape) keeps its whole table.
- The search index. Sphinx memoises the English stemmer within a page, not across pages: the
  words the pages share are stemmed again on each page (41,000 calls; snowballstemmer in pure
  Python). Here one memo serves the whole build; the stemmer is a pure function of the word.
- Code highlighting. Pygments lexes the book's ~900 code cells and outputs (900 kB of source) on
  every build, 5 s of CPU, for the same HTML each time. Each block's HTML is kept in the user's
  cache (`$XDG_CACHE_HOME/transformer-book/highlight-<environment>.json`, like the vega bundle),
  keyed by everything Sphinx's highlighter reads (the source, the language, the options, the
  formatter and its style); the file's name is a hash of every installed package's version (a new
  Pygments, lexer or theme starts a new file), and each build keeps only the blocks it used. A
  block whose highlighting logged a warning is never kept, so it warns (an error under `-W`) on
  every build. Without a writable cache the build highlights everything, as Sphinx does.
"""
import functools
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.environment.adapters.toctree import global_toctree_for_doc


def _reducible(toc, metadata: dict) -> bool:
    "A table whose `titles_only` reduction is the same on every page, whatever the tags."
    return (not metadata.get("tocdepth", 0) and isinstance(toc, nodes.bullet_list)
            and not any(toc.findall(addnodes.only))
            and all(isinstance(item, nodes.list_item) and len(item) <= 2 for item in toc.children))


def titles_only_tocs(env) -> dict:
    """Each document's table of contents as `titles_only` leaves it (Sphinx's
    `_entries_from_toctree`: each top-level entry keeps its title and, in place of its sections,
    the toctrees found in them), made from a copy; `env.tocs` itself is untouched."""
    out = {}
    for docname, toc in env.tocs.items():
        if not _reducible(toc, env.metadata.get(docname, {})):
            out[docname] = toc
            continue
        toc = toc.deepcopy()
        for top_level in toc.children:
            if len(top_level) > 1:
                if subtrees := list(top_level.findall(addnodes.toctree)):
                    top_level[1][:] = subtrees
                else:
                    top_level.pop(1)
        out[docname] = toc
    return out


class _TitlesOnlyEnv:
    "The build environment, whose `tocs` are the reduced ones; everything else is the environment's."

    def __init__(self, env, tocs):
        self._env, self.tocs = env, tocs

    def __getattr__(self, name):
        return getattr(self._env, name)


def _reduce_tocs(app, builder):
    "Once per build, when reading is done and writing starts."
    app.lean_build_tocs = titles_only_tocs(app.env)


def _page_toctree(app, pagename, templatename, context, doctree):
    """The page's `toctree()` (Sphinx's `_get_local_toctree`, for the templates) reads the reduced
    tables when the template asks for titles only."""
    tocs = getattr(app, "lean_build_tocs", None)
    if tocs is None or "toctree" not in context:
        return
    full = context["toctree"]

    def toctree(collapse=True, **kwargs):
        if not kwargs.get("titles_only"):
            return full(collapse=collapse, **kwargs)
        kwargs.setdefault("includehidden", False)
        if kwargs.get("maxdepth") == "":
            kwargs.pop("maxdepth")
        tree = global_toctree_for_doc(_TitlesOnlyEnv(app.env, tocs), pagename, app.builder, collapse=collapse, **kwargs)
        return app.builder.render_partial(tree)["fragment"]
    context["toctree"] = toctree


def _memoise_stemmer(app, doctree, docname):
    "The search indexer exists once writing starts; its language's stemmer gets one memo for the build."
    lang = getattr(getattr(app.builder, "indexer", None), "lang", None)
    if lang is not None and not getattr(lang, "lean_build_memo", False):
        lang.stem = functools.cache(lang.stem)
        lang.lean_build_memo = True


@functools.cache
def _environment_key() -> str:
    "A hash of Python's version and every installed distribution's name and version (once per process)."
    from importlib import metadata
    dists = sorted({((d.metadata["Name"] or "").lower(), d.version) for d in metadata.distributions()})
    return hashlib.sha256(repr((sys.version, dists)).encode()).hexdigest()[:16]


def highlight_cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "transformer-book"
    return base / f"highlight-{_environment_key()}.json"


class _Warnings(logging.Filter):
    "Counts the warnings Sphinx's highlighter logs (suppressed or not), letting every record through."

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record):
        self.count += record.levelno >= logging.WARNING
        return True


HIGHLIGHT_LOGGER = "sphinx.sphinx.highlighting"   # sphinx.util.logging.getLogger("sphinx.highlighting")


def cache_highlighting(bridge, kept: dict, used: dict, warnings: _Warnings) -> None:
    """`bridge.highlight_block` (a Sphinx PygmentsBridge) answers from `kept` what it highlighted before
    with the same arguments, and records in `used` every block it answered without a warning."""
    highlight = bridge.highlight_block
    setting = repr((type(bridge).__qualname__, bridge.dest, bridge.latex_engine, bridge.formatter,
                    sorted(bridge.formatter_args.items()), getattr(bridge, "trim_doctest_flags", None)))

    def highlight_block(source, lang, opts=None, force=False, location=None, **kwargs):
        key = hashlib.sha256(repr((setting, source, lang, sorted((opts or {}).items()), force,
                                   sorted(kwargs.items()))).encode()).hexdigest()
        if key in kept:
            used[key] = kept[key]
            return kept[key]
        before = warnings.count
        html = highlight(source, lang, opts=opts, force=force, location=location, **kwargs)
        if warnings.count == before and isinstance(html, str):
            used[key] = html
        return html
    bridge.highlight_block = highlight_block


def _load_highlighting(app):
    bridge = getattr(app.builder, "highlighter", None)
    if app.builder.format != "html" or bridge is None:
        return
    path = highlight_cache_file()
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = {}
    app.lean_build_highlighting = path, {}, _Warnings()
    logging.getLogger(HIGHLIGHT_LOGGER).addFilter(app.lean_build_highlighting[2])
    cache_highlighting(bridge, kept if isinstance(kept, dict) else {}, *app.lean_build_highlighting[1:])


def _save_highlighting(app, exception):
    if getattr(app, "lean_build_highlighting", None) is None:
        return
    path, used, warnings = app.lean_build_highlighting
    logging.getLogger(HIGHLIGHT_LOGGER).removeFilter(warnings)
    if exception is not None or not used:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps(used), encoding="utf-8")
        partial.replace(path)                     # atomic: a reader sees all of it or nothing
    except OSError:
        pass


def setup(app):
    app.connect("builder-inited", _load_highlighting)
    app.connect("build-finished", _save_highlighting)
    app.connect("write-started", _reduce_tocs)
    app.connect("html-page-context", _page_toctree, priority=100)   # before the themes render with it
    app.connect("doctree-resolved", _memoise_stemmer)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
