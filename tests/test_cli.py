"""Chapter 08d, cli.py: `python -m transformer train|translate|evaluate`, end to end on Multi30k, and every bad input."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformer.cli import main
from transformer.data import DataError, load_multi30k

ROOT = Path(__file__).resolve().parents[1]


def run(*argv, stdin=""):
    "main(argv) in this process: (exit code, stdout, stderr)."
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        sys.stdin = old
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, out, err, expected_code, match):
    assert code == expected_code, err
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and match in err, err


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def multi30k():
    try:
        load_multi30k("de", "en", "val", download=False, progress=False)
    except DataError as e:
        pytest.skip(f"Multi30k not available offline ({e}); set TRANSFORMER_DATA")


TRAIN = ["train", "--preset", "tiny", "--max-steps", 24, "--eval-every", 12, "--eval-sentences", 16,
         "--vocab-size", 1000, "--beam", 2, "--threads", 1, "--quiet", "--no-download", "--log-every", 4,
         "--average", 3, "--snapshot-every", 6]


@pytest.fixture(scope="module")
def trained(multi30k, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny-de-en"
    code, stdout, err = run(*TRAIN, "--out", out)
    assert code == 0, err
    return out, stdout


def test_train_writes_the_run_directory(trained):
    out, stdout = trained
    assert {"config.json", "tokenizer.model", "last.pt", "best.pt", "metrics.jsonl", "results.json"} <= \
        {p.name for p in out.iterdir()}
    results = json.loads((out / "results.json").read_text())
    for key in ("bleu", "bleu_lc_tok", "chrf", "train_seconds", "eval_seconds", "tokens_per_second"):
        assert isinstance(results[key], float) and results[key] >= 0, key
    assert results["split"] == "test_2016_flickr" and results["steps"] == 24 and results["params"] > 0
    assert 0 < results["epochs"] < 1
    assert results["eval_seconds"] < results["train_seconds"]
    assert results["device"].startswith("cpu") and results["torch"] == torch.__version__
    assert set(results["val"]) == {"bleu", "bleu_lc_tok", "chrf"}
    # checkpoint averaging: the last 3 snapshots (every 6 steps), scored on val beside best.pt
    assert results["averaged"] == ["step-0000012.pt", "step-0000018.pt", "step-0000024.pt"]
    assert sorted(p.name for p in out.glob("step-*.pt")) == results["averaged"] and (out / "averaged.pt").exists()
    by = results["val_by_checkpoint"]
    assert set(by) == {"best", "averaged"} and results["checkpoint"] in by
    assert by[results["checkpoint"]]["bleu"] == max(v["bleu"] for v in by.values()) == results["val"]["bleu"]
    assert set(results["greedy"]) == {"bleu", "bleu_lc_tok", "chrf"}
    # provenance: the code, the machine, the software
    assert results["python"] and results["cpu"] and results["cpu_count"] == os.cpu_count()
    assert results["threads"] == 1 and results["train_config"]["keep_checkpoints"] == 3
    assert results["command"].startswith("python -m transformer train --preset tiny")
    if (ROOT / ".git").exists():
        assert len(results["git_commit"]) == 40 and isinstance(results["git_dirty"], bool)
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["d_model"] == 64 and config["data"] == {"src": "de", "tgt": "en", "vocab_size": 1000}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == list(range(4, 25, 4))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [12, 24]
    assert all("bleu" in r and "val_loss" in r for r in records if r["kind"] == "eval")
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("test_2016_flickr: BLEU ") and float(last.split()[2]) == pytest.approx(results["bleu"], abs=0.01)


def test_translate_arguments_and_stdin(trained):
    out, _ = trained
    code, stdout, err = run("translate", "--model", out, "--beam", 1, "Ein Hund läuft.", "Zwei Männer.")
    assert code == 0, err
    assert len(stdout.splitlines()) == 2
    code, stdout2, err = run("translate", "--model", out, "--beam", 1, stdin="Ein Hund läuft.\nZwei Männer.\n")
    assert code == 0 and stdout2 == stdout


def test_evaluate_split_json_and_files(trained, tmp_path):
    out, _ = trained
    code, stdout, err = run("evaluate", "--model", out, "--split", "val", "--limit", 8, "--beam", 1, "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["sentences"] == 8 and 0 <= s["bleu"] <= 100 and "case:lc" in s["signatures"]["bleu_lc_tok"]
    pairs = load_multi30k("de", "en", "val", download=False)[:8]
    (tmp_path / "src.de").write_text("".join(p[0] + "\n" for p in pairs))
    (tmp_path / "ref.en").write_text("".join(p[1] + "\n" for p in pairs))
    code, stdout2, err = run("evaluate", "--model", out, "--src-file", tmp_path / "src.de",
                             "--ref-file", tmp_path / "ref.en", "--beam", 1, "--json")
    assert code == 0 and json.loads(stdout2)["bleu"] == pytest.approx(s["bleu"])
    code, stdout3, _ = run("evaluate", "--model", out, "--split", "val", "--limit", 8, "--beam", 1)
    assert code == 0 and "BLEU" in stdout3 and "chrF" in stdout3


def test_resume_continues_and_refuses_changes(trained, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(trained[0], out)
    code, out_, err = run(*TRAIN, "--out", out)
    assert_one_line_error(code, out_, err, 1, "already holds a run; add --resume")
    code, out_, err = run(*TRAIN, "--out", out, "--resume", "--warmup", 7, "--dropout", 0.2)
    assert_one_line_error(code, out_, err, 1, "--resume with a different config")
    assert "warmup=7" in err and "dropout=0.2" in err
    code, stdout, err = run(*[a if a != 24 else 30 for a in TRAIN], "--out", out, "--resume")
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["steps"] == 30
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 30


def test_checkpoint_choice(trained):
    out, _ = trained
    chosen = json.loads((out / "results.json").read_text())["checkpoint"]
    outputs = {}
    for which in ("chosen", "best", "last", "averaged"):
        code, stdout, err = run("translate", "--model", out, "--beam", 1, "--checkpoint", which,
                                "Ein Hund läuft über eine Wiese.")
        assert code == 0, err
        outputs[which] = stdout
    assert outputs["chosen"] == outputs[chosen]


def test_translate_empty_input(trained):
    code, out, err = run("translate", "--model", trained[0], stdin="\n  \n")
    assert_one_line_error(code, out, err, 1, "no input")


def _broken_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "best.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "corrupt" / "tokenizer.model").write_bytes(b"x")
    (tmp_path / "foreign").mkdir()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "foreign" / "best.pt")
    (tmp_path / "foreign" / "tokenizer.model").write_bytes(b"x")
    (tmp_path / "notok").mkdir()
    torch.save({}, tmp_path / "notok" / "last.pt")


BAD = [  # (what, argv, exit code, part of the message)
    ("unknown preset", ["train", "--preset", "huge"], 2, "invalid choice: 'huge'"),
    ("zero steps", ["train", "--max-steps", "0"], 2, "0 must be > 0"),
    ("not a number", ["train", "--max-minutes", "soon"], 2, "'soon' is not a number"),
    ("no command", [], 2, "required: {train,translate,evaluate}"),
    ("unknown command", ["fly"], 2, "invalid choice: 'fly'"),
    ("unknown option", ["train", "--learning-rate", "1"], 2, "unrecognized arguments"),
    ("same languages", ["train", "--src", "de", "--tgt", "de"], 1, "both 'de'"),
    ("CUDA absent", ["train", "--device", "cuda"], 1, "--device cuda: no CUDA device"),
    ("CUDA absent (translate)", ["translate", "--model", "TMP/empty", "--device", "cuda", "x"], 1, "no CUDA device"),
    ("missing data", ["train", "--data", "TMP/nowhere", "--no-download", "--out", "TMP/r"], 1, "not found in"),
    ("resume without a run", ["train", "--resume", "--out", "TMP/empty"], 1, "no run to resume"),
    ("no such run directory", ["translate", "--model", "TMP/nowhere", "x"], 1, "no such directory"),
    ("directory without a model", ["translate", "--model", "TMP/empty", "x"], 1, "holds no model"),
    ("model without tokenizer", ["translate", "--model", "TMP/notok", "x"], 1, "no tokenizer.model"),
    ("corrupt checkpoint", ["evaluate", "--model", "TMP/corrupt"], 1, "not a readable checkpoint"),
    ("foreign checkpoint", ["evaluate", "--model", "TMP/foreign"], 1, "not a checkpoint of this package"),
    ("half a file pair", ["evaluate", "--model", "TMP/empty", "--src-file", "a"], 1, "go together"),
    ("split and files", ["evaluate", "--model", "TMP/empty", "--split", "val", "--src-file", "a", "--ref-file", "b"],
     1, "not both"),
]


@pytest.mark.parametrize("what, argv, code, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_nonzero(tmp_path, monkeypatch, what, argv, code, match):
    _broken_runs(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = run(*[a.replace("TMP", str(tmp_path)) for a in argv])
    assert_one_line_error(*got, code, match)


def test_missing_reference_file(trained, tmp_path):
    (tmp_path / "src.de").write_text("Hallo\n")
    code, out, err = run("evaluate", "--model", trained[0], "--src-file", tmp_path / "src.de",
                         "--ref-file", tmp_path / "nope.en")
    assert_one_line_error(code, out, err, 1, "no such file")


def test_mismatched_tokenizer(trained, tmp_path):
    out = tmp_path / "mixed"
    shutil.copytree(trained[0], out)
    from transformer.tokens import Tokenizer
    Tokenizer.train(["ein kleiner satz", "a small sentence"] * 20, vocab_size=30).save(out / "tokenizer.model")
    code, o, err = run("translate", "--model", out, "Hallo")
    assert_one_line_error(code, o, err, 1, "from different runs")


def test_python_dash_m_runs_main():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "transformer", "--help"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "train" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "transformer", "train", "--preset", "huge"], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_keep_freed_memory_applies_on_glibc():
    import platform
    from transformer.cli import keep_freed_memory
    assert keep_freed_memory() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
