"""Tests for transformer.heads (chapter 04): MultiHeadAttention against torch.nn.MultiheadAttention,
split_heads/merge_heads, the per-head weights (need_weights, hooks) and the KV cache. The module
trusts its callers: inputs are checked at the user's boundary (`TransformerConfig`, `Transformer`)."""
import pytest
import torch
from torch import nn

from transformer.attention import attention
from transformer.heads import MultiHeadAttention, merge_heads, split_heads

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def pair(d_model=16, h=4, bias=True, seed=0):
    "Our module and torch's, with the same weights, in float64."
    torch.manual_seed(seed)
    ours = MultiHeadAttention(d_model, h, bias=bias).double().eval()
    ref = nn.MultiheadAttention(d_model, h, bias=bias, batch_first=True).double().eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
        ref.out_proj.weight.copy_(ours.w_o.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
            ref.out_proj.bias.copy_(ours.w_o.bias)
    return ours, ref


def x(B, T, d=16, seed=1):
    return torch.randn(B, T, d, dtype=F64, generator=torch.Generator().manual_seed(seed))


def check(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_matches_torch(bias):
    ours, ref = pair(bias=bias)
    s = x(3, 6)
    out, w = ours(s, s, s, need_weights=True)
    ref_out, ref_w = ref(s, s, s, need_weights=True, average_attn_weights=True)
    check(out, ref_out)
    check(w.mean(dim=1), ref_w)
    _, ref_w_heads = ref(s, s, s, need_weights=True, average_attn_weights=False)
    check(w, ref_w_heads)
    fast, none = ours(s, s, s)
    assert none is None
    check(fast, ref_out)


def test_cross_attention_matches_torch():
    ours, ref = pair()
    y, memory = x(3, 4), x(3, 9, seed=2)
    out, w = ours(y, memory, memory, need_weights=True)
    ref_out, ref_w = ref(y, memory, memory, need_weights=True)
    assert out.shape == (3, 4, 16) and w.shape == (3, 4, 4, 9)
    check(out, ref_out)
    check(w.mean(1), ref_w)
    check(ours(y, memory, memory)[0], ref_out)


def test_key_padding_mask_matches_torch():
    ours, ref = pair()
    y, memory = x(3, 4), x(3, 9, seed=2)
    lengths = torch.tensor([9, 5, 2])
    pad = torch.arange(9)[None] >= lengths[:, None]              # torch: True = ignore
    mask = ~pad[:, None, None, :]                                 # ours: (B, 1, 1, T_k), True = may attend
    ref_out, ref_w = ref(y, memory, memory, key_padding_mask=pad, need_weights=True)
    for need in (False, True):
        out, w = ours(y, memory, memory, mask, need_weights=need)
        check(out, ref_out)
    check(w.mean(1), ref_w)


def test_causal_mask_matches_torch():
    ours, ref = pair()
    s = x(2, 7)
    future = torch.ones(7, 7, dtype=torch.bool).triu(1)          # torch: True = not allowed
    ref_out, ref_w = ref(s, s, s, attn_mask=future, need_weights=True)
    for need in (False, True):
        out, w = ours(s, s, s, ~future, need_weights=need)
        check(out, ref_out)
    check(w.mean(1), ref_w)
    assert (w.triu(1) == 0).all()


def test_causal_and_padding_mask_match_torch():
    ours, ref = pair()
    s = x(2, 7)
    future = torch.ones(7, 7, dtype=torch.bool).triu(1)
    pad = torch.arange(7)[None] >= torch.tensor([7, 5])[:, None]
    ref_out, _ = ref(s, s, s, attn_mask=future, key_padding_mask=pad)
    out, _ = ours(s, s, s, ~future[None, None] & ~pad[:, None, None, :])
    check(out, ref_out)


def test_changing_a_future_token_leaves_earlier_outputs_unchanged():
    ours, _ = pair()
    s = x(1, 6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    s2 = s.clone()
    s2[0, 4] += 3.0
    out, out2 = ours(s, s, s, mask)[0], ours(s2, s2, s2, mask)[0]
    check(out2[:, :4], out[:, :4])
    assert not torch.allclose(out2[:, 4], out[:, 4])


def test_self_attention_is_permutation_equivariant():
    ours, _ = pair()
    s = x(2, 6)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    out = ours(s, s, s)[0]
    out_p = ours(s[:, perm], s[:, perm], s[:, perm])[0]
    check(out_p, out[:, perm])


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_query_gives_w_o_bias_not_nan(need_weights):
    ours, _ = pair()
    s = x(2, 5)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[0, :, 2] = False
    mask[1] = False
    out, w = ours(s, s, s, mask, need_weights=need_weights)
    assert not out.isnan().any()
    # no key -> zero attention output -> what is left is the output projection's bias
    check(out[0, 2], ours.w_o.bias)
    check(out[1], ours.w_o.bias.expand(5, -1))
    if need_weights:
        assert (w[0, :, 2] == 0).all() and (w[1] == 0).all()


@pytest.mark.parametrize("need_weights", [False, True])
def test_batch_order_independence(need_weights):
    ours, _ = pair()
    s = x(4, 6)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 5])[:, None])[:, None, None, :]
    perm = torch.tensor([1, 3, 0, 2])
    out = ours(s, s, s, mask, need_weights=need_weights)[0]
    out_p = ours(s[perm], s[perm], s[perm], mask[perm], need_weights=need_weights)[0]
    check(out_p, out[perm])


