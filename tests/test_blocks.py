"""Blocks: FFN, `residual`, encoder/decoder layers and stacks against torch.nn in float64; the KV caches.
The blocks trust their callers (inputs are checked by `TransformerConfig` and `Transformer`);
appendix D's fast dropout is tested in test_fast.py."""
import pytest
import torch
from torch import nn

from transformer.blocks import Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward
from transformer.heads import MultiHeadAttention

D, H, D_FF = 32, 4, 64


def copy_mha(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
        ref.out_proj.weight.copy_(ours.w_o.weight)
        ref.out_proj.bias.copy_(ours.w_o.bias)


def copy_layer(ours, ref) -> None:
    "Copy one of our encoder/decoder layers into nn.TransformerEncoderLayer/DecoderLayer."
    copy_mha(ours.self_attn, ref.self_attn)
    if hasattr(ours, "cross_attn"):
        copy_mha(ours.cross_attn, ref.multihead_attn)
    with torch.no_grad():
        for a, b in ((ours.feed_forward.w_1, ref.linear1), (ours.feed_forward.w_2, ref.linear2)):
            b.weight.copy_(a.weight); b.bias.copy_(a.bias)
        for i in (1, 2, 3):
            if hasattr(ours, f"norm{i}"):
                getattr(ref, f"norm{i}").load_state_dict(getattr(ours, f"norm{i}").state_dict())


def randomize_norms(module: nn.Module) -> None:
    "LayerNorm starts as identity affine; give it random gains and biases so the copy is tested."
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5); m.bias.normal_(0, 0.1)


def inputs(B=3, T=7, S=5):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    y = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    lengths = torch.tensor([S, S - 2, 1])                          # a padded batch
    src_keep = torch.arange(S)[None] < lengths[:, None]            # (B, S) True = real
    return x, y, src_keep


