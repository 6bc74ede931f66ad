"""Fixtures shared by the test files, and what the xdist workers of one run share."""
import gzip
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """xdist's workers share the cores: each takes its share of torch's threads (one each when
    there are as many workers as cores), and so do the notebooks' kernels and the subprocesses it
    starts (OMP_NUM_THREADS, inherited), unless the caller set OMP_NUM_THREADS. n workers of n
    threads each on n cores would wait on each other's OpenMP threads, which spin while they wait."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    _warm_kernels(config)


def _warm_kernels(config) -> None:
    """nbval's kernels forked from a zygote that has imported torch (tests/warm_kernel.py): the same
    kernel process a cold start gives, about 3 s of CPU sooner, 40 times a run. Linux only; the
    environment variable TRANSFORMER_COLD_KERNELS=1 turns it off. The zygote starts with the first
    notebook of this process and stops with it."""
    if sys.platform != "linux" or os.environ.get("TRANSFORMER_COLD_KERNELS") \
            or not (getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False)):
        return
    import atexit

    import ipykernel.kernelspec
    from nbval import kernel as nbval_kernel
    from warm_kernel import Zygote
    zygote = []
    original = nbval_kernel.NbvalKernelspecManager.get_kernel_spec

    def get_kernel_spec(self, kernel_name):
        if kernel_name != nbval_kernel.CURRENT_ENV_KERNEL_NAME:
            return original(self, kernel_name)
        if not zygote:
            zygote.append(Zygote())
            atexit.register(zygote[0].close)
        return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES, **zygote[0].kernel_spec())
    nbval_kernel.NbvalKernelspecManager.get_kernel_spec = get_kernel_spec


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored after: the models of the tests are tiny (a
    second thread gains nothing), results do not depend on the core count, and a busy
    machine disturbs one thread least."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def keep_threads():
    "Restore torch's thread count after a test whose code sets it (`--threads`)."
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# The fast lane (CONTRIBUTING, "Running the tests"): `pytest -m "not slow"` leaves out what trains,
# starts processes, builds the book, opens a browser or runs a notebook. Tests mark themselves
# `slow`; these get their marks from what they are or what they use.
FIXTURE_MARKS = {
    "built_book": ("book", "slow"),                 # tests/test_book.py: a whole book build
    "browser": ("browser", "slow"),                 # pages opened in headless Chrome
    "trained": ("slow",), "shaped": ("slow",),      # tests/test_cli.py: `train` runs
    "swept": ("slow",),                             # tests/test_sweep.py: a real sweep
    "copier": ("slow",), "copier_run": ("slow",),   # a model trained to copy (below)
    "alone": ("slow",),                             # tests/test_cli_hostile.py: the shipped model translates
    "prepared_multi30k": ("slow",),                 # tests/test_cli.py: `prepare` over the slice (below)
}


# `pytest` runs on every core (pyproject.toml: -n auto --dist loadfile): each test file and each
# notebook runs on one xdist worker, in order (a notebook's cells share one kernel; a file's module
# fixtures are built once). FIRST: the longest start first, so that no long one is left for the
# end; LAST: what reads a build another file makes once per run (`once_per_run`) goes last, when
# that build is likely done, so that its worker does not wait for it.
# (FIRST: longest first, by `pytest --durations=0` summed per file on a 2-core AMD EPYC)
FIRST = ["test_book", "10_1_multi30k", "test_training", "test_cli", "i_web", "test_sweep", "d_2_fast", "e_2_loop",
         "03_scaling", "09_decoding", "test_plots", "a_data", "d_performance", "test_cli_hostile", "08_training",
         "f_devices", "19_decoder_only", "test_warm_kernel", "test_web_tokenizer", "test_gpt"]
LAST = ["test_api_page"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)} | {name: len(FIRST) + 2 + i for i, name in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(FIRST) + 1))   # stable: in-file order kept
    for item in items:
        marks = set()
        if item.path.suffix == ".ipynb":                                # nbval: a chapter's cells
            marks |= {"notebooks", "slow"}
        for name in getattr(item, "fixturenames", ()):
            marks |= set(FIXTURE_MARKS.get(name, ()))
        for mark in sorted(marks):
            item.add_marker(mark)


@pytest.fixture(scope="session")
def multi30k():
    """The command line, the sweep and the training tests run on the real corpus: a missing corpus
    is a failure, not a skip (a skipped suite would look green). It downloads when it can."""
    from transformer.data import DataError, load_multi30k
    try:
        load_multi30k("de", "en", "val", progress=False)
    except DataError as e:
        pytest.fail(f"these tests need Multi30k: {e}")


# what a command-line run needs of Multi30k's train split when the claim is about the run, not about the corpus:
# pairs enough for a 1,000-piece tokenizer and for tens of steps of a tiny model in under one epoch. Not slow itself
# (a tenth of a second): a test that trains on it marks itself, a bad-input test that only reads it stays in the
# fast lane (test_cli's test_batch_tokens_too_small_fails_before_the_tokenizer)
SLICE_PAIRS = 2000


@pytest.fixture(scope="session")
def multi30k_slice(multi30k, tmp_path_factory) -> Path:
    """A directory holding multi30k/: the first `SLICE_PAIRS` lines of Multi30k's train files (de, en, fr) and
    its val and test files whole, byte for byte, built once per run. `train --data DIR --unverified-data` on it
    is `train` on Multi30k (the same files, the same code), with a fifteenth of the training text to tokenize:
    for the tests whose runs only need to exist (the checksums are of the whole files, hence --unverified-data)."""
    from transformer.data import cache_dir, download_multi30k, multi30k_dir

    def build(out):
        (out / "multi30k").mkdir()
        for split, lang in [(split, lang) for split in ("train", "val", "test_2016_flickr") for lang in ("de", "en", "fr")]:
            name = f"{split}.{lang}.gz"
            found = next((d / name for d in (multi30k_dir(), cache_dir()) if (d / name).is_file()), None)
            found = found or download_multi30k(split, lang, progress=False) / name
            if split == "train":
                lines = gzip.decompress(found.read_bytes()).split(b"\n")[:SLICE_PAIRS]
                (out / "multi30k" / name).write_bytes(gzip.compress(b"\n".join(lines) + b"\n", mtime=0))
            else:
                shutil.copyfile(found, out / "multi30k" / name)
    return once_per_run(tmp_path_factory, "multi30k_slice", build)


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """A folder that `build(folder)` fills once per test run, whichever xdist worker asks first; the
    others wait for it and read the same folder (`pytest -n 0`: the one process builds it). A build
    that failed fails every test that asks for it, with the same message, and is not tried again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):                       # gw0, gw1, ...: a worker of xdist
        base = base.parent                                          # the workers' common parent
    folder, done, failed = base / name, base / f"{name}.done", base / f"{name}.failed"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists() and not failed.exists():
            folder.mkdir(exist_ok=True)
            try:
                build(folder)
                done.touch()
            except (Exception, pytest.fail.Exception) as e:         # an assert, or pytest.fail
                failed.write_text(json.dumps("".join(traceback.format_exception_only(e)).strip()))
    if failed.exists():
        pytest.fail(f"{name}, built once for the whole run, failed: {json.loads(failed.read_text())}")
    return folder


