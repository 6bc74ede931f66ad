"""The CUDA path: runs where torch sees a GPU, skips elsewhere (CI has none).

What each test proves on a GPU: a training step in bf16 and in float16 (with its GradScaler) that
never waits for the device (CUDA's sync debug mode turns any host sync into an error), the step
compiled by inductor into a bounded number of graphs, NCCL DDP against one process (two GPUs or
more), decoding on the device equal to the CPU's, and the benchmark with its MFU. README says
where these last ran."""
import pytest
import torch
import torch.multiprocessing as mp
from copy_task import copy_examples as _copy_examples
from copy_task import free_port

from transformer.engine.loop import RunConfig, _Loop, train
from transformer.model import Transformer, TransformerConfig
from transformer.training import collate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def copy_examples(n, seed=0):
    return _copy_examples(n, seed, vocab=32, hi=12)


def config(**kw):
    return TransformerConfig(**{**dict(src_vocab=32, tgt_vocab=32, d_model=64, d_ff=128, h=4, n_layers=2,
                                       dropout=0.1, max_len=64), **kw})


def quick(**kw):
    return RunConfig(**{**dict(batch_tokens=600, max_steps=30, warmup=20, eval_every=15, log_every=5), **kw})


def steps_without_sync(loop, n):
    "Run n steps of the loop with CUDA's sync debug mode set to error: any host sync raises."
    batches = iter(loop.schedule())
    items = [next(batches) for _ in range(n)]
    tensors = [[t.pin_memory().to(CUDA, non_blocking=True) for t in loop.tensors(item)] for item in items]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for item, ts in zip(items, tensors):
            loop.step(ts, item[3])               # the step's target tokens
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return loop.read_window()


@pytest.mark.parametrize("bf16", [True, False])
def test_a_step_never_waits_for_the_gpu(monkeypatch, bf16):
    if not bf16:                                  # a GPU without bf16: float16 and a GradScaler
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    torch.manual_seed(0)
    model = Transformer(config()).to(CUDA)
    loop = _Loop(model, copy_examples(400), None, quick(), None, None, False, None)
    # attention without cuDNN's kernel, which plans anew for every input shape (engine.devices.fast_kernels)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert loop.precision.dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert (loop.precision.scaler is None) == bf16
    loss, nll, grad_norm = steps_without_sync(loop, 6)
    assert loss > 0 and nll > 0 and grad_norm > 0
    assert loop.at["step"] == 6


@pytest.mark.parametrize("bf16", [True, False])
def test_training_learns_on_the_gpu(monkeypatch, bf16, tmp_path):
    if not bf16:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    torch.manual_seed(0)
    model = Transformer(config(dropout=0.0)).to(CUDA)
    # quick()'s peak rate is too high for this to learn in 120 steps (on the CPU the ratio below is 0.86 to 0.94)
    result = train(model, copy_examples(800), copy_examples(40, seed=1),
                   quick(max_steps=120, eval_every=60, lr_scale=0.5, warmup=50, label_smoothing=0.0),
                   out_dir=tmp_path, progress=False)
    losses = [r["loss"] for r in result.history if r["kind"] == "train"]
    assert losses[-1] < 0.6 * losses[0]         # on the CPU, 10 seeds: 0.22 to 0.40 (float32 and bf16)
    assert (tmp_path / "last.pt").exists() and (tmp_path / "best.pt").exists()


def test_compiled_step_on_the_gpu_one_graph_for_many_shapes(tmp_path):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Transformer(config()).to(CUDA)
    result = train(model, copy_examples(400), None, quick(max_steps=12, compile=True), out_dir=tmp_path,
                   progress=False)
    assert result.step == 12
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_decoding_on_the_gpu_matches_the_cpu():
    from transformer.engine.fast import beam_search, greedy_search
    torch.manual_seed(0)
    model = Transformer(config(dropout=0.0)).eval()
    src, _ = collate(copy_examples(8, seed=2), list(range(8)))
    with torch.no_grad():
        cpu_logits = model(src, src)
        gpu = model.to(CUDA)
        gpu_logits = gpu(src.to(CUDA), src.to(CUDA)).cpu()
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=2e-2, rtol=0)   # TF32 may be on
    assert len(greedy_search(gpu, src.to(CUDA))) == 8
    assert len(beam_search(gpu, src.to(CUDA), beam_size=4)) == 8


def _nccl_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = Transformer(config(dropout=0.0)).to(f"cuda:{rank}")
        result = train(model, copy_examples(300), copy_examples(20, seed=3),
                       quick(max_steps=6, batch_tokens=800, eval_every=6, log_every=1, amp=False),
                       out_dir=out_dir, progress=False)
        torch.save([r["loss"] for r in result.history if r["kind"] == "train"], f"{out_dir}/losses{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs two GPUs or more")
def test_nccl_ddp_matches_one_process(tmp_path):
    torch.manual_seed(0)
    single = Transformer(config(dropout=0.0)).to(CUDA)
    torch.backends.cuda.matmul.allow_tf32 = False
    one = train(single, copy_examples(300), copy_examples(20, seed=3),
                quick(max_steps=6, batch_tokens=800, eval_every=6, log_every=1, accum_steps=2, amp=False),
                out_dir=tmp_path / "one", progress=False)
    (tmp_path / "two").mkdir()
    mp.spawn(_nccl_worker, args=(2, free_port(), str(tmp_path / "two")), nprocs=2, join=True)
    expected = [r["loss"] for r in one.history if r["kind"] == "train"]
    for rank in range(2):
        assert torch.load(tmp_path / "two" / f"losses{rank}.pt") == pytest.approx(expected, rel=1e-3)


def test_bench_on_the_gpu_prints_tokens_per_second_and_mfu(capsys):
    "The benchmark on CUDA: both models timed side by side, MFU against the device's assumed peak."
    from transformer.cli import bench
    from transformer.cli.measure import assumed_peak_tflops
    assert bench.main(["--device", "cuda", "--preset", "small", "--repeats", "2", "--vocab-size", "2000",
                       "--decode-sentences", "8"]) == 0
    out = capsys.readouterr().out
    assert "on cuda" in out and "train target tokens/s" in out
    assert "train TFLOP/s" in out
    if assumed_peak_tflops(torch.cuda.get_device_name()):              # a device in the table: its MFU
        assert "MFU" in out
    print(out)
