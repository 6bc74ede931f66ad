"""The front page opens with what the reader will build (issue 43): one German sentence, what the
shipped model writes for it, a human translation, and the model top down. The sentences are stored
data, not typed from memory: this test reads them back from the test set and from the shipped model's
own translation of it (`book/model/test_2016_flickr.beam4.en`, written by `evaluate`)."""
import re
from pathlib import Path

from test_plain_markup import raw_myst

from transformer.data import load_multi30k

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "book" / "index.md"
ROW = re.compile(r"^\| \*\*(German|the model writes|a person wrote)\*\* \| (.+?) \|$", re.M)


def example() -> dict[str, str]:
    return dict(ROW.findall(INDEX.read_text(encoding="utf-8")))


def test_the_example_is_the_shipped_models_stored_translation():
    rows = example()
    assert set(rows) == {"German", "the model writes", "a person wrote"}, rows
    test = load_multi30k("de", "en", "test_2016_flickr", download=False)
    written = (ROOT / "book" / "model" / "test_2016_flickr.beam4.en").read_text(encoding="utf-8").splitlines()
    assert len(written) == len(test)
    number = next(i for i, (de, _) in enumerate(test) if de == rows["German"])   # a test sentence
    assert rows["the model writes"] == written[number]
    assert rows["a person wrote"] == test[number][1]
    assert f"line {number + 1} of" in INDEX.read_text(encoding="utf-8")       # the comment says where


def test_the_example_and_the_picture_come_first():
    "The first screen: the example, the translator box and the picture, before any table."
    text = INDEX.read_text(encoding="utf-8")
    first_table = text.index("| chapter |")
    for part in ("| **German** |", 'class="book-translator"', "(_static/model_top_down.svg)"):
        assert text.index(part) < first_table, part
    svg = (ROOT / "book" / "_static" / "model_top_down.svg").read_text(encoding="utf-8")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    # every layer is labelled with the chapter that builds it
    for chapter in ("ch. 1", "ch. 2–4", "ch. 5", "ch. 6", "ch. 7", "ch. 7.1"):
        assert f">{chapter}<" in svg, chapter


def test_the_page_reads_right_in_a_plain_viewer():
    """GitHub's viewer and JupyterLab's Markdown preview show the front page as CommonMark: no MyST
    directive (such as an `{include}` of the model card) or role left as text. The model card is
    named by its path, not included or linked: the site does not build book/model (a relative link
    would be a broken cross-reference there), and the repository's address is written in
    _config.yml alone (tests/test_workflow.py), so a fork changes one line."""
    text = INDEX.read_text(encoding="utf-8")
    assert raw_myst(text) == [], raw_myst(text)
    assert not re.search(r"(?m)^(```|:::)\s*\{", text)
    assert "`book/model/README.md`" in text and (ROOT / "book" / "model" / "README.md").is_file()
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):     # every relative link has its file
        if "://" not in target:
            assert (INDEX.parent / target).is_file(), target


def test_the_plain_viewer_check_sees_an_include():
    assert raw_myst('```{include} model/README.md\n:start-after: "## How"\n```\n')
