"""Eagle-style autoregressive drafter: the paper's Eagle3 comparison (docs/design.md section 8).

Glossary (EAGLE / EAGLE-3 conventions)
- fused feature g_j = fc([H^(l1)_j; ...; H^(lm)_j]): the target's features of position j, fused by
  the same kind of `fc` as DSpark's (m layers -> hidden).
- element j: the drafter's input at position j pairs the embedding of token x_j with the hidden
  state that produced x_j: g_{j-1} (the target's, for context tokens) or the drafter's own output
  at j-1 (for drafted tokens). g_{-1} = 0. The layer reads
  `[input_layernorm(embed(x_j)); hidden_norm(hidden_{j-1})]` (2 * hidden wide), its residual
  stream is hidden_{j-1}, and its output o_j (pre-norm) predicts x_{j+1} through
  `lm_head(norm(o_j))` and is the hidden input of element j+1.
- KV cache: keys/values of element j depend only on element j's input, so the per-request cache
  holds the context elements (true features); drafting appends elements for the anchor and each
  drafted token, token by token (gamma sequential single-layer passes).
- training-time test (TTT): training unrolls the same gamma steps per anchor with teacher-forced
  tokens but the drafter's own hidden states, so training sees what drafting sees.
- confidence: this drafter has no confidence head; `c_k` is the max probability of its raw
  (temperature 1) distribution at position k, a heuristic that depends on x_<k only.

Same `append_context` / `release` / `draft(...) -> list[DraftBlock]` interface as the DSpark
drafter, except that `append_context` needs the token ids of the appended positions.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.context_kv_cache import ContextKVCache
from dspark.models.draft_processing import DraftProcessing
from dspark.models.draft_sampling import (
    assemble_blocks,
    draft_uniforms,
    plan_rows,
    position_noise,
    sample_block_position,
)
from dspark.models.draft_types import (
    BlockTrainOutputs,
    DraftBlock,
    DraftRequest,
    positions_to_draft,
)
from dspark.models.drafter import FrozenTargetHead
from dspark.models.drafter_config import Architecture, DrafterConfig, SequentialHead
from dspark.models.drafter_layers import DrafterMLP, rope_cos_sin
from dspark.models.transformer import RMSNorm, apply_rope


def eagle_config(target_config: dict, *, target_layer_ids: list[int], block_size: int = 7,
                 draft_vocab_size: int | None = None, mask_token_id: int = 0) -> DrafterConfig:
    """The Eagle-style drafter's config for a target (one layer, no extra heads)."""
    return DrafterConfig.from_target_config(
        target_config, architecture=Architecture.EAGLE, num_hidden_layers=1,
        block_size=block_size, target_layer_ids=target_layer_ids,
        markov_head_type=SequentialHead.NONE, markov_rank=0, enable_confidence_head=False,
        confidence_head_with_markov=False, draft_vocab_size=draft_vocab_size,
        mask_token_id=mask_token_id)


class EagleAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        bias = config.attention_bias
        self.q_proj = nn.Linear(2 * d, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(2 * d, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=bias)

    def project_kv(self, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """x2 [B, n, 2 * hidden] -> k, v [B, num_kv_heads, n, head_dim] (k rotated)."""
        B, n, _ = x2.shape
        k = self.k_proj(x2).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x2).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos.unsqueeze(1), sin.unsqueeze(1)), v  # cos/sin [B, 1, n, head_dim]

    def query(self, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x2 [B, n, 2 * hidden] -> q [B, heads, n, head_dim] (rotated)."""
        B, n, _ = x2.shape
        q = self.q_proj(x2).view(B, n, self.num_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))  # cos/sin [B, 1, n, head_dim]

    def attend(self, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
               ctx_mask: torch.Tensor, chain_k: torch.Tensor, chain_v: torch.Tensor) -> torch.Tensor:
        """Each query n attends to the shared context (masked) and to its own chain.

        q [B, heads, N, head_dim]; ctx_k/ctx_v [B, kv_heads, L, head_dim]; ctx_mask [B, N, L] bool;
        chain_k/chain_v [B, kv_heads, N, s, head_dim] (s >= 1: element n's own chain so far).
        Returns o_proj(attention) [B, N, hidden].
        """
        B, H, N, hd = q.shape
        rep = H // self.num_kv_heads
        ck = ctx_k.repeat_interleave(rep, dim=1)  # [B, H, L, hd]
        cv = ctx_v.repeat_interleave(rep, dim=1)
        hk = chain_k.repeat_interleave(rep, dim=1)  # [B, H, N, s, hd]
        hv = chain_v.repeat_interleave(rep, dim=1)
        scale = hd ** -0.5
        s_ctx = torch.einsum("bhnd,bhld->bhnl", q, ck) * scale  # [B, H, N, L]
        s_ctx = s_ctx.masked_fill(~ctx_mask.unsqueeze(1), float("-inf"))
        s_chain = torch.einsum("bhnd,bhnsd->bhns", q, hk) * scale  # [B, H, N, s]
        weights = torch.softmax(torch.cat([s_ctx, s_chain], dim=-1).float(), dim=-1).to(q.dtype)
        L = ck.shape[2]
        out = (torch.einsum("bhnl,bhld->bhnd", weights[..., :L], cv)
               + torch.einsum("bhns,bhnsd->bhnd", weights[..., L:], hv))  # [B, H, N, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, N, H * hd))


class EagleLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = EagleAttention(config)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def layer_input(self, token_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] x 2 -> [..., 2 * hidden]."""
        return torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = hidden + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class _EagleRequest:
    """The last fused feature (pairs with the next token) and its position."""

    def __init__(self, pending: torch.Tensor, last_position: int) -> None:
        self.pending = pending  # [hidden]
        self.last_position = last_position


class EagleDrafter(FrozenTargetHead):
    """One-layer autoregressive drafter on fused target features (EAGLE-3 style)."""

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None,
                 draft_token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        if config.architecture != Architecture.EAGLE:
            raise ValueError("EagleDrafter needs a config with architecture EAGLE")
        self.config = config
        self.gamma = config.block_size
        d = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * d, d, bias=False)
        self.midlayer = EagleLayer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self._init_target_buffers()
        self._cache = ContextKVCache()
        self._requests: dict[Hashable, _EagleRequest] = {}
        if embed_weight is not None and lm_head_weight is not None:
            self.set_target_weights(embed_weight, lm_head_weight, draft_token_ids)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    # ---- training (training-time test over N anchors per sequence) -----------------------------

    def forward_train(self, input_ids: torch.Tensor, features: torch.Tensor,
                      anchors: torch.Tensor, labels: torch.Tensor) -> BlockTrainOutputs:
        """input_ids [B, T]; features [B, T, m * hidden]; anchors [B, N] (>= 1); labels
        [B, N, gamma] = x*_{a+1..a+gamma}. Step s of chain a predicts x_{a+s+1} from element a+s,
        whose token is teacher forced and whose hidden is the drafter's own output of step s-1."""
        self._check_ready()
        B, T = input_ids.shape
        N, gamma = anchors.shape[1], self.gamma
        layer, attn = self.midlayer, self.midlayer.self_attn
        dtype = self.fc.weight.dtype
        g = self.fc(features.to(dtype))  # [B, T, hidden]
        hid_in = torch.cat([g.new_zeros(B, 1, g.shape[-1]), g[:, :-1]], dim=1)  # g_{j-1}
        x2 = layer.layer_input(F.embedding(input_ids, self.embed_weight), hid_in)  # [B, T, 2h]
        cos, sin = self._rope(torch.arange(T, device=input_ids.device).expand(B, T), dtype)
        ctx_k, ctx_v = attn.project_kv(x2, cos, sin)  # [B, kv, T, hd]: true elements 0..T-1
        # Context = true elements < a; element a (anchor, true feature g_{a-1}) is chain step 0.
        ctx_mask = torch.arange(T, device=input_ids.device).view(1, 1, T) < anchors.unsqueeze(-1)
        idx = anchors.unsqueeze(-1)  # [B, N, 1]
        x2_s = x2.gather(1, idx.expand(B, N, x2.shape[-1]))  # [B, N, 2h]
        hidden = hid_in.gather(1, idx.expand(B, N, hid_in.shape[-1]))  # [B, N, h]
        chain_k = chain_v = None
        outs = []
        for s in range(gamma):
            pos = anchors + s  # [B, N]
            cos_s, sin_s = self._rope(pos, dtype)
            k_s, v_s = attn.project_kv(x2_s, cos_s, sin_s)  # [B, kv, N, hd]
            chain_k = k_s.unsqueeze(3) if chain_k is None else torch.cat(
                [chain_k, k_s.unsqueeze(3)], dim=3)  # [B, kv, N, s+1, hd]
            chain_v = v_s.unsqueeze(3) if chain_v is None else torch.cat(
                [chain_v, v_s.unsqueeze(3)], dim=3)
            q = attn.query(x2_s, cos_s, sin_s)
            out = layer.finish(hidden, attn.attend(q, ctx_k, ctx_v, ctx_mask, chain_k, chain_v))
            outs.append(out)
            if s + 1 < gamma:
                hidden = out
                x2_s = layer.layer_input(F.embedding(labels[..., s], self.embed_weight), hidden)
        logits = self.base_logits(self.norm(torch.stack(outs, dim=2)))  # [B, N, gamma, V_d]
        return BlockTrainOutputs(logits, None)

    # ---- inference -------------------------------------------------------------------------

    def append_context(self, request_id: Hashable, features: torch.Tensor,
                       positions: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        """Context tokens token_ids [n] at consecutive positions [n] with their target features
        [n, m * hidden]. Element j pairs token j with the fused feature of position j-1."""
        if token_ids is None:
            raise ValueError("the Eagle-style drafter needs the token ids of the context")
        n = features.shape[0]
        assert features.dim() == 2 and positions.shape == (n,) and token_ids.shape == (n,)
        if n == 0:
            return
        self._check_ready()
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        host_positions = positions.to(torch.int64)  # [n]: they come from the host
        positions = host_positions.to(device, non_blocking=True)
        state = self._requests.get(request_id)
        first = int(host_positions[0])
        if state is None:
            pending = torch.zeros(self.config.hidden_size, device=device, dtype=dtype)
        else:
            if first != state.last_position + 1:
                raise ValueError(f"context positions must continue at {state.last_position + 1}, "
                                 f"got {first}")
            pending = state.pending
        if n > 1 and not bool((host_positions[1:] == host_positions[:-1] + 1).all()):
            raise ValueError("context positions must be consecutive")
        with torch.no_grad():
            g = self.fc(features.to(device=device, dtype=dtype))  # [n, hidden]
            hid_in = torch.cat([pending.unsqueeze(0), g[:-1]], dim=0)
            x2 = self.midlayer.layer_input(F.embedding(token_ids.to(device), self.embed_weight),
                                           hid_in)
            cos, sin = self._rope(positions.unsqueeze(0), dtype)
            k, v = self.midlayer.self_attn.project_kv(x2.unsqueeze(0), cos, sin)  # [1, kv, n, hd]
        # "num_layers" axis = batch axis of 1; each token's fused feature g kept beside its K/V
        # (a fork's child continues from the g of its last copied position).
        self._cache.append(request_id, k, v, positions, hidden=g,
                           host_positions=host_positions)
        self._requests[request_id] = _EagleRequest(g[-1], int(host_positions[-1]))

    def release(self, request_id: Hashable) -> None:
        self._cache.release(request_id)
        self._requests.pop(request_id, None)

    def fork(self, parent_id: Hashable, child_id: Hashable, num_positions: int) -> None:
        """`child_id`'s context: `parent_id`'s context tokens at positions < num_positions,
        continuing from the fused feature of the last of them."""
        self._cache.fork(parent_id, child_id, num_positions)
        self._requests.pop(child_id, None)
        ctx = self._cache.get(child_id)
        if ctx is not None:
            self._requests[child_id] = _EagleRequest(ctx.hidden[ctx.length - 1].clone(),
                                                     ctx.last_position)

    def context_length(self, request_id: Hashable) -> int:
        return self._cache.length(request_id)

    @torch.no_grad()
    def draft(self, requests: Sequence[DraftRequest], sparse_top_k: int | None = None,
              num_positions: int | None = None) -> list[DraftBlock]:
        """Draft gamma tokens per request (or the first `num_positions`), one single-layer pass
        per token for all requests."""
        self._check_ready()
        if not requests:
            return []
        cfg, gamma = self.config, self.gamma
        n = positions_to_draft(num_positions, gamma)
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        R = len(requests)
        layer, attn = self.midlayer, self.midlayer.self_attn
        keys, values, ctx_pos = self._cache.gather(
            [r.request_id for r in requests], 1, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        ctx_k, ctx_v = keys[0], values[0]  # [R, kv, L, hd]
        anchor_pos = torch.tensor([r.anchor_position for r in requests], dtype=torch.int64,
                                  device=device)
        ctx_mask = (ctx_pos < anchor_pos.unsqueeze(1)).unsqueeze(1)  # [R, 1, L]
        for r in requests:  # the anchor element pairs x_a with g_{a-1}: the last context feature
            state = self._requests.get(r.request_id)
            if state is not None and r.anchor_position != state.last_position + 1:
                raise ValueError(f"request {r.request_id!r}: anchor at {r.anchor_position}, but "
                                 f"its context ends at {state.last_position}")
        hidden = torch.stack([
            self._requests[r.request_id].pending if r.request_id in self._requests
            else torch.zeros(cfg.hidden_size, device=device, dtype=dtype)
            for r in requests]).unsqueeze(1)  # [R, 1, h]: g_{a-1}
        prev = torch.tensor([r.anchor_token for r in requests], dtype=torch.int64, device=device)
        plan = plan_rows(requests, self.draft_vocab_size, sparse_top_k, device)
        uniforms = None if plan.all_greedy else draft_uniforms(requests, gamma, device)
        reduced = cfg.draft_vocab_size is not None
        target_ids = (self.draft_to_target if reduced  # [V_d]: the target id of each draft id
                      else torch.arange(self.draft_vocab_size, device=device))
        processing = DraftProcessing.plan(requests, self.target_to_draft if reduced else None,
                                          target_ids, device)
        chain_k = chain_v = None
        samples, confidences = [], []
        for s in range(n):
            x2 = layer.layer_input(F.embedding(prev, self.embed_weight).unsqueeze(1), hidden)
            cos, sin = self._rope((anchor_pos + s).unsqueeze(1), dtype)  # [R, 1, hd]
            k_s, v_s = attn.project_kv(x2, cos, sin)  # [R, kv, 1, hd]
            chain_k = k_s.unsqueeze(3) if chain_k is None else torch.cat(
                [chain_k, k_s.unsqueeze(3)], dim=3)
            chain_v = v_s.unsqueeze(3) if chain_v is None else torch.cat(
                [chain_v, v_s.unsqueeze(3)], dim=3)
            out = layer.finish(hidden, attn.attend(attn.query(x2, cos, sin), ctx_k, ctx_v,
                                                   ctx_mask, chain_k, chain_v))  # [R, 1, h]
            logits = self.base_logits(self.norm(out[:, 0]))  # [R, V_d]
            confidences.append(torch.softmax(logits, dim=-1).max(dim=-1).values)
            if processing is not None:  # q is the processed distribution (draft_processing)
                logits = processing.apply(s, logits)
            u_s = None if uniforms is None else uniforms[:, s]
            sample = sample_block_position(logits, plan, u_s,
                                           position_noise(plan, s + 1, target_ids))
            samples.append(sample)
            prev = self.draft_to_target[sample.tokens] if reduced else sample.tokens
            if processing is not None:
                processing.advance(sample.tokens, prev)
            hidden = out
        if processing is not None:
            processing.finish()
        return assemble_blocks(plan, samples, torch.stack(confidences, dim=1),
                               self.draft_to_target if reduced else None)
