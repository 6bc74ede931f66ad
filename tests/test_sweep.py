"""Appendix C.3, sweep.py: `python -m transformer sweep`, the variant file, real tiny sweeps on Multi30k (two at
once, skipped when done, stopped by a signal and resumed, failures kept and retried, evaluate variants, --results);
the readers it shares with the chapters (`read_variants`, `run_state`, `collect`) are appendix E.1's, engine/trained.py."""
import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformer.cli.sweep import KEEP, command_line, main
from transformer.engine.checkpoints import load_checkpoint
from transformer.engine.trained import SweepError, Variant, collect, load, read_variants, run_state

ROOT = Path(__file__).resolve().parents[1]
# a one-layer tiny model, a few steps, a few sentences: each variant takes seconds on one thread
BASE = ["--preset", "tiny", "--max-steps", "6", "--eval-every", "3", "--eval-sentences", "4", "--vocab-size", "300",
        "--batch-tokens", "600", "--beam", "1", "--no-download", "--d-model", "32", "--d-ff", "64", "--layers", "1"]
BAD_SHAPE = ["--d-model", "100", "--heads", "3"]


pytestmark = pytest.mark.usefixtures("keep_threads")


def sweep(*argv):
    "sweep.main(argv) in this process: (exit code, stdout, stderr)."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def write_variants(path, variants, base=BASE):
    path.write_text(json.dumps({"base": base, "variants": variants}, indent=1))
    return path


def commands_in_log(run_dir):
    "The command lines the sweep started for a variant, in order (the `$ ...` lines of its log.txt)."
    return [line[2:] for line in (run_dir / "log.txt").read_text().splitlines() if line.startswith("$ ")]


# ---- the variant file ------------------------------------------------------------------------------------------

def entry(**kw):
    return {"name": "a", "row": "x", **kw}


BAD_FILES = [  # (what, file content or None for a missing file, part of the message)
    ("missing file", None, "cannot read the variant file"),
    ("not JSON", "{'base': []", "is not valid JSON (line 1"),
    ("a list, not an object", "[]", 'must hold a JSON object with a "variants" list'),
    ("no variants", json.dumps({"base": []}), 'must hold a JSON object with a "variants" list'),
    ("base not a list", json.dumps({"base": "--preset tiny", "variants": []}), '"base" must be a list of strings'),
    ("base holds a number", json.dumps({"base": ["--max-steps", 6], "variants": []}), '"base" must be a list'),
    ("entry not an object", json.dumps({"variants": [entry(), "b"]}), "variant 2: expected an object, got 'b'"),
    ("unknown key", json.dumps({"variants": [entry(arg=[])]}), "variant 1: unknown keys ['arg']; known: name, row"),
    ("missing row", json.dumps({"variants": [{"name": "a"}]}), 'variant 1: "name" and "row" are required'),
    ("missing name", json.dumps({"variants": [{"row": "x"}]}), 'variant 1: "name" and "row" are required'),
    ("name escapes --out", json.dumps({"variants": [entry(name="../x")]}), "variant 1: name '../x' must be a"),
    ("name with a slash", json.dumps({"variants": [entry(), entry(name="a/b")]}), "variant 2: name 'a/b' must be"),
    ("empty name", json.dumps({"variants": [entry(name="")]}), "variant 1: name '' must be a non-empty directory"),
    ("name ..", json.dumps({"variants": [entry(name="..")]}), "variant 1: name '..' must be"),
    ("name with a space", json.dumps({"variants": [entry(name="a b")]}), "variant 1: name 'a b' must be"),
    ("name not a string", json.dumps({"variants": [entry(name=3)]}), "variant 1: name 3 must be"),
    ("duplicate name", json.dumps({"variants": [entry(), entry(name="b"), entry(row="y")]}),
     "variant 3: the name 'a' is used twice"),
    ("args a string", json.dumps({"variants": [entry(args="--heads 2")]}),
     'variant 1 (a): "args" must be a list of strings'),
    ("args hold a number", json.dumps({"variants": [entry(), entry(name="b", args=["--heads", 2])]}),
     'variant 2 (b): "args" must be a list of strings'),
    ("unknown command", json.dumps({"variants": [entry(command="translate")]}),
     "variant 1 (a): command 'translate' is not one of train, evaluate"),
]


