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
