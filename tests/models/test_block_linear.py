"""The GGUF block linear kernel against a float64 reference on the dequantised weights, and its
batch invariance (a row bit-identical alone, in 8, in 64, whatever the threads) and ISA
invariance (AVX-512, AVX2 and portable builds agree bit for bit)."""

from __future__ import annotations

import pytest
import torch

from dspark.models.quantized_linear import (BlockFormat, BlockWeight, _kernel_name, block_linear,
                                            build_kernel, dequantize, kernel_available)

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler for the block kernel")


def random_blocks(fmt: BlockFormat, out: int, in_features: int, seed: int = 0) -> BlockWeight:
    """Random GGUF blocks with plausible scales (d in [0.001, 0.021), Q4_1's m in (-0.1, 0])."""
    g = torch.Generator().manual_seed(seed)
    nb = in_features // 32
    b = torch.randint(0, 256, (out, nb, fmt.value), dtype=torch.uint8, generator=g)
    b[..., 0:2] = (torch.rand(out, nb, 1, generator=g) * 0.02 + 0.001).half().view(torch.uint8)
    if fmt is BlockFormat.Q4_1:
        b[..., 2:4] = (-torch.rand(out, nb, 1, generator=g) * 0.1).half().view(torch.uint8)
    return BlockWeight(fmt, b.reshape(out, -1), in_features)


def test_dequantize_follows_ggml_layout():
    """Weight j of a Q4_1 block is d * low nibble of byte j + m, weight j + 16 the high nibble."""
    w = random_blocks(BlockFormat.Q4_1, 1, 32)
    raw = w.blocks[0]
    d = raw[0:2].view(torch.float16).float().item()
    m = raw[2:4].view(torch.float16).float().item()
    dense = dequantize(w)[0]
    for j in (0, 5, 15):
        assert dense[j].item() == torch.tensor(d * float(raw[4 + j] & 15) + m, dtype=torch.float32).item()
        assert dense[j + 16].item() == torch.tensor(d * float(raw[4 + j] >> 4) + m, dtype=torch.float32).item()
    q8 = random_blocks(BlockFormat.Q8_0, 1, 32)
    d8 = q8.blocks[0, 0:2].view(torch.float16).float()
    assert torch.equal(dequantize(q8)[0], d8 * q8.blocks[0, 2:].view(torch.int8).float())