def test_need_weights_returns_the_per_head_weights_of_the_teaching_path():
    "need_weights=True: (B, h, T_q, T_k) weights, those of chapter 2's `attention` on the split heads, with grad."
    ours, _ = pair()
    y, memory = x(2, 5).requires_grad_(True), x(2, 7, seed=2)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[1, ..., 4:] = False
    out, w = ours(y, memory, memory, mask, need_weights=True)
    assert w.shape == (2, 4, 5, 7) and w.requires_grad
    q, k, v = (split_heads(lin(t), 4) for lin, t in ((ours.w_q, y), (ours.w_k, memory), (ours.w_v, memory)))
    want_out, want_w = attention(q, k, v, mask)
    check(w, want_w)
    check(out, ours.w_o(merge_heads(want_out)))
    assert (w[1, ..., 4:] == 0).all()
    fast, none = ours(y, memory, memory, mask)
    assert none is None
    check(fast, out)


def test_a_forward_hook_collects_the_weights_of_every_attention():
    "How figures get weights: a pre-hook asks each MultiHeadAttention for them, a forward hook keeps output[1]."
    from transformer.model import Transformer, TransformerConfig
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=30, tgt_vocab=30, d_model=16, d_ff=32, h=4, n_layers=2,
                                         dropout=0.0)).double().eval()
    src, tgt = torch.randint(4, 30, (2, 6)), torch.randint(4, 30, (2, 5))
    src[1, 4:] = 0                                                   # padding in the second source
    plain = model(src, tgt)
    weights, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, MultiHeadAttention):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs: (args, {**kwargs, "need_weights": True}), with_kwargs=True))
            handles.append(m.register_forward_hook(
                lambda mod, args, output, name=name: weights.__setitem__(name, output[1].detach())))
    try:
        hooked = model(src, tgt)
    finally:
        for handle in handles:
            handle.remove()
    assert len(weights) == 6                               # 2 encoder self, 2 decoder self, 2 decoder cross
    torch.testing.assert_close(hooked, plain, rtol=0, atol=1e-10)   # asking for weights changes nothing
    for name, w in weights.items():
        T_q, T_k = (5, 6) if "cross" in name else (6, 6) if name.startswith("encoder") else (5, 5)
        assert w.shape == (2, 4, T_q, T_k), name
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, T_q, dtype=F64))
        if name.startswith("encoder") or "cross" in name:
            assert (w[1, ..., 4:] == 0).all(), name        # padded source keys get no weight
        else:
            assert (w.triu(1) == 0).all(), name            # the decoder's self-attention is causal
    weights.clear()
    model(src, tgt)
    assert weights == {}                                            # hooks removed: nothing more collected


def test_dropout_only_in_training():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, dropout=0.5).double()
    s = x(2, 6)
    m.eval()
    a, b = m(s, s, s)[0], m(s, s, s)[0]
    check(a, b)
    m.train()
    c = m(s, s, s)[0]
    assert not torch.allclose(a, c)


def test_parameter_count_and_shapes():
    m = MultiHeadAttention(512, 8)
    assert m.d_k == 64
    assert sum(p.numel() for p in m.parameters()) == 4 * (512 * 512 + 512)
    for lin in (m.w_q, m.w_k, m.w_v, m.w_o):
        assert isinstance(lin, nn.Linear) and lin.weight.shape == (512, 512)
    assert sum(p.numel() for p in MultiHeadAttention(512, 1).parameters()) == 4 * (512 * 512 + 512)


