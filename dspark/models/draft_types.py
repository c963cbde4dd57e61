"""What passes between a drafter and its callers: the drafting request, the drafted block, the
`Drafter` interface every drafter follows (DSpark, DFlash, Eagle-style), and the teacher-forced
training outputs.

Glossary (docs/design.md section 3)
- anchor x_0: the last token already produced (the previous round's bonus token), at position a.
  Its target features do not exist yet, so the block drafted after it sees only context
  positions < a.
- block: gamma drafted tokens x_1..x_gamma, each with its draft distribution and confidence.
- draft distribution p^d_k: exactly the distribution x_k was drawn from, after the request's
  temperature / top-k / top-p (`dspark.sampling.probs_from_logits`) and any truncation; returned
  dense [gamma, V] or sparse (indices, probs) [gamma, k].
- confidence c_k: the drafter's estimate of P(x_k accepted | x_<k accepted), a function of x_<k
  only, never of x_k.

These types import no layer: the verifier, the engine and the wire format use them without
loading a drafter's modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence

import torch

from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams

if TYPE_CHECKING:
    from dspark.structured_output import GrammarRequest, GrammarState


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
    generator: CounterGenerator | None = None
    """The request's random numbers (dspark.random_draws); None = keyed by sampling.seed, or by
    a fresh seed when that is None too."""
    num_output: int = 0
    """Output tokens up to and including the anchor (a resumed request's earlier output
    counted): min_tokens bans the stop tokens at block position k while num_output + k - 1 <
    sampling.min_tokens (dspark.models.draft_processing)."""
    grammar: GrammarState | None = None
    """Structured output: the request's grammar matcher after its committed output, anchor
    included; the drafter masks each position with it, follows its drafts and rolls back
    (dspark.models.draft_processing). None = no grammar, or a drafter in another process
    (which builds its own from `grammar_request`)."""
    grammar_request: GrammarRequest | None = None
    """Structured output for a drafter in another process (dspark.serving.remote_drafter): the
    spec and the stop tokens it builds its own matcher from (`grammar` is the matcher a drafter
    in the verifier's process reads). None = no grammar."""
    token_ids: Sequence[int] | None = None
    """The request's tokens at positions 0..anchor_position (prompt, then output, the anchor
    last; the last num_output of them are output): the penalties read them. None = the
    request has no penalty (SamplingParams.has_penalties)."""


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

    def fork(self, parent_id: Hashable, child_id: Hashable, num_positions: int) -> None:
        """`child_id`'s context becomes a copy of `parent_id`'s at positions < num_positions
        (the n samples of one prompt, dspark/forks.py)."""
        ...

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

