"Blocks: FFN, encoder/decoder layers and stacks against torch.nn in float64; plumbing; errors."
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
    for a, b in zip(enc.layers, ref.encoder.layers):
        copy_layer(a, b)
    for a, b in zip(dec.layers, ref.decoder.layers):
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


@pytest.mark.parametrize("call, exc, match", [
    (lambda: EncoderLayer(30, 4, 64), ValueError, r"d_model=30 is not divisible by h=4"),
    (lambda: Encoder(D, H, D_FF, 0), ValueError, r"n_layers=0"),
    (lambda: Decoder(D, H, D_FF, 2.5), ValueError, r"n_layers=2.5"),
    (lambda: Encoder(D, H, D_FF, 1)(torch.zeros(2, 3, 16)), ValueError, r"x must have shape \(B, T, d_model=32\)"),
    (lambda: Decoder(D, H, D_FF, 1)(torch.zeros(2, 3, D), torch.zeros(3, 4, D)), ValueError,
     r"memory has batch size 3 but y has 2"),
    (lambda: Decoder(D, H, D_FF, 1)(torch.zeros(2, 3, D), torch.zeros(2, 4)), ValueError, r"memory must have shape"),
    (lambda: Encoder(D, H, D_FF, 1)(torch.zeros(2, 3, D), torch.ones(2, 1, 1, 3)), TypeError, r"bool"),
])
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# --- chapter 6's dropout: a cheaper CPU mask, fused with the residual addition ---------------------------------

from transformer.blocks import Dropout, dropout_mask


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_mask_drops_the_rounded_p_and_keeps_the_mean(p):
    torch.manual_seed(0)
    m = dropout_mask(torch.empty(2000, 1000, dtype=torch.float64), p)
    p_rounded = round(p * 2**15) / 2**15
    share = (m == 0).double().mean().item()
    assert abs(share - p_rounded) < 5 * (p_rounded * (1 - p_rounded) / m.numel()) ** 0.5
    assert set(m.unique().tolist()) == {0.0, 1 / (1 - p_rounded)}
    assert abs(m.mean().item() - 1) < 0.005


def test_dropout_mask_odd_sizes_dtype_and_bad_p():
    for shape in [(1,), (3, 5), (7, 1, 3)]:                      # not a multiple of 4 entries
        m = dropout_mask(torch.empty(shape), 0.5, torch.bfloat16)
        assert m.shape == shape and m.dtype == torch.bfloat16
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"dropout probability p=.* must be in \[0, 1\)"):
            dropout_mask(torch.empty(3), p)


def test_dropout_masks_are_independent_across_positions():
    "Neighbouring entries come from the same 64-bit draw: they must still be uncorrelated."
    torch.manual_seed(1)
    m = (dropout_mask(torch.empty(400_000, dtype=torch.float64), 0.5) > 0).double()
    for lag in (1, 2, 3, 4):
        corr = torch.corrcoef(torch.stack([m[:-lag], m[lag:]]))[0, 1].item()
        assert abs(corr) < 0.01, (lag, corr)


def test_dropout_module_forward_gradient_residual_and_eval():
    drop = Dropout(0.2).train()
    x = torch.randn(300, 200, dtype=torch.float64, requires_grad=True)
    y = torch.randn(300, 200, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    out = drop(x)
    torch.manual_seed(5)
    mask = dropout_mask(x, 0.2)
    assert torch.equal(out, x * mask)
    out.sum().backward()
    assert torch.equal(x.grad, mask)
    x.grad = None
    torch.manual_seed(6)
    fused = drop.residual(x, y)
    torch.manual_seed(6)
    assert torch.allclose(fused, x + drop(y), atol=1e-12)
    fused.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))               # the residual path passes the gradient through
    torch.manual_seed(6)
    assert torch.equal(y.grad, dropout_mask(y, 0.2))
    drop.eval()
    assert drop(x) is x and torch.equal(drop.residual(x, y), x + y)
    assert torch.equal(Dropout(0.0).train().residual(x, y), x + y)


def test_dropout_residual_mixed_precision_keeps_the_stream_dtype():
    "Under autocast the stream is float32 and the sub-layer output bf16: the mask is float32, the result too."
    drop = Dropout(0.1).train()
    x, y = torch.randn(64, 32), torch.randn(64, 32).to(torch.bfloat16)
    out = drop.residual(x, y)
    assert out.dtype == torch.float32
    kept = (out - x).abs() > 0
    assert torch.allclose((out - x)[kept], y.float()[kept] * (1 / (1 - round(0.1 * 2**15) / 2**15)), rtol=1e-5, atol=1e-6)


def test_layers_use_the_fused_residual_dropout():
    "In training the layer's output is random (dropout), and reproducible from the seed; in eval it is not."
    for layer, args in ((EncoderLayer(D, H, D_FF, dropout=0.3, norm_first=True), (torch.randn(2, 5, D),)),
                        (DecoderLayer(D, H, D_FF, dropout=0.3), (torch.randn(2, 5, D), torch.randn(2, 4, D)))):
        assert all(isinstance(getattr(layer, f"dropout{k}"), Dropout) for k in (1, 2))
        layer.train()
        torch.manual_seed(0); a = layer(*args)
        torch.manual_seed(0); b = layer(*args)
        torch.manual_seed(1); c = layer(*args)
        assert torch.equal(a, b) and not torch.equal(a, c)
        layer.eval()
        assert torch.equal(layer(*args), layer(*args))


def test_dropout_under_torch_compile_traces_pytorchs_dropout():
    "Inside a compiled graph the module takes F.dropout (the compiler fuses it); the result is still dropout."
    drop = Dropout(0.5).train()
    fused = torch.compile(lambda x, y: drop.residual(x, y), backend="eager", fullgraph=True)
    x, y = torch.zeros(200, 100), torch.ones(200, 100)
    out = fused(x, y)
    assert set(out.unique().tolist()) == {0.0, 2.0} and abs((out == 0).float().mean().item() - 0.5) < 0.02
