"""The main line (chapters 0-12, the TOC's parts before "The paper's claims, measured") is read in an
afternoon: issue 30 asks for at most 22,000 words of prose and 3,000 lines of code. This test counts
both, the same way as the closing notes do, and holds each to a budget that may only go down: the
main line cannot grow while it is cut towards the goal. When a change cuts it, lower the budget to the
new count (the failure message prints it).

Counted: words of markdown cells (display math `$$...$$`, HTML tags and comments left out: a
glued number `<span data-glue="x:.2f">0.13</span>` is one word, a `<details>` fold none; inline
math and code spans counted as the words they contain), and non-blank lines of code cells, `#|`
directives left out, and the install cell (the same hidden cell atop every notebook, which
tests/test_install_cell.py holds) left out."""
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GOAL_WORDS, GOAL_LINES = 22_000, 3_000           # issue 30's goal for chapters 0-12
BUDGET_WORDS, BUDGET_LINES = 21_853, 2_828       # the count after issue 43 (one running example through chapters 1-11, chapter 12 a lesson, chapter 0 on the task, one notation); lower it as chapters are cut
# raised once, by issue 42, from 21,838 / 2,911: chapter 3 now writes `scaled_dot_product_attention` (moved from
# appendix D, which proves and times it), +18 words and +29 code lines there (the function, a check against
# chapter 2's `attention`, two imports, a summary line); the budget is the new count, not the old one plus that
# and by one code line for issue 42's one beam default: chapter 2's greedy attention map now says beam_size=1;
# lowered to 2,918 lines when chapter 8's TrainConfig lost the engine's fields (appendix E.2's RunConfig), then
# to 2,828 when the install cell left the count (its 6 lines in each of the 15 notebooks: it grew to clone the
# repository on Colab, and it is no chapter's code)
FIRST_LATER_PART = "The paper's claims, measured"
# the HTML that markdown cells use as markup (glue spans, folds, a title's math), not as words
TAG = re.compile(r"</?(?:span|details|summary|i|b|em|strong|sup|sub|code|br|div|p)\b[^<>]*>")


def main_line() -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = []
    for part in toc["parts"]:
        if part["caption"] == FIRST_LATER_PART:
            break
        for chapter in part["chapters"]:
            files += [chapter["file"]] + [s["file"] for s in chapter.get("sections", [])]
    return [ROOT / f"{f}.ipynb" for f in files]


def count(path: Path) -> tuple[int, int]:
    cells = json.loads(path.read_text())["cells"]
    words = lines = 0
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            text = re.sub(r"\$\$.*?\$\$|<!--.*?-->", " ", text, flags=re.S)
            words += len(TAG.sub("", text).split())
        elif cell["cell_type"] == "code" and cell.get("id") != "install":
            lines += sum(1 for line in text.splitlines()
                         if line.strip() and not line.lstrip().startswith("#|"))
    return words, lines


def test_the_main_line_is_the_toc_before_the_later_parts():
    names = [p.stem for p in main_line()]
    assert names[0] == "00_why_attention" and "12_results" in names and "13_claims" not in names
    assert all(p.exists() for p in main_line())


def test_the_main_line_does_not_grow():
    per = {p.stem: count(p) for p in main_line()}
    words, lines = (sum(w for w, _ in per.values()), sum(n for _, n in per.values()))
    table = "\n".join(f"  {name:<20} {w:>6} words {n:>5} code lines" for name, (w, n) in per.items())
    assert words <= BUDGET_WORDS and lines <= BUDGET_LINES, (
        f"the main line holds {words:,} words and {lines:,} code lines, over the budget of "
        f"{BUDGET_WORDS:,} / {BUDGET_LINES:,} (goal {GOAL_WORDS:,} / {GOAL_LINES:,}):\n{table}")


def test_the_counter_counts_what_it_says(tmp_path):
    nb = {"cells": [
        {"cell_type": "markdown", "source": ["Two words $x$\n", "$$\\sum_k q_k$$\n",
                                             '<span data-glue="n">3</span> <!-- a note -->\n',
                                             "<details><summary>Solution</summary>\n"], "metadata": {}},
        {"cell_type": "code", "source": ["#| export\n", "x = 1\n", "\n", "y = 2  # two\n"], "metadata": {},
         "outputs": [], "execution_count": None}]}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    assert count(path) == (5, 2)
