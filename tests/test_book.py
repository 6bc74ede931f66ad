"""The book builds with warnings as errors, and its interactive charts render with no network."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text())
API_PAGE = "book/g_api"   # appendix G, the API reference: autodoc's page (book/g_api.rst, tests/test_api_page.py), no notebook
CHAPTERS = [entry["file"] for part in TOC["parts"] for c in part["chapters"]
            for entry in [c, *c.get("sections", [])]   # a chapter's second notebook is its section N.1
            if entry["file"] != API_PAGE]


def _chart_specs(notebook: Path) -> list[dict]:
    "The Vega-Lite specs of the charts stored in a notebook's outputs (see transformer.figures.viz)."
    specs = []
    for cell in json.loads(notebook.read_text())["cells"]:
        for out in cell.get("outputs", []):
            html = "".join(out.get("data", {}).get("text/html", ""))
            for m in re.finditer(r"var spec = (.*?);\n", html):
                specs.append(json.loads(m.group(1).replace("<\\/", "</")))
    return specs


def test_toc_lists_every_chapter_notebook():
    on_disk = {f"book/{p.stem}" for p in [*(ROOT / "book").glob("[0-9]*.ipynb"), *(ROOT / "book").glob("[a-z]_*.ipynb")]}
    assert on_disk == set(CHAPTERS), f"_toc.yml and book/ disagree: only in toc {set(CHAPTERS) - on_disk}, only on disk {on_disk - set(CHAPTERS)}"


def test_every_chapter_page_exists_with_outputs(built_book):
    for chapter in CHAPTERS:
        page = built_book / f"{chapter}.html"
        assert page.exists(), f"{page} was not built"
        assert "cell_output" in page.read_text(), f"{chapter}: the page shows no stored outputs"
    assert (built_book / "_static" / "vega-bundle.js").stat().st_size > 100_000, "the offline vega bundle is missing"


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chart_specs_compile(chapter):
    "Every stored chart is a valid Vega-Lite spec (vl-convert compiles it, no browser needed)."
    import vl_convert

    for spec in _chart_specs(ROOT / f"{chapter}.ipynb"):
        vl_convert.vegalite_to_vega(spec)


BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
BROWSER_PATHS = ("/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",   # macOS
                 "/Applications/Chromium.app/Contents/MacOS/Chromium",
                 "/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome",
                 "/snap/bin/chromium", "/opt/google/chrome/chrome")
NO_BROWSER = ("no Chrome/Chromium found: browser checks skipped; install Chromium or Google Chrome, "
              "or set TRANSFORMER_BROWSER=/path/to/chrome")


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def _browser() -> str:
    """A headless Chrome or Chromium: $TRANSFORMER_BROWSER, else the first on PATH, else a standard install
    location. None found: a failure under CI (which installs one), a skip with the way to get one elsewhere."""
    named = os.environ.get("TRANSFORMER_BROWSER")
    if named:
        found = shutil.which(named)
        if not found:
            pytest.fail(f"TRANSFORMER_BROWSER={named!r} is not an executable file; point it at Chrome or Chromium")
        return found
    for found in [shutil.which(name) for name in BROWSER_NAMES] + [p for p in BROWSER_PATHS if _is_executable(p)]:
        if found:
            return found
    if _on_ci():
        pytest.fail("no headless browser found: install Debian's `chromium` (apt-get install chromium); .ci/run does")
    pytest.skip(NO_BROWSER)


@pytest.fixture(scope="session")
def browser() -> str:
    return _browser()


CHART_PAGES = [c for c in CHAPTERS if _chart_specs(ROOT / f"{c}.ipynb")]


def test_math_renders_offline(rendered, built_book):   # the browser first: no browser, no book build
    dom, _ = rendered(built_book / "book" / "00_why_attention.html", "light", keep=True)   # its every-page check reads it too
    n_math = dom.count('class="math')
    assert n_math > 5, "expected displayed and inline math on the chapter page"
    assert dom.count("<mjx-container") >= n_math, "MathJax did not typeset every formula (is _static/mathjax there?)"


def test_some_chapters_have_charts():
    assert len(CHART_PAGES) >= 5, f"expected interactive figures in most chapters, found them in {CHART_PAGES}"


# What a page has finished doing once its scripts ran: the document loaded, every chart drawn (an
# svg or canvas in its container), every formula typeset by MathJax.
SETTLED = """(() => document.readyState === "complete"
  && [...document.querySelectorAll('div[id^="vis-"].book-chart')].every(c => c.querySelector("svg, canvas"))
  && document.querySelectorAll("mjx-container").length >= document.querySelectorAll(".math").length)()"""


def _messages(events: list[dict]) -> list[str]:
    "What a page said on its console, raised uncaught, or failed to load (DevTools events)."
    out = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append(f"Uncaught {d.get('exception', {}).get('description') or d.get('text')}")
        elif e["method"] == "Runtime.consoleAPICalled":
            out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif e["method"] == "Log.entryAdded":
            out.append(f"{p['entry']['text']} {p['entry'].get('url', '')}")
    return out


# The window the pages open in: as wide as before (the theme's layout and the charts' widths follow the
# width), a fifth as tall. Nothing here looks at pixels, and the software compositor drew every frame of
# a loading page over the whole window (about a third of Chromium's CPU per page at 1280x1600).
WINDOW = ["--window-size=1280,400"]


@pytest.fixture(scope="module")
def chromes(browser, tmp_path_factory):
    """One headless Chromium for every page of this file, in either theme mode (tests/web_browser.py's
    DevTools driver): chromes(mode) is that browser, its pages seeing `prefers-color-scheme: mode` from
    their first byte on (DevTools' media emulation: what --force-dark-mode gave a second browser, which
    the theme's auto mode follows). Started on first use; one browser for every page and both modes."""
    from web_browser import Chrome
    started, scheme = [], [None]

    def get(mode: str):
        assert mode in ("light", "dark"), mode
        if not started:
            started.append(Chrome(browser, tmp_path_factory.mktemp("chrome"), WINDOW))
            started[0].call("Log.enable")
        if scheme[0] != mode:
            started[0].call("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": mode}]})
            scheme[0] = mode
        return started[0]
    yield get
    for chrome in started:
        chrome.close()


