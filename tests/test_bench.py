"""transformer.cli.bench: the reference computes our function, the FLOP count is exact, and the benchmark runs end
to end on real Multi30k batches, feeding both models the same inputs (the memory probe, engine.devices.peak_memory,
is tested in test_devices.py). No assertion here reads a clock."""
import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from transformer.cli import bench
from transformer.cli.measure import (
    TorchTransformer,
    assumed_peak_tflops,
    copy_weights,
    train_flops,
    train_step,
)
from transformer.engine.devices import cpu_has_bf16_units, pick_device
from transformer.engine.fast import greedy_search
from transformer.masking import causal_mask
from transformer.model import Transformer, TransformerConfig
from transformer.tokens import BOS, PAD

ROOT = Path(__file__).resolve().parents[1]
# one thread (the fixture, tests/conftest.py): the models are tiny, a second thread only waits on a busy machine
pytestmark = [pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"), pytest.mark.usefixtures("one_thread")]

# one thread: on a busy two-core machine two OpenMP threads wait on each other (slow, not wrong)
SMALL_RUN = ["--preset", "tiny", "--device", "cpu", "--repeats", "2", "--batches", "2", "--max-tokens", "400",
             "--decode-sentences", "4", "--vocab-size", "500", "--threads", "1", "--warmup", "1"]


def _pair(norm_first=False, vocab=120):
    torch.manual_seed(0)
    cfg = TransformerConfig.preset("tiny", src_vocab=vocab, tgt_vocab=vocab, dropout=0.0, norm_first=norm_first)
    ours = Transformer(cfg).double().eval()
    if norm_first:  # make the final LayerNorms non-trivial, so that copying them is tested
        with torch.no_grad():
            for norm in (ours.encoder.norm, ours.decoder.norm):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)
    return ours, copy_weights(ours, TorchTransformer(cfg).double()).eval()


def _batch(vocab=120):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, vocab, (4, 8), generator=g)
    src[1, 5:] = PAD
    tgt_in = torch.randint(4, vocab, (4, 6), generator=g)
    tgt_in[:, 0] = BOS
    tgt_in[2, 4:] = PAD
    return src, tgt_in


@pytest.mark.parametrize("norm_first", [False, True])
def test_reference_computes_our_function(norm_first):
    ours, ref = _pair(norm_first)
    src, tgt_in = _batch()
    with torch.no_grad():
        a, b = ours(src, tgt_in), ref(src, tgt_in)
    real = tgt_in != PAD
    torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-10)
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())


def test_reference_can_fail():
    "The equivalence test above can fail: one changed weight breaks it."
    ours, ref = _pair()
    with torch.no_grad():
        ref.core.decoder.layers[0].linear1.weight[0, 0] += 0.5
    src, tgt_in = _batch()
    with torch.no_grad():
        assert (ours(src, tgt_in) - ref(src, tgt_in)).abs().max() > 1e-6


@pytest.mark.slow
def test_reference_decode_takes_a_causal_mask_and_decodes_alike():
    ours, ref = _pair()
    src, tgt_in = _batch()
    memory = ours.encode(src)
    with torch.no_grad():
        a = ours.decode(tgt_in, memory, tgt_mask=causal_mask(tgt_in.size(1)))
        b = ref.decode(tgt_in, memory, tgt_mask=causal_mask(tgt_in.size(1)))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert greedy_search(ours, src, extra_len=4, cache=False) == greedy_search(ref, src, extra_len=4, cache=False)
    with pytest.raises(ValueError, match=r"one \(T, T\) = \(6, 6\) target mask"):
        ref.decode(tgt_in, memory, tgt_mask=torch.ones(4, 1, 6, 6, dtype=torch.bool))


@pytest.mark.parametrize("model_cls", [Transformer, TorchTransformer])
@pytest.mark.parametrize("B,S,T", [(3, 7, 5), (2, 4, 9)])
@pytest.mark.slow
def test_train_flops_equal_pytorch_flop_counter(model_cls, B, S, T):
    cfg = TransformerConfig.preset("tiny", src_vocab=90, tgt_vocab=90)
    model = model_cls(cfg)
    src, tgt = torch.randint(4, 90, (B, S)), torch.randint(4, 90, (B, T + 1))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:   # the fused kernel is opaque
        train_step(model, torch.optim.Adam(model.parameters()), src, tgt)
    assert counter.get_total_flops() == train_flops(cfg, B, S, T)


def test_assumed_peaks():
    assert assumed_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert assumed_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert assumed_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert assumed_peak_tflops("Some Future GPU") is None


