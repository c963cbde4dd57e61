"""The decoder forward pass over a flattened batch (docs/design.md section 5, "Variable lengths").

Glossary
- *flattened batch*: the new tokens of all requests in one sequence [num_tokens]; request r owns
  the contiguous run `query_start[r] .. query_start[r] + query_len[r] - 1`. No padding.
- *context* of request r: all its tokens with K/V in the cache after this step's tokens are
  written, positions 0..context_len[r]-1; its new tokens are the last query_len[r] of them.
- Attention of a new token at position p covers its own request's context positions 0..p.

The layer math mirrors transformers' Llama / Qwen2 / Qwen3 modules (RMSNorm in float32,
half-rotation RoPE, SiLU-gated MLP) so the two agree to float rounding. Projections are fused
(q|k|v in one matrix, gate|up in another): fewer, larger matrix products.

Grouped-query attention without copying K/V: the `num_queries_per_kv` query heads that share a
KV head are stacked along the sequence axis, so one SDPA call per KV head group sees
q [num_kv_heads, group * q_len, head_dim] against k, v [num_kv_heads, context_len, head_dim].

Attention implementations (`AttentionImpl`; the runner picks PAGED on a CPU where its C++ kernel
builds, PADDED on a GPU):

- PAGED: one kernel call per layer for the whole batch, each (request, KV head) reading its
  context in place through the block table (`dspark.models.paged_attention`). Its cost grows
  with the K/V read, not with the number of requests: at 64 decode streams it removes the
  1,920 SDPA calls per step (30 layers x 64) of PER_REQUEST, each ~0.05 ms of call overhead.
- PADDED: contexts gathered into one padded batch and one SDPA call per layer (a constant number
  of launches: what a GPU wants; on a CPU the gathered copy makes it the slowest at 256 streams).
- FLEX, TRITON: the GPU candidates that, like PAGED, read every context in place and serve
  prompt chunks, decode rows and verification blocks in one call per layer: FlexAttention with a
  BlockMask built from the block tables, and a Triton kernel (docs/gpu.md, "Attention";
  bench/attention_backends.py measures them against PADDED).
- PER_REQUEST: one SDPA call per request over its own context (read in place when its blocks are
  consecutive); the fallback on a CPU without a compiler. Measured on a 2-core CPU
  (SmolLM2-135M fp32, 1 thread, context 300 per request, whole forward, median of 5) against
- BLOCK_DIAGONAL: one SDPA call over all contexts with a block-diagonal mask:

    requests x new tokens   B    per_request   block_diagonal
    1 x 1                   1      121 ms        132 ms
    1 x 8                   8      305 ms        298 ms
    4 x 4                  16      432 ms        475 ms
    16 x 1                 16      487 ms        905 ms
    16 x 4                 64     1022 ms       1932 ms

  Block-diagonal multiplies every query by every request's context: it only ties at one request.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models import fused_norm
from dspark.models.block_layer_loop import BlockLayerLoop, LayerWeights
from dspark.models.config import ModelConfig
from dspark.models.flex_paged_attention import FlexMask, build_flex_mask, flex_paged_attention
from dspark.models.kv_cache import PagedKVCache
from dspark.models.packed_linear import pack_weight, packed_linear
from dspark.models.paged_attention import (LONG_QUERY_MIN_TOKENS, long_query_attention,
                                           paged_attention, padded_attention, rope_write_attention)
from dspark.models.quantized_linear import BlockWeight, block_linear
from dspark.models.triton_paged_attention import triton_paged_attention


class AttentionImpl(enum.Enum):
    """How attention over the flattened batch is computed (all give the same numbers up to float
    rounding)."""

    PAGED = "paged"
    """One call per layer of the C++ kernel that reads every context in place through the block
    tables (CPU; `dspark.models.paged_attention`). The CPU default where the kernel builds."""
    PADDED = "padded"
    """One SDPA call per layer over all contexts gathered into a padded batch (any device; a
    constant number of kernel launches whatever the batch, the GPU default)."""
    PER_REQUEST = "per_request"
    """One SDPA call per request over its own context (work ~ sum_r q_len_r * ctx_len_r)."""
    BLOCK_DIAGONAL = "block_diagonal"
    """One SDPA call over all contexts with a block-diagonal causal mask
    (work ~ num_tokens * sum_r ctx_len_r, but one call per layer)."""
    FLEX = "flex"
    """One FlexAttention call per layer over the whole cache as keys and values, with a BlockMask
    built from the block tables once per pass (`dspark.models.flex_paged_attention`; compiled on
    CUDA, eager and slow on a CPU). The cache is allocated zeroed for it."""
    TRITON = "triton"
    """One launch per layer of a Triton kernel that reads every context in place through the block
    tables, a program per (request, KV head, tile of new tokens)
    (`dspark.models.triton_paged_attention`; CUDA, or a CPU under TRITON_INTERPRET=1 for tests)."""

    @property
    def uses_block_tables(self) -> bool:
        """Whether the pass's metadata is block tables (rather than gathered contexts)."""
        return self in (AttentionImpl.PAGED, AttentionImpl.PADDED, AttentionImpl.FLEX,
                        AttentionImpl.TRITON)


