"""oneDNN-packed products against F.linear, and the models that use them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.packed_linear import (PackedLinear, bf16_packing_supported, pack_linears,
                                         pack_weight, packed_linear, packing_available)

pytestmark = pytest.mark.skipif(not packing_available("cpu", torch.float32),
                                reason="this PyTorch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)  # [out, in]
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    y = packed_linear(x, pack_weight(w), b)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_keeps_leading_dimensions_and_copies_the_weight():
    w = torch.randn(24, 8)
    packed = pack_weight(w)
    x = torch.randn(2, 3, 8)
    expected = F.linear(x, w)
    w.zero_()  # the packed copy does not alias the dense weight
    torch.testing.assert_close(packed_linear(x, packed, None), expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_every_linear_and_keeps_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    expected = model(x)
    weight = model[0].weight
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert model[0].weight is weight  # device / dtype lookups keep working
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert pack_linears(model) == 0  # already packed


def test_packing_for_float32_cpu_and_bf16_where_onednn_supports_it():
    assert packing_available("cpu", torch.bfloat16) == bf16_packing_supported()
    assert not packing_available("cpu", torch.float16)
    assert not packing_available("meta", torch.float32)


@pytest.mark.skipif(not bf16_packing_supported(), reason="oneDNN has no bf16 products on this CPU")
@pytest.mark.parametrize("rows", [1, 2, 8, 33])
def test_packed_bf16_linear_matches_an_fp32_product_of_the_same_bf16_numbers(rows):
    """bf16 in, bf16 out, fp32 accumulation: within one bf16 rounding of the exact product."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).bfloat16()  # [out, in]
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    y = packed_linear(x, pack_weight(w), b)
    assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
    exact = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), exact, rtol=1e-2, atol=2e-2)
