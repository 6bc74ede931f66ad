"""Issue 41, hostile use round three: translate and evaluate read and write a chunk at a time (memory bounded by a
token budget per batch, not the input), with a progress bar on a terminal and what was written kept on SIGTERM;
`TrainedModel.translate` refuses bad items in one TypeError; input files that are not text, or that end lines with a
lone CR, get a clear answer."""
import contextlib
import inspect
import io
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_cli import assert_one_line_error, run

import transformer.cli.use as cli_use
import transformer.engine.trained as trained_mod
from transformer.__main__ import main
from transformer.data import load_multi30k
from transformer.engine.trained import load
from transformer.evaluation import score

MODEL = Path(__file__).resolve().parents[1] / "book" / "model"
pytestmark = pytest.mark.usefixtures("keep_threads")
SENTENCES = ["Ein Hund läuft.", "Zwei Männer spielen Fußball auf einer grünen Wiese im Park.", "Eine Frau.",
             "Ein kleines Kind sitzt auf dem Boden und spielt mit einem roten Ball.", "Hallo."]


@pytest.fixture(scope="module")
def shipped():
    return load(MODEL)


@pytest.fixture
def chunk_of_two(monkeypatch):
    "Chunks of two sentences, so that a few sentences make several chunks."
    monkeypatch.setattr(trained_mod, "CHUNK", 2, raising=False)


class _Trickle(io.RawIOBase):
    "A stdin that hands over one line a read and counts the lines read so far."
    def __init__(self, lines: list[bytes]):
        self.lines, self.read_lines = lines, 0

    def readable(self):
        return True

    def readinto(self, b):
        if self.read_lines == len(self.lines):
            return 0
        data = self.lines[self.read_lines]
        self.read_lines += 1
        b[:len(data)] = data
        return len(data)


@pytest.mark.slow
def test_translate_writes_each_chunk_before_reading_the_rest(shipped, chunk_of_two, monkeypatch):
    "Old: stdin read whole first (205 MB: 2.73 GB, nothing written). Now chunk 1 is out after 2 lines of 5 are read."
    trickle = _Trickle([s.encode() + b"\n" for s in SENTENCES])
    seen = []                           # lines of stdin read at each write to stdout

    class Out(io.StringIO):
        def write(self, s):
            seen.append(trickle.read_lines)
            return super().write(s)
    out = Out()
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BufferedReader(trickle, 1)))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["translate", "--model", str(MODEL), "--beam", "1"]) == 0
    assert out.getvalue().splitlines() == shipped.translate(SENTENCES, beam_size=1)   # in input order
    assert seen[0] <= 3 < len(SENTENCES), seen


@pytest.mark.slow
def test_a_batch_stays_within_the_token_budget(monkeypatch):
    "Old: 64 sentences a batch whatever their length (64 x 50k characters, beam 4: over 4 GB). Now a token budget."
    batches = []

    def fake(model, tok, texts, beam_size, alpha, batch_size):
        batches.append((texts, beam_size))
        return [f"T{SENTENCES.index(t)}" if t in SENTENCES else "long" for t in texts]
    monkeypatch.setattr(cli_use, "translate", fake)
    long = "Ein Mann fährt Fahrrad. " * 2000           # cut to max_len=1024 pieces: 2,047 positions a beam
    lines = SENTENCES + [long, long]
    code, out, err = run("translate", "--model", MODEL, "--beam", 4, "--batch-tokens", 9000,
                         stdin="\n".join(lines) + "\n")
    assert code == 0 and err == "", err
    assert out.splitlines() == [f"T{i}" for i in range(len(SENTENCES))] + ["long", "long"]
    tok = load(MODEL).tokenizer
    for texts, beam in batches:
        n = max(min(len(tok.encode(t)) + 1, 1024) for t in texts)
        assert len(texts) * beam * (n + min(n + 50, 1023)) <= 9000 or len(texts) == 1
    assert [len(t) for t, _ in batches][-2:] == [1, 1]          # each long sentence alone


def test_trained_model_translate_names_a_bad_item(shipped):
    "Old: None, [None], [1] gave three different raw errors, and a dict translated its keys."
    for bad, match in ((None, "sentences must be a str or a list of str, not a NoneType"),
                       ([None], r"sentences\[0\] is a NoneType, not a str"),
                       (["Hallo.", 1], r"sentences\[1\] is a int, not a str"),
                       ({"Hallo.": 1}, "not a dict")):
        with pytest.raises(TypeError, match=match):
            shipped.translate(bad, beam_size=1)


@pytest.mark.parametrize("alpha", ["a", float("inf"), float("nan"), -1])
def test_trained_model_translate_refuses_a_length_penalty_that_is_no_finite_number(shipped, alpha):
    "Old: 'a' raised a raw TypeError inside the search, and inf and nan decoded with scores that compare as nothing."
    with pytest.raises(ValueError, match=r"alpha=.* must be a finite number >= 0 \(the paper's: 0.6\)"):
        shipped.translate("Ein Hund läuft.", alpha=alpha)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where there is none")