@dataclasses.dataclass
class FlatBatch:
    """Per-token and per-request metadata of one forward pass; shared by all layers."""

    token_ids: torch.Tensor
    """[num_tokens] int64."""
    positions: torch.Tensor
    """[num_tokens] int64: each token's position in its request."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot each new token's K/V is written to."""
    query_lens: list[int]
    """[num_requests]: new tokens per request."""
    context_lens: list[int]
    """[num_requests]: context length per request (cached + new)."""
    context_in_place: list[bool]
    """[num_requests]: the request's context is read where it lies in the cache (its blocks are
    consecutive), else from the gathered copy."""
    context_offsets: list[int]
    """[num_requests]: first row of the request's context: a cache slot when in place, else a row
    of the gathered K/V."""
    gather_blocks: torch.Tensor
    """[num_gathered_blocks] int64: the blocks of the contexts not read in place, in request order."""
    masks: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    """PER_REQUEST: per request, bool [group * q_len, context_len] (None when q_len == 1)."""
    in_place_contexts: list[tuple[torch.Tensor, torch.Tensor] | None] = dataclasses.field(default_factory=list)
    """PER_REQUEST: per request whose context is read in place, views of its keys and values in
    every layer, each [num_layers, 1, num_kv_heads, context_len, head_dim] (None: gathered). Made
    once per forward (`bind_cache`), so a layer takes a request's context with one indexing op."""
    block_tables: torch.Tensor | None = None
    """PAGED / PADDED / FLEX / TRITON: int64 [num_requests, max_blocks], each request's blocks in
    order (a short table is padded with block 0, never read)."""
    query_start: torch.Tensor | None = None
    """PAGED / FLEX / TRITON: int64 [num_requests + 1], request r's new tokens are rows query_start[r] .. query_start[r+1]-1."""
    query_lens_t: torch.Tensor | None = None
    """PADDED: int64 [num_requests], `query_lens` on the device."""
    context_lens_t: torch.Tensor | None = None
    """PAGED / PADDED / FLEX / TRITON: int64 [num_requests], `context_lens` on the device."""
    long_queries: list[tuple[int, int, int, torch.Tensor]] = dataclasses.field(default_factory=list)
    """PAGED: (first token row, new tokens, context length, context cache slots [context_len]
    int64) of each request with at least `LONG_QUERY_MIN_TOKENS` new tokens (the kernel skips
    them; SDPA runs them, `long_query_attention`)."""
    flex_mask: FlexMask | None = None
    """FLEX: the BlockMask every layer shares (`build_flex_mask`)."""
    block_mask: torch.Tensor | None = None
    """BLOCK_DIAGONAL: bool [group * num_tokens, num_context_blocks * block_size]."""
    unused_rows: torch.Tensor | None = None
    """BLOCK_DIAGONAL: bool [num_rows], True at the rows of the gathered K/V past their request's
    context (the tail of its last block). They hold whatever the cache memory held, possibly NaN,
    and a masked NaN still poisons softmax, so attention zeroes them (by a mask, not a list of
    rows: a `nonzero` would wait for the device)."""

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def bind_cache(self, cache: PagedKVCache) -> None:
        """PER_REQUEST: make the in-place context views of `cache` (see `in_place_contexts`)."""
        # [num_layers, num_kv_heads, num_slots, head_dim] views of the whole cache
        k_all, v_all = cache.k.flatten(1, 2).transpose(1, 2), cache.v.flatten(1, 2).transpose(1, 2)
        self.in_place_contexts = [
            (k_all[:, None, :, start:start + ctx_len], v_all[:, None, :, start:start + ctx_len])
            if in_place else None
            for in_place, start, ctx_len in zip(self.context_in_place, self.context_offsets, self.context_lens)]

    def prepare(self, impl: AttentionImpl, group: int, cache: PagedKVCache) -> None:
        """Build the attention masks and context views `impl` needs (once per forward, before the layers)."""
        device = self.token_ids.device
        if impl.uses_block_tables:
            assert self.block_tables is not None, f"{impl.name} batches carry block tables"
            if impl is AttentionImpl.FLEX:
                self.flex_mask = build_flex_mask(self.block_tables, self.query_start, self.context_lens_t,
                                                 self.positions, cache.manager.num_blocks,
                                                 cache.manager.block_size)
            return
        if impl is AttentionImpl.PER_REQUEST:
            self.bind_cache(cache)
            self.masks = []
            for q_len, ctx_len in zip(self.query_lens, self.context_lens):
                if q_len == 1:  # the single new token sees the whole context
                    self.masks.append(None)
                    continue
                i = torch.arange(q_len, device=device)[:, None]
                j = torch.arange(ctx_len, device=device)[None, :]
                mask = j <= (ctx_len - q_len) + i  # [q_len, ctx_len]
                self.masks.append(mask.repeat(group, 1))  # [group * q_len, ctx_len]
        else:
            assert not any(self.context_in_place), "the block-diagonal mask spans gathered contexts only"
            num_requests = len(self.query_lens)
            block_size = cache.manager.block_size
            num_rows = self.gather_blocks.shape[0] * block_size
            request_of_token = torch.repeat_interleave(
                torch.arange(num_requests, device=device),
                torch.tensor(self.query_lens, device=device),
                output_size=sum(self.query_lens))  # [num_tokens]
            offsets = torch.tensor(self.context_offsets, device=device)  # [num_requests]
            rows_per_request = torch.diff(offsets, append=torch.tensor([num_rows], device=device))
            request_of_row = torch.repeat_interleave(  # output sizes known here: no device read
                torch.arange(num_requests, device=device), rows_per_request,
                output_size=num_rows)  # [num_rows]
            pos_of_row = torch.arange(request_of_row.shape[0], device=device) - offsets[request_of_row]
            # A row past the request's context (the unused tail of its last block) has a position
            # beyond every query's, so the causal test masks it too.
            mask = (request_of_token[:, None] == request_of_row[None, :]) & (
                pos_of_row[None, :] <= self.positions[:, None])  # [num_tokens, num_rows]
            self.block_mask = mask.repeat(group, 1)  # [group * num_tokens, num_rows]
            context_of_row = torch.tensor(self.context_lens, device=device)[request_of_row]  # [num_rows]
            self.unused_rows = pos_of_row >= context_of_row  # [num_rows]


