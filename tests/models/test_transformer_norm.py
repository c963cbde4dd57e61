"""RMSNorm against transformers' LlamaRMSNorm, bit for bit: greedy output stays token-identical
to transformers only if every norm rounds as theirs does."""

import pytest
import torch
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