@pytest.fixture(scope="session")
def built_book(tmp_path_factory) -> Path:
    """The whole book (jupyter-book, warnings as errors), built once per run: tests/test_book.py reads
    its pages and tests/test_api_page.py its appendix G."""
    def build(out):
        result = subprocess.run(["jupyter-book", "build", str(ROOT), "--path-output", str(out), "-W",
                                 "--keep-going"], capture_output=True, text=True)
        assert result.returncode == 0, ("book build failed (warnings are errors):\n" + result.stdout[-6000:]
                                        + result.stderr[-3000:])
    return once_per_run(tmp_path_factory, "book", build) / "_build" / "html"


@pytest.fixture(scope="session")
def copier_run(tmp_path_factory) -> Path:
    """A tiny model trained to copy its input (250 steps on one thread), once per run for every worker
    that asks: its run directory, best.pt by validation loss, with history.json (the loop's records)
    and result.json. tests/test_decoding.py decodes with it, tests/test_training.py checks that it
    learned: one training where each file trained its own."""
    # 250 steps (400 before), seeds 0-5 (seed 1 is the second regime's seed 0; one thread in both): the first
    # evaluation's val_nll 1.37-1.59, the best of the last two 0.009-0.022 (worst: seed 5), and best.pt copies
    # 57-59 of test_decoding's 60 held-out inputs by greedy, beam 4 and beam 3 without a length penalty
    # (worst: seed 3, 57 by beam 3)
    def build(out):
        from copy_task import copy_examples

        from transformer.engine.loop import RunConfig, train
        from transformer.model import Transformer, TransformerConfig
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(0)
            model = Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=32, d_ff=128, h=4,
                                                  n_layers=2, dropout=0.0, max_len=64, norm_first=True))
            result = train(model, copy_examples(3000, seed=1, hi=6), copy_examples(100, seed=2, hi=6),
                           RunConfig(batch_tokens=1024, max_steps=250, warmup=50, lr_scale=0.2, eval_every=50,
                                       label_smoothing=0.0), out_dir=out, progress=False)
        finally:
            torch.set_num_threads(threads)
        (out / "history.json").write_text(json.dumps(result.history))
        (out / "result.json").write_text(json.dumps({k: getattr(result, k) for k in
                                                     ("stopped", "step", "tokens", "tokens_per_second")}))
    return once_per_run(tmp_path_factory, "copier", build)
