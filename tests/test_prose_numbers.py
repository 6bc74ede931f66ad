"""Every number in the prose comes from the code (issues 30 and 43).

A number a notebook computes reaches its text through a glue record: the code cell calls myst-nb's
`glue("name", value, display=False)`, which stores the value as one more output of the cell, a
`display_data` whose only MIME type is `application/papermill.record/text/plain` (the `repr` of the
value). The markdown holds the number as plain text, in a span that names the record and the
format: `<span data-glue="name:.2f">0.13</span>` (another notebook's record:
`other.ipynb::name:.2f`). Every viewer shows the number (the span is invisible), and
`python tests/plain_markup.py --write` rewrites it from the stored record after a notebook has been
re-executed. So:

- **The text equals the stored record.** The fast checks below fail when a number in a span
  differs from its stored value formatted, when a span names a value no cell glues, or when a
  myst-nb `{glue}` role (which only the built site renders) is left; planted drifts show each.
- **nbval compares the glue records.** nbval skips only a few keys (`metadata`, `traceback`, ...)
  and compares every MIME type of every output, `application/papermill.record/text/plain`
  included, after `book/sanitize.cfg` (floats cut to five decimals). A stored glue value that a
  fresh run does not reproduce fails `pytest book/NN.ipynb` like any other output: the tests
  marked slow below plant such a drift, in a small notebook and in a copy of chapter 7.1, and
  watch the suite's own nbval command fail on it (and pass on the untouched copy).
- **Except in a cell tagged `nbval-ignore-output`.** There nbval compares nothing, glue records
  included (a test below shows that too): the text still agrees with the stored run (both are
  checked against it), and the claim the text makes from it must be asserted in the cell
  (CONTRIBUTING, "Notebook rules").

The chapters whose prose has been moved to glue (`GLUED`) also hold no decimal or
thousands-grouped number typed by hand outside glue spans, math, code and the cited facts listed
for them (inline math included).
"""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plain_markup import ROLE, SPAN, Records, glued, number_problems, source, text_of

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
GLUE = "application/papermill.record/"

# Chapters whose prose takes every computed number from glue (or from an assert beside it).
# A number still typed in their text must be a cited fact, listed here with its source.
GLUED = {
    "00_why_attention": {},
    "07_1_model": {
        "0.1": "P_drop of the paper's base model (Table 3)",
        "0.3": "P_drop of the paper's big model (Table 3)",
        "37,000": "the paper's shared byte-pair vocabulary (section 5.1)",
        "29,000": "Multi30k's training pairs (Elliott et al., 2016)",
    },
    "09_decoding": {
        "0.6": "the paper's length penalty alpha (section 6.1)",
        "0.3": "the example of the length-penalty chart: -0.3 nats per token, a constant",
    },
    "11_traced": {"0.6": "the paper's length penalty alpha (section 6.1)"},
    "12_results": {
        "29,000": "Multi30k's training pairs (Elliott et al., 2016)",
        "27.3": "the paper's base model on newstest2014 (Table 2)",
        "4.5": "WMT 2014 English-German: 4.5 million sentence pairs (the paper's section 5.1)",
        "100,000": "the base model's training steps (the paper's section 5.2)",
        "300,000": "the big model's training steps (the paper's section 5.2)",
        "3.5": "the big model's training days (the paper's section 5.2)",
        "9.5": "the P100's assumed sustained TFLOP/s (Table 2's footnote)",
        "41.0": "the big model's En-Fr BLEU in the early versions' abstract",
        "41.8": "the big model's En-Fr BLEU in Table 2 (arXiv version)",
    },
}
# a decimal (8.9, 0.85, 63.1M) or a thousands-grouped integer (6,463)
NUMBER = re.compile(r"(?<![\w.,])(?:\d+\.\d+|\d{1,3}(?:,\d{3})+)(?![\w.,]*\d)")
# ... that is not a name: "section 3.4", "chapter 7.1", "*11.3*", "arXiv:1706.03762"
NAMED = re.compile(r"(?i)(?:sections?|chapters?|appendix|table|figure|equation|eq\.|arxiv:)"
                   r"\s*$|\*$")


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_prose_numbers_equal_their_glue_records(path):
    """Every number in a glue span equals its stored value formatted, every span names a value
    glued once (in this notebook or the one its `path::` names), and no myst-nb glue role is
    left. A failure lists each; `python tests/plain_markup.py --write` rewrites the numbers."""
    nb = read(path)
    twice = sorted(name for name, where in glued(nb).items() if len(where) > 1)
    assert not twice, f"{path.name}: glued more than once: {twice}"
    problems = number_problems(nb, path.stem)
    assert not problems, (f"{path.name} (python tests/plain_markup.py --write):\n"
                          + "\n".join(problems))


