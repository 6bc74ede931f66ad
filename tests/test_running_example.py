"""The running example (issue 43): one sentence, Multi30k's test_2016_flickr line 15, carried
through chapters 1-11. Where a chapter types it out, the text must be that line; where it reads
it by index, the index must be 15; chapter 11 traces the same sentence."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INDEX = 15
TYPED = ["01_tokens", "02_attention", "07_masking", "09_decoding"]         # the sentence as a literal
BY_INDEX = ["08_training", "10_evaluation"]                                # test_2016_flickr")[15]
MAIN_LINE = [*TYPED, *BY_INDEX, "11_traced"]


def _code(chapter: str) -> str:
    cells = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


@pytest.fixture(scope="module")
def pair(multi30k):
    from transformer.data import load_multi30k
    return load_multi30k("de", "en", "test_2016_flickr", progress=False)[INDEX]


@pytest.mark.parametrize("chapter", TYPED)
def test_a_typed_running_example_is_test_2016_flickr_line_15(chapter, pair):
    source, reference = pair
    assert f'"{source}"' in _code(chapter), f"{chapter} does not type the running example: {source!r}"
    if chapter == "07_masking":                                              # the pair, both sides
        assert f'"{reference}"' in _code(chapter), f"{chapter}: the English side is not {reference!r}"


@pytest.mark.parametrize("chapter", BY_INDEX)
def test_an_indexed_running_example_is_line_15(chapter):
    indices = re.findall(r'"test_2016_flickr"\)\[(\d+)\]', _code(chapter))
    assert indices and set(indices) == {str(INDEX)}, f"{chapter} reads test_2016_flickr lines {indices}"


def test_chapter_11_traces_the_running_example(pair):
    cells = json.loads((ROOT / "book" / "11_traced.ipynb").read_text())["cells"]
    shown = "".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", []))
    assert f"source:    {pair[0]}" in shown, "chapter 11's trace does not start from the running example"


def test_the_chapters_that_carry_it_are_the_main_line():
    toc = (ROOT / "_toc.yml").read_text()
    assert all(f"book/{c}" in toc for c in MAIN_LINE)
