"""Appendix C, the command line (transformer/cli/): `python -m transformer train|translate|evaluate`, end to end on Multi30k, and every bad input."""
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from transformer.__main__ import main
from transformer.data import DataError, load_multi30k

ROOT = Path(__file__).resolve().parents[1]


class _BytesStdin(io.StringIO):
    "A stdin with the bytes of a real one (sys.stdin.buffer)."
    def __init__(self, data: bytes):
        super().__init__()
        self.buffer = io.BytesIO(data)


def run(*argv, stdin=""):
    "main(argv) in this process: (exit code, stdout, stderr); `stdin` text, or the bytes of a real stdin."
    out, err = io.StringIO(), io.StringIO()
    old = sys.stdin
    sys.stdin = _BytesStdin(stdin) if isinstance(stdin, bytes) else io.StringIO(stdin)
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


@contextlib.contextmanager
def kept_state():
    """Put back what `main` in this process changes for what runs after it: torch's thread count (--threads), the
    global seeds (train seeds torch), and the oneDNN cache variable that train sets in os.environ (the subprocesses
    of later tests would inherit it). train puts its SIGTERM handler back itself; this checks that it did."""
    import random

    import numpy as np
    threads, handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        with pytest.MonkeyPatch.context() as mp:                   # its own: a test may undo its monkeypatch
            for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
                if name in os.environ:
                    mp.setenv(name, os.environ[name])              # put back at the end, whatever train does
                else:
                    mp.delenv(name, raising=False)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
    assert signal.getsignal(signal.SIGTERM) == handler, "a command left its SIGTERM handler behind"


@pytest.fixture
def global_state():
    "kept_state around each test (a module's fixtures that run commands use it themselves)."
    with kept_state():
        yield


pytestmark = pytest.mark.usefixtures("one_thread", "global_state")  # tiny models: a second thread only spins


def _hold(run_dir) -> int:
    """Another process that holds the run directory, as a live run does (its `run_lock`): a child forked from this
    one, so that it imports nothing again; returns its pid once it holds the lock. `_release(pid)` ends it."""
    from transformer.engine.corpus import run_lock
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                                   # the child: hold until killed, never return
        try:
            with run_lock(run_dir):
                os.write(write, b"held")
                time.sleep(120)
        finally:
            os._exit(0)
    os.close(write)
    try:
        said = os.read(read, 4)
    finally:
        os.close(read)
    if said != b"held":
        _release(pid)
        pytest.fail(f"the forked holder of {run_dir} did not take its lock")
    return pid


def _release(pid: int):
    "End a holder of `_hold`, as a kill ends a run: the operating system frees its lock."
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


# small on purpose: 800-token steps, 4 sentences scored (an untrained model writes to the length cap)
TRAIN = ["train", "--preset", "tiny", "--max-steps", 24, "--eval-every", 12, "--eval-sentences", 4,
         "--vocab-size", 1000, "--beam", 2, "--threads", 1, "--quiet", "--no-download", "--log-every", 4,
         "--average", 3, "--snapshot-every", 6, "--batch-tokens", 800]


@pytest.fixture(scope="module")
def sliced(multi30k_slice):
    """The flags of a run on the slice of Multi30k (tests/conftest.py: its first 2,000 training pairs, its val and
    test whole): every `train` of this file needs a run, not the whole corpus, and so tokenizes a fifteenth of it."""
    return ["--data", multi30k_slice, "--unverified-data"]


