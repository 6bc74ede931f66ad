"""Issue 42: a main-line class is the paper's component. Chapters 1-10's exported code (the cells their own
notebooks write into `transformer/`, not what an appendix appends) holds no name that serves a later chapter,
the engine, DDP or a GPU: no `cache`, `arch`, `attend` seam, `check_ids`, `rank`/`world_size`, `decoding_state`.

The scan reads the generated modules, keeps the cells whose `# %% ../book/NN_...ipynb` header names a main-line
notebook, and collects their NAME tokens (so strings, docstrings and comments may mention the words).

And the main-line modules are the main line's alone: an appendix extends them by composition or subclass in a
module of its own, never by appending cells to one (which also put imports mid-file).
"""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_LINE = ["tokens", "attention", "heads", "positions", "blocks", "masking", "model", "training", "decoding",
             "evaluation"]
CORE = {"attention", "heads", "positions", "blocks", "masking", "model"}
FORBIDDEN = {"cache", "caches", "arch", "rank", "world_size", "check_ids", "decoding_state", "attend"}
HEADER = re.compile(r"^# %% (?:\.\./)+book/(\S+)\.ipynb", re.M)


def cells(text: str) -> list[tuple[str | None, str]]:
    "A generated module's cells as (notebook that wrote it, or None for nbdev's own, code)."
    parts = re.split(r"^(# %% .*)$", text, flags=re.M)
    out, notebook = [], None
    for part in parts[1:]:
        if part.startswith("# %%"):
            m = HEADER.match(part)
            notebook = m.group(1) if m else None
        else:
            out.append((notebook, part))
    return out


def is_main_line(notebook: str | None) -> bool:
    return bool(notebook) and notebook[:2].isdigit()


def module_text(module: str) -> str:
    return (ROOT / "transformer" / f"{module}.py").read_text(encoding="utf-8")


def main_line_code(module: str) -> str:
    "The cells of `module` written by main-line notebooks (numbered 00-12), joined."
    return "\n".join(code for notebook, code in cells(module_text(module)) if is_main_line(notebook))


def names(code: str) -> set[str]:
    return {t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type == tokenize.NAME}


def found() -> set[tuple[str, str]]:
    return {(m, n) for m in MAIN_LINE for n in names(main_line_code(m)) & FORBIDDEN}


def test_the_main_line_holds_no_later_chapters_hook():
    hits = sorted(found())
    assert not hits, f"hooks in chapters 1-10's code (module, name): {hits}"


def test_multi_head_attention_forward_has_no_branch():
    import ast
    import inspect

    from transformer.heads import MultiHeadAttention
    tree = ast.parse(inspect.getsource(MultiHeadAttention.forward).lstrip())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.Match, ast.For, ast.While))]


def test_the_six_core_modules_hold_at_most_450_lines():
    lines = sum((ROOT / "transformer" / f"{m}.py").read_text(encoding="utf-8").count("\n") for m in CORE)  # wc -l
    assert lines <= 450, f"the six core modules hold {lines} lines (issue 42: <= 450)"


def test_the_scan_sees_a_planted_hook():
    assert "cache" in names("def forward(self, x, cache=None):\n    return x\n")
    assert "cache" not in names('"a cache in a string"  # and a comment: cache\n')


def test_core_training_imports_chapter_19_1_only_for_a_decoder_only_model():
    """Issue 42: the engine's checkpoints and loop, and the train command and its parser, import `transformer.modern`
    inside a function, never at the top; the parser's choices of `--arch` are chapter 19.1's."""
    import ast

    from transformer.cli.commands import ARCHS
    from transformer.modern.gpt import ARCHS as chapter_19_1
    assert ARCHS == chapter_19_1
    for module in ("training", "engine/checkpoints", "engine/loop", "cli/train", "cli/commands"):
        tree = ast.parse((ROOT / "transformer" / f"{module}.py").read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        named = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in named if "modern" in m], f"{module} imports transformer.modern at the top"


def appended() -> set[tuple[str, str]]:
    "(module, notebook) for every cell of a main-line module that a notebook outside 00-12 wrote."
    return {(m, nb) for m in MAIN_LINE for nb, _ in cells(module_text(m)) if nb and not is_main_line(nb)}


def test_every_cell_of_a_main_line_module_comes_from_a_main_line_notebook():
    """No exception: the last, appendix D's `scaled_dot_product_attention` in `attention.py`, is chapter 3's cell
    now (issue 42), so chapter 4's `MultiHeadAttention` calls main-line code only."""
    found = appended()
    assert not found, f"appendices append to main-line modules: {sorted(found)}"


def late_imports(source: str) -> list[int]:
    "Lines of the top-level imports that come after the module's first function or class."
    body = ast.parse(source).body
    first = next((n.lineno for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))),
                 None)
    return [n.lineno for n in body if first and n.lineno > first and isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_module_imports_after_its_first_definition():
    late = {str(p.relative_to(ROOT)): lines for p in sorted((ROOT / "transformer").rglob("*.py"))
            if (lines := late_imports(p.read_text(encoding="utf-8")))}
    assert not late, f"imports mid-file (an appended cell's, or a cell's below a definition): {late}"


def test_the_module_checks_see_a_planted_appendix_cell_and_a_late_import():
    text = ("# %% ../book/02_attention.ipynb #c1\nimport math\n\n# %% auto #0\n__all__ = []\n\n"
            "# %% ../book/d_performance.ipynb #x\ndef f():\n    import torch\n    return math.pi\n\n"
            "# %% ../../book/a_data.ipynb #y\nfrom os import path\n")
    assert [nb for nb, _ in cells(text)] == ["02_attention", None, "d_performance", "a_data"]
    assert [nb for nb, _ in cells(text) if nb and not is_main_line(nb)] == ["d_performance", "a_data"]
    assert late_imports(text) == [13]          # the import inside f is lazy, and allowed


INT_IDIOM = re.compile(r"isinstance\((\w[\w.]*), bool\) or not isinstance\(\1, (?:int|\(int, float\))\)")


def test_the_int_idiom_is_written_once():
    """`is_int` and `is_number` (appendix A's module of checks, `transformer/data.py`) say "an int (or a float)
    and not a bool" once; no module spells the idiom out again (it stood in 26 places)."""
    spelled = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "transformer").rglob("*.py"))
               for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if INT_IDIOM.search(line)]
    assert not spelled, f"use transformer.data.is_int / is_number: {spelled}"
    assert INT_IDIOM.search("if isinstance(n, bool) or not isinstance(n, int) or n < 1:")          # the scan sees it
    assert INT_IDIOM.search("if isinstance(p, bool) or not isinstance(p, (int, float)):")
    from transformer.data import is_int, is_number
    assert [is_int(v) for v in (3, True, 3.0, "3")] == [True, False, False, False]
    assert [is_number(v) for v in (3, 0.5, False, None)] == [True, True, False, False]
