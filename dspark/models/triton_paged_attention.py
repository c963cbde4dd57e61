"""Causal attention of a flattened batch read straight from the paged KV cache: a Triton kernel.

One program per (request, KV head, tile of BLOCK_M new tokens). Its rows are the tile's tokens
times the `group` query heads that share the KV head (row = token * GROUP_P + head in group), so
the keys and values of a KV head are read once for all of its query heads, and a decode row, a
verification block and a prompt chunk all run in the same launch. The program walks its
request's context BLOCK_N positions at a time through the block table (no gathered copy, no
padding to the longest request), with an online softmax (running max and sum per row, as in
FlashAttention), and stops at the last position its tile's tokens may see (causal within the
request's new tokens, everything before them in the context). Slots past a request's context
are never loaded (masked loads), so the cache may hold anything there.

Shapes as `dspark.models.paged_attention.paged_attention`: q [num_tokens, num_heads, head_dim],
k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim], block_tables
[num_requests, max_blocks] int64, query_start [num_requests + 1] int64, context_lens
[num_requests] int64.

It runs on CUDA, and on a CPU under Triton's interpreter (TRITON_INTERPRET=1: numpy, slow; what
the tests use). The kernel is defined on first use, so the interpreter setting in force then is
the one it keeps.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["triton_available", "triton_paged_attention"]


def triton_available(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on `device`: Triton installed, and a CUDA device or
    the interpreter (TRITON_INTERPRET=1) on a CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
            scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, stride_ot, stride_oh, stride_bt,
            GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        request = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        q_start = tl.load(query_start_ptr + request)
        q_len = tl.load(query_start_ptr + request + 1) - q_start
        if tile * BLOCK_M < q_len:
            ctx_len = tl.load(context_lens_ptr + request)
            rows = tl.arange(0, BLOCK_M * GROUP_P)  # [M]
            token = tile * BLOCK_M + rows // GROUP_P  # index among the request's new tokens
            head = kv_head * GROUP + rows % GROUP_P
            row_valid = (token < q_len) & (rows % GROUP_P < GROUP)  # [M]
            dims = tl.arange(0, HEAD_P)  # [D]
            dim_valid = dims < HEAD_DIM
            q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                        + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            limit = ctx_len - q_len + token  # [M]: last position each row may see
            end = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_M)  # positions < end
            m_i = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
            acc = tl.zeros([BLOCK_M * GROUP_P, HEAD_P], tl.float32)
            for start in range(0, end, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)  # [N]
                pos_valid = pos < end
                block = tl.load(block_tables_ptr + request * stride_bt + pos // BLOCK_SIZE,
                                mask=pos_valid, other=0)
                offset = pos % BLOCK_SIZE
                kv_mask = pos_valid[:, None] & dim_valid[None, :]
                k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                            + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
                v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                            + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [M, N]
                s = tl.where(pos[None, :] <= limit[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # rows that have seen nothing yet keep m = -inf; subtract 0 there instead
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
                     + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_valid[:, None] & dim_valid[None, :])

    return paged_attention_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, max_query_len: int) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim].

    max_query_len: the most new tokens of any request (a Python int: the grid's third size,
    known without reading the device).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads, "query heads must be a multiple of KV heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "head_dim must be contiguous"
    if not triton_available(q.device):
        raise RuntimeError("the Triton kernel needs Triton and a CUDA device "
                           "(or TRITON_INTERPRET=1 on a CPU)")
    q = q.contiguous()
    out = torch.empty_like(q)
    group_p = _pow2(group)
    # rows per program = BLOCK_M * group_p, at least 16 (tl.dot), at most 64
    block_m = min(_pow2(max_query_len), max(1, 64 // group_p))
    block_m = max(block_m, max(1, 16 // group_p))
    grid = (context_lens.shape[0], num_kv_heads, -(-max_query_len // block_m))
    _kernel()[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_P=max(16, _pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=64,
        # float32 stays float32 (not TF32): the runner's outputs must match the reference's
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bf16/fp16 tiles wrongly (triton 3.9): it gets float32
        UPCAST=q.device.type != "cuda")
    return out
