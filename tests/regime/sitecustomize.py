"""The second numeric regime (CONTRIBUTING, "Any CPU"; run by `.ci/regime`).

Python imports `sitecustomize` at start-up from the first folder of its path that holds one, so with
this folder on PYTHONPATH every process of a test run imports it: pytest, its xdist workers, the
notebooks' kernels under nbval, and the `python -m transformer` subprocesses. With
TRANSFORMER_SEED_SHIFT=k, every seed given to torch's global generator, to `random` and to numpy's
global generator moves by k: each model starts from other weights and draws other dropout masks.
(Seeded `torch.Generator`s, which make the tests' data, keep their seeds: the data stays the same.)
The thread count is the caller's: `.ci/regime` sets OMP_NUM_THREADS.
"""
import os

_shift = int(os.environ.get("TRANSFORMER_SEED_SHIFT", "0") or 0)



def _shifted(seed_fn):
    def seed(value=None, *args, **kwargs):
        return seed_fn(value if value is None else int(value) + _shift, *args, **kwargs)
    seed.__doc__ = seed_fn.__doc__
    return seed


if _shift:
    import random
    random.seed = _shifted(random.seed)
    try:                                    # a process without them (a test's fresh venv) goes on
        import torch
        torch.manual_seed = torch.random.manual_seed = _shifted(torch.manual_seed)
    except ImportError:
        pass
    try:
        import numpy
        numpy.random.seed = _shifted(numpy.random.seed)
    except ImportError:
        pass
