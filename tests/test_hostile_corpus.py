"""Issue 41, hostile use, round three: prepared corpora and run directories. `prepare` into a run or model
directory, two `prepare`s at once, held-out text split at Unicode line breaks, shards and manifests that lie,
`--resume` without the corpus, `--data` that is not a corpus, stale snapshots after a kill, sweep records written
over other runs. Each error is one line on stderr, with no traceback."""
import errno
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from test_cli import TRAIN, assert_one_line_error, run
from test_sweep import sweep, write_variants

from transformer.data import DataError, load_multi30k, sha256_file
from transformer.engine import corpus as corpus_module
from transformer.engine.checkpoints import SaveError, atomic_write
from transformer.engine.corpus import WMT14_DE_EN, ShardedCorpus, prepare, wmt14_text
from transformer.tokens import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "book" / "model"
pytestmark = pytest.mark.usefixtures("keep_threads")
ONSHARDS = ["train", "--preset", "tiny", "--max-steps", 2, "--eval-every", 2, "--eval-sentences", 4, "--beam", 1,
            "--threads", 1, "--quiet", "--log-every", 1, "--average", 0, "--batch-tokens", 600]


@pytest.fixture(scope="module")
def texts(multi30k, tmp_path_factory):
    "Three hundred Multi30k pairs to train on, twenty to validate, twenty to test, as files; and a tokenizer."
    tmp = tmp_path_factory.mktemp("texts")
    pairs = load_multi30k("de", "en", "val", download=False)[:340]
    for name, part in (("train", pairs[:300]), ("val", pairs[300:320]), ("test", pairs[320:])):
        for k, lang in enumerate(("de", "en")):
            (tmp / f"{name}.{lang}").write_text("".join(p[k] + "\n" for p in part), encoding="utf-8")
    tokenizer = Tokenizer.train([s for p in pairs for s in p], vocab_size=300)
    tokenizer.save(tmp / "tok.model")
    return tmp


def _prepare_argv(texts, out, *more):
    return ["prepare", "--src-files", texts / "train.de", "--tgt-files", texts / "train.en", "--val-files",
            texts / "val.de", texts / "val.en", "--test-files", texts / "test.de", texts / "test.en",
            "--tokenizer", texts / "tok.model", "--shard-pairs", 120, "--quiet", "--out", out, *more]


@pytest.fixture(scope="module")
def prepared(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    code, _, err = run(*_prepare_argv(texts, out))
    assert code == 0, err
    return out


def _copy(src, tmp_path, name="corpus"):
    return Path(shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("web")))


def _hold(directory: Path) -> subprocess.Popen:
    "A process holding `directory`'s run lock (a live run or prepare), once it has printed 'held'."
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom transformer.engine.checkpoints import "
                               "run_lock\nwith run_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)",
                               str(directory)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


# ---- 1. prepare --out refuses a run or a model directory, and takes the run lock; train --out refuses a corpus ----

def _fake_run(path: Path) -> Path:
    path.mkdir(parents=True)
    for name in ("config.json", "last.pt", "metrics.jsonl", "tokenizer.model"):
        (path / name).write_text(name)
    return path


@pytest.mark.parametrize("kind", ["run", "model"])
def test_prepare_refuses_a_run_or_model_directory(texts, tmp_path, kind):
    out = _fake_run(tmp_path / "run") if kind == "run" else _copy(MODEL, tmp_path, "model")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, stdout, err = run(*_prepare_argv(texts, out))
    assert_one_line_error(code, stdout, err, 1, f"--out {out} holds a {kind}")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_prepare_takes_the_run_lock(texts, tmp_path):
    out = tmp_path / "corpus"
    holder = _hold(out)
    try:
        code, stdout, err = run(*_prepare_argv(texts, out))
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_error(code, stdout, err, 1, f"is in use by another run (pid {holder.pid})")
    assert not (out / "tokenizer.model").exists()


@pytest.mark.parametrize("kind", ["corpus", "model"])
def test_train_refuses_a_prepared_corpus_or_a_model_as_out(prepared, tmp_path, kind):
    out = _copy(prepared if kind == "corpus" else MODEL, tmp_path, kind)
    before = sorted(p.name for p in out.iterdir())
    code, stdout, err = run(*TRAIN, "--out", out)
    assert_one_line_error(code, stdout, err, 1, f"--out {out} holds a " + ("corpus written by prepare" if
                                                                           kind == "corpus" else "model"))
    assert sorted(p.name for p in out.iterdir()) == before


