"""Every number in the prose comes from the code (issue 30).

A number a notebook computes reaches its text through myst-nb's glue: the code cell calls
`glue("name", value, display=False)` and the markdown writes `` {glue:text}`name:.2f` ``. The glued
value is stored as one more output of the cell, a `display_data` whose only MIME type is
`application/papermill.record/text/plain` (the `repr` of the value), and the book renders the text
from that stored output. So the text cannot disagree with the outputs it stands beside, and:

- **nbval compares the glue records.** nbval skips only a few keys (`metadata`, `traceback`, ...)
  and compares every MIME type of every output, `application/papermill.record/text/plain`
  included, after `book/sanitize.cfg` (floats cut to five decimals). A stored glue value that a
  fresh run does not reproduce fails `pytest book/NN.ipynb` like any other output: the tests
  marked slow below plant such a drift, in a small notebook and in a copy of chapter 7.1, and
  watch the suite's own nbval command fail on it (and pass on the untouched copy).
- **Except in a cell tagged `nbval-ignore-output`.** There nbval compares nothing, glue records
  included (a test below shows that too): the text still agrees with the stored run (both are
  read from it), and the claim the text makes from it must be asserted in the cell (CONTRIBUTING,
  "Notebook rules").

The fast checks read the stored notebooks only: every `{glue...}` reference in book/*.ipynb names a
value glued in that notebook (or in the notebook its `path::name` names) and its format applies
to the stored value; no name is glued twice; and the chapters whose prose has been moved to glue
(`GLUED`) hold no decimal or thousands-grouped number typed by hand outside math, code and the
cited facts listed for them (inline math included).
"""
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from myst_nb.core.variables import format_plain_text

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
GLUE = "application/papermill.record/"
# {glue}`name`, {glue:text}`name:.2f`, {glue:md}`path::name` ...
ROLE = re.compile(r"\{glue(?::(\w+))?\}`([^`]+)`")
# ```{glue:figure} name, :::{glue:math} name, ```{glue} name
DIRECTIVE = re.compile(r"^\s*(?:`{3,}|:{3,})\{glue(?::(\w+))?\}\s+(\S+)", re.M)

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
        "0.1": "dropout of runs (asserted in cell r050a)",
        "0.2": "subword dropout of runs (asserted in cell r046)",
        "0.3": "dropout of runs (asserted in cell r050a)",
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


def glued(nb: dict) -> dict[str, list[tuple[str, dict]]]:
    "name -> [(cell id, stored MIME bundle without the glue prefix)], in the order glued."
    out: dict[str, list] = {}
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get("scrapbook")
            if output.get("output_type") == "display_data" and meta:
                prefix = meta.get("mime_prefix", "")
                data = {k[len(prefix):]: v for k, v in output["data"].items()
                        if k.startswith(prefix)}
                out.setdefault(meta["name"], []).append((cell.get("id"), data))
    return out


def references(nb: dict) -> list[tuple[str, str, str, str, str]]:
    "(cell id, kind, notebook stem or '', name, format spec) of every glue reference."
    refs = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        found = [(kind, body) for kind, body in ROLE.findall(text)]
        found += [(kind or "any", body) for kind, body in DIRECTIVE.findall(text)]
        for kind, body in found:
            doc, _, key = body.rpartition("::")
            name, _, spec = key.partition(":")
            refs.append((cell.get("id"), kind or "any", Path(doc).stem, name, spec))
    return refs


