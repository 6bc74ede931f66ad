"""Appendix D's fast paths (transformer.engine.fast): the cheaper CPU dropout mask and its module,
`float32_attention` (CPU low precision through the float32 kernel), and `speed_up`, which swaps
both into a model without changing the function it computes; and the loss on the real positions in one
pass (`fused_smoothed_cross_entropy`, `FastSeq2SeqLoss`), equal to chapter 8's."""
import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer.attention import scaled_dot_product_attention
from transformer.blocks import DecoderLayer, EncoderLayer
from transformer.engine.fast import (
    Dropout,
    FastSeq2SeqLoss,
    Float32Attention,
    dropout_mask,
    float32_attention,
    fused_smoothed_cross_entropy,
    speed_up,
)
from transformer.heads import MultiHeadAttention
from transformer.model import Transformer, TransformerConfig
from transformer.tokens import BOS, PAD
from transformer.training import Seq2SeqLoss, label_smoothed_nll

D, H, D_FF, V = 32, 4, 64, 40
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(B=2, h=3, T_q=6, T_k=6, d_k=8, d_v=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, T_q, d_k, generator=g, dtype=dtype),
            torch.randn(B, h, T_k, d_k, generator=g, dtype=dtype),
            torch.randn(B, h, T_k, d_v, generator=g, dtype=dtype))


def tiny(dropout=0.1, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(src_vocab=V, tgt_vocab=V, d_model=D, d_ff=D_FF, h=H, n_layers=2, dropout=dropout, max_len=20,
               attention_dropout=0.05, ffn_dropout=0.2)
    return Transformer(TransformerConfig(**{**cfg, **kw}))


def batch(B=3, S=8, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(4, V, (B, S), generator=g), torch.randint(4, V, (B, T), generator=g)
    src[1, 5:] = 0
    tgt[2, 4:] = 0
    return src, tgt


# ---- the dropout mask and the module ------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_mask_drops_the_rounded_p_and_keeps_the_mean(p):
    torch.manual_seed(0)
    m = dropout_mask(torch.empty(2000, 1000, dtype=F64), p)
    p_rounded = round(p * 2**15) / 2**15
    share = (m == 0).double().mean().item()
    assert abs(share - p_rounded) < 5 * (p_rounded * (1 - p_rounded) / m.numel()) ** 0.5
    assert set(m.unique().tolist()) == {0.0, 1 / (1 - p_rounded)}
    assert abs(m.mean().item() - 1) < 0.005


def test_dropout_mask_odd_sizes_and_dtype():
    for shape in [(1,), (3, 5), (7, 1, 3)]:                      # not a multiple of 4 entries
        for dtype in (torch.bfloat16, F64):                        # the dtype of `like`
            m = dropout_mask(torch.empty(shape, dtype=dtype), 0.5)
            assert m.shape == shape and m.dtype == dtype


def test_dropout_masks_are_independent_across_positions():
    "Neighbouring entries come from the same 64-bit draw: they must still be uncorrelated."
    torch.manual_seed(1)
    m = (dropout_mask(torch.empty(400_000, dtype=F64), 0.5) > 0).double()
    for lag in (1, 2, 3, 4):
        corr = torch.corrcoef(torch.stack([m[:-lag], m[lag:]]))[0, 1].item()
        assert abs(corr) < 0.01, (lag, corr)


def test_dropout_module_forward_gradient_and_eval():
    drop = Dropout(0.2).train()
    assert isinstance(drop, nn.Dropout) and drop.p == 0.2
    x = torch.randn(300, 200, dtype=F64, requires_grad=True)
    torch.manual_seed(5)
    out = drop(x)
    torch.manual_seed(5)
    mask = dropout_mask(x, 0.2)
    assert torch.equal(out, x * mask)
    out.sum().backward()
    assert torch.equal(x.grad, mask)
    drop.eval()
    assert drop(x) is x
    assert Dropout(0.0).train()(x) is x


@pytest.mark.slow
def test_dropout_under_torch_compile_traces_pytorchs_dropout():
    "Inside a compiled graph the module takes F.dropout (the compiler fuses it); the result is still dropout."
    drop = Dropout(0.5).train()
    compiled = torch.compile(drop, backend="eager", fullgraph=True)
    out = compiled(torch.ones(200, 100))
    assert set(out.unique().tolist()) == {0.0, 2.0} and abs((out == 0).float().mean().item() - 0.5) < 0.02


def test_sped_up_layers_drop_out_reproducibly_in_training_only():
    "In training a sped-up layer's output is random (dropout), and reproducible from the seed; in eval it is not."
    for layer, args in ((EncoderLayer(D, H, D_FF, dropout=0.3, norm_first=True), (torch.randn(2, 5, D),)),
                        (DecoderLayer(D, H, D_FF, dropout=0.3), (torch.randn(2, 5, D), torch.randn(2, 4, D)))):
        speed_up(layer)
        assert all(isinstance(getattr(layer, f"dropout{k}"), Dropout) for k in (1, 2))
        layer.train()
        torch.manual_seed(0); a = layer(*args)
        torch.manual_seed(0); b = layer(*args)
        torch.manual_seed(1); c = layer(*args)
        assert torch.equal(a, b) and not torch.equal(a, c)
        layer.eval()
        assert torch.equal(layer(*args), layer(*args))


# ---- float32_attention: on a CPU, low precision through the float32 kernel ---------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_cpu_attention_runs_in_float32(dtype, causal):
    q, k, v = (t.to(dtype) for t in qkv())
    mask = None if causal else torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(3)) > 0.4
    out, w = float32_attention(q, k, v, mask, is_causal=causal)
    assert out.dtype == dtype and w is None
    want, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, is_causal=causal)
    assert torch.equal(out, want.to(dtype))                          # the float32 kernel, one rounding at the end
    exact, _ = scaled_dot_product_attention(q.double(), k.double(), v.double(), mask, is_causal=causal)
    theirs, _ = scaled_dot_product_attention(q, k, v, mask, is_causal=causal)     # PyTorch's low-precision kernel
    ours_err, theirs_err = (out.double() - exact).abs().max(), (theirs.double() - exact).abs().max()
    assert ours_err <= 2**-7 * exact.abs().max() and ours_err <= theirs_err
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    float32_attention(*leaves, mask, is_causal=causal)[0].float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in leaves)


