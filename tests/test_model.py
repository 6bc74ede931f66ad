"The whole model: config and presets, weight tying, nn.Transformer equivalence, causality, padding, errors."
import pytest
import torch
from test_blocks import copy_layer, randomize_norms
from torch import nn

from transformer.masking import causal_mask
from transformer.model import PRESETS, Transformer, TransformerConfig
from transformer.tokens import BOS, PAD

V = 50


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(src_vocab=V, tgt_vocab=V, d_model=32, d_ff=64, h=4, n_layers=2, dropout=0.0, max_len=40)
    return Transformer(TransformerConfig(**{**cfg, **kw})).double().eval()


def batch(B=3, S=9, T=7, seed=1):
    "Random ids with ragged padding at the end of each row (at least one real token)."
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (B, S), generator=g)
    tgt = torch.randint(4, V, (B, T), generator=g)
    tgt[:, 0] = BOS
    for b, (ls, lt) in enumerate([(S, T), (S - 3, T - 2), (2, 3)][:B]):
        src[b, ls:] = PAD
        tgt[b, lt:] = PAD
    return src, tgt


def expected_count(c: TransformerConfig) -> int:
    "Closed form: what the paper's architecture has, with one shared embedding matrix when tied."
    d, f, n = c.d_model, c.d_ff, c.n_layers
    attn, ffn, ln = 4 * d * d + 4 * d, 2 * d * f + f + d, 2 * d
    enc, dec = n * (attn + ffn + 2 * ln), n * (2 * attn + ffn + 3 * ln)
    final_norms = 2 * ln if c.norm_first else 0
    emb = c.src_vocab * d + (0 if c.tie_embeddings and c.src_vocab == c.tgt_vocab else c.tgt_vocab * d)
    gen = c.tgt_vocab + (0 if c.tie_embeddings else c.tgt_vocab * d)
    return enc + dec + final_norms + emb + gen


# ---- config and presets -------------------------------------------------------------------------

def test_presets_match_the_paper_table_3():
    base = TransformerConfig.preset("base", src_vocab=V, tgt_vocab=V)
    big = TransformerConfig.preset("big", src_vocab=V, tgt_vocab=V)
    assert (base.n_layers, base.d_model, base.d_ff, base.h, base.dropout) == (6, 512, 2048, 8, 0.1)
    assert (big.n_layers, big.d_model, big.d_ff, big.h, big.dropout) == (6, 1024, 4096, 16, 0.3)
    t = TransformerConfig.preset("tiny", src_vocab=V, tgt_vocab=V)
    s = TransformerConfig.preset("small", src_vocab=V, tgt_vocab=V)
    assert (t.d_model, t.d_ff, t.h, t.n_layers) == (64, 256, 4, 2)
    assert (s.d_model, s.d_ff, s.h, s.n_layers, s.dropout) == (256, 1024, 4, 3, 0.3)   # tuned on val (ch 9)
    assert set(PRESETS) == {"tiny", "small", "base", "big"}
    assert TransformerConfig.preset("tiny", src_vocab=V, tgt_vocab=V, h=8).h == 8   # overrides win


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("overrides", [{}, dict(norm_first=True), dict(tie_embeddings=False),
                                       dict(tgt_vocab=70), dict(tgt_vocab=70, tie_embeddings=False)])
def test_parameter_count_closed_form(name, overrides):
    c = TransformerConfig.preset(name, **{"src_vocab": 60, "tgt_vocab": 60, **overrides})
    assert Transformer(c).num_parameters() == expected_count(c)


@pytest.mark.slow
def test_paper_scale_counts():
    "With the paper's shared ~37k vocabulary: base ≈ 63M (paper: 65M), big ≈ 214M (paper: 213M)."
    for name, paper in (("base", 65e6), ("big", 213e6)):
        c = TransformerConfig.preset(name, src_vocab=37000, tgt_vocab=37000)
        n = expected_count(c)
        assert abs(n - paper) / paper < 0.03
    with torch.device("meta"):
        assert Transformer(TransformerConfig.preset("base", src_vocab=37000, tgt_vocab=37000)).num_parameters() \
            == expected_count(TransformerConfig.preset("base", src_vocab=37000, tgt_vocab=37000))


