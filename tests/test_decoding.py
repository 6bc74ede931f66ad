"""Chapter 9, decoding.py: the plain greedy search and the length penalty; appendix D.2, engine/fast.py: the
searches with the KV cache, batched beam search, translate (each proved equal to the plain code)."""
import copy
import random

import pytest
import torch
from copy_task import copy_examples as _copy_examples

from transformer.decoding import greedy_search as plain_greedy_search
from transformer.decoding import length_penalty
from transformer.engine.checkpoints import model_from_checkpoint
from transformer.engine.fast import beam_search, greedy_search, translate
from transformer.model import Transformer, TransformerConfig
from transformer.tokens import BOS, EOS, PAD, Tokenizer, pad_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def copy_examples(n, seed):
    "The copier's task (tests/conftest.py's copier_run): 3 to 6 ids."
    return _copy_examples(n, seed, hi=6)


@pytest.fixture(scope="module")
def copier(copier_run):
    "A tiny model trained to copy its input (tests/conftest.py's copier_run): best.pt by validation loss."
    return model_from_checkpoint(copier_run / "best.pt")


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(1)
    return Transformer(TransformerConfig(src_vocab=20, tgt_vocab=20, d_model=32, d_ff=64, h=4, n_layers=2,
                                         dropout=0.0, max_len=128)).eval()


def test_greedy_and_beam_copy_exactly(copier):
    held_out = copy_examples(60, seed=5)
    src, _ = pad_batch([s for s, _ in held_out])
    want = [t[1:-1] for _, t in held_out]
    # 57-59 of 60 over seeds 0-5 of the 250-step copier (conftest; an untrained model copies none)
    for got in (greedy_search(copier, src), beam_search(copier, src, beam_size=4),
                beam_search(copier, src, beam_size=3, alpha=0.0)):
        assert sum(g == w for g, w in zip(got, want)) >= 50


@pytest.mark.slow
def test_beam_size_one_is_greedy(random_model):
    torch.manual_seed(2)
    src = torch.randint(4, 20, (12, 9))
    src[3, 5:] = PAD
    src[7, 2:] = PAD
    for extra in (0, 3, 50):
        assert beam_search(random_model, src, beam_size=1, extra_len=extra) == greedy_search(random_model, src, extra)


@pytest.mark.parametrize("norm_first", [False, True])
def test_cache_gives_the_outputs_and_logits_of_the_full_prefix(norm_first):
    torch.manual_seed(5)
    model = Transformer(TransformerConfig(src_vocab=20, tgt_vocab=20, d_model=32, d_ff=64, h=4, n_layers=3,
                                          dropout=0.0, max_len=128, norm_first=norm_first)).eval()
    src = torch.randint(4, 20, (6, 7))
    src[2, 3:] = PAD
    assert greedy_search(model, src, 12) == greedy_search(model, src, 12, cache=False)
    assert beam_search(model, src, 3, extra_len=12) == beam_search(model, src, 3, extra_len=12, cache=False)
    from transformer.decoding import PrefixDecoder
    from transformer.engine.fast import CachedDecoder
    from transformer.masking import padding_mask
    mask = padding_mask(src)
    memory = model.encode(src, mask)
    cached, plain = CachedDecoder(model, memory, mask), PrefixDecoder(model, memory, mask)
    ys = torch.full((6, 1), BOS)
    with torch.no_grad():
        for _ in range(6):
            a, b = cached.next_logits(ys), plain.next_logits(ys)
            assert torch.allclose(a, b, atol=1e-5)
            ys = torch.cat([ys, torch.randint(4, 20, (6, 1))], 1)


def test_chapter_9s_plain_greedy_search_writes_what_the_engines_writes(random_model):
    "Chapter 9's greedy_search (PrefixDecoder, no cache) = appendix D.2's, with and without its cache."
    src = torch.randint(4, 20, (6, 7), generator=torch.Generator().manual_seed(8))
    src[1, 3:], src[4, 5:] = PAD, PAD
    for extra in (0, 4, 20):
        plain = plain_greedy_search(random_model, src, extra)
        assert plain == greedy_search(random_model, src, extra) == greedy_search(random_model, src, extra, cache=False)


def test_cached_greedy_matches_on_the_trained_copier(copier):
    src, _ = pad_batch([s for s, _ in copy_examples(30, seed=9)])
    assert greedy_search(copier, src, cache=False) == greedy_search(copier, src)
    assert beam_search(copier, src, 4, cache=False) == beam_search(copier, src, 4)