# ---- 2. sweep --results never writes over a run; --out after -- is refused ---------------------------------------

def _done(run_dir: Path, tag: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "metrics.jsonl", "results.json"):
        (run_dir / name).write_text(json.dumps({"tag": tag, "step": 1}) + "\n")
    return run_dir


def test_sweep_results_refuses_to_write_over_another_run(tmp_path):
    runs = tmp_path / "runs"
    base = _done(runs / "base", "the other run")
    (base / "last.pt").write_text("weights")
    _done(base / "base", "the variant")                                   # the sweep's variant, finished
    path = write_variants(tmp_path / "v.json", [{"name": "base", "row": "x"}])
    code, stdout, err = sweep(path, "--out", base, "--results", runs)
    assert_one_line_error(code, stdout, err, 2, f"--results {runs}: {base} holds a run")
    assert json.loads((base / "results.json").read_text())["tag"] == "the other run"


def test_sweep_results_equal_to_out_is_one_line(tmp_path):
    out = tmp_path / "runs"
    _done(out / "a", "a")
    path = write_variants(tmp_path / "v.json", [{"name": "a", "row": "x"}])
    code, stdout, err = sweep(path, "--out", out, "--results", out)
    assert_one_line_error(code, stdout, err, 2, f"--results {out} is --out")


def test_sweep_refuses_out_after_the_double_dash(tmp_path):
    path = write_variants(tmp_path / "v.json", [{"name": "a", "row": "x"}, {"name": "b", "row": "y"}])
    code, stdout, err = sweep(path, "--out", tmp_path / "runs", "--list", "--", "--device", "cpu", "--out", "x")
    assert_one_line_error(code, stdout, err, 2, "--out after --")


# ---- 3. held-out pairs split only at \n, as prepare wrote them ------------------------------------------------------

BREAKS = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r"]


def test_held_out_pairs_keep_every_unicode_line_break(texts, tmp_path):
    pairs = [(f"Ein{c}Hund {i}.", f"A{c}dog {i}.") for i, c in enumerate(BREAKS)]
    for k, lang in enumerate(("de", "en")):
        (tmp_path / f"odd.{lang}").write_text("".join(p[k] + "\n" for p in pairs), encoding="utf-8", newline="")
    out = prepare(tmp_path / "odd.de", tmp_path / "odd.en", tmp_path / "c", tokenizer=texts / "tok.model",
                  val_files=(tmp_path / "odd.de", tmp_path / "odd.en"),
                  test_files=(tmp_path / "odd.de", tmp_path / "odd.en"), quiet=True)
    corpus = ShardedCorpus(out)
    for split in ("val", "test"):
        assert corpus.split(split) == pairs
        assert corpus.manifest["splits"][split]["pairs"] == len(pairs) == len(corpus)


# ---- 4. the manifest records the tokenizer prepare wrote; a corpus opens only with it ------------------------------

def test_a_tokenizer_replaced_while_prepare_runs_is_refused(texts, tmp_path, monkeypatch):
    out, real = tmp_path / "c", corpus_module._write_shard

    def another_prepare_writes(*a, **k):                   # a second prepare into the same --out, meanwhile
        shutil.copyfile(MODEL / "tokenizer.model", out / "tokenizer.model")
        return real(*a, **k)
    monkeypatch.setattr(corpus_module, "_write_shard", another_prepare_writes)
    with pytest.raises(DataError, match="tokenizer.model"):
        prepare(texts / "train.de", texts / "train.en", out, tokenizer=texts / "tok.model", quiet=True)
        ShardedCorpus(out, verify=False)


@pytest.mark.parametrize("lie", ["another tokenizer", "vocab_size"])
def test_a_corpus_opens_only_with_the_tokenizer_its_manifest_names(prepared, tmp_path, lie):
    corpus = _copy(prepared, tmp_path)
    if lie == "another tokenizer":
        shutil.copyfile(MODEL / "tokenizer.model", corpus / "tokenizer.model")
        match = "tokenizer.model: its sha256 differs"
    else:
        _edit_manifest(corpus, lambda m: m.update(vocab_size=280))
        match = "has 300 pieces, the manifest says 280"
    with pytest.raises(DataError, match=match):
        ShardedCorpus(corpus, verify=False)
    assert_one_line_error(*run(*ONSHARDS, "--data", corpus, "--out", tmp_path / "r"), 1, match)


