"""Chapter 16: tiled attention (the online softmax) equals chapter 2's attention, and its
memory does not grow with the square of the length."""
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from transformer.attention import attention
from transformer.modern.flash import peak_tensor_bytes, tiled_attention

# (B, h, T_q, T_k, d_k, d_v, block_q, block_k): tiles that divide the lengths, tiles that
# don't, tiles larger than the input, single-row tiles, T_q != T_k both ways
SHAPES = [
    (1, 1, 1, 1, 4, 4, 128, 128),
    (2, 3, 17, 23, 8, 5, 4, 7),
    (2, 2, 32, 32, 16, 16, 8, 8),
    (3, 1, 10, 40, 8, 8, 3, 16),
    (2, 4, 40, 10, 8, 3, 16, 3),
    (1, 2, 9, 9, 6, 6, 1, 1),
    (2, 2, 33, 31, 4, 12, 32, 5),
]
MASKS = ["none", "random", "padding", "rows_blind"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(shape, dtype, seed=0):
    B, h, T_q, T_k, d_k, d_v, _, _ = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, T_q, d_k, generator=g, dtype=dtype)
    k = torch.randn(B, h, T_k, d_k, generator=g, dtype=dtype)
    v = torch.randn(B, h, T_k, d_v, generator=g, dtype=dtype)
    return q, k, v, g


def _mask(kind, shape, g):
    B, _, T_q, T_k = shape[:4]
    if kind == "none":
        return None
    if kind == "padding":
        return torch.rand(B, 1, 1, T_k, generator=g) > 0.3
    mask = torch.rand(B, 1, T_q, T_k, generator=g) > 0.5
    if kind == "rows_blind":
        mask[:, :, ::3] = False                           # every third query sees no key
    return mask


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_tiled_equals_attention(shape, kind, dtype, tol):
    q, k, v, g = _inputs(shape, dtype)
    mask = _mask(kind, shape, g)
    ref, _ = attention(q, k, v, mask)
    out = tiled_attention(q, k, v, mask, block_q=shape[6], block_k=shape[7])
    assert out.shape == ref.shape and out.dtype == dtype
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_equals_the_written_out_triangle_and_pytorch(shape):
    q, k, v, _ = _inputs(shape, torch.float64)
    T_q, T_k = shape[2], shape[3]
    out = tiled_attention(q, k, v, is_causal=True, block_q=shape[6], block_k=shape[7])
    ref, _ = attention(q, k, v, torch.ones(T_q, T_k, dtype=torch.bool).tril())
    assert (out - ref).abs().max().item() < 1e-12
    # PyTorch's own causal flag is aligned the same way (query i sees keys 0..i)
    if shape[4] == shape[5]:
        torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert (out - torch_out).abs().max().item() < 1e-12


def test_causal_never_looks_ahead():
    "Changing a future key or value leaves earlier outputs unchanged."
    q, k, v, _ = _inputs((1, 2, 12, 12, 8, 8, 5, 5), torch.float64)
    out = tiled_attention(q, k, v, is_causal=True, block_q=5, block_k=5)
    k2, v2 = k.clone(), v.clone()
    k2[..., 7:, :] += 10.0
    v2[..., 7:, :] -= 3.0
    out2 = tiled_attention(q, k2, v2, is_causal=True, block_q=5, block_k=5)
    assert torch.equal(out[..., :7, :], out2[..., :7, :])
    assert not torch.allclose(out[..., 7:, :], out2[..., 7:, :])


def test_fully_masked_rows_give_zeros_like_chapter_2():
    q, k, v, g = _inputs((2, 3, 9, 11, 8, 8, 4, 3), torch.float64)
    mask = torch.rand(2, 1, 9, 11, generator=g) > 0.5
    mask[1, :, 2] = False
    mask[0, :, 8] = False
    out, lse = tiled_attention(q, k, v, mask, block_q=4, block_k=3, return_lse=True)
    ref, _ = attention(q, k, v, mask)
    assert out.isfinite().all() and (out[1, :, 2] == 0).all() and (out[0, :, 8] == 0).all()
    assert (out - ref).abs().max() < 1e-12
    assert lse[1, :, 2].eq(float("-inf")).all()
    everything_masked = torch.zeros(9, 11, dtype=torch.bool)
    assert (tiled_attention(q, k, v, everything_masked) == 0).all()


def test_no_keys_at_all():
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 0, 8), torch.randn(2, 0, 3)
    out = tiled_attention(q, k, v)
    assert out.shape == (2, 5, 3) and (out == 0).all()
    assert attention(q, k, v)[0].shape == out.shape


def test_log_sum_exp_is_the_rows_logsumexp():
    q, k, v, g = _inputs((2, 2, 13, 17, 8, 8, 5, 4), torch.float64)
    mask = _mask("random", (2, 2, 13, 17), g)
    mask[..., 0] = True
    _, lse = tiled_attention(q, k, v, mask, block_q=5, block_k=4, return_lse=True)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    assert lse.shape == (2, 2, 13) and torch.allclose(lse, scores.logsumexp(-1), atol=1e-12)


