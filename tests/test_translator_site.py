"""book/_ext/translator_site.py without a book build: which pages get the widget's files, where the
runtime comes from, and what a missing npm does (the whole site is tests/test_book.py's)."""
import json
import sys
from pathlib import Path

from docutils import nodes
from docutils.utils import new_document

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import translator_site  # noqa: E402


def document(*children):
    doc = new_document("page")
    doc.extend(children)
    return doc


def test_a_page_has_the_widget_only_as_raw_html():
    div = '<div class="book-translator" data-size="small"></div>'
    assert translator_site.has_widget(document(nodes.raw("", div, format="html")))
    assert not translator_site.has_widget(document(nodes.literal_block(div, div)))    # shown as code
    assert not translator_site.has_widget(document(nodes.paragraph(text=div)))
    assert not translator_site.has_widget(document(nodes.raw("", div, format="latex")))
    assert not translator_site.has_widget(None)                                       # search, genindex


def test_pages_without_the_widget_lose_its_files():
    class File(str):
        filename = property(lambda self: str(self))
    context = {"script_files": [File("_static/doctools.js"), File(translator_site.SCRIPT)],
               "css_files": [File("_static/pygments.css"), File(translator_site.CSS)]}
    translator_site._page_assets(None, "book/05_positions", "page.html", context, document())
    assert context == {"script_files": ["_static/doctools.js"], "css_files": ["_static/pygments.css"]}
    kept = {"script_files": [File(translator_site.SCRIPT)], "css_files": [File(translator_site.CSS)]}
    widget = document(nodes.raw("", '<div class="book-translator"></div>', format="html"))
    translator_site._page_assets(None, "book/11_traced", "page.html", kept, widget)
    assert kept == {"script_files": [translator_site.SCRIPT], "css_files": [translator_site.CSS]}


def test_the_runtime_is_the_locked_onnxruntime_web():
    lock = json.loads((translator_site.TRANSLATOR / "package-lock.json").read_text())
    package = json.loads((translator_site.TRANSLATOR / "package.json").read_text())
    assert package["dependencies"] == {"onnxruntime-web": translator_site.locked_version()}
    assert lock["packages"]["node_modules/onnxruntime-web"]["integrity"].startswith("sha512-")
    assert set(translator_site.RUNTIME_FILES) == {"ort.wasm.bundle.min.mjs", "ort-wasm-simd-threaded.wasm"}


def test_without_npm_the_build_warns_and_copies_no_runtime(tmp_path, monkeypatch):
    package = tmp_path / "translator"
    package.mkdir()
    (package / "package-lock.json").write_text(json.dumps(
        {"packages": {"node_modules/onnxruntime-web": {"version": "1.30.0"}}}))
    warnings = []
    monkeypatch.setattr(translator_site.shutil, "which", lambda name: None)
    monkeypatch.setattr(translator_site.logger, "warning", warnings.append)
    monkeypatch.setattr(translator_site, "BOOK", tmp_path / "book")          # commands are named from the root
    assert translator_site.install_runtime(package) is None
    (message,) = warnings
    assert "npm is not on PATH" in message and "npm ci --prefix translator" in message

    static = tmp_path / "site" / "_static"
    translator_site.copy_site_files(static, None)              # the modules and the model, no runtime
    out = static / "translator"
    assert (out / "widget.js").is_file() and (out / "translator.js").is_file()
    assert not any((out / "ort").iterdir())
    config = json.loads((out / "model" / "config.json").read_text())
    for name in (config["encoder"], config["decoder"], config["tokenizer"], *config["external_data"]):
        assert (out / "model" / name).stat().st_size == (translator_site.WEB / name).stat().st_size
