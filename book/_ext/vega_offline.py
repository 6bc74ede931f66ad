"""Sphinx extension: the book's scripts ship with the book, so every page works offline.

- Vega, Vega-Lite and Vega-Embed: altair's default HTML loads them from a CDN. The book's charts
  (see `transformer.figures.viz`) call the global `vegaEmbed` instead; this extension writes the
  libraries, bundled by vl-convert (once per version, kept in the user's cache), to
  `_static/vega-bundle.js` at build time and adds it to the
  pages that have a chart (about 1 MB that the other pages do not load): a page has one when its
  document holds the renderer's HTML output (`has_chart`), never when it merely shows its
  source. The bundle is wrapped in a function so that its top-level names do not clash with
  Sphinx's own globals; it exports only `vega`, `vegaLite` and `vegaEmbed` on `window`.
- MathJax 3: Sphinx loads it from a CDN by default. We copy the files of the
  `django-static-mathjax` wheel (a plain copy of MathJax 3, no Django needed) into
  `_static/mathjax` and point `mathjax_path` there.
- Charts in the theme's dark mode: an opaque light card behind each chart (`book-charts.css`),
  since a chart's dark labels on a transparent background would vanish on a dark page.
- MathJax on every page, since the sidebar's chapter titles hold math.
- sphinx-thebe adds its configuration script twice to every page (a JavaScript error:
  "Identifier 'THEBE_JS_URL' has already been declared"): each page keeps one copy.
"""
import shutil
from pathlib import Path

from docutils import nodes

BUNDLE = "vega-bundle.js"
MATHJAX = "mathjax/es5/tex-mml-chtml.js"


def _mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax wheel

    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def _use_local_mathjax(app, config):
    config.mathjax_path = MATHJAX


def _bundle() -> str:
    """vl-convert's bundle of Vega, Vega-Lite and Vega-Embed (seconds of CPU to make), kept per
    vl-convert version in the user's cache (`$XDG_CACHE_HOME/transformer-book/`), so that a
    rebuild does not make it again; made in place when the cache cannot be written."""
    import os

    import vl_convert

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "transformer-book"
    kept = base / f"vega-bundle-{vl_convert.__version__}.js"
    if kept.is_file():
        return kept.read_text(encoding="utf-8")
    bundle = vl_convert.javascript_bundle()
    try:
        base.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.part")
        partial.write_text(bundle, encoding="utf-8")
        partial.replace(kept)                     # atomic: a reader sees all of it or nothing
    except OSError:
        pass
    return bundle


def _write_static(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / CSS).write_text(DARK, encoding="utf-8")
    (static / BUNDLE).write_text("(function () {\n" + _bundle() + "\n})();\n", encoding="utf-8")
    # the speech-rule engine (sre) is only for optional accessibility exploration: leave it out
    shutil.copytree(_mathjax_source(), static / "mathjax" / "es5", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("sre", "*-full*.js", "node-main.js"))


CSS = "book-charts.css"
DARK = """/* the theme's dark mode: charts keep their light colours on an opaque card */
html[data-theme="dark"] .book-chart {
  background: #ffffff;
  border-radius: 6px;
  padding: 6px;
  display: inline-block;
}
"""


CHART = 'class="book-chart"'   # what transformer.figures.viz's renderer writes on each chart's div


def has_chart(doctree) -> bool:
    """A chart is raw HTML that the renderer wrote: a cell's (or a glued) HTML output, which
    myst-nb turns into a `raw` node. Source code that shows the renderer's template, and text
    that a cell prints, become `literal_block` nodes, whatever the highlighter makes of them."""
    if doctree is None:                                 # a page with no document (search, ...)
        return False
    return any(node.get("format") == "html" and CHART in node.astext()
               for node in doctree.findall(nodes.raw))


def _page_scripts(app, pagename, templatename, context, doctree):
    "The vega bundle only where a chart is; each inline script once."
    scripts, seen, kept = context.get("script_files", []), set(), []
    chart = has_chart(doctree)
    for script in scripts:
        name = str(getattr(script, "filename", script) or "")  # None and "": inline
        key = (name, tuple(sorted(getattr(script, "attributes", {}).items())))
        if (name.endswith(BUNDLE) and not chart) or key in seen:
            continue
        seen.add(key)
        kept.append(script)
    scripts[:] = kept


def setup(app):
    app.add_js_file(BUNDLE)  # a classic script in <head>: loaded before any chart's inline script
    app.add_css_file(CSS)
    # MathJax on every page: the sidebar's chapter titles hold math (3. ... $\\sqrt{d_k}$), and
    # Sphinx would load MathJax only where the page body has some
    app.set_html_assets_policy("always")
    app.connect("html-page-context", _page_scripts)
    app.connect("config-inited", _use_local_mathjax)
    app.connect("build-finished", _write_static)
    return {"version": "1.1", "parallel_read_safe": True, "parallel_write_safe": True}
