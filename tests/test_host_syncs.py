"""Issue 44: decoding reads the device rarely. A `TorchFunctionMode` sees every call that, on a GPU, makes the host
wait for the device (a host sync): a tensor turned into a Python value (`bool`, `int`, `float`, `.item()`,
`.tolist()`, `.numpy()`, an index), a data-dependent shape (`nonzero`, `masked_select`, boolean-mask indexing), a
copy to the host (`.cpu()`, `.to("cpu")`) or from Python data (`torch.tensor`, `torch.as_tensor`). Counted on a CPU:
the code paths are the same ones a GPU takes. Appendix D.2's greedy and beam search make at most
ceil(T / POLL_EVERY) + a constant of them for T generated positions, write what chapter 9's plain code writes, and
never copy or reorder the cross-attention's keys and values."""
import math
import types
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

import transformer.engine.fast as fast
from transformer.decoding import greedy_search as plain_greedy_search
from transformer.engine.fast import POLL_EVERY, KVCache, beam_search, greedy_search
from transformer.model import Transformer, TransformerConfig
from transformer.tokens import EOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")

READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "nonzero", "argwhere",
         "masked_select", "unique", "equal", "allclose", "cpu", "tensor", "as_tensor"}
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


def _is_bool_tensor(x):
    return isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8)


class HostSyncs(TorchFunctionMode):
    "Counts (by name) the calls that would make the host wait for a GPU."

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS and not (name in ("tensor", "as_tensor") and isinstance(args[0], torch.Tensor)):
            self.calls[name] += 1
        elif name == "to" and any(a == "cpu" or a == torch.device("cpu") for a in (*args[1:], kwargs.get("device"))):
            self.calls["to(cpu)"] += 1
        elif name in INDEXING and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(_is_bool_tensor(i) for i in index):
                self.calls["boolean index"] += 1
        return func(*args, **kwargs)

    @property
    def total(self):
        return sum(self.calls.values())


def test_the_counter_sees_each_kind_of_read():
    t, rows = torch.arange(6), torch.tensor([0, 2])
    with HostSyncs() as syncs:
        bool(t.any()), int(t.max()), float(t.sum()), t.tolist(), t[0].item(), t.nonzero(), t[t > 2], t.cpu()
        torch.tensor([1, 2]), t.to("cpu"), range(t[1])
        t + 1, t.argmax(), t.view(2, 3), t[1:], t[rows], torch.as_tensor(t)  # none of these
    assert syncs.calls == Counter({"__bool__": 1, "__int__": 1, "__float__": 1, "tolist": 1, "item": 1,
                                   "nonzero": 1, "boolean index": 1, "cpu": 1, "tensor": 1, "to(cpu)": 1,
                                   "__index__": 1})


@pytest.fixture(scope="module")
def model():
    "An untrained model in float64: its outputs run to their limits, and no near-tie flips a token."
    torch.manual_seed(3)
    return Transformer(TransformerConfig(src_vocab=24, tgt_vocab=24, d_model=16, d_ff=32, h=2, n_layers=2,
                                         dropout=0.0, max_len=128)).double().eval()


def sources(B=6, S=7, seed=4):
    src = torch.randint(4, 24, (B, S), generator=torch.Generator().manual_seed(seed))
    src[1, 3:], src[4, 5:] = PAD, PAD
    return src


@pytest.mark.parametrize("extra", [0, 5, 20])
def test_greedy_search_waits_for_the_device_once_per_poll(model, extra):
    src = sources()
    with HostSyncs() as syncs:
        got = greedy_search(model, src, extra)
    positions = src.size(1) + extra            # the longest output the search may write
    # the source's check (min, max), the output limits, torch.tensor(limits), the outputs at the end
    assert syncs.total <= math.ceil(positions / POLL_EVERY) + 5, syncs.calls
    assert got == plain_greedy_search(model, src, extra)       # chapter 9's search, a read every step


