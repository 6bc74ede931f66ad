"""transformer.tokens: the tokenizer, the scaled embedding, token-budget batches and padding."""
import math
import os
import pickle
import random
from itertools import pairwise

import pytest
import sentencepiece as spm
import torch

from transformer.data import load_multi30k
from transformer.tokens import BOS, EOS, PAD, UNK, Embeddings, Tokenizer, pad_batch, token_batches


def multi30k(split: str):
    root = os.environ.get("TRANSFORMER_DATA")
    if not root:
        pytest.fail("set TRANSFORMER_DATA to the directory that holds multi30k/ (CI does)")
    return load_multi30k("de", "en", split, data_dir=root, download=False)


@pytest.fixture(scope="module")
def train_texts():
    return [s for pair in multi30k("train") for s in pair]


@pytest.fixture(scope="module")
def tok(train_texts):
    return Tokenizer.train(train_texts, vocab_size=2000)


@pytest.fixture(scope="module")
def val_texts():
    return [s for pair in multi30k("val") for s in pair]


# --- the tokenizer --------------------------------------------------------------------------

def test_special_ids(tok):
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == len(tok) == 2000
    ids = tok.encode("A dog runs.")
    assert min(ids) > EOS  # plain encoding holds no special ids
    assert tok.encode("A dog runs.", bos=True, eos=True) == [BOS] + ids + [EOS]
    assert tok.encode("A dog runs.", eos=True) == ids + [EOS]
    assert tok.encode("A dog runs.", bos=True) == [BOS] + ids


def test_unknown_character_is_unk(tok):
    ids = tok.encode("A dog \u2603 runs.")  # a snowman never occurs in Multi30k
    assert UNK in ids
    assert tok.decode(ids) == "A dog  \u2047  runs."
    assert tok.piece_to_id("no-such-piece") == UNK


def test_round_trip_on_validation_text(tok, val_texts):
    "decode(encode(s)) == s for normal text; the one exception is a no-break space (NFKC)."
    changed = [s for s in val_texts if tok.decode(tok.encode(s)) != s]
    assert len(changed) == 1 and "\xa0" in changed[0]
    assert tok.decode(tok.encode(changed[0])) == changed[0].replace("\xa0", " ")


def test_decode_drops_pad_bos_eos(tok):
    ids = tok.encode("Zwei Kinder spielen.")
    assert tok.decode([BOS] + ids + [EOS, PAD, PAD]) == "Zwei Kinder spielen."
    assert tok.decode(torch.tensor([BOS] + ids + [EOS])) == "Zwei Kinder spielen."
    assert tok.decode([]) == ""


def test_batch_encode_decode_match_single(tok, val_texts):
    texts = val_texts[:50]
    batch = tok.encode_batch(texts, bos=True, eos=True)
    assert batch == [tok.encode(t, bos=True, eos=True) for t in texts]
    ids, _ = pad_batch(batch)
    assert tok.decode_batch(ids) == tok.decode_batch(batch) == [tok.decode(b) for b in batch]


def test_save_load(tok, tmp_path):
    path = tok.save(tmp_path / "sub" / "tok.model")
    loaded = Tokenizer.load(path)
    assert loaded == tok and loaded.vocab_size == tok.vocab_size
    assert loaded.encode("Ein Mann fährt Fahrrad.") == tok.encode("Ein Mann fährt Fahrrad.")
    # the file is a plain sentencepiece model
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.encode("Ein Mann fährt Fahrrad.") == tok.encode("Ein Mann fährt Fahrrad.")
    assert Tokenizer.from_bytes(tok.to_bytes()) == tok
    assert pickle.loads(pickle.dumps(tok)) == tok


@pytest.mark.slow
def test_deterministic(train_texts, tok):
    "Same corpus and vocabulary size, same pieces: a tokenizer can be rebuilt, not just stored."
    again = Tokenizer.train(train_texts, vocab_size=2000)
    assert again.to_bytes() == tok.to_bytes()
    other = Tokenizer.train(train_texts, vocab_size=1000)
    assert other != tok


@pytest.mark.slow
def test_unigram_deterministic(train_texts):
    texts = train_texts[:4000]
    a = Tokenizer.train(texts, vocab_size=1000, model_type="unigram")
    b = Tokenizer.train(texts, vocab_size=1000, model_type="unigram")
    assert a == b and a.vocab_size == 1000
    assert a != Tokenizer.train(texts, vocab_size=1000, model_type="bpe")


def test_joint_vocabulary_covers_both_languages(tok):
    pieces = {tok.id_to_piece(i) for i in range(tok.vocab_size)}
    assert {"▁the", "▁der", "▁und", "▁and"} <= pieces


