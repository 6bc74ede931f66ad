"""Appendix F, devices.py: precision, the step skipped on the device, batches made ahead of time, peak memory."""
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from transformer.engine.devices import (
    Precision,
    all_sum,
    choose_precision,
    peak_memory,
    prefetch,
    world,
)


def test_choose_precision_on_each_kind_of_device(monkeypatch):
    assert choose_precision("cpu").dtype is None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cpu_bf16=True on a CPU without bf16")
        assert choose_precision("cpu", cpu_bf16=True).dtype == torch.bfloat16
    assert choose_precision("cpu", amp=True).scaler is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    bf16 = choose_precision("cuda")
    assert bf16.dtype == torch.bfloat16 and bf16.scaler is None
    # a T4 or a V100: bf16 only by emulation (the default including_emulation=True says yes)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available")   # GradScaler, no GPU
        fp16 = choose_precision("cuda")
    assert fp16.dtype == torch.float16 and isinstance(fp16.scaler, torch.amp.GradScaler)
    assert choose_precision("cuda", amp=False).dtype is None


def test_a_cpu_without_bf16_units_is_warned(monkeypatch):
    import transformer.engine.devices as devices
    monkeypatch.setattr(devices, "cpu_has_bf16_units", lambda: False)
    with pytest.warns(UserWarning, match="without bf16 instructions"):
        choose_precision("cpu", cpu_bf16=True)


@pytest.mark.parametrize("fused", [True, False])
def test_precision_step_skips_a_flagged_update_on_the_device(fused):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1, fused=fused or None)
    precision = Precision("cpu")
    p.grad = torch.tensor([1.0, 2.0, float("nan")])
    precision.step(opt, torch.tensor(1.0))                        # flagged: nothing changes
    assert torch.equal(p.detach(), torch.ones(3))
    assert not hasattr(opt, "found_inf")
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    precision.step(opt, torch.tensor(0.0))                        # not flagged: an Adam step
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))
    assert float(opt.state[p]["step"]) == 1.0                      # the skipped step did not count


def test_autocast_context_follows_the_precision():
    x = torch.randn(4, 4)
    with Precision("cpu", torch.bfloat16).autocast():
        assert (x @ x).dtype == torch.bfloat16
    with Precision("cpu").autocast():
        assert (x @ x).dtype == torch.float32


def make(item):
    return torch.tensor(item), torch.tensor(item) * 10


@pytest.mark.parametrize("threaded", [False, True])
def test_prefetch_yields_every_item_in_order(threaded):
    items = [[i, i + 1] for i in range(20)]
    got = list(prefetch(items, make, "cpu", threaded=threaded))
    assert [i for i, _ in got] == items
    assert all(torch.equal(t[1], torch.tensor(i) * 10) for i, t in got)


def test_prefetch_runs_ahead_in_a_thread_and_stops_when_closed():
    made = []

    def slow(item):
        made.append(item)
        return (torch.tensor([item]),)

    batches = prefetch(iter(range(1000)), slow, "cpu", depth=2, threaded=True)
    assert next(batches)[0] == 0
    deadline = time.monotonic() + 5
    while len(made) < 3 and time.monotonic() < deadline:         # it works ahead of the consumer
        time.sleep(0.01)
    assert len(made) >= 3
    batches.close()                                               # the loop ended early
    assert not any(t.name == "prefetch" for t in threading.enumerate())
    assert len(made) < 10                                         # at most depth ahead, never the rest


def test_prefetch_raises_an_error_of_make_in_the_consumer():
    def broken(item):
        if item == 2:
            raise ValueError("bad item 2")
        return (torch.tensor([item]),)

    batches = prefetch(range(5), broken, "cpu", threaded=True)
    assert [int(t[0]) for _, t in (next(batches), next(batches))] == [0, 1]
    with pytest.raises(ValueError, match="bad item 2"):
        next(batches)


def test_all_sum_is_the_identity_in_one_process():
    assert world() == (0, 1)
    t = torch.tensor([1.0, 2.0])
    assert all_sum(t) is t and t.tolist() == [1.0, 2.0]


def test_peak_memory_cpu_is_the_high_water_mark():
    def fn():
        a = torch.empty(250_000)        # 1 MB
        b = torch.empty(500_000)        # 2 MB -> 3 MB live
        del a
        c = torch.empty(100_000)        # 0.4 MB -> 2.4 MB live
        return b, c
    assert peak_memory(fn, torch.device("cpu")) == 3_000_000


def test_inductor_workarounds_turn_off_the_tiling_analysis_that_failed_on_a_gpu():
    "Met on an H200 with torch 2.11 (book/results/gpu/): the loop and the bench call this before compiling."
    from torch._inductor import config

    from transformer.engine.devices import inductor_workarounds
    if not hasattr(config.triton, "coalesce_tiling_analysis"):
        pytest.skip("this torch has no coalesce_tiling_analysis")
    before = config.triton.coalesce_tiling_analysis
    try:
        config.triton.coalesce_tiling_analysis = True
        inductor_workarounds()
        assert config.triton.coalesce_tiling_analysis is False
        inductor_workarounds()                                          # idempotent
        assert config.triton.coalesce_tiling_analysis is False
    finally:
        config.triton.coalesce_tiling_analysis = before


def test_fast_kernels_take_cudnn_out_of_attention_on_a_gpu_only(monkeypatch):
    """On CUDA: TF32, and scaled dot-product attention without cuDNN's kernel, which builds a plan for every new
    input shape (the H200's slow first epoch, appendix F). On the CPU nothing changes. The flags are torch's own
    (saved and restored here); the loop, the benchmark and `load` (so translate and evaluate) call this."""
    from transformer.engine.devices import fast_kernels
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        fast_kernels(torch.device("cpu"))
        assert calls == [] and not torch.backends.cuda.matmul.allow_tf32
        fast_kernels(torch.device("cuda"))
        assert calls == [False] and torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_load_sets_the_fast_kernels_for_its_device(monkeypatch):
    "transformer.load (the command line's translate and evaluate, and the Python API) sets them for where it loads."
    import transformer.engine.trained as trained
    seen = []
    monkeypatch.setattr(trained, "fast_kernels", seen.append)
    trained.load(Path(__file__).resolve().parents[1] / "book" / "model")
    assert seen == [torch.device("cpu")]
