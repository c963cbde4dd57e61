"""The DSpark drafter: a parallel backbone plus a tiny sequential head (DESIGN.md section 3).

Glossary
- target features: hidden states of m chosen target layers l_1..l_m for every context token,
  concatenated: [num_tokens, m * hidden_size]. Fused as `H_ctx = hidden_norm(fc(features))`.
- context K/V injection: in every drafter layer i the context enters only as extra keys and values,
  `K_i = [k_proj(H_ctx); k_proj(h_d)]`, `V_i = [v_proj(H_ctx); v_proj(h_d)]` (k_norm and RoPE at
  the context tokens' absolute positions), as in DFlash / DeepSpec. The drafter keeps these per
  request (`ContextKVCache`) and appends each round's accepted tokens' features.
- anchor x_0: the last token already produced (the previous round's bonus token), at position a.
  Its target features do not exist yet, so block positions see only context positions < a.
- block: gamma input positions at positions a..a+gamma-1 = embedding of x_0, then gamma-1 copies of
  the embedding of `mask_token_id`; attention inside the block is bidirectional. Block position k
  (1-based) emits h_k and base logits `U_k = lm_head(norm(h_k))` and predicts x_k.
- sequential head: `p_k = softmax(U_k + B_k(x_0, x_<k))`, sampled left to right. `markov`:
  `B = W1[x_{k-1}] W2^T`; `rnn`: gated state over the prefix; `none`: DFlash (no bias).
- confidence c_k = sigmoid(proj([norm(h_k); W1[x_{k-1}]])): a function of x_{<k} only, never of x_k.
  (Head `none`: proj(norm(h_k)), see drafter_config.)
- draft distribution p^d_k: exactly the distribution x_k was drawn from, after the request's
  temperature / top-k / top-p (`dspark.sampling.probs_from_logits`) and any truncation; returned
  dense [gamma, V] or sparse (indices, probs) [gamma, k].
- reduced draft vocabulary (optional): the LM head is restricted to `draft_vocab_size` target ids
  (`draft_to_target`, ascending); tokens outside it have p^d = 0, so the distribution stays exact.
  W1 stays indexed by target ids (any real token can precede a draft position).

The token embedding and the LM head are the target's, passed in and frozen: they are buffers here,
not parameters, and never part of the drafter's checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.drafter_config import DrafterConfig, SequentialHead
from dspark.models.packed_linear import pack_linears, pack_weight, packed_linear, packing_available
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample_from_probs

if TYPE_CHECKING:
    from dspark.calibration import CalibrationSet

# Position given to padding slots of a gathered context: never < any anchor position, so masked.
_PAD_POSITION = 2**62


# ------------------------------------------------------------------------------------------------
# Data passed between stages
# ------------------------------------------------------------------------------------------------


@dataclass
class DraftRequest:
    """One request's input to a drafting call."""

    request_id: Hashable
    anchor_token: int
    """x_0: the last token produced (target vocabulary id)."""
    anchor_position: int
    """Absolute position of x_0; the context must hold the features of positions < this."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Temperature (0 = greedy), top_k (0 = off), top_p (1 = off): the same as the target's."""
    generator: torch.Generator | None = None
    """The request's random stream; None = torch's global stream."""


