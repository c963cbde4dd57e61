"""The decoder layers on GGUF blocks as one loop of kernel calls (CPU, float32, PAGED attention).

With every projection on the GGUF blocks (weights=q4), a decoder layer on a CPU is eight kernel
calls and three torch operators: RMSNorm, the q|k|v product, RoPE + K/V write + attention
(`rope_write_attention`), the o product, residual add + RMSNorm, the gate|up product, SiLU and
the gate's multiply, the down product and the residual add. `DecoderLayer.forward` reaches the
same calls through ten module calls a layer and the checks each makes to pick its path; at one
decode row of SmolLM2 that Python is a fixed cost on one core, whatever the thread count.
`BlockLayerLoop` binds each layer's kernels and weights once and `run` calls them back to back:
the same calls with the same arguments in the same order as the module path, so the same bits
(tests/models/test_block_layer_loop.py). `Transformer.forward` takes it for every pass it applies
to (`applies`); any other pass (prompt chunks over `max_rows`, long queries, autograd, the separate
steps the tests compare) keeps the module path.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dspark.models import fused_norm
from dspark.models import paged_attention as paged_attention_module
from dspark.models import quantized_linear
from dspark.models.quantized_linear import BlockFormat, BlockWeight

__all__ = ["BlockLayerLoop", "LayerWeights"]


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the kernels take them."""

    input_norm: torch.Tensor
    """[hidden_size] float32."""
    qkv: BlockWeight
    qkv_bias: torch.Tensor | None
    o: BlockWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    """[hidden_size] float32."""
    gate_up: BlockWeight
    gate_up_bias: torch.Tensor | None
    down: BlockWeight
    down_bias: torch.Tensor | None


def _product_fn(ext, weight: BlockWeight):
    return ext.q4_1_linear if weight.format is BlockFormat.Q4_1 else ext.q8_0_linear


class BlockLayerLoop:
    """The layers of one `Transformer` whose projections are all GGUF blocks (see module doc)."""

    def __init__(self, layers: list[LayerWeights], num_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, scale: float, max_rows: int | None) -> None:
        self.layers = layers
        self.num_heads, self.head_dim = num_heads, head_dim
        self.intermediate_size = intermediate_size
        self.eps, self.scale = eps, scale
        self.max_rows = max_rows
        """Passes over more rows take the module path (its products use the packed weights); None: any."""

    def applies(self, h: torch.Tensor, cache_dtype: torch.dtype, long_queries: bool) -> bool:
        """Whether a pass of h [num_tokens, hidden_size] runs on the loop: float32 on a CPU without
        autograd, a float32 cache, no long queries (SDPA runs those), the fused norm and attention
        kernels on (`fused_norm.lanes()`, `Attention.fused_step`: the tests switch them off to
        compare with the separate steps), at most `max_rows` rows."""
        from dspark.models.transformer import Attention

        return (h.dtype == torch.float32 and h.is_cpu and cache_dtype == torch.float32 and not long_queries
                and not torch.is_grad_enabled() and Attention.fused_step
                and (self.max_rows is None or h.shape[0] <= self.max_rows)
                and fused_norm.lanes() is not None)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache,
            hidden_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """All layers over h [num_tokens, hidden_size] (the embeddings), writing K/V into `cache`
        (a PagedKVCache); cos, sin [num_tokens, head_dim]; `batch` a FlatBatch with block tables.
        Returns the last layer's output and the outputs of `hidden_layer_ids` by layer."""
        norm_ext = fused_norm._extension()
        lanes = fused_norm.lanes()
        norm, add_norm = norm_ext.rms_norm, norm_ext.add_rms_norm
        attend = paged_attention_module._cpu_extension().rope_write_attention
        block_ext = quantized_linear._extension()
        profiling = torch.autograd._profiler_enabled()
        eps, scale, heads, inter = self.eps, self.scale, self.num_heads, self.intermediate_size
        num_tokens = h.shape[0]
        k_layers, v_layers = cache.k.unbind(0), cache.v.unbind(0)  # num_layers x [num_blocks, block_size, kv_heads, head_dim]
        slots, tables, starts, lens = batch.slot_mapping, batch.block_tables, batch.query_start, batch.context_lens_t
        captured: dict[int, torch.Tensor] = {}
        for i, w in enumerate(self.layers):
            x = norm(h, w.input_norm, eps, lanes)  # [num_tokens, hidden_size]
            qkv = _product(block_ext, x, w.qkv, w.qkv_bias, profiling)  # [num_tokens, (heads + 2 kv_heads) * head_dim]
            out = _attend(attend, qkv, cos, sin, k_layers[i], v_layers[i], slots, tables, starts, lens, heads,
                          scale, profiling)  # [num_tokens, heads, head_dim]
            attended = _product(block_ext, out.view(num_tokens, heads * self.head_dim), w.o, w.o_bias, profiling)
            h, x = add_norm(attended, h, w.post_norm, eps, lanes)  # h + attended, its norm
            gate_up = _product(block_ext, x, w.gate_up, w.gate_up_bias, profiling)  # [num_tokens, 2 * inter]
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [num_tokens, inter]
            h = h + _product(block_ext, act, w.down, w.down_bias, profiling)
            if i in hidden_layer_ids:
                captured[i] = h
        return h, captured


def _product(ext, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None, profiling: bool) -> torch.Tensor:
    fn = _product_fn(ext, weight)
    if profiling:
        with torch.profiler.record_function(quantized_linear.PROFILER_LABEL):
            return fn(x, weight.blocks, bias)
    return fn(x, weight.blocks, bias)


def _attend(fn, qkv, cos, sin, k, v, slots, tables, starts, lens, heads, scale, profiling) -> torch.Tensor:
    if profiling:
        with torch.profiler.record_function(paged_attention_module.PROFILER_LABEL):
            return fn(qkv, cos, sin, k, v, slots, tables, starts, lens, heads, scale, 0)
    return fn(qkv, cos, sin, k, v, slots, tables, starts, lens, heads, scale, 0)