def test_batch_dimensions_broadcast_as_in_chapter_2():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)
    k = torch.randn(9, 8, generator=g, dtype=torch.float64)            # shared by all
    v = torch.randn(1, 3, 9, 4, generator=g, dtype=torch.float64)      # per head
    out = tiled_attention(q, k, v, block_q=2, block_k=4)
    assert out.shape == (2, 3, 9, 4)
    assert (out - attention(q, k, v)[0]).abs().max() < 1e-12
    # queries without batch dimensions, values with them
    q1 = torch.randn(9, 8, generator=g, dtype=torch.float64)
    v2 = torch.randn(2, 9, 4, generator=g, dtype=torch.float64)
    assert (tiled_attention(q1, k, v2, block_q=4, block_k=2) - attention(q1, k, v2)[0]
            ).abs().max() < 1e-12


def test_low_precision_is_accumulated_in_float32():
    q, k, v, _ = _inputs((2, 4, 50, 50, 16, 16, 16, 16), torch.float32)
    for low in (torch.bfloat16, torch.float16):
        ql, kl, vl = q.to(low), k.to(low), v.to(low)
        out = tiled_attention(ql, kl, vl, block_q=16, block_k=16)
        ref = attention(ql.float(), kl.float(), vl.float())[0]
        assert out.dtype == low
        # one rounding of the output to the low precision, no more
        eps = torch.finfo(low).eps
        assert (out.float() - ref).abs().max() <= 2 * ref.abs().max() * eps


def test_autograd_gives_chapter_2s_gradients():
    q, k, v, g = _inputs((2, 2, 13, 11, 8, 8, 4, 5), torch.float64)
    mask = torch.rand(2, 1, 13, 11, generator=g) > 0.3
    mask[..., 0] = True
    grads = []
    for fn in (lambda a, b, c: attention(a, b, c, mask)[0],
               lambda a, b, c: tiled_attention(a, b, c, mask, block_q=4, block_k=5)):
        a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
        fn(a, b, c).square().sum().backward()
        grads.append([a.grad, b.grad, c.grad])
    for ours, ref in zip(*grads[::-1], strict=True):
        assert (ours - ref).abs().max() < 1e-12
    # and no NaN gradient through a fully masked row
    mask[0, :, 3] = False
    a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
    tiled_attention(a, b, c, mask, block_q=4, block_k=5).square().sum().backward()
    assert all(t.grad.isfinite().all() for t in (a, b, c))


@pytest.mark.slow
def test_plain_peak_is_two_score_matrices_and_tiled_peak_does_not_grow():
    B, h, d, tile = 1, 2, 16, 32
    plain, tiled = {}, {}
    for T in (64, 128, 256):
        q, k, v = (torch.randn(B, h, T, d) for _ in range(3))
        output = B * h * T * d * 4
        plain[T] = peak_tensor_bytes(partial(attention, q, k, v)) - output
        tiled[T] = peak_tensor_bytes(
            partial(tiled_attention, q, k, v, block_q=tile, block_k=tile)) - output
        assert plain[T] == 2 * B * h * T * T * 4
    assert plain[256] == 4 * plain[128] == 16 * plain[64]
    assert tiled[64] == tiled[128] == tiled[256] < B * h * tile * tile * 4 * 8


def test_peak_tensor_bytes_counts_what_is_alive_at_once():
    x = torch.randn(100)
    assert peak_tensor_bytes(lambda: torch.empty(1000)) == 4000
    assert peak_tensor_bytes(lambda: x[10:20].view(2, 5)) == 0     # views of an input: free

    def one_after_the_other():
        a = torch.zeros(1000)
        del a
        return torch.zeros(1000, dtype=torch.float64)

    def both_alive():
        a = torch.zeros(1000)
        b = torch.zeros(1000, dtype=torch.float64)
        return a, b

    assert peak_tensor_bytes(one_after_the_other) == 8000
    assert peak_tensor_bytes(both_alive) == 12000
    assert peak_tensor_bytes(lambda: torch.zeros(1000)[::2].clone()) == 6000


# the tiles' own checks; shapes are trusted, as chapter 2's attention trusts them
BAD = [
    (dict(mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True), ValueError, "not both"),
    (dict(block_q=0), ValueError, "block_q=0 must be a positive int"),
    (dict(block_k=-3), ValueError, "block_k=-3"),
    (dict(block_k=True), ValueError, "block_k=True"),
    (dict(block_q=2.5), ValueError, "block_q=2.5"),
    (dict(key=torch.randn(2, 5, 8).double()), TypeError, "share one dtype"),
    (dict(query=torch.ones(2, 5, 8, dtype=torch.long)), TypeError, "floating-point"),
]


@pytest.mark.parametrize("bad,error,message", BAD)
def test_bad_inputs_say_what_is_wrong(bad, error, message):
    args = dict(query=torch.randn(2, 5, 8), key=torch.randn(2, 5, 8),
                value=torch.randn(2, 5, 8)) | bad
    with pytest.raises(error, match=message):
        tiled_attention(**args)
