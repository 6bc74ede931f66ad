"""One notation in the whole book (CONTRIBUTING, "Notation"): the markdown of every notebook writes
the symbols of the table one way. A planted drift shows the check sees each form it refuses."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
# the refused spelling -> what the table writes instead
REFUSED = {
    r"d_\{model\}|d_\{\\text\{model\}\}|d_\\mathrm\{model\}": r"$d_\text{model}$",
    r"d_\{\\text\{ff\}\}|d_\\text\{ff\}|d_\{FF\}": r"$d_{ff}$",
    r"\\beta(?![_\w])": r"$\beta_1$, $\beta_2$ (Adam's only; LayerNorm's shift is $b$)",
    r"\\gamma(?!\w)": r"$g$ (LayerNorm's and RMSNorm's gain)",
}


def drifts(markdown: str) -> list[str]:
    "Each refused spelling in a markdown text, with the one the table writes."
    return [f"{m.group()!r} (write {instead})" for pattern, instead in REFUSED.items()
            for m in re.finditer(pattern, markdown)]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_markdown_follows_the_table_of_symbols(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    found = [f"cell {i}: {d}" for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             for d in drifts("".join(c["source"]))]
    assert not found, f"{notebook.name}: {found}"


def test_the_check_sees_each_refused_form():
    for planted in (r"$d_{model}$", r"$d_{\text{model}}$", r"$d_\mathrm{model}$", r"$d_\text{ff}$",
                    r"Adam's $\beta$", r"LayerNorm's $\gamma$"):
        assert drifts(planted), planted
    assert not drifts(r"$d_\text{model}$, $d_{ff}$, $\beta_1$, $\beta_2$, $g$, $b$")
