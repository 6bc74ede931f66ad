"""Issue 28, hostile use of the command line: input that keeps its lines, figures too large to draw, damaged metrics,
variant files that are not UTF-8, a run directory taken in the middle of a sweep, and an interrupt during the final
evaluation. Each error is one line on stderr, with no traceback, and leaves nothing behind."""
import contextlib
import io
import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch
from test_cli import SHORT, _hold, _release, assert_one_line_error, global_state, kept_state, run  # noqa: F401
from test_sweep import _children, sweep, write_variants

import transformer.cli.train as cli_train
import transformer.cli.use as cli_use
from transformer.cli.commands import Terminated
from transformer.cli.sweep import Variant, read_variants
from transformer.engine.trained import load
from transformer.figures import plots

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "book" / "model"          # the shipped model: 3 layers, 4 heads
pytestmark = pytest.mark.usefixtures("one_thread", "global_state")  # tiny models: a second thread only spins


# ---- 1. translate keeps line i of the output on line i of the input ------------------------------------------------

SENTENCES = ["Ein Hund läuft.", "Zwei Männer."]


@pytest.fixture(scope="module")
def alone():
    "Each sentence translated on its own, as an argument."
    with kept_state():
        torch.set_num_threads(1)                                    # as `one_thread` does for the tests
        return [run("translate", "--model", MODEL, "--beam", 1, s)[1] for s in SENTENCES]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("stdin", ["text", "bytes"])
def test_translate_keeps_empty_lines_and_splits_every_line_ending(alone, monkeypatch, newline, stdin):
    asked = []
    real = cli_use.translate
    monkeypatch.setattr(cli_use, "translate", lambda model, tok, texts, **kw: asked.append(texts) or
                        real(model, tok, texts, **kw))
    text = newline.join([SENTENCES[0], "", "  ", SENTENCES[1]]) + newline
    code, out, err = (run("translate", "--model", MODEL, "--beam", 1, stdin=text) if stdin == "text" else
                      run("translate", "--model", MODEL, "--beam", 1, stdin=text.encode()))
    assert code == 0 and err == "", err
    assert out == alone[0] + "\n\n" + alone[1]                   # empty in, empty out, in place
    assert asked == [SENTENCES]                                   # the empty lines never reach the model


@pytest.mark.slow
def test_translate_empty_arguments_stay_in_place(alone):
    code, out, err = run("translate", "--model", MODEL, "--beam", 1, SENTENCES[0], "", SENTENCES[1])
    assert code == 0 and out == alone[0] + "\n" + alone[1], err


# ---- 2. attend refuses a figure it could not draw in reasonable memory ----------------------------------------------

