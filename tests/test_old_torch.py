"""pyproject.toml allows torch>=2.4: the GPU paths must not call what torch 2.4 lacks (read in the 2.4.0
wheel): `torch.accelerator` (torch 2.6) and Dynamo's `recompile_limit` (torch 2.7; `cache_size_limit`
before). Both run only on a GPU or with --compile, so each is shown here with torch 2.4 simulated."""
import types

import torch
from copy_task import copy_examples

import transformer.cli.bench as bench
import transformer.engine.loop as loop
from transformer.engine.loop import RunConfig
from transformer.model import Transformer, TransformerConfig


def test_bench_waits_for_a_gpu_without_torch_accelerator(monkeypatch):
    "bench's timer on CUDA and MPS under torch 2.4, which has no torch.accelerator."
    monkeypatch.delattr(torch, "accelerator", raising=False)
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waited.append(("mps", None)))
    for dev in (torch.device("cuda", 1), torch.device("mps"), torch.device("cpu")):
        assert bench._Bench.timed(types.SimpleNamespace(dev=dev), lambda: None) >= 0
    assert waited == [("cuda", torch.device("cuda", 1))] * 2 + [("mps", None)] * 2   # before and after; none on the CPU


def test_a_bucketed_compile_raises_dynamos_limit_under_its_torch_2_4_name(monkeypatch):
    "train(compile=True, buckets=8) under torch 2.4, whose Dynamo config has cache_size_limit, not recompile_limit."
    old = types.SimpleNamespace(cache_size_limit=8)
    monkeypatch.setattr(torch._dynamo, "config", old)
    monkeypatch.setattr(torch, "compile", lambda net, **kwargs: net)    # the limit is what is checked here
    monkeypatch.setattr(loop, "inductor_workarounds", lambda: None)
    model = Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=1,
                                          max_len=256))
    loop._Loop(model, copy_examples(20), None, RunConfig(compile=True, max_steps=1), None, None, False, None,
               buckets=8)
    assert old.cache_size_limit == 256 // 8 + 2
