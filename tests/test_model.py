"The whole model: config and presets, weight tying, nn.Transformer equivalence, causality, padding, errors."
import pytest
import torch
from torch import nn

from test_blocks import copy_layer, randomize_norms
from transformer.masking import causal_mask
from transformer.model import PRESETS, Transformer, TransformerConfig
from transformer.tokens import BOS, PAD

V = 50


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
    for a, b in zip(m.encoder.layers, ref.encoder.layers):
        copy_layer(a, b)
    for a, b in zip(m.decoder.layers, ref.decoder.layers):
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


# ---- the fast paths of forward: no source mask without padding, the causal flag ---------------------

@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_fast_paths_equal_the_explicit_masks(norm_first):
    from transformer.masking import decoder_mask, padding_mask
    m = tiny(norm_first=norm_first)
    src, tgt = batch()
    full = src.clone(); full[full == PAD] = 5                      # the same batch without source padding
    assert m._source_mask(full) is None and m._source_mask(src) is not None
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
    with pytest.raises(ValueError, match="different batch sizes"):
        model.features(src, tgt_in[:2])