def test_output_length_is_capped_at_source_plus_extra(random_model):
    src = torch.randint(4, 20, (4, 6))
    src[1, 2:] = PAD                                                   # 2 real tokens
    for extra in (0, 5):
        for hyps in (greedy_search(random_model, src, extra), beam_search(random_model, src, 2, extra_len=extra)):
            lengths = [len(h) for h in hyps]
            assert lengths[1] <= 2 + extra and max(lengths) <= 6 + extra
    quiet = copy.deepcopy(random_model)           # a model that never writes PAD or BOS itself (a random one may),
    with torch.no_grad():                         # so one in an output would be the search's own bookkeeping
        quiet.generator.bias[[PAD, BOS]] = -1e4
    assert all(EOS not in h and PAD not in h and BOS not in h for h in greedy_search(quiet, src))


def test_decoding_does_not_depend_on_the_batch(random_model):
    torch.manual_seed(3)
    seqs = [torch.randint(4, 20, (n,)).tolist() + [EOS] for n in (3, 8, 5, 1)]
    batch, _ = pad_batch(seqs)
    together = greedy_search(random_model, batch, 10), beam_search(random_model, batch, 3, extra_len=10)
    for i, s in enumerate(seqs):
        alone = torch.tensor([s])
        assert greedy_search(random_model, alone, 10)[0] == together[0][i]
        assert beam_search(random_model, alone, 3, extra_len=10)[0] == together[1][i]


def test_beam_finds_at_least_the_greedy_score_on_average(random_model):
    "With alpha=0 beam search maximises log P; it should not do worse than greedy on most inputs."
    torch.manual_seed(4)
    src = torch.randint(4, 20, (16, 5))

    def logp(ids_src, hyp):
        tgt = torch.tensor([[BOS] + hyp + [EOS]])
        logits = random_model(ids_src[None], tgt[:, :-1])
        return logits.log_softmax(-1)[0].gather(-1, tgt[0, 1:, None]).sum().item()

    g, b = greedy_search(random_model, src, 8), beam_search(random_model, src, 4, alpha=0.0, extra_len=8)
    better = [logp(s, bb) >= logp(s, gg) - 1e-4 for s, gg, bb in zip(src, g, b)]
    assert sum(better) >= 14


def test_length_penalty_values():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(10, 0.6) == pytest.approx((15 / 6) ** 0.6)
    assert length_penalty(10, 0.0) == 1.0


@pytest.fixture(scope="module")
def words():
    vocab = "zero one two three four five six seven eight nine".split()
    rng = random.Random(0)
    pairs = []
    for _ in range(500):
        ws = [rng.choice(vocab) for _ in range(rng.randint(2, 6))]
        pairs.append((" ".join(ws), " ".join(ws)))
    return Tokenizer.train([s for p in pairs for s in p], vocab_size=56)


def test_translate_text_to_text_keeps_order_and_handles_empty(random_model, words):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=56, tgt_vocab=56, d_model=32, d_ff=64, h=4, n_layers=1,
                                          dropout=0.0, max_len=128))
    texts = ["one two three", "", "nine", "four four four four five"]
    out = translate(model, words, texts, beam_size=1, batch_size=2)
    assert len(out) == 4 and all(isinstance(t, str) for t in out)
    assert out == [translate(model, words, [t], beam_size=1)[0] for t in texts]
    assert translate(model, words, []) == []
    assert model.training                                              # mode restored
    # the default search is the package's one default everywhere: beam 4, as the paper
    assert translate(model, words, texts, batch_size=2) == translate(model, words, texts, beam_size=4, batch_size=2)


def test_translate_cuts_a_source_longer_than_max_len_with_a_warning(words):
    "translate's checks live in appendix D.2 (`_source_ids`): a long source is cut to max_len, EOS kept."
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=56, tgt_vocab=56, d_model=32, d_ff=64, h=4, n_layers=1,
                                          dropout=0.0, max_len=8)).eval()
    long = " ".join(["one two"] * 10)                                  # 20 words, more than 8 tokens
    with pytest.warns(UserWarning, match=r"1 source\(s\) longer than max_len=8 tokens were cut"):
        out = translate(model, words, [long, "one"], beam_size=1)
    cut = words.encode(long, eos=True)[:7] + [EOS]
    assert out[0] == words.decode(greedy_search(model, torch.tensor([cut]))[0])


