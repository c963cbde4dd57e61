"""The block-table attentions (C++ kernel, padded SDPA) against a per-request SDPA reference."""

from __future__ import annotations

import pytest
import torch

from dspark.models.paged_attention import (cpu_kernel_available, padded_attention, paged_attention,
                                           reference_attention)

BLOCK_SIZE = 4


def make_case(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int,
              dtype: torch.dtype, seed: int = 0):
    """A cache whose blocks are handed out in a random order (contexts scattered), and queries."""
    g = torch.Generator().manual_seed(seed)
    head_dim = 8
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
]


@pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler for the CPU kernel")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel_equals_per_request_sdpa(case, heads, dtype, tol):
    query_lens, context_lens = case
    q, k, v, tables, block_tables, query_start = make_case(query_lens, context_lens, *heads, dtype)
    scale = 8 ** -0.5
    expected = reference_attention(q, k, v, tables, query_lens, context_lens, scale).float()
    got = paged_attention(q, k, v, block_tables, query_start, torch.tensor(context_lens), scale)
    assert got.shape == q.shape and got.dtype == dtype
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
