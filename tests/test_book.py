"""The book builds with warnings as errors, and its interactive charts render with no network."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text())
CHAPTERS = [c["file"] for part in TOC["parts"] for c in part["chapters"]]
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--virtual-time-budget=20000", "--dump-dom"]


def _chart_specs(notebook: Path) -> list[dict]:
    "The Vega-Lite specs of the charts stored in a notebook's outputs (see transformer.viz)."
    specs = []
    for cell in json.loads(notebook.read_text())["cells"]:
        for out in cell.get("outputs", []):
            html = "".join(out.get("data", {}).get("text/html", ""))
            for m in re.finditer(r"var spec = (.*?);\n", html):
                specs.append(json.loads(m.group(1).replace("<\\/", "</")))
    return specs


@pytest.fixture(scope="session")
def built_book(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("book")
    result = subprocess.run(["jupyter-book", "build", str(ROOT), "--path-output", str(out), "-W", "--keep-going"],
                            capture_output=True, text=True)
    assert result.returncode == 0, "book build failed (warnings are errors):\n" + result.stdout[-6000:] + result.stderr[-3000:]
    return out / "_build" / "html"


def test_toc_lists_every_chapter_notebook():
    on_disk = {f"book/{p.stem}" for p in (ROOT / "book").glob("[0-9]*.ipynb")}
    assert on_disk == set(CHAPTERS), f"_toc.yml and book/ disagree: only in toc {set(CHAPTERS) - on_disk}, only on disk {on_disk - set(CHAPTERS)}"


def test_every_chapter_page_exists_with_outputs(built_book):
    for chapter in CHAPTERS:
        page = built_book / f"{chapter}.html"
        assert page.exists(), f"{page} was not built"
        assert "cell_output" in page.read_text(), f"{chapter}: the page shows no stored outputs"
    assert (built_book / "_static" / "vega-bundle.js").stat().st_size > 100_000, "the offline vega bundle is missing"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chart_specs_compile(chapter):
    "Every stored chart is a valid Vega-Lite spec (vl-convert compiles it, no browser needed)."
    import vl_convert

    for spec in _chart_specs(ROOT / f"{chapter}.ipynb"):
        vl_convert.vegalite_to_vega(spec)


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("no headless browser found: install Debian's `chromium` (apt-get install chromium); .ci/run does")


CHART_PAGES = [c for c in CHAPTERS if _chart_specs(ROOT / f"{c}.ipynb")]


def _render(page: Path, profile: Path) -> str:
    "The page's DOM after its scripts ran, in headless Chromium with no network."
    result = subprocess.run([_browser(), *CHROME_FLAGS, f"--user-data-dir={profile}", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert "<body" in result.stdout, f"the browser returned no page for {page}:\n{result.stderr[-2000:]}"
    return result.stdout


def test_math_renders_offline(built_book, tmp_path):
    dom = _render(built_book / "book" / "00_bottleneck.html", tmp_path)
    n_math = dom.count('class="math')
    assert n_math > 5, "expected displayed and inline math on the chapter page"
    assert dom.count("<mjx-container") >= n_math, "MathJax did not typeset every formula (is _static/mathjax there?)"


def test_some_chapters_have_charts():
    assert len(CHART_PAGES) >= 5, f"expected interactive figures in most chapters, found them in {CHART_PAGES}"


@pytest.mark.parametrize("chapter", CHART_PAGES)
def test_charts_render_offline_in_a_browser(built_book, chapter, tmp_path):
    page = built_book / f"{chapter}.html"
    n_charts = len(_chart_specs(ROOT / f"{chapter}.ipynb"))
    dom = _render(page, tmp_path)
    assert "Error loading script" not in dom
    charts = re.findall(r'<div id="vis-[^"]+" class="book-chart[^"]*"[^>]*>(.*?)</div>\s*<script', dom, re.S)
    assert len(charts) == n_charts, f"{chapter}: {n_charts} charts stored, {len(charts)} on the page"
    failed = {i: re.sub(r"<[^>]+>", "", inner)[:200] for i, inner in enumerate(charts)
              if "<svg" not in inner and "<canvas" not in inner}
    assert not failed, f"{chapter}: charts did not render (no svg/canvas in their container): {failed}"