@pytest.mark.parametrize("call, error, match", [
    (lambda m, t: greedy_search(m, torch.tensor([4, 5, 6])), ValueError, r"\(B, S\)"),
    (lambda m, t: greedy_search(m, torch.zeros(0, 3, dtype=torch.long)), ValueError, "non-empty"),
    (lambda m, t: greedy_search(m, torch.tensor([[4, 5]]), extra_len=-1), ValueError, "extra_len=-1"),
    (lambda m, t: beam_search(m, torch.tensor([[4, 5]]), beam_size=0), ValueError, "beam_size=0"),
    (lambda m, t: beam_search(m, torch.tensor([[4, 5]]), alpha=-0.5), ValueError, "alpha=-0.5"),
    (lambda m, t: translate(m, t, "one two"), TypeError, "list of sentences"),
    (lambda m, t: translate(m, t, ["one"], batch_size=0), ValueError, "batch_size=0"),
    (lambda m, t: translate(m, t, ["one"]), ValueError, "the tokenizer has 56 tokens but the model expects"),
])
def test_bad_inputs(random_model, words, call, error, match):
    with pytest.raises(error, match=match):
        call(random_model, words)


def test_kv_cache_is_allocated_once_and_follows_beam_reordering():
    from transformer.engine.fast import KVCache
    cache = KVCache(capacity=3)
    k = [torch.full((2, 1, 1, 4), float(i)) for i in range(4)]
    out_k, _ = cache.append(k[0], -k[0])
    storage = cache.k.data_ptr()
    for i in (1, 2):
        out_k, out_v = cache.append(k[i], -k[i])
    assert cache.k.data_ptr() == storage                              # filled in place, never grown
    assert out_k.shape == (2, 1, 3, 4) and out_k[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert torch.equal(out_v, -out_k)
    with pytest.raises(ValueError, match="holds 3 positions"):
        cache.append(k[3], k[3])
    cache.k[1] += 10                                                  # rows differ
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.k[0], cache.k[1]) and cache.k[0, 0, 0, 0] == 10


def test_kv_cache_fixed_holds_one_append_and_bad_uses_are_refused():
    from transformer.engine.fast import KVCache
    memory_k = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    cache = KVCache(fixed=True)
    assert cache.nbytes == 0 and cache.length == 0
    k, v = cache.append(memory_k, 2 * memory_k)
    assert torch.equal(k, memory_k) and torch.equal(v, 2 * memory_k) and cache.length == 7
    assert cache.k.shape == (2, 4, 7, 8) and cache.nbytes == 2 * 2 * 4 * 7 * 8 * 8
    with pytest.raises(ValueError, match="holds 7 positions"):
        cache.append(memory_k[:, :, :1], memory_k[:, :, :1])
    for bad in (0, -1, None, 2.0, True):
        with pytest.raises(ValueError, match="must be a positive int"):
            KVCache(bad)
    cache = KVCache(5)
    cache.append(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))
    with pytest.raises(ValueError, match="do not fit this cache"):
        cache.append(torch.zeros(3, 4, 1, 8), torch.zeros(3, 4, 1, 8))
    with pytest.raises(ValueError, match="needs capacity >= 7"):
        cache.append(torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 8))


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_logits_equal_the_prefix_logits_step_by_step_in_float64(norm_first):
    "Step by step, with beam-style reordering of the rows: the cache changes no logit (float64)."
    from transformer.decoding import PrefixDecoder
    from transformer.engine.fast import CachedDecoder
    from transformer.masking import padding_mask
    torch.manual_seed(6)
    model = Transformer(TransformerConfig(src_vocab=20, tgt_vocab=20, d_model=32, d_ff=64, h=4, n_layers=2,
                                          dropout=0.0, max_len=64, norm_first=norm_first)).double().eval()
    src = torch.randint(4, 20, (3, 6))
    src[1, 4:] = PAD
    K, g = 2, torch.Generator().manual_seed(0)
    with torch.no_grad():
        mask = padding_mask(src)
        memory = model.encode(src, mask).repeat_interleave(K, 0)        # (3K, S, d_model)
        mask = mask.repeat_interleave(K, 0)
        cached, plain = CachedDecoder(model, memory, mask, 8), PrefixDecoder(model, memory, mask)
        ys = torch.full((3 * K, 1), BOS)
        for _ in range(8):
            a, b = cached.next_logits(ys), plain.next_logits(ys)
            assert a.dtype == torch.float64 and torch.allclose(a, b, atol=1e-10, rtol=0)
            # each row continues a row of its own sentence, as in beam search
            rows = (torch.arange(3)[:, None] * K + torch.randint(0, K, (3, K), generator=g)).view(-1)
            ys = torch.cat([ys[rows], torch.randint(4, 20, (3 * K, 1), generator=g)], 1)
            cached.reorder(rows)                  # the plain decoder recomputes every row's prefix