@pytest.fixture(scope="module")
def rendered(chromes):
    """_render_logged(chromes(mode), page) as rendered(page, mode); one asked for with keep=True is kept for
    the next reader of the same page and mode, who takes it (the math check's page is also a page of the
    every-page check: one load of it for both)."""
    kept = {}

    def get(page: Path, mode: str, keep: bool = False) -> tuple[str, list[str]]:
        if (page, mode) in kept:
            return kept.pop((page, mode))
        result = _render_logged(chromes(mode), page)
        if keep:
            kept[page, mode] = result
        return result
    return get


def _render_logged(chrome, page: Path, timeout: float = 30) -> tuple[str, list[str]]:
    """The page's DOM once it settled (SETTLED, polled in the page; or `timeout` seconds: the asserts then
    say what did not happen), and the messages its JavaScript logged or the browser logged for it: every
    message from the navigation on (no detour through about:blank, which cost a navigation per page and
    dropped what the previous page still logged; here such a message would count against this page, never
    be lost)."""
    mark = len(chrome.events)
    chrome.open(page.as_uri())
    chrome.settle(SETTLED, timeout=timeout)
    dom = chrome.evaluate("document.documentElement.outerHTML")
    chrome.evaluate("1")                                  # the events that arrived meanwhile
    return dom, _messages(chrome.events[mark:])


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_the_browser_check_sees_errors_failed_loads_and_unfinished_charts(chromes, tmp_path, mode):
    """The check below on a page that fails each way, in either mode: it must see every failure (planted),
    and the page saw the mode's colour scheme while it loaded, not after."""
    page = tmp_path / "bad.html"
    page.write_text('<html><body><script src="missing.js"></script>'
                    '<script>document.body.dataset.scheme = matchMedia("(prefers-color-scheme: dark)").matches'
                    ' ? "dark" : "light"</script>'
                    '<script>console.error("Error: planted"); throw new Error("thrown on purpose")</script>'
                    '<div id="vis-x" class="book-chart">no chart</div><script>1</script></body></html>')
    dom, console = _render_logged(chromes(mode), page, timeout=2)
    assert any("Uncaught" in m and "thrown on purpose" in m for m in console), console
    assert any("Error: planted" in m for m in console), console
    assert any("missing.js" in m for m in console), console
    assert "<svg" not in dom and "no chart" in dom
    assert f'data-scheme="{mode}"' in dom, dom[:300]


