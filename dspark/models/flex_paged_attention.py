"""Causal attention of a flattened batch over the paged KV cache with torch's FlexAttention.

The keys and values are the whole cache as one sequence of slots (no copy: a view of
`PagedKVCache.k[layer]`), and a `BlockMask` tells FlexAttention which of them each new token
sees. Its tiles are Q_BLOCK new tokens (rows of the flattened batch) by one cache block
(`block_size` slots), so a tile row lists the cache blocks in the block tables of the requests
with a token in it, read from the block tables without a host round trip. Inside a tile the
mask_mod decides per (token, slot): the slot's block belongs to the token's request and its
position in that request is at most the token's own (causal within a prompt chunk or a
verification block, everything before it in the context).

Glossary
- *slot*, *block*, *block table*: as in `dspark.models.kv_cache`.
- *owner* of a cache block: the request of this pass whose block table holds it (-1: none);
  *logical index*: its index in that table (so slot offset o of it is position
  `logical * block_size + o`).

The cache must hold finite values in the slots the tiles cover (FlexAttention multiplies masked
probabilities, zeros, by them, and 0 * NaN is NaN): the runner allocates it zeroed for this
backend (`PagedKVCache(zeroed=True)`).

On a CPU it runs eagerly (the dense reference implementation of FlexAttention: fine for tests,
slow); on CUDA the compiled Triton kernel (`torch.compile(flex_attention)`, compiled once per
shape class on first use).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["FlexMask", "build_flex_mask", "flex_paged_attention", "FLEX_Q_BLOCK"]

FLEX_Q_BLOCK = 16
"""New tokens per BlockMask tile row: every token of a row is computed against the union of its
requests' blocks, so a short row wastes less on many small requests (a verification block of 8
shares a row with one other request). 16 is the smallest the compiled kernel takes (tl.dot)."""


@dataclasses.dataclass
class FlexMask:
    """What every layer's FlexAttention call of one pass shares."""

    block_mask: object
    """torch.nn.attention.flex_attention.BlockMask over [num_tokens, num_cache_slots]."""
    kernel_options: dict
    """Tile sizes for the compiled kernel (its KV tile must divide the cache block)."""


def build_flex_mask(block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                    positions: torch.Tensor, num_cache_blocks: int, block_size: int,
                    q_block: int = FLEX_Q_BLOCK) -> FlexMask:
    """The BlockMask of one pass, built on the tensors' device without reading them on the host.

    block_tables [num_requests, max_blocks] int64 (short tables padded with anything: entries
    past a request's context are ignored); query_start [num_requests + 1] int64; context_lens
    [num_requests] int64; positions [num_tokens] int64, each new token's position.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = block_tables.device
    num_requests, width = block_tables.shape
    num_tokens = positions.shape[0]
    num_q_blocks = -(-num_tokens // q_block)
    # which cache blocks each request reads, and who owns each block
    used = (torch.arange(width, device=device)[None, :]
            < (context_lens[:, None] + block_size - 1) // block_size)  # [R, width]
    table = torch.where(used, block_tables, num_cache_blocks)  # unused entries -> a spare index
    request_ids = torch.arange(num_requests, device=device)[:, None].expand(num_requests, width)
    logical_ids = torch.arange(width, device=device)[None, :].expand(num_requests, width)
    owner = torch.full((num_cache_blocks + 1,), -1, dtype=torch.int64, device=device)
    owner.scatter_(0, table.flatten(), request_ids.flatten())  # [num_cache_blocks + 1]
    logical = torch.zeros(num_cache_blocks + 1, dtype=torch.int64, device=device)
    logical.scatter_(0, table.flatten(), logical_ids.flatten())
    reads = torch.zeros(num_requests, num_cache_blocks + 1, device=device)
    reads.scatter_(1, table, 1.0)  # [R, num_cache_blocks + 1]
    # which requests have a token in each tile row
    first_row = query_start[:-1] // q_block  # [R]
    last_row = (query_start[1:] - 1) // q_block  # [R]
    rows = torch.arange(num_q_blocks, device=device)[:, None]  # [num_q_blocks, 1]
    touches = ((rows >= first_row[None, :]) & (rows <= last_row[None, :])).float()  # [num_q_blocks, R]
    needed = (touches @ reads)[:, :num_cache_blocks] > 0  # [num_q_blocks, num_cache_blocks]
    kv_num_blocks = needed.sum(-1, dtype=torch.int32)  # [num_q_blocks]
    kv_indices = torch.argsort(needed.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    request_of_token = torch.repeat_interleave(
        torch.arange(num_requests, device=device), query_start.diff(), output_size=num_tokens)

    def visible(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        return (owner[block] == request_of_token[q_idx]) & (
            logical[block] * block_size + kv_idx % block_size <= positions[q_idx])

    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=(q_block, block_size),
        mask_mod=visible, seq_lengths=(num_tokens, num_cache_blocks * block_size))
    return FlexMask(block_mask, {"BLOCK_M": q_block, "BLOCK_N": min(block_size, 64)})


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True, dynamic=True)


def flex_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         mask: FlexMask, scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim].

    k_cache, v_cache [num_cache_blocks, block_size, num_kv_heads, head_dim] (one layer's).
    """
    from torch.nn.attention.flex_attention import flex_attention

    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    q4 = q.transpose(0, 1)[None]  # [1, num_heads, num_tokens, head_dim]
    k4 = k_cache.flatten(0, 1).transpose(0, 1)[None]  # [1, num_kv_heads, num_slots, head_dim]
    v4 = v_cache.flatten(0, 1).transpose(0, 1)[None]
    if q.device.type == "cuda":
        out = _compiled_flex_attention()(q4, k4, v4, block_mask=mask.block_mask, scale=scale,
                                         enable_gqa=num_heads != num_kv_heads,
                                         kernel_options=mask.kernel_options)
    else:
        out = flex_attention(q4, k4, v4, block_mask=mask.block_mask, scale=scale,
                             enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