@pytest.mark.parametrize("what, text, match", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_variant_file_names_the_entry(tmp_path, what, text, match):
    path = tmp_path / "variants.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SweepError, match=None) as e:
        read_variants(path)
    assert match in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    # the command: one line, exit code 2, nothing run or created
    code, out, err = sweep(path, "--out", tmp_path / "runs")
    assert code == 2 and out == "" and err == f"error: {e.value}\n"
    assert not (tmp_path / "runs").exists()


def test_good_variant_file_and_defaults(tmp_path):
    path = write_variants(tmp_path / "v.json", [{"name": "base-s0", "row": "base"},
                                                {"name": "E_none.1", "row": "E", "args": ["--positions", "none"],
                                                 "note": "no positions"},
                                                {"name": "ev", "row": "d", "command": "evaluate", "args": []}])
    base, variants = read_variants(path)
    assert base == BASE
    assert variants == [Variant("base-s0", "base"), Variant("E_none.1", "E", ["--positions", "none"], "train",
                                                            "no positions"),
                        Variant("ev", "d", [], "evaluate")]
    path.write_text(json.dumps({"variants": []}))
    assert read_variants(path) == ([], [])


@pytest.mark.slow
def test_the_committed_variant_file_is_valid():
    "Every variant of the book's sweep parses as a train (or evaluate) command and gives a valid model config."
    from transformer.cli.commands import build_parser
    from transformer.cli.train import _configs
    base, variants = read_variants(ROOT / "book" / "results" / "claims" / "variants.json")
    assert len({v.name for v in variants}) == len(variants) > 1
    plain = _configs(build_parser().parse_args(["train", *base]), 8000)
    loaded = set()                                            # each model loaded once (7 variants share one)
    for v in variants:
        if v.command == "train":
            args = build_parser().parse_args(["train", *base, *v.args, "--out", "x"])
            # a variant with args changes something (a flag that repeats the base's value is a typo)
            assert (_configs(args, 8000) != plain) == bool(v.args), v.name
        else:
            args = build_parser().parse_args(["evaluate", *v.args, "--json"])
            if args.model not in loaded:
                assert load(ROOT / args.model).path.exists(), v.name     # a model the command can load
                loaded.add(args.model)
    assert loaded                                             # (the file has evaluate variants)


@pytest.mark.parametrize("sweep_dir", ["claims", "tuning"])
def test_the_committed_variant_files_still_ask_for_the_committed_runs(sweep_dir):
    """Each committed run's config.json is what its variant asks for with today's presets: a preset
    that changed since (dropout 0.3, subword dropout 0.2) must be pinned in the file's base, or
    "one command reproduces them" would quietly train something else."""
    from transformer.cli.commands import build_parser
    from transformer.cli.train import _configs
    results = ROOT / "book" / "results" / sweep_dir
    base, variants = read_variants(results / "variants.json")
    checked = 0
    for v in variants:
        stored = results / v.name / "config.json"
        if v.command != "train" or not stored.exists():
            continue
        config = json.loads(stored.read_text())
        args = build_parser().parse_args(["train", *base, *v.args, "--out", "x"])
        model, train = _configs(args, config["data"]["vocab_size"])
        for asked, kept in ((model, config["model"]), (train, config["train"])):
            # read as a resume reads it: a field added after the run has its default, which the run trained
            # with; one that moved (arch, now chapter 19.1's) reads as today's config
            assert type(asked).from_dict(kept) == asked, v.name
        checked += 1
    assert checked >= 2


def test_sweep_option_errors(tmp_path):
    path = write_variants(tmp_path / "v.json", [entry()])
    for argv, match in ((["--only", "a", "zz", "yy"], f"error: --only: no variant named yy, zz in {path}"),
                        (["--jobs", "0"], "error: --jobs and --threads must be >= 1"),
                        (["--threads", "0"], "error: --jobs and --threads must be >= 1")):
        code, out, err = sweep(path, "--out", tmp_path / "runs", *argv)
        assert code == 2 and out == "" and err.strip() == match, err
    assert not (tmp_path / "runs").exists()


# ---- the state of a run directory and the command that runs it ----------------------------------------------------

def test_run_state_and_command_line(tmp_path):
    run = tmp_path / "a"
    v = Variant("a", "x", ["--heads", "2"])
    assert run_state(run) == "new"
    cmd = command_line(v, ["--preset", "tiny"], run, ["--threads", "1"])
    assert cmd == [sys.executable, "-m", "transformer", "train", "--preset", "tiny", "--heads", "2", "--out", str(run),
                   "--quiet", "--threads", "1"]
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert run_state(run) == "new"                       # a stub, no checkpoint yet
    (run / "last.pt").write_bytes(b"")
    assert run_state(run) == "interrupted" and command_line(v, [], run)[-1] == "--resume"
    (run / "failed.json").write_text("{}")
    assert run_state(run) == "failed"
    (run / "results.json").write_text("{}")
    assert run_state(run) == "done"
    ev = Variant("e", "d", ["--model", "m", "--split", "val"], "evaluate")
    assert command_line(ev, ["--preset", "tiny"], tmp_path / "e", ["--threads", "1"]) == \
        [sys.executable, "-m", "transformer", "evaluate", "--model", "m", "--split", "val", "--json", "--threads", "1"]


# ---- a real sweep ------------------------------------------------------------------------------------------------

def on_slice(multi30k_slice):
    """BASE on the slice of Multi30k (tests/conftest.py: its first 2,000 training pairs, its val and test whole): a
    variant's run needs to exist, not to have read the whole corpus, and tokenizes a fifteenth of it."""
    return [*BASE, "--data", str(multi30k_slice), "--unverified-data"]


@pytest.fixture(scope="module")
def swept(multi30k_slice, tmp_path_factory):
    """Two train variants two at a time (one with a stub left by a run killed before its first checkpoint), one that
    train refuses, one evaluate variant that fails; then an evaluate variant of a finished run."""
    tmp = tmp_path_factory.mktemp("sweep")
    out = tmp / "runs"
    path = write_variants(tmp / "variants.json", base=on_slice(multi30k_slice), variants=[
        {"name": "a", "row": "base", "note": "the base"},
        {"name": "b", "row": "E", "args": ["--positions", "none", "--d-k", "8", "--norm", "pre"]},
        {"name": "bad", "row": "A", "args": BAD_SHAPE},
        {"name": "ev-missing", "row": "d", "command": "evaluate", "args": ["--model", str(tmp / "nowhere")]},
        {"name": "ev", "row": "d", "command": "evaluate",
         "args": ["--model", str(out / "a"), "--split", "val", "--limit", "5", "--beam", "1"]},
    ])
    (out / "b").mkdir(parents=True)
    (out / "b" / "config.json").write_text("{}")                   # a stub: the run must start afresh
    code, list_out, err = sweep(path, "--out", out, "--list")
    assert code == 0, err
    first = sweep(path, "--out", out, "--jobs", 2, "--threads", 1, "--only", "a", "b", "bad", "ev-missing")
    second = sweep(path, "--out", out, "--threads", 1, "--only", "ev")
    return path, out, list_out, first, second


def test_list_prints_each_state_and_command(swept, tmp_path):
    path, out, list_out, *_ = swept
    lines = list_out.splitlines()
    assert [line.split()[:2] for line in lines] == [["new", "a"], ["new", "b"], ["new", "bad"], ["new", "ev-missing"],
                                                    ["new", "ev"]]
    base, _ = read_variants(path)
    assert base[:len(BASE)] == BASE                                          # on_slice(...)
    assert lines[0].split(None, 2)[2] == " ".join(["-m", "transformer", "train", *base, "--out", str(out / "a"),
                                                   "--quiet"])
    assert "evaluate --model" in lines[-1] and lines[-1].endswith("--beam 1 --json")
    code, now, err = sweep(path, "--out", out, "--list", "--threads", 1)
    assert code == 0 and err == ""
    states = {line.split()[1]: line.split()[0] for line in now.splitlines()}
    assert states == {"a": "done", "b": "done", "bad": "failed", "ev-missing": "failed", "ev": "done"}
    assert all(line.endswith("--threads 1") for line in now.splitlines())


def test_sweep_runs_variants_two_at_a_time_and_writes_results(swept):
    path, out, _, (code, stdout, err), _ = swept
    assert code == 1, err                                          # two variants failed
    lines = stdout.splitlines()
    assert lines[0] == f"4 variants: 0 done before, 4 to run, 2 at a time; run directories in {out}"
    assert lines[1].startswith("start  a: -m transformer train --preset tiny")
    assert lines[2].startswith("start  b: ") and "--positions none --d-k 8 --norm pre" in lines[2]
    assert lines[2].endswith("--quiet --threads 1")
    assert sum(line.startswith("done   ") for line in lines) == 2 and sum("FAILED" in line for line in lines) == 2
    assert err.strip() == ("2 variants failed: bad, ev-missing (their log.txt says why); the same command skips "
                           "them, --retry-failed runs them again")
    for name, positions, d_k, norm_first in (("a", "sinusoidal", None, False), ("b", "none", 8, True)):
        results = json.loads((out / name / "results.json").read_text())
        assert results["steps"] == 6 and results["stopped"] == "max_steps" and results["threads"] == 1
        model = json.loads((out / name / "config.json").read_text())["model"]
        assert (model["positions"], model["d_k"], model["norm_first"], model["d_model"]) == \
            (positions, d_k, norm_first, 32)
        assert load_checkpoint(out / name / "best.pt")["model_config"] == model
        started = lines[1 + "ab".index(name)].split(": ", 1)[1]
        assert commands_in_log(out / name) == [f"{shlex.quote(sys.executable)} {started}"]
        assert not (out / name / "failed.json").exists()


def test_a_failed_variant_writes_failed_json(swept):
    path, out, *_ = swept
    failed = json.loads((out / "bad" / "failed.json").read_text())
    assert failed["returncode"] == 1
    assert failed["error"].startswith("error: --d-model 100 is not divisible by --heads 3")
    assert failed["command"].startswith("-m transformer train --preset tiny") and "--heads 3" in failed["command"]
    assert sorted(p.name for p in (out / "bad").iterdir()) == ["failed.json", "log.txt"]   # train left nothing
    missing = json.loads((out / "ev-missing" / "failed.json").read_text())
    assert missing["returncode"] == 1 and "no such directory" in missing["error"]
    assert not (out / "ev-missing" / "results.json").exists()


def test_an_evaluate_variant_writes_results(swept):
    path, out, _, _, (code, stdout, err) = swept
    assert code == 0, err
    assert stdout.splitlines()[0] == f"1 variants: 0 done before, 1 to run, 1 at a time; run directories in {out}"
    results = json.loads((out / "ev" / "results.json").read_text())
    assert results["variant"] == "ev" and results["sentences"] == 5 and results["beam"] == 1
    assert results["alpha"] == 0.6 and 0 <= results["bleu"] <= 100 and 0 <= results["bleu_lc_tok"] <= 100
    assert results["command"] == " ".join(["-m", "transformer", "evaluate", "--model", str(out / "a"), "--split",
                                           "val", "--limit", "5", "--beam", "1", "--json", "--threads", "1"])
    # results.json is evaluate's JSON line (kept in the log too), with the variant and command added
    printed = json.loads((out / "ev" / "log.txt").read_text().strip().splitlines()[-1])
    assert results == {**printed, "variant": "ev", "command": results["command"]}


def test_second_call_skips_everything_and_failed_is_retried_on_request(swept, tmp_path, monkeypatch):
    path, out, *_ = swept
    logs = {name: (out / name / "log.txt").read_text() for name in ("a", "b", "bad", "ev")}
    done = {name: (out / name / "results.json").stat().st_mtime_ns for name in ("a", "b", "ev")}
    code, stdout, err = sweep(path, "--out", out, "--jobs", 2, "--threads", 1)
    assert code == 0 and err == "", err                            # a failure is a result: kept, not run again
    assert stdout.splitlines() == [f"5 variants: 5 done before, 0 to run, 2 at a time; run directories in {out}"]
    assert {name: (out / name / "log.txt").read_text() for name in logs} == logs
    assert {name: (out / name / "results.json").stat().st_mtime_ns for name in done} == done
    # --retry-failed runs a failed variant again (here it fails again: a second command in its log), as a
    # stand-in that fails at once (evaluate's own failure, in its own process, is the fixture's first run)
    again = [sys.executable, "-c", "import sys; sys.exit('error: failed again')"]
    _children(monkeypatch, {"ev-missing": again})
    code, stdout, err = sweep(path, "--out", out, "--threads", 1, "--only", "ev-missing", "--retry-failed")
    assert code == 1 and "1 variants failed: ev-missing" in err
    assert stdout.splitlines()[0].startswith("1 variants: 0 done before, 1 to run")
    assert commands_in_log(out / "ev-missing")[1:] == [shlex.join(again)]
    failed = json.loads((out / "ev-missing" / "failed.json").read_text())
    assert failed["returncode"] == 1 and failed["error"] == "error: failed again"   # the new run's outcome
    assert {name: (out / name / "log.txt").read_text() for name in ("a", "bad")} == {"a": logs["a"], "bad": logs["bad"]}


def test_results_copies_the_small_files_and_collect_reads_them(swept, tmp_path):
    path, out, *_ = swept
    dest = tmp_path / "results"
    code, stdout, err = sweep(path, "--out", out, "--results", dest)
    assert code == 0, err
    assert stdout.splitlines()[-1] == f"copied the results of 5 finished variants to {dest}"
    copied = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert copied == {"a/config.json", "a/metrics.jsonl", "a/results.json",
                      "b/config.json", "b/metrics.jsonl", "b/results.json",
                      "bad/failed.json", "ev-missing/failed.json", "ev/results.json"}
    assert set(KEEP) == {"config.json", "metrics.jsonl", "results.json", "failed.json"}
    for f in copied:
        assert (dest / f).read_bytes() == (out / f).read_bytes(), f
    _, variants = read_variants(path)
    rows = collect(out, variants)
    assert [(r["name"], r["state"]) for r in rows] == [("a", "done"), ("b", "done"), ("bad", "failed"),
                                                       ("ev-missing", "failed"), ("ev", "done")]
    a, b, bad, missing, ev = rows
    assert a["row"] == "base" and a["note"] == "the base" and a["steps"] == 6 and a["params"] > 0
    last_eval = [json.loads(line) for line in (out / "a" / "metrics.jsonl").read_text().splitlines()][-1]
    assert a["val_ppl"] == last_eval["val_ppl"] and a["val_bleu"] >= 0 and a["test_bleu"] >= 0
    assert b["params"] != a["params"]                      # d_k 8 of 16: narrower W^Q, W^K
    assert bad["error"].startswith("error: --d-model 100 is not divisible") and "steps" not in bad
    assert ev["command"] == "evaluate" and ev["beam"] == 1 and ev["alpha"] == 0.6 and ev["val_bleu"] >= 0
    assert collect(dest, variants) == rows                  # the committed copy is enough for the table
    assert collect(tmp_path / "nothing", variants) == []


# ---- stopped by a signal, resumed ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_stopped_sweep_resumes_its_variant(multi30k_slice, tmp_path, monkeypatch):
    """SIGTERM to the sweep's process: the child saves last.pt, the sweep exits 130; the same command (its budget
    now set) continues the variant with --resume up to --max-steps. The sweep runs in this process (main(argv), what
    `python -m transformer sweep` runs: tests/test_cli.py starts that), so that its train children are the only
    interpreters started; a thread sends this process the SIGTERM once the child saved its first last.pt.
    The child is `python -m transformer train` in a process of its own, and this is the suite's test of what train
    does on SIGTERM (tests/test_cli.py had one more process for it): it finishes its step, saves last.pt, exits
    with 143 (128 + SIGTERM) and says on its last line of stderr, with no traceback, how to continue."""
    import threading
    out = tmp_path / "runs"
    jobs = _children(monkeypatch, {})                                   # the real commands; the jobs kept
    # --eval-share 1: an evaluation every --eval-every steps, whatever it costs (the schedule asserted below)
    path = write_variants(tmp_path / "v.json", [{"name": "long", "row": "x",
                                                  "args": ["--max-steps", "100000", "--eval-share", "1"]}],
                          base=on_slice(multi30k_slice))
    sent, done = [], threading.Event()

    def stop_when_saved():
        deadline = time.time() + 240
        while time.time() < deadline and not done.is_set() and not (out / "long" / "last.pt").exists():
            time.sleep(0.1)
        if not done.is_set():
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    # a SIGTERM that came after the sweep put back the handler it found is caught here, not the end of pytest
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sent.append("late"))
    stopper = threading.Thread(target=stop_when_saved, daemon=True)
    try:
        stopper.start()
        code, stdout, err = sweep(path, "--out", out, "--threads", 1)
    finally:
        done.set()
        stopper.join()
        signal.signal(signal.SIGTERM, previous)
    assert sent == [True] and code == 130, (stdout, err)                 # stopped by the signal, while running
    assert err.strip() == "sweep stopped; run the same command again to resume"
    state = load_checkpoint(out / "long" / "last.pt")                  # whole, loadable
    step = state["progress"]["step"]
    assert step >= 3
    log = (out / "long" / "log.txt").read_text()
    assert [job.proc.returncode for job in jobs] == [128 + signal.SIGTERM]
    last = log.strip().splitlines()[-1]                                 # train's stderr, the end of the log
    assert last.startswith(f"SIGTERM at step {step}: saved {out / 'long' / 'last.pt'}; continue with: "
                           "python -m transformer train --preset tiny")
    assert last.endswith(" --resume") and "Traceback" not in log
    assert run_state(out / "long") == "interrupted" and not (out / "long" / "failed.json").exists()
    code, listed, _ = sweep(path, "--out", out, "--list", "--threads", 1)
    assert listed.split()[:2] == ["interrupted", "long"] and listed.rstrip().endswith("--threads 1 --resume")
    # the same sweep, with a budget that ends soon
    write_variants(path, [{"name": "long", "row": "x", "args": ["--max-steps", str(step + 3), "--eval-share", "1"]}],
                   base=on_slice(multi30k_slice))
    code, stdout, err = sweep(path, "--out", out, "--threads", 1)
    assert code == 0, (out / "long" / "log.txt").read_text()
    first, again = commands_in_log(out / "long")
    assert "--resume" not in first and again.endswith("--threads 1 --resume")
    results = json.loads((out / "long" / "results.json").read_text())
    assert results["steps"] == step + 3
    records = [json.loads(line) for line in (out / "long" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    assert evals == sorted(set(evals)) and evals[-1] == step + 3   # continued where it stopped, none repeated
    # every 3 steps before the stop (a signal skips the evaluation of its step), then after it, and the last step
    assert [s for s in evals if s < step] == list(range(3, step, 3))
    assert [s for s in evals if s > step] == sorted({s for s in range(step + 1, step + 3) if s % 3 == 0} | {step + 3})
    trains = [r["step"] for r in records if r["kind"] == "train"]
    assert trains == sorted(set(trains)) and trains[-1] == step + 3
    assert load_checkpoint(out / "long" / "last.pt")["progress"]["step"] == step + 3


# ---- issue 28: a sweep never deletes a live run, survives what a child prints, and leaves no orphan --------------

def _children(monkeypatch, commands: dict[str, list[str]]):
    """Run these variants' children as the given commands (cheap stand-ins for train and evaluate); the jobs
    the sweep starts are collected in the returned list."""
    import transformer.cli.sweep as sw
    real, jobs = sw.command_line, []
    monkeypatch.setattr(sw, "command_line", lambda v, *a, **k: commands.get(v.name) or real(v, *a, **k))
    init = sw._Job.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        jobs.append(self)
    monkeypatch.setattr(sw._Job, "__init__", keep)
    return jobs


def _hold_lock(run_dir, says):
    from transformer.engine.checkpoints import run_lock
    with run_lock(run_dir):
        says.send("held")
        time.sleep(60)


@pytest.mark.slow
def test_a_live_run_is_left_alone(tmp_path, monkeypatch):
    "A run still alive (from an earlier sweep) holds its lock: the sweep neither clears its files nor starts it."
    out = tmp_path / "runs"
    (out / "a").mkdir(parents=True)
    for name in ("config.json", "tokenizer.model"):                       # a new run's first files, no last.pt yet
        (out / "a" / name).write_text("{}")
    # another process holds it: forked (torch and this package come imported), it takes the lock, says
    # so and sleeps (a fresh interpreter would import torch for it, seconds of CPU)
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    said, says = fork.Pipe(duplex=False)
    holder = fork.Process(target=_hold_lock, args=(out / "a", says))
    holder.start()
    try:
        assert said.recv() == "held"
        _children(monkeypatch, {"a": [sys.executable, "-c", "pass"], "b": [sys.executable, "-c", "pass"]})
        path = write_variants(tmp_path / "v.json", [{"name": "a", "row": "x"}, {"name": "b", "row": "x"}])
        code, stdout, err = sweep(path, "--out", out, "--jobs", "2")
    finally:
        holder.kill()
        holder.join()
    assert code == 1 and f"busy   a: {out / 'a'} is in use by another run (pid {holder.pid})" in stdout
    assert "1 variants are running in another process: a; left alone" in err
    assert sorted(p.name for p in (out / "a").iterdir()) == [".lock", "config.json", "tokenizer.model"]
    assert run_state(out / "b") == "new" and (out / "b" / "log.txt").exists()   # b ran (a train stand-in)


@pytest.mark.slow
def test_output_the_sweep_cannot_parse_is_a_failure_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """An evaluation that exits 0 but whose last line is no JSON object (as `evaluate --help` prints its help) is a
    failure; a child that prints 100 KB must not block the sweep on a pipe. Both children are stand-ins (the sweep
    reads what a child prints, whichever child: a real evaluate variant runs in the `swept` fixture)."""
    big = "import json\nprint('x' * 100_000)\nprint(json.dumps({'bleu': 1.5}))"
    usage = "print('usage: python -m transformer evaluate [-h] ...')\nprint('  --output FILE  the translations')"
    _children(monkeypatch, {"big": [sys.executable, "-c", big], "help": [sys.executable, "-c", usage]})
    path = write_variants(tmp_path / "v.json", [{"name": "help", "row": "x", "command": "evaluate", "args": ["--help"]},
                                                {"name": "big", "row": "x", "command": "evaluate"}])
    code, stdout, err = sweep(path, "--out", tmp_path / "runs")
    assert code == 1 and "1 variants failed: help" in err
    failed = json.loads((tmp_path / "runs" / "help" / "failed.json").read_text())
    assert failed["returncode"] == 0 and failed["error"] == "its last line is not the JSON object of a result"
    assert failed["last_lines"][-1].strip().startswith("--output FILE")   # the end of what it printed
    result = json.loads((tmp_path / "runs" / "big" / "results.json").read_text())
    assert result["bleu"] == 1.5 and result["variant"] == "big"


def test_no_child_outlives_the_sweep(tmp_path, monkeypatch):
    "Whatever ends the sweep (here a bug of ours in finishing a job), it ends the children it started."
    import transformer.cli.sweep as sw
    jobs = _children(monkeypatch, {"quick": [sys.executable, "-c", "pass"],
                                   "slow": [sys.executable, "-c", "import time; time.sleep(60)"]})
    monkeypatch.setattr(sw._Job, "finish", lambda self: 1 / 0)
    variants = [Variant("quick", "x"), Variant("slow", "x")]
    with pytest.raises(ZeroDivisionError):
        sw.run_sweep(variants, [], tmp_path / "runs", jobs=2, say=lambda *a: None)
    assert [j.variant.name for j in jobs] == ["quick", "slow"]
    assert all(j.proc.poll() is not None for j in jobs)                 # ended, not left running


@pytest.mark.parametrize("flag", ["--out", "--results"])
def test_out_or_results_naming_a_file_is_refused_before_any_work(tmp_path, flag):
    path = write_variants(tmp_path / "v.json", [{"name": "a", "row": "x"}])
    (tmp_path / "afile").write_text("x")
    argv = ["--out", tmp_path / "runs", flag, tmp_path / "afile"] if flag == "--results" else [flag, tmp_path / "afile"]
    code, stdout, err = sweep(path, *argv)
    assert code == 2 and stdout == "" and err == f"error: {flag} {tmp_path / 'afile'} is a file; name a directory " \
                                                 "(it is created if missing)\n"
    assert not (tmp_path / "runs").exists()


def test_a_failed_variant_is_recorded_where_signal_has_no_sigkill(tmp_path, monkeypatch):
    "Windows has no signal.SIGKILL: the sweep stopped with AttributeError at the first failed variant."
    import transformer.cli.sweep as sw
    monkeypatch.delattr(signal, "SIGKILL")
    _children(monkeypatch, {"bad": [sys.executable, "-c", "import sys; sys.exit('error: no such file')"]})
    said = []
    assert sw.run_sweep([Variant("bad", "x")], [], tmp_path / "runs", say=said.append) == {"bad": "failed"}
    assert json.loads((tmp_path / "runs" / "bad" / "failed.json").read_text())["error"] == "error: no such file"
    assert said[-1].startswith("FAILED bad after ") and "log.txt" in said[-1]


@pytest.mark.slow
def test_a_childs_utf8_error_survives_a_locale_that_is_not_utf8(tmp_path):
    """The children write UTF-8 (`transformer.__main__.utf8_output`); the sweep read their log in the locale's
    encoding (Windows: cp1252), and failed.json's error came out garbled. Here the locale is ASCII (C, without
    Python's UTF-8 mode), a stand-in for cp1252."""
    said = "error: /data/Müller/train.de: no such file ⁇"
    child = tmp_path / "child.py"       # a failing train's stand-in, writing as the package's main does
    child.write_text(f"import sys\nsys.stderr.buffer.write({(said + chr(10)).encode()!r})\nsys.exit(1)\n")
    script = ("import sys; import transformer.cli.sweep as sw; from transformer.engine.trained import Variant; "
              "sw.command_line = lambda *a, **k: [sys.executable, sys.argv[1]]; "
              "sw.run_sweep([Variant('bad', 'x')], [], sys.argv[2], say=lambda *a: None)")
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-X", "utf8=0", "-c", script, child, tmp_path / "runs"], env=env,
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert json.loads((tmp_path / "runs" / "bad" / "failed.json").read_text("utf-8"))["error"] == said
