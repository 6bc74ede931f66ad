"""Tests for transformer.attention: the teaching path `attention` and the fast path
`scaled_dot_product_attention` (chapters 02 and 03). Both trust their callers (inputs are
checked at the user's boundary, `Transformer`); the CPU low-precision route is appendix D's
`float32_attention`, tested in test_fast.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from transformer.attention import attention, scaled_dot_product_attention

F64 = torch.float64


def qkv(B=2, h=3, T_q=5, T_k=7, d_k=8, d_v=6, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, T_q, d_k, generator=g, dtype=dtype),
            torch.randn(B, h, T_k, d_k, generator=g, dtype=dtype),
            torch.randn(B, h, T_k, d_v, generator=g, dtype=dtype))


def padding_mask(B=2, T_k=7, lengths=(7, 4)):
    return (torch.arange(T_k)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, T_k)


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)


def test_attention_is_eq1_by_hand():
    q, k, v = qkv()
    out, w = attention(q, k, v)
    expected_w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
    torch.testing.assert_close(w, expected_w, rtol=0, atol=1e-14)
    torch.testing.assert_close(out, w @ v, rtol=0, atol=1e-14)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "padding+causal", "random"])
def test_teaching_path_matches_torch_sdpa(mask_kind):
    """Chapter 2's `attention` is PyTorch's `F.scaled_dot_product_attention` in float64, with the
    mask shapes later chapters use: padding (B, 1, 1, T_k), causal (1, 1, T, T), both, random."""
    T = 6
    q, k, v = qkv(T_q=T, T_k=T)
    pad = padding_mask(T_k=T, lengths=(6, 3))
    mask = {"none": None, "padding": pad, "causal": causal(T), "padding+causal": pad & causal(T),
            "random": torch.rand(2, 3, T, T, generator=torch.Generator().manual_seed(1)) > 0.3}[mask_kind]
    if mask is not None:
        mask = mask | torch.eye(T, dtype=torch.bool)  # every row keeps a key: torch's reference is defined there
    out, _ = attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "padding+causal", "fully-masked-rows"])
def test_fast_path_equals_teaching_path_float64(mask_kind):
    T = 7
    q, k, v = qkv(T_q=T, T_k=T)
    pad = padding_mask(T_k=T, lengths=(7, 4))
    mask = {"none": None, "padding": pad, "causal": causal(T), "padding+causal": pad & causal(T),
            "fully-masked-rows": pad & causal(T) & (torch.arange(T) != 2)[:, None]}[mask_kind]
    fast, none = scaled_dot_product_attention(q, k, v, mask)
    slow, w = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert none is None and w.shape == (2, 3, T, T)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)
    teach, _ = attention(q, k, v, mask)
    torch.testing.assert_close(slow, teach, rtol=0, atol=0)


@pytest.mark.parametrize("need_weights", [False, True])
def test_masked_key_gets_exactly_zero_weight_and_no_influence(need_weights):
    q, k, v = qkv()
    mask = padding_mask(lengths=(7, 4))                  # sequence 1: keys 4, 5, 6 are padding
    out, w = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    if need_weights:
        assert (w[1, ..., 4:] == 0).all() and (w[1, ..., :4] > 0).all() and (w[0] > 0).all()
    k2, v2 = k.clone(), v.clone()                        # change what sits behind the mask ...
    k2[1, :, 4:] += 100.0
    v2[1, :, 4:] = 1e6
    out2, _ = scaled_dot_product_attention(q, k2, v2, mask, need_weights=need_weights)
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)   # ... and nothing changes


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fully_masked_row_gives_zero_not_nan(need_weights, dtype):
    q, k, v = qkv(dtype=dtype)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[0, :, 3] = False                            # query 3 of sequence 0 may look at nothing
    mask[1] = False                                  # sequence 1 is masked completely
    out, w = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    assert not out.isnan().any()
    assert (out[0, :, 3] == 0).all() and (out[1] == 0).all()
    assert (out[0, :, 2].abs() > 0).any()
    if need_weights:
        assert (w[0, :, 3] == 0).all() and (w[1] == 0).all()
        torch.testing.assert_close(w[0, :, 2].sum(-1), torch.ones(3, dtype=dtype))
    out.square().sum().backward()
    for t in (q, k, v):
        assert not t.grad.isnan().any()
    assert (q.grad[1] == 0).all()


def test_no_mask_and_all_true_mask_agree():
    q, k, v = qkv()
    for need in (False, True):
        a, _ = scaled_dot_product_attention(q, k, v, None, need_weights=need)
        b, _ = scaled_dot_product_attention(q, k, v, torch.ones(1, 1, 1, 7, dtype=torch.bool), need_weights=need)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
def test_batch_order_independence(need_weights):
    q, k, v = qkv(B=4)
    mask = padding_mask(B=4, lengths=(7, 3, 5, 1)) & causal(7)[..., :5, :]
    perm = torch.tensor([2, 0, 3, 1])
    out, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    out_p, _ = scaled_dot_product_attention(q[perm], k[perm], v[perm], mask[perm], need_weights=need_weights)
    torch.testing.assert_close(out_p, out[perm], rtol=0, atol=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_flag_equals_the_causal_mask(need_weights):
    "`is_causal=True` (the fused kernel's flag; the teaching path writes the triangle out) = an explicit tril mask."
    q, k, v = qkv(T_q=6, T_k=6)
    flag, w_flag = scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=need_weights)
    mask, w_mask = scaled_dot_product_attention(q, k, v, causal(6), need_weights=need_weights)
    torch.testing.assert_close(flag, mask, rtol=0, atol=1e-12)
    if need_weights:
        assert torch.equal(w_flag, w_mask) and (w_flag.triu(1) == 0).all()


def test_key_permutation_invariance():
    "Attention is a set operation over (key, value) pairs: reordering them together changes nothing."
    q, k, v = qkv()
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(3))
    out, _ = attention(q, k, v)
    out_p, _ = attention(q, k[..., perm, :], v[..., perm, :])
    torch.testing.assert_close(out_p, out, rtol=0, atol=1e-12)


def test_dropout_is_applied_to_the_weights():
    q, k, v = qkv()
    torch.manual_seed(0)
    out, w = scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True)
    zeros = (w == 0).double().mean().item()
    assert 0.3 < zeros < 0.7          # 210 weights, p = 0.5: 0.419-0.600 over seeds 0-199 (0.6 was hit once)
    torch.testing.assert_close(out, w @ v)
    a, _ = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b, _ = scaled_dot_product_attention(q, k, v)
    assert not torch.allclose(a, b)


def test_cross_attention_lengths_and_broadcast_batch_dims():
    q = torch.randn(2, 3, 4, 8, dtype=F64)
    k = torch.randn(1, 3, 9, 8, dtype=F64)               # one memory shared by the batch
    v = torch.randn(1, 3, 9, 5, dtype=F64)
    out, w = attention(q, k, v)
    assert out.shape == (2, 3, 4, 5) and w.shape == (2, 3, 4, 9)
    fast, _ = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(fast, out, rtol=0, atol=1e-12)


def test_fast_path_gradients_equal_teaching_path_gradients():
    T = 6
    pad = padding_mask(T_k=T, lengths=(6, 3))
    mask = pad & causal(T) & pad.transpose(-1, -2)                 # includes rows that see no key
    grads = []
    for need_weights in (False, True):
        q, k, v = (t.requires_grad_(True) for t in qkv(T_q=T, T_k=T))
        out, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
        (out * torch.linspace(-1, 1, out.size(-1), dtype=F64)).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    for fast, slow in zip(*grads, strict=True):
        assert not fast.isnan().any()
        torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)


def test_fast_path_under_inference_mode_matches():
    q, k, v = qkv()
    mask = padding_mask(lengths=(7, 4)) & torch.ones(5, 7, dtype=torch.bool).index_fill(0, torch.tensor([1]), False)
    expected, _ = attention(q, k, v, mask)
    with torch.inference_mode():
        out, _ = scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert (out[:, :, 1] == 0).all()
