"""Chapter 15: grouped-query attention. g = h is chapter 4's MultiHeadAttention, every g
is PyTorch's enable_gqa kernel, cached decoding is the full forward, and bad inputs are
refused."""
import pytest
import torch
import torch.nn.functional as F

from transformer.heads import MultiHeadAttention
from transformer.modern.gqa import GroupedQueryAttention, KVCache
from transformer.modern.rope import apply_rope, rope_cos_sin

D, H = 48, 6


def _sdpa_reference(m, x, is_causal=True, mask=None):
    B, T, _ = x.shape
    q = m.w_q(x).view(B, T, m.h, m.d_k).transpose(1, 2)
    k = m.w_k(x).view(B, T, m.g, m.d_k).transpose(1, 2)
    v = m.w_v(x).view(B, T, m.g, m.d_k).transpose(1, 2)
    if m.rope_base is not None:
        cos, sin = rope_cos_sin(T, m.d_k, m.rope_base, dtype=x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         enable_gqa=True)
    return m.w_o(out.transpose(1, 2).reshape(B, T, m.h * m.d_k))


@pytest.mark.parametrize("bias", [True, False])
def test_g_equal_h_is_multi_head_attention(bias):
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, H, bias=bias).double().eval()
    gqa = GroupedQueryAttention(D, H, H, bias=bias).double().eval()
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(2, 9, D, dtype=torch.float64)
    ref, _ = mha(x, x, x, is_causal=True)
    assert torch.allclose(gqa(x, is_causal=True), ref, atol=1e-12)
    assert torch.allclose(gqa(x), mha(x, x, x)[0], atol=1e-12)


@pytest.mark.parametrize("g", [1, 2, 3, 6])
@pytest.mark.parametrize("rope", [None, 10000.0])
def test_equals_sdpa_with_enable_gqa(g, rope):
    torch.manual_seed(g)
    m = GroupedQueryAttention(D, H, g, rope_base=rope).double().eval()
    x = torch.randn(3, 10, D, dtype=torch.float64)
    assert torch.allclose(m(x, is_causal=True), _sdpa_reference(m, x), atol=1e-12)
    # a per-query-head mask: each head sees a different set of keys
    mask = torch.rand(3, H, 10, 10, generator=torch.Generator().manual_seed(1)) > 0.3
    mask |= torch.eye(10, dtype=torch.bool)          # no query without a key
    assert torch.allclose(m(x, mask=mask), _sdpa_reference(m, x, False, mask), atol=1e-12)


def test_the_query_heads_of_a_group_read_one_key_value_head():
    "Changing key/value head 1 changes the outputs of query heads 2, 3 (h=4, g=2) only."
    torch.manual_seed(3)
    m = GroupedQueryAttention(16, 4, 2).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)

    def per_head(module):
        B, T, _ = x.shape
        with torch.no_grad():
            w_o, module.w_o.weight.data = module.w_o.weight.data, torch.eye(16).double()
            out = module(x, is_causal=True).view(B, T, 4, 4)
            module.w_o.weight.data = w_o
        return out

    before = per_head(m)
    with torch.no_grad():
        m.w_v.weight[4:8] += 1.0                      # value head 1 (rows 4..7)
    after = per_head(m)
    changed = [(after[:, :, j] - before[:, :, j]).abs().max().item() > 1e-6
               for j in range(4)]
    assert changed == [False, False, True, True]


@pytest.mark.slow
@pytest.mark.parametrize("g", [1, 3, 6])
def test_cached_decoding_equals_the_full_forward(g):
    torch.manual_seed(10 + g)
    m = GroupedQueryAttention(D, H, g, rope_base=10000.0).double().eval()
    x = torch.randn(2, 15, D, dtype=torch.float64)
    full = m(x, is_causal=True)
    for prompt in (1, 4, 15):
        cache = KVCache(20)
        parts = [m(x[:, :prompt], is_causal=True, cache=cache)]
        parts += [m(x[:, t:t + 1], is_causal=True, cache=cache) for t in range(prompt, 15)]
        assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12)
        assert cache.length == 15
    # two chunks of several positions each: the shifted causal mask
    cache = KVCache(15)
    parts = [m(x[:, :6], is_causal=True, cache=cache),
             m(x[:, 6:], is_causal=True, cache=cache)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12)


