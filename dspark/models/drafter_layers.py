"""The drafter's Qwen3-style layers: attention that takes the context as extra keys and values,
the SiLU-gated MLP, and the pre-norm layer around them (docs/design.md section 3).

Glossary
- H_ctx: the context tokens' target features fused to the drafter's width,
  `H_ctx = hidden_norm(fc(features))` [num_tokens, hidden_size].
- context K/V injection: in every drafter layer i the context enters only as extra keys and values,
  `K_i = [k_proj(H_ctx); k_proj(h_d)]`, `V_i = [v_proj(H_ctx); v_proj(h_d)]` (k_norm and RoPE at
  the context tokens' absolute positions), as in DFlash / DeepSpec. The block's own queries, keys
  and values come from its hidden states h_d.

RMSNorm and the half-rotation RoPE are the target transformer's (`dspark.models.transformer`):
the same op order, so the drafter's numbers and its checkpoint are unchanged by sharing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.drafter_config import DrafterConfig
from dspark.models.packed_linear import pack_weight, packed_linear
from dspark.models.transformer import RMSNorm, apply_rope

if TYPE_CHECKING:
    from dspark.models.context_kv_cache import RequestContext


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., n] int64 -> cos, sin [..., n, head_dim] (default RoPE, HF layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))  # [head_dim/2]
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., n, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., n, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DrafterAttention(nn.Module):
    """Attention whose keys/values are [context; block], context projected from H_ctx."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.qkv_packed: torch.Tensor | None = None
        """Inference on a CPU (`pack_fused`): [q; k; v] weights in one oneDNN-packed product."""
        self.kv_packed: torch.Tensor | None = None
        """The same for [k; v] (the context's projection)."""
        self.qkv_bias: torch.Tensor | None = None
        self.kv_bias: torch.Tensor | None = None

    def pack_fused(self) -> None:
        """Inference only (no autograd): q, k and v in one packed product, and k and v in another,
        instead of one product each (a third of the calls; at 8 rows 37 against 82 us)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        self.qkv_packed = pack_weight(torch.cat([q.weight, k.weight, v.weight]))
        self.kv_packed = pack_weight(torch.cat([k.weight, v.weight]))
        self.qkv_bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
        self.kv_bias = None if k.bias is None else torch.cat([k.bias, v.bias])

    def _finish_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k, v [B, n, num_kv_heads * head_dim] -> [B, num_kv_heads, n, head_dim], k normed
        and rotated (cos/sin [B, n, head_dim])."""
        B, n, _ = k.shape
        k = self.k_norm(k.view(B, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos.unsqueeze(1), sin.unsqueeze(1)), v  # cos/sin [B, 1, n, head_dim]

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, hidden] -> k, v [B, num_kv_heads, n, head_dim] (k normed and rotated)."""
        if self.kv_packed is None:
            return self._finish_kv(self.k_proj(x), self.v_proj(x), cos, sin)
        k, v = packed_linear(x, self.kv_packed, self.kv_bias).chunk(2, dim=-1)
        return self._finish_kv(k, v, cos, sin)

    def _project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, Q, hidden] -> q [B, heads, Q, head_dim] (normed, rotated) and project_kv's k, v."""
        B, Q, _ = x.shape
        if self.qkv_packed is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = packed_linear(x, self.qkv_packed, self.qkv_bias).split(
                [self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))  # [B, heads, Q, head_dim]
        return (q, *self._finish_kv(k, v, cos, sin))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, hidden] (after input_layernorm); cos/sin [B, Q, head_dim] at block positions;
        ctx_k/ctx_v [B, num_kv_heads, L, head_dim]; mask [B, Q, L + Q] bool (True = attend)."""
        B, Q, _ = x.shape
        q, k_blk, v_blk = self._project_qkv(x, cos, sin)  # [B, heads or kv_heads, Q, head_dim]
        k = torch.cat([ctx_k, k_blk], dim=2)  # [B, kv_heads, L + Q, head_dim]
        v = torch.cat([ctx_v, v_blk], dim=2)
        assert mask.shape == (B, Q, k.shape[2]), (mask.shape, B, Q, k.shape)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1),
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))

    def forward_padded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Inference, one attention call for all requests: x [R, Q, hidden]; keys/values
        [R, num_kv_heads, L + Q, head_dim], the padded contexts (`context_kv_cache.gather_padded`)
        whose last Q slots receive the block's own keys/values (written here); mask [R, Q, L + Q]
        bool (True = attend). Equal to `forward_cached` up to float rounding: padding slots are
        masked, so they add exactly zero."""
        R, Q, _ = x.shape
        L = keys.shape[2] - Q
        assert keys.shape[0] == R and mask.shape == (R, Q, L + Q), (keys.shape, mask.shape, R, Q)
        q, k_blk, v_blk = self._project_qkv(x, cos, sin)  # [R, heads or kv_heads, Q, head_dim]
        keys[:, :, L:] = k_blk
        values[:, :, L:] = v_blk
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(1),
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.num_heads * self.head_dim))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       contexts: Sequence[RequestContext], layer: int,
                       masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Inference: x [R, Q, hidden]; request r attends to its own cached context of `layer`
        plus its block, read in place (the block's keys/values go to the context's scratch slots).
        masks[r]: [Q, L_r + Q] bool or None (= everything visible)."""
        R, Q, _ = x.shape
        q, k_blk, v_blk = self._project_qkv(x, cos, sin)  # [R, heads or kv_heads, Q, head_dim]
        gqa = self.num_heads != self.num_kv_heads
        outs = []
        for r, ctx in enumerate(contexts):  # requests in order: duplicates are safe
            end = ctx.length + Q
            keys, values = ctx.keys[layer], ctx.values[layer]  # [kv_heads, capacity, head_dim]
            keys[:, ctx.length: end] = k_blk[r]
            values[:, ctx.length: end] = v_blk[r]
            mask = None if masks[r] is None else masks[r].view(1, 1, Q, end)
            outs.append(F.scaled_dot_product_attention(
                q[r: r + 1], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                enable_gqa=gqa))
        out = torch.cat(outs)  # [R, heads, Q, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.gate_up_packed: torch.Tensor | None = None
        """Inference on a CPU (`pack_fused`): [gate; up] weights in one oneDNN-packed product."""

    def pack_fused(self) -> None:
        """Inference only (no autograd): gate and up in one packed product."""
        self.gate_up_packed = pack_weight(torch.cat([self.gate_proj.weight, self.up_proj.weight]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_packed is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = packed_linear(x, self.gate_up_packed, None).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_padded(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_padded(self.input_layernorm(x), cos, sin, keys, values, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       contexts: Sequence[RequestContext], layer: int,
                       masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, contexts, layer,
                                              masks)
        return x + self.mlp(self.post_attention_layernorm(x))