def test_greedy_search_stops_within_a_poll_of_the_last_output(model, monkeypatch):
    "A model that writes EOS at once: the loop ends at the first poll, after POLL_EVERY steps, not max_len."
    steps = []
    real = fast.CachedDecoder.next_logits

    def counted(self, ys):
        steps.append(ys.size(1))
        return real(self, ys)
    monkeypatch.setattr(fast.CachedDecoder, "next_logits", counted)
    eos_model = Transformer(model.config).double().eval()
    with torch.no_grad():
        eos_model.generator.bias[EOS] = 1e3        # EOS wins every step
    out = greedy_search(eos_model, sources(), 60)
    assert out == [[]] * 6 and len(steps) == POLL_EVERY


@pytest.mark.parametrize("beam, extra", [(2, 5), (4, 20)])
def test_beam_search_waits_for_the_device_once_per_poll(model, beam, extra):
    src = sources()
    with HostSyncs() as syncs:
        got = beam_search(model, src, beam, extra_len=extra)
    positions = src.size(1) + extra
    assert syncs.total <= math.ceil(positions / POLL_EVERY) + 5, syncs.calls
    assert got == beam_search(model, src, beam, extra_len=extra, cache=False)   # the plain prefix decoder


def test_beam_search_never_copies_the_cross_attention_cache(model, monkeypatch):
    """The fixed caches are allocated with one row per source (not per beam) and never reordered; the
    self-attention caches are reordered, K rows per source."""
    fixed, reordered = [], []
    append, reorder = KVCache.append, KVCache.reorder

    def spy_append(self, k, v):
        if self.fixed:
            fixed.append(k.size(0))
        return append(self, k, v)

    def spy_reorder(self, index):
        reordered.append((self.fixed, index.numel()))
        return reorder(self, index)
    monkeypatch.setattr(KVCache, "append", spy_append)
    monkeypatch.setattr(KVCache, "reorder", spy_reorder)
    src = sources()
    beam_search(model, src, 4, extra_len=6)
    assert fixed == [6] * model.config.n_layers                  # once per layer, B rows
    assert reordered and all(not f and n == 6 * 4 for f, n in reordered)


def test_bleu_callback_tokenizes_the_validation_sources_once(monkeypatch):
    "Three evaluations, one `encode_batch` of the sources; the scores are those of `evaluate` (translate, score)."
    import random

    from transformer.engine.fast import bleu_callback, evaluate
    from transformer.tokens import Tokenizer
    rng = random.Random(0)
    vocab = "zero one two three four five six seven eight nine".split()
    pairs = [(" ".join(rng.choice(vocab) for _ in range(rng.randint(2, 5))),) * 2 for _ in range(200)]
    words = Tokenizer.train([s for p in pairs for s in p], vocab_size=56)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=56, tgt_vocab=56, d_model=16, d_ff=32, h=2, n_layers=1,
                                          dropout=0.0, max_len=64)).eval()
    calls = []
    encode_batch = Tokenizer.encode_batch

    def counted(self, texts, *args, **kwargs):
        calls.append(len(texts))
        return encode_batch(self, texts, *args, **kwargs)
    monkeypatch.setattr(Tokenizer, "encode_batch", counted)
    on_eval = bleu_callback(words, pairs[:12])
    got = [on_eval(model, step) for step in (1, 2, 3)]
    assert calls == [12]
    want = evaluate(model, words, pairs[:12])
    assert got[0] == got[2] == {k: want[k] for k in ("bleu", "bleu_lc_tok", "chrf")}


@pytest.mark.parametrize(("device", "given", "expected"), [("cpu", None, 64), ("cuda", None, 512), ("cuda", 32, 32)])
def test_bleu_callback_decodes_large_batches_on_a_gpu(monkeypatch, device, given, expected):
    """Validation BLEU decodes 64 sentences at a time on a CPU and 512 on a GPU (a decoding step of 64 leaves most of
    it idle), unless told otherwise: the batch size `_translate_ids` is handed, read without a GPU."""
    import transformer.engine.fast as fast
    from transformer.tokens import Tokenizer
    seen = []
    monkeypatch.setattr(fast, "_source_ids", lambda model, tokenizer, texts, size: [[5, 2] for _ in texts])
    monkeypatch.setattr(fast, "_translate_ids", lambda model, tok, ids, k, a, extra, size: seen.append(size) or
                        ["x"] * len(ids))
    model = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device(device))]))
    fast.bleu_callback(Tokenizer.__new__(Tokenizer), [("a", "x")] * 3, batch_size=given)(model, 1)
    assert seen == [expected]
