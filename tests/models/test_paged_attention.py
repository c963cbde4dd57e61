"""The block-table attentions (C++ kernel, padded SDPA) against a per-request SDPA reference."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from dspark.models.paged_attention import (build_cpu_kernel, cpu_kernel_available, long_query_attention,
                                           padded_attention, paged_attention, reference_attention)
from dspark.models.runner import long_queries

BLOCK_SIZE = 4


def make_case(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int,
              dtype: torch.dtype, seed: int = 0, head_dim: int = 8):
    """A cache whose blocks are handed out in a random order (contexts scattered), and queries."""
    g = torch.Generator().manual_seed(seed)
    tables_needed = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(tables_needed) + 3
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in tables_needed:
        tables.append(order[used:used + n])
        used += n
    width = max(tables_needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    query_start = torch.tensor([0] + torch.cumsum(torch.tensor(query_lens), 0).tolist(), dtype=torch.int64)
    return q, k_cache, v_cache, tables, block_tables, query_start


CASES = [
    ([1], [1]),                       # a first token alone
    ([1, 1, 1], [7, 1, 13]),          # decode steps
    ([3, 9, 1, 5], [3, 20, 6, 5]),    # verification blocks and whole prompts
    ([8, 2], [8, 33]),
    ([1, 4, 16], [40, 37, 70]),       # several 16-position tiles, partial last tiles
]


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])  # 32-128: the SIMD path where built
def test_cpu_kernel_equals_per_request_sdpa(case, heads, dtype, tol, head_dim):
    query_lens, context_lens = case
    q, k, v, tables, block_tables, query_start = make_case(query_lens, context_lens, *heads, dtype,
                                                           head_dim=head_dim)
    scale = head_dim ** -0.5
    expected = reference_attention(q, k, v, tables, query_lens, context_lens, scale).float()
    got = paged_attention(q, k, v, block_tables, query_start, torch.tensor(context_lens), scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()[2:]}


# The kernel's narrower paths, built with the ISA flags that turn the wider ones off, so that a
# wide CPU tests all of them: (flags the path needs, flags the native build has beyond it).
NARROWER_BUILDS = {
    "avx512": ({"avx512f"}, {"avx512_bf16"}, ("-mno-avx512bf16",)),
    "avx2": ({"avx2", "fma"}, {"avx512f"}, ("-mno-avx512f",)),
    "portable": (set(), {"avx2", "avx512f"}, ("-mno-avx512f", "-mno-avx2")),
}


@functools.cache
def narrower_build(path: str):
    """The kernel built for `path`, or a reason to skip: the CPU lacks what it needs, or the
    native build already is that path (the tests above cover it)."""
    needs, wider, flags = NARROWER_BUILDS[path]
    have = cpu_flags()
    if not needs <= have:
        return f"this CPU lacks {sorted(needs - have)}"
    if not wider & have:
        return "the native build is this path"
    source = Path(__file__).resolve().parents[2] / "dspark" / "models" / "csrc" / "paged_attention.cpp"
    return build_cpu_kernel(source, f"dspark_paged_attention_{path}", flags)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads", [(6, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("path", sorted(NARROWER_BUILDS))
def test_narrower_kernel_paths_equal_per_request_sdpa(path, head_dim, heads, dtype, tol):
    """The AVX-512 path without bf16 dot products, the AVX2 path and the portable loops, built on
    a CPU whose native build takes a wider path, against the reference on every case (1 to 4 rows
    a register block, partial tiles)."""
    ext = narrower_build(path)
    if isinstance(ext, str):
        pytest.skip(ext)
    for query_lens, context_lens in CASES:
        q, k, v, tables, block_tables, query_start = make_case(query_lens, context_lens, *heads, dtype,
                                                               head_dim=head_dim)
        scale = head_dim ** -0.5
        expected = reference_attention(q, k, v, tables, query_lens, context_lens, scale).float()
        got = ext.paged_attention(q, k, v, block_tables, query_start, torch.tensor(context_lens), scale, 0)
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_long_queries_through_sdpa_equal_per_request_sdpa(dtype, tol):
    """The kernel skips the requests with at least `min_len` new tokens and SDPA fills them in:
    together the same attention as the reference, for a batch that mixes whole prompts (long and
    short), continued prompts (context partly cached, long and short) and decode steps."""
    min_len = 6
    query_lens, context_lens = [1, 9, 5, 7, 1, 6, 3], [14, 9, 5, 19, 3, 6, 11]
    q, k_cache, v_cache, tables, block_tables, query_start = make_case(
        query_lens, context_lens, 9, 3, dtype)
    spans = long_queries(query_lens, context_lens, block_tables, BLOCK_SIZE, min_len)
    assert [(start, q_len, ctx_len) for start, q_len, ctx_len, _ in spans] == [
        (1, 9, 9), (15, 7, 19), (23, 6, 6)]
    # this pass's keys and values: the cache slots of each request's new tokens
    new_slots = [tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for r, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens))
                 for p in range(ctx_len - q_len, ctx_len)]
    k_new, v_new = k_cache.flatten(0, 1)[new_slots], v_cache.flatten(0, 1)[new_slots]
    scale = 8 ** -0.5
    expected = reference_attention(q, k_cache, v_cache, tables, query_lens, context_lens, scale).float()
    got = paged_attention(q, k_cache, v_cache, block_tables, query_start, torch.tensor(context_lens),
                          scale, long_min_q_len=min_len)
    long_query_attention(got, q, k_new, v_new, k_cache, v_cache, spans, scale)
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("case", CASES)
def test_padded_sdpa_equals_per_request_sdpa(case, heads):
    query_lens, context_lens = case
    q, k, v, tables, block_tables, _ = make_case(query_lens, context_lens, *heads, torch.float32)
    scale = 8 ** -0.5
    expected = reference_attention(q, k, v, tables, query_lens, context_lens, scale)
    got = padded_attention(q, k, v, block_tables, torch.tensor(query_lens), torch.tensor(context_lens),
                           scale, max(query_lens), max(context_lens))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
def test_cpu_kernel_refuses_indices_outside_the_cache():
    q, k, v, _, block_tables, query_start = make_case([2], [6], 4, 2, torch.float32)
    bad_tables = block_tables.clone()
    bad_tables[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention(q, k, v, bad_tables, query_start, torch.tensor([6]), 1.0)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        paged_attention(q, k, v, block_tables, query_start, torch.tensor([6 + 2 * BLOCK_SIZE]), 1.0)
    with pytest.raises(RuntimeError, match="shorter than its new tokens"):
        paged_attention(q, k, v, block_tables, query_start, torch.tensor([1]), 1.0)


def test_each_set_of_isa_flags_and_each_source_builds_under_its_own_name(tmp_path, monkeypatch):
    from dspark.models import paged_attention as module

    native, no_flags = module.kernel_build("")
    assert no_flags == () and native.startswith("dspark_paged_attention_")
    avx2, flags = module.kernel_build("-mno-avx512f")
    assert flags == ("-mno-avx512f",) and avx2 != native
    assert module.kernel_build("  -mno-avx512f ") == (avx2, flags)
    portable = module.kernel_build("-mno-avx512f -mno-avx2")
    assert portable[1] == ("-mno-avx512f", "-mno-avx2") and portable[0] not in (avx2, native)
    edited = tmp_path / "paged_attention.cpp"
    edited.write_bytes(module._SOURCE.read_bytes() + b"\n// another version\n")
    monkeypatch.setattr(module, "_SOURCE", edited)
    assert module.kernel_build("")[0] != native


def test_cpu_kernel_refuses_tensors_off_the_cpu():
    """The kernel reads host pointers: tensors on another device are refused with a message
    before they reach it, never read."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pretend_device import PretendDevice

    q, k, v, _, block_tables, query_start = make_case([2], [6], 4, 2, torch.float32)
    device = PretendDevice()
    device.place(k, v)
    with device, pytest.raises(ValueError, match="k_cache, v_cache on another device"):
        paged_attention(q, k, v, block_tables, query_start, torch.tensor([6]), 1.0)


