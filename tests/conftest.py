"""Fixtures shared by the test files."""
import pytest
import torch


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
    "copier": ("slow",),                            # tests/test_decoding.py: a model trained to copy
}


def pytest_collection_modifyitems(config, items):
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
