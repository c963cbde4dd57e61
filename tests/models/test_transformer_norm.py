"""RMSNorm against transformers' LlamaRMSNorm, bit for bit: greedy output stays token-identical
to transformers only if every norm rounds as theirs does."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dspark.models.transformer import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (64, 576), (3, 5, 64), (2, 9, 7, 64)])
def test_rms_norm_is_llamas_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    size = shape[-1]
    weight = (1.0 + 0.5 * torch.randn(size, generator=g)).to(dtype)
    x = (3.0 * torch.randn(*shape, generator=g)).to(dtype)
    ours, theirs = RMSNorm(size, 1e-5).to(dtype), LlamaRMSNorm(size, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))


def test_rms_norm_gradients_match_llamas():
    g = torch.Generator().manual_seed(0)
    weight = 1.0 + 0.5 * torch.randn(64, generator=g)
    x = torch.randn(4, 64, generator=g, dtype=torch.float64).float()
    ours, theirs = RMSNorm(64, 1e-6), LlamaRMSNorm(64, eps=1e-6)
    grads = []
    for norm in (ours, theirs):
        with torch.no_grad():
            norm.weight.copy_(weight)
        xi = x.clone().requires_grad_(True)
        (norm(xi) * torch.arange(64.0)).sum().backward()
        grads.append((xi.grad, norm.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _kernel_lanes():
    from dspark.models import fused_norm

    return fused_norm.lanes() if fused_norm._extension() is not None else None


@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (64, 576), (3, 1536), (5, 64), (2, 4100), (1, 24)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_fused_rms_norm_kernel_gives_torchs_bits(shape, scale):
    """csrc/rms_norm.cpp against F.rms_norm (seeds and shapes other than its own start-up
    check), and add_rms_norm against the add then F.rms_norm."""
    from dspark.models import fused_norm

    if _kernel_lanes() is None:
        pytest.skip("no fused RMSNorm kernel on this machine")
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1])
    x = scale * torch.randn(*shape, generator=g)
    residual = scale * torch.randn(*shape, generator=g)
    weight = 1.0 + 0.5 * torch.randn(shape[1], generator=g)
    for eps in (1e-5, 1e-6):
        assert torch.equal(fused_norm.rms_norm(x, weight, eps), F.rms_norm(x, (shape[1],), weight, eps))
        h, normed = fused_norm.add_rms_norm(x, residual, weight, eps)
        assert torch.equal(h, x + residual)
        assert torch.equal(normed, F.rms_norm(x + residual, (shape[1],), weight, eps))


def test_fused_rms_norm_kernel_finds_atens_vector_width():
    """Where a compiler exists the kernel is found to reproduce torch with 8 (AVX2) or 16
    (AVX-512) lanes, and with exactly one of them: the start-up comparison tells them apart."""
    from dspark.models import fused_norm

    ext = fused_norm._extension()
    if ext is None:
        pytest.skip("no C++ compiler")
    assert fused_norm.lanes() in (8, 16)
    with torch.inference_mode():
        assert [fused_norm._matches_torch(ext, n) for n in (8, 16)].count(True) == 1


def test_rms_norm_module_uses_the_kernel_only_without_autograd(monkeypatch):
    from dspark.models import fused_norm

    if _kernel_lanes() is None:
        pytest.skip("no fused RMSNorm kernel on this machine")
    calls = []
    real = fused_norm.rms_norm
    monkeypatch.setattr(fused_norm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    norm, x = RMSNorm(576, 1e-5), torch.randn(2, 576)
    norm(x)
    assert not calls  # autograd on: torch's (the kernel has no backward)
    with torch.no_grad():
        norm(x)
    assert calls == [1]
