"""Exercises with tested solutions (issues 30 and 43): a chapter's Exercises section holds at least
three exercises, each with a solution whose code runs under nbval (a code cell `exN-solution`, not
`nbval-ignore-output`, asserting what it claims) and whose explanation is folded (cell
`exN-explanation`). Folded in every viewer: the solution cell carries the notebook format's
`"jupyter": {"source_hidden": true, "outputs_hidden": true}` (JupyterLab, VS Code) and the site's
`hide-cell` tag; the explanation is an HTML `<details><summary>Solution N: ...</summary>` block
whose markdown body has blank lines around it (so that every viewer parses it). The chapters listed
in EXERCISED have theirs; the list grows until it holds every main-line chapter."""
import json
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
EXERCISED = ["00_why_attention", "01_tokens", "02_attention", "03_scaling", "04_heads",
             "05_positions", "06_blocks", "07_masking", "07_1_model", "08_training",
             "09_decoding", "10_evaluation", "10_1_multi30k",
             "11_traced", "12_results"]


# <details><summary>Solution N: ...</summary>, a blank line, the body, a blank line, </details>
FOLD = re.compile(r"^<details><summary>Solution (\d+): [^\n]+</summary>\n\n(?!\n).*?\S\n\n</details>$",
                  re.M | re.S)


def cells(stem):
    return json.loads((BOOK / f"{stem}.ipynb").read_text())["cells"]


@pytest.mark.parametrize("stem", EXERCISED)
def test_a_chapter_has_three_exercises_with_solutions_that_run(stem):
    nb = cells(stem)
    ids = [c.get("id", "") for c in nb]
    solutions = [c for c in nb if re.fullmatch(r"ex\d+-solution", c.get("id", ""))]
    assert len(solutions) >= 3, f"{stem}: {len(solutions)} exercises with a solution"
    for c in solutions:
        tags = c["metadata"].get("tags", [])
        source = "".join(c["source"])
        assert c["cell_type"] == "code" and "hide-cell" in tags, (stem, c["id"], tags)
        hidden = c["metadata"].get("jupyter", {})
        assert hidden.get("source_hidden") is True and hidden.get("outputs_hidden") is True, (
            f"{stem} {c['id']}: a solution is collapsed in JupyterLab and VS Code too "
            "(python tests/plain_markup.py --write adds the metadata)")
        assert "nbval-ignore-output" not in tags and "nbval-skip" not in tags, (stem, c["id"])
        assert "assert" in source, f"{stem} {c['id']}: a solution asserts what it claims"
        explanation = c["id"].replace("solution", "explanation")
        assert explanation in ids, f"{stem}: {c['id']} has no {explanation}"
        text = "".join(nb[ids.index(explanation)]["source"])
        n = re.fullmatch(r"ex(\d+)-solution", c["id"]).group(1)
        assert FOLD.search(text) and FOLD.search(text).group(1) == n, (
            f"{stem} {explanation}: the explanation is folded in <details>, its summary "
            f"'Solution {n}: ...', with blank lines around its markdown body")
        assert "{dropdown}" not in text, f"{stem} {explanation}: a dropdown shows as text outside the site"
    headings = [line for c in nb if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines() if line.startswith("## ")]
    order = [h for h in headings if h in ("## Summary", "## Exercises", "## Questions")]
    assert order == ["## Summary", "## Exercises", "## Questions"], (stem, order)
