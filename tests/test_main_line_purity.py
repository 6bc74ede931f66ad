"""Issue 42: a main-line class is the paper's component. Chapters 1-10's exported code (the cells their own
notebooks write into `transformer/`, not what an appendix appends) holds no name that serves a later chapter,
the engine, DDP or a GPU: no `cache`, `arch`, `attend` seam, `check_ids`, `rank`/`world_size`, `decoding_state`.

The scan reads the generated modules, keeps the cells whose `# %% ../book/NN_...ipynb` header names a main-line
notebook, and collects their NAME tokens (so strings, docstrings and comments may mention the words).
"""
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_LINE = ["tokens", "attention", "heads", "positions", "blocks", "masking", "model", "training", "decoding",
             "evaluation"]
CORE = {"attention", "heads", "positions", "blocks", "masking", "model"}
FORBIDDEN = {"cache", "caches", "arch", "rank", "world_size", "check_ids", "decoding_state", "attend"}
HEADER = re.compile(r"^# %% \.\./book/(\S+)\.ipynb", re.M)


def main_line_code(module: str) -> str:
    "The cells of `module` written by main-line notebooks (numbered 00-12), joined."
    text = (ROOT / "transformer" / f"{module}.py").read_text(encoding="utf-8")
    parts = re.split(r"^(# %% .*)$", text, flags=re.M)
    keep, take = [], False
    for part in parts:
        if part.startswith("# %%"):
            m = HEADER.match(part)
            take = bool(m) and m.group(1)[:2].isdigit()
        elif take:
            keep.append(part)
    return "\n".join(keep)


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
    "Issue 42: the engine's checkpoints and loop import `transformer.modern` inside a function, never at the top."
    import ast
    for module in ("training", "engine/checkpoints", "engine/loop"):
        tree = ast.parse((ROOT / "transformer" / f"{module}.py").read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        named = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in named if "modern" in m], f"{module} imports transformer.modern at the top"