def test_autocast_cpu_attention_is_computed_in_float32():
    "Under CPU autocast PyTorch would cast float32 inputs to bf16; float32_attention keeps them, returns bf16."
    q, k, v = (t.float() for t in qkv())
    exact, _ = scaled_dot_product_attention(q.double(), k.double(), v.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = float32_attention(q, k, v)
        theirs = F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(out, scaled_dot_product_attention(q, k, v)[0].to(torch.bfloat16))
    assert (out.double() - exact).abs().max() <= 2**-7 * exact.abs().max()               # one bf16 rounding


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_float32_attention_is_chapter_3s_function_elsewhere(need_weights, dtype):
    "Full precision, or weights asked for: exactly `scaled_dot_product_attention`."
    q, k, v = qkv(dtype=dtype)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    for args, kwargs in (((q, k, v, mask), {}), ((q, k, v), dict(is_causal=True))):
        a = float32_attention(*args, need_weights=need_weights, **kwargs)
        b = scaled_dot_product_attention(*args, need_weights=need_weights, **kwargs)
        assert torch.equal(a[0], b[0]) and (a[1] is b[1] is None or torch.equal(a[1], b[1]))
    out, w = float32_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), need_weights=True)
    assert out.dtype == w.dtype == torch.bfloat16                    # weights: the teaching path, as asked


# ---- speed_up --------------------------------------------------------------------------------------------------

def dropouts(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Dropout)}


def test_speed_up_leaves_eval_logits_bit_identical():
    model = tiny().eval()
    src, tgt = batch()
    with torch.no_grad():
        before, memory = model(src, tgt), model.encode(src)
        assert speed_up(model) is model
        assert torch.equal(model(src, tgt), before) and torch.equal(model.encode(src), memory)


def test_speed_up_swaps_every_dropout_keeping_p_and_mode():
    model = tiny().train()
    model.decoder.layers[1].eval()                                   # a mixed model: each module keeps its mode
    before = {name: (m.p, m.training) for name, m in dropouts(model).items()}
    assert before and all(type(m) is nn.Dropout for m in dropouts(model).values())
    assert {p for p, _ in before.values()} == {0.1, 0.2} and {t for _, t in before.values()} == {True, False}
    keys = list(model.state_dict())
    speed_up(model)
    after = dropouts(model)
    assert after.keys() == before.keys()
    assert all(type(m) is Dropout for m in after.values())
    assert {name: (m.p, m.training) for name, m in after.items()} == before
    assert list(model.state_dict()) == keys                         # a checkpoint loads either way