@pytest.mark.slow
def test_bench_end_to_end_table_and_json(capsys, monkeypatch, tmp_path):
    """Real Multi30k batches, tiny preset: the table ends in a parsable line, --out writes the JSON result
    (and nothing else), --json is one valid object."""
    seen = {"Transformer": [], "TorchTransformer": []}
    decoded = {"Transformer": [], "TorchTransformer": []}
    real_step, real_search = bench.train_step, bench.greedy_search

    def recording_step(model, optimizer, src, tgt, autocast=False, criterion=None):
        seen[type(model).__name__].append((src.clone(), tgt.clone()))
        return real_step(model, optimizer, src, tgt, autocast, criterion)

    def recording_search(model, src, **kwargs):
        decoded[type(model).__name__].append((src.clone(), kwargs.get("cache", True)))
        return real_search(model, src, **kwargs)

    threads_before = torch.get_num_threads()
    real_data = bench.bench_data       # real batches of Multi30k's first 2,000 pairs: a fifteenth of the tokenizing
    monkeypatch.setattr(bench, "bench_data", lambda *args, **kwargs: real_data(*args, **{"n_pairs": 2000, **kwargs}))
    monkeypatch.setattr(bench, "train_step", recording_step)
    monkeypatch.setattr(bench, "greedy_search", recording_search)
    saved = tmp_path / "r" / "bench.json"
    assert bench.main(SMALL_RUN + ["--out", str(saved)]) == 0           # the table, and the result in a file
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"speedup_vs_nn: (\d+\.\d\d)", last)
    assert m and float(m.group(1)) > 0
    result = json.loads(saved.read_text())
    assert last == f"speedup_vs_nn: {result['speedup_vs_nn']:.2f}"
    assert [p.name for p in saved.parent.iterdir()] == ["bench.json"]          # no temporary file left behind
    assert "train target tokens/s" in out and "greedy decode sentences/s" in out

    # both models saw the same batches, in the same number, and decoded the same sources
    a, b = seen["Transformer"], seen["TorchTransformer"]
    assert len(a) == len(b) == 1 * 2 + 2 * 2 + 1      # warm-up pass over 2 batches, 2 rounds x 2 batches, memory
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    # the warm-up pass and each round go over the same two batches, in the same order
    assert all(torch.equal(a[i][0], a[i % 2][0]) and torch.equal(a[i][1], a[i % 2][1]) for i in range(6))
    da = [x for x, cache in decoded["Transformer"] if not cache]       # the comparison: no cache for either
    db = [x for x, cache in decoded["TorchTransformer"] if not cache]
    assert len(da) == len(db) > 0 and all(torch.equal(x, y) for x, y in zip(da, db))
    assert not any(cache for _, cache in decoded["TorchTransformer"])
    assert [x.shape for x, cache in decoded["Transformer"] if cache]     # ours is also timed with its cache

    # the JSON result of that run (--out writes what --json prints)
    assert result["speedup_vs_nn"] == pytest.approx(sorted(result["train"]["ratio"])[0] / 2
                                                    + sorted(result["train"]["ratio"])[1] / 2)
    assert len(result["train"]["ours_tokens_per_s"]) == len(result["train"]["nn_tokens_per_s"]) == 2
    assert result["data"]["max_tokens"] == 400 and result["preset"] == "tiny"
    assert result["command"] == "python -m transformer bench " + " ".join(SMALL_RUN + ["--out", str(saved)])
    for key in ("git_commit", "git_dirty", "torch", "device_name", "threads", "started_utc"):
        assert key in result
    assert result["memory"]["train_peak_bytes"]["ours"] > 0 and result["flops"]["mfu"] is None
    assert len(result["decode"]["ours_cached_sentences_per_s"]) == 2 and result["decode"]["cached_median_ratio"] > 0
    # EOS is forbidden while timing: every sentence runs to its limit, the same work for all three
    gen = result["decode"]["generated_tokens"]
    assert gen["ours"] == gen["nn"] == gen["ours cached"] > 0, gen
    assert result["bf16_autocast"] == cpu_has_bf16_units()           # the default: training's precision here
    assert result["keep_freed_memory"] in (True, False)
    assert result["threads"] == 1 and torch.get_num_threads() == threads_before  # restored
    # --json prints the same object on stdout, and nothing else (one round over one batch: the format)
    short = SMALL_RUN + ["--repeats", "1", "--batches", "1", "--decode-sentences", "1", "--warmup", "0", "--json"]
    assert bench.main(short) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed.keys() == result.keys() and printed["command"].startswith("python -m transformer bench")
    assert "--json" in printed["command"] and len(printed["train"]["ours_tokens_per_s"]) == 1


@pytest.mark.parametrize("where", ["under a file", "deeper under a file", "a directory", "a run's results"])
def test_bad_out_is_refused_before_the_benchmark(where, tmp_path, capsys, monkeypatch):
    "A wrong --out fails at once (the benchmark never starts): one line on stderr, exit 2, nothing written."
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text('{"bleu": 40.0}\n')
    out = {"under a file": a_file / "bench.json", "deeper under a file": a_file / "sub" / "bench.json",
           "a directory": tmp_path, "a run's results": tmp_path / "run" / "results.json"}[where]
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m transformer bench: error: --out "), err
    assert {"a directory": "is a directory", "a run's results": "exists and is not a bench result"}.get(
        where, f"{a_file} is a file") in err
    assert (tmp_path / "run" / "results.json").read_text() == '{"bleu": 40.0}\n' 
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run"] and a_file.read_text() == "keep"