def text_of(data: dict) -> str:
    value = data.get("text/plain", "")
    return "".join(value) if isinstance(value, list) else value


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_glue_references_resolve(path):
    """Every {glue} reference names a value glued once, and a text reference's format applies
    to the stored value (what the book build would print)."""
    nb = read(path)
    values = glued(nb)
    twice = sorted(name for name, where in values.items() if len(where) > 1)
    assert not twice, f"{path.name}: glued more than once: {twice}"
    problems = []
    for cell_id, kind, doc, name, spec in references(nb):
        source = values if not doc else glued(read(BOOK / f"{doc}.ipynb"))
        if name not in source:
            problems.append(f"cell {cell_id}: {{glue:{kind}}} names {name!r}, which "
                            f"{doc or path.stem} never glues")
            continue
        data = source[name][0][1]
        if kind in ("text", "any", "") and spec:
            if "text/plain" not in data:
                problems.append(f"cell {cell_id}: {name!r} has no text/plain to format")
                continue
            try:
                format_plain_text(text_of(data), spec)
            except (ValueError, TypeError) as e:
                problems.append(f"cell {cell_id}: {name}:{spec} does not apply to the "
                                f"stored {text_of(data)!r}: {e}")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def prose(text: str) -> str:
    """Markdown without display math, code, glue references, links' targets and HTML comments
    (inline math stays: `$-1.73$` is a number typed by hand too)."""
    for pattern in (r"```.*?```", r"\$\$.*?\$\$", ROLE.pattern,
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
    cell = next(c for c in nb["cells"] if c["cell_type"] == "markdown"
                and "{glue:text}`gru_growth:.1f`" in "".join(c["source"]))
    cell["source"] = "".join(cell["source"]).replace("{glue:text}`gru_growth:.1f`", "8.9")
    assert any("'8.9'" in f for f in hand_typed(nb, GLUED["00_why_attention"]))
    # a glue reference to a name no cell glues is caught as well
    cell["source"] += "\n{glue:text}`no_such_value:.1f`"
    assert ("no_such_value", "") in {(name, doc) for _, _, doc, name, _ in references(nb)}
    assert "no_such_value" not in glued(nb)


# --- nbval on planted drifts: the suite's own notebook check, run on a copy ---

def nbval(folder: Path) -> dict[str, str | None]:
    """`pytest --nbval` with the repository's settings (pyproject.toml's addopts: --nbval
    --nbval-current-env --nbval-sanitize-with book/sanitize.cfg), as `pytest book/` runs every
    chapter, once on every notebook in `folder`: {file name: None if it passed, else what nbval said}."""
    import xml.etree.ElementTree as ET
    report = folder / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-n", "0",
                    "--rootdir", str(folder), "-q", f"--junitxml={report}", str(folder)],
                   cwd=ROOT, capture_output=True, text=True, timeout=600)
    results = {p.name: None for p in folder.glob("*.ipynb")}
    for case in ET.parse(report).iter("testcase"):
        for problem in [*case.iter("failure"), *case.iter("error")]:
            name = case.get("classname")                         # the notebook's file name
            results[name] = (results[name] or "") + (problem.get("message") or "") + (problem.text or "")
    return results


def small_notebook(tags: list[str]) -> dict:
    "A chapter in miniature: a glued value, and the text that quotes it."
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("from myst_nb import glue\n\n"
                                  "ratio = 2 ** 0.5\n"
                                  "print(f'ratio {ratio:.2f}')\n"
                                  "glue('ratio', ratio, display=False)",
                                  metadata={"tags": tags} if tags else {}),
        nbformat.v4.new_markdown_cell("The ratio is {glue:text}`ratio:.2f`."),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
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
    """One nbval run over every planted drift below and its untouched copy (one pytest process
    and one kernel start instead of one per notebook)."""
    folder = tmp_path_factory.mktemp("planted")
    small, ignored = small_notebook(tags=[]), small_notebook(tags=["nbval-ignore-output"])
    write(small, folder / "ok.ipynb")
    write(plant(small, "ratio", "1.5"), folder / "drift.ipynb")
    # the five decimals of book/sanitize.cfg: a difference in the sixth is rounding, not drift
    write(plant(small, "ratio", "1.4142139"), folder / "same.ipynb")
    write(plant(ignored, "ratio", "1.5"), folder / "ignored.ipynb")
    nb = read(BOOK / "07_1_model.ipynb")
    names = glued(nb)
    assert "base_params" in names
    cell_id = names["base_params"][0][0]
    index = next(i for i, c in enumerate(nb["cells"]) if c.get("id") == cell_id)
    cut = copy.deepcopy(nb)
    cut["cells"] = cut["cells"][:index + 1]              # nothing after it is needed
    write(cut, folder / "model_ok.ipynb")
    write(plant(cut, "base_params", "65000000"), folder / "model_drift.ipynb")
    return nbval(folder)


@pytest.mark.slow
def test_nbval_catches_a_drifted_glue_value(planted):
    """A glued value whose stored record a fresh run does not reproduce fails nbval; the same
    notebook unchanged passes. The prose quotes that record, so the drift the issue found (text
    that disagrees with the code) fails the suite."""
    assert planted["ok.ipynb"] is None, planted["ok.ipynb"]
    drift = planted["drift.ipynb"]
    assert drift is not None and GLUE + "text/plain" in drift and "1.5" in drift, drift
    assert planted["same.ipynb"] is None, planted["same.ipynb"]


@pytest.mark.slow
def test_nbval_ignores_glue_in_an_ignored_cell(planted):
    """What nbval does not see: in a cell tagged nbval-ignore-output a drifted glue record
    passes. Such a cell asserts the claim its text makes (CONTRIBUTING)."""
    assert planted["ignored.ipynb"] is None, planted["ignored.ipynb"]


@pytest.mark.slow
def test_nbval_catches_drift_in_a_chapter(planted):
    """The same on a real chapter: a copy of 7.1 passes nbval, and with the stored parameter
    count of the base model (which its text quotes) changed it fails, at that cell."""
    assert planted["model_ok.ipynb"] is None, planted["model_ok.ipynb"]
    drift = planted["model_drift.ipynb"]
    assert drift is not None and "65000000" in drift and GLUE in drift, drift