def test_config_round_trip():
    c = TransformerConfig.preset("small", src_vocab=100, tgt_vocab=120, norm_first=True)
    d = c.to_dict()
    assert d["tgt_vocab"] == 120 and d["norm_first"] is True
    assert TransformerConfig.from_dict(d) == c


@pytest.mark.parametrize("call, exc, match", [
    (lambda: TransformerConfig.preset("huge", src_vocab=V, tgt_vocab=V), ValueError,
     r"unknown preset 'huge'; known presets: tiny, small, base, big"),
    (lambda: TransformerConfig.preset("tiny"), TypeError, r"needs src_vocab= and tgt_vocab="),
    (lambda: TransformerConfig.preset("tiny", src_vocab=V, tgt_vocab=V, h=5), ValueError,
     r"d_model=64 is not divisible by h=5"),
    (lambda: TransformerConfig(src_vocab=0, tgt_vocab=V), ValueError, r"src_vocab=0 must be a positive int"),
    (lambda: TransformerConfig(src_vocab=V, tgt_vocab=V, dropout=1.0), ValueError, r"dropout=1.0"),
    (lambda: TransformerConfig(src_vocab=V, tgt_vocab=V, d_model=33, h=3), ValueError, r"d_model=33 must be even"),
    (lambda: TransformerConfig(src_vocab=V, tgt_vocab=V, pad_id=V), ValueError, r"pad_id=50"),
    (lambda: TransformerConfig.from_dict({"src_vocab": V, "tgt_vocab": V, "layers": 3}), ValueError,
     r"unknown TransformerConfig fields \['layers'\]"),
])
def test_bad_configs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ---- weights --------------------------------------------------------------------------------------

def test_weight_tying():
    m = tiny()
    w = m.generator.weight
    assert m.src_embed.embedding.weight is w and m.tgt_embed.embedding.weight is w
    m = tiny(tgt_vocab=V + 10)   # separate vocabularies: target embedding and generator still share
    assert m.tgt_embed.embedding.weight is m.generator.weight
    assert m.src_embed.embedding.weight is not m.generator.weight
    m = tiny(tie_embeddings=False)
    assert len({id(m.src_embed.embedding.weight), id(m.tgt_embed.embedding.weight), id(m.generator.weight)}) == 3


def test_tied_model_survives_state_dict_round_trip():
    a, b = tiny(), tiny()
    with torch.no_grad():
        b.generator.weight.add_(1.0)
    b.load_state_dict(a.state_dict())
    assert b.src_embed.embedding.weight is b.generator.weight
    src, tgt = batch()
    assert torch.equal(a(src, tgt), b(src, tgt))
    assert not any("pe" == k.split(".")[-1] for k in a.state_dict())   # the sinusoid table is rebuilt, not saved


def test_initialization():
    torch.manual_seed(0)
    m = Transformer(TransformerConfig.preset("small", src_vocab=4000, tgt_vocab=4000))
    w = m.src_embed.embedding.weight
    assert torch.equal(w[PAD], torch.zeros_like(w[PAD]))
    assert w[1:].std().item() == pytest.approx(256 ** -0.5, rel=0.02)    # N(0, 1/d_model) ...
    x = m.src_embed(torch.arange(1, 4000)[None])
    assert x.std().item() == pytest.approx(1.0, rel=0.02)                # ... so embeddings × √d_model ≈ unit scale
    assert torch.equal(m.generator.bias, torch.zeros_like(m.generator.bias))
    for name, module in [*m.encoder.named_modules(), *m.decoder.named_modules()]:
        if isinstance(module, nn.Linear):                                 # Xavier-uniform weights, zero biases
            fan_out, fan_in = module.weight.shape
            assert module.weight.abs().max() <= (6 / (fan_in + fan_out)) ** 0.5, name
            assert module.weight.std().item() == pytest.approx((2 / (fan_in + fan_out)) ** 0.5, rel=0.1), name
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
    untied = Transformer(TransformerConfig.preset("small", src_vocab=4000, tgt_vocab=4000, tie_embeddings=False))
    assert untied.generator.weight.std().item() == pytest.approx(256 ** -0.5, rel=0.02)