@pytest.fixture(scope="module")
def trained(sliced, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny-de-en"
    with kept_state():
        code, stdout, err = run(*TRAIN, *sliced, "--out", out)
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
    assert results["device"].startswith("cpu") and results["torch"] == torch.__version__
    assert set(results["val"]) == {"bleu", "bleu_lc_tok", "chrf"}
    # checkpoint averaging: the last 3 snapshots (every 6 steps), scored on val beside best.pt
    assert results["averaged"] == ["step-0000012.pt", "step-0000018.pt", "step-0000024.pt"]
    assert sorted(p.name for p in out.glob("step-*.pt")) == results["averaged"] and (out / "averaged.pt").exists()
    by = results["val_by_checkpoint"]
    assert set(by) == {"best", "averaged"} and results["checkpoint"] in by
    assert by[results["checkpoint"]]["bleu"] == max(v["bleu"] for v in by.values()) == results["val"]["bleu"]
    assert set(results["greedy"]) == {"bleu", "bleu_lc_tok", "chrf"}
    # no --alpha: the final evaluation tries 0.6 and 1.0 with each candidate, on val
    grid = results["val_grid"]
    assert [(r["snapshots"], r["alpha"]) for r in grid] == [(0, 0.6), (0, 1.0), (3, 0.6), (3, 1.0)]
    winner = max(grid, key=lambda r: r["bleu"])
    assert results["alpha"] == winner["alpha"] and results["val"]["bleu"] == winner["bleu"]
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
    # without --alpha, the length penalty the run chose on val; with it, the one given
    assert s["alpha"] == json.loads((out / "results.json").read_text())["alpha"]
    code, given, err = run("evaluate", "--model", out, "--split", "val", "--limit", 2, "--beam", 1,
                           "--json", "--alpha", 0.3)
    assert code == 0 and json.loads(given)["alpha"] == 0.3, err
    pairs = load_multi30k("de", "en", "val", download=False)[:8]
    (tmp_path / "src.de").write_text("".join(p[0] + "\n" for p in pairs))
    (tmp_path / "ref.en").write_text("".join(p[1] + "\n" for p in pairs))
    code, stdout2, err = run("evaluate", "--model", out, "--src-file", tmp_path / "src.de",
                             "--ref-file", tmp_path / "ref.en", "--beam", 1, "--json")
    assert code == 0 and json.loads(stdout2)["bleu"] == pytest.approx(s["bleu"])
    code, stdout3, _ = run("evaluate", "--model", out, "--split", "val", "--limit", 8, "--beam", 1)
    assert code == 0 and "BLEU" in stdout3 and "chrF" in stdout3
    code, stdout4, err = run("evaluate", "--model", out, "--split", "val", "--limit", 8, "--beam", 1, "--json",
                             "--output", tmp_path / "hyps.en")
    assert code == 0 and json.loads(stdout4)["bleu"] == pytest.approx(s["bleu"]), err
    hyps = (tmp_path / "hyps.en").read_text().splitlines()
    from transformer.evaluation import score
    assert len(hyps) == 8 and score(hyps, [p[1] for p in pairs])["bleu"] == pytest.approx(s["bleu"])


def test_resume_continues_and_refuses_changes(trained, sliced, tmp_path):
    """--resume continues a run and refuses to change it; a run directory that another process holds is refused
    until that process ends, however it ends (the operating system frees the lock); and a metrics line that a kill
    cut short is dropped on resume. One resume shows the last three: each resume trains and evaluates again."""
    out = tmp_path / "copy"
    shutil.copytree(trained[0], out)
    code, out_, err = run(*TRAIN, *sliced, "--out", out)
    assert_one_line_error(code, out_, err, 1, "already holds a run; add --resume")
    config = (out / "config.json").read_bytes()
    code, out_, err = run(*TRAIN, *sliced, "--out", out, "--resume", "--warmup", 7, "--dropout", 0.2)
    assert_one_line_error(code, out_, err, 1, "--resume with a different config")
    assert "warmup=7" in err and "dropout=0.2" in err and (out / "config.json").read_bytes() == config
    holder = _hold(out)                                             # a second process, while a run holds it
    try:
        code, stdout, err = run(*[a if a != 24 else 30 for a in TRAIN], *sliced, "--out", out, "--resume")
        assert_one_line_error(code, stdout, err, 1, f"is in use by another run (pid {holder})")
    finally:
        _release(holder)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 2')              # the run was killed while writing this line
    code, stdout, err = run(*[a if a != 24 else 30 for a in TRAIN], *sliced, "--out", out, "--resume")  # the OS freed it
    assert code == 0, err
    assert "metrics.jsonl: dropped its last line, cut short" in err
    assert json.loads((out / "results.json").read_text())["steps"] == 30
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 30   # as resumed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
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
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "s.de").write_text("Ein Hund.\n")
    (tmp_path / "r.en").write_text("A dog.\n")
    (tmp_path / "escape").mkdir()                            # results.json names a file elsewhere
    (tmp_path / "escape" / "results.json").write_text(json.dumps({"checkpoint": "../foreign/best"}))
    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / "config.json").write_text("{}")
    (tmp_path / "stub" / "tokenizer.model").write_bytes(b"x")
    (tmp_path / "halfrun").mkdir()
    torch.save({}, tmp_path / "halfrun" / "last.pt")
    # issue 28: files that claim to be what they are not
    from transformer.engine.checkpoints import CHECKPOINT_FORMAT
    from transformer.model import Transformer, TransformerConfig
    config = TransformerConfig.preset("tiny", src_vocab=20, tgt_vocab=20)
    good = {"format": CHECKPOINT_FORMAT, "model_config": config.to_dict(),
            "model": Transformer(config).state_dict()}
    edits = {"runstr": {"run": "tokenizer"},                                          # "run" is a string
             "int8": {"model": {k: v.to(torch.int8) for k, v in good["model"].items()}},
             "shape": {"model": {**good["model"], "generator.bias": torch.zeros(3)}},
             "missing": {"model": {k: v for k, v in good["model"].items() if "decoder" not in k}}}
    for name, edit in edits.items():
        (tmp_path / name).mkdir()
        torch.save({**good, **edit}, tmp_path / name / "best.pt")
        (tmp_path / name / "tokenizer.model").write_bytes(b"x")
    (tmp_path / "listconfig").mkdir()
    (tmp_path / "listconfig" / "config.json").write_text("[1, 2]")
    for name in ("listconfig", "dirckpt", "exported", "evil"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "tokenizer.model").write_bytes(b"x")
    (tmp_path / "listconfig" / "best.pt").write_bytes(b"x")
    (tmp_path / "dirckpt" / "best.pt").mkdir()                                      # a directory named best.pt
    torch.save(good, tmp_path / "exported" / "best.pt")
    (tmp_path / "exported" / "results.json").write_text(json.dumps({"weights_sha256": "0" * 64}))
    torch.save({"format": CHECKPOINT_FORMAT, "model": _Evil()}, tmp_path / "evil" / "best.pt")
    (tmp_path / "stbad").mkdir()                                   # issue 29: an exported model's safetensors
    (tmp_path / "stbad" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    (tmp_path / "stbad" / "tokenizer.model").write_bytes(b"x")


class _Evil:
    "A pickle that runs code when it is loaded without weights_only."
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


BAD = [  # (what, argv, exit code, part of the message)
    ("unknown preset", ["train", "--preset", "huge"], 2, "invalid choice: 'huge'"),
    ("zero steps", ["train", "--max-steps", "0"], 2, "0 must be > 0"),
    ("not a number", ["train", "--max-minutes", "soon"], 2, "'soon' is not a number"),
    ("steps past a C int", ["train", "--max-steps", "2147483648"], 2, "2147483648 is too large (at most 2147483647)"),
    ("400-digit threads", ["translate", "--model", "m", "--threads", "9" * 400, "x"], 2, "is too large (at most 2147483647)"),
    ("no command", [], 2, "required: {train,translate,evaluate,export,plot,attend,bench,sweep,prepare}"),
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
    # issue 18: every flag checked before any work, in the flag's words
    ("dropout out of range", ["train", "--dropout", "1.5"], 2, "argument --dropout: 1.5 must be in [0, 1)"),
    ("dropout not a number", ["train", "--dropout", "nan"], 2, "argument --dropout: nan must be in [0, 1)"),
    ("label smoothing out of range", ["train", "--label-smoothing", "-0.1"], 2, "-0.1 must be in [0, 1)"),
    ("attention dropout out of range", ["train", "--attention-dropout", "1"], 2,
     "argument --attention-dropout: 1 must be in [0, 1)"),
    ("ffn dropout out of range", ["train", "--ffn-dropout", "-0.2"], 2, "argument --ffn-dropout: -0.2 must be in [0, 1)"),
    ("subword dropout out of range", ["train", "--subword-dropout", "1"], 2,
     "argument --subword-dropout: 1 must be in [0, 1)"),
    ("negative clip norm", ["train", "--clip-norm", "-1"], 2, "argument --clip-norm: -1 must be >= 0"),
    ("negative length penalty", ["translate", "--model", "TMP/empty", "--alpha", "-1", "x"], 2,
     "argument --alpha: -1 must be in [0, 10]"),
    # issue 28: limits on what one command may allocate, paths that stay inside the run
    ("huge length penalty", ["translate", "--model", "TMP/empty", "--alpha", "1e308", "x"], 2,
     "argument --alpha: 1e308 must be in [0, 10]"),
    ("huge beam", ["translate", "--model", "TMP/empty", "--beam", "8000", "x"], 2,
     "argument --beam: 8000 must be in [1, 64]"),
    ("huge beam (evaluate)", ["evaluate", "--model", "TMP/empty", "--beam", "100000"], 2,
     "argument --beam: 100000 must be in [1, 64]"),
    ("huge beam (attend)", ["attend", "--model", "TMP/empty", "--beam", "65", "x"], 2,
     "argument --beam: 65 must be in [1, 64]"),
    ("--output over the source", ["evaluate", "--model", "TMP/empty", "--src-file", "TMP/s.de", "--ref-file",
                                  "TMP/r.en", "--output", "TMP/s.de"], 1,
     "s.de is also an input of this command; write the output to another file"),
    ("--output over the run's weights", ["evaluate", "--model", "TMP/corrupt", "--output", "TMP/corrupt/best.pt"],
     1, "best.pt would overwrite a file of the run directory"),
    ("checkpoint outside the run", ["translate", "--model", "TMP/escape", "x"], 1,
     "results.json: \"checkpoint\" is '../foreign/best', not one of best, last, averaged; fix the file"),
    ("negative average", ["train", "--average", "-2"], 2, "argument --average: -2 must be >= 0"),
    ("infinite learning rate", ["train", "--lr-scale", "inf"], 2, "inf must be > 0"),
    ("--out is a file", ["train", "--out", "TMP/afile"], 1, "afile is a file, not a directory; pass a directory"),
    ("another run's files", ["train", "--out", "TMP/stub"], 1,
     "holds files of another run (config.json, tokenizer.model) but no last.pt"),
    ("resume without its tokenizer", ["train", "--resume", "--out", "TMP/halfrun"], 1,
     "has last.pt but no config.json; it is not a whole run directory"),
    ("averaged asked, absent", ["translate", "--model", "TMP/corrupt", "--checkpoint", "averaged", "x"], 1,
     "holds no averaged.pt (train --average N writes it); use --checkpoint best (best.pt)"),
    # issue 15: the model shape flags, in the flags' words, before any work
    ("d_model not divisible by heads", ["train", "--preset", "tiny", "--d-model", "100", "--heads", "3", "--out", "TMP/r"],
     1, "error: --d-model 100 is not divisible by --heads 3; choose"),
    ("heads do not divide the preset's d_model", ["train", "--preset", "tiny", "--heads", "128", "--out", "TMP/r"], 1,
     "--d-model 64 is not divisible by --heads 128"),
    ("odd d_model", ["train", "--d-model", "34", "--heads", "2", "--d-model", "33", "--heads", "3", "--out", "TMP/r"], 1,
     "error: --d-model 33 must be even"),
    ("zero d_k", ["train", "--d-k", "0"], 2, "argument --d-k: 0 must be > 0"),
    ("fractional d_k", ["train", "--d-k", "2.5"], 2, "argument --d-k: '2.5' is not a number"),
    ("zero heads", ["train", "--heads", "0"], 2, "argument --heads: 0 must be > 0"),
    ("zero layers", ["train", "--layers", "0"], 2, "argument --layers: 0 must be > 0"),
    ("negative d_ff", ["train", "--d-ff", "-1"], 2, "argument --d-ff: -1 must be > 0"),
    ("zero d_model", ["train", "--d-model", "0"], 2, "argument --d-model: 0 must be > 0"),
    ("unknown positions", ["train", "--positions", "rope"], 2,
     "argument --positions: invalid choice: 'rope' (choose from 'sinusoidal', 'learned', 'none')"),
    ("unknown norm", ["train", "--norm", "middle"], 2, "argument --norm: invalid choice: 'middle' (choose from 'pre', 'post')"),
    ("--output is a directory", ["evaluate", "--model", "TMP/empty", "--output", "TMP/empty"], 1,
     "empty: name a file in an existing directory"),
    # issue 28 (3, 4, 7, 9): weights are what they claim; damaged files are one line that keeps the reason
    ("config.json holds a list", ["translate", "--model", "TMP/listconfig", "x"], 1,
     "config.json holds a list, not a JSON object"),
    ("checkpoint's run is a string", ["translate", "--model", "TMP/runstr", "x"], 1,
     "best.pt: its \"run\" record is a str, not a dictionary"),
    ("int8 weights", ["translate", "--model", "TMP/int8", "x"], 1,
     "tensor src_embed.embedding.weight is (20, 64) torch.int8, but the checkpoint's config makes it "
     "(20, 64) torch.float32"),
    ("a tensor of another shape", ["translate", "--model", "TMP/shape", "x"], 1,
     "tensor generator.bias is (3,) torch.float32, but the checkpoint's config makes it (20,) torch.float32"),
    ("tensors missing", ["translate", "--model", "TMP/missing", "x"], 1, "does not hold this model's tensors: "),
    ("a directory named best.pt", ["translate", "--model", "TMP/dirckpt", "x"], 1,
     "best.pt is a directory, not a checkpoint file"),
    ("exported weights replaced", ["translate", "--model", "TMP/exported", "x"], 1,
     "best.pt is not the file that was exported (sha256 "),
    ("last.pt of an exported model", ["translate", "--model", "TMP/exported", "--checkpoint", "last", "x"], 1,
     "is an exported model: it holds one checkpoint, best.pt, and no last.pt; use --checkpoint best"),
    ("a pickle that runs code", ["translate", "--model", "TMP/evil", "x"], 1,
     "refused without running any (torch: Trying to load unsupported GLOBAL posix.system whose module posix is "
     "blocked.)"),
    ("a directory as the source file", ["evaluate", "--model", "TMP/empty", "--src-file", "TMP/empty", "--ref-file",
                                        "TMP/r.en"], 1, "empty: a directory, not a file; name a file in it"),
    ("a damaged model.safetensors", ["translate", "--model", "TMP/stbad", "x"], 1,
     "model.safetensors is not a readable weights file of this package (SafetensorError: "),
    ("last.pt of a shipped model", ["translate", "--model", "TMP/stbad", "--checkpoint", "last", "x"], 1,
     "is an exported model: it holds one checkpoint, model.safetensors, and no last.pt; use --checkpoint best"),
    ("missing source file, checked before the model", ["evaluate", "--model", "TMP/empty", "--src-file", "TMP/no.de",
                                                       "--ref-file", "TMP/no.en"], 1, "no.de: no such file"),
]


@pytest.mark.parametrize("what, argv, code, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_nonzero(tmp_path, monkeypatch, what, argv, code, match):
    _broken_runs(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    got = run(*[a.replace("TMP", str(tmp_path)) for a in argv])
    assert_one_line_error(*got, code, match)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before, "a refused command left files behind"


def test_help_lists_every_command(capsys, monkeypatch):
    "Issue 42: `python -m transformer --help` names every command `main` runs (prepare was missing), each with its help."
    import argparse

    from transformer.__main__ import OWN_PARSERS, commands
    from transformer.cli.commands import build_parser
    monkeypatch.setenv("COLUMNS", "200")   # one line a command
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    registered = [*commands(), *OWN_PARSERS]
    assert "prepare" in registered
    listed = dict(line.split(None, 1) for line in out.splitlines()
                  if line.startswith("    ") and not line.startswith("     ") and len(line.split(None, 1)) == 2)
    for name in registered:
        assert len(listed.get(name, "").split()) >= 3, (name, out)   # listed, with a description
    # and the parser knows no command that main does not run
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(registered)


@pytest.mark.parametrize("command", ["bench", "sweep", "prepare"])
def test_run_command_sends_bench_and_sweep_to_the_entry_point(capsys, command):
    "cli.commands may not import bench, sweep or prepare (later sections): run_command names where they run."
    from transformer.cli.commands import run_command
    assert run_command([command], {}) == 1
    assert capsys.readouterr().err == (f"error: {command} runs through the package entry point: "
                                       f"python -m transformer {command} --help\n")


BUGS = [  # (what the command raises, exit code, the last line of stderr, a traceback above it)
    (TypeError("unsupported operand"), 70, "error: this is a bug in the transformer package, not in your input "
     "(TypeError); please report it with the traceback above", True),
    (KeyError("w_q"), 70, "(KeyError); please report it", True),
    (DataError("val.de.gz: no such file; check the path"), 1, "error: val.de.gz: no such file; check the path", False),
    (MemoryError(), 1, "error: out of memory (MemoryError); lower --beam, or translate shorter sentences", False),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 5368709120 bytes."), 1, "can't allocate memory: you tried to allocate 5368709120 bytes.); "
     "lower --beam, or translate shorter sentences", False),
    (PermissionError(13, "Permission denied", "out.en"), 1, "error: [Errno 13] Permission denied: 'out.en'", False),
]


@pytest.mark.parametrize("raised, code, last, traceback", BUGS, ids=[type(b[0]).__name__ for b in BUGS])
def test_a_bug_shows_its_traceback_and_a_user_error_one_line(monkeypatch, raised, code, last, traceback):
    "Issue 28 (10): only user errors, the machine's OSErrors and running out of memory are one line."
    from transformer.cli import use as cli_use

    def fail(args):
        raise raised
    monkeypatch.setattr(cli_use, "cmd_translate", fail)
    got, out, err = run("translate", "--model", ROOT / "book" / "model", "Ein Hund.")
    assert got == code and out == "", err
    assert err.splitlines()[-1].startswith("error: ") and last in err.splitlines()[-1], err
    assert ("Traceback (most recent call last)" in err) == traceback, err
    if not traceback:
        assert err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["bench", "sweep"])
def test_bench_and_sweep_report_like_main(monkeypatch, capsys, command):
    "`python -m transformer bench|sweep` go around run_command (hand-written __main__.py), through the same report."
    import importlib

    from transformer.__main__ import main as entry
    from transformer.engine.checkpoints import RunDirectoryError
    module = importlib.import_module(f"transformer.cli.{command}")
    for raised, code in ((AttributeError("'NoneType' object has no attribute 'pid'"), 70),
                         (RunDirectoryError("runs/a is in use by another run (pid 7)"), 1)):
        monkeypatch.setattr(module, "main", lambda argv, raised=raised: (_ for _ in ()).throw(raised))
        assert entry([command, "x"]) == code
        err = capsys.readouterr().err
        assert ("Traceback" in err) == (code == 70), err
        assert err.splitlines()[-1].startswith("error: "), err


def test_output_is_utf8_where_python_chose_another_encoding(monkeypatch):
    """Windows gives a stdout redirected to a file or a pipe its code page (cp1252): `translate > out.txt` stopped
    with UnicodeEncodeError at a character cp1252 lacks (sentencepiece's ⁇), and wrote cp1252 where the package reads
    UTF-8. main writes UTF-8 there; a terminal keeps its encoding, with '?' for what it cannot show."""
    import transformer.__main__ as entry
    said = "Ein Hund läuft über ⁇"

    class Terminal(io.TextIOWrapper):
        def isatty(self):
            return True

    def translate(args):
        print(said)
        print(said, file=sys.stderr)
        return 0
    monkeypatch.setattr(entry, "commands", lambda: {"translate": translate})
    for kind, encoding, shown in ((io.TextIOWrapper, "utf-8", said), (Terminal, "cp1252", said[:-1] + "?")):
        out, err = (kind(io.BytesIO(), encoding="cp1252") for _ in range(2))
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        assert entry.main(["translate", "--model", "m", "x"]) == 0
        for stream in (out, err):
            stream.flush()
            assert stream.buffer.getvalue().decode(encoding) == shown + os.linesep


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")   # inductor's import
def test_compile_without_a_cxx_compiler_is_one_line(monkeypatch, capsys):
    """torch.compile on a CPU builds C++ kernels: Windows without Visual Studio's cl on PATH (or a Mac whose compiler
    lacks OpenMP) has none, and `train --compile` ended as "a bug in the transformer package", with a traceback. Here
    inductor is pointed at a compiler that does not exist, and its real error goes to `report`."""
    import torch._inductor.config as inductor

    from transformer.cli.commands import report
    monkeypatch.setattr(inductor.cpp, "cxx", ("no-such-c++",))
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as raised:
            torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8))
    finally:
        torch._dynamo.reset()
    assert report(raised.value, "train") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: --compile found no working C++ compiler (") and "drop --compile" in err, err


def test_attend_help_states_the_limits_plots_enforces(capsys):
    "Issue 28 (6): the limits are stated in --help; plots.py holds the numbers (cli.py may not import matplotlib)."
    plots = pytest.importorskip("transformer.figures.plots")
    assert main(["attend", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (f"at most {plots.MAX_PIECES} pieces a side and {plots.MAX_PIXELS:,} pixels ({plots.MAX_SIDE:,} a side)"
            in text), text


@pytest.mark.slow
def test_a_modified_corpus_is_refused_unless_asked_for(tmp_path):
    "Issue 28 (8): val.de.gz shifted by one line (same line count) was scored against misaligned references."
    import gzip
    data = tmp_path / "multi30k"
    data.mkdir()
    shared = Path(load_multi30k.__globals__["multi30k_dir"]())
    lines = gzip.decompress((shared / "val.de.gz").read_bytes()).decode().splitlines()
    (data / "val.de.gz").write_bytes(gzip.compress(("\n".join(lines[1:] + lines[:1]) + "\n").encode()))
    shutil.copy(shared / "val.en.gz", data / "val.en.gz")
    argv = ["evaluate", "--model", ROOT / "book" / "model", "--split", "val", "--data", tmp_path, "--limit", 2,
            "--beam", 1, "--no-download"]
    code, out, err = run(*argv)
    assert_one_line_error(code, out, err, 1, "val.de.gz differs from the original Multi30k file (sha256 ")
    assert err.rstrip().endswith("set TRANSFORMER_DATA_UNVERIFIED=1 (or pass --unverified-data)"), err
    code, out, err = run(*argv, "--unverified-data")
    assert code == 0 and "BLEU" in out, err


def test_tampered_shipped_weights_are_refused(tmp_path):
    "Issue 28 (4): 64 flipped bytes in the middle of the shipped weights translated silently to nonsense."
    model = tmp_path / "model"
    shutil.copytree(ROOT / "book" / "model", model)
    data = bytearray((model / "model.safetensors").read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    (model / "model.safetensors").write_bytes(bytes(data))
    code, out, err = run("translate", "--model", model, "Ein Hund.")
    assert_one_line_error(code, out, err, 1, "model.safetensors is not the file that was exported (sha256 ")
    assert "recorded in results.json): it is damaged or was replaced" in err


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    "Root writes anywhere, so the read-only place is simulated: the error comes before the model loads."
    _broken_runs(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    got = run("evaluate", "--model", tmp_path / "corrupt", "--output", tmp_path / "out.en")
    assert_one_line_error(*got, 1, "out.en: not writable here; choose another place")


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


@pytest.mark.slow
def test_python_dash_m_runs_main(monkeypatch, capsys):
    "`python -m transformer` runs main and exits with its code: --help as `-m` runs it here, a bad line in a real process."
    import runpy
    monkeypatch.setattr(sys, "argv", ["transformer", "--help"])
    monkeypatch.delitem(sys.modules, "transformer.__main__")        # run afresh, as -m does (put back after)
    with pytest.raises(SystemExit) as ok:
        runpy.run_module("transformer", run_name="__main__", alter_sys=True)
    assert ok.value.code == 0 and "train" in capsys.readouterr().out
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "transformer", "train", "--preset", "huge"], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_keep_freed_memory_applies_on_glibc():
    import platform

    from transformer.cli.commands import keep_freed_memory
    assert keep_freed_memory() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


# what `train` runs in a fresh process: import the whole command line, cap the oneDNN kernel cache, then multiply
# three matrices of shapes A, B, A; oneDNN's verbose mode says whether the third found its kernel in the cache
_CACHE_PROBE = """
import os, sys, torch
import transformer.__main__, transformer.cli.commands, transformer.cli.train, transformer.cli.sweep  # noqa: F401
from transformer.cli.commands import cap_kernel_cache
print("set" if cap_kernel_cache(int(sys.argv[1])) else "kept", flush=True)
for n in (8, 16, 8):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(torch.randn(n, 64), torch.randn(32, 64))
"""


def _kernel_cache(capacity: int, **env) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if "PRIMITIVE_CACHE_CAPACITY" not in k} | env
    done = subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(capacity)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT), "ONEDNN_VERBOSE": "profile_create"}, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return lines[0], [m for line in lines for m in ("cache_hit", "cache_miss") if f"create:{m}" in line]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build of torch")
@pytest.mark.slow
def test_cap_kernel_cache_takes_effect_after_importing_the_package_and_yields_to_the_user():
    # oneDNN's default (1024), set by the user: the third multiplication reuses the first one's kernel
    said, events = _kernel_cache(1, ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    if not events:
        pytest.skip("bf16 matmuls on this CPU do not go through oneDNN")
    assert said == "kept" and events == ["cache_miss", "cache_miss", "cache_hit"]
    # capacity 1, set by cap_kernel_cache: the kernel of shape A is evicted by B's and compiled again
    assert _kernel_cache(1) == ("set", ["cache_miss"] * 3)


def test_cap_kernel_cache_yields_to_the_older_name_of_the_variable(monkeypatch):
    "The older name of the variable counts as the user's choice too (read from os.environ: no fresh process needed)."
    from transformer.cli.commands import cap_kernel_cache
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert cap_kernel_cache(1) is False
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ and os.environ["DNNL_PRIMITIVE_CACHE_CAPACITY"] == "1024"


# --- issue 18: careless and hostile use of a real run directory --------------------------------------------------

def _copy(trained, tmp_path, name="copy"):
    out = tmp_path / name
    shutil.copytree(trained[0], out)
    return out


def _forked(*argv) -> tuple[int, int]:
    """`run(*argv)` in a child forked from this process: a second process that imports nothing again (torch and
    the package come with the fork; `python -m transformer` itself is test_python_dash_m_runs_main's, and the
    sweep's children's in tests/test_sweep.py). Returns its pid and the read end of a pipe on which it writes
    (exit code, stdout, stderr) as JSON; `_joined` reads it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                                   # the child: never returns into pytest
        try:
            os.close(read)
            with os.fdopen(write, "w") as said:
                json.dump(run(*argv), said)
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def _joined(child: tuple[int, int], timeout=600) -> tuple[int, str, str]:
    "What the child of `_forked` wrote, once it ended (killed after `timeout` seconds)."
    import select
    pid, read = child
    try:
        if not select.select([read], [], [], timeout)[0]:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the forked run did not end within {timeout} s")
        with os.fdopen(read) as said:
            text = said.read()
    finally:
        os.waitpid(pid, 0)
    assert text, "the forked run ended without a result"
    return tuple(json.loads(text))


def test_foreign_tokenizer_is_refused(trained, sliced, tmp_path):
    "A tokenizer.model from another run with the same vocabulary size: refused by translate, evaluate and --resume."
    from transformer.tokens import Tokenizer
    out = _copy(trained, tmp_path)
    texts = [p[1] + " " + p[0] for p in load_multi30k("de", "en", "val", download=False)]
    other = Tokenizer.train(list(reversed(texts)), 1000)
    assert other.vocab_size == 1000
    other.save(out / "tokenizer.model")
    for argv in (["translate", "--model", out, "Ein Hund."], ["evaluate", "--model", out, "--split", "val"],
                 [*TRAIN, *sliced, "--out", out, "--resume"]):
        code, stdout, err = run(*argv)
        assert_one_line_error(code, stdout, err, 1, "tokenizer.model is not the tokenizer")
        assert "sha256" in err and "different runs" in err


def test_nan_weights_are_an_error(trained, tmp_path):
    out = _copy(trained, tmp_path)
    for name in ("best.pt", "averaged.pt"):
        state = torch.load(out / name, weights_only=True)
        state["model"]["generator.bias"] = torch.full_like(state["model"]["generator.bias"], float("nan"))
        torch.save(state, out / name)
    code, stdout, err = run("translate", "--model", out, "Ein Hund.")
    assert_one_line_error(code, stdout, err, 1, "holds NaN or infinite weights (generator.bias)")


def test_absurd_config_is_refused_before_allocating(trained, tmp_path):
    out = _copy(trained, tmp_path)
    for name in ("best.pt", "averaged.pt"):
        state = torch.load(out / name, weights_only=True)
        state["model_config"].update(d_model=2**16, d_ff=2**20, n_layers=512, h=1)
        torch.save(state, out / name)
    code, stdout, err = run("translate", "--model", out, "Ein Hund.")
    assert_one_line_error(code, stdout, err, 1, "describes a model of about")
    assert "GiB" in err and "more than this machine's" in err


def test_missing_averaged_falls_back_to_best(trained, tmp_path):
    out = _copy(trained, tmp_path)
    results = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({**results, "checkpoint": "averaged"}))
    (out / "averaged.pt").unlink()
    code, stdout, err = run("translate", "--model", out, "--beam", 1, "Ein Hund läuft.")
    assert code == 0 and stdout.strip(), err
    assert err.strip() == f"warning: {out / 'results.json'} chose averaged.pt, which is missing; using best.pt"
    assert stdout == run("translate", "--model", out, "--beam", 1, "--checkpoint", "best", "Ein Hund läuft.")[1]


def test_invalid_utf8_on_stdin(trained):
    class BytesStdin(io.StringIO):
        buffer = io.BytesIO("Ein Hund.\nFu\xdfball\n".encode("latin-1"))
    old = sys.stdin
    sys.stdin = BytesStdin()
    try:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["translate", "--model", str(trained[0])])
    finally:
        sys.stdin = old
    assert_one_line_error(code, out.getvalue(), err.getvalue(), 1,
                          "stdin line 2 is not valid UTF-8 (byte b'\\xdf' at column 3)")


def test_damaged_metrics_line_names_file_and_line(trained, sliced, tmp_path):
    out = _copy(trained, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, stdout, err = run(*[a if a != 24 else 28 for a in TRAIN], *sliced, "--out", out, "--resume")
    assert_one_line_error(code, stdout, err, 1, "metrics.jsonl, line 2: not a metrics record")


def test_batch_tokens_too_small_fails_before_the_tokenizer(sliced, tmp_path):
    out = tmp_path / "r"
    code, stdout, err = run(*TRAIN, *sliced, "--batch-tokens", 1, "--out", out)
    assert_one_line_error(code, stdout, err, 1, "--batch-tokens 1 is too small: the longest training pair needs at least")
    assert "use --batch-tokens" in err and "the tiny preset uses 3000" in err
    assert not out.exists()


def test_disk_full_while_saving(trained, sliced, tmp_path, monkeypatch):
    "Every write raises ENOSPC: one line, no temp file left, last.pt as it was, exit code 1."
    import errno
    out = _copy(trained, tmp_path)
    before = (out / "last.pt").read_bytes()

    def full_disk(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    code, stdout, err = run(*[a if a != 24 else 36 for a in TRAIN], *sliced, "--out", out, "--resume")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: no space left on the device while saving {out}/step-0000030.pt; nothing was written")
    assert not list(out.glob(".*.tmp")) and not (out / ".lock").exists()
    assert (out / "last.pt").read_bytes() == before


def test_save_checkpoint_on_a_full_tmpfs(tmp_path):
    "The same with a real full file system (a 64 KiB tmpfs), where the machine lets us mount one."
    import errno

    from transformer.engine.checkpoints import SaveError, load_checkpoint, save_checkpoint
    from transformer.model import Transformer, TransformerConfig
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        small = Transformer(TransformerConfig(src_vocab=10, tgt_vocab=10, d_model=8, d_ff=16, h=2, n_layers=1, max_len=16))
        save_checkpoint(disk / "last.pt", small)
        big = Transformer(TransformerConfig(src_vocab=2000, tgt_vocab=2000, d_model=64, d_ff=256, h=2, n_layers=1))
        with pytest.raises(SaveError, match=r"no space left on the device while saving .*last\.pt; the previous "
                                            r"last\.pt is intact") as e:
            save_checkpoint(disk / "last.pt", big)
        assert e.value.errno == errno.ENOSPC and str(e.value).count("\n") == 0
        assert sorted(p.name for p in disk.iterdir()) == ["last.pt"]
        assert load_checkpoint(disk / "last.pt")["model_config"]["d_model"] == 8
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_two_trainings_into_one_directory(sliced, tmp_path):
    """Started together: one trains, the other is refused with one line; the run left is whole and consistent. One
    runs in another process (forked from this one, `_forked`), the other meanwhile in this one."""
    out = tmp_path / "both"
    fr_en = _forked(*SHORT, *sliced, "--src", "fr", "--out", out)  # 3 steps: the claim needs no more
    results = [run(*SHORT, *sliced, "--out", out)]                  # de-en, while fr-en starts
    results.append(_joined(fr_en))
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 1], results
    code, _, err = next(r for r in results if r[0] == 1)
    assert err.count("\n") == 1 and ("is in use by another run (pid" in err or "already holds a run" in err
                                     or "holds files of another run" in err), err
    config = json.loads((out / "config.json").read_text())
    from transformer.engine.checkpoints import load_checkpoint
    state = load_checkpoint(out / "last.pt")
    from transformer.data import sha256_file
    assert state["run"]["tokenizer_sha256"] == sha256_file(out / "tokenizer.model")
    assert config["data"]["src"] in ("de", "fr") and not list(out.glob(".*.tmp"))


# SIGTERM to `python -m transformer train` in a process of its own (it saves last.pt, exits 143 and says how to
# continue): tests/test_sweep.py's test_a_stopped_sweep_resumes_its_variant, whose sweep sends it to its train child


def _safetensors(path):
    "The tensors and the metadata of a safetensors file, read without this package."
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["transformer-book"])


def test_export_writes_a_model_as_the_field_ships_one(trained, tmp_path):
    "Issue 29: model.safetensors (float16, tied tensors once), config.json, tokenizer.model, results.json, a card."
    from transformer.data import sha256_file
    from transformer.engine.checkpoints import load_checkpoint
    out = tmp_path / "model"
    code, stdout, err = run("export", "--model", trained[0], "--out", out)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "results.json",
                                                     "tokenizer.model"]
    info = json.loads((out / "results.json").read_text())
    chosen = json.loads((trained[0] / "results.json").read_text())["checkpoint"]
    assert info["weights_sha256"] == sha256_file(out / "model.safetensors") and info["dtype"] == "float16"
    assert info["source_checkpoint"] == f"{chosen}.pt" and info["source_results"]["bleu"] >= 0
    tensors, meta = _safetensors(out / "model.safetensors")
    assert all(v.dtype == torch.float16 for v in tensors.values() if v.is_floating_point())
    full = load_checkpoint(trained[0] / f"{chosen}.pt")["model"]
    assert set(tensors) | set(meta["tied"]) == set(full) and not set(tensors) & set(meta["tied"])
    assert all(torch.allclose(tensors[meta["tied"].get(k, k)].float(), v, rtol=1e-3, atol=1e-4)
               for k, v in full.items() if v.is_floating_point())
    assert (out / "model.safetensors").stat().st_size < 0.6 * (trained[0] / f"{chosen}.pt").stat().st_size
    card = (out / "README.md").read_text()
    assert f"sha256 `{info['weights_sha256']}`" in card and "nrefs:1|case:mixed|eff:no|tok:13a" in card
    code, stdout, err = run("translate", "--model", out, "--beam", 1, "Ein Hund läuft.")
    assert code == 0 and stdout.strip(), err
    assert stdout == run("translate", "--model", trained[0], "--beam", 1, "Ein Hund läuft.")[1]
    again = tmp_path / "again"                                            # an export of the export: the same bytes
    assert run("export", "--model", out, "--out", again)[0] == 0
    assert sha256_file(again / "model.safetensors") == info["weights_sha256"]
    code, stdout, err = run("export", "--model", trained[0], "--out", out)
    assert_one_line_error(code, stdout, err, 1, "exists and is not an empty directory")


@pytest.mark.slow
def test_the_shipped_model_translates_on_a_fresh_clone():
    "book/model: float16 safetensors whose sha256 is recorded and checked, a model card, no training needed."
    from transformer.data import sha256_file
    model_dir = ROOT / "book" / "model"
    info = json.loads((model_dir / "results.json").read_text())
    assert sorted(p.name for p in model_dir.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                           "results.json", "test_2016_flickr.beam4.en",
                                                           "tokenizer.model", "web"]
    assert info["weights_sha256"] == sha256_file(model_dir / "model.safetensors")
    assert info["tokenizer_sha256"] == sha256_file(model_dir / "tokenizer.model")
    tensors, meta = _safetensors(model_dir / "model.safetensors")
    assert info["dtype"] == "float16" and all(v.dtype == torch.float16 for v in tensors.values())
    assert meta["tokenizer_sha256"] == info["tokenizer_sha256"]
    assert (model_dir / "model.safetensors").stat().st_size < 20 * 2**20
    assert info["weights_sha256"] in (model_dir / "README.md").read_text()
    code, stdout, err = run("translate", "--model", model_dir, "Ein Hund läuft im Schnee.")
    assert code == 0 and err == "", err
    assert "dog" in stdout and "snow" in stdout, stdout
    import transformer  # the Python API of issue 29
    assert "dog" in transformer.load(model_dir).translate(["Ein Hund läuft im Schnee."])[0]


# --- issue 15: the model shape flags -------------------------------------------------------------------------------

# small on purpose: 3 steps, 4 sentences scored (an untrained model writes to the length cap)
SHORT = ["train", "--preset", "tiny", "--max-steps", 3, "--eval-every", 3, "--eval-sentences", 4, "--vocab-size", 300,
         "--batch-tokens", 600, "--beam", 1, "--threads", 1, "--quiet", "--no-download"]
SHAPE = ["--d-model", 32, "--d-ff", 48, "--heads", 2, "--d-k", 8, "--layers", 1, "--positions", "learned",
         "--norm", "post"]


@pytest.mark.parametrize("flags, want", [
    ([], dict(d_model=64, d_ff=256, h=4, d_k=None, n_layers=2, positions="sinusoidal", norm_first=False)),
    (["--d-model", "32", "--heads", "2"], dict(d_model=32, h=2, d_k=None, d_ff=256)),
    (["--d-ff", "100", "--layers", "3"], dict(d_ff=100, n_layers=3, d_model=64)),
    (["--d-k", "5"], dict(d_k=5, h=4, d_model=64)),
    (["--positions", "none"], dict(positions="none")),
    (["--positions", "learned", "--norm", "pre"], dict(positions="learned", norm_first=True)),
    (["--preset", "small", "--norm", "post"], dict(norm_first=False, d_model=256)),
    (["--preset", "small"], dict(norm_first=True)),                   # the small preset is pre-LN
    (["--attention-dropout", "0.1", "--ffn-dropout", "0.2"], dict(attention_dropout=0.1, ffn_dropout=0.2, dropout=0.1)),
])
def test_shape_flags_set_the_model_config(flags, want):
    from transformer.cli.commands import build_parser
    from transformer.cli.train import _configs
    args = build_parser().parse_args(["train", "--preset", "tiny", *flags])
    model_config, _ = _configs(args, 300)
    assert {k: getattr(model_config, k) for k in want} == want


@pytest.fixture(scope="module")
def shaped(sliced, tmp_path_factory):
    "A 3-step run with every shape flag set, and subword dropout (a training flag that config.json keeps as well)."
    out = tmp_path_factory.mktemp("shaped") / "run"
    with kept_state():
        code, stdout, err = run(*SHORT, *SHAPE, *sliced, "--subword-dropout", 0.1, "--out", out)
    assert code == 0, err
    return out


def test_shape_flags_reach_config_json_and_the_checkpoint(shaped):
    from transformer.engine.checkpoints import load_checkpoint, model_from_checkpoint
    from transformer.model import Transformer, TransformerConfig
    config = json.loads((shaped / "config.json").read_text())
    want = dict(d_model=32, d_ff=48, h=2, d_k=8, n_layers=1, positions="learned", norm_first=False)
    assert {k: config["model"][k] for k in want} == want
    state = load_checkpoint(shaped / "last.pt")
    assert state["model_config"] == config["model"] and "pos.embedding.weight" in state["model"]
    results = json.loads((shaped / "results.json").read_text())
    assert results["params"] == Transformer(TransformerConfig.from_dict(config["model"])).num_parameters()
    assert results["steps"] == 3 and "--d-k 8" in results["command"] and "--positions learned" in results["command"]
    model = model_from_checkpoint(shaped / "best.pt")
    assert model.encoder.layers[0].self_attn.w_q.weight.shape == (2 * 8, 32) and len(model.encoder.layers) == 1
    code, stdout, err = run("translate", "--model", shaped, "--beam", 2, "Ein Hund läuft.")
    assert code == 0 and len(stdout.splitlines()) == 1, err


@pytest.mark.slow
def test_subword_dropout_reaches_config_json_and_resume_keeps_it(shaped, sliced, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(shaped, out)                                     # `shaped` trained with --subword-dropout 0.1
    assert json.loads((out / "config.json").read_text())["train"]["subword_dropout"] == 0.1
    more = [*(a if a != 3 else 5 for a in SHORT), *SHAPE, *sliced]   # --max-steps 5
    code, out_, err = run(*more, "--out", out, "--resume")
    assert_one_line_error(code, out_, err, 1, "subword_dropout=0.0 (the run has 0.1)")
    code, _, err = run(*more, "--subword-dropout", 0.1, "--out", out, "--resume")
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["steps"] == 5


# a 3-step run of a smaller model (a faster resume), with the defaults of every field that a later version added
SMALL = ["--d-model", 32, "--heads", 2, "--d-ff", 48, "--layers", 1]


@pytest.fixture(scope="module")
def small(sliced, tmp_path_factory):
    "A 3-step run that the tests below copy and make look older."
    out = tmp_path_factory.mktemp("small") / "run"
    with kept_state():
        code, _, err = run(*SHORT, *SMALL, *sliced, "--out", out)
    assert code == 0, err
    return out


def _strip_new_fields(run_dir, checkpoints=(), subword_dropout=False):
    """Make a run look as if written before `positions` and `d_k` existed (in config.json and `checkpoints`), and with
    `subword_dropout`, before that field too (in config.json and last.pt: the run trained with its default, 0)."""
    config = json.loads((run_dir / "config.json").read_text())
    for key in ("positions", "d_k"):
        del config["model"][key]
    if subword_dropout:
        del config["train"]["subword_dropout"]
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in checkpoints:
        state = torch.load(run_dir / name, weights_only=True)
        for key in ("positions", "d_k"):
            del state["model_config"][key]
        if subword_dropout and name == "last.pt":
            del state["train_config"]["subword_dropout"]
        torch.save(state, run_dir / name)


@pytest.mark.parametrize("checkpoints", [(), ("last.pt", "best.pt")],
                         ids=["config.json", "config.json+last.pt, and from before subword dropout"])
@pytest.mark.slow
def test_resume_of_a_run_from_before_the_shape_fields(small, sliced, tmp_path, checkpoints):
    """A run whose config.json (and checkpoints) lack positions and d_k continues with --resume: they are the defaults.
    The second also lacks subword_dropout in config.json and last.pt (a run from before subword dropout resumes)."""
    out = tmp_path / "run"
    shutil.copytree(small, out)
    (out / "results.json").unlink()
    _strip_new_fields(out, checkpoints, subword_dropout=bool(checkpoints))
    more = [*SHORT, *sliced, "--max-steps", 5]                      # the last --max-steps wins
    code, _, err = run(*more, *SMALL, "--out", out, "--resume")
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["steps"] == 5
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 5
    # a shape flag that differs from the run is still refused, in the flag's words
    code, stdout, err = run(*more, *SMALL, "--positions", "none", "--out", out, "--resume")
    assert_one_line_error(code, stdout, err, 1, "--resume with a different config")
    assert "positions='none' (the run has 'sinusoidal')" in err
    code, stdout, err = run(*more, *SMALL, "--seed", 7, "--out", out, "--resume")   # the seed, named once
    assert_one_line_error(code, stdout, err, 1, "--resume with a different config")
    assert err.count("seed=7 (the run has 0)") == 1, err


# --- train --data DIR: a corpus written by `prepare` (issue 32) --------------------------------------

@pytest.fixture(scope="module")
def prepared_multi30k(multi30k_slice, tmp_path_factory):
    """The slice of Multi30k's train, its val and test prepared with a tokenizer of 1,000 pieces, as `train
    --vocab-size 1000` trains it."""
    d, out = multi30k_slice / "multi30k", tmp_path_factory.mktemp("prepared") / "corpus"
    with kept_state():
        code, stdout, err = run("prepare", "--src-files", d / "train.de.gz", "--tgt-files", d / "train.en.gz",
                                "--val-files", d / "val.de.gz", d / "val.en.gz",
                                "--test-files", d / "test_2016_flickr.de.gz", d / "test_2016_flickr.en.gz",
                                "--vocab-size", 1000, "--out", out, "--quiet")
    assert code == 0, err
    return out


ONSHARDS = ["train", "--preset", "tiny", "--max-steps", 4, "--eval-every", 4, "--eval-sentences", 4, "--beam", 1,
         "--threads", 1, "--quiet", "--log-every", 1, "--average", 0]


@pytest.fixture(scope="module")
def on_shards(prepared_multi30k, tmp_path_factory):
    "A 4-step run on the prepared corpus: (its run directory, what it printed)."
    out = tmp_path_factory.mktemp("on_shards") / "shards"
    with kept_state():
        code, stdout, err = run(*ONSHARDS, "--data", prepared_multi30k, "--out", out)
    assert code == 0, err
    return out, stdout


@pytest.mark.slow
def test_train_on_a_prepared_corpus_is_train_on_multi30ks_text(prepared_multi30k, on_shards, sliced, tmp_path):
    "The same tokenizer, the same batches and losses, the same scores: one run from text, one from the shards."
    code, _, err = run(*ONSHARDS, "--vocab-size", 1000, "--no-download", *sliced, "--out", tmp_path / "text")
    assert code == 0, err
    shards, stdout = on_shards
    assert f"pairs of {prepared_multi30k}" in stdout
    runs = [tmp_path / "text", shards]
    assert (runs[0] / "tokenizer.model").read_bytes() == (runs[1] / "tokenizer.model").read_bytes()
    logs = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    key = ("kind", "step", "loss", "nll", "tokens", "val_loss", "bleu")
    assert [[{k: x.get(k) for k in key} for x in log] for log in logs[:1]] == [
        [{k: x.get(k) for k in key} for x in log] for log in logs[1:]]
    assert len([x for x in logs[0] if x["kind"] == "train"]) == 4
    text, shards = (json.loads((r / "results.json").read_text()) for r in runs)
    assert (text["split"], shards["split"]) == ("test_2016_flickr", "test")
    assert text["bleu"] == shards["bleu"] and text["val"] == shards["val"]
    config = json.loads((runs[1] / "config.json").read_text())
    pairs = load_multi30k("de", "en", "train", data_dir=sliced[1], download=False, verify=False)
    assert config["train"]["subword_dropout"] == 0 and config["data"]["corpus_pairs"] == len(pairs) == 2000


@pytest.mark.slow
def test_resume_on_a_prepared_corpus_refuses_another_corpus(prepared_multi30k, on_shards, tmp_path):
    shutil.copytree(on_shards[0], tmp_path / "run")                  # 4 steps done; 2 more on resume
    other = tmp_path / "other"
    shutil.copytree(prepared_multi30k, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["skipped"] = 1                                          # another corpus, as far as the run can tell
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(*run(*ONSHARDS, "--max-steps", 6, "--data", other, "--out", tmp_path / "run", "--resume"),
                          1, "corpus_manifest_sha256=")
    code, _, err = run(*ONSHARDS, "--max-steps", 6, "--data", prepared_multi30k, "--out", tmp_path / "run", "--resume")
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == 6


@pytest.mark.parametrize("flags,match", [
    (["--subword-dropout", 0.2], "subword dropout segments text anew each epoch"),
    (["--vocab-size", 500], "the prepared corpus's tokenizer has 1000 pieces"),
    (["--eval-split", "test_2016_flickr"], "names a Multi30k split"),
])
@pytest.mark.slow
def test_a_prepared_corpus_refuses_what_needs_text(prepared_multi30k, tmp_path, flags, match):
    assert_one_line_error(*run(*ONSHARDS, "--data", prepared_multi30k, "--out", tmp_path / "r", *flags), 1, match)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("damage", ["truncated shard", "no val"])
def test_a_damaged_or_incomplete_prepared_corpus_is_one_line(prepared_multi30k, tmp_path, damage):
    corpus = tmp_path / "corpus"
    shutil.copytree(prepared_multi30k, corpus)
    if damage == "truncated shard":
        shard = corpus / "tgt-00000.npy"
        shard.write_bytes(shard.read_bytes()[:-100])
        match = "tgt-00000.npy: "
    else:
        manifest = json.loads((corpus / "manifest.json").read_text())
        del manifest["splits"]["val"]
        (corpus / "manifest.json").write_text(json.dumps(manifest))
        match = "holds no val pairs; run prepare again with --val-files SRC TGT"
    assert_one_line_error(*run(*ONSHARDS, "--data", corpus, "--out", tmp_path / "r"), 1, match)