def test_load_on_a_device_that_is_not_here_is_one_line():
    "Old: load(device='cuda') on a CPU-only torch raised torch's AssertionError; now appendix F's DeviceError."
    from transformer.engine.devices import DeviceError
    with pytest.raises(DeviceError, match="no CUDA device is available here"):
        load(MODEL, device="cuda")
    assert load(MODEL, device="auto").model.generator.weight.device.type in ("cpu", "mps")


def test_one_name_for_the_beam_in_the_python_api():
    """Issue 42: `TrainedModel.translate(beam=4)` beside `translate(beam_size=1)` and `evaluate(beam_size=1)`: every
    function of the package names its beam `beam_size` (the command line's flag stays --beam); `beam` lives on only
    as `TrainedModel.translate`'s keyword-only alias."""
    import ast
    root = MODEL.parents[1] / "transformer"
    found, sizes = [], 0
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                sizes += any(x.arg == "beam_size" for x in a.posonlyargs + a.args + a.kwonlyargs)
                found += [f"{path.relative_to(root)}:{node.lineno} {node.name}({x.arg})"
                          for x in a.posonlyargs + a.args if "beam" in x.arg and x.arg != "beam_size"]
                found += [f"{path.relative_to(root)}:{node.lineno} {node.name}(*, {x.arg})" for x in a.kwonlyargs
                          if "beam" in x.arg and x.arg != "beam_size"]
    assert sizes >= 6, sizes      # beam_search, translate, evaluate, bleu_callback, translate_chunks, .translate, ...
    assert found == ["engine/trained.py:" + str(trained_mod.TrainedModel.translate.__code__.co_firstlineno)
                     + " translate(*, beam)"], found


def test_trained_model_translate_keeps_beam_as_an_alias(shipped):
    "The old keyword still works, with a DeprecationWarning that names the new one, and gives what beam_size gives."
    with pytest.warns(DeprecationWarning, match=r"translate\(beam_size=\.\.\.\)"):
        old = shipped.translate(SENTENCES[0], beam=1)
    assert old == shipped.translate(SENTENCES[0], beam_size=1) != ""
    assert inspect.signature(shipped.translate).parameters["beam_size"].default == 4   # the paper's, as --beam


def test_trained_model_config_is_the_run_s_dict_beside_the_model_s_dataclass(shipped):
    "Issue 42: what TrainedModel's docstring says of its two configs (the types stay: only the text changed)."
    from transformer.model import TransformerConfig
    assert isinstance(shipped.config, dict) and isinstance(shipped.model.config, TransformerConfig)
    assert set(shipped.config) >= {"model", "train", "data"}
    assert TransformerConfig.from_dict(shipped.config["model"]) == shipped.model.config
    assert "model.config" in trained_mod.TrainedModel.__doc__


@pytest.mark.slow
def test_trained_model_translate_shows_progress_for_long_lists(shipped, chunk_of_two, capsys):
    "Old: 10,000 sentences showed nothing. Now a bar on stderr for lists longer than a chunk; none for short ones."
    out = shipped.translate(SENTENCES[:3], beam_size=1, batch_tokens=500)
    assert out == [shipped.translate(s, beam_size=1) for s in SENTENCES[:3]]
    assert "3/3" in capsys.readouterr().err
    shipped.translate(SENTENCES[:2], beam_size=1)
    assert capsys.readouterr().err == ""


def _files(tmp_path, n=6, newline="\n"):
    pairs = load_multi30k("de", "en", "val", download=False)[:n]
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_bytes("".join(p[0] + newline for p in pairs).encode())
    ref.write_bytes("".join(p[1] + newline for p in pairs).encode())
    return pairs, src, ref


@pytest.mark.slow
def test_evaluate_writes_its_output_as_it_goes_and_scores_the_same(multi30k, chunk_of_two, tmp_path, monkeypatch):
    "Old: all translations held, then written at once. Now a chunk at a time, scored from summed statistics."
    pairs, src, ref = _files(tmp_path)
    hyps_file, written = tmp_path / "hyps.en", []
    real = cli_use.translate

    def spy(*args, **kwargs):
        written.append(hyps_file.read_text().count("\n") if hyps_file.exists() else 0)
        return real(*args, **kwargs)
    monkeypatch.setattr(cli_use, "translate", spy)
    code, out, err = run("evaluate", "--model", MODEL, "--src-file", src, "--ref-file", ref, "--beam", 1, "--json",
                         "--output", hyps_file)
    assert code == 0, err
    assert written[-1] >= 2, written                         # the first chunk was on disk before the last began
    hyps = hyps_file.read_text().splitlines()
    want = score(hyps, [r for _, r in pairs])
    got = json.loads(out)
    assert got["sentences"] == 6 and got["bleu"] == pytest.approx(want["bleu"]) and \
        got["chrf"] == pytest.approx(want["chrf"]) and got["bleu_lc_tok"] == pytest.approx(want["bleu_lc_tok"])


