"""Positional encodings: the paper's formula, the relative-offset property, shapes, `start`. The
modules trust their callers (sizes are checked by `TransformerConfig`, lengths by `Transformer`)."""
import math

import pytest
import torch

from transformer.heads import MultiHeadAttention
from transformer.positions import (
    LearnedPositionalEmbedding,
    NoPositions,
    PositionalEncoding,
    sinusoidal_encoding,
)


def test_formula_entries():
    "PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), checked entry by entry."
    d = 16
    pe = sinusoidal_encoding(50, d).double()
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_wavelengths_geometric_from_2pi_to_10000_2pi():
    "Recover each pair's frequency from the table itself: wavelengths run 2π ... 10000^(1-2/d)·2π geometrically."
    d = 64
    pe = sinusoidal_encoding(2, d).double()
    omega = torch.atan2(pe[1, 0::2], pe[1, 1::2])          # angle at pos=1 is the frequency
    wavelength = 2 * math.pi / omega
    assert wavelength[0].item() == pytest.approx(2 * math.pi, rel=1e-6)
    assert wavelength[-1].item() == pytest.approx(2 * math.pi * 10000 ** (1 - 2 / d), rel=1e-5)
    ratios = wavelength[1:] / wavelength[:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, 10000 ** (2 / d)), rtol=1e-5)


def rotation(k: int, d: int) -> torch.Tensor:
    "M_k: block-diagonal 2x2 rotations by k·ω_i, acting on (sin, cos) pairs."
    omega = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    M = torch.zeros(d, d, dtype=torch.float64)
    c, s = torch.cos(k * omega), torch.sin(k * omega)
    M[0::2, 0::2] = torch.diag(c); M[0::2, 1::2] = torch.diag(s)
    M[1::2, 0::2] = torch.diag(-s); M[1::2, 1::2] = torch.diag(c)
    return M


@pytest.mark.parametrize("k", [1, 3, 17, 100])
def test_offset_is_a_fixed_linear_map(k):
    torch.set_default_dtype(torch.float64)
    try:
        d, n = 32, 200
        pe = sinusoidal_encoding(n + k, d)
        M = rotation(k, d)
        assert torch.allclose(pe[k:] , pe[:n] @ M.T, atol=1e-9)   # every pos, one matrix
        assert not torch.allclose(pe[k:], pe[:n], atol=1e-3)       # and it is not the identity
    finally:
        torch.set_default_dtype(torch.float32)


def test_dot_product_depends_only_on_offset():
    pe = sinusoidal_encoding(64, 32).double()
    gram = pe @ pe.T
    for k in range(-10, 11):
        diag = torch.diagonal(gram, offset=k)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-9)


def test_attention_without_positions_is_permutation_equivariant():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4).double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    perm = torch.randperm(7)
    out, _ = mha(x, x, x)
    out_perm, _ = mha(x[:, perm], x[:, perm], x[:, perm])
    assert torch.allclose(out_perm, out[:, perm], atol=1e-12)
    pos = PositionalEncoding(32).double()           # with positions the symmetry is broken
    y = pos(x); y_perm = pos(x[:, perm])
    out, _ = mha(y, y, y)
    out_perm, _ = mha(y_perm, y_perm, y_perm)
    assert not torch.allclose(out_perm, out[:, perm], atol=1e-3)


@pytest.mark.parametrize("cls", [PositionalEncoding, LearnedPositionalEmbedding])
def test_adds_table_and_keeps_shape(cls):
    torch.manual_seed(0)
    module = cls(16, dropout=0.0, max_len=20).eval()
    x = torch.zeros(3, 9, 16)
    out = module(x)
    assert out.shape == (3, 9, 16)
    table = module.pe if cls is PositionalEncoding else module.embedding.weight
    assert torch.equal(out[1], table[:9])
    assert module(torch.zeros(1, 20, 16)).shape == (1, 20, 16)   # exactly max_len is fine