def test_speed_up_sets_float32_attention_on_every_attention():
    model = tiny()
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert len(attentions) == 6 and all(type(m) is MultiHeadAttention for m in attentions)
    params = [p for m in attentions for p in m.parameters()]
    speed_up(model)
    assert all(type(m) is Float32Attention for m in attentions)       # the same modules, their class swapped
    assert [p for m in attentions for p in m.parameters()] == params   # the very same parameters
    assert type(MultiHeadAttention(D, H)) is MultiHeadAttention


def test_sped_up_model_attends_in_float32_under_autocast(monkeypatch):
    "Under CPU bfloat16 autocast each attention of a sped-up model runs PyTorch's kernel on float32, autocast off."
    calls = []
    kernel = F.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        calls.append((query.dtype, torch.is_autocast_enabled("cpu")))
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    src, tgt = batch()
    plain, fast = tiny().eval(), speed_up(tiny().eval())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(src, tgt)
        assert len(calls) == 6 and all(enabled for _, enabled in calls)             # PyTorch's bf16 kernel
        calls.clear()
        got = fast(src, tgt)
    assert calls == [(torch.float32, False)] * 6                                    # the float32 kernel
    assert got.dtype == want.dtype == torch.bfloat16
    with torch.no_grad():
        exact = tiny().double().eval()(src, tgt)
    real = tgt != 0
    assert (got.double() - exact)[real].abs().max() < 0.1 * exact.abs().max()       # still the same function


def test_speed_up_is_idempotent():
    model = speed_up(tiny().train())
    modules = dict(model.named_modules())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert speed_up(model) is model
    assert dict(model.named_modules()) == modules                    # the very same modules: nothing swapped again
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(type(m) is Float32Attention for m in model.modules() if isinstance(m, MultiHeadAttention))
    model.eval()
    src, tgt = batch()
    with torch.no_grad():
        assert torch.equal(model(src, tgt), speed_up(model)(src, tgt))


# ---- the loss on the real positions, in one pass (chapter 8's loss, appendix D.2) ------------------------------

def teaching(hidden, generator, target, eps):
    return label_smoothed_nll(generator(hidden), target, eps, pad_id=-100)       # no padding among the targets


def loss_and_grads(fn, hidden, generator, target, eps=0.1):
    "Loss, NLL, and the gradients of 0.37 * loss for the hidden states and the generator's weights."
    hidden = hidden.detach().clone().requires_grad_(True)
    generator.zero_grad()
    loss, nll = fn(hidden, generator, target, eps)
    (0.37 * loss).backward()
    return [loss.detach(), nll.detach(), hidden.grad, *(p.grad.clone() for p in generator.parameters())]


@pytest.mark.parametrize("n,V", [(1, 5), (7, 300), (1100, 2000)])      # one block, one block, several blocks
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_loss_equals_chapter_8s(n, V, eps, bias):
    g = torch.Generator().manual_seed(n + V)
    generator = nn.Linear(16, V, bias=bias).double()
    with torch.no_grad():
        generator.weight.normal_(0, 1, generator=g)
    hidden = torch.randn(n, 16, generator=g, dtype=F64)
    target = torch.randint(0, V, (n,), generator=g)
    for a, b in zip(loss_and_grads(teaching, hidden, generator, target, eps),
                    loss_and_grads(fused_smoothed_cross_entropy, hidden, generator, target, eps), strict=True):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-13)