def test_bad_out_from_the_command_line(tmp_path, capsys):
    """The same through `python -m transformer bench`'s entry point (transformer.__main__.main), in this
    process: exit code 2, one line, no traceback (`python -m transformer` in a fresh process: tests/test_cli.py)."""
    from transformer.__main__ import main as entry
    with pytest.raises(SystemExit) as e:
        entry(["bench", "--out", str(tmp_path)])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "is a directory" in captured.err, captured.err
    assert captured.err.startswith("python -m transformer bench: error: --out ")
    assert list(tmp_path.iterdir()) == []


def test_out_is_written_all_or_nothing(tmp_path, capsys, monkeypatch):
    "A write that fails at the end leaves the old file as it was, no temporary file, and the result on stdout."
    out = tmp_path / "bench.json"
    old = '{"speedup_vs_nn": 1.2}\n'                                    # an earlier result
    out.write_text(old)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {"speedup_vs_nn": 1.5})

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)                     # under atomic_write
    assert bench.main(["--json", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"speedup_vs_nn": 1.5, "command": f"python -m transformer bench --json --out {out}"}
    assert captured.err.count("\n") == 1 and "no space left on the device while saving" in captured.err
    assert "the previous bench.json is intact" in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"] and out.read_text() == old


@pytest.mark.parametrize("argv,message", [
    (["--repeats", "0"], r"--repeats=0 must be >= 1"),
    (["--batches", "-1"], r"--batches=-1 must be >= 1"),
    (["--max-tokens", "0"], r"--max-tokens=0 must be >= 1"),
    (["--threads", "0"], r"--threads=0 must be >= 1"),
    (["--warmup", "-1"], r"--warmup=-1 must be >= 0"),
    (["--peak-tflops", "0"], r"--peak-tflops=0.0 must be > 0"),
    (["--preset", "huge"], r"invalid choice: 'huge'"),
    (["--device", "tpu"], r"invalid choice: 'tpu'"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bad_values_in_python():
    with pytest.raises(ValueError, match=r"repeats=0 must be an int >= 1"):
        bench.run_bench(repeats=0)
    with pytest.raises(ValueError, match=r"--device tpu: not one of auto, cpu, cuda, mps"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no CUDA device is available here .* use --device auto or --device cpu"):
            pick_device("cuda")
    with pytest.raises(ValueError, match=r"only \d+ batches of max_tokens=100000"):
        bench.bench_data(n_batches=50, max_tokens=100_000, vocab_size=500, n_pairs=2000)


def test_python_m_transformer_dispatches_bench(capsys):
    "`python -m transformer bench ...` reaches transformer.cli.bench (wired in the hand-written __main__.py)."
    from transformer.__main__ import main as entry

    with pytest.raises(SystemExit) as exc:
        entry(["bench", "--help"])
    assert exc.value.code == 0
    assert "--preset" in capsys.readouterr().out


@pytest.mark.parametrize("extras", [dict(), dict(attention_dropout=0.2, ffn_dropout=0.3)])
def test_reference_drops_out_where_ours_does(extras):
    "Dropout rates must match site by site, or the benchmark would time different work."
    cfg = TransformerConfig.preset("tiny", src_vocab=50, tgt_vocab=50, dropout=0.1, **extras)
    ours, ref = Transformer(cfg), TorchTransformer(cfg)
    attn, ffn = extras.get("attention_dropout", 0.0), extras.get("ffn_dropout", 0.0)
    for mine, theirs in [*zip(ours.encoder.layers, ref.core.encoder.layers),
                         *zip(ours.decoder.layers, ref.core.decoder.layers)]:
        assert mine.self_attn.dropout == theirs.self_attn.dropout == attn
        assert mine.feed_forward.dropout.p == theirs.dropout.p == ffn
        assert mine.dropout1.p == theirs.dropout1.p == 0.1
        if hasattr(mine, "cross_attn"):
            assert mine.cross_attn.dropout == theirs.multihead_attn.dropout == attn


@pytest.mark.parametrize("cuda, decodes", [(False, 1), (True, 3)])
def test_the_warm_up_decodes_every_batch_on_a_gpu(cuda, decodes):
    """A first call of each shape costs more on a GPU (the H200's first decode round was 9x slower than the later
    ones): there the warm-up decodes every batch, each model and ours with the cache; on the CPU one batch."""
    import types

    from transformer.cli.bench import _Bench
    calls = []
    stub = types.SimpleNamespace(models={"ours": None, "nn": None}, batches=[0, 1], decode_srcs=[0, 1, 2], cuda=cuda,
                                 step=lambda name, i: calls.append(("step", name, i)),
                                 decode=lambda name, i, cache=False: calls.append(("decode", name, i, cache)))
    _Bench.warm_up(stub, 1, False)
    for name, cache in (("ours", False), ("nn", False), ("ours", True)):
        assert [c[2] for c in calls if c[:2] == ("decode", name) and c[3] == cache] == list(range(decodes))
    assert [c for c in calls if c[0] == "step"] == [("step", n, i) for n in ("ours", "nn") for i in (0, 1)]