def _sentence(pieces: int) -> str:
    "A sentence of `pieces` subword pieces (</s> included) for the shipped model's tokenizer: 5 a repeat."
    assert pieces % 5 == 1
    return " ".join(["Ein Mann fährt Fahrrad."] * (pieces // 5))


def _never(*args, **kwargs):
    raise AssertionError("called after the limit was found exceeded")


@pytest.mark.slow
def test_attend_refuses_a_sentence_longer_than_a_map_before_translating(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "attention_weights", _never)
    code, out, err = run("attend", "--model", MODEL, "--kind", "encoder", _sentence(301), "--out", tmp_path / "a.png")
    assert_one_line_error(code, out, err, 1, f"the sentence has 301 subword pieces, more than the {plots.MAX_PIECES} "
                                             "an attention map shows; pass a shorter sentence")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_attend_refuses_a_figure_over_the_pixel_limit_and_one_panel_fits(tmp_path, monkeypatch):
    "101 pieces: 12 panels would be 13,571 x 10,238 pixels; --layer 1 --head 1 draws one panel of 3,573 x 3,573."
    real = plots.attention_maps
    monkeypatch.setattr(plots, "attention_maps", _never)
    out_png = tmp_path / "a.png"
    code, out, err = run("attend", "--model", MODEL, "--kind", "encoder", _sentence(101), "--out", out_png)
    assert_one_line_error(code, out, err, 1, "the figure of 12 panels (3 layers x 4 heads) of 101 x 101 pieces would "
                                             "be 13,571 x 10,238 pixels, more than attend draws (100,000,000 pixels")
    assert "draw fewer panels with --layer and/or --head, or pass a shorter sentence" in err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(plots, "attention_maps", real)
    code, out, err = run("attend", "--model", MODEL, "--kind", "encoder", "--layer", 1, "--head", 1, _sentence(101),
                         "--out", out_png)
    assert code == 0 and err == "", err
    from PIL import Image
    assert Image.open(out_png).size == plots.attention_maps_pixels(1, 1, 101, 101) == (3573, 3573)


@pytest.mark.slow
def test_attend_refuses_a_translation_longer_than_a_map(tmp_path, monkeypatch):
    "The limit on the pieces written is checked after the translation, before drawing."
    monkeypatch.setattr(plots, "MAX_PIECES", 6)                  # the sentence has 6 pieces, its translation more
    monkeypatch.setattr(plots, "attention_maps", _never)
    code, out, err = run("attend", "--model", MODEL, "Ein Mann fährt Fahrrad.", "--out", tmp_path / "a.png")
    assert_one_line_error(code, out, err, 1, "the translation has 7 subword pieces, more than the 6 an attention map "
                                             "shows; pass a shorter sentence")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_size_attend_checks_is_the_size_it_draws():
    from PIL import Image
    shipped = load(MODEL)
    model, tokenizer = shipped.model, shipped.tokenizer
    weights = plots.attention_weights(model, tokenizer, "Ein Mann fährt Fahrrad.")
    for kind, layer, head in (("cross", None, None), ("encoder", 2, None), ("decoder", None, 3), ("cross", 1, 1)):
        rows, cols = weights.pieces(kind)
        fig = plots.attention_maps(weights, kind, layer, head)
        size = Image.open(io.BytesIO(plots.to_bytes(fig))).size
        assert size == plots.attention_maps_pixels(1 if layer else 3, 1 if head else 4, len(rows), len(cols)), kind


# ---- 3. plot names the file and line of a record it cannot draw ----------------------------------------------------

GOOD = {"kind": "train", "step": 8, "loss": 2.0, "lr": 0.001}
BAD_RECORDS = [  # (what, the record on line 2, part of the message)
    ("loss not a number", {"kind": "train", "step": 4, "loss": "abc", "lr": 0.1}, "\"loss\" is 'abc', not a number"),
    ("seconds not a number", {"kind": "eval", "step": 4, "seconds": "x", "bleu": 1.0}, "\"seconds\" is 'x', not"),
    ("step not a number", {"kind": "train", "step": "four", "loss": 1.0}, "\"step\" is 'four', not a number"),
    ("step null", {"kind": "train", "step": None, "loss": 1.0}, '"step" is None, not a number'),
    ("a list", {"kind": "train", "step": 4, "loss": [1]}, '"loss" is [1], not a number'),
    ("a boolean", {"kind": "train", "step": 4, "lr": True}, '"lr" is True, not a number'),
    ("kind a number", {"kind": 5, "step": 4, "loss": 1.0}, '"kind" is 5, not train or eval'),
    ("no kind", {"step": 4, "loss": 1.0}, '"kind" is None, not train or eval'),
]


@pytest.mark.parametrize("what, record, match", BAD_RECORDS, ids=[b[0] for b in BAD_RECORDS])
def test_plot_names_the_file_and_line_of_a_bad_record(tmp_path, what, record, match):
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({**GOOD, "step": 2}, record, GOOD)))
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run("plot", tmp_path / "run", "--out", tmp_path / "c.png")
    assert_one_line_error(code, out, err, 1, f"error: {path}, line 2: not a metrics record that can be drawn ({match}")
    assert "fix or delete that line" in err and sorted(tmp_path.rglob("*")) == before


def test_plot_refuses_a_run_given_twice_or_without_records(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    for argv, match in (([ROOT / "book" / "results" / "xeon-de-en"] * 2, "xeon-de-en is given twice"),
                        ([tmp_path / "run"], "metrics.jsonl holds no records yet (train writes one every --log-every")):
        code, out, err = run("plot", *argv, "--out", tmp_path / "c.png")
        assert_one_line_error(code, out, err, 1, match)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["metrics.jsonl", "run"]


@pytest.mark.slow
def test_plot_draws_nan_losses_and_records_without_the_optional_fields(tmp_path):
    "A diverged run logs NaN; an eval record without BLEU (no callback) is a record all the same."
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "train", "step": 2, "loss": float("nan"), "lr": 0.1}, {"kind": "eval", "step": 2, "val_loss": 1.5},
        {"kind": "train", "step": 4, "loss": 1, "lr": None})))
    code, out, err = run("plot", tmp_path / "run", "--out", tmp_path / "c.png")
    assert code == 0 and err == "", err


# ---- 4. sweep: a variant file that is not UTF-8 or of the wrong shape; a run directory taken meanwhile ---------------

def entry(**kw):
    return {"name": "a", "row": "x", **kw}