# ---- 5. --resume compares every data-defining key the run recorded ---------------------------------------------------

@pytest.mark.slow
def test_resume_without_data_is_refused_naming_the_corpus(prepared, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(*ONSHARDS, "--data", prepared, "--out", out)
    assert code == 0, err
    assert_one_line_error(*run(*ONSHARDS, "--no-download", "--max-steps", 4, "--out", out, "--resume"), 1,
                          f"the run trained on the prepared corpus {prepared}; resume with --data {prepared}")


# ---- 6. --data DIR without a manifest is an error naming DIR ---------------------------------------------------------

@pytest.mark.parametrize("leftover", [[], ["tokenizer.model", "src-00000.npy"]])
def test_data_without_a_manifest_is_refused(prepared, tmp_path, leftover):
    data = tmp_path / "data"
    data.mkdir()
    for name in leftover:
        shutil.copyfile(prepared / name, data / name)
    match = (f"--data {data} holds tokenizer.model, src-00000.npy but no manifest.json: a prepare that did not finish"
             if leftover else f"--data {data}: manifest.json (a corpus written by prepare) and multi30k/ not found in")
    assert_one_line_error(*run(*ONSHARDS, "--data", data, "--out", tmp_path / "r"), 1, match)
    assert not (tmp_path / "r").exists()


# ---- 7. a resumed run averages only its own trajectory's snapshots ---------------------------------------------------

@pytest.mark.slow
def test_snapshots_newer_than_last_pt_are_dropped_on_resume(tmp_path):
    import torch

    from transformer.engine.loop import RunConfig, train
    from transformer.model import Transformer, TransformerConfig

    def model():
        torch.manual_seed(0)
        return Transformer(TransformerConfig(src_vocab=50, tgt_vocab=50, d_model=16, d_ff=32, h=2, n_layers=1,
                                             max_len=16))
    g = torch.Generator().manual_seed(0)
    examples = [(torch.randint(4, 50, (6,), generator=g).tolist() + [2],
                 [1] + torch.randint(4, 50, (6,), generator=g).tolist() + [2]) for _ in range(64)]

    def config(steps):
        return RunConfig(batch_tokens=80, max_steps=steps, warmup=4, eval_every=100, log_every=100,
                           snapshot_every=2, keep_checkpoints=3)
    train(model(), examples, None, config(6), out_dir=tmp_path / "whole", progress=False)
    train(model(), examples, None, config(4), out_dir=tmp_path / "cut", progress=False)
    # killed at step 6 with last.pt at 4: the abandoned trajectory's snapshot of step 6 is on the disk
    shutil.copyfile(tmp_path / "whole" / "step-0000006.pt", tmp_path / "cut" / "step-0000006.pt")
    train(model(), examples, None, config(5), out_dir=tmp_path / "cut", resume=True, progress=False)
    assert sorted(p.name for p in (tmp_path / "cut").glob("step-*.pt")) == [
        "step-0000002.pt", "step-0000004.pt", "step-0000005.pt"]                 # 6 was never this run's


# ---- 9. shards and manifests are checked when the corpus opens ---------------------------------------------------------

def _edit_manifest(corpus: Path, edit) -> None:
    m = json.loads((corpus / "manifest.json").read_text())
    edit(m)
    (corpus / "manifest.json").write_text(json.dumps(m))


def _rewrite(corpus: Path, name: str, change) -> None:
    "Change a shard file's array and record its new size and sha256 in the manifest: only the range checks can tell."
    a = np.load(corpus / name).copy()
    change(a)
    np.save(corpus / name, a)

    def edit(m):
        for shard in m["shards"]:
            for want in shard["files"].values():
                if want["name"] == name:
                    want.update(bytes=(corpus / name).stat().st_size, sha256=sha256_file(corpus / name))
    _edit_manifest(corpus, edit)


def _set(row, col, value):
    def change(a):
        a[row, col] = value
    return change


def _id(value):
    def change(a):
        a[3] = value
    return change


DAMAGE = [  # (what, damage, part of the message)
    ("offset past the data", lambda c: _rewrite(c, "index-00000.npy", _set(-1, 0, 10**6)),
     "index-00000.npy: pair 119's source tokens"),
    ("negative offset", lambda c: _rewrite(c, "index-00000.npy", _set(5, 2, -3)), "index-00000.npy: pair 5's target"),
    ("overlapping pairs", lambda c: _rewrite(c, "index-00000.npy", _set(1, 0, 0)), "index-00000.npy: pair 1's source"),
    ("zero length", lambda c: _rewrite(c, "index-00001.npy", _set(0, 3, 0)), "index-00001.npy: pair 0's target"),
    ("an id past the vocabulary", lambda c: _rewrite(c, "src-00002.npy", _id(300)),
     "src-00002.npy: token id 300 at position 3, but the vocabulary has 300 pieces"),
    ("dtype bogus", lambda c: _edit_manifest(c, lambda m: m.update(dtype="bogus")), "dtype 'bogus'"),
    ("shards a dict", lambda c: _edit_manifest(c, lambda m: m.update(shards={"a": 1})), "not a manifest written by"),
    ("a manifest a list", lambda c: (c / "manifest.json").write_text("[1, 2]"), "not a manifest written by"),
    ("a name outside the corpus", lambda c: _edit_manifest(
        c, lambda m: m["shards"][0]["files"]["src"].update(name="../x")), "'../x' is not a file name in"),
    ("an absolute name", lambda c: _edit_manifest(
        c, lambda m: m["shards"][0]["files"]["src"].update(name="/etc/hostname")), "'/etc/hostname' is not a file name"),
    ("a tokenizer outside", lambda c: _edit_manifest(
        c, lambda m: m["tokenizer"].update(name="../tok.model")), "'../tok.model' is not a file name"),
]


@pytest.mark.parametrize("what,damage,match", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_lying_shard_or_manifest_is_refused_when_the_corpus_opens(prepared, tmp_path, what, damage, match):
    corpus = _copy(prepared, tmp_path)
    damage(corpus)
    with pytest.raises(DataError, match="re-run prepare") as e:
        ShardedCorpus(corpus, verify=False)
    assert match in str(e.value) and "\n" not in str(e.value), str(e.value)



@pytest.mark.parametrize("name", ["../val.de", "/etc/hostname"])
def test_a_held_out_split_outside_the_corpus_is_refused(prepared, tmp_path, name):
    "The held-out text files go through the same name check as the shards: no path out of the corpus directory."
    corpus = _copy(prepared, tmp_path)
    _edit_manifest(corpus, lambda m: m["splits"]["val"]["src"].update(name=name))
    with pytest.raises(DataError, match="re-run prepare") as e:
        ShardedCorpus(corpus, verify=False).split("val")
    assert f"{name!r} is not a file name in" in str(e.value) and "\n" not in str(e.value), str(e.value)

def _archives(raw: Path, extra: str | None = None):
    for archive, base in WMT14_DE_EN.items():
        with tarfile.open(raw / archive, "w:gz") as tar:
            for name in [f"training/{base}.de", f"training/{base}.en", *([extra.format(base)] if extra else [])]:
                info = tarfile.TarInfo(name)
                info.size = len(data := f"Satz {name}\n".encode())
                tar.addfile(info, io.BytesIO(data))


def test_wmt14_refuses_a_duplicate_member_and_a_damaged_sources_json(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _archives(raw, extra="other/{}.de")
    with pytest.raises(DataError, match="holds two files named europarl-v7.de-en.de"):
        wmt14_text(raw)
    _archives(raw)
    (raw / "de-en").mkdir(exist_ok=True)
    (raw / "de-en" / "sources.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="sources.json: not a record written by prepare"):
        wmt14_text(raw)


# ---- lesser: a full disk before the first checkpoint does not suggest --resume ---------------------------------------

def test_a_full_disk_suggests_resume_only_when_there_is_a_run_to_resume(tmp_path):
    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(SaveError) as e:
        atomic_write(tmp_path / "step-0000006.pt", full)
    assert "--resume" not in str(e.value) and "run the same command again" in str(e.value)
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(SaveError, match="continue the run with --resume"):
        atomic_write(tmp_path / "step-0000006.pt", full)