def spans(nb: dict) -> list[tuple[dict, re.Match]]:
    return [(cell, m) for cell in nb["cells"] if cell["cell_type"] == "markdown"
            for m in SPAN.finditer(source(cell))]


def test_a_planted_drift_fails():
    """Chapter 11 in memory: it checks clean; with a stored value changed (a re-executed
    notebook whose prose was not rewritten), with a number in the text changed (a hand edit),
    with a span naming no value or a role left, it does not, and each is named."""
    nb = read(BOOK / "11_traced.ipynb")
    assert number_problems(nb, "11_traced") == []
    cell, m = next((c, m) for c, m in spans(nb) if m.group(1) == "emb_min:.2f")
    # the stored record drifts: 1.25 becomes 1.5
    drifted = copy.deepcopy(nb)
    for c in drifted["cells"]:
        for output in c.get("outputs", []):
            if output.get("metadata", {}).get("scrapbook", {}).get("name") == "emb_min":
                key = output["metadata"]["scrapbook"]["mime_prefix"] + "text/plain"
                output["data"][key] = "1.5"
    assert any("'emb_min:.2f' reads '1.25', its stored value formats as '1.50'" in p
               for p in number_problems(drifted, "11_traced")), number_problems(drifted, "11_traced")
    # the text drifts, an unknown name, a role left
    for old, new, expect in [
            (m.group(0), '<span data-glue="emb_min:.2f">1.26</span>', "reads '1.26'"),
            (m.group(0), '<span data-glue="emb_minimum:.2f">1.25</span>', "no value named 'emb_minimum'"),
            (m.group(0), "{glue:text}`emb_min:.2f`", "glue role"),
            (m.group(0), '<span data-glue="emb_min:.2q">1.25</span>', "'.2q' does not apply")]:
        planted = copy.deepcopy(nb)
        c = next(c for c in planted["cells"] if c.get("id") == cell.get("id"))
        c["source"] = source(c).replace(old, new)
        found = number_problems(planted, "11_traced")
        assert any(expect in p for p in found), (new, found)


def test_a_span_reads_another_notebooks_record():
    "`other.ipynb::name` reads the record stored in that notebook, as myst-nb's glue did."
    vocab = Records().value("vocab:,", "11_traced")
    nb = read(BOOK / "00_why_attention.ipynb")
    cell = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    cell["source"] = source(cell) + f'\n\n<span data-glue="11_traced.ipynb::vocab:,">{vocab}</span>'
    assert number_problems(nb, "00_why_attention") == []
    cell["source"] = source(cell).replace(f">{vocab}<", ">1<")
    assert any("reads '1'" in p for p in number_problems(nb, "00_why_attention"))


def prose(text: str) -> str:
    """Markdown without display math, code, glue spans and roles, links' targets and HTML comments
    (inline math stays: `$-1.73$` is a number typed by hand too)."""
    for pattern in (r"```.*?```", r"\$\$.*?\$\$", SPAN.pattern, ROLE.pattern,
                    r"`[^`\n]+`", r"\]\([^)]*\)", r"<!--.*?-->", r"https?://\S+"):
        text = re.sub(pattern, " ", text, flags=re.S)
    return text