BAD_VARIANT_FILES = [  # (what, the file's bytes, part of the message)
    ("latin-1, not UTF-8", '{"variants": [\n {"name": "a", "row": "Fußball"}]}'.encode("latin-1"),
     "is not UTF-8 text: byte b'\\xdf' at line 2, column 26 (byte 41 of the file); save it as UTF-8"),
    ("UTF-16", json.dumps({"variants": []}).encode("utf-16"), "is not UTF-8 text: byte b'\\xff' at line 1, column 1"),
    ("row not a string", json.dumps({"variants": [entry(row=5)]}).encode(), 'variant 1 (a): "row" must be a string, '
                                                                             "got 5"),
    ("note not a string", json.dumps({"variants": [entry(note=["x"])]}).encode(), 'variant 1 (a): "note" must be a '
                                                                                  "string, got ['x']"),
    ("nested too deeply", b"[" * 100_000 + b"]" * 100_000, "is nested too deeply to be a variant file"),
]


@pytest.mark.parametrize("what, data, match", BAD_VARIANT_FILES, ids=[b[0] for b in BAD_VARIANT_FILES])
def test_a_variant_file_sweep_cannot_read_is_one_line(tmp_path, what, data, match):
    path = tmp_path / "variants.json"
    path.write_bytes(data)
    code, out, err = sweep(path, "--out", tmp_path / "runs", "--list")          # --list: a valid file runs nothing
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: {path}") and match in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_a_variant_file_with_a_byte_order_mark_is_read(tmp_path):
    "Windows editors start UTF-8 files with a byte order mark; it is not part of the JSON."
    path = tmp_path / "variants.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"variants": [entry(row="Fußball")]}).encode())
    assert read_variants(path) == ([], [Variant("a", "Fußball")])


@pytest.mark.slow
def test_retry_failed_leaves_a_held_failed_run_alone(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    (out / "a").mkdir(parents=True)
    (out / "a" / "failed.json").write_text('{"error": "diverged"}')
    _children(monkeypatch, {"b": [sys.executable, "-c", "pass"]})
    path = write_variants(tmp_path / "v.json", [entry(), entry(name="b")])
    holder = _hold(out / "a")                                        # a live run in another process
    try:
        code, stdout, err = sweep(path, "--out", out, "--retry-failed")
    finally:
        _release(holder)
    assert code == 1 and f"busy   a: {out / 'a'} is in use by another run (pid {holder})" in stdout, err
    assert err == "1 variants are running in another process: a; left alone (run the same command when they end)\n"
    assert (out / "a" / "failed.json").read_text() == '{"error": "diverged"}'        # kept: not ours to delete


# a stand-in for a variant's command: it has another process take the run's lock (say, `train --out` typed by hand
# into the same directory) and ends with an error, which the sweep then cannot record. That process is
# `_hold_when_asked`'s, forked from the test before the sweep (no second import of torch); it takes the lock when
# this command writes to the FIFO argv[1], and says so on the FIFO argv[2].
TAKE_AND_FAIL = """import sys
with open(sys.argv[1], "w") as go:
    go.write("take")
with open(sys.argv[2]) as held:
    assert held.read() == "held"
sys.exit(1)"""


def _hold_when_asked(run_dir: Path, go: Path, held: Path) -> int:
    "A child forked from this process that takes `run_dir`'s lock once `go` is written, and says so on `held`; its pid."
    from transformer.engine.corpus import run_lock
    os.mkfifo(go)
    os.mkfifo(held)
    pid = os.fork()
    if pid == 0:                                                   # the child: never returns into pytest
        said = "not held"
        try:
            with open(go) as f:                                    # waits for the variant's command
                f.read()
            with run_lock(run_dir):
                said = "held"
                with open(held, "w") as f:
                    f.write(said)
                time.sleep(120)
        finally:
            if said != "held":                                     # the command waits for an answer
                with contextlib.suppress(OSError), open(held, "w") as f:
                    f.write(said)
            os._exit(0)
    return pid


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_run_taken_before_its_result_is_recorded_is_busy(tmp_path, monkeypatch, command):
    out, go, held = tmp_path / "runs", tmp_path / "go", tmp_path / "held"
    holder = _hold_when_asked(out / "a", go, held)
    _children(monkeypatch, {"a": [sys.executable, "-c", TAKE_AND_FAIL, str(go), str(held)]})
    path = write_variants(tmp_path / "v.json", [entry(command=command)])
    try:
        code, stdout, err = sweep(path, "--out", out)
    finally:
        _release(holder)
    assert code == 1 and f"busy   a: {out / 'a'} is in use by another run (pid {holder})" in stdout, (stdout, err)
    assert err == "1 variants are running in another process: a; left alone (run the same command when they end)\n"
    assert not (out / "a" / "failed.json").exists() and not (out / "a" / "results.json").exists()


# ---- 5. an interrupt during train's final evaluation says how to redo it ---------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("signal_name, error, code", [("SIGINT", KeyboardInterrupt, 130), ("SIGTERM", Terminated, 143)])
def test_an_interrupt_during_the_final_evaluation_says_how_to_redo_it(multi30k_slice, tmp_path, monkeypatch,
                                                                      signal_name, error, code):
    out = tmp_path / "run"                                            # 3 steps: the claim is about what comes after
    short = [*SHORT, "--data", multi30k_slice, "--unverified-data"]   # tests/conftest.py: Multi30k's first pairs

    def interrupted(*args, **kwargs):
        raise error()
    monkeypatch.setattr(cli_train, "final_evaluation", interrupted)
    got, stdout, err = run(*short, "--out", out)
    assert got == code and err.count("\n") == 1 and "Traceback" not in err, err
    again = f"python -m transformer {shlex.join(str(a) for a in [*short, '--out', out, '--resume'])}"
    assert err == (f"{signal_name} during the final evaluation: training finished (step 3) and its checkpoints are "
                   f"saved in {out}; redo the final evaluation with: {again}\n")
    assert (out / "last.pt").exists() and (out / "best.pt").exists() and not (out / "results.json").exists()
    metrics = (out / "metrics.jsonl").read_text()
    monkeypatch.undo()
    got, stdout, err = run(*shlex.split(again)[3:])
    assert got == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 3 and results["stopped"] == "max_steps"
    assert (out / "metrics.jsonl").read_text() == metrics               # no step trained again


@pytest.mark.slow
def test_a_run_stopped_by_its_time_limit_redoes_only_the_final_evaluation(multi30k_slice, tmp_path, monkeypatch):
    """A run that --max-minutes stopped (here at step 3 of 5) resumes with --max-steps at its step: resumed
    without it, it would train on."""
    import dataclasses
    out, real = tmp_path / "run", cli_train.train

    def by_the_clock(model, examples, val, config, **kwargs):
        done = real(model, examples, val, dataclasses.replace(config, max_steps=3), **kwargs)
        return dataclasses.replace(done, stopped="max_minutes")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_train, "train", by_the_clock)
    monkeypatch.setattr(cli_train, "final_evaluation", interrupted)
    got, stdout, err = run(*SHORT, "--data", multi30k_slice, "--unverified-data", "--max-steps", 5,
                           "--out", out)                                    # the last --max-steps wins
    assert got == 130 and err.endswith(f"--out {out} --resume --max-steps 3\n"), err
    metrics = (out / "metrics.jsonl").read_text()
    monkeypatch.undo()
    got, stdout, err = run(*shlex.split(err.split("with: ")[1])[3:])
    assert got == 0, err
    assert json.loads((out / "results.json").read_text())["steps"] == 3
    assert (out / "metrics.jsonl").read_text() == metrics