@pytest.mark.parametrize("cls", [PositionalEncoding, LearnedPositionalEmbedding, NoPositions])
def test_start_offsets_the_positions(cls):
    "forward(x, start) adds rows start ... start + T - 1: one token at position t gets pe[t] (cached decoding)."
    torch.manual_seed(0)
    module = cls(16, max_len=12).eval()
    x = torch.randn(2, 9, 16)
    whole = module(x)
    for t in range(9):
        assert torch.equal(module(x[:, t:t + 1], start=t), whole[:, t:t + 1])
    assert torch.equal(module(x[:, 4:], start=4), whole[:, 4:])
    assert torch.equal(module(x[:, :3], start=5), x[:, :3] + module.pe[5:8])


def test_no_positions_is_a_positional_encoding_with_a_zero_table():
    module = NoPositions(16, max_len=10)
    assert isinstance(module, PositionalEncoding) and module.pe.shape == (10, 16)
    assert not module.pe.any() and PositionalEncoding(16, max_len=10).pe.any()


def test_dropout_only_in_training():
    torch.manual_seed(0)
    module = PositionalEncoding(16, dropout=0.5, max_len=10)
    x = torch.randn(2, 10, 16)
    assert (module(x) == 0).any()
    module.eval()
    assert torch.equal(module(x), x + module.pe[:10])


def test_table_follows_dtype_and_is_not_saved():
    module = PositionalEncoding(8, max_len=10).double()
    assert module.pe.dtype == torch.float64
    assert "pe" not in module.state_dict()
    assert sum(p.numel() for p in module.parameters()) == 0
    assert sum(p.numel() for p in LearnedPositionalEmbedding(8, max_len=10).parameters()) == 80


def test_learned_rms_matches_sinusoids():
    torch.manual_seed(0)
    w = LearnedPositionalEmbedding(256, max_len=512).embedding.weight
    pe = sinusoidal_encoding(512, 256)
    assert w.pow(2).mean().sqrt().item() == pytest.approx(pe.pow(2).mean().sqrt().item(), rel=0.02)


# ---- NoPositions and the learned table under the name pe (Table 3, row E) --------------------------

def test_no_positions_is_dropout_alone():
    torch.manual_seed(0)
    module = NoPositions(16, dropout=0.5, max_len=10)
    x = torch.randn(2, 10, 16)
    dropped = module(x)
    assert (dropped == 0).any() and torch.allclose(dropped[dropped != 0], 2 * x[dropped != 0])   # inverted dropout
    module.eval()
    assert torch.equal(module(x), x) and torch.equal(module(x[:, :3]), x[:, :3])


def test_no_positions_table_is_zeros_follows_dtype_and_is_not_saved():
    module = NoPositions(8, max_len=12)
    assert module.pe.shape == (12, 8) and not module.pe.any()
    assert module.double().pe.dtype == torch.float64
    assert dict(module.state_dict()) == {} and not list(module.parameters())
    # the table the decoder reads one position of: x + pe[t] is x
    x = torch.randn(1, 1, 8, dtype=torch.float64)
    assert torch.equal(x + module.pe[5], x)


def test_no_positions_makes_attention_permutation_equivariant():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4).double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    perm = torch.randperm(7)
    for pos, equivariant in ((NoPositions(32).double().eval(), True),
                             (PositionalEncoding(32).double().eval(), False),
                             (LearnedPositionalEmbedding(32).double().eval(), False)):
        y, y_perm = pos(x), pos(x[:, perm])
        same = torch.allclose(mha(y_perm, y_perm, y_perm)[0], mha(y, y, y)[0][:, perm], atol=1e-12)
        assert same is equivariant, type(pos).__name__


def test_learned_pe_is_the_trained_table():
    "`pe` of the learned module is its parameter itself (not a copy): what the cached decoder adds, trained."
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(8, max_len=6)
    assert module.pe is module.embedding.weight and module.pe.shape == (6, 8) and module.pe.requires_grad
    module(torch.zeros(1, 4, 8)).sum().backward()
    assert torch.equal(module.pe.grad[:4], torch.ones(4, 8)) and not module.pe.grad[4:].any()
    with torch.no_grad():
        module.embedding.weight[2] += 1.0
    assert torch.equal(module.eval()(torch.zeros(1, 3, 8))[0, 2], module.pe[2])
    assert torch.equal(module.double().pe, module.embedding.weight) and module.pe.dtype == torch.float64
    assert list(module.state_dict()) == ["embedding.weight"]