PAGES = ["book/index", *CHAPTERS, API_PAGE]
# dark mode changes the theme's colours (one template for every page) and puts each chart on a card
# (one stylesheet, book/_ext/vega_offline.py, on the one chart class every chart carries): each kind of
# page opens in it, the front page, a chapter with charts (the charts of every chapter render in light
# mode above) and the API page, not a notebook
DARK = ["book/index", CHART_PAGES[0], API_PAGE]


@pytest.mark.parametrize(("page", "mode"), [(p, "light") for p in PAGES] + [(p, "dark") for p in DARK])
def test_every_page_in_a_browser(rendered, built_book, page, mode):
    """Every page, offline, in the theme's light mode, and each kind of page in its dark mode too:
    no script that failed to load, no JavaScript error, every chart rendered, every formula typeset,
    every image there; in dark mode the theme switched and the charts sit on an opaque light card."""
    html_path = built_book / f"{page}.html"
    dom, console = rendered(html_path, mode)
    assert "Error loading script" not in dom
    errors = [m for m in console if "Uncaught" in m or "Error" in m or "Failed to load" in m]
    assert not errors, f"{page} ({mode}): JavaScript errors {errors}"
    assert f'data-theme="{mode}"' in dom.split("<body", 1)[0], f"{page}: the theme did not switch to {mode}"
    n_charts = len(_chart_specs(ROOT / f"{page}.ipynb")) if page in CHAPTERS else 0
    charts = re.findall(r'<div id="vis-[^"]+" class="book-chart[^"]*"[^>]*>(.*?)</div>\s*<script', dom, re.S)
    assert len(charts) == n_charts, f"{page}: {n_charts} charts stored, {len(charts)} on the page"
    failed = {i: re.sub(r"<[^>]+>", "", inner)[:200] for i, inner in enumerate(charts)
              if "<svg" not in inner and "<canvas" not in inner}
    assert not failed, f"{page}: charts did not render (no svg/canvas in their container): {failed}"
    loads_vega = re.search(r'<script[^>]+src="[^"]*vega-bundle\.js', dom) is not None
    assert loads_vega == (n_charts > 0), f"{page}: the vega bundle belongs on chart pages only"
    n_math = dom.count('class="math')
    assert dom.count("<mjx-container") >= n_math, f"{page}: MathJax did not typeset every formula"
    for src in re.findall(r'<img[^>]+src="([^"]+)"', dom):
        if not src.startswith(("data:", "http")):
            assert (html_path.parent / src.split("?")[0]).resolve().is_file(), f"{page}: broken image {src}"
    if mode == "dark" and n_charts:
        assert "book-charts.css" in dom                              # the card behind each chart


@pytest.mark.parametrize("ci", [None, "true", "1", "false", "0"])
def test_no_browser_skips_for_a_reader_and_fails_under_ci(ci, monkeypatch):
    monkeypatch.delenv("TRANSFORMER_BROWSER", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sys.modules[__name__], "_is_executable", lambda path: False)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    on_ci = ci in ("true", "1")
    with pytest.raises(pytest.fail.Exception if on_ci else pytest.skip.Exception) as e:
        _browser()
    assert ("apt-get install chromium" if on_ci else NO_BROWSER) in str(e.value)


def test_browser_search_order(monkeypatch):
    "TRANSFORMER_BROWSER, then PATH, then the standard install locations."
    monkeypatch.delenv("TRANSFORMER_BROWSER", raising=False)
    monkeypatch.setenv("CI", "true")
    executables = {"google-chrome-stable": "/usr/local/bin/google-chrome-stable", "/opt/my/chrome": "/opt/my/chrome"}
    monkeypatch.setattr(shutil, "which", executables.get)
    monkeypatch.setattr(sys.modules[__name__], "_is_executable",
                        lambda path: path == "/Applications/Chromium.app/Contents/MacOS/Chromium")
    assert _browser() == "/usr/local/bin/google-chrome-stable"
    del executables["google-chrome-stable"]
    assert _browser() == "/Applications/Chromium.app/Contents/MacOS/Chromium"
    monkeypatch.setenv("TRANSFORMER_BROWSER", "/opt/my/chrome")
    assert _browser() == "/opt/my/chrome"
    monkeypatch.setenv("TRANSFORMER_BROWSER", "/nowhere/chrome")
    with pytest.raises(pytest.fail.Exception, match="TRANSFORMER_BROWSER='/nowhere/chrome' is not an executable"):
        _browser()


