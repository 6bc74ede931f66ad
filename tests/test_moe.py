"""Chapter 18: the mixture-of-experts feed-forward layer and the Switch load-balancing
loss."""

from itertools import pairwise

import pytest
import torch

from transformer.blocks import FeedForward
from transformer.modern.moe import MoEFeedForward, load_balancing_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def per_token(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    "Equation (18.2) written as a loop over tokens: the reference."
    rows = []
    for token in x.reshape(-1, moe.d_model):
        p = moe.router(token).softmax(dim=-1)
        top = p.topk(moe.k)
        g = top.values / top.values.sum() if moe.renormalize else top.values
        rows.append(sum(g_i * moe.experts[i](token)
                        for g_i, i in zip(g, top.indices.tolist(), strict=True)))
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_expert_is_exactly_the_dense_feed_forward(dtype, renormalize):
    torch.manual_seed(0)
    dense = FeedForward(24, 48).to(dtype)
    moe = MoEFeedForward(24, 48, n_experts=1, k=1, renormalize=renormalize).to(dtype)
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 11, 24, dtype=dtype)
    assert torch.equal(moe(x), dense(x))
    assert moe.aux_loss.item() == pytest.approx(1.0)
    assert moe.tokens_per_expert.tolist() == [33]


@pytest.mark.parametrize("n_experts,k,renormalize", [
    (2, 1, False), (2, 1, True), (2, 2, True), (4, 2, True), (8, 1, False), (8, 3, True),
    (8, 8, True), (16, 4, False)])
@pytest.mark.parametrize("shape", [(13, 16), (2, 7, 16), (16,)])
def test_routed_equals_per_token_loop(n_experts, k, renormalize, shape):
    torch.manual_seed(n_experts * 10 + k)
    moe = MoEFeedForward(16, 32, n_experts, k, renormalize=renormalize).double()
    x = torch.randn(*shape, dtype=torch.float64)
    out = moe(x)
    assert out.shape == x.shape
    assert (out - per_token(moe, x)).abs().max() < 1e-12
    n_tokens = x.numel() // 16
    assert moe.tokens_per_expert.shape == (n_experts,)
    assert moe.tokens_per_expert.sum().item() == n_tokens * k


def test_gradients_equal_the_per_token_loop():
    torch.manual_seed(3)
    moe = MoEFeedForward(8, 16, 4, 2).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    grads = []
    for fn in (moe, lambda t: per_token(moe, t)):
        moe.zero_grad()
        fn(x).square().sum().backward()
        grads.append([p.grad.clone() for p in moe.parameters()])
    for ours, ref in zip(*grads, strict=True):
        assert (ours - ref).abs().max() < 1e-12
    assert grads[0][0].abs().sum() > 0               # the router learns from the task


def test_top1_renormalized_gate_gives_the_router_no_task_gradient():
    """With k = 1 the renormalized gate is always 1: Switch's g = p is needed to train the
    router."""
    torch.manual_seed(4)
    x = torch.randn(20, 8)
    size = {}
    for renormalize in (True, False):
        torch.manual_seed(4)
        moe = MoEFeedForward(8, 16, 4, 1, renormalize=renormalize)
        moe(x).square().sum().backward()
        size[renormalize] = moe.router.weight.grad.abs().sum().item()
    # p / p: zero in exact arithmetic, rounding noise in floats
    assert size[False] > 0.1 and size[True] < 1e-5 * size[False]


def test_renormalized_gates_are_a_softmax_over_the_top_k_scores():
    torch.manual_seed(5)
    moe = MoEFeedForward(8, 16, 8, 3)
    x = torch.randn(50, 8)
    gates, index, probs = moe.route(x)
    top = moe.router(x).topk(3)
    assert torch.allclose(gates, top.values.softmax(-1), atol=1e-6)
    assert torch.equal(index, top.indices) and torch.allclose(probs.sum(-1), torch.ones(50))