@pytest.mark.parametrize("texts, kwargs, error, match", [
    ("A sentence.", {}, TypeError, "not a single string"),
    (["ok", 3], {}, TypeError, r"texts\[1\] is a int"),
    ([], {}, ValueError, "no characters"),
    (["", "  "], {}, ValueError, "no characters"),
    (["a b c"], dict(model_type="wordpiece"), ValueError, r"model_type='wordpiece' is not one of"),
    (["a b c"], dict(vocab_size=4), ValueError, r"vocab_size=4 must be an int larger"),
    (["a b c"], dict(vocab_size=100.0), ValueError, r"vocab_size=100.0"),
    (["a b c"] * 10, dict(vocab_size=5000), ValueError, r"could not train a bpe model with vocab_size=5000"),
])
def test_train_bad_input(texts, kwargs, error, match):
    with pytest.raises(error, match=match):
        Tokenizer.train(texts, **kwargs)


def test_load_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer model at"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"junk\.model: not a sentencepiece model"):
        Tokenizer.load(tmp_path / "junk.model")
    # a sentencepiece model with sentencepiece's own special ids (unk=0, bos=1, eos=2, no pad)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["a b c d e f g"] * 20),
                                   model_prefix=str(tmp_path / "foreign"), vocab_size=12,
                                   minloglevel=2)
    with pytest.raises(ValueError, match=r"special pieces \('<unk>', '<s>', '</s>'"):
        Tokenizer.load(tmp_path / "foreign.model")


@pytest.mark.parametrize("call, error, match", [
    (lambda t: t.encode(["a list"]), TypeError, "use encode_batch"),
    (lambda t: t.encode(None), TypeError, "encode expects a str"),
    (lambda t: t.encode_batch("one string"), TypeError, "use encode"),
    (lambda t: t.encode_batch(["ok", b"bytes"]), TypeError, r"texts\[1\] is a bytes"),
    (lambda t: t.decode([5, 2000]), ValueError, r"token id 2000 is out of range for vocab_size=2000"),
    (lambda t: t.decode([-1]), ValueError, r"token id -1 is out of range"),
    (lambda t: t.decode([5.0]), TypeError, r"token id 5.0 is not an integer"),
    (lambda t: t.decode(torch.ones(2, 3, dtype=torch.long)), ValueError, r"got shape \(2, 3\); use decode_batch"),
    (lambda t: t.decode_batch(torch.ones(3, dtype=torch.long)), ValueError, r"expects a \(B, T\) tensor"),
    (lambda t: t.id_to_piece(99999), ValueError, "out of range"),
])
def test_encode_decode_bad_input(tok, call, error, match):
    with pytest.raises(error, match=match):
        call(tok)


# --- the embedding --------------------------------------------------------------------------

def test_embeddings_is_a_scaled_lookup():
    torch.manual_seed(0)
    emb = Embeddings(100, 16)
    ids = torch.tensor([[5, 7, PAD], [9, 9, 1]])
    out = emb(ids)  # (B, T, d_model)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, emb.embedding.weight[ids] * 4.0)
    one_hot = torch.nn.functional.one_hot(ids, 100).float()  # a lookup is a one-hot matmul
    torch.testing.assert_close(out, one_hot @ emb.embedding.weight * math.sqrt(16))
    assert torch.equal(out[0, 2], torch.zeros(16))  # PAD is the zero vector


def test_embeddings_output_has_unit_scale():
    torch.manual_seed(0)
    for d_model in (64, 512):
        emb = Embeddings(8000, d_model)
        w = emb.embedding.weight[1:]
        assert abs(w.std().item() - d_model ** -0.5) < 0.05 * d_model ** -0.5
        out = emb(torch.arange(1, 8000))
        assert abs(out.pow(2).mean().sqrt().item() - 1.0) < 0.02  # RMS of entries ~ 1


def test_embeddings_pad_gets_no_gradient():
    emb = Embeddings(10, 4)
    emb(torch.tensor([[PAD, 3, 4]])).sum().backward()
    assert torch.equal(emb.embedding.weight.grad[PAD], torch.zeros(4))
    assert emb.embedding.weight.grad[3].abs().sum() > 0
    assert Embeddings(10, 4, padding_idx=None).embedding.padding_idx is None


@pytest.mark.parametrize("args, match", [
    ((0, 8), "vocab_size=0 must be a positive int"),
    ((10, 8.0), "d_model=8.0 must be a positive int"),
    ((10, 8, 10), r"padding_idx=10 is outside the vocabulary \[0, 10\)"),
])
def test_embeddings_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        Embeddings(*args)


def test_embeddings_rejects_float_ids():
    with pytest.raises(TypeError, match="expects integer token ids"):
        Embeddings(10, 4)(torch.tensor([[1.0, 2.0]]))


# --- token-budget batches -------------------------------------------------------------------

def random_pairs(n, seed, max_len=40):
    rng = random.Random(seed)
    src = [[5] * rng.randint(1, max_len) for _ in range(n)]
    tgt = [[6] * rng.randint(1, max_len) for _ in range(n)]
    return src, tgt


def cost(batch, src, tgt):
    return len(batch) * max(max(len(src[i]), len(tgt[i])) for i in batch)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_tokens", [40, 333, 2000])