def hand_typed(nb: dict, allowed: dict[str, str]) -> list[str]:
    "Numbers in the text that are neither glued, nor names of sections, nor listed as facts."
    found = []
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or text.startswith("## References"):
            continue
        for line in prose(text).splitlines():
            if line.lstrip().startswith("#"):                   # a title: "## 11.2 ..."
                continue
            for m in NUMBER.finditer(line):
                if m.group() not in allowed and not NAMED.search(line[:m.start()]):
                    found.append(f"cell {cell.get('id')}: {m.group()!r} in {line.strip()!r}")
    return found


@pytest.mark.parametrize("stem", sorted(GLUED))
def test_no_hand_typed_numbers(stem):
    """A chapter converted to glue types no computed number by hand: every decimal and every
    thousands-grouped integer left in its text is a cited fact (GLUED names each one)."""
    found = hand_typed(read(BOOK / f"{stem}.ipynb"), GLUED[stem])
    assert not found, ("numbers typed by hand (glue them, or list a cited fact in GLUED):\n"
                       + "\n".join(found))


def test_hand_typed_number_is_caught():
    "The check above catches the drift issue 30 found: a ratio typed from an earlier run."
    nb = read(BOOK / "00_why_attention.ipynb")
    assert hand_typed(nb, GLUED["00_why_attention"]) == []
    cell, m = next((c, m) for c, m in spans(nb) if m.group(1) == "gru_growth:.1f")
    cell["source"] = source(cell).replace(m.group(0), "8.9")
    assert any("'8.9'" in f for f in hand_typed(nb, GLUED["00_why_attention"]))


# --- nbval on planted drifts: the suite's own notebook check, run on a copy ---

def nbval(folder: Path) -> dict[tuple[str, str], str | None]:
    """`pytest --nbval` with the repository's settings (pyproject.toml's addopts: --nbval
    --nbval-current-env --nbval-sanitize-with book/sanitize.cfg), as `pytest book/` runs every
    chapter, once on every notebook in `folder`: {(file name, "Cell N"): None if that cell passed,
    else what nbval said}."""
    import xml.etree.ElementTree as ET
    report = folder / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-n", "0",
                    "--rootdir", str(folder), "-q", f"--junitxml={report}", str(folder)],
                   cwd=ROOT, capture_output=True, text=True, timeout=600,
                   env=os.environ | {"TRANSFORMER_SEED_SHIFT": "0"})   # strict: the seeds that wrote the outputs
    results = {}
    for case in ET.parse(report).iter("testcase"):
        problems = [*case.iter("failure"), *case.iter("error")]
        results[case.get("classname"), case.get("name")] = "".join(
            (p.get("message") or "") + (p.text or "") for p in problems) or None
    return results


SMALL = ["ok", "drift", "same", "ignored"]      # the cells of the small notebook, in order


