"""Sphinx extension: the translator widget (issue 31; chapter 11 and the front page) ships with the
book, so it runs from the site alone, with nothing fetched from elsewhere.

- onnxruntime-web, pinned by `book/_static/translator/package-lock.json`: when its `node_modules`
  lacks the locked version, the build installs it (`npm ci --prefix book/_static/translator`, with
  the machine's Node.js). Only what single-threaded WASM needs is copied, to
  `_static/translator/ort/`: the ES module with its loader bundled in (renamed `.js`) and its one
  `.wasm` (threads would need cross-origin isolation headers, which GitHub Pages cannot send).
- The translator's modules and stylesheet (`book/_static/translator/*.js`, `*.css`) go to
  `_static/translator/`, and the web export `book/model/web/` (appendix I) to
  `_static/translator/model/`.
- `widget.js` and `widget.css` are added only to the pages that hold a widget, a raw HTML
  `<div class="book-translator">` (as `vega_offline` adds the chart bundle); every other page loads
  none of it, and the widget itself loads the runtime and the model only when the reader first
  presses Translate.

Without npm, or when `npm ci` fails, the build warns (an error under `-W`) and the site gets no
runtime: the widget then says that it failed to load.
"""
import json
import shutil
import subprocess
from pathlib import Path

from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

BOOK = Path(__file__).resolve().parents[1]
TRANSLATOR = BOOK / "_static" / "translator"
WEB = BOOK / "model" / "web"
RUNTIME = "onnxruntime-web"
# the package's file -> the site's: the module as .js, a type every web server sends as JavaScript
# (a browser refuses a module sent as application/octet-stream, as some servers send .mjs)
RUNTIME_FILES = {"ort.wasm.bundle.min.mjs": "ort.wasm.bundle.min.js",
                 "ort-wasm-simd-threaded.wasm": "ort-wasm-simd-threaded.wasm"}
OUT = "translator"                  # under the site's _static/
SCRIPT, CSS = f"{OUT}/widget.js", f"{OUT}/widget.css"
WIDGET = 'class="book-translator'   # the div a page holds the widget in


def locked_version(package_dir: Path = TRANSLATOR, name: str = RUNTIME) -> str:
    "The version of `name` that package-lock.json pins."
    lock = json.loads((package_dir / "package-lock.json").read_text(encoding="utf-8"))
    return lock["packages"][f"node_modules/{name}"]["version"]


def installed_version(package_dir: Path = TRANSLATOR, name: str = RUNTIME) -> str | None:
    path = package_dir / "node_modules" / name / "package.json"
    return json.loads(path.read_text(encoding="utf-8"))["version"] if path.is_file() else None


def install_runtime(package_dir: Path = TRANSLATOR) -> Path | None:
    """onnxruntime-web's dist folder at the locked version, installed with `npm ci` when missing;
    None (after a warning) when it cannot be."""
    want = locked_version(package_dir)
    if installed_version(package_dir) != want:
        npm = shutil.which("npm")
        command = f"npm ci --prefix {package_dir.relative_to(BOOK.parent)}"
        if npm is None:
            logger.warning(f"translator: {RUNTIME} {want} is not installed and npm is not on PATH: install "
                           f"Node.js (with npm), or run `{command}`; the site gets no translator runtime")
            return None
        logger.info(f"translator: installing {RUNTIME} {want} ({command})")
        result = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(package_dir)],
                                capture_output=True, text=True)
        if result.returncode != 0 or installed_version(package_dir) != want:
            logger.warning(f"translator: `{command}` failed (exit {result.returncode}): "
                           f"{(result.stderr or result.stdout)[-1500:]}")
            return None
    return package_dir / "node_modules" / RUNTIME / "dist"


def copy_site_files(static: Path, dist: Path | None) -> None:
    """The translator's modules, onnxruntime-web's WASM files (from `dist`, when there) and the web
    export, into the site's _static/."""
    out = static / OUT
    (out / "ort").mkdir(parents=True, exist_ok=True)
    for path in sorted([*TRANSLATOR.glob("*.js"), *TRANSLATOR.glob("*.css")]):
        shutil.copy2(path, out / path.name)
    if dist is not None:
        for name, site_name in RUNTIME_FILES.items():
            shutil.copy2(dist / name, out / "ort" / site_name)
    if not (WEB / "config.json").is_file():
        logger.warning(f"translator: {WEB} holds no web export: run `python -m transformer export --web "
                       f"--model book/model --out book/model/web`")
        return
    config = json.loads((WEB / "config.json").read_text(encoding="utf-8"))
    (out / "model").mkdir(exist_ok=True)
    for name in ["config.json", config["tokenizer"], config["encoder"], config["decoder"], *config["external_data"]]:
        shutil.copy2(WEB / name, out / "model" / name)


def has_widget(doctree) -> bool:
    "The page holds the widget's div as raw HTML (not as text or code that shows it)."
    if doctree is None:
        return False
    return any(node.get("format") == "html" and WIDGET in node.astext() for node in doctree.findall(nodes.raw))


def _page_assets(app, pagename, templatename, context, doctree):
    "widget.js and widget.css only where a widget is."
    if has_widget(doctree):
        return
    for key, name in (("script_files", SCRIPT), ("css_files", CSS)):
        files = context.get(key, [])
        files[:] = [f for f in files if not str(getattr(f, "filename", f) or "").endswith(name)]


def _install(app):
    "Early, so that a missing runtime is reported before the pages are written."
    app.translator_runtime = install_runtime() if app.builder.format == "html" else None


def _write_files(app, exception):
    if exception is None and app.builder.format == "html":
        copy_site_files(Path(app.outdir) / "_static", getattr(app, "translator_runtime", None))


def setup(app):
    app.add_js_file(SCRIPT, defer="defer")  # a classic script: a page read from disk loads without error
    app.add_css_file(CSS)
    app.connect("builder-inited", _install)
    app.connect("html-page-context", _page_assets)
    app.connect("build-finished", _write_files)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