# ---- equivalence with torch.nn.Transformer ---------------------------------------------------------

@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer(norm_first):
    m = tiny(norm_first=norm_first)
    with torch.no_grad():                      # biases start at zero: make them count
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    randomize_norms(m)
    c = m.config
    ref = nn.Transformer(c.d_model, c.h, c.n_layers, c.n_layers, c.d_ff, dropout=0.0, batch_first=True,
                         norm_first=norm_first, dtype=torch.float64).eval()
    for a, b in zip(m.encoder.layers, ref.encoder.layers, strict=True):
        copy_layer(a, b)
    for a, b in zip(m.decoder.layers, ref.decoder.layers, strict=True):
        copy_layer(a, b)
    if norm_first:
        ref.encoder.norm.load_state_dict(m.encoder.norm.state_dict())
        ref.decoder.norm.load_state_dict(m.decoder.norm.state_dict())
    else:   # the paper's post-LN stack has no final norm; nn.Transformer always adds one
        ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    src, tgt = batch()
    T = tgt.size(1)
    hidden = ref(m.pos(m.src_embed(src)), m.pos(m.tgt_embed(tgt)), tgt_mask=~causal_mask(T)[0, 0],
                 src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt == PAD,
                 memory_key_padding_mask=src == PAD)
    want = m.generator(hidden)
    got = m(src, tgt)
    real = tgt != PAD      # padded target positions are unspecified (the causal flag in training, chapter 7)
    assert (got - want)[real].abs().max().item() < 1e-10
    with torch.no_grad():                      # negative control: one changed weight is noticed
        ref.decoder.layers[-1].linear2.weight[0, 0] += 1e-3
    hidden = ref(m.pos(m.src_embed(src)), m.pos(m.tgt_embed(tgt)), tgt_mask=~causal_mask(T)[0, 0],
                 src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt == PAD,
                 memory_key_padding_mask=src == PAD)
    assert (got - m.generator(hidden))[real].abs().max().item() > 1e-6


def test_encode_always_uses_the_padding_mask():
    "encode(src) = encode(src, padding_mask(src)), with or without padding in the batch; pad rows stay finite."
    from transformer.masking import padding_mask
    m = tiny()
    src, _ = batch()
    full = src.clone(); full[full == PAD] = 5
    for s in (src, full):
        assert torch.equal(m.encode(s), m.encode(s, padding_mask(s)))
    unmasked = m.encode(src, torch.ones(1, 1, 1, src.size(1), dtype=torch.bool))
    real = src != PAD
    assert not torch.allclose(m.encode(src)[real], unmasked[real], atol=1e-6)   # the padding mask is applied


def test_forward_is_encode_then_decode():
    m = tiny()
    src, tgt = batch()
    from transformer.masking import padding_mask
    memory = m.encode(src)
    logits = m.generator(m.decode(tgt, memory, padding_mask(src)))
    real = tgt != PAD      # forward uses the causal flag: the same at every real target position
    assert torch.allclose(logits[real], m(src, tgt)[real], atol=1e-5)
    assert not torch.allclose(logits, m(src, tgt), atol=1e-5)   # padded positions may differ, and here do