def test_beam_search_with_the_cache_equals_without_in_float64():
    torch.manual_seed(7)
    model = Transformer(TransformerConfig(src_vocab=12, tgt_vocab=12, d_model=32, d_ff=64, h=4, n_layers=2,
                                          dropout=0.0, max_len=64)).double().eval()
    src = torch.randint(4, 12, (5, 8))
    src[0, 3:], src[4, 6:] = PAD, PAD
    for K, alpha, extra in [(1, 0.6, 6), (3, 0.0, 5), (4, 0.6, 10)]:
        assert (beam_search(model, src, K, alpha, extra)
                == beam_search(model, src, K, alpha, extra, cache=False)), (K, alpha, extra)


def test_the_cached_step_goes_through_cached_attention_with_a_cache(monkeypatch):
    "Every cached step calls cached_attention (chapter 4's module over a KVCache) with one new query and a cache."
    import transformer.engine.fast as decoding
    calls = []
    original = decoding.cached_attention

    def spy(attn, query, kv, cache, *args, **kwargs):
        calls.append((query.size(1), cache.fixed))
        return original(attn, query, kv, cache, *args, **kwargs)

    monkeypatch.setattr(decoding, "cached_attention", spy)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=20, tgt_vocab=20, d_model=32, d_ff=64, h=4, n_layers=2,
                                          dropout=0.0, max_len=64)).eval()
    src = torch.randint(4, 20, (2, 5))
    from transformer.engine.fast import CachedDecoder
    from transformer.masking import padding_mask
    with torch.no_grad():
        memory = model.encode(src)
        calls.clear()
        state = CachedDecoder(model, memory, padding_mask(src), capacity=3)
        ys = torch.full((2, 1), BOS)
        for _ in range(3):
            state.next_logits(ys)
            ys = torch.cat([ys, torch.randint(4, 20, (2, 1))], 1)
    # per step and layer: self-attention (growing cache), cross-attention (fixed cache)
    assert calls == [(1, False), (1, True)] * 2 * 3
    for self_cache, cross_cache in state.caches:
        assert self_cache.length == 3 and cross_cache.length == 5 and cross_cache.k.size(2) == 5


def test_cross_attention_keys_and_values_are_computed_once(monkeypatch):
    "The memory's projections run at the first step only; later steps read the fixed cache."
    from transformer.engine.fast import CachedDecoder
    from transformer.masking import padding_mask
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=20, tgt_vocab=20, d_model=32, d_ff=64, h=4, n_layers=2,
                                          dropout=0.0, max_len=64)).eval()
    src = torch.randint(4, 20, (2, 5))
    seen = []
    for layer in model.decoder.layers:
        layer.cross_attn.w_k.register_forward_hook(lambda m, i, o: seen.append(i[0].size(1)))
    with torch.no_grad():
        state = CachedDecoder(model, model.encode(src), padding_mask(src), capacity=4)
        ys = torch.full((2, 1), BOS)
        for _ in range(4):
            state.next_logits(ys)
            ys = torch.cat([ys, torch.randint(4, 20, (2, 1))], 1)
    assert seen == [5, 5]                                             # once per layer, over the memory


# --- beam search on the device = the host-side beam search it replaced --------------------------

import math  # noqa: E402

from transformer.decoding import output_limits as _output_limits  # noqa: E402
from transformer.decoding import until_eos as _until_eos  # noqa: E402
from transformer.engine.fast import _start  # noqa: E402
from transformer.tokens import BOS as _BOS  # noqa: E402