def test_batches_respect_budget_and_cover_every_pair_once(seed, max_tokens):
    src, tgt = random_pairs(500, seed)
    batches = token_batches(src, tgt, max_tokens, seed=seed)
    assert all(cost(b, src, tgt) <= max_tokens for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(500))


def test_batches_are_nearly_full():
    "Greedy packing: adding the next pair of the sorted order would have broken the budget."
    src, tgt = random_pairs(2000, 0)
    batches = token_batches(src, tgt, 1000, shuffle=False)
    for b, nxt in pairwise(batches):
        assert cost(b + nxt[:1], src, tgt) > 1000


def test_batches_seeded_shuffle():
    src, tgt = random_pairs(300, 1)
    a = token_batches(src, tgt, 200, seed=3)
    assert a == token_batches(src, tgt, 200, seed=3)
    assert a != token_batches(src, tgt, 200, seed=4)
    ordered = token_batches(src, tgt, 200, shuffle=False)
    longest = [max(max(len(src[i]), len(tgt[i])) for i in b) for b in ordered]
    assert longest == sorted(longest)  # without shuffling: short batches first


def test_batches_source_only_and_max_sentences():
    src, _ = random_pairs(100, 2, max_len=3)
    batches = token_batches(src, max_tokens=1000, max_sentences=8)
    assert max(len(b) for b in batches) == 8
    assert sorted(i for b in batches for i in b) == list(range(100))


@pytest.mark.slow
def test_bucketing_pads_less_than_random_batches(tok):
    pairs = multi30k("train")[:4000]
    src = tok.encode_batch([s for s, _ in pairs], bos=True, eos=True)
    tgt = tok.encode_batch([t for _, t in pairs], bos=True, eos=True)

    def padding(batches):
        real = slots = 0
        for b in batches:
            for side in (src, tgt):
                _, mask = pad_batch([side[i] for i in b])
                real += mask.sum().item()
                slots += mask.numel()
        return 1 - real / slots

    bucketed = token_batches(src, tgt, 1500, seed=0)
    order = list(range(len(pairs)))
    random.Random(0).shuffle(order)
    fixed = [order[i:i + 64] for i in range(0, len(order), 64)]
    assert padding(bucketed) < 0.1 < 0.3 < padding(fixed)


@pytest.mark.parametrize("kwargs, match", [
    (dict(src=[[1] * 5], tgt=[[1] * 5, [1]]), "src has 1 sequences but tgt has 2"),
    (dict(src=[]), "got no sequences"),
    (dict(src=[[1] * 5, [1] * 50], max_tokens=40), r"pair 1 has 50 tokens, more than max_tokens=40"),
    (dict(src=[[1]], tgt=[[1] * 50], max_tokens=40), r"pair 0 has 50 tokens"),
    (dict(src=[[1]], max_tokens=0), r"max_tokens=0 must be an int >= 1"),
    (dict(src=[[1]], max_tokens=10.5), r"max_tokens=10.5"),
    (dict(src=[[1]], max_sentences=0), r"max_sentences=0"),
])
def test_batches_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_batches(**kwargs)


# --- padding --------------------------------------------------------------------------------

def test_pad_batch_ids_and_mask():
    seqs = [[5, 6, 7], [8], [9, 10]]
    ids, mask = pad_batch(seqs)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids.tolist() == [[5, 6, 7], [8, PAD, PAD], [9, 10, PAD]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]


@pytest.mark.parametrize("seed", range(3))
def test_pad_batch_invariants(seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, 100, (int(n),), generator=g) for n in torch.randint(0, 12, (16,), generator=g)]
    seqs[0] = torch.randint(4, 100, (12,), generator=g)
    ids, mask = pad_batch(seqs, pad_id=PAD)
    assert ids.shape == mask.shape == (16, 12)
    assert mask.sum(1).tolist() == [len(s) for s in seqs]
    assert torch.equal(ids[mask], torch.cat(seqs))  # real tokens, in order, nothing else
    assert (ids[~mask] == PAD).all()
    assert torch.equal(mask, ids != PAD)  # ids >= 4 here, so the mask is exactly "not PAD"


def test_pad_batch_custom_pad_and_empty_rows():
    ids, mask = pad_batch([[], [1, 2]], pad_id=-1)
    assert ids.tolist() == [[-1, -1], [1, 2]]
    assert mask.tolist() == [[False, False], [True, True]]
    ids, mask = pad_batch([[], []])
    assert ids.shape == (2, 0)


@pytest.mark.parametrize("seqs, error, match", [
    ([], ValueError, "non-empty list"),
    (torch.ones(2, 3, dtype=torch.long), ValueError, "non-empty list"),
    ([[1, 2], torch.ones(2, 2, dtype=torch.long)], ValueError, r"sequence 1 has shape \(2, 2\)"),
    ([[1.5, 2.0]], TypeError, r"sequence 0 has dtype torch.float32"),
    ([torch.tensor([True])], TypeError, r"dtype torch.bool"),
])
def test_pad_batch_bad_input(seqs, error, match):
    with pytest.raises(error, match=match):
        pad_batch(seqs)
