"""Sphinx extension: ship one offline copy of Vega, Vega-Lite and Vega-Embed with the book.

Altair's default HTML loads these libraries from a CDN, so an offline reader sees an error. The
book's charts (see `transformer.viz`) instead call the global `vegaEmbed`. This extension writes
the libraries, bundled by vl-convert, to `_static/vega-bundle.js` at build time and adds it to
every page. The bundle is wrapped in a function so that its top-level names do not clash with
Sphinx's own globals; it exports only `vega`, `vegaLite` and `vegaEmbed` on `window`.
"""
from pathlib import Path

BUNDLE = "vega-bundle.js"


def _write_bundle(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    import vl_convert

    static = Path(app.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / BUNDLE).write_text("(function () {\n" + vl_convert.javascript_bundle() + "\n})();\n",
                                 encoding="utf-8")


def setup(app):
    app.add_js_file(BUNDLE)  # a classic script in <head>: loaded before any chart's inline script
    app.connect("build-finished", _write_bundle)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