# ---- invariances -----------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
def test_causality(norm_first):
    "Changing target tokens after position t leaves the logits at positions <= t unchanged."
    m = tiny(norm_first=norm_first)
    src, tgt = batch(B=2)
    tgt = tgt.clone(); tgt[tgt == PAD] = 7
    base = m(src, tgt)
    for t in range(tgt.size(1) - 1):
        changed = tgt.clone()
        changed[:, t + 1:] = torch.randint(4, V, changed[:, t + 1:].shape, generator=torch.Generator().manual_seed(t))
        out = m(src, changed)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-12)
        assert not torch.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-6)


def test_padding_invariance():
    "More padding on either side leaves the logits at real target positions unchanged."
    m = tiny()
    src, tgt = batch()
    base = m(src, tgt)
    more_src = torch.cat([src, torch.full((3, 6), PAD)], dim=1)
    more_tgt = torch.cat([tgt, torch.full((3, 4), PAD)], dim=1)
    out = m(more_src, more_tgt)[:, : tgt.size(1)]
    real = tgt != PAD
    assert torch.allclose(out[real], base[real], atol=1e-12)


def test_batch_order_independence():
    m = tiny()
    src, tgt = batch()
    perm = torch.tensor([2, 0, 1])
    assert torch.allclose(m(src[perm], tgt[perm]), m(src, tgt)[perm], atol=1e-12)


def test_no_nan_with_fully_padded_rows():
    m = tiny()
    src, tgt = batch()
    src[1] = PAD                 # an all-padding source sentence
    tgt[2] = PAD                 # an all-padding target row, BOS included
    logits = m(src, tgt)
    assert torch.isfinite(logits).all()


def test_dropout_in_training_only():
    m = tiny(dropout=0.3)
    src, tgt = batch()
    m.train()
    assert not torch.allclose(m(src, tgt), m(src, tgt))
    m.eval()
    assert torch.equal(m(src, tgt), m(src, tgt))


def test_gradients_reach_every_parameter():
    m = tiny().train()
    src, tgt = batch()
    m(src, tgt).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


# ---- bad inputs ------------------------------------------------------------------------------------

def _bad_cases():
    src, tgt = batch()
    return [
        ("src id >= vocab", lambda m: m(src.masked_fill(src == src[0, 0], V), tgt), ValueError,
         r"src holds token id 50 outside the vocabulary \[0, 50\)"),
        ("negative tgt id", lambda m: m(src, tgt.masked_fill(tgt == BOS, -1)), ValueError,
         r"tgt_in holds token id -1 outside the vocabulary"),
        ("too long", lambda m: m(torch.full((1, 41), 5), tgt[:1]), ValueError,
         r"src has length T=41 > max_len=40"),
        ("batch mismatch", lambda m: m(src, tgt[:2]), ValueError, r"different batch sizes: 3 != 2"),
        ("float ids", lambda m: m(src.double(), tgt), TypeError, r"integer token ids, got dtype torch.float64"),
        ("1-D ids", lambda m: m.encode(src[0]), ValueError, r"shape \(B, T\), got \(9,\)"),
        ("empty", lambda m: m(src[:, :0], tgt), ValueError, r"src is empty"),
        ("memory mismatch", lambda m: m.decode(tgt, m.encode(src)[:2]), ValueError,
         r"memory of shape \(2, 9, 32\) does not fit tgt_in"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
    _, call, exc, match = case
    with pytest.raises(exc, match=match):
        call(tiny())


# ---- forward's fast path: the causal flag instead of the decoder's mask -------------------------------

@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_equals_the_explicit_masks(norm_first):
    "forward (padding mask on the source, the causal flag on the target) = encode/decode with every mask written out."
    from transformer.masking import decoder_mask, padding_mask
    m = tiny(norm_first=norm_first)
    src, tgt = batch()
    full = src.clone(); full[full == PAD] = 5                      # the same batch without source padding
    for s in (src, full):
        explicit = m.generator(m.decode(tgt, m.encode(s, padding_mask(s)), padding_mask(s), decoder_mask(tgt)))
        real = tgt != PAD
        assert (m(s, tgt) - explicit)[real].abs().max() < 1e-10


def test_forward_calls_the_decoder_with_the_causal_flag(monkeypatch):
    m = tiny()
    seen = []
    original = m.decoder.layers[0].self_attn.forward
    def spy(*args, **kwargs):
        seen.append((args[3] if len(args) > 3 else kwargs.get("mask"), kwargs.get("is_causal")))
        return original(*args, **kwargs)
    monkeypatch.setattr(m.decoder.layers[0].self_attn, "forward", spy)
    src, tgt = batch()
    m(src, tgt)
    assert seen == [(None, True)]            # no mask built: the kernel's causal path


def test_features_is_forward_without_the_generator():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=20, tgt_vocab=20, d_model=16, d_ff=32, h=2, n_layers=1,
                                          dropout=0.0)).double().eval()
    src, tgt_in = torch.randint(4, 20, (3, 6)), torch.randint(4, 20, (3, 5))
    src[1, 4:] = 0
    assert torch.equal(model(src, tgt_in), model.generator(model.features(src, tgt_in)))
    with pytest.raises(ValueError, match="different batch sizes"):   # forward checks; features, the loss's, does not
        model(src, tgt_in[:2])