def unfused_rope_write_attention(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_tables, query_start,
                                 context_lens, num_heads, scale):
    """The three steps `rope_write_attention` fuses, as the transformer does them apart."""
    from dspark.models.transformer import apply_rope

    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads = qkv.view(qkv.shape[0], -1, head_dim)  # [T, H + 2 KVH, D]
    q, k = apply_rope(heads[:, :num_heads + num_kv_heads], cos[:, None], sin[:, None]).split(
        [num_heads, num_kv_heads], dim=1)
    k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k)
    v_cache.flatten(0, 1).index_copy_(0, slot_mapping, heads[:, num_heads + num_kv_heads:])
    return paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_write_attention_is_bit_identical_to_its_three_steps(case, heads, head_dim):
    """RoPE + the K/V write + attention in one call: the same output and cache bits as
    apply_rope, PagedKVCache.write's index_copy_ and paged_attention called apart."""
    from dspark.models.paged_attention import rope_write_attention

    query_lens, context_lens = case
    num_heads, num_kv_heads = heads
    _, k, v, _, block_tables, query_start = make_case(query_lens, context_lens, num_heads, num_kv_heads,
                                                      torch.float32, head_dim=head_dim)
    g = torch.Generator().manual_seed(1)
    num_tokens = sum(query_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    angles = positions[:, None].float() * torch.rand(head_dim // 2, generator=g)  # [T, D / 2]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # [T, D]
    slot_mapping = torch.cat([
        torch.tensor([block_tables[r, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c - q, c)])
        for r, (q, c) in enumerate(zip(query_lens, context_lens))])
    context_lens_t = torch.tensor(context_lens)
    k2, v2 = k.clone(), v.clone()
    expected = unfused_rope_write_attention(qkv, cos, sin, k, v, slot_mapping, block_tables, query_start,
                                            context_lens_t, num_heads, head_dim ** -0.5)
    got = rope_write_attention(qkv, cos, sin, k2, v2, slot_mapping, block_tables, query_start,
                               context_lens_t, num_heads, head_dim ** -0.5)
    assert got.shape == expected.shape
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert torch.equal(got, expected)


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
def test_rope_write_attention_refuses_slots_outside_the_cache():
    from dspark.models.paged_attention import rope_write_attention

    _, k, v, _, block_tables, query_start = make_case([1], [3], 4, 2, torch.float32)
    qkv, cos, sin = torch.randn(1, 8 * 8), torch.randn(1, 8), torch.randn(1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_write_attention(qkv, cos, sin, k, v, torch.tensor([k.shape[0] * BLOCK_SIZE]), block_tables,
                             query_start, torch.tensor([3]), 4, 1.0)
