"""Sphinx extension: the book's scripts ship with the book, so every page works offline.

- Vega, Vega-Lite and Vega-Embed: altair's default HTML loads them from a CDN. The book's charts
  (see `transformer.viz`) call the global `vegaEmbed` instead; this extension writes the
  libraries, bundled by vl-convert, to `_static/vega-bundle.js` at build time and adds it to every
  page. The bundle is wrapped in a function so that its top-level names do not clash with
  Sphinx's own globals; it exports only `vega`, `vegaLite` and `vegaEmbed` on `window`.
- MathJax 3: Sphinx loads it from a CDN by default. We copy the files of the
  `django-static-mathjax` wheel (a plain copy of MathJax 3, no Django needed) into
  `_static/mathjax` and point `mathjax_path` there.
"""
import shutil
from pathlib import Path

BUNDLE = "vega-bundle.js"
MATHJAX = "mathjax/es5/tex-mml-chtml.js"


def _mathjax_source() -> Path:
    import mathjax  # the django-static-mathjax wheel

    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def _use_local_mathjax(app, config):
    config.mathjax_path = MATHJAX


def _write_static(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    import vl_convert

    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / BUNDLE).write_text("(function () {\n" + vl_convert.javascript_bundle() + "\n})();\n",
                                 encoding="utf-8")
    # the speech-rule engine (sre) is only for optional accessibility exploration: leave it out
    shutil.copytree(_mathjax_source(), static / "mathjax" / "es5", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("sre", "*-full*.js", "node-main.js"))


def setup(app):
    app.add_js_file(BUNDLE)  # a classic script in <head>: loaded before any chart's inline script
    app.connect("config-inited", _use_local_mathjax)
    app.connect("build-finished", _write_static)
    return {"version": "1.1", "parallel_read_safe": True, "parallel_write_safe": True}
