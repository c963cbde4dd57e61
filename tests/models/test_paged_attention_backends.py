"""The GPU paged attentions (FlexAttention with a block-table BlockMask, the Triton kernel)
against the per-request SDPA reference, on this CPU: FlexAttention runs its dense reference
implementation, the Triton kernel Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).
The greedy engine on them gives transformers' tokens."""

from __future__ import annotations

import pytest
import torch

from dspark.engine import Engine, EngineConfig
from dspark.models.flex_paged_attention import build_flex_mask, flex_paged_attention
from dspark.models.paged_attention import reference_attention
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.models.transformer import AttentionImpl
from dspark.models.triton_paged_attention import triton_paged_attention
from dspark.cost_table import CostTable
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import LAYER_IDS

from .test_paged_attention import BLOCK_SIZE, CASES, make_case
from ..conftest import tiny_dspark
from ..test_engine import PROMPTS, reference_greedy  # noqa: F401  (a fixture: transformers' tokens)

MIXED = ([40, 8, 1, 8, 1, 8], [100, 13, 57, 8, 1, 30])
"""A prompt chunk continuing a request (40 new of 100), verification blocks of 8 (one of them a
whole fresh sequence), decode rows."""


def positions_of(query_lens: list[int], context_lens: list[int]) -> torch.Tensor:
    """[num_tokens]: each new token's position (its request's last query_len positions)."""
    return torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])


def run_backend(name: str, q, k, v, block_tables, query_start, query_lens, context_lens, scale):
    if name == "flex":
        mask = build_flex_mask(block_tables, query_start, torch.tensor(context_lens),
                               positions_of(query_lens, context_lens), k.shape[0], k.shape[1])
        return flex_paged_attention(q, k, v, mask, scale)
    return triton_paged_attention(q, k, v, block_tables, query_start, torch.tensor(context_lens),
                                  scale, max(query_lens))


@pytest.mark.parametrize("backend", ["flex", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 4), 8)])
@pytest.mark.parametrize("case", CASES + [MIXED])
def test_backend_equals_per_request_sdpa(backend, case, heads, head_dim, dtype, tol):
    query_lens, context_lens = case
    q, k, v, tables, block_tables, query_start = make_case(query_lens, context_lens, *heads, dtype,
                                                           head_dim=head_dim)
    scale = head_dim ** -0.5
    expected = reference_attention(q, k, v, tables, query_lens, context_lens, scale).float()
    got = run_backend(backend, q, k, v, block_tables, query_start, query_lens, context_lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_triton_never_reads_slots_past_a_context():
    """Unwritten cache memory may hold NaN: the kernel's loads stop at each context's end."""
    query_lens, context_lens = MIXED
    q, k, v, tables, block_tables, query_start = make_case(query_lens, context_lens, 9, 3, torch.float32,
                                                           head_dim=64)
    expected = reference_attention(q, k, v, tables, query_lens, context_lens, 0.125)
    used = {table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for table, c in zip(tables, context_lens) for p in range(c)}
    unused = torch.tensor(sorted(set(range(k.shape[0] * BLOCK_SIZE)) - used))
    k.flatten(0, 1)[unused] = float("nan")
    v.flatten(0, 1)[unused] = float("nan")
    got = triton_paged_attention(q, k, v, block_tables, query_start, torch.tensor(context_lens), 0.125,
                                 max(query_lens))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_block", [16, 4])
def test_flex_block_mask_lists_exactly_the_blocks_of_each_tiles_requests(q_block):
    """The eager path evaluates mask_mod everywhere; the compiled kernel visits only the listed
    tiles, so the tile lists are checked on their own: tile row i lists the cache blocks in the
    tables of the requests with a new token in rows i * q_block .. (i + 1) * q_block - 1."""
    query_lens, context_lens = MIXED
    _, k, _, tables, block_tables, query_start = make_case(query_lens, context_lens, 9, 3, torch.float32)
    mask = build_flex_mask(block_tables, query_start, torch.tensor(context_lens),
                           positions_of(query_lens, context_lens), k.shape[0], BLOCK_SIZE, q_block)
    tiles = mask.block_mask.to_dense()[0, 0].bool()  # [num_q_blocks, num_cache_blocks]
    request_of_token = [r for r, n in enumerate(query_lens) for _ in range(n)]
    expected = torch.zeros_like(tiles)
    for token, r in enumerate(request_of_token):
        expected[token // q_block, tables[r]] = True
    assert torch.equal(tiles, expected)


@pytest.mark.parametrize("impl", [AttentionImpl.FLEX, AttentionImpl.TRITON])
def test_greedy_engine_is_token_identical_on_the_gpu_attentions(tiny_target, reference_greedy, impl):
    """Speculative rounds (drafts of 4 verified as blocks of 5), prompt chunks of 3 riding in
    them, several requests: the tokens of transformers' greedy decoding."""
    runner = TargetRunner(tiny_target[0], RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=1024,
                                                       attention=impl))
    table = CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = Engine(TargetVerifier(runner), tiny_dspark(0, runner), table, EngineConfig().with_values(
        policy="fixed:4", max_running=8, prefill_chunk_tokens=3, update_cost_table=False))
    done = engine.generate(PROMPTS, SamplingParams(temperature=0), max_tokens=24)
    assert [r.output_ids for r in done] == reference_greedy
    assert sum(r.metrics.drafts_verified for r in done) > 0