@pytest.mark.slow
def test_train_hands_buckets_to_the_loop(multi30k_slice, tmp_path, monkeypatch):
    "--compile --buckets 4 reaches appendix E.2's train(buckets=4) (the loop's tests prove what it does)."
    seen = {}

    def stop_here(model, examples, val, config, **kwargs):
        seen.update(compile=config.compile, buckets=kwargs["buckets"])
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_train, "train", stop_here)
    got, stdout, err = run(*SHORT, "--data", multi30k_slice, "--unverified-data", "--compile", "--buckets", 4,
                           "--out", tmp_path / "run")
    assert got == 130 and seen == {"compile": True, "buckets": 4}, err


# ---- 6. round four: a vocabulary the text cannot give, --threads past what starts, a damaged config.json ----------

@pytest.mark.parametrize("vocab, match", [(50, "their characters and the 4 special pieces need "),
                                          (90_000, "they yield at most ")], ids=["too small", "too large"])
def test_train_says_which_vocab_size_the_text_allows(multi30k_slice, tmp_path, vocab, match):
    "Old: --vocab-size 100 or 300000 on Multi30k was sentencepiece's INTERNAL error, exit 70 (a bug)."
    code, out, err = run(*SHORT, "--data", multi30k_slice, "--unverified-data", "--vocab-size", vocab,
                         "--out", tmp_path / "run")
    assert_one_line_error(code, out, err, 1, f"sentencepiece could not train a bpe model with vocab_size={vocab} on ")
    assert match in err and "; pass a vocab_size (--vocab-size) of at " in err and "INTERNAL" not in err, err