def test_fused_loss_under_bf16_autocast_and_no_grad_fallback():
    "Under CPU bfloat16 autocast both compute the logits in bfloat16; the gradients agree within its rounding."
    torch.manual_seed(0)
    generator, hidden, target = nn.Linear(32, 40), torch.randn(50, 32), torch.randint(0, 40, (50,))
    with torch.autocast("cpu", torch.bfloat16):
        plain = loss_and_grads(teaching, hidden, generator, target)
        fused = loss_and_grads(fused_smoothed_cross_entropy, hidden, generator, target)
    assert fused[0].dtype == fused[1].dtype == torch.float32 and not fused[1].requires_grad
    assert all(a.dtype == b.dtype for a, b in zip(plain, fused))       # float32 gradients, as autograd gives
    assert torch.allclose(plain[0], fused[0], rtol=1e-5) and torch.allclose(plain[1], fused[1], rtol=1e-5)
    for a, b in zip(plain[2:], fused[2:]):
        assert (a - b).abs().max() <= 2 ** -7 * a.abs().max()          # one bfloat16 rounding
    with torch.no_grad():                                               # evaluation: chapter 8's code, same numbers
        a = fused_smoothed_cross_entropy(hidden, generator, target)
        b = teaching(hidden, generator, target, 0.1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_fused_loss_refuses_a_second_backward():
    hidden = torch.randn(4, 8, requires_grad=True)
    loss, _ = fused_smoothed_cross_entropy(hidden, nn.Linear(8, 9), torch.tensor([1, 2, 3, 4]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("padded", [True, False])
def test_fast_seq2seq_loss_equals_seq2seq_loss(padded):
    "Loss, NLL and every weight's gradient, float64, dropout off; with and without padding."
    model = tiny(dropout=0.0, attention_dropout=0.0, ffn_dropout=0.0).double()
    src, tgt = batch()
    if not padded:
        src, tgt = src.clamp(min=4), tgt.clamp(min=4)
    results = []
    for criterion in (Seq2SeqLoss(model, 0.1), FastSeq2SeqLoss(speed_up(model), 0.1)):
        model.zero_grad()
        loss, nll = criterion(src, tgt)
        loss.backward()
        results.append((loss.detach(), nll.detach(), [p.grad.clone() for p in model.parameters()]))
    (l1, n1, g1), (l2, n2, g2) = results
    assert torch.allclose(l1, l2, rtol=1e-12) and torch.allclose(n1, n2, rtol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(g1, g2))


def test_fast_seq2seq_loss_keeps_the_state_dict_and_evaluates_the_same():
    model = tiny().eval()
    src, tgt = batch()
    fast = FastSeq2SeqLoss(model, 0.1)
    assert fast.state_dict().keys() == Seq2SeqLoss(model, 0.1).state_dict().keys()
    with torch.no_grad():
        a, b = fast(src, tgt), Seq2SeqLoss(model, 0.1)(src, tgt)
    assert torch.allclose(a[0], b[0], rtol=1e-5) and torch.allclose(a[1], b[1], rtol=1e-5)


def _ops(model, src, tgt) -> tuple[int, int]:
    "(matrix products, all ops) that one training step of `FastSeq2SeqLoss(model)` runs, forward and backward."
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.products = self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.products += func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm)
            return func(*args, **(kwargs or {}))

    loss_fn = FastSeq2SeqLoss(model, 0.1)
    with Count() as count:
        loss, _ = loss_fn(src, tgt)
        loss.backward()
    return count.products, count.ops


@pytest.mark.parametrize("norm_first", [False, True])
def test_w_q_w_k_w_v_are_one_product_where_they_read_one_input(monkeypatch, norm_first):
    """The sped-up attention computes W^Q, W^K, W^V as one matrix product in self-attention and W^K, W^V as one in
    cross-attention: k products of one input become one, in the forward pass and in each of the backward pass's two
    (the input's gradient, the weight's), so 3 (k - 1) products fewer: 6 per self-attention, 3 per cross-attention,
    with fewer ops in all; the loss and every gradient are the same (float64). The count is the budget: it cannot
    depend on the machine."""
    import transformer.engine.fast as fast
    config = TransformerConfig(src_vocab=40, tgt_vocab=40, d_model=32, d_ff=64, h=4, n_layers=2, dropout=0.0,
                               norm_first=norm_first)
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)
    runs = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:                        # the three products one by one, as chapter 4 writes them
                m.setattr(fast, "_fused", lambda linears, x: [w(x) for w in linears])
            torch.manual_seed(0)
            model = speed_up(Transformer(config).double())
            products, ops = _ops(model, src, tgt)
            loss, _ = FastSeq2SeqLoss(model, 0.1)(src, tgt)
            loss.backward()
            runs[fused] = products, ops, loss.detach(), [p.grad for p in model.parameters()]
    n_self, n_cross = 2 * config.n_layers, config.n_layers
    saved = 3 * (3 - 1) * n_self + 3 * (2 - 1) * n_cross
    assert runs[False][0] - runs[True][0] == saved, (runs[False][:2], runs[True][:2])
    assert runs[True][1] < runs[False][1]
    assert torch.allclose(runs[True][2], runs[False][2], rtol=1e-12, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(runs[True][3], runs[False][3], strict=True))


# ---- training: no fix-up of the queries that see no key (issue 44) --------------------------------------------

# ops of one training step (forward and backward) of the sped-up test model below on a padded batch, post-LN and
# pre-LN: a budget that may only go down. It was 722 / 730 with chapter 3's fix-up of blind rows in each of the 4
# masked attention calls: per call `any`, `~`, `|`, the output's fill and its gradient's, and the copy that
# `merge_heads` then made of the filled output (7 ops; 1 view back). A count, not a time: the same on every machine.
STEP_OPS = {False: 698, True: 706}


def _op_counts(model, src, tgt) -> Counter:
    "The ops (by name) that one training step of `FastSeq2SeqLoss(model)` runs, forward and backward."
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        loss, _ = FastSeq2SeqLoss(model, 0.1)(src, tgt)
        loss.backward()
    return count.ops


def _fix_up(m):
    "The training path as it was: chapter 3's function, blind-row fix-up included, for every masked call."
    import transformer.engine.fast as fast
    m.setattr(fast, "_no_blind_rows", scaled_dot_product_attention)


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_training_step_runs_no_blind_row_fix_up(monkeypatch, norm_first):
    """In training the sped-up attention hands its mask to PyTorch's kernel as it is: per masked call (each encoder
    self-attention and each cross-attention; the decoder's self-attention gets the causal flag, no mask) no `any` over
    the mask, no `~`, no `|`, and no fill of the output nor of its gradient. The step's count is `STEP_OPS`."""
    config = TransformerConfig(src_vocab=40, tgt_vocab=40, d_model=32, d_ff=64, h=4, n_layers=2, dropout=0.0,
                               norm_first=norm_first)
    src, tgt = batch(S=7)                                            # padded: src[1, 5:], tgt[2, 4:]
    counts = {}
    for fix_up in (True, False):
        with monkeypatch.context() as m:
            if fix_up:
                _fix_up(m)
            torch.manual_seed(0)
            counts[fix_up] = _op_counts(speed_up(Transformer(config).double()).train(), src, tgt)
    masked_calls = 2 * config.n_layers
    for op in ("aten.any", "aten.bitwise_not", "aten.bitwise_or"):
        assert (counts[True][op], counts[False][op]) == (masked_calls, 0), op
    assert counts[True]["aten.masked_fill"] - counts[False]["aten.masked_fill"] == 2 * masked_calls  # fwd and bwd
    assert counts[True]["aten.clone"] - counts[False]["aten.clone"] == masked_calls   # merge_heads' copy of the fill
    total = {fix_up: sum(c.values()) for fix_up, c in counts.items()}
    assert total[False] < total[True]
    assert total[False] <= STEP_OPS[norm_first], f"{total[False]} ops per step, over the budget {STEP_OPS[norm_first]}"


def _decoder_only(arch):
    from transformer.modern.gpt import DecoderOnly, DecoderOnlyConfig
    return DecoderOnly(DecoderOnlyConfig(src_vocab=V, tgt_vocab=V, d_model=D, d_ff=D_FF, h=H, n_layers=2,
                                         dropout=0.1, max_len=20, arch=arch))


@pytest.mark.parametrize("arch", ["encoder-decoder", "decoder-only", "prefix-lm"])
def test_training_without_the_fix_up_is_the_same_function(monkeypatch, arch):
    """A padded training batch in float64, dropout on (the same random draws): the loss, the NLL and every gradient
    are the same bit for bit with and without chapter 3's fix-up, since no query of a training batch is blind."""
    src, tgt = batch()
    runs = []
    for fix_up in (True, False):
        with monkeypatch.context() as m:
            if fix_up:
                _fix_up(m)
            torch.manual_seed(0)
            model = speed_up((tiny() if arch == "encoder-decoder" else _decoder_only(arch)).double().train())
            torch.manual_seed(1)
            loss, nll = FastSeq2SeqLoss(model, 0.1)(src, tgt)
            loss.backward()
            runs.append((loss.detach(), nll, [p.grad for p in model.parameters()]))
    (l1, n1, g1), (l2, n2, g2) = runs
    assert torch.equal(l1, l2) and torch.equal(n1, n2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_no_query_of_a_training_batch_is_blind(monkeypatch):
    """Why the fix-up can go: chapter 8's `make_examples` (as appendix A.1's `prepare` and E.2's `SubwordDropout`)
    writes `(x EOS, BOS y EOS)`, so even an empty sentence holds a token that is not PAD; the encoder and the
    cross-attention are masked by the source's padding, the decoder by the causal flag (chapter 19.1: causal and
    padding over one packed sequence whose first position is a real token). Every mask that reaches the kernel
    without the fix-up, in a training step on padded batches with empty sentences, lets every query see a key."""
    from pathlib import Path

    import transformer.engine.fast as fast
    from transformer.modern.gpt import DecoderOnly, DecoderOnlyConfig
    from transformer.tokens import Tokenizer
    from transformer.training import collate, make_examples
    tokenizer = Tokenizer.load(Path(__file__).resolve().parents[1] / "book" / "model" / "tokenizer.model")
    pairs = [("", ""), ("Ein Hund rennt.", ""), ("", "A dog runs."),
             ("Zwei Männer spielen Fußball auf einer Wiese.", "Two men play football on a meadow.")]
    examples = make_examples(tokenizer, pairs)
    assert all(PAD not in s and s and t[0] == BOS for s, t in examples)
    src, tgt = collate(examples, range(len(examples)))
    assert (src == PAD).any() and (tgt == PAD).any()                 # padded on both sides
    seen, kernel = [], fast._no_blind_rows

    def spy(query, key, value, mask=None, *args, **kwargs):
        seen.append(mask)
        return kernel(query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(fast, "_no_blind_rows", spy)
    for arch in ("encoder-decoder", "decoder-only", "prefix-lm"):
        torch.manual_seed(0)
        config = dict(src_vocab=8000, tgt_vocab=8000, d_model=16, d_ff=32, h=2, n_layers=1, max_len=32)
        model = (Transformer(TransformerConfig(**config)) if arch == "encoder-decoder" else
                 DecoderOnly(DecoderOnlyConfig(**config, arch=arch)))
        seen.clear()
        FastSeq2SeqLoss(speed_up(model).train(), 0.1)(src, tgt)[0].backward()
        masks = [m for m in seen if m is not None]
        assert masks and all(m.any(-1).all() for m in masks), arch


def test_train_refuses_an_example_whose_side_is_empty():
    """The promise above holds for any examples `train` is given, not only the ones `make_examples` writes: a side
    with no token but padding (an empty id list, or PADs only) is refused at the data boundary, before a step."""
    from transformer.engine.loop import check_examples
    config = TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=1)
    fine = [([5, 3], [BOS, 6, 3])]
    check_examples(fine, config, "train_examples")                      # no error
    for bad in ([], [PAD, PAD]):
        with pytest.raises(ValueError, match=r"train_examples\[1\]: the source holds no token but padding"):
            check_examples([*fine, (bad, [BOS, 6, 3])], config, "train_examples")
    for bad in ([], [PAD]):
        with pytest.raises(ValueError, match=r"val_examples\[0\]: the target holds no token but padding"):
            check_examples([([5, 3], bad)], config, "val_examples")


def test_outside_training_the_sped_up_attention_keeps_chapter_3s_contract(monkeypatch):
    """Evaluation, or `float32_attention` called as chapter 3's function (`blind_rows=True`, the default): a query
    that sees no key gets zeros, never NaN, exactly as chapter 4's `MultiHeadAttention` gives it, through chapter
    3's fix-up (PyTorch 2.13's CPU kernel gives such a row zeros by itself, not every kernel: the spy tells)."""
    import transformer.engine.fast as fast_module

    def refused(*args, **kwargs):
        raise AssertionError("the kernel without the fix-up, outside training")

    monkeypatch.setattr(fast_module, "_no_blind_rows", refused)
    q, k, v = qkv()
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[0, 0, 2] = False                                            # query 2 of row 0 sees no key
    out, _ = float32_attention(q, k, v, mask)
    assert torch.equal(out, scaled_dot_product_attention(q, k, v, mask)[0]) and (out[0, :, 2] == 0).all()
    torch.manual_seed(0)
    plain = MultiHeadAttention(D, H, dropout=0.1).double().eval()
    fast = speed_up(copy.deepcopy(plain))
    x = torch.randn(2, 6, D, dtype=F64)
    assert torch.equal(fast(x, x, x, mask)[0], plain(x, x, x, mask)[0])
    assert not fast(x, x, x, mask)[0].isnan().any()
