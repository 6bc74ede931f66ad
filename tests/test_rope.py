"""Chapter 14: rotary positions. The rotation is chapter 5's, the scores depend only on the
offset, and bad inputs raise errors that name the bad value."""
import math

import pytest
import torch

from transformer.modern.rope import apply_rope, rope_cos_sin, rope_frequencies
from transformer.positions import sinusoidal_encoding


def _rotate(x, offset=0, base=10000.0):
    cos, sin = rope_cos_sin(x.size(-2), x.size(-1), base=base, offset=offset,
                            dtype=x.dtype)
    return apply_rope(x, cos, sin)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_scores_depend_only_on_the_offset(base):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 24, 32, dtype=torch.float64)   # (B, h, T, d_k)
    k = torch.randn(2, 3, 24, 32, dtype=torch.float64)
    scores = _rotate(q, base=base) @ _rotate(k, base=base).transpose(-2, -1)
    for shift in (1, 5, 999, 40000):
        shifted = (_rotate(q, shift, base) @ _rotate(k, shift, base).transpose(-2, -1))
        assert torch.allclose(shifted, scores, atol=1e-9)
    # and they do depend on the offset: unrotated scores differ
    assert not torch.allclose(scores, q @ k.transpose(-2, -1), atol=1e-3)


def test_one_query_one_key_everywhere_gives_a_toeplitz_score_table():
    torch.manual_seed(1)
    T, d = 30, 16
    q = torch.randn(1, d, dtype=torch.float64).expand(T, d)
    k = torch.randn(1, d, dtype=torch.float64).expand(T, d)
    s = _rotate(q) @ _rotate(k).T
    for o in range(-T + 1, T):
        diag = torch.diagonal(s, offset=o)
        assert torch.allclose(diag, diag[:1].expand_as(diag), atol=1e-10)


def test_rotation_keeps_norms_and_is_chapter_5s_table_on_unit_pairs():
    torch.manual_seed(2)
    x = torch.randn(40, 64, dtype=torch.float64)
    assert torch.allclose(_rotate(x).norm(dim=-1), x.norm(dim=-1), atol=1e-12)
    ones = torch.tensor([1.0, 0.0], dtype=torch.float64).repeat(32).expand(40, 64)
    swap = torch.arange(64).view(-1, 2).flip(1).flatten()
    pe = sinusoidal_encoding(40, 64).double()
    assert torch.allclose(_rotate(ones), pe[:, swap], atol=1e-6)   # table stored in float32


def test_interleaved_pairs_rotate_like_complex_numbers():
    "Meta's Llama: each pair (2i, 2i+1) is one complex number times exp(i omega_i pos)."
    torch.manual_seed(3)
    x = torch.randn(10, 8, dtype=torch.float64)
    angle = torch.arange(10, dtype=torch.float64)[:, None] * rope_frequencies(8)
    z = torch.view_as_complex(x.view(10, 4, 2).contiguous()) * torch.polar(
        torch.ones_like(angle), angle)
    assert torch.allclose(_rotate(x), torch.view_as_real(z).flatten(-2), atol=1e-12)


def test_offset_gives_the_rows_of_a_longer_table_and_dtypes_follow():
    c, s = rope_cos_sin(50, 16, offset=0)
    c2, s2 = rope_cos_sin(7, 16, offset=43)
    assert torch.equal(c2, c[43:]) and torch.equal(s2, s[43:])
    assert c.dtype == torch.get_default_dtype() and c.shape == (50, 8)
    c16, _ = rope_cos_sin(3, 16, dtype=torch.bfloat16)
    assert c16.dtype == torch.bfloat16
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert apply_rope(x, *rope_cos_sin(3, 16)).dtype == torch.bfloat16
    omega = rope_frequencies(16)
    assert omega[0] == 1.0 and math.isclose(omega[-1].item(), 10000 ** (-14 / 16))


@pytest.mark.parametrize("call, message", [
    (lambda: rope_frequencies(15), "d_k=15 must be even"),
    (lambda: rope_frequencies(0), "d_k=0"),
    (lambda: rope_frequencies(8, base=1.0), "base=1.0 must be a number > 1"),
    (lambda: rope_cos_sin(0, 8), "T=0"),
    (lambda: rope_cos_sin(4, 8, offset=-1), "offset=-1"),
    (lambda: rope_cos_sin(2.5, 8), "T=2.5"),
    (lambda: apply_rope(torch.zeros(4, 10), *rope_cos_sin(4, 8)), "d_k = 2 \\* cos"),
    (lambda: apply_rope(torch.zeros(5, 8), *rope_cos_sin(4, 8)), "x has T=5 positions"),
    (lambda: apply_rope(torch.zeros(4, 8), torch.zeros(4, 4), torch.zeros(4, 3)),
     "must have the same shape"),
    (lambda: apply_rope(torch.zeros(8), *rope_cos_sin(4, 8)),
     "must be \\(..., T, d_k\\)"),
])
def test_bad_inputs_name_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