@dataclass
class DraftBlock:
    """A drafted block for one request: tokens, their exact draft distributions, confidences."""

    tokens: torch.Tensor
    """[gamma] int64 target-vocabulary ids x_1..x_gamma."""
    probs: torch.Tensor
    """[gamma, vocab_size] dense p^d_k, or [gamma, k] when `indices` is set (float32)."""
    confidences: torch.Tensor
    """[gamma] float32 c_k = P(x_k accepted | x_<k accepted); after STS if temperatures are set."""
    indices: torch.Tensor | None = None
    """[gamma, k] int64 target ids of a sparse p^d_k (each row sums to 1 over them), or None."""

    def __post_init__(self) -> None:
        gamma = self.tokens.shape[0]
        assert self.tokens.shape == (gamma,), self.tokens.shape
        assert self.confidences.shape == (gamma,), self.confidences.shape
        assert self.probs.dim() == 2 and self.probs.shape[0] == gamma, self.probs.shape
        if self.indices is not None:
            assert self.indices.shape == self.probs.shape, (self.indices.shape, self.probs.shape)

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_sparse(self) -> bool:
        return self.indices is not None

    def token_probs(self) -> torch.Tensor:
        """p^d_k(x_k) for each position: [gamma] float32."""
        if self.indices is None:
            return self.probs.float().gather(1, self.tokens.unsqueeze(1)).squeeze(1)
        hit = self.indices == self.tokens.unsqueeze(1)  # [gamma, k]
        return (self.probs.float() * hit).sum(dim=1)

    def dense(self, vocab_size: int) -> torch.Tensor:
        """p^d as [gamma, vocab_size] float32."""
        if self.indices is None:
            assert self.probs.shape[1] == vocab_size, (self.probs.shape, vocab_size)
            return self.probs.float()
        out = torch.zeros(self.gamma, vocab_size, dtype=torch.float32, device=self.probs.device)
        return out.scatter_add_(1, self.indices, self.probs.float())

    @staticmethod
    def dummy(gamma: int, vocab_size: int, sparse_k: int | None = None,
              generator: torch.Generator | None = None) -> "DraftBlock":
        """A valid block with random distributions, tokens drawn from them (for tests)."""
        logits = torch.randn(gamma, vocab_size, generator=generator)
        if sparse_k is None:
            probs = torch.softmax(logits, dim=1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            return DraftBlock(tokens, probs, torch.rand(gamma, generator=generator))
        values, indices = torch.topk(logits, sparse_k, dim=1)
        probs = torch.softmax(values, dim=1)
        pick = torch.multinomial(probs, 1, generator=generator)  # [gamma, 1]
        tokens = indices.gather(1, pick).squeeze(1)
        return DraftBlock(tokens, probs, torch.rand(gamma, generator=generator), indices)


class Drafter(Protocol):
    """What the engine needs from any drafter (DSpark, DFlash, Eagle-style)."""

    gamma: int

    def append_context(self, request_id: Hashable, features: torch.Tensor,
                       positions: torch.Tensor, token_ids: torch.Tensor | None = None) -> None: ...

    def release(self, request_id: Hashable) -> None: ...

    def draft(self, requests: Sequence[DraftRequest], sparse_top_k: int | None = None,
              num_positions: int | None = None) -> list[DraftBlock]:
        """One block per request. `num_positions` (1..gamma; None = gamma): draft only the first
        positions of each block. They are exactly the positions a whole block would have, since a
        position depends only on the ones before it and on the block input."""
        ...


def positions_to_draft(num_positions: int | None, gamma: int) -> int:
    """`num_positions` of `Drafter.draft` validated: 1..gamma, None meaning gamma."""
    if num_positions is None:
        return gamma
    if not 1 <= num_positions <= gamma:
        raise ValueError(f"num_positions must lie in 1..{gamma}, got {num_positions}")
    return int(num_positions)


@dataclass
class BlockTrainOutputs:
    """Teacher-forced outputs for training blocks (B sequences x N anchors x gamma positions)."""

    draft_logits: torch.Tensor
    """[B, N, gamma, draft_vocab_size] float32: U_k + B_k(x*_{<k}) (teacher forcing)."""
    confidence_logits: torch.Tensor | None
    """[B, N, gamma] float32 logits of c_k, or None without a confidence head."""


# ------------------------------------------------------------------------------------------------
# Building blocks (Qwen3-style layers)
# ------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., n] int64 -> cos, sin [..., n, head_dim] (default RoPE, HF layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))  # [head_dim/2]
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., n, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., n, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, n, head_dim], cos/sin [B, n, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


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

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, hidden] -> k, v [B, num_kv_heads, n, head_dim] (k normed and rotated)."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, hidden] (after input_layernorm); cos/sin [B, Q, head_dim] at block positions;
        ctx_k/ctx_v [B, num_kv_heads, L, head_dim]; mask [B, Q, L + Q] bool (True = attend)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [B, heads, Q, head_dim]
        k_blk, v_blk = self.project_kv(x, cos, sin)  # [B, kv_heads, Q, head_dim]
        k = torch.cat([ctx_k, k_blk], dim=2)  # [B, kv_heads, L + Q, head_dim]
        v = torch.cat([ctx_v, v_blk], dim=2)
        assert mask.shape == (B, Q, k.shape[2]), (mask.shape, B, Q, k.shape)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1),
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))


    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       contexts: Sequence[RequestContext], layer: int,
                       masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Inference: x [R, Q, hidden]; request r attends to its own cached context of `layer`
        plus its block, read in place (the block's keys/values go to the context's scratch slots).
        masks[r]: [Q, L_r + Q] bool or None (= everything visible)."""
        R, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(R, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [R, heads, Q, head_dim]
        k_blk, v_blk = self.project_kv(x, cos, sin)  # [R, kv_heads, Q, head_dim]
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       contexts: Sequence[RequestContext], layer: int,
                       masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, contexts, layer,
                                              masks)
        return x + self.mlp(self.post_attention_layernorm(x))


# ------------------------------------------------------------------------------------------------
# Sequential heads and the confidence head
# ------------------------------------------------------------------------------------------------


class MarkovHead(nn.Module):
    """B(x_{k-1}, .) = W1[x_{k-1}] @ W2^T; W2 starts at 0 (= the pure parallel drafter)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        r = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, r)  # [V, r], indexed by target ids
        self.markov_w2 = nn.Linear(r, config.effective_draft_vocab_size, bias=False)  # [V_d, r]

    def initial_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, prev_ids: torch.Tensor, hn: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """prev_ids [*], hn [*, hidden] -> bias [*, V_d], new state, W1[prev] [*, r]."""
        w1_prev = self.markov_w1(prev_ids)  # one row gather
        return self.markov_w2(w1_prev), None, w1_prev  # one r x V_d product

    def block_bias(self, prev_ids: torch.Tensor, hn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forced over whole blocks: prev_ids [..., gamma], hn [..., gamma, hidden]
        -> bias [..., gamma, V_d], W1[prev] [..., gamma, r]."""
        w1_prev = self.markov_w1(prev_ids)
        return self.markov_w2(w1_prev), w1_prev


class RNNHead(nn.Module):
    """z_k = [s_{k-1}; W1[x_{k-1}]; h_k]; s_k = g * s_{k-1} + (1 - g) * tanh(W_c z_k),
    g = sigmoid(W_g z_k); B_k = W2 tanh(W_o z_k). W_g, W_c, W_o are one `joint_proj`."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        r, d = config.markov_rank, config.hidden_size
        self.rank = r
        self.markov_w1 = nn.Embedding(config.vocab_size, r)
        self.markov_w2 = nn.Linear(r, config.effective_draft_vocab_size, bias=False)
        self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def initial_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(*batch_shape, self.rank)

    def step(self, prev_ids: torch.Tensor, hn: torch.Tensor, state: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w1_prev = self.markov_w1(prev_ids)  # [*, r]
        z = torch.cat([state, w1_prev.to(hn.dtype), hn], dim=-1)  # [*, 2r + hidden]
        gate_raw, cand_raw, out_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), new_state, w1_prev

    def block_bias(self, prev_ids: torch.Tensor, hn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.initial_state(tuple(prev_ids.shape[:-1]), hn)
        biases, w1s = [], []
        for k in range(prev_ids.shape[-1]):
            bias, state, w1_prev = self.step(prev_ids[..., k], hn[..., k, :], state)
            biases.append(bias)
            w1s.append(w1_prev)
        return torch.stack(biases, dim=-2), torch.stack(w1s, dim=-2)


class ConfidenceHead(nn.Module):
    """logit c_k = proj([norm(h_k); W1[x_{k-1}]]) (DeepSpec's AcceptRatePredictor)."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


# ------------------------------------------------------------------------------------------------
# Per-request context K/V
# ------------------------------------------------------------------------------------------------


class RequestContext:
    """Keys/values of one request's context tokens for every layer, in a growable buffer.

    Slots past `length` are scratch space: drafting writes the block's own keys/values there so
    that attention reads [context; block] straight from this buffer, without copying the context.
    With `hidden_size` > 0 it also keeps each context token's fused state H_ctx [capacity, hidden]
    (for `DrafterConfig.inject_last_context`).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = 64,
                 hidden_size: int = 0) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.hidden = torch.empty(capacity if hidden_size else 0, hidden_size, dtype=dtype,
                                  device=device)
        self.positions = torch.empty(capacity, dtype=torch.int64, device=device)
        self.length = 0
        self.max_position = -1

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` slots (amortised doubling)."""
        if capacity <= self.keys.shape[2]:
            return
        cap = max(capacity, 2 * self.keys.shape[2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        pos = self.positions.new_empty(cap)
        pos[: self.length] = self.positions[: self.length]
        self.positions = pos
        if self.hidden.shape[0]:
            hidden = self.hidden.new_empty(cap, self.hidden.shape[1])
            hidden[: self.length] = self.hidden[: self.length]
            self.hidden = hidden

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               hidden: torch.Tensor | None = None) -> None:
        """keys/values [num_layers, num_kv_heads, n, head_dim], positions [n], hidden [n, hidden]
        (required iff the context keeps fused states)."""
        n = keys.shape[2]
        need = self.length + n
        assert (hidden is not None) == bool(self.hidden.shape[1]), "fused states: all or none"
        self.reserve(need)
        self.keys[:, :, self.length: need] = keys
        self.values[:, :, self.length: need] = values
        self.positions[self.length: need] = positions
        if hidden is not None:
            self.hidden[self.length: need] = hidden
        self.length = need
        if n:
            self.max_position = max(self.max_position, int(positions.max()))

    def visibility(self, anchor_position: int, block_size: int) -> torch.Tensor | None:
        """Mask [block_size, length + block_size] of what a block at `anchor_position` may see
        (context positions < anchor, the whole block), or None when it may see everything."""
        if self.max_position < anchor_position:
            return None
        mask = torch.ones(block_size, self.length + block_size, dtype=torch.bool,
                          device=self.positions.device)
        mask[:, : self.length] = self.positions[: self.length] < anchor_position
        return mask

    def last_hidden(self, anchor_position: int) -> torch.Tensor | None:
        """The fused state [hidden] of the latest context position before `anchor_position`
        (the most recently appended one if a position occurs twice), or None if there is none."""
        if self.length == 0:
            return None
        last = self.length - 1
        if int(self.positions[last]) == self.max_position < anchor_position:
            return self.hidden[last]  # the usual case: appended in order, all before the anchor
        positions = self.positions[: self.length]
        visible = positions < anchor_position
        if not bool(visible.any()):
            return None
        best = positions[visible].max()
        return self.hidden[int((positions == best).nonzero()[-1])]


class ContextKVCache:
    """The drafter's per-request context: projected context keys/values of every layer."""

    def __init__(self) -> None:
        self._requests: dict[Hashable, RequestContext] = {}

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def length(self, request_id: Hashable) -> int:
        ctx = self._requests.get(request_id)
        return 0 if ctx is None else ctx.length

    def append(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        ctx = self._requests.get(request_id)
        if ctx is None:
            ctx = RequestContext(keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype,
                                 keys.device, capacity=max(64, keys.shape[2]),
                                 hidden_size=0 if hidden is None else hidden.shape[-1])
            self._requests[request_id] = ctx
        ctx.append(keys, values, positions, hidden)

    def release(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)

    def get(self, request_id: Hashable) -> RequestContext | None:
        return self._requests.get(request_id)

    def gather(self, request_ids: Sequence[Hashable], num_layers: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded copy for batched attention (the Eagle-style drafter): keys/values
        [num_layers, R, num_kv_heads, L_max, head_dim], positions [R, L_max] (padding slots at
        _PAD_POSITION, so masked)."""
        contexts = [self._requests.get(rid) for rid in request_ids]
        lengths = [0 if c is None else c.length for c in contexts]
        R, L = len(request_ids), max(lengths, default=0)
        if R == 1 and contexts[0] is not None:  # no copy for a single request
            c = contexts[0]
            return (c.keys[:, None, :, : c.length], c.values[:, None, :, : c.length],
                    c.positions[None, : c.length])
        keys = torch.zeros(num_layers, R, num_kv_heads, L, head_dim, dtype=dtype, device=device)
        values = torch.zeros_like(keys)
        positions = torch.full((R, L), _PAD_POSITION, dtype=torch.int64, device=device)
        for r, c in enumerate(contexts):
            if c is not None and c.length:
                keys[:, r, :, : c.length] = c.keys[:, :, : c.length]
                values[:, r, :, : c.length] = c.values[:, :, : c.length]
                positions[r, : c.length] = c.positions[: c.length]
        return keys, values, positions


# ------------------------------------------------------------------------------------------------
# Sampling one block position for many requests
# ------------------------------------------------------------------------------------------------


@dataclass
class RowPlan:
    """How the requests of one drafting call sample, prepared once for all gamma positions.

    Sparse rows (greedy: k = 1; a top_k parameter or drafter-side truncation: k) draw from the
    renormalised top-k of their logits; dense rows from the full (draft) vocabulary.
    """

    num_rows: int
    sparse_rows: list[int]
    sparse_ks: list[int]
    dense_rows: list[int]
    all_greedy: bool
    sparse_index: torch.Tensor | None  # [n_sparse] row ids, None = all rows
    dense_index: torch.Tensor | None  # [n_dense] row ids, None = all rows
    sparse_params: SamplingTensors | None  # top_k off: the truncation is done by topk
    sparse_greedy: torch.Tensor | None  # [n_sparse] bool
    beyond_k: torch.Tensor | None  # [n_sparse, k_max] bool: slots past each row's own k
    dense_params: SamplingTensors | None


def _select(index: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if index is None else x[index]


def plan_rows(requests: Sequence[DraftRequest], vocab_size: int,
              sparse_top_k: int | None, device: torch.device) -> RowPlan:
    ks: list[int | None] = []
    for req in requests:
        s = req.sampling
        if s.is_greedy:
            ks.append(1)
            continue
        k = s.top_k if 0 < s.top_k < vocab_size else None
        if sparse_top_k is not None and sparse_top_k < vocab_size:
            k = sparse_top_k if k is None else min(k, sparse_top_k)
        ks.append(k)
    R = len(requests)
    sampling = SamplingTensors.from_params([r.sampling for r in requests], device=device)
    sparse_rows = [r for r in range(R) if ks[r] is not None]
    dense_rows = [r for r in range(R) if ks[r] is None]
    sparse_ks = [int(ks[r]) for r in sparse_rows]  # type: ignore[arg-type]

    def index(rows: list[int]) -> torch.Tensor | None:
        return None if len(rows) == R else torch.tensor(rows, dtype=torch.int64, device=device)

    sparse_index, dense_index = index(sparse_rows), index(dense_rows)
    plan = RowPlan(R, sparse_rows, sparse_ks, dense_rows,
                   all(r.sampling.is_greedy for r in requests), sparse_index, dense_index,
                   None, None, None, None)
    if sparse_rows:
        k_max = max(sparse_ks)
        k_tensor = torch.tensor(sparse_ks, device=device)
        plan.beyond_k = torch.arange(k_max, device=device).unsqueeze(0) >= k_tensor.unsqueeze(1)
        temperature = _select(sparse_index, sampling.temperature)
        plan.sparse_params = SamplingTensors(temperature, torch.zeros_like(k_tensor),
                                             _select(sparse_index, sampling.top_p))
        plan.sparse_greedy = temperature == 0.0
    if dense_rows:
        plan.dense_params = SamplingTensors(_select(dense_index, sampling.temperature),
                                            _select(dense_index, sampling.top_k),
                                            _select(dense_index, sampling.top_p))
    return plan


@dataclass
class PositionSample:
    """One block position sampled for every request of a call (rows grouped as in the plan)."""

    tokens: torch.Tensor  # [R] draft-vocabulary ids
    sparse_indices: torch.Tensor | None  # [n_sparse, k_max] draft-vocabulary ids
    sparse_probs: torch.Tensor | None  # [n_sparse, k_max] (0 past each row's k)
    dense_probs: torch.Tensor | None  # [n_dense, V_d]


def sample_block_position(logits: torch.Tensor, plan: RowPlan, uniforms: torch.Tensor | None
                          ) -> PositionSample:
    """Sample one position for every request: logits [R, V_d] float32, uniforms [R] in [0, 1)
    (None only when every request is greedy).

    Each token is drawn from exactly the distribution returned for its row.
    """
    R, _ = logits.shape
    if plan.all_greedy:  # argmax, lowest index on ties (as dspark.sampling)
        tokens = logits.argmax(dim=1)
        return PositionSample(tokens, tokens.unsqueeze(1), logits.new_ones(R, 1), None)
    tokens = torch.empty(R, dtype=torch.int64, device=logits.device)
    sparse_indices = sparse_probs = dense_probs = None
    if plan.sparse_rows:
        sub = _select(plan.sparse_index, logits)  # [n, V_d]
        values, sparse_indices = torch.topk(sub, plan.beyond_k.shape[1], dim=1)  # sorted desc
        greedy = plan.sparse_greedy
        if bool(greedy.any()):  # argmax with the lowest index on ties
            sparse_indices[greedy, 0] = sub[greedy].argmax(dim=1)
        values = values.masked_fill(plan.beyond_k, float("-inf"))
        sparse_probs = probs_from_logits(values, plan.sparse_params)  # greedy: one-hot at slot 0
        pick = sample_from_probs(sparse_probs, _select(plan.sparse_index, uniforms))
        picked = sparse_indices.gather(1, pick.unsqueeze(1)).squeeze(1)
        if plan.sparse_index is None:
            tokens = picked
        else:
            tokens[plan.sparse_index] = picked
    if plan.dense_rows:
        dense_probs = probs_from_logits(_select(plan.dense_index, logits), plan.dense_params)
        picked = sample_from_probs(dense_probs, _select(plan.dense_index, uniforms))
        if plan.dense_index is None:
            tokens = picked
        else:
            tokens[plan.dense_index] = picked
    return PositionSample(tokens, sparse_indices, sparse_probs, dense_probs)


def draw_uniforms(requests: Sequence[DraftRequest], count: int, device: torch.device) -> torch.Tensor:
    """[R, count] uniforms, each request's from its own generator (or the global stream)."""
    rows = [torch.rand(count, generator=req.generator) if req.generator is not None
            else torch.rand(count) for req in requests]
    return torch.stack(rows).to(device) if rows else torch.empty(0, count, device=device)


def assemble_blocks(plan: RowPlan, samples: Sequence[PositionSample], confidences: torch.Tensor,
                    draft_to_target: torch.Tensor | None, vocab_size: int) -> list[DraftBlock]:
    """Per-position samples (n of them, n <= gamma) and confidences [R, n] -> one DraftBlock each
    (`gamma` below is the n positions drafted)."""
    R, gamma = plan.num_rows, len(samples)
    tokens = torch.stack([s.tokens for s in samples], dim=1)  # [R, gamma]
    if draft_to_target is not None:
        tokens = draft_to_target[tokens]
    confidences = confidences.float()
    blocks: list[DraftBlock | None] = [None] * R
    if plan.sparse_rows:
        indices = torch.stack([s.sparse_indices for s in samples], dim=1)  # [n, gamma, k_max]
        if draft_to_target is not None:
            indices = draft_to_target[indices]
        probs = torch.stack([s.sparse_probs for s in samples], dim=1).float()
        for i, (r, k) in enumerate(zip(plan.sparse_rows, plan.sparse_ks)):
            blocks[r] = DraftBlock(tokens[r], probs[i, :, :k], confidences[r], indices[i, :, :k])
    if plan.dense_rows:
        probs = torch.stack([s.dense_probs for s in samples], dim=1).float()  # [n, gamma, V_d]
        if draft_to_target is not None:
            full = probs.new_zeros(probs.shape[0], gamma, vocab_size)
            full[:, :, draft_to_target] = probs
            probs = full
        for i, r in enumerate(plan.dense_rows):
            blocks[r] = DraftBlock(tokens[r], probs[i], confidences[r])
    return blocks  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------
# The drafter
# ------------------------------------------------------------------------------------------------


class FrozenTargetHead(nn.Module):
    """Shared plumbing of the drafters: the target's frozen embedding and LM head as buffers, and
    the optional reduced draft vocabulary (draft id -> target id, ascending)."""

    config: DrafterConfig
    fc: nn.Linear

    def _init_target_buffers(self) -> None:
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)
        self.register_buffer("draft_to_target", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("target_to_draft", torch.empty(0, dtype=torch.int64), persistent=False)

    def set_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                           draft_token_ids: torch.Tensor | None = None) -> None:
        """The target's embedding [V, hidden] and LM head [V, hidden] (frozen, shared), and the
        draft vocabulary (ascending target ids [V_d]) when it is reduced."""
        cfg = self.config
        self.packed_lm_head = None  # packed from the old weights, if packed: pack again
        assert embed_weight.shape == (cfg.vocab_size, cfg.hidden_size), embed_weight.shape
        assert lm_head_weight.shape == (cfg.vocab_size, cfg.hidden_size), lm_head_weight.shape
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.embed_weight = embed_weight.detach().to(device=device, dtype=dtype)
        if cfg.draft_vocab_size is None:
            assert draft_token_ids is None or draft_token_ids.numel() == cfg.vocab_size
            self.lm_head_weight = lm_head_weight.detach().to(device=device, dtype=dtype)
            self.draft_to_target = torch.empty(0, dtype=torch.int64, device=device)
            self.target_to_draft = torch.empty(0, dtype=torch.int64, device=device)
            return
        if draft_token_ids is None:
            raise ValueError("a reduced draft vocabulary needs draft_token_ids")
        ids = draft_token_ids.to(device=device, dtype=torch.int64)
        assert ids.shape == (cfg.draft_vocab_size,), ids.shape
        if not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= cfg.vocab_size:
            raise ValueError("draft_token_ids must be strictly ascending target ids")
        self.draft_to_target = ids
        t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.int64, device=device)
        t2d[ids] = torch.arange(ids.numel(), device=device)
        self.target_to_draft = t2d
        self.lm_head_weight = lm_head_weight.detach().to(device=device)[ids].to(dtype)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.effective_draft_vocab_size

    def _check_ready(self) -> None:
        if self.embed_weight.numel() == 0:
            raise RuntimeError("call set_target_weights(embed, lm_head) before using the drafter")

    def base_logits(self, hn: torch.Tensor) -> torch.Tensor:
        """U = lm_head(norm(h)): [..., hidden] -> [..., V_d] float32."""
        packed = getattr(self, "packed_lm_head", None)
        if packed is not None:
            return packed_linear(hn, packed, None).float()
        return F.linear(hn, self.lm_head_weight).float()

    def pack_for_inference(self) -> None:
        """Multiply with oneDNN-packed weights from now on (a CPU, float32 or bf16 where oneDNN
        supports it; see `dspark.models.packed_linear`): every nn.Linear, and the
        (draft-vocabulary) LM head.
        Inference only; a no-op elsewhere. Call after `set_target_weights`."""
        self._check_ready()
        if not packing_available(self.lm_head_weight.device, self.lm_head_weight.dtype):
            return
        pack_linears(self)
        self.packed_lm_head = pack_weight(self.lm_head_weight)


class DSparkDrafter(FrozenTargetHead):
    """DFlash-style parallel backbone + sequential head + confidence head (DESIGN.md section 3).

    Parameters carry DeepSpec's tensor names (see `dspark.models.drafter_io`). The target's
    embedding and LM head are frozen buffers set with `set_target_weights`.
    """

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None,
                 draft_token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.gamma = config.block_size
        d = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        head = config.markov_head_type
        self.markov_head: MarkovHead | RNNHead | None = (
            MarkovHead(config) if head == SequentialHead.MARKOV
            else RNNHead(config) if head == SequentialHead.RNN else None)
        self.confidence_head = (ConfidenceHead(config.confidence_input_size)
                                if config.enable_confidence_head else None)
        self._conf_with_w1 = bool(config.confidence_head_with_markov and self.markov_head is not None)
        self.reset_parameters()
        # Frozen target tensors and the draft-vocabulary map: buffers, not in the checkpoint.
        self._init_target_buffers()
        # STS fits applied to the confidences, one row per sampling temperature calibrated at
        # (set_confidence_calibration); one identity row until then.
        self.register_buffer("confidence_temperatures", torch.ones(1, self.gamma), persistent=False)
        self.register_buffer("confidence_biases", torch.zeros(1, self.gamma), persistent=False)
        self._calibration_sampling_temps: list[float] = []  # [num_fits] when num_fits > 1
        self._cache = ContextKVCache()
        # Context tokens not yet projected into the cache, per request: (features [n, m * hidden],
        # positions [n]) in arrival order (see append_context).
        self._pending: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        if embed_weight is not None and lm_head_weight is not None:
            self.set_target_weights(embed_weight, lm_head_weight, draft_token_ids)

    # ---- set-up ------------------------------------------------------------------------------

    def reset_parameters(self, std: float = 0.02) -> None:
        """DeepSpec/HF-style init; W2 = 0 so training starts from the pure parallel drafter."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.markov_head is not None:
            nn.init.zeros_(self.markov_head.markov_w2.weight)

    def set_confidence_temperatures(self, temperatures: Sequence[float] | torch.Tensor,
                                    biases: Sequence[float] | torch.Tensor | None = None) -> None:
        """One STS fit for every request: c_k = sigmoid(logit(c_k) / T_k + b_k) (b_k default 0)."""
        t = torch.as_tensor(temperatures, dtype=torch.float32, device=self.fc.weight.device)
        assert t.shape == (self.gamma,) and bool((t > 0).all()), t
        b = (torch.zeros_like(t) if biases is None
             else torch.as_tensor(biases, dtype=torch.float32, device=t.device))
        assert b.shape == (self.gamma,) and bool(torch.isfinite(b).all()), b
        self.confidence_temperatures = t.unsqueeze(0)  # [1, gamma]
        self.confidence_biases = b.unsqueeze(0)  # [1, gamma]
        self._calibration_sampling_temps = []

    def set_confidence_calibration(self, calibration: CalibrationSet) -> None:
        """STS fits per sampling temperature (dspark.calibration.CalibrationSet): each request's
        confidences use the fit of the sampling temperature nearest its own."""
        if calibration.gamma != self.gamma:
            raise ValueError(f"calibration has gamma={calibration.gamma}, the drafter {self.gamma}")
        device = self.fc.weight.device
        self.confidence_temperatures = torch.tensor(
            [f.temperatures for f in calibration.fits], dtype=torch.float32, device=device)
        self.confidence_biases = torch.tensor(
            [f.biases for f in calibration.fits], dtype=torch.float32, device=device)
        self._calibration_sampling_temps = ([f.sampling_temperature for f in calibration.fits]
                                            if len(calibration.fits) > 1 else [])

    def _calibration_rows(self, requests: Sequence[DraftRequest]) -> torch.Tensor | None:
        """Row of confidence_temperatures for each request [R] (None: the single row 0)."""
        temps = self._calibration_sampling_temps
        if not temps:
            return None
        rows = [min(range(len(temps)), key=lambda i: (abs(temps[i] - r.sampling.temperature), i))
                for r in requests]
        return torch.tensor(rows, dtype=torch.int64, device=self.confidence_temperatures.device)

    # ---- the parallel backbone ---------------------------------------------------------------

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., m * hidden] -> H_ctx [..., hidden]."""
        assert features.shape[-1] == self.fc.in_features, (features.shape, self.fc.in_features)
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, L, m * hidden], positions [B, L] -> keys, values
        [num_layers, B, num_kv_heads, L, head_dim]."""
        keys, values, _ = self.context_states(features, positions)
        return keys, values

    def context_states(self, features: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """features [B, L, m * hidden], positions [B, L] -> keys, values
        [num_layers, B, num_kv_heads, L, head_dim] and H_ctx [B, L, hidden]."""
        h_ctx = self.fuse_context(features)  # [B, L, hidden]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h_ctx.dtype)
        ks, vs = zip(*(layer.self_attn.project_kv(h_ctx, cos, sin) for layer in self.layers))
        return torch.stack(ks), torch.stack(vs), h_ctx

    def backbone(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                 ctx_keys: torch.Tensor, ctx_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """block_embeds [B, Q, hidden], block_positions [B, Q], ctx_keys/values
        [num_layers, B, num_kv_heads, L, head_dim], mask [B, Q, L + Q] -> norm(h) [B, Q, hidden]."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(block_positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_keys[i], ctx_values[i], mask)
        return self.norm(x)

    def _confidence_logits(self, hn: torch.Tensor, w1_prev: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        feats = hn if not self._conf_with_w1 else torch.cat([hn, w1_prev.to(hn.dtype)], dim=-1)
        return self.confidence_head(feats).float()

    # ---- training: many blocks per sequence, teacher forced ------------------------------------

    def forward_train(self, input_ids: torch.Tensor, features: torch.Tensor,
                      anchors: torch.Tensor, labels: torch.Tensor) -> BlockTrainOutputs:
        """Teacher-forced block outputs for N anchors per sequence.

        input_ids [B, T]; features [B, T, m * hidden] (target features of every position);
        anchors [B, N] anchor positions a (block k sees context positions < a);
        labels [B, N, gamma] the true x*_{a+1..a+gamma} (any valid id where out of range).
        """
        self._check_ready()
        B, T = input_ids.shape
        N, gamma = anchors.shape[1], self.gamma
        assert features.shape[:2] == (B, T), (features.shape, B, T)
        assert labels.shape == (B, N, gamma), labels.shape
        device = input_ids.device
        positions = torch.arange(T, device=device).expand(B, T)
        ctx_k, ctx_v, h_ctx = self.context_states(features, positions)
        anchor_tokens = input_ids.gather(1, anchors)  # [B, N]
        block_ids = torch.full((B, N, gamma), self.config.mask_token_id, dtype=torch.int64,
                               device=device)
        block_ids[:, :, 0] = anchor_tokens
        embeds = F.embedding(block_ids.view(B, N * gamma), self.embed_weight)  # [B, N*gamma, hidden]
        if self.config.inject_last_context:
            last = h_ctx.gather(1, (anchors - 1).clamp(min=0).unsqueeze(-1).expand(
                B, N, h_ctx.shape[-1]))  # [B, N, hidden]: H_ctx at a - 1
            last = last * (anchors > 0).unsqueeze(-1).to(last.dtype)  # no context before a = 0
            embeds = (embeds.view(B, N, gamma, -1) + last.unsqueeze(2)).view(B, N * gamma, -1)
        offsets = torch.arange(gamma, device=device)
        block_pos = (anchors.unsqueeze(-1) + offsets).view(B, N * gamma)
        mask = training_mask(anchors, T, gamma)  # [B, N*gamma, T + N*gamma]
        hn = self.backbone(embeds, block_pos, ctx_k, ctx_v, mask).view(B, N, gamma, -1)
        logits = self.base_logits(hn)  # [B, N, gamma, V_d]
        prev_ids = torch.cat([anchor_tokens.unsqueeze(-1), labels[..., :-1]], dim=-1)  # [B, N, gamma]
        w1_prev = None
        if self.markov_head is not None:
            bias, w1_prev = self.markov_head.block_bias(prev_ids, hn)
            logits = logits + bias.float()
        return BlockTrainOutputs(logits, self._confidence_logits(hn, w1_prev))

    # ---- inference: per-request context cache and batched drafting ------------------------------

    def append_context(self, request_id: Hashable, features: torch.Tensor,
                       positions: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        """Add context tokens' target features [n, m * hidden] at absolute positions [n].
        (token_ids is accepted for interface parity with the Eagle-style drafter; unused.)

        Lazy: the tokens are projected into the context cache when the request is next drafted
        (`_absorb_pending`), together with every other pending token of that draft call, in one
        product per weight instead of one per request and round; a round that skips drafting
        then costs the drafter nothing. Each token's projection depends on that token alone, so
        the result is the same up to float summation order."""
        assert features.dim() == 2 and positions.shape == (features.shape[0],), (
            features.shape, positions.shape)
        if features.shape[0] == 0:
            return
        self._pending.setdefault(request_id, []).append((features, positions))

    def _absorb_pending(self, request_ids: Sequence[Hashable]) -> None:
        """Project the pending context tokens of these requests into the cache, all at once."""
        pieces = [(rid, piece) for rid in dict.fromkeys(request_ids)
                  for piece in self._pending.pop(rid, ())]
        if not pieces:
            return
        device = self.fc.weight.device
        features = torch.cat([f for _, (f, _) in pieces]).to(device)  # [N, m * hidden]
        positions = torch.cat([p for _, (_, p) in pieces]).to(device=device, dtype=torch.int64)  # [N]
        with torch.no_grad():
            # keys, values [num_layers, 1, num_kv_heads, N, head_dim]; h_ctx [1, N, hidden]
            keys, values, h_ctx = self.context_states(features.unsqueeze(0), positions.unsqueeze(0))
        start = 0
        for rid, (f, _) in pieces:
            end = start + f.shape[0]
            hidden = h_ctx[0, start:end] if self.config.inject_last_context else None  # [n, hidden]
            self._cache.append(rid, keys[:, 0, :, start:end], values[:, 0, :, start:end],
                               positions[start:end], hidden)
            start = end

    def release(self, request_id: Hashable) -> None:
        self._pending.pop(request_id, None)
        self._cache.release(request_id)

    def context_length(self, request_id: Hashable) -> int:
        self._absorb_pending([request_id])
        return self._cache.length(request_id)

    def _last_context_states(self, contexts: Sequence[RequestContext],
                             requests: Sequence[DraftRequest]) -> torch.Tensor:
        """H_ctx at each request's last context position before its anchor: [R, hidden]
        (zeros where there is none, as in training at anchor 0)."""
        rows = []
        for ctx, req in zip(contexts, requests):
            row = ctx.last_hidden(req.anchor_position)
            rows.append(row if row is not None else
                        self.embed_weight.new_zeros(self.config.hidden_size))
        return torch.stack(rows)

    @torch.no_grad()
    def draft(self, requests: Sequence[DraftRequest], sparse_top_k: int | None = None,
              num_positions: int | None = None) -> list[DraftBlock]:
        """Draft one block for each request in one backbone pass.

        sparse_top_k: if set, every sampled request draws from its top-k-truncated distribution
        and gets it back sparse (lossless: p^d is reported exactly). Greedy requests are always
        returned sparse with k = 1; requests with a top_k sampling parameter are sparse too.
        num_positions: sample only the first n positions (the LM head and the sequential head
        run n times instead of gamma). The backbone still runs over the whole block, whose input
        (anchor + masks) every position attends to, so the n positions are exactly those of the
        whole block; each request's generator advances by gamma uniforms either way.
        """
        self._check_ready()
        if not requests:
            return []
        cfg, gamma = self.config, self.gamma
        n = positions_to_draft(num_positions, gamma)
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        R = len(requests)
        self._absorb_pending([r.request_id for r in requests])
        contexts = []
        for r in requests:  # a request with no context yet gets an empty, unstored one
            ctx = self._cache.get(r.request_id) or RequestContext(
                len(self.layers), cfg.num_key_value_heads, cfg.head_dim, dtype, device, gamma,
                cfg.hidden_size if cfg.inject_last_context else 0)
            ctx.reserve(ctx.length + gamma)
            contexts.append(ctx)
        masks = [c.visibility(r.anchor_position, gamma) for c, r in zip(contexts, requests)]
        anchor_tok = torch.tensor([r.anchor_token for r in requests], dtype=torch.int64, device=device)
        anchor_pos = torch.tensor([r.anchor_position for r in requests], dtype=torch.int64,
                                  device=device)
        block_ids = torch.full((R, gamma), cfg.mask_token_id, dtype=torch.int64, device=device)
        block_ids[:, 0] = anchor_tok
        block_pos = anchor_pos.unsqueeze(1) + torch.arange(gamma, device=device)  # [R, gamma]
        x = F.embedding(block_ids, self.embed_weight)  # [R, gamma, hidden]
        if cfg.inject_last_context:
            x = x + self._last_context_states(contexts, requests).unsqueeze(1)
        cos, sin = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta, dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cos, sin, contexts, i, masks)
        hn = self.norm(x)[:, :n]  # [R, n, hidden]
        base = self.base_logits(hn)  # [R, n, V_d]

        plan = plan_rows(requests, self.draft_vocab_size, sparse_top_k, device)
        uniforms = None if plan.all_greedy else draw_uniforms(requests, gamma, device)  # [R, gamma]
        reduced = cfg.draft_vocab_size is not None
        rows = self._calibration_rows(requests)
        conf_t = self.confidence_temperatures[0 if rows is None else rows]  # [gamma] or [R, gamma]
        conf_b = self.confidence_biases[0 if rows is None else rows]
        prev = anchor_tok  # target ids
        state = (self.markov_head.initial_state((R,), hn)
                 if self.markov_head is not None else None)
        samples, confidences = [], []
        for k in range(n):
            logits_k = base[:, k]  # [R, V_d]
            w1_prev = None
            if self.markov_head is not None:
                bias, state, w1_prev = self.markov_head.step(prev, hn[:, k], state)
                logits_k = logits_k + bias.float()
            conf_logit = self._confidence_logits(hn[:, k], w1_prev)  # before x_k exists
            if conf_logit is None:
                confidences.append(torch.full((R,), float("nan"), device=device))
            else:
                confidences.append(torch.sigmoid(conf_logit / conf_t[..., k] + conf_b[..., k]))
            u_k = None if uniforms is None else uniforms[:, k]
            sample = sample_block_position(logits_k, plan, u_k)
            samples.append(sample)
            prev = self.draft_to_target[sample.tokens] if reduced else sample.tokens
        return assemble_blocks(plan, samples, torch.stack(confidences, dim=1),
                               self.draft_to_target if reduced else None, cfg.vocab_size)


def training_mask(anchors: torch.Tensor, seq_len: int, gamma: int) -> torch.Tensor:
    """Attention mask for N blocks per sequence: anchors [B, N] -> [B, N*gamma, T + N*gamma] bool.

    A block query sees context position j iff j < its anchor, and every position of its own block
    (bidirectional), nothing of other blocks.
    """
    B, N = anchors.shape
    device = anchors.device
    q_block = torch.arange(N * gamma, device=device) // gamma  # [Q]
    q_anchor = anchors[:, q_block]  # [B, Q]
    ctx = torch.arange(seq_len, device=device).view(1, 1, -1) < q_anchor.unsqueeze(-1)  # [B, Q, T]
    same = q_block.view(-1, 1) == q_block.view(1, -1)  # [Q, Q]
    return torch.cat([ctx, same.unsqueeze(0).expand(B, -1, -1)], dim=2)


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, answer_mask: torch.Tensor,
                 gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of N blocks per sequence and which are supervised.

    input_ids [B, T]; anchors [B, N]; answer_mask [B, T] bool (positions whose token is a
    target-generated answer token). Returns labels [B, N, gamma] = x*_{a+k} (clamped where out of
    range) and valid [B, N, gamma] bool: a contiguous prefix of in-range answer positions.
    """
    B, T = input_ids.shape
    idx = anchors.unsqueeze(-1) + torch.arange(1, gamma + 1, device=anchors.device)  # [B, N, gamma]
    in_range = idx < T
    safe = idx.clamp(max=T - 1)
    flat = safe.view(B, -1)
    labels = input_ids.gather(1, flat).view_as(safe)
    valid = in_range & answer_mask.gather(1, flat).view_as(safe)
    valid = valid.to(torch.int32).cumprod(dim=-1).bool()
    return labels, valid


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