def test_feed_forward_is_equation_2():
    torch.manual_seed(0)
    ffn = FeedForward(D, D_FF).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    expected = torch.clamp(x @ ffn.w_1.weight.T + ffn.w_1.bias, min=0) @ ffn.w_2.weight.T + ffn.w_2.bias
    assert torch.allclose(ffn(x), expected, atol=1e-12)
    # position-wise: each position alone gives the same answer
    assert torch.allclose(ffn(x[:, 3:4]), ffn(x)[:, 3:4], atol=1e-12)
    assert sum(p.numel() for p in ffn.parameters()) == 2 * D * D_FF + D_FF + D


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_matches_torch(norm_first):
    torch.manual_seed(0)
    ours = EncoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).double().eval()
    randomize_norms(ours)
    ref = nn.TransformerEncoderLayer(D, H, D_FF, dropout=0.0, batch_first=True,
                                     norm_first=norm_first, dtype=torch.float64).eval()
    copy_layer(ours, ref)
    x, _, keep = inputs()
    got = ours(x, keep[:, None, None, :])
    want = ref(x, src_key_padding_mask=~keep)
    assert (got - want).abs().max().item() < 1e-10


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    torch.manual_seed(0)
    ours = DecoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).double().eval()
    randomize_norms(ours)
    ref = nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.0, batch_first=True,
                                     norm_first=norm_first, dtype=torch.float64).eval()
    copy_layer(ours, ref)
    memory, y, keep = inputs()
    T = y.size(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    got = ours(y, memory, causal[None, None], keep[:, None, None, :])
    want = ref(y, memory, tgt_mask=~causal, memory_key_padding_mask=~keep)
    assert (got - want).abs().max().item() < 1e-10


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_torch(norm_first):
    torch.manual_seed(0)
    n = 3
    enc = Encoder(D, H, D_FF, n, dropout=0.0, norm_first=norm_first).double().eval()
    dec = Decoder(D, H, D_FF, n, dropout=0.0, norm_first=norm_first).double().eval()
    randomize_norms(enc); randomize_norms(dec)
    ref = nn.Transformer(D, H, n, n, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                         dtype=torch.float64).eval()
    for a, b in zip(enc.layers, ref.encoder.layers, strict=True):
        copy_layer(a, b)
    for a, b in zip(dec.layers, ref.decoder.layers, strict=True):
        copy_layer(a, b)
    if norm_first:   # pre-LN: both have a final norm
        ref.encoder.norm.load_state_dict(enc.norm.state_dict())
        ref.decoder.norm.load_state_dict(dec.norm.state_dict())
    else:            # post-LN: the paper (and we) have none; nn.Transformer always adds one
        assert isinstance(enc.norm, nn.Identity) and isinstance(dec.norm, nn.Identity)
        ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    x, y, keep = inputs()
    T = y.size(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    memory = enc(x, keep[:, None, None, :])
    got = dec(y, memory, causal[None, None], keep[:, None, None, :])
    want = ref(x, y, tgt_mask=~causal, src_key_padding_mask=~keep, memory_key_padding_mask=~keep)
    assert (got - want).abs().max().item() < 1e-10


def test_post_ln_output_is_normalized_pre_ln_is_not():
    torch.manual_seed(0)
    x = 5 * torch.randn(2, 6, D, dtype=torch.float64)
    post = EncoderLayer(D, H, D_FF, dropout=0.0, norm_first=False).double()(x)
    pre = EncoderLayer(D, H, D_FF, dropout=0.0, norm_first=True).double()(x)
    assert torch.allclose(post.mean(-1), torch.zeros(2, 6, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(post.std(-1, unbiased=False), torch.ones(2, 6, dtype=torch.float64), atol=1e-4)
    assert pre.std(-1, unbiased=False).mean() > 2          # the residual stream keeps its scale


def test_final_norm_only_for_pre_ln():
    assert isinstance(Encoder(D, H, D_FF, 2, 0.0, norm_first=True).norm, nn.LayerNorm)
    assert isinstance(Decoder(D, H, D_FF, 2, 0.0, norm_first=True).norm, nn.LayerNorm)
    assert isinstance(Encoder(D, H, D_FF, 2, 0.0, norm_first=False).norm, nn.Identity)
    assert isinstance(Decoder(D, H, D_FF, 2, 0.0, norm_first=False).norm, nn.Identity)


def test_decoder_is_causal():
    torch.manual_seed(0)
    dec = Decoder(D, H, D_FF, 2, dropout=0.0).double().eval()
    memory, y, _ = inputs()
    T = y.size(1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    out = dec(y, memory, causal)
    y2 = y.clone(); y2[:, 4:] = torch.randn_like(y2[:, 4:])
    out2 = dec(y2, memory, causal)
    assert torch.allclose(out[:, :4], out2[:, :4], atol=1e-12)
    assert not torch.allclose(out[:, 4:], out2[:, 4:], atol=1e-3)


def test_encoder_pad_invariance_and_no_nan():
    torch.manual_seed(0)
    enc = Encoder(D, H, D_FF, 2, dropout=0.0).double().eval()
    x, _, keep = inputs()
    mask = keep[:, None, None, :]
    out = enc(x, mask)
    x2 = torch.where(keep[..., None], x, torch.randn_like(x) * 100)   # change what sits at pad positions
    out2 = enc(x2, mask)
    assert torch.allclose(out[keep], out2[keep], atol=1e-12)
    nothing = torch.zeros_like(mask)                                  # every key masked
    assert torch.isfinite(enc(x, nothing)).all()


def test_dropout_is_active_in_training_only():
    torch.manual_seed(0)
    layer = EncoderLayer(D, H, D_FF, dropout=0.5).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    assert torch.equal(layer(x), layer(x))


def test_residual_is_post_ln_or_pre_ln():
    "residual(x, f, norm, dropout, norm_first): LayerNorm(x + f(x)) (the paper) or x + f(LayerNorm(x))."
    from transformer.blocks import residual
    torch.manual_seed(0)
    norm, ffn = nn.LayerNorm(D).double(), FeedForward(D, D_FF).double()
    randomize_norms(norm)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    keep = nn.Identity()
    assert torch.equal(residual(x, ffn, norm, keep, norm_first=False), norm(x + ffn(x)))
    assert torch.equal(residual(x, ffn, norm, keep, norm_first=True), x + ffn(norm(x)))
    drop = nn.Dropout(0.5).train()                                  # the dropout wraps the sub-layer's output
    torch.manual_seed(1); got = residual(x, ffn, norm, drop, norm_first=True)
    torch.manual_seed(1); assert torch.equal(got, x + drop(ffn(norm(x))))


@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_use_torch_dropout_until_sped_up(norm_first):
    "The layers are built from nn.Dropout (appendix D's speed_up swaps in the fast one)."
    enc = EncoderLayer(D, H, D_FF, dropout=0.3, norm_first=norm_first)
    dec = DecoderLayer(D, H, D_FF, dropout=0.3, norm_first=norm_first)
    for layer, names in ((enc, ("dropout1", "dropout2")), (dec, ("dropout1", "dropout2", "dropout3"))):
        assert all(type(getattr(layer, n)) is nn.Dropout and getattr(layer, n).p == 0.3 for n in names)
        assert type(layer.feed_forward.dropout) is nn.Dropout


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_with_a_kv_cache_equals_the_causal_pass(norm_first):
    "cached_encoder_layer one token at a time (chapter 19.1's decoder-only model) = EncoderLayer with the causal mask."
    from transformer.engine.fast import KVCache, cached_encoder_layer
    torch.manual_seed(0)
    layer = EncoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first).double().eval()
    randomize_norms(layer)
    _, y, _ = inputs()
    T = y.size(1)
    full = layer(y, torch.ones(T, T, dtype=torch.bool).tril())
    cache = KVCache(capacity=T)
    steps = [cached_encoder_layer(layer, y[:, t:t + 1], None, cache) for t in range(T)]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-10


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_with_caches_equals_the_causal_pass(norm_first):
    "cached_decoder_layer through the stack, (self, cross) caches per layer, one token at a time = the causal pass."
    from transformer.engine.fast import KVCache, cached_decoder_layer
    torch.manual_seed(0)
    dec = Decoder(D, H, D_FF, 2, dropout=0.0, norm_first=norm_first).double().eval()
    randomize_norms(dec)
    memory, y, keep = inputs()
    T = y.size(1)
    memory_mask = keep[:, None, None, :]
    full = dec(y, memory, None, memory_mask, tgt_is_causal=True)
    caches = [(KVCache(capacity=T), KVCache(fixed=True)) for _ in dec.layers]
    def step(y_t):
        for layer, pair in zip(dec.layers, caches):
            y_t = cached_decoder_layer(layer, y_t, memory, memory_mask, pair)
        return dec.norm(y_t)
    steps = [step(y[:, t:t + 1]) for t in range(T)]
    assert all(c[0].length == T and c[1].length == memory.size(1) for c in caches)
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-10