def test_is_causal_with_a_cache_is_bottom_right():
    """With T_k - T positions cached, is_causal=True means query p sees keys 0 .. p: the
    T new queries are the last T positions (triangle aligned bottom-right, tril(T_k - T)),
    not chapter 3's / F.sdpa's top-left triangle (tril()), which is right only for T = T_k."""
    torch.manual_seed(3)
    m = GroupedQueryAttention(D, H, 2, rope_base=10000.0).double().eval()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    T_cached, T = 5, 4
    outs = {}
    for kind in ("flag", "bottom-right", "top-left"):
        cache = KVCache(9)
        m(x[:, :T_cached], is_causal=True, cache=cache)
        if kind == "flag":
            outs[kind] = m(x[:, T_cached:], is_causal=True, cache=cache)
        else:
            tri = torch.ones(T, T_cached + T, dtype=torch.bool)
            mask = tri.tril(T_cached) if kind == "bottom-right" else tri.tril()
            outs[kind] = m(x[:, T_cached:], mask=mask, cache=cache)
    assert torch.allclose(outs["flag"], outs["bottom-right"], atol=1e-12)
    assert not torch.allclose(outs["flag"], outs["top-left"], atol=1e-3)
    assert torch.allclose(outs["flag"], m(x, is_causal=True)[:, T_cached:], atol=1e-12)


@pytest.mark.parametrize("g", [1, 2, 6])
def test_cache_bytes(g):
    m = GroupedQueryAttention(D, H, g)
    cache = KVCache(32)
    assert cache.nbytes == 0
    with torch.no_grad():
        m(torch.randn(3, 4, D), is_causal=True, cache=cache)
    assert cache.nbytes == 2 * 3 * g * 32 * (D // H) * 4
    assert cache.k.shape == (3, g, 32, D // H)


@pytest.mark.parametrize("make, message", [
    (lambda: GroupedQueryAttention(48, 6, 4), "h=6 query heads cannot be split into g=4"),
    (lambda: GroupedQueryAttention(48, 6, 0), "g=0 must be a positive int"),
    (lambda: GroupedQueryAttention(48, 5, 5), "d_model=48 is not divisible by h=5"),
    (lambda: GroupedQueryAttention(48, 8, 8, d_k=5, rope_base=1e4),
     "d_k=5 must be even"),
    (lambda: GroupedQueryAttention(48, 6, 2, dropout=1.0), "dropout=1.0"),
    (lambda: KVCache(0), "capacity=0"),
])
def test_bad_configurations(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_calls():
    m = GroupedQueryAttention(D, H, 2)
    with pytest.raises(ValueError, match="x must have shape"):
        m(torch.zeros(2, 5, D + 1))
    with pytest.raises(ValueError, match="either a mask or is_causal"):
        m(torch.zeros(1, 3, D), mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)
    cache = KVCache(4)
    m(torch.zeros(1, 3, D), is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="needs capacity >= 5"):
        m(torch.zeros(1, 2, D), is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="do not fit this cache"):
        m(torch.zeros(2, 1, D), is_causal=True, cache=cache)


def test_the_cache_is_chapter_9s():
    "One cache class in the book: chapter 15 imports chapter 9's KVCache, and the head split of chapter 4."
    import transformer.modern.gqa as gqa
    from transformer.engine.fast import KVCache as chapter_9_cache
    from transformer.heads import split_heads
    assert KVCache is chapter_9_cache and gqa.split_heads is split_heads
    assert not hasattr(gqa, "_heads")