def _number(stem: str) -> str:
    """The number a notebook's file name gives its title: 07_1_model -> '7.1', 10_evaluation -> '10',
    a_data -> 'A', b_1_plots -> 'B.1'."""
    parts = stem.split("_")
    first = str(int(parts[0])) if parts[0].isdigit() else parts[0].upper()
    return ".".join([first] + ([parts[1]] if parts[1].isdigit() else []))


def test_titles_numbers_and_toc_agree():
    "One number per main-line chapter, its section N.1 nested under it (B.1 under appendix B), appendices at the end; no 1a/8d."
    sections = {s["file"]: c["file"] for part in TOC["parts"] for c in part["chapters"] for s in c.get("sections", [])}
    for chapter in CHAPTERS:
        stem = chapter.split("/")[-1]
        first = json.loads((ROOT / f"{chapter}.ipynb").read_text())["cells"][0]
        title = "".join(first["source"]).splitlines()[0]
        number = _number(stem)
        assert re.match(rf"# {re.escape(number)}\.? ", title), f"{chapter}: title {title!r} should start with '# {number}'"
        assert not re.search(r"# \d+[a-z]\b", title), f"{chapter}: a lettered number in {title!r}"
        if "." in number:
            parent = sections.get(chapter)
            assert parent is not None and _number(parent.split("/")[-1]) == number.split(".")[0], \
                f"{chapter} ({number}) must be a section of chapter {number.split('.')[0]} in _toc.yml"
    numbers = [_number(c.split("/")[-1]) for c in CHAPTERS]
    main = [n for n in numbers if n[0].isdigit() and "." not in n]
    assert main == sorted(main, key=int) and len(set(main)) == len(main), main
    appendices = [n for n in numbers if n[0].isalpha()]   # with their sections: A, B, B.1, C
    assert numbers[-len(appendices):] == sorted(appendices), "appendices come last, in order"
    index = (ROOT / "book" / "index.md").read_text()
    for chapter in CHAPTERS:
        assert f"({chapter.split('/')[-1]}.ipynb)" in index, f"book/index.md does not link {chapter}"


CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_control_characters(chapter):
    "A stray control character (a BEL where '\\a' of '\\approx' was meant) renders as garbage; none anywhere."
    notebook = json.loads((ROOT / f"{chapter}.ipynb").read_text())
    for cell in notebook["cells"]:
        texts = ["".join(cell["source"])]
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")))
            texts += ["".join(v) for k, v in out.get("data", {}).items() if k.startswith("text/")]
        for text in texts:
            bad = CONTROL.search(text)
            assert bad is None, f"{chapter}, cell {cell.get('id')}: control character {bad.group()!r} in " \
                                f"{text[max(0, bad.start() - 30):bad.start() + 10]!r}"


def test_every_notebook_page_has_colab_binder_and_download_buttons(built_book):
    "The launch menu and the download button on every chapter page (from _config.yml's one repository url)."
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config["repository"]["url"].removeprefix("https://github.com/")
    branch = config["repository"]["branch"]
    for chapter in CHAPTERS:
        html = (built_book / f"{chapter}.html").read_text()
        notebook = f"{chapter}.ipynb"
        assert f"https://colab.research.google.com/github/{repo}/blob/{branch}/{notebook}" in html, chapter
        assert f"https://mybinder.org/v2/gh/{repo}/{branch}?urlpath=" in html and notebook in html, chapter
        assert f"_sources/{chapter}.ipynb" in html, f"{chapter}: no download link to its notebook"


def test_search_works_offline_in_a_browser(chromes, built_book):
    "The built search index answers a query in the browser, from the files alone (no server, no network)."
    chrome = chromes("light")
    chrome.open((built_book / "search.html").as_uri() + "?q=positional+encoding")
    try:
        chrome.wait_for(r"/found \d+ page/.test(document.body.innerText)", bool, timeout=30)
    except TimeoutError:
        pass                                                # the asserts say what is missing
    dom = chrome.evaluate("document.documentElement.outerHTML")
    found = re.search(r"found (\d+) page", dom)
    assert found and int(found.group(1)) > 0, "the search page found nothing (is searchindex.js there?)"
    hits = re.findall(r'<a href="(book/[^"#?]+\.html)', dom.split('id="search-results"', 1)[-1])
    assert "book/05_positions.html" in hits, f"the positions chapter is not among the hits: {hits[:10]}"