def test_gradients_flow_to_every_parameter():
    m = MultiHeadAttention(16, 4).double()
    s = x(2, 5)
    m(s, s, s, torch.ones(1, 1, 5, 5, dtype=torch.bool).tril())[0].sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_broadcastable_masks_are_accepted():
    m = MultiHeadAttention(16, 4).double()
    q, kv = x(2, 5), x(2, 7, seed=2)
    full = m(q, kv, kv)[0]
    for shape in [(5, 7), (1, 5, 7), (1, 1, 1, 7), (2, 1, 1, 7), (2, 4, 5, 7)]:
        check(m(q, kv, kv, torch.ones(shape, dtype=torch.bool))[0], full)


def test_a_mask_with_a_head_axis_hides_a_key_from_one_head_on_both_paths():
    "A (1, h, 1, T_k) mask: head 0 loses key 2, the other heads are untouched; fast == teaching path."
    m = MultiHeadAttention(16, 4).double()
    q = x(2, 5)
    mask = torch.ones(1, 4, 1, 5, dtype=torch.bool)
    mask[:, 0, :, 2] = False
    _, w = m(q, q, q, need_weights=True)
    slow, w_masked = m(q, q, q, mask=mask, need_weights=True)
    assert (w_masked[:, 0, :, 2] == 0).all() and torch.equal(w_masked[:, 1:], w[:, 1:])
    check(m(q, q, q, mask=mask)[0], slow)


# ---- d_k apart from d_model / h (Table 3, row B) ----------------------------------------------------

def by_the_book(m: MultiHeadAttention, query, key, value, mask=None):
    """Section 3.2.2 written out head by head: head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V,
    W_i^Q and W_i^K of width d_k (rows i*d_k ... of w_q, w_k), W_i^V of width d_v; Concat(heads) W^O."""
    d_k, d_v = m.d_k, m.d_model // m.h
    heads, weights = [], []
    for i in range(m.h):
        qk = slice(i * d_k, (i + 1) * d_k)
        v_ = slice(i * d_v, (i + 1) * d_v)
        q = query @ m.w_q.weight[qk].T + (m.w_q.bias[qk] if m.w_q.bias is not None else 0)    # (B, T_q, d_k)
        k = key @ m.w_k.weight[qk].T + (m.w_k.bias[qk] if m.w_k.bias is not None else 0)      # (B, T_k, d_k)
        v = value @ m.w_v.weight[v_].T + (m.w_v.bias[v_] if m.w_v.bias is not None else 0)   # (B, T_k, d_v)
        scores = q @ k.transpose(1, 2) / d_k ** 0.5                                          # (B, T_q, T_k)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, 0], float("-inf"))                    # mask (B, 1, T_q, T_k)
        w = scores.softmax(-1)
        heads.append(w @ v)                                                                  # (B, T_q, d_v)
        weights.append(w)
    return m.w_o(torch.cat(heads, -1)), torch.stack(weights, 1)


