"""Q8_0 blocks quantised from float weights (`quantize_q8_0`, the drafter's block weights): every
weight within half a step of the original, ggml's Q8_0 blocks reproduced bit for bit, and the
block linear over them equal to x @ dequantize(W)^T (a float64 reference)."""

from __future__ import annotations

import pytest
import torch

from dspark.models.quantized_linear import (BlockFormat, BlockWeight, block_linear, dequantize,
                                            kernel_available, quantize_q8_0)


def _weights(out: int, in_features: int, seed: int) -> torch.Tensor:
    """Weights at several scales per row (a block of 1e-4 beside one of 1), an all-zero block and
    an exact tie (0.5 steps) so rounding and the zero scale are exercised."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, in_features, generator=g) * torch.logspace(-4, 0, in_features // 32).repeat_interleave(32)
    w[0, :32] = 0.0
    w[1, 32:64] = torch.linspace(-1, 1, 32) * (127 / 128)  # max 127/128: d = 1/128, exact in fp16
    w[1, 33] = 0.5 / 128  # half a step: ggml rounds it away from zero, to q = 1
    return w


@pytest.mark.parametrize("out,in_features", [(3, 64), (40, 576), (17, 1728)])
def test_dequantized_within_half_a_step(out, in_features):
    w = _weights(out, in_features, seed=out)
    blocks = quantize_q8_0(w)
    assert blocks.format is BlockFormat.Q8_0 and blocks.blocks.shape == (out, in_features // 32 * 34)
    d = blocks.blocks.reshape(out, -1, 34)[..., 0:2].contiguous().view(torch.float16).float()  # [out, nb, 1]
    err = (dequantize(blocks) - w).abs().reshape(out, -1, 32)  # [out, nb, 32]
    assert bool((err <= d / 2 * (1 + 1e-6)).all()), (err / d).max()
    assert torch.equal(dequantize(blocks)[0, :32], torch.zeros(32))  # the all-zero block stays zero
    q = blocks.blocks.reshape(out, -1, 34)[..., 2:].contiguous().view(torch.int8)
    assert int(q.abs().max()) == 127 and int(q[1, 1, 1]) == 1


def test_reproduces_q8_0_blocks():
    """Weights that are Q8_0 blocks dequantised (the target's LM head) quantise to those blocks."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (12, 8, 32), dtype=torch.int8, generator=g)
    q[:, :, 5] = 127  # ggml's quantiser gives the block's largest weight q = +-127
    d = (torch.rand(12, 8, 1, generator=g) * 0.02 + 1e-4).half()
    blocks = BlockWeight(BlockFormat.Q8_0, torch.cat([d.view(torch.uint8), q.view(torch.uint8)], -1)
                         .reshape(12, -1), 256)
    assert torch.equal(quantize_q8_0(dequantize(blocks)).blocks, blocks.blocks)


@pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the block kernel")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_block_linear_equals_dequantized_product(rows):
    w = _weights(48, 576, seed=5)
    blocks = quantize_q8_0(w)
    bias = torch.randn(48)
    x = torch.randn(rows, 576)
    ref = x.double() @ dequantize(blocks).double().T + bias.double()  # [rows, 48]
    y = block_linear(x, blocks, bias)
    scale = (x.double().abs() @ dequantize(blocks).double().abs().T).max().item()
    assert y.shape == (rows, 48) and (y.double() - ref).abs().max().item() <= 1e-6 * scale