@pytest.mark.slow
def test_the_vega_bundle_follows_charts_not_the_source_that_shows_them(tmp_path):
    """A page that shows the renderer's template as highlighted source has no chart and gets no
    bundle, whatever the highlighter escapes; a page with a chart's HTML output gets it."""
    from transformer.figures.viz import _TEMPLATE, chart_html

    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
                                 "extensions = ['vega_offline']\n")
    code = "\n".join("   " + line for line in f'_TEMPLATE = """{_TEMPLATE}"""'.splitlines())
    chart = "\n".join("   " + line for line in chart_html({"mark": "point"}).splitlines())
    (src / "index.rst").write_text("Pages\n=====\n\n.. toctree::\n\n   source\n   chart\n")
    (src / "source.rst").write_text(f"Source\n======\n\n.. code-block:: python\n\n{code}\n\n"
                                    f"Also inline: ``<div class=\"book-chart\">``.\n")
    (src / "chart.rst").write_text(f"Chart\n=====\n\n.. raw:: html\n\n{chart}\n")
    out = tmp_path / "html"
    result = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", str(src), str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    bundle = re.compile(r'<script[^>]+src="[^"]*vega-bundle\.js')
    shown = (out / "source.html").read_text()
    assert 'class="book-chart"' in shown and not bundle.search(shown)   # the template, as it is...
    assert bundle.search((out / "chart.html").read_text())             # ...the bundle with a chart


def _sphinx(src: Path, out: Path, strict: bool = True) -> tuple[bool, str]:
    """An HTML build of `src` in this process, as `sphinx-build -E -q [-W]` would make it (a second of
    CPU less than a subprocess): whether it succeeded, and what it warned."""
    import io

    from sphinx.application import Sphinx
    from sphinx.errors import SphinxError
    from sphinx.util.docutils import docutils_namespace, patch_docutils

    warnings = io.StringIO()
    try:
        with patch_docutils(str(src)), docutils_namespace():
            app = Sphinx(str(src), str(src), str(out), str(out / ".doctrees"), "html", status=None,
                         warning=warnings, freshenv=True, warningiserror=strict)
            app.build()
    except SphinxError as e:
        return False, f"{warnings.getvalue()}{e}"
    return app.statuscode == 0, warnings.getvalue()


def _site(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file() and ".doctrees" not in p.parts}


@pytest.mark.slow
def test_the_lean_build_writes_the_same_site(tmp_path, monkeypatch):
    """book/_ext/lean_build.py (issue 40) changes no byte of the site: a small project whose table of
    contents has what Sphinx's `titles_only` treats specially (sections, a toctree inside a section, a
    hidden one, a page with `:tocdepth:`, an `only` directive, a caption, math in a title), built with
    and without it, asking for the global toctree with titles only (collapsed and not, with a maxdepth)
    and without; the reduction ran where it may and left alone the pages it must."""
    import pickle

    monkeypatch.syspath_prepend(str(ROOT / "book" / "_ext"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    (src / "_templates").mkdir(parents=True)
    (src / "_templates" / "layout.html").write_text(
        '{% extends "!layout.html" %}{% block footer %}'
        "<nav>{{ toctree(titles_only=True, includehidden=True, collapse=False) }}</nav>"
        "<nav>{{ toctree(titles_only=True, collapse=True, maxdepth=2) }}</nav>"
        "<nav>{{ toctree(includehidden=True, collapse=False) }}</nav>{{ super() }}{% endblock %}")
    (src / "index.rst").write_text("Book\n====\n\n.. toctree::\n   :caption: Part one\n\n   a\n   b\n\n"
                                   ".. toctree::\n   :hidden:\n\n   c\n")
    (src / "a.rst").write_text("A :math:`\\sqrt{d_k}`\n====================\n\nOne\n---\n\nText.\n\nDeep\n~~~~\n\n"
                               ".. toctree::\n\n   a1\n\nTwo\n---\n\nText.\n")
    (src / "a1.rst").write_text("A.1\n===\n\nInside\n------\n\nText.\n")
    (src / "b.rst").write_text(":tocdepth: 1\n\nB\n=\n\nOne\n---\n\n.. toctree::\n\n   b1\n")
    (src / "b1.rst").write_text("B.1\n===\n\nText.\n")
    (src / "c.rst").write_text("C\n=\n\nOne\n---\n\n.. only:: latex\n\n   .. toctree::\n\n      c1\n\n"
                               "Two\n---\n\nText.\n")
    (src / "c1.rst").write_text("C.1\n===\n\nText.\n")
    sites = {}
    for lean in (False, True):
        (src / "conf.py").write_text(f"extensions = {['lean_build'] if lean else []!r}\ntemplates_path = ['_templates']\n")
        ok, warnings = _sphinx(src, tmp_path / f"html-{lean}")
        assert ok, warnings[-3000:]
        sites[lean] = _site(tmp_path / f"html-{lean}")
    assert sites[True] == sites[False], [p for p in sites[False] if sites[True].get(p) != sites[False][p]]
    titles_only = sites[True]["b.html"].split(b"<nav>")[1]          # the first: titles only, not collapsed
    assert b'href="a1.html">A.1</a>' in titles_only and b"#one" not in titles_only and b"c1.html" not in titles_only

    import lean_build
    env = pickle.loads((tmp_path / "html-True" / ".doctrees" / "environment.pickle").read_bytes())
    tocs = lean_build.titles_only_tocs(env)
    size = lambda toc: sum(1 for _ in toc.findall())  # noqa: E731
    assert size(tocs["a"]) < size(env.tocs["a"]) and size(tocs["a1"]) < size(env.tocs["a1"])   # reduced...
    assert tocs["b"] is env.tocs["b"] and tocs["c"] is env.tocs["c"]                           # ...where it may


@pytest.mark.slow
def test_highlighting_is_kept_across_builds_but_never_a_warning(tmp_path, monkeypatch):
    """book/_ext/lean_build.py keeps each code block's highlighted HTML in the user's cache: a second build
    writes the same site from it, a changed block is highlighted afresh, and a block whose highlighting
    warned is not kept, so that `-W` fails on it in every build, the first or the next."""
    monkeypatch.syspath_prepend(str(ROOT / "book" / "_ext"))
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    (src / "conf.py").write_text("extensions = ['lean_build']\n")
    good = ("Code\n====\n\n.. code-block:: python\n\n   def f(x):\n       return x  # one\n\n"
            ".. code-block:: ipython3\n\n   %time f(1)\n")
    bad = "\n.. code-block:: json\n\n   {not json at all\n"

    def build(name, text, strict=True, where=cache):
        (src / "index.rst").write_text(text)
        monkeypatch.setenv("XDG_CACHE_HOME", str(where))
        ok, warnings = _sphinx(src, tmp_path / name, strict)
        return ok, warnings, _site(tmp_path / name)

    cold = build("cold", good, where=tmp_path / "elsewhere")
    assert cold[0], cold[1][-2000:]
    lenient = build("lenient", good + bad, strict=False)           # warns (no -W): the good blocks are kept
    assert lenient[0] and "Lexing literal_block" in lenient[1], lenient[1][-2000:]
    [kept] = (cache / "transformer-book").glob("highlight-*.json")
    assert len(json.loads(kept.read_text())) == 2                   # the two good blocks, not the bad one
    strict = build("strict", good + bad)                           # the bad one warns again: an error
    assert not strict[0] and "Lexing literal_block" in strict[1], strict[1][-2000:]
    warm = build("warm", good)
    assert warm[0] and warm[2] == cold[2]                           # the same site from the cache
    kept.write_text(json.dumps({k: "<pre>from the cache</pre>" for k in json.loads(kept.read_text())}))
    served = build("served", good)[2]["index.html"]                 # it did come from the cache...
    assert served.count(b"from the cache") == 2
    changed = build("changed", good.replace("# one", "# two"))[2]["index.html"]
    assert changed.count(b"from the cache") == 1 and b"two" in changed   # ...but not for a changed block


BLANKET = re.compile(r"""(simplefilter|filterwarnings)\(\s*["']ignore["']\s*\)""")


def test_no_code_silences_every_warning():
    """A cell that expects a warning names it; a blanket filter would hide the next library's new
    warning from nbval, and from the weekly run on the newest versions."""
    found = []
    for nb in sorted((ROOT / "book").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code" and BLANKET.search("".join(cell["source"])):
                found.append(f"{nb.name} cell {i}")
    for path in sorted([*(ROOT / "transformer").glob("*.py"), *(ROOT / "tests").glob("*.py")]):
        if path.name != "test_book.py" and BLANKET.search(path.read_text()):
            found.append(path.name)
    assert not found, f"blanket warning filters (name the warning instead): {found}"
    assert BLANKET.search('warnings.simplefilter("ignore")') and not BLANKET.search(
        'warnings.filterwarnings("ignore", message="IProgress not found")')


def test_the_translator_runs_in_a_browser_from_the_built_site(browser, built_book, tmp_path):
    """Issue 31, the built site served from localhost and opened in headless Chromium (through the
    DevTools protocol: tests/web_browser.py). Chapter 5, which has no widget, asks for nothing of
    the translator. The front page draws its box and loads nothing more until Translate is pressed.
    Chapter 11 with `?sentence=Ein Hund läuft im Schnee.` translates on its own: a translation with
    "dog" and a drawn cross-attention map (one cell per written piece and source piece). No request
    leaves localhost, and the runtime and the model come from the site."""
    from urllib.parse import quote

    import sentencepiece as spm
    from web_browser import STATE, Chrome, local, serve

    translator = "/_static/translator/"
    with serve(built_book) as (base, served), Chrome(browser, tmp_path) as chrome:
        chrome.open(f"{base}/book/05_positions.html")
        asked = chrome.requests()
        assert asked and not [u for u in asked if translator in u or u.endswith((".wasm", ".mjs", ".onnx"))], asked

        mark = len(chrome.events)
        chrome.open(f"{base}/book/index.html")
        assert chrome.wait_for(STATE, lambda s: s is not None) == "idle"
        assert chrome.evaluate("document.querySelector('.book-translator .bt-button').textContent") == "Translate"
        front = [u for u in chrome.requests(mark) if translator in u]
        assert [u.split(translator)[1] for u in front] == ["widget.css", "widget.js"], front

        sentence = "Ein Hund läuft im Schnee."
        chrome.open(f"{base}/book/11_traced.html?sentence={quote(sentence)}")
        state = chrome.wait_for(STATE, lambda s: s in ("done", "error"), timeout=120)
        widget = "document.querySelector('.book-translator')"
        assert state == "done", chrome.evaluate(f"{widget}.querySelector('.bt-status').textContent")
        assert chrome.evaluate(f"{widget}.querySelector('.bt-input').value") == sentence
        translation = chrome.evaluate(f"{widget}.querySelector('.bt-output').textContent")
        assert "dog" in translation, translation
        rows, columns, cells, darkest = chrome.evaluate(f"""(() => {{
            const map = {widget}.querySelector('.bt-map');
            const cells = [...map.querySelectorAll('svg rect.bt-cell')];
            return [Number(map.dataset.rows), Number(map.dataset.columns), cells.length,
                    Math.max(...cells.map((c) => Number(c.getAttribute('fill-opacity'))))]; }})()""")
        pieces = spm.SentencePieceProcessor(model_file=str(ROOT / "book" / "model" / "tokenizer.model")).encode(sentence)
        assert columns == len(pieces) + 1 and rows >= 3, (rows, columns, pieces)   # the source's pieces and EOS
        assert cells == rows * columns and darkest == 1, (rows, columns, cells, darkest)
        assert chrome.evaluate(f"{widget}.querySelectorAll('.bt-top tr').length") == 6   # a header and the top 5
        everything = chrome.requests()
    outside = [u for u in everything if not local(u)]
    assert not outside, f"requests that left localhost: {outside}"
    assert any(p.endswith("/ort/ort-wasm-simd-threaded.wasm") for p in served), "the runtime was not served by the site"
    assert any(p.endswith("/model/decoder.onnx") for p in served), "the model was not served by the site"


def test_the_vega_bundle_is_made_once_per_version_and_kept(tmp_path, monkeypatch):
    "book/_ext/vega_offline.py keeps vl-convert's bundle in the user's cache; without a cache it still builds."
    import vl_convert
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import vega_offline
    finally:
        sys.path.remove(str(ROOT / "book" / "_ext"))
    made = []
    monkeypatch.setattr(vl_convert, "javascript_bundle", lambda: made.append(1) or "bundle();")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert vega_offline._bundle() == vega_offline._bundle() == "bundle();" and len(made) == 1
    kept = list((tmp_path / "transformer-book").iterdir())
    assert [p.name for p in kept] == [f"vega-bundle-{vl_convert.__version__}.js"]   # no part file left
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "kept" / "file"))
    (tmp_path / "kept").write_text("a file where the cache's folder would go")
    assert vega_offline._bundle() == "bundle();" and len(made) == 2               # unwritable: made, not kept