def small_notebook() -> dict:
    """A chapter in miniature, one cell a case: each cell glues a value, and the text quotes it.
    The last cell is tagged nbval-ignore-output. Its stored outputs are written here as a run
    writes them (what the cell prints, then myst-nb's glue record), not by a kernel of their own:
    nbval runs the cells in a fresh kernel, and the untouched case ("ok") passing shows that they
    are exactly what that run writes."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("from myst_nb import glue", execution_count=1)]
    for i, name in enumerate(SMALL, start=2):
        nb.cells.append(nbformat.v4.new_code_cell(
            f"ratio_{name} = 2 ** 0.5\nprint(f'ratio {{ratio_{name}:.2f}}')\n"
            f"glue('ratio_{name}', ratio_{name}, display=False)", execution_count=i,
            metadata={"tags": ["nbval-ignore-output"]} if name == "ignored" else {},
            outputs=[nbformat.v4.new_output("stream", name="stdout", text=f"ratio {2 ** 0.5:.2f}\n"),
                     nbformat.v4.new_output("display_data", data={GLUE + "text/plain": repr(2 ** 0.5)},
                                            metadata={"scrapbook": {"mime_prefix": GLUE,
                                                                    "name": f"ratio_{name}"}})]))
        nb.cells.append(nbformat.v4.new_markdown_cell(
            f'The ratio is <span data-glue="ratio_{name}:.2f">1.41</span>.'))
    nbformat.validate(nb)
    return json.loads(nbformat.writes(nb))


def plant(nb: dict, name: str, value: str) -> dict:
    "The notebook with the stored glue record `name` changed to `value` (its repr)."
    nb = copy.deepcopy(nb)
    records = [o for c in nb["cells"] for o in c.get("outputs", [])
               if o.get("metadata", {}).get("scrapbook", {}).get("name") == name]
    assert len(records) == 1, name
    record = records[0]
    key = record["metadata"]["scrapbook"]["mime_prefix"] + "text/plain"
    assert text_of(record["data"]) != value
    record["data"][key] = value
    return nb


def write(nb: dict, path: Path) -> Path:
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, str | None]:
    """One nbval run over every planted drift below (one pytest process; two kernels: the small
    notebook, whose cells hold one case each, and a cut copy of chapter 7.1):
    {case: None if its cell passed, else what nbval said}."""
    folder = tmp_path_factory.mktemp("planted")
    small = plant(small_notebook(), "ratio_drift", "1.5")
    # the five decimals of book/sanitize.cfg: a difference in the sixth is rounding, not drift
    small = plant(small, "ratio_same", "1.4142139")
    small = plant(small, "ratio_ignored", "1.5")
    write(small, folder / "small.ipynb")
    nb = read(BOOK / "07_1_model.ipynb")
    names = glued(nb)
    assert "base_params" in names
    cell_id = names["base_params"][0][0]
    index = next(i for i, c in enumerate(nb["cells"]) if c.get("id") == cell_id)
    cut = copy.deepcopy(nb)
    cut["cells"] = cut["cells"][:index + 1]              # nothing after it is needed
    code_cells = sum(c["cell_type"] == "code" for c in cut["cells"])
    write(plant(cut, "base_params", "65000000"), folder / "model_drift.ipynb")
    results = nbval(folder)
    cases = {name: results["small.ipynb", f"Cell {i + 1}"] for i, name in enumerate(SMALL)}
    cases["model_before"] = "".join(results["model_drift.ipynb", f"Cell {i}"] or ""
                                    for i in range(code_cells - 1)) or None
    cases["model_drift"] = results["model_drift.ipynb", f"Cell {code_cells - 1}"]
    return cases


@pytest.mark.slow
def test_nbval_catches_a_drifted_glue_value(planted):
    """A glued value whose stored record a fresh run does not reproduce fails nbval; the same
    cell unchanged passes. The prose quotes that record, so the drift the issue found (text
    that disagrees with the code) fails the suite."""
    assert planted["ok"] is None, planted["ok"]
    drift = planted["drift"]
    assert drift is not None and GLUE + "text/plain" in drift and "1.5" in drift, drift
    assert planted["same"] is None, planted["same"]


@pytest.mark.slow
def test_nbval_ignores_glue_in_an_ignored_cell(planted):
    """What nbval does not see: in a cell tagged nbval-ignore-output a drifted glue record
    passes. Such a cell asserts the claim its text makes (CONTRIBUTING)."""
    assert planted["ignored"] is None, planted["ignored"]


@pytest.mark.slow
def test_nbval_catches_drift_in_a_chapter(planted):
    """The same on a real chapter: in a copy of 7.1 with the stored parameter count of the base
    model (which its text quotes) changed, nbval fails at that cell and passes every cell before
    it (the whole chapter unchanged passes: `pytest book/07_1_model.ipynb`)."""
    assert planted["model_before"] is None, planted["model_before"]
    drift = planted["model_drift"]
    assert drift is not None and "65000000" in drift and GLUE in drift, drift