@torch.no_grad()
def _host_beam_search(model: Transformer, src: torch.Tensor, beam_size: int = 4,
                alpha: float = 0.6, extra_len: int = 50,
                cache: bool = True) -> list[list[int]]:
    ("Batched beam search with GNMT's length penalty: source ids (B, S) -> "
     "B lists of output ids.")
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size={beam_size!r} must be an int >= 1")
    if not alpha >= 0:
        raise ValueError(f"alpha={alpha!r} must be >= 0")
    limits = _output_limits(model, src, extra_len)
    K, B, device, pad = beam_size, src.size(0), src.device, model.config.pad_id
    # encoder once, K rows per sentence
    state = _start(model, src, K, cache, max(limits))
    ys = torch.full((B * K, 1), _BOS, dtype=torch.long, device=device)    # (B*K, 1)
    # (B, K) log P of each hypothesis
    scores = torch.full((B, K), -math.inf, device=device)
    scores[:, 0] = 0.0  # one live hypothesis at the start
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    for t in range(max(limits)):
        logp = state.next_logits(ys).float().log_softmax(-1)             # (B*K, V)
        V = logp.size(-1)
        cand = (scores[:, :, None] + logp.view(B, K, V)).view(B, K * V)  # (B, K*V)
        top, flat = cand.topk(min(2 * K, K * V), dim=-1)  # (B, 2K) best extensions
        top, beam, token = top.tolist(), (flat // V).tolist(), (flat % V).tolist()
        lp = length_penalty(t + 1, alpha)
        rows, tokens, new_scores = [], [], []
        for b in range(B):
            keep = []
            if not done[b]:
                for j, (s, k, w) in enumerate(zip(top[b], beam[b], token[b])):
                    if s == -math.inf:
                        break
                    if w == EOS:
                        if j < K:                  # EOS among the top K: finished
                            finished[b].append((s / lp, ys[b * K + k, 1:].tolist()))
                    elif len(keep) < K:
                        keep.append((k, w, s))
                if t + 1 >= limits[b]:            # out of room: the beam ends here
                    finished[b] += [(s / lp, ys[b * K + k, 1:].tolist() + [w])
                                    for k, w, s in keep]
                    keep = []
                done[b] = len(finished[b]) >= K or not keep
            # idle rows of finished sentences
            keep += [(0, pad, -math.inf)] * (K - len(keep))
            rows += [b * K + k for k, _, _ in keep]
            tokens += [w for _, w, _ in keep]
            new_scores += [s for _, _, s in keep]
        if all(done):
            break
        ys = torch.cat([ys[rows], torch.tensor(tokens, device=device)[:, None]],
                       dim=1)                                            # (B*K, t+2)
        state.reorder(rows)
        scores = torch.tensor(new_scores, device=device).view(B, K)
    return [_until_eos(max(f, key=lambda x: x[0])[1]) if f else [] for f in finished]


@pytest.mark.parametrize("seed", range(6))
def test_beam_search_on_the_device_equals_the_host_version_it_replaced(seed):
    "Same outputs as the per-sentence Python loop it replaced: EOS in the top K, the length limit, ties."
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    vocab = [6, 12, 40][seed % 3]                    # a small vocabulary makes EOS frequent
    model = Transformer(TransformerConfig(src_vocab=vocab, tgt_vocab=vocab, d_model=32, d_ff=64, h=4,
                                          n_layers=2, dropout=0.0, max_len=64,
                                          norm_first=bool(seed % 2))).eval()
    src = torch.randint(4, vocab, (7, 9), generator=g)
    src[1, 4:], src[5, 2:] = PAD, PAD
    for K, alpha, extra in [(1, 0.6, 5), (3, 0.0, 4), (4, 0.6, 8), (5, 1.5, 0)]:
        assert beam_search(model, src, K, alpha, extra) == _host_beam_search(model, src, K, alpha, extra), \
            (K, alpha, extra)


def test_beam_search_on_the_device_equals_the_host_version_on_the_trained_copier(copier):
    src, _ = pad_batch([s for s, _ in copy_examples(40, seed=11)])
    for K in (2, 4):
        assert beam_search(copier, src, K) == _host_beam_search(copier, src, K)


def test_one_beam_default_everywhere():
    """One name and one default for the search everywhere a user translates: `beam_size=4` (the paper's; 1 is
    greedy) in every function, `--beam 4` in every command that decodes (`train`'s final scoring included)."""
    import inspect

    from transformer.cli.commands import build_parser
    from transformer.engine import fast, trained
    from transformer.figures import plots
    for fn in (fast.translate, fast.evaluate, fast.beam_search, fast.bleu_callback, plots.attention_weights,
               trained.translate_chunks, trained.TrainedModel.translate):
        assert inspect.signature(fn).parameters["beam_size"].default == 4, fn.__qualname__
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    decoding = {name: sub for name, sub in commands.items()
                if any(a.dest == "beam" for a in sub._actions)}
    assert {"train", "translate", "evaluate", "attend"} <= set(decoding)
    assert {name: sub.get_default("beam") for name, sub in decoding.items()} == dict.fromkeys(decoding, 4)