@pytest.mark.parametrize("d_k", [1, 2, 3, 8, 20])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["self", "cross", "separate"])
def test_d_k_matches_the_per_head_computation(d_k, bias, kind):
    "d_k narrows queries and keys only: the fast and the teaching path both equal the head-by-head formula."
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, bias=bias, d_k=d_k).double().eval()
    assert (m.d_k, m.w_v.out_features // m.h) == (d_k, 4)
    q = x(3, 5)
    k = q if kind == "self" else x(3, 7, seed=2)
    v = k if kind != "separate" else x(3, k.size(1), seed=3)
    mask = torch.ones(3, 1, q.size(1), k.size(1), dtype=torch.bool)
    mask[1, :, :, 3:] = False                                       # padding in row 1
    mask[2] = torch.ones(q.size(1), k.size(1), dtype=torch.bool).tril()
    for msk in (None, mask):
        want, want_w = by_the_book(m, q, k, v, msk)
        for need_weights in (False, True):                  # F.scaled_dot_product_attention, explicit softmax
            out, w = m(q, k, v, msk, need_weights=need_weights)
            check(out, want)
            if need_weights:
                check(w, want_w)


def test_d_k_is_the_softmax_temperature():
    "The scores are divided by sqrt(d_k), not by sqrt(d_v): doubling q and k's width at equal dot products shows it."
    m = MultiHeadAttention(8, 2, d_k=8).double().eval()
    s = x(1, 4, d=8)
    _, w = m(s, s, s, need_weights=True)
    _, want = by_the_book(m, s, s, s)
    check(w, want)
    # the wrong temperature sqrt(d_v) = 2 instead of sqrt(8) would give other weights
    q = (s @ m.w_q.weight.T + m.w_q.bias).view(1, 4, 2, 8).transpose(1, 2)
    k = (s @ m.w_k.weight.T + m.w_k.bias).view(1, 4, 2, 8).transpose(1, 2)
    wrong = (q @ k.transpose(-1, -2) / 2).softmax(-1)
    assert not torch.allclose(w, wrong, atol=1e-6)


@pytest.mark.parametrize("d_model, h, d_k", [(16, 4, 2), (16, 4, 16), (512, 8, 32), (512, 8, 64), (12, 3, 5)])
def test_d_k_parameter_count_and_shapes(d_model, h, d_k):
    m = MultiHeadAttention(d_model, h, d_k=d_k)
    assert m.w_q.weight.shape == m.w_k.weight.shape == (h * d_k, d_model)
    assert m.w_v.weight.shape == m.w_o.weight.shape == (d_model, d_model)      # d_v = d_model / h stays
    assert sum(p.numel() for p in m.parameters()) == 2 * (d_model * h * d_k + h * d_k) + 2 * (d_model ** 2 + d_model)
    assert sum(p.numel() for p in MultiHeadAttention(d_model, h, bias=False, d_k=d_k).parameters()) \
        == 2 * d_model * h * d_k + 2 * d_model ** 2
    assert f"d_k={d_k}" in repr(m)


def test_default_d_k_is_d_model_over_h_bit_for_bit():
    "d_k=None builds and computes exactly what d_k=d_model/h does: same weights from the same seed, same outputs."
    outs = []
    for d_k in (None, 4):
        torch.manual_seed(3)
        m = MultiHeadAttention(16, 4, d_k=d_k).eval()
        assert m.d_k == m.w_v.out_features // m.h == 4
        s, kv = x(2, 5).float(), x(2, 6, seed=2).float()
        outs.append((m.state_dict(), m(s, s, s)[0], m(s, kv, kv)[0], m(s, kv, kv, need_weights=True)))
    (sd1, *o1), (sd2, *o2) = outs
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert all(torch.equal(a, b) for a, b in zip(o1[:2], o2[:2], strict=True))
    assert torch.equal(o1[2][0], o2[2][0]) and torch.equal(o1[2][1], o2[2][1])


# ---- split_heads / merge_heads, and the KV cache (chapter 9) ------------------------------------------

@pytest.mark.parametrize("h", [1, 2, 4, 8])
def test_split_and_merge_heads_are_inverse(h):
    t = x(3, 5)                                                     # (B, T, 16)
    heads = split_heads(t, h)
    assert heads.shape == (3, h, 5, 16 // h)
    assert torch.equal(merge_heads(heads), t)
    assert torch.equal(split_heads(merge_heads(heads), h), heads)
    d = 16 // h
    for i in range(h):                                              # head i: features i*d ... (i+1)*d - 1
        assert torch.equal(heads[:, i], t[..., i * d:(i + 1) * d])


@pytest.mark.parametrize("d_k", [None, 3])
def test_kv_cache_one_token_at_a_time_equals_the_causal_pass(d_k):
    "Self-attention fed one token at a time with a KVCache (`cached_attention`) gives the full causal pass's outputs."
    from transformer.engine.fast import KVCache, cached_attention
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, d_k=d_k).double().eval()
    s = x(2, 7)
    full, _ = m(s, s, s, is_causal=True)
    cache = KVCache(capacity=7)
    steps = [cached_attention(m, s[:, t:t + 1], s[:, t:t + 1], cache) for t in range(7)]
    assert cache.length == 7
    check(torch.cat(steps, 1), full)
    prefix_cache = KVCache(capacity=7)                              # a prefix of 3 at once, then one at a time
    first = cached_attention(m, s[:, :3], s[:, :3], prefix_cache, torch.ones(3, 3, dtype=torch.bool).tril())
    rest = [cached_attention(m, s[:, t:t + 1], s[:, t:t + 1], prefix_cache) for t in range(3, 7)]
    check(torch.cat([first, *rest], 1), full)


def test_fixed_kv_cache_keeps_the_memory_of_the_first_call():
    "Cross-attention with `KVCache(fixed=True)`: the memory's keys and values are computed once, then only read."
    from transformer.engine.fast import KVCache, cached_attention
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4).double().eval()
    y, memory = x(2, 5), x(2, 9, seed=2)
    full, _ = m(y, memory, memory)
    cache = KVCache(fixed=True)
    steps = [cached_attention(m, y[:, :1], memory, cache)]
    steps += [cached_attention(m, y[:, t:t + 1], memory * 0, cache) for t in range(1, 5)]  # not re-read
    assert cache.length == 9
    check(torch.cat(steps, 1), full)