@pytest.mark.parametrize("argv", [["translate", "--model", MODEL, "x"], ["evaluate", "--model", MODEL], ["train"]],
                         ids=["translate", "evaluate", "train"])
def test_threads_past_what_can_start_are_refused(argv):
    "Old: --threads 100000 killed the process with a segfault (exit 139, no message): libgomp could not start them."
    code, out, err = run(*argv, "--threads", 100_000)
    assert_one_line_error(code, out, err, 2, "argument --threads: 100000 must be in [1, 1024]")


def test_bench_and_sweep_refuse_threads_past_what_can_start(tmp_path, capsys):
    from transformer.cli.bench import main as bench
    with pytest.raises(SystemExit) as exit_:
        bench(["--threads", "5000", "--preset", "tiny", "--repeats", "1", "--batches", "1", "--warmup", "0",
               "--decode-sentences", "1"])      # were the check gone: a short benchmark
    assert exit_.value.code == 2 and "error: --threads=5000 must be <= 1024" in capsys.readouterr().err
    code, out, err = sweep(write_variants(tmp_path / "v.json", [entry()]), "--out", tmp_path / "runs", "--threads",
                           5000, "--list")
    assert code == 2 and err == "error: --threads 5000: at most 1024\n", err


def test_prepare_says_what_a_file_that_is_not_text_is(tmp_path):
    "Old: prepare --src-files /dev/zero (or a named pipe) said 'no such file; check the path'."
    (tmp_path / "t.en").write_text("A dog.\n")
    code, out, err = run("prepare", "--src-files", "/dev/zero", "--tgt-files", tmp_path / "t.en", "--out",
                         tmp_path / "corpus", "--quiet")
    assert_one_line_error(code, out, err, 1, "/dev/zero: a pipe or a device, not a regular file; pass a text file")


def _model_with_data(tmp_path, data) -> Path:
    "A copy of the shipped model whose config.json's \"data\" is `data`."
    import shutil
    model = Path(shutil.copytree(MODEL, tmp_path / "model", ignore=shutil.ignore_patterns("web")))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "data": data}))
    return model


@pytest.mark.parametrize("data", [None, {"src": "xx", "tgt": "en"}, {"src": "de", "tgt": "de"}, {"src": 5}, "de"],
                         ids=["null", "unknown language", "same language", "a number", "a string"])
def test_evaluate_names_languages_config_json_does_not_say(tmp_path, data):
    "Old: \"data\": null, or a language that is not Multi30k's, in config.json was a TypeError or ValueError, exit 70."
    model = _model_with_data(tmp_path, data)
    code, out, err = run("evaluate", "--model", model, "--beam", 1, "--limit", 1)
    assert_one_line_error(code, out, err, 1, f"{model}/config.json does not say the languages (src ")
    assert ": two of de, en, fr); use --src-file/--ref-file" in err


@pytest.fixture(scope="module")
def short_run(multi30k_slice, tmp_path_factory):
    "A run of three steps on the slice of Multi30k, to resume."
    out = tmp_path_factory.mktemp("short") / "run"
    with kept_state():
        code, stdout, err = run(*SHORT, "--data", multi30k_slice, "--unverified-data", "--out", out)
    assert code == 0, err
    return out


DAMAGED_CONFIGS = [  # (what, config.json as a function of the run's, part of the message)
    ("not JSON", lambda run: '{"model": ', "Expecting value"),
    ("a list", lambda run: "[]", "'list' object has no attribute 'get'"),
    ("data null", lambda run: json.dumps({**run, "data": None}), "'NoneType' object is not iterable"),
    ("train null", lambda run: json.dumps({**run, "train": None}), "'NoneType' object is not a mapping"),
    ("a field out of range", lambda run: json.dumps({**run, "model": {**run["model"], "d_model": "x"}}),
     "d_model='x' must be a positive int"),
]


@pytest.mark.slow
@pytest.mark.parametrize("what, damage, match", DAMAGED_CONFIGS, ids=[d[0] for d in DAMAGED_CONFIGS])
def test_resume_with_a_damaged_config_json_is_one_line(short_run, multi30k_slice, tmp_path, what, damage, match):
    "Old: train --resume on a run whose config.json was not JSON, or had a part that is not an object: exit 70."
    import shutil
    out = Path(shutil.copytree(short_run, tmp_path / "run"))
    config = out / "config.json"
    config.write_text(damage(json.loads(config.read_text())))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, stdout, err = run(*SHORT, "--data", multi30k_slice, "--unverified-data", "--out", out, "--resume")
    assert_one_line_error(code, stdout, err, 1, f"--resume: {config} is damaged (")
    assert match in err and "put back the run's own, or train into a new --out" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
