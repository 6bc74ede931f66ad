"""Chapter 17: RMSNorm equals torch.nn.RMSNorm, SwiGLU computes its equation, the widths and
parameter counts are Llama's, and bad inputs are refused."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer.modern.rmsnorm_swiglu import RMSNorm, SwiGLU, swiglu_d_ff


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_rmsnorm_equals_torch_rmsnorm(eps, scale):
    torch.manual_seed(0)
    ours = RMSNorm(40, eps=eps).double()
    with torch.no_grad():
        ours.weight.copy_(torch.randn(40))
    ref = nn.RMSNorm(40, eps=eps).double()
    ref.load_state_dict(ours.state_dict())
    x = scale * torch.randn(3, 5, 40, dtype=torch.float64)
    assert torch.allclose(ours(x), ref(x), atol=1e-12, rtol=1e-12)


def test_rmsnorm_scale_invariant_shift_sensitive_and_layernorm_on_mean_zero():
    torch.manual_seed(1)
    x = torch.randn(6, 32, dtype=torch.float64)
    rms, ln = RMSNorm(32, eps=1e-12).double(), nn.LayerNorm(32, eps=1e-12).double()
    assert torch.allclose(rms(5.0 * x), rms(x), atol=1e-10)
    assert not torch.allclose(rms(x + 1.0), rms(x), atol=1e-2)
    centred = x - x.mean(-1, keepdim=True)
    assert torch.allclose(rms(centred), ln(centred), atol=1e-10)
    y = rms(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(6, dtype=torch.float64), atol=1e-10)


def test_rmsnorm_low_precision_goes_through_float32():
    torch.manual_seed(2)
    norm = RMSNorm(64).bfloat16()            # a model cast to bfloat16: the gain too
    x = (100 * torch.randn(4, 64)).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expect = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(out, expect.bfloat16())


def test_swiglu_is_its_equation_and_has_no_biases():
    torch.manual_seed(3)
    ffn = SwiGLU(16, 24).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    expect = (F.silu(x @ ffn.w_1.weight.T) * (x @ ffn.v.weight.T)) @ ffn.w_2.weight.T
    assert torch.allclose(ffn(x), expect, atol=1e-12)
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 16 * 24
    with_bias = SwiGLU(16, 24, bias=True)
    assert sum(p.numel() for p in with_bias.parameters()) == 3 * 16 * 24 + 2 * 24 + 16


@pytest.mark.parametrize("d_model, multiple_of, d_ff", [
    (4096, 256, 11008),     # Llama 7B
    (5120, 256, 13824),     # Llama 13B
    (512, 256, 1536), (96, 32, 256), (6, 1, 16)])
def test_swiglu_d_ff_is_llamas_rule(d_model, multiple_of, d_ff):
    assert swiglu_d_ff(d_model, multiple_of) == d_ff


@pytest.mark.parametrize("call, message", [
    (lambda: RMSNorm(0), "d_model=0"),
    (lambda: RMSNorm(8, eps=0.0), "eps=0.0 must be a number > 0"),
    (lambda: RMSNorm(8)(torch.zeros(2, 9)), "last dimension must be 8"),
    (lambda: SwiGLU(8, 0), "d_ff=0"),
    (lambda: SwiGLU(8, 16, dropout=-0.1), "dropout=-0.1"),
    (lambda: swiglu_d_ff(4096, multiple_of=0), "multiple_of=0"),
])
def test_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call()
