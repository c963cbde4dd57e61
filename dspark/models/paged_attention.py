"""Causal attention of a flattened batch read straight from the paged KV cache.

Two implementations of one function, `paged_attention(q, k_cache, v_cache, block_tables,
query_start, context_lens, scale) -> out`, with the shapes of `csrc/paged_attention.cpp`:

- **CPU**: a C++ kernel (`csrc/paged_attention.cpp`), compiled on first use with
  `torch.utils.cpp_extension` and cached (in `TORCH_EXTENSIONS_DIR`, default
  `~/.cache/torch_extensions`). One call per layer for the whole batch; each (request, KV head)
  pair reads its context's K/V once through the block table, with no gathered copy. On an
  AVX-512 or AVX2 CPU, float32 and bf16 caches with head_dim 32, 64 or 128 take a path with
  queries, scores and outputs in registers (2-9x the portable loops at decode on AVX-512,
  `bench/paged_attention_kernel.py --against`), the softmax in vector registers too, and bf16
  scores by VDPBF16PS where the CPU has AVX512-BF16. Where no C++
  compiler is found it is unavailable (`cpu_kernel_available()`) and the runner falls back to
  per-request SDPA.
- **Any device** (`padded_attention`): the contexts gathered into one padded
  [num_requests, num_kv_heads, max_context, head_dim] tensor and one SDPA call with a causal
  padding mask: a constant number of kernel launches whatever the batch, which is what a GPU wants.

Both equal `reference_attention` (a per-request loop over plain SDPA) up to float rounding; the
tests hold them together.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["paged_attention", "rope_write_attention", "long_query_attention", "padded_attention", "reference_attention",
           "cpu_kernel_available", "build_cpu_kernel", "LONG_QUERY_MIN_TOKENS"]

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_log = logging.getLogger(__name__)
PROFILER_LABEL = "dspark::paged_attention"
"""The kernel's name in torch profiler tables (it is not an aten op, so it needs a label)."""
LONG_QUERY_MIN_TOKENS = 32
"""A request with at least this many new tokens in a pass (a prompt chunk) goes through
`long_query_attention` (SDPA's flash kernel, one call per such request) and the C++ kernel skips
it: the kernel's per-(request, KV head) loops are made for the few new tokens of decode and
verification. bench/decode_breakdown.py on an AMX-BF16 Xeon, 128 chat prompts (15,425 tokens) in
bf16, one thread: the prefill took 11.7 s with the C++ kernel for every request, 8.8 s with SDPA
per request."""


def build_cpu_kernel(source: Path, name: str, isa_flags: tuple[str, ...] = ()):
    """Compile a kernel source (this module's, or another version of it: a benchmark's
    baseline) into an extension module `name` with `.paged_attention`, for this CPU
    (-march=native: the AVX-512 path where the CPU has it, else the AVX2 one). `isa_flags` come
    after it, to build a narrower path on a wider CPU (("-mno-avx512f",): the AVX2 path;
    ("-mno-avx512f", "-mno-avx2"): the portable loops) for its tests and benchmarks."""
    from dspark.models.kernel_load import load_kernel

    return load_kernel(name, sources=[str(source)],
                       extra_cflags=["-O3", "-march=native", *isa_flags, "-fopenmp", "-fopenmp-simd"],
                       extra_ldflags=["-fopenmp"], verbose=False)


KERNEL_ISA_FLAGS_ENV = "DSPARK_KERNEL_ISA_FLAGS"
"""Compiler flags after -march=native for the runners' kernel, space-separated: "-mno-avx512f"
runs the AVX2 path on an AVX-512 CPU. With ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2
(torch's own kernels and oneDNN's) a whole run takes an AVX2-only CPU's code paths, which is how
bench/target_decode.py compares against transformers as on such a CPU. Unset: this CPU's best."""


def kernel_build(isa_flags: str) -> tuple[str, tuple[str, ...]]:
    """(extension name, flags) for `isa_flags` (KERNEL_ISA_FLAGS_ENV's value). The name carries
    a digest of the source and the flags, so each set of flags, and each version of the source
    (two checkouts, an upgrade), is built and cached under its own name: switching between them
    never rebuilds another's build folder, nor waits on its lock."""
    flags = tuple(isa_flags.split())
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    return f"dspark_paged_attention_{digest}", flags


