"""`bench/int4pack_mm.py` maps Q4_1 blocks onto torch's 4-bit CPU matmul without requantising:
with float32 scales torch widens them to exactly the dequantised weights, with bfloat16 scales it
does not, and its float32 products are close to the float64 reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dspark.models.quantized_linear import BlockFormat, dequantize
from dspark.paths import REPO_ROOT

from .test_block_linear import random_blocks


@pytest.fixture(scope="module")
def int4pack_mm():
    spec = importlib.util.spec_from_file_location("int4pack_mm", REPO_ROOT / "bench" / "int4pack_mm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_float32_scales_give_the_dequantised_weights(int4pack_mm):
    w = random_blocks(BlockFormat.Q4_1, 32, 128, seed=3)
    packed, sz = int4pack_mm.int4pack_operands(w, torch.float32)
    assert sz.shape == (128 // 32, 32, 2) and sz.dtype == torch.float32
    assert torch.equal(int4pack_mm.widened_weights(packed, sz, w.in_features), dequantize(w))


def test_bfloat16_scales_change_the_weights(int4pack_mm):
    w = random_blocks(BlockFormat.Q4_1, 32, 128, seed=3)
    packed, sz = int4pack_mm.int4pack_operands(w, torch.bfloat16)
    widened = int4pack_mm.widened_weights(packed, sz, w.in_features)
    dense = dequantize(w)
    assert not torch.equal(widened, dense)
    assert torch.allclose(widened, dense, rtol=0.02, atol=2e-3)


def test_float32_product_against_float64(int4pack_mm):
    w = random_blocks(BlockFormat.Q4_1, 48, 576, seed=1)
    packed, sz = int4pack_mm.int4pack_operands(w, torch.float32)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    reference = x.double() @ dequantize(w).double().T
    got = int4pack_mm.int4pack_linear(x, packed, sz).double()
    assert (got - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert int4pack_mm.batch_invariant(lambda rows: int4pack_mm.int4pack_linear(rows, packed, sz),
                                       torch.randn(64, 576))


def test_q8_0_blocks_have_no_int4_form(int4pack_mm):
    with pytest.raises(ValueError, match="Q4_1"):
        int4pack_mm.int4pack_operands(random_blocks(BlockFormat.Q8_0, 4, 64), torch.float32)