def test_sigterm_keeps_the_chunks_already_written(chunk_of_two, monkeypatch):
    "SIGTERM while chunk 2 translates: chunk 1 is on stdout, the exit is 143 with one line."
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))

    def fake(model, tok, texts, **kw):
        calls.append(texts)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return ["done"] * len(texts)
    monkeypatch.setattr(cli_use, "translate", fake)
    try:
        code, out, err = run("translate", "--model", MODEL, "--beam", 1, stdin="a\nb\nc\nd\ne\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and err == "error: interrupted (SIGTERM)\n", err
    assert out == "done\ndone\n"


def test_evaluate_says_what_a_file_that_is_not_text_is(tmp_path):
    "Old: --src-file /dev/zero said 'no such file'."
    (tmp_path / "ref.en").write_text("A dog.\n")
    code, out, err = run("evaluate", "--model", MODEL, "--src-file", "/dev/zero", "--ref-file", tmp_path / "ref.en")
    assert_one_line_error(code, out, err, 1, "--src-file /dev/zero is a character device, not a regular file; pass a "
                                             "text file, one sentence a line")


def test_translate_refuses_a_line_without_an_end(monkeypatch):
    "stdin from /dev/zero: no line ending within MAX_LINE characters is one line, not a read of everything."
    monkeypatch.setattr(cli_use, "MAX_LINE", 100, raising=False)
    code, out, err = run("translate", "--model", MODEL, "--beam", 1, stdin=b"\0" * 1000)
    assert_one_line_error(code, out, err, 1, "stdin line 1 has no line ending within 100 characters; pass text, one "
                                             "sentence a line")


@pytest.mark.slow
def test_evaluate_reads_lone_cr_line_endings(multi30k, tmp_path):
    "Old: a file with lone CR line endings was one line, and sentencepiece's INTERNAL error."
    pairs, src, ref = _files(tmp_path, 3, newline="\r")
    code, out, err = run("evaluate", "--model", MODEL, "--src-file", src, "--ref-file", ref, "--beam", 1, "--json")
    assert code == 0 and err == "", err
    assert json.loads(out)["sentences"] == 3


def test_read_parallel_says_what_a_path_that_is_not_a_file_is(tmp_path):
    "Old: a named pipe or /dev/zero was 'no such file; check the path', though the path was there."
    from transformer.data import DataError, read_parallel
    (tmp_path / "b.en").write_text("A dog.\n")
    os.mkfifo(tmp_path / "a.de")
    for path in (tmp_path / "a.de", Path("/dev/zero")):
        with pytest.raises(DataError, match=f"^{path}: a pipe or a device, not a regular file; pass a text file"):
            read_parallel(path, tmp_path / "b.en")
    with pytest.raises(DataError, match="no such file; check the path"):
        read_parallel(tmp_path / "c.de", tmp_path / "b.en")


@pytest.mark.parametrize("vocab, match", [(10, "their characters and the 4 special pieces need 16; pass a vocab_size "
                                               r"\(--vocab-size\) of at least 16"),
                                          (500, r"they yield at most \d+ pieces; pass a vocab_size \(--vocab-size\) "
                                                r"of at most \d+, or more text")], ids=["too small", "too large"])
def test_tokenizer_train_says_which_vocab_size_the_texts_allow(vocab, match):
    "Old: sentencepiece's INTERNAL message, a line of C++ source, as a plain ValueError (a bug, to the command line)."
    from transformer.data import DataError
    from transformer.tokens import Tokenizer
    with pytest.raises(DataError, match=f"could not train a bpe model with vocab_size={vocab} on 100 texts: {match}"):
        Tokenizer.train(["Ein Hund läuft."] * 100, vocab_size=vocab)


@pytest.mark.parametrize("seed", ["x", -1, 2**70, 1.5, True])
def test_train_config_refuses_a_seed_torch_cannot_take(seed):
    "Old: TrainConfig(seed='x') was accepted and train failed later on (TypeError; 2**70: OverflowError's ValueError)."
    from transformer import TrainConfig
    with pytest.raises(ValueError, match=r"^seed=.* must be an int in \[0, 2\*\*63\)$"):
        TrainConfig(seed=seed)


@pytest.mark.parametrize("bad", [None, [], "d_model=64"])
def test_from_dict_names_what_it_was_given_instead_of_a_dict(bad):
    "Old: from_dict(None) said 'argument of type 'NoneType' is not iterable'."
    from transformer import TrainConfig, TransformerConfig
    for cls in (TransformerConfig, TrainConfig):
        with pytest.raises(TypeError, match=rf"{cls.__name__}.from_dict takes a dict of its fields, not a "):
            cls.from_dict(bad)