# ---- model variants: positions (Table 3, row E) and d_k (row B) as config fields --------------------

POSITION_KINDS = ["sinusoidal", "learned", "none"]
VARIANTS = [(p, d_k, nf) for p in POSITION_KINDS for d_k in (None, 3, 16) for nf in (False, True)]
VARIANT_IDS = [f"{p}-dk{d_k}-{'pre' if nf else 'post'}" for p, d_k, nf in VARIANTS]


def variant(positions="sinusoidal", d_k=None, norm_first=False, seed=0, **kw) -> Transformer:
    "A small model of one variant, its weights random (learned positions too)."
    torch.manual_seed(seed)
    cfg = dict(src_vocab=V, tgt_vocab=V, d_model=32, d_ff=64, h=4, n_layers=2, dropout=0.0, max_len=40,
               positions=positions, d_k=d_k, norm_first=norm_first)
    return Transformer(TransformerConfig(**{**cfg, **kw})).eval()


def test_positions_and_d_k_build_the_named_modules():
    from transformer.model import POSITIONS
    from transformer.positions import LearnedPositionalEmbedding, NoPositions, PositionalEncoding
    assert POSITIONS == {"sinusoidal": PositionalEncoding, "learned": LearnedPositionalEmbedding,
                         "none": NoPositions}
    for positions, cls in POSITIONS.items():
        m = variant(positions, d_k=6)
        assert type(m.pos) is cls and m.pos.pe.shape == (40, 32)
        attns = [m.encoder.layers[0].self_attn, m.decoder.layers[1].self_attn, m.decoder.layers[1].cross_attn]
        assert all((a.d_k, a.w_v.out_features // a.h) == (6, 8) for a in attns)        # d_v = d_model / h
    c = TransformerConfig(src_vocab=V, tgt_vocab=V)
    assert (c.positions, c.d_k) == ("sinusoidal", None)       # the paper's model by default


@pytest.mark.parametrize("positions", POSITION_KINDS)
@pytest.mark.parametrize("d_k", [None, 2, 8, 24])
@pytest.mark.parametrize("norm_first", [False, True])
def test_parameter_count_closed_form_with_d_k_and_positions(positions, d_k, norm_first):
    c = variant(positions, d_k, norm_first).config
    d, h, k = c.d_model, c.h, d_k or c.d_model // c.h
    # the paper's count, with W^Q and W^K of h * d_k columns instead of d_model, plus a learned table
    narrower = 2 * (d * h * k + h * k) - 2 * (d * d + d)
    attentions = 3 * c.n_layers                                      # encoder self; decoder self and cross
    table = c.max_len * d if positions == "learned" else 0
    assert Transformer(c).num_parameters() == expected_count(c) + attentions * narrower + table


@pytest.mark.parametrize("field, value, match", [
    ("positions", "rope", r"positions='rope' is not one of 'sinusoidal', 'learned', 'none'"),
    ("positions", "Sinusoidal", r"positions='Sinusoidal' is not one of"),
    ("positions", None, r"positions=None is not one of"),
    ("positions", ["learned"], r"positions=\['learned'\] is not one of"),
    ("d_k", 0, r"d_k=0 must be a positive int, or None for d_model / h"),
    ("d_k", -1, r"d_k=-1 must be a positive int"),
    ("d_k", 2.5, r"d_k=2.5 must be a positive int"),
    ("d_k", 8.0, r"d_k=8.0 must be a positive int"),
    ("d_k", True, r"d_k=True must be a positive int"),
    ("d_k", "8", r"d_k='8' must be a positive int"),
])
def test_bad_positions_and_d_k(field, value, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(src_vocab=V, tgt_vocab=V, **{field: value})
    with pytest.raises(ValueError, match=match):
        TransformerConfig.preset("tiny", src_vocab=V, tgt_vocab=V, **{field: value})


def test_config_without_the_new_fields_loads_with_defaults():
    "A config dict written before `positions` and `d_k` existed (an old checkpoint or config.json)."
    new = TransformerConfig.preset("small", src_vocab=100, tgt_vocab=100, norm_first=True)
    old = {k: v for k, v in new.to_dict().items() if k not in ("positions", "d_k")}
    assert TransformerConfig.from_dict(old) == new
    assert TransformerConfig.from_dict(old).to_dict() == {**old, "positions": "sinusoidal", "d_k": None}
    c = TransformerConfig.preset("tiny", src_vocab=100, tgt_vocab=100, positions="none", d_k=4)
    assert TransformerConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("positions, d_k, norm_first", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.slow
def test_variant_cached_decoding_equals_uncached(positions, d_k, norm_first):
    "The KV cache (values of width d_v, keys of width d_k, the position read from pe[t]) gives the full prefix's logits."
    from transformer.decoding import PrefixDecoder
    from transformer.engine.fast import CachedDecoder, beam_search, greedy_search
    from transformer.masking import padding_mask
    m = variant(positions, d_k, norm_first, seed=5)
    g = torch.Generator().manual_seed(6)
    src = torch.randint(4, V, (5, 7), generator=g)
    src[2, 3:] = PAD
    assert greedy_search(m, src, 10) == greedy_search(m, src, 10, cache=False)
    assert beam_search(m, src, 3, extra_len=10) == beam_search(m, src, 3, extra_len=10, cache=False)
    mask = padding_mask(src)
    memory = m.encode(src, mask)
    cached, plain = CachedDecoder(m, memory, mask), PrefixDecoder(m, memory, mask)
    ys = torch.full((5, 1), BOS)
    with torch.no_grad():
        for _ in range(8):
            torch.testing.assert_close(cached.next_logits(ys), plain.next_logits(ys), rtol=0, atol=1e-5)
            ys = torch.cat([ys, torch.randint(4, V, (5, 1), generator=g)], 1)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_cached_decoding_reads_the_position_table(positions, monkeypatch):
    "Zeroing the table the cached decoder reads breaks the equality: that test checks positions, not only shapes."
    from transformer.decoding import PrefixDecoder
    from transformer.engine.fast import CachedDecoder
    from transformer.masking import padding_mask
    m = variant(positions, seed=5)
    src = torch.randint(4, V, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = padding_mask(src)
    memory = m.encode(src, mask)
    ys = torch.tensor([[BOS, 7, 9], [BOS, 8, 4]])
    cached = CachedDecoder(m, memory, mask)
    with torch.no_grad():
        want = PrefixDecoder(m, memory, mask).next_logits(ys)
        for t in range(1, 4):
            got = cached.next_logits(ys[:, :t])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # the class attribute wins over the module's buffer or parameter
        monkeypatch.setattr(type(m.pos), "pe", property(lambda self: torch.zeros(40, 32)), raising=False)
        assert not m.pos.pe.any()
        wrong = CachedDecoder(m, memory, mask)
        for t in range(1, 4):
            got = wrong.next_logits(ys[:, :t])
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.parametrize("positions, d_k, norm_first", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.slow
def test_variant_checkpoint_round_trip(positions, d_k, norm_first, tmp_path):
    "save_checkpoint then model_from_checkpoint: the same config and bit-identical outputs (learned positions saved)."
    from transformer.engine.checkpoints import (
        load_checkpoint,
        model_from_checkpoint,
        save_checkpoint,
    )
    m = variant(positions, d_k, norm_first, seed=7)
    save_checkpoint(tmp_path / "m.pt", m)
    state = load_checkpoint(tmp_path / "m.pt")
    assert state["model_config"]["positions"] == positions and state["model_config"]["d_k"] == d_k
    assert ("pos.embedding.weight" in state["model"]) == (positions == "learned")
    assert not any(k.endswith(".pe") or k == "pos.pe" for k in state["model"])
    back = model_from_checkpoint(tmp_path / "m.pt")
    assert back.config == m.config and type(back.pos) is type(m.pos)
    src, tgt = batch()
    assert torch.equal(back(src, tgt), m(src, tgt))
    assert torch.equal(back.encode(src), m.encode(src))
    other = variant(positions, d_k, norm_first, seed=8)        # another init: the equality above is not vacuous
    assert not torch.allclose(other(src, tgt), m(src, tgt), atol=1e-3)
    if positions == "learned":                                 # the table alone: reloaded, not re-drawn
        other.load_state_dict({k: v for k, v in m.state_dict().items() if k != "pos.embedding.weight"},
                              strict=False)
        assert not torch.allclose(other(src, tgt), m(src, tgt), atol=1e-3)


def test_checkpoint_from_before_the_new_fields_loads(tmp_path):
    "An old checkpoint's model_config has no positions/d_k: it loads as the paper's model (sinusoids, d_model/h)."
    from transformer.engine.checkpoints import (
        load_checkpoint,
        model_from_checkpoint,
        save_checkpoint,
    )
    m = variant(seed=9)
    save_checkpoint(tmp_path / "m.pt", m)
    state = load_checkpoint(tmp_path / "m.pt")
    for key in ("positions", "d_k"):
        del state["model_config"][key]
    torch.save(state, tmp_path / "old.pt")
    back = model_from_checkpoint(tmp_path / "old.pt")
    src, tgt = batch()
    assert back.config == m.config and torch.equal(back(src, tgt), m(src, tgt))


@pytest.mark.parametrize("positions, equivariant", [("none", True), ("sinusoidal", False), ("learned", False)])
@pytest.mark.parametrize("d_k", [None, 3])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_is_permutation_equivariant_without_positions(positions, equivariant, d_k, norm_first):
    "With no position information the encoder cannot tell the order: permuting the source permutes the memory."
    m = variant(positions, d_k, norm_first, seed=3).double()
    g = torch.Generator().manual_seed(4)
    src = torch.randint(4, V, (3, 9), generator=g)                   # no padding
    perm = torch.randperm(9, generator=g)
    memory, permuted = m.encode(src), m.encode(src[:, perm])
    assert torch.allclose(permuted, memory[:, perm], atol=1e-10) is equivariant
    # and the decoder, which sees the source through cross-attention alone, gets the same logits
    tgt = torch.randint(4, V, (3, 5), generator=g)
    tgt[:, 0] = BOS
    assert torch.allclose(m(src[:, perm], tgt), m(src, tgt), atol=1e-10) is equivariant
