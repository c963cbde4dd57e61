"""The drafter's sequential heads and its confidence head (docs/design.md section 3).

Glossary
- base logits U_k = lm_head(norm(h_k)): what the parallel backbone predicts for block position k
  (1-based), from the block input alone.
- sequential head: `p_k = softmax(U_k + B_k(x_0, x_<k))`, sampled left to right. `markov`:
  `B = W1[x_{k-1}] W2^T` (`MarkovHead`); `rnn`: gated state over the prefix (`RNNHead`); `none`:
  DFlash (no bias, no head). W1 is indexed by target ids (any real token can precede a draft
  position); W2 maps to the (possibly reduced) draft vocabulary.
- confidence c_k = sigmoid(proj([norm(h_k); W1[x_{k-1}]])): a function of x_{<k} only, never of x_k.
  (Head `none`: proj(norm(h_k)), see drafter_config.)
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.drafter_config import DrafterConfig


class MarkovHead(nn.Module):
    """B(x_{k-1}, .) = W1[x_{k-1}] @ W2^T; W2 starts at 0 (= the pure parallel drafter)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        r = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, r)  # [V, r], indexed by target ids
        self.markov_w2 = nn.Linear(r, config.effective_draft_vocab_size, bias=False)  # [V_d, r]
        self.w2_t: torch.Tensor | None = None
        """Inference on a CPU (`pack_fused`): W2^T [r, V_d] in float32, for `add_bias`."""

    def pack_fused(self) -> None:
        """Inference only: keep W2^T in float32, so that `add_bias` adds a position's bias to its
        float32 logits in one addmm, instead of a bf16 product of one row, its float copy and
        an add (on a 2-core AMX Xeon, one thread, 7 positions at rank 64 and V_d 8,192: about
        0.2 ms less a drafting round of one request)."""
        self.w2_t = self.markov_w2.weight.detach().float().t().contiguous()

    def initial_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        return None

    def add_bias(self, logits: torch.Tensor, prev_ids: torch.Tensor, hn: torch.Tensor,
                 state: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One drafting position: logits [R, V_d] float32 + B(x_{k-1}), prev_ids [R], hn
        [R, hidden] -> (the biased logits [R, V_d] float32, new state, W1[prev] [R, r])."""
        w1_prev = self.markov_w1(prev_ids)  # [R, r]: one row gather
        if self.w2_t is not None:
            return torch.addmm(logits, w1_prev.float(), self.w2_t), None, w1_prev
        return logits + self.markov_w2(w1_prev).float(), None, w1_prev

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

    def add_bias(self, logits: torch.Tensor, prev_ids: torch.Tensor, hn: torch.Tensor,
                 state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafting position, as MarkovHead.add_bias: -> (logits + B_k, new state, W1[prev])."""
        bias, new_state, w1_prev = self.step(prev_ids, hn, state)
        return logits + bias.float(), new_state, w1_prev

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