@pytest.mark.parametrize("fmt", list(BlockFormat))
@pytest.mark.parametrize("out,in_features", [(6, 64), (40, 576), (13, 1536)])
def test_matches_float64_reference(fmt, out, in_features):
    w = random_blocks(fmt, out, in_features)
    bias = torch.randn(out)
    x = torch.randn(11, in_features)
    ref = x.double() @ dequantize(w).double().T + bias.double()
    y = block_linear(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (11, out)
    scale = (x.double().abs() @ dequantize(w).double().abs().T).max().item()
    assert (y.double() - ref).abs().max().item() <= 1e-6 * scale
    assert torch.equal(block_linear(x[None], w, bias)[0], y)  # leading dimensions


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_batch_invariant(fmt):
    """Row i's outputs are the same bits alone, in a block of 8 and in a batch of 64, at 1 and 2
    threads: the reduction order per output never depends on the rows around it."""
    w = random_blocks(fmt, 70, 576, seed=1)
    x = torch.randn(64, 576)
    before = torch.get_num_threads()
    try:
        batch = block_linear(x, w)
        for i in (0, 3, 7, 21, 63):
            assert torch.equal(block_linear(x[i:i + 1], w), batch[i:i + 1]), i
        for start in (0, 8, 53):
            assert torch.equal(block_linear(x[start:start + 8], w), batch[start:start + 8]), start
        # the few-row tiles (2-4 rows), every strip tile and its remainders (4, 2 and 1 rows), and
        # past the 32-row chunk
        for rows in (2, 3, 4, 5, 6, 11, 17, 33):
            assert torch.equal(block_linear(x[:rows], w), batch[:rows]), rows
        torch.set_num_threads(2)
        assert torch.equal(block_linear(x, w), batch)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", list(BlockFormat))
@pytest.mark.parametrize("in_features", [1536, 2080])
def test_batch_invariant_long_rows(fmt, in_features):
    """Rows longer than a span of the strip (1536 = 2 spans of 24 blocks; 2080 = 65 blocks, 3
    uneven spans): row i's bits are the same alone and in any batch."""
    w = random_blocks(fmt, 22, in_features, seed=5)
    x = torch.randn(40, in_features)
    batch = block_linear(x, w)
    for rows in (5, 8, 11, 33):
        assert torch.equal(block_linear(x[:rows], w), batch[:rows]), rows
    for i in (0, 9, 39):
        assert torch.equal(block_linear(x[i:i + 1], w), batch[i:i + 1]), i


def test_not_a_float32_gemm_copy():
    """The test above can fail: torch's own float32 product of the same weights is not
    batch-invariant in general, and the kernel's bits differ from it (another order)."""
    w = random_blocks(BlockFormat.Q4_1, 64, 1536, seed=2)
    x = torch.randn(64, 1536)
    y = block_linear(x, w)
    assert not torch.equal(y, x @ dequantize(w).T)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.skipif(" avx2" not in _cpu_flags(), reason="needs an AVX2 CPU")
def test_isa_paths_bit_identical():
    """The AVX-512 (where the CPU has it), AVX2 and portable builds give the same bits."""
    builds = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
    exts = {k: build_kernel(_kernel_name(flags), flags) for k, flags in builds.items()}
    assert exts["avx2"].isa() == "avx2" and exts["portable"].isa() == "portable"
    bias = torch.randn(42)  # 42 outputs: whole tiles and a partial one on every path
    # the one-row kernel, the few-row tiles, the strip tiles with remainders; rows of one span and
    # of several (`strip_rows`: 1536 and 2080 inputs)
    for in_features, row_counts in ((576, (1, 2, 3, 4, 11)), (1536, (1, 11)), (2080, (7, 33))):
        for rows in row_counts:
            x = torch.randn(rows, in_features)
            for fmt in BlockFormat:
                w = random_blocks(fmt, 42, in_features, seed=3)
                outs = {k: getattr(e, f"{fmt.name.lower()}_linear")(x, w.blocks, bias) for k, e in exts.items()}
                assert torch.equal(outs["native"], outs["avx2"]), (fmt, in_features, rows)
                assert torch.equal(outs["native"], outs["portable"]), (fmt, in_features, rows)


@pytest.mark.slow
@pytest.mark.skipif(" avx512f" not in _cpu_flags(), reason="needs an AVX-512 CPU")
def test_one_row_paths_bit_identical():
    """One row through `one_row_tile` (a chunk's fp16 scales converted first: the Intel default)
    and through `tile` (each block's scales as it is widened: the AMD default) gives the same bits,
    with inputs of part of one scale chunk, one chunk and a remainder, three, and four and one
    block (in = 64, 576, 1536, 2080), and a partial tile of outputs (42)."""
    builds = {"first": ("-DDSPARK_ONE_ROW_SCALES_FIRST=1",), "per_block": ("-DDSPARK_ONE_ROW_SCALES_FIRST=0",)}
    exts = {k: build_kernel(_kernel_name(flags), flags) for k, flags in builds.items()}
    bias = torch.randn(42)
    for in_features in (64, 576, 1536, 2080):
        x = torch.randn(1, in_features)
        for fmt in BlockFormat:
            w = random_blocks(fmt, 42, in_features, seed=4)
            linear = f"{fmt.name.lower()}_linear"
            first, per_block = (getattr(exts[k], linear)(x, w.blocks, bias) for k in ("first", "per_block"))
            assert torch.equal(first, per_block), (fmt, in_features)
            reference = x.double() @ dequantize(w).double().T + bias.double()
            torch.testing.assert_close(first.double(), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(" avx512f" not in _cpu_flags(), reason="needs an AVX-512 CPU")
def test_strip_widening_paths_bit_identical():
    """More than 4 rows with the strip widened inside the first row tile (`widening_tile`: the
    Intel default) and in a pass of its own (`widen_strip`: the AMD default) give the same bits:
    5, 8, 11 and 16 rows, and 37 (past the 32-row chunk, whose second chunk of 5 widens again),
    over one, three and four and one blocks of inputs, with a partial tile of outputs (42)."""
    builds = {"first_pass": ("-DDSPARK_WIDEN_IN_FIRST_PASS=1",), "own_pass": ("-DDSPARK_WIDEN_IN_FIRST_PASS=0",)}
    exts = {k: build_kernel(_kernel_name(flags), flags) for k, flags in builds.items()}
    bias = torch.randn(42)
    for in_features in (32, 576, 2080):
        for rows in (5, 8, 11, 16, 37):
            x = torch.randn(rows, in_features)
            for fmt in BlockFormat:
                w = random_blocks(fmt, 42, in_features, seed=5)
                linear = f"{fmt.name.lower()}_linear"
                fused, own = (getattr(exts[k], linear)(x, w.blocks, bias) for k in ("first_pass", "own_pass"))
                assert torch.equal(fused, own), (fmt, in_features, rows)
                reference = x.double() @ dequantize(w).double().T + bias.double()
                torch.testing.assert_close(fused.double(), reference, rtol=1e-5, atol=1e-4)