class Linear(nn.Module):
    """y = x W^T + b, tuned for CPU matrix libraries; x [num_rows, in_features] (the untransposed
    LM head also takes leading batch dimensions).

    - `transposed=True` stores W^T ([in_features, out_features], contiguous) and multiplies
      x @ W^T directly: for float32 on CPU, MKL's sgemm runs this layout faster than nn.Linear's
      [out, in] (a whole SmolLM2 step: 1.1-1.4x at one row, ~1.05x at 8-64 rows), but the bf16
      kernels run it ~5x slower, so only float32 CPU models use it (the loader transposes the
      checkpoint). The LM head keeps [out, in]: it is tied to the embedding matrix.
    - bf16/fp16 weights on CPUs without bf16 matrix units (AVX2 only) multiply at a fixed ~5
      GFLOP/s, about 4x slower than float32 once more than a few rows share the weights, while a
      single row is bound by memory traffic, where half-size weights win. So at `upcast_min_rows`
      rows or more (None: never) inputs and weights are widened to float32, multiplied, and the
      result rounded back: a bf16 GEMM's fp32-accumulated arithmetic in another summation order.
    """

    upcast_min_rows: int | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        """W reordered into oneDNN's blocked layout (see `pack`); None: not packed."""
        self.blocks: BlockWeight | None = None
        """W as the GGUF file's blocks (see `use_blocks`); None: the dense or packed weight."""
        self.blocks_max_rows: int | None = None
        """Products over more rows than this use the packed weight instead of the blocks; None: never."""

    def use_blocks(self, blocks: BlockWeight, keep_dense: bool, max_rows: int | None = None) -> None:
        """Multiply float32 inputs with W read from its GGUF blocks from now on
        (`dspark.models.quantized_linear`: the same float32 weights, a sixth of the bytes, a
        batch-invariant order). With `max_rows`, products over more rows use the packed weights
        (if packed; faster there). `keep_dense=False` frees the dense weight (and, without
        `max_rows`, the packed one)."""
        self.blocks, self.blocks_max_rows = blocks, max_rows
        if not keep_dense:
            self.weight = None
            if max_rows is None:
                self.packed = None

    def pack(self, keep_dense: bool) -> None:
        """Multiply with a oneDNN-packed copy of W from now on (a CPU, float32 or bf16 where
        oneDNN supports it; see `dspark.models.packed_linear` for the measurements).
        `keep_dense=False` frees the dense weight; the LM head keeps it, as the embedding and the
        drafter share it. Packing twice is a no-op."""
        if self.packed is not None:
            return
        w = self.weight.t() if self.transposed else self.weight  # [out_features, in_features]
        self.packed = pack_weight(w)
        if not keep_dense:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None and x.dtype == torch.float32 and (
                self.packed is None or self.blocks_max_rows is None
                or x.numel() // x.shape[-1] <= self.blocks_max_rows):
            return block_linear(x, self.blocks, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        w, b = self.weight, self.bias
        rows = x.numel() // x.shape[-1]
        if self.upcast_min_rows is not None and rows >= self.upcast_min_rows:
            w, b = w.float(), (None if b is None else b.float())
            return self._product(x.float(), w, b).to(x.dtype)
        return self._product(x, w, b)

    def _product(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, w, b)
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm, bit for bit: normalise in float32, scale in x's dtype
        # (weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)); torch's fused rms_norm does the
        # normalising in one op instead of five (tests/models/test_transformer_norm.py).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if self._kernel_applies(x):  # the same bits in one call (dspark.models.fused_norm)
                return fused_norm.rms_norm(x.view(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, self(h)) with h = x + residual: a decoder layer's residual add and the norm after
        it, one kernel call where `fused_norm` applies (float32 on a CPU, no autograd)."""
        if (x.dtype == torch.float32 and self.weight.dtype == torch.float32 and self._kernel_applies(x)
                and residual.dtype == torch.float32 and residual.is_contiguous() and residual.shape == x.shape):
            h, normed = fused_norm.add_rms_norm(x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]),
                                                self.weight, self.eps)
            return h.view(x.shape), normed.view(x.shape)
        h = x + residual
        return h, self(h)

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        return (x.is_cpu and x.is_contiguous() and x.shape[-1] >= fused_norm.MIN_FEATURES
                and not torch.is_grad_enabled() and fused_norm.lanes() is not None)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-rotation RoPE of x [..., head_dim] (transformers' op order), cos/sin broadcast to x:
    here x [num_tokens, heads, head_dim] with cos/sin [num_tokens, 1, head_dim]; the drafters'
    x [B, heads, n, head_dim] with cos/sin [B, 1, n, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Rotary(nn.Module):
    """cos/sin [num_tokens, head_dim] for arbitrary positions (computed per forward)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.scaling = config.rope.inv_freq_and_scaling(config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2] float32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()  # [num_tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class Attention(nn.Module):
    fused_step: bool = True
    """Run RoPE, the K/V write and PAGED attention as one kernel call where that path applies
    (float32, no q/k norms, no long queries: `rope_write_attention`, the same bits); False: the
    separate steps (tests and benchmarks compare the two)."""

    def __init__(self, config: ModelConfig, transposed: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.group = config.num_queries_per_kv
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, config.qkv_bias, transposed)
        self.o_proj = Linear(q_size, config.hidden_size, config.o_bias, transposed)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: FlatBatch,
                impl: AttentionImpl, cache: PagedKVCache, layer: int) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        if (self.fused_step and impl is AttentionImpl.PAGED and self.q_norm is None and not batch.long_queries
                and qkv.dtype == torch.float32 and cache.k.dtype == torch.float32 and qkv.is_contiguous()):
            # decode and verification on a CPU: RoPE, the K/V write and attention in one kernel
            # call, the same bits as the steps below (tests/models/test_paged_attention.py)
            out = rope_write_attention(qkv, cos, sin, cache.k[layer], cache.v[layer], batch.slot_mapping,
                                       batch.block_tables, batch.query_start, batch.context_lens_t,
                                       self.num_heads, self.scale)  # [num_tokens, num_heads, head_dim]
            return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))
        qkv = qkv.view(num_tokens, -1, self.head_dim)  # [num_tokens, num_heads + 2 * num_kv_heads, head_dim]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [num_tokens, 1, head_dim]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        if self.q_norm is None:  # q and k are adjacent: rotate both with one set of ops
            q, k = apply_rope(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin).split(
                [self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = apply_rope(self.q_norm(qkv[:, :self.num_heads]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, self.num_heads:self.num_heads + self.num_kv_heads]), cos, sin)
        cache.write(layer, batch.slot_mapping, k, v)
        if impl is AttentionImpl.PAGED:
            out = paged_attention(q, cache.k[layer], cache.v[layer], batch.block_tables,
                                  batch.query_start, batch.context_lens_t, self.scale,
                                  LONG_QUERY_MIN_TOKENS)
            long_query_attention(out, q, k, v, cache.k[layer], cache.v[layer], batch.long_queries,
                                 self.scale)
        elif impl is AttentionImpl.PADDED:
            out = padded_attention(q, cache.k[layer], cache.v[layer], batch.block_tables,
                                   batch.query_lens_t, batch.context_lens_t, self.scale,
                                   max(batch.query_lens), max(batch.context_lens))
        elif impl is AttentionImpl.TRITON:
            out = triton_paged_attention(q, cache.k[layer], cache.v[layer], batch.block_tables,
                                         batch.query_start, batch.context_lens_t, self.scale,
                                         max(batch.query_lens))
        elif impl is AttentionImpl.FLEX:
            out = flex_paged_attention(q, cache.k[layer], cache.v[layer], batch.flex_mask, self.scale)
        elif impl is AttentionImpl.BLOCK_DIAGONAL:
            out = self._block_diagonal(q, batch, cache, layer)
        else:
            out = self._per_request(q, batch, cache, layer)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _gathered(self, batch: FlatBatch, cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_kv_heads, rows, head_dim] of the contexts whose blocks are scattered (a copy)."""
        k, v = cache.gather(layer, batch.gather_blocks)  # [rows, num_kv_heads, head_dim]
        if batch.unused_rows is not None:
            k.masked_fill_(batch.unused_rows[:, None, None], 0.0)  # [rows, num_kv_heads, head_dim]
            v.masked_fill_(batch.unused_rows[:, None, None], 0.0)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _block_diagonal(self, q: torch.Tensor, batch: FlatBatch, cache: PagedKVCache,
                        layer: int) -> torch.Tensor:
        """One SDPA call over all gathered contexts: q [num_tokens, num_heads, head_dim] ->
        [num_tokens, num_kv_heads, group, head_dim]."""
        num_tokens = q.shape[0]
        k, v = self._gathered(batch, cache, layer)
        # Query heads of one KV group stacked along the sequence: [num_kv_heads, group * num_tokens, head_dim]
        q = q.view(num_tokens, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        q = q.reshape(self.num_kv_heads, self.group * num_tokens, self.head_dim)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=batch.block_mask,
                                             scale=self.scale)[0]
        return out.view(self.num_kv_heads, self.group, num_tokens, self.head_dim).permute(2, 0, 1, 3)

    def _per_request(self, q: torch.Tensor, batch: FlatBatch, cache: PagedKVCache,
                     layer: int) -> torch.Tensor:
        """One SDPA call per request over its own context: q [num_tokens, num_heads, head_dim] ->
        [num_tokens, num_kv_heads, group, head_dim] (contiguous).

        At 16 requests x 1 new token this loop runs 16 times per layer, so each iteration is kept
        to a few tensor ops: in-place contexts come from `batch.in_place_contexts` by one index, a
        single new token's query heads are already SDPA's [1, num_kv_heads, group, head_dim], and
        the outputs are joined by one `cat` at the end.
        """
        num_tokens = q.shape[0]
        if batch.gather_blocks.numel():
            k_gathered, v_gathered = self._gathered(batch, cache, layer)
        q_tokens = q.view(num_tokens, 1, self.num_kv_heads, self.group, self.head_dim)
        outs: list[torch.Tensor] = []
        q_start = 0
        for q_len, ctx_len, ctx_start, views, mask in zip(
                batch.query_lens, batch.context_lens, batch.context_offsets, batch.in_place_contexts,
                batch.masks):
            if views is not None:
                k_r, v_r = views[0][layer], views[1][layer]  # [1, num_kv_heads, ctx_len, head_dim]
            else:
                k_r = k_gathered[None, :, ctx_start:ctx_start + ctx_len]
                v_r = v_gathered[None, :, ctx_start:ctx_start + ctx_len]
            if q_len == 1:
                # [1, num_kv_heads, group, head_dim]: the token's query heads, group along "sequence"
                outs.append(F.scaled_dot_product_attention(q_tokens[q_start], k_r, v_r, scale=self.scale))
            else:
                q_r = q_tokens[q_start:q_start + q_len, 0].permute(1, 2, 0, 3).reshape(
                    1, self.num_kv_heads, self.group * q_len, self.head_dim)
                # 4-D inputs: the CPU flash kernel takes only [batch, heads, seq, head_dim].
                out_r = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=mask, scale=self.scale)
                outs.append(out_r.view(self.num_kv_heads, self.group, q_len, self.head_dim).permute(2, 0, 1, 3))
            q_start += q_len
        return torch.cat(outs, dim=0)  # [num_tokens, num_kv_heads, group, head_dim]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, transposed: bool) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, transposed)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, transposed: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, transposed)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, transposed)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: FlatBatch,
                impl: AttentionImpl, cache: PagedKVCache, layer: int) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(h), cos, sin, batch, impl, cache, layer)
        h, x = self.post_attention_layernorm.add_forward(h, attended)  # h + attended, its norm
        return h + self.mlp(x)


class Transformer(nn.Module):
    """Decoder-only causal LM. `embed_tokens`, `norm` and `lm_head` are public: the drafter shares them.

    `transposed_projections`: the layers' projections store W^T (see `Linear`; for float32 on CPU).
    """

    def __init__(self, config: ModelConfig, transposed_projections: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, transposed_projections)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, transposed=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config)
        self.block_loop: BlockLayerLoop | None = None
        """The layers as one loop of kernel calls, set when every projection is on GGUF blocks
        (`use_block_weights`); passes it applies to skip the module calls (same bits)."""

    def forward(self, batch: FlatBatch, cache: PagedKVCache, impl: AttentionImpl,
                hidden_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run all layers over the flattened batch, writing its K/V into `cache`.

        Returns the last layer's output [num_tokens, hidden_size] (before the final norm) and, when
        `hidden_layer_ids` is non-empty, those layers' outputs [num_tokens, len(hidden_layer_ids), hidden_size].
        """
        h = self.embed_tokens(batch.token_ids)  # [num_tokens, hidden_size]
        cos, sin = self.rotary(batch.positions, h.dtype)
        loop = self.block_loop
        if loop is not None and impl is AttentionImpl.PAGED and loop.applies(h, cache.k.dtype, bool(batch.long_queries)):
            h, captured = loop.run(h, cos, sin, batch, cache, hidden_layer_ids)
        else:
            captured: dict[int, torch.Tensor] = {}
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, batch, impl, cache, i)
                if i in hidden_layer_ids:
                    captured[i] = h
        hidden = torch.stack([captured[i] for i in hidden_layer_ids], dim=1) if hidden_layer_ids else None
        return h, hidden

    def pack_linear_weights(self) -> None:
        """Multiply with oneDNN-packed weights from now on (a CPU; see `Linear.pack`).
        The layers' dense projection weights are freed; the LM head keeps its (shared) weight."""
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.pack(keep_dense=False)
        self.lm_head.pack(keep_dense=True)

    def use_block_weights(self, weights: dict[str, BlockWeight], max_rows: int | None = None) -> None:
        """Multiply with GGUF blocks from now on (`Linear.use_blocks`): `weights` by module name
        (`layers.{i}.self_attn.qkv_proj`, ..., `lm_head`; `dspark.models.gguf_blocks`), up to
        `max_rows` rows per product where the weights are also packed. The layers' dense weights
        are freed; the LM head keeps its (shared) weight."""
        modules = dict(self.named_modules())
        for name, blocks in weights.items():
            module = modules[name]
            if not isinstance(module, Linear):
                raise ValueError(f"{name} is not a Linear")
            module.use_blocks(blocks, keep_dense=name == "lm_head", max_rows=max_rows)
        self.block_loop = self._block_layer_loop(max_rows)

    def _block_layer_loop(self, max_rows: int | None) -> BlockLayerLoop | None:
        """The layers as a `BlockLayerLoop` when every projection has blocks, no layer has q/k
        norms and the hidden size takes the fused norm; else None (the module path)."""
        layers, packed = [], False
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.q_norm is not None or any(lin.blocks is None for lin in linears):
                return None
            # packed weights beside the blocks: passes over max_rows take them (the module path)
            packed |= any(lin.packed is not None for lin in linears)
            layers.append(LayerWeights(
                layer.input_layernorm.weight.detach(), attn.qkv_proj.blocks, _bias(attn.qkv_proj),
                attn.o_proj.blocks, _bias(attn.o_proj), layer.post_attention_layernorm.weight.detach(),
                mlp.gate_up_proj.blocks, _bias(mlp.gate_up_proj), mlp.down_proj.blocks, _bias(mlp.down_proj)))
        if self.config.hidden_size < fused_norm.MIN_FEATURES or not layers:
            return None
        attn = self.layers[0].self_attn
        return BlockLayerLoop(layers, attn.num_heads, attn.head_dim, self.config.intermediate_size,
                              self.config.rms_norm_eps, attn.scale, max_rows if packed else None)

    def set_upcast_min_rows(self, rows: int | None) -> None:
        """Rows from which bf16/fp16 matrix products run in float32 (see `Linear`); None: never."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.upcast_min_rows = rows

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: h [num_rows, hidden_size] (a layer output) -> logits [num_rows, vocab_size] float32."""
        return self.lm_head(self.norm(h)).float()


def _bias(linear: Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()