def test_aux_loss_is_one_for_uniform_routing_and_grows_with_skew():
    E, N = 8, 64
    certain = torch.full((N, E), -30.0)
    certain[torch.arange(N), torch.arange(N) % E] = 30.0
    p = certain.softmax(-1)
    assert load_balancing_loss(p, p.topk(1).indices).item() == pytest.approx(1.0, abs=1e-6)
    # uniform counts: exactly 1 whatever the probabilities
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        arbitrary = torch.randn(N, E, generator=g).mul(3).softmax(-1)
        index = torch.stack([torch.arange(N) % E, (torch.arange(N) + 3) % E], dim=1)
        assert load_balancing_loss(arbitrary, index).item() == pytest.approx(1.0, abs=1e-6)
    # collapse onto one expert with certainty: E
    one = torch.zeros(N, E)
    one[:, 2] = 1.0
    assert load_balancing_loss(one, torch.full((N, 1), 2)).item() == E
    # a certain router: E * sum f_i^2 >= 1, growing with skew
    losses = []
    for n_busy in (8, 4, 2, 1):
        choice = torch.arange(N) % n_busy
        assert load_balancing_loss(torch.eye(E)[choice], choice[:, None]).item() == \
            pytest.approx(E / n_busy)
        losses.append(E / n_busy)
    # random routers of growing skew
    values = []
    for skew in (0.0, 2.0, 4.0, 8.0):
        probs = (torch.randn(4096, E, generator=g) - skew * torch.arange(E) / E).softmax(-1)
        values.append(load_balancing_loss(probs, probs.topk(2).indices).item())
    assert values[0] < 1.01 and all(a < b for a, b in pairwise(values))


@pytest.mark.slow
def test_aux_loss_is_hugging_face_mixtral_divided_by_k():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    g = torch.Generator().manual_seed(1)
    for E, k in ((8, 2), (4, 1), (16, 4)):
        logits = torch.randn(100, E, generator=g)
        p = logits.softmax(-1)
        ours = load_balancing_loss(p, p.topk(k).indices)
        theirs = mixtral.load_balancing_loss_func((logits,), E, k)
        assert torch.allclose(k * ours, theirs, atol=1e-6)


def test_aux_loss_trains_the_router_only_and_evens_a_skewed_router():
    torch.manual_seed(6)
    moe = MoEFeedForward(8, 16, 4, 1, renormalize=False)
    with torch.no_grad():
        moe.router.weight[0] += 3.0                           # expert 0 wins most tokens
    x = torch.randn(256, 8) + 1.0
    moe(x)
    before = moe.aux_loss.item()
    moe.aux_loss.backward()
    assert all(p.grad is None for p in moe.experts.parameters())
    optimizer = torch.optim.Adam(moe.router.parameters(), lr=0.05)
    for _ in range(100):
        optimizer.zero_grad()
        moe(x)
        moe.aux_loss.backward()
        optimizer.step()
    moe(x)
    assert before > 2.0 and moe.aux_loss.item() < 1.1
    assert (moe.tokens_per_expert > 0).all()


def test_empty_batch():
    moe = MoEFeedForward(8, 16, 4, 2)
    out = moe(torch.randn(0, 5, 8))
    assert out.shape == (0, 5, 8)
    assert moe.aux_loss.item() == 0.0 and moe.tokens_per_expert.tolist() == [0, 0, 0, 0]


def test_bfloat16_autocast_on_cpu():
    torch.manual_seed(7)
    moe = MoEFeedForward(16, 32, 4, 2)
    x = torch.randn(3, 10, 16)
    ref = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.float32 and (out - ref).abs().max() < 0.05


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_experts=2, k=3), "k=3 is larger than n_experts=2"),
    (dict(n_experts=0, k=1), "n_experts=0"),
    (dict(n_experts=4, k=0), "k=0"),
    (dict(n_experts=4, k=1.5), "k=1.5"),
    (dict(n_experts=True, k=1), "n_experts=True"),
    (dict(n_experts=4, k=2, d_model=0), "d_model=0"),
    (dict(n_experts=4, k=2, d_ff=-1), "d_ff=-1"),
])
def test_bad_config_says_what_is_wrong(kwargs, message):
    args = dict(d_model=8, d_ff=16) | kwargs
    with pytest.raises(ValueError, match=message):
        MoEFeedForward(**args)


def test_wrong_input_width():
    with pytest.raises(ValueError, match=r"d_model=8\), got \(2, 3, 7\)"):
        MoEFeedForward(8, 16, 4)(torch.randn(2, 3, 7))


@pytest.mark.parametrize("probs,index,error,message", [
    (torch.rand(6), torch.zeros(6, 1, dtype=torch.long), ValueError, "shape \\(N, E\\)"),
    (torch.rand(6, 4), torch.zeros(5, 1, dtype=torch.long), ValueError, "N=6"),
    (torch.rand(6, 4), torch.zeros(6, dtype=torch.long), ValueError, "N=6"),
    (torch.rand(6, 4), torch.zeros(6, 1), TypeError, "int64"),
    (torch.rand(2, 4), torch.tensor([[0], [4]]), ValueError, "outside the experts 0..3"),
    (torch.rand(2, 4), torch.tensor([[0], [-1]]), ValueError, "outside"),
])
def test_bad_loss_inputs(probs, index, error, message):
    with pytest.raises(error, match=message):
        load_balancing_loss(probs, index)