@functools.cache
def _cpu_extension():
    """The compiled CPU kernel module, or None where it cannot be built here."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    try:
        name, flags = kernel_build(os.environ.get(KERNEL_ISA_FLAGS_ENV, ""))
        return build_cpu_kernel(_SOURCE, name, flags)
    except Exception as exc:  # no compiler headers, no ninja: fall back, and say why once
        _log.warning("paged attention CPU kernel unavailable (%s); per-request SDPA is used", exc)
        return None


def cpu_kernel_available() -> bool:
    """Whether the C++ kernel builds (or is already built) on this machine."""
    return _cpu_extension() is not None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                    scale: float, long_min_q_len: int = 0) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> out [num_tokens, num_heads, head_dim] (CPU kernel).

    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; block_tables
    [num_requests, max_blocks] int64; query_start [num_requests + 1] int64; context_lens
    [num_requests] int64 (all on the CPU). With `long_min_q_len` > 0, the rows of a request with at
    least that many new tokens are left unwritten for the caller (`long_query_attention`).
    """
    tensors = (q, k_cache, v_cache, block_tables, query_start, context_lens)
    if not all(t.is_cpu for t in tensors):  # the kernel reads its tensors through host pointers
        _off_cpu(("q", "k_cache", "v_cache", "block_tables", "query_start", "context_lens"), tensors)
    ext = _cpu_extension()
    if ext is None:
        raise RuntimeError("the paged attention CPU kernel is not available on this machine")
    if torch.autograd._profiler_enabled():  # the label costs ~8 us a call: only while profiling
        with torch.profiler.record_function(PROFILER_LABEL):  # visible to the torch profiler
            return ext.paged_attention(q.contiguous(), k_cache, v_cache, block_tables, query_start,
                                       context_lens, float(scale), int(long_min_q_len))
    return ext.paged_attention(q.contiguous(), k_cache, v_cache, block_tables, query_start,
                               context_lens, float(scale), int(long_min_q_len))


def rope_write_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         query_start: torch.Tensor, context_lens: torch.Tensor, num_heads: int,
                         scale: float, long_min_q_len: int = 0) -> torch.Tensor:
    """A layer's steps between its q|k|v and o products in one kernel call (float32, CPU): RoPE of
    q and k (`transformer.apply_rope`'s roundings), the K/V write at `slot_mapping`
    (`PagedKVCache.write`), then `paged_attention`; the same bits as those three calls.

    qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] float32 (the fused projection's
    output: q heads, k heads, v heads); cos, sin [num_tokens, head_dim]; slot_mapping
    [num_tokens] int64; the rest as `paged_attention`. Returns [num_tokens, num_heads, head_dim].
    A decode step calls it once per layer, so the Python here is a few operations."""
    if not (qkv.is_cpu and cos.is_cpu and sin.is_cpu and k_cache.is_cpu and v_cache.is_cpu and slot_mapping.is_cpu
            and block_tables.is_cpu and query_start.is_cpu and context_lens.is_cpu):
        _off_cpu(("qkv", "cos", "sin", "k_cache", "v_cache", "slot_mapping", "block_tables", "query_start",
                  "context_lens"), (qkv, cos, sin, k_cache, v_cache, slot_mapping, block_tables, query_start,
                                    context_lens))
    ext = _cpu_extension()
    if ext is None:
        raise RuntimeError("the paged attention CPU kernel is not available on this machine")
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(PROFILER_LABEL):
            return ext.rope_write_attention(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                                            query_start, context_lens, num_heads, float(scale),
                                            int(long_min_q_len))
    return ext.rope_write_attention(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                                    query_start, context_lens, num_heads, float(scale), int(long_min_q_len))


def _off_cpu(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """Refuse tensors on another device by name (the kernel reads host pointers)."""
    off = [name for name, t in zip(names, tensors) if not t.is_cpu]
    raise ValueError(f"paged_attention is the CPU kernel: {', '.join(off)} on "
                     f"{tensors[0].device if off[0] == names[0] else 'another device'}; on a GPU the "
                     f"runner uses padded_attention (AttentionImpl.PADDED)")


def long_query_attention(out: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         spans: list[tuple[int, int, int, torch.Tensor]], scale: float) -> None:
    """Causal attention of the requests the kernel skipped (`long_min_q_len`), written into `out`.

    q, out [num_tokens, num_heads, head_dim]; k_new, v_new [num_tokens, num_kv_heads, head_dim]:
    this pass's keys and values (already in the cache too); k_cache, v_cache [num_blocks,
    block_size, num_kv_heads, head_dim]; spans: (first token row, new tokens q_len, context length,
    the context's cache slots [context_len] int64) per request. A request whose context is all new
    attends over k_new / v_new with SDPA's causal flag; one with a cached part gathers its context
    from the cache and masks new token i to positions 0 .. context_len - q_len + i.
    """
    group = q.shape[1] // k_new.shape[1]
    for start, q_len, ctx_len, slots in spans:
        rows = slice(start, start + q_len)
        q_r = q[rows].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        if ctx_len == q_len:
            k_r, v_r, mask = k_new[rows], v_new[rows], None
        else:
            k_r = k_cache.flatten(0, 1).index_select(0, slots)  # [ctx_len, num_kv_heads, head_dim]
            v_r = v_cache.flatten(0, 1).index_select(0, slots)
            i = torch.arange(q_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= ctx_len - q_len + i  # [q_len, ctx]
        k_r = k_r.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, num_heads, ctx, head_dim]
        v_r = v_r.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        out[rows] = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=mask, is_causal=mask is None,
                                                   scale=scale)[0].transpose(0, 1)


def padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, max_query_len: int, max_context_len: int) -> torch.Tensor:
    """The same attention with one SDPA call over padded contexts (any device).

    q [num_tokens, num_heads, head_dim]; query_lens, context_lens [num_requests] int64 on q's
    device; max_query_len / max_context_len: their maxima (Python ints, so no device sync).
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_requests = context_lens.shape[0]
    device = q.device
    # slots [num_requests, max_context_len] of each context position (padding: slot 0, masked)
    pos = torch.arange(max_context_len, device=device)  # [L]
    blocks = block_tables[:, :-(-max_context_len // block_size)]  # [R, ceil(L / block_size)]
    slots = blocks.repeat_interleave(block_size, dim=1)[:, :max_context_len] * block_size + pos % block_size
    valid = pos[None, :] < context_lens[:, None]  # [R, L]
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    k = k_cache.flatten(0, 1).index_select(0, slots.flatten())  # [R * L, num_kv_heads, head_dim]
    v = v_cache.flatten(0, 1).index_select(0, slots.flatten())
    k = k.view(num_requests, max_context_len, num_kv_heads, head_dim).transpose(1, 2)  # [R, KVH, L, D]
    v = v.view(num_requests, max_context_len, num_kv_heads, head_dim).transpose(1, 2)
    # queries padded to [R, KVH, group * max_query_len, D]: row (g, i) = new token i, head h*group+g
    query_start = torch.cumsum(query_lens, 0) - query_lens  # [R]
    i = torch.arange(max_query_len, device=device)  # [Q]
    q_valid = i[None, :] < query_lens[:, None]  # [R, Q]
    token_of = torch.where(q_valid, query_start[:, None] + i[None, :], torch.zeros_like(q_valid, dtype=torch.int64))
    q_pad = q.index_select(0, token_of.flatten()).view(num_requests, max_query_len, num_kv_heads, group, head_dim)
    q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(num_requests, num_kv_heads, group * max_query_len, head_dim)
    # causal + padding mask [R, 1, group * Q, L]: new token i of request r sees positions
    # 0 .. context_len - query_len + i; padded query rows, and rows whose limit is negative (the
    # graph runner's padding rows, dspark/models/graph_runner.py), see position 0 at least (a
    # finite row, dropped) rather than nothing (a NaN row).
    limit = context_lens[:, None] - query_lens[:, None] + i[None, :]  # [R, Q]
    limit = torch.where(q_valid, limit, torch.zeros_like(limit)).clamp_min(0)
    mask = pos[None, None, :] <= limit[:, :, None]  # [R, Q, L]
    mask = mask[:, None].expand(num_requests, group, max_query_len, max_context_len).reshape(
        num_requests, 1, group * max_query_len, max_context_len)
    out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=mask, scale=scale)  # [R, KVH, G*Q, D]
    out = out.view(num_requests, num_kv_heads, group, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_requests * max_query_len, num_heads, head_dim)
    # Token t of request r sits at padded row r * Q + (t - query_start[r]): found without
    # reading the device (a nonzero of the mask would wait for it).
    req_of_token = torch.repeat_interleave(torch.arange(num_requests, device=device), query_lens,
                                           output_size=num_tokens)  # [num_tokens]
    row = (req_of_token * max_query_len + torch.arange(num_tokens, device=device)
           - query_start[req_of_token])  # [num_tokens]
    return out.index_select(0, row)  # [num_tokens, H, D]


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: list[list[int]], query_lens: list[int], context_lens: list[int],
                        scale: float) -> torch.Tensor:
    """Slow and obvious: per request, gather its context token by token and run plain SDPA with a
    causal mask. q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    outs, start = [], 0
    for table, q_len, ctx_len in zip(block_tables, query_lens, context_lens):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx_len)]
        k = k_cache.flatten(0, 1)[slots].float().transpose(0, 1)  # [KVH, ctx, D]
        v = v_cache.flatten(0, 1)[slots].float().transpose(0, 1)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)  # [H, ctx, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
        q_r = q[start:start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        i = torch.arange(q_len)[:, None]
        j = torch.arange(ctx_len)[None, :]
        mask = j <= ctx_len - q_len + i  # [q_len, ctx]
        outs.append(F.scaled_dot_product_attention(q_r, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        start += q_len
    return torch.cat(outs).to(q.dtype)
