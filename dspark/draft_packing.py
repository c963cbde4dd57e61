"""Draft distributions as verification reads them, and the packing of drafted blocks into one.

A drafter returns each request's block (dspark.models.draft_types.DraftBlock) with p^d_k either
dense [gamma, vocab_size] or sparse on its support (indices, probs) [gamma, k]. Verification reads
all admitted drafts of a round as one flattened `DraftProbs` [num_drafts, ...], request after
request (dspark.rejection's layout). `pack_draft_probs` builds it; the representation it picks:

- every block dense: the rows concatenated, [num_drafts, vocab_size];
- every block sparse over one shared support (the drafter's reduced vocabulary: each block's
  ids are stride-0 views of the same row): `SparseDraftProbs` with that row expanded, so the
  verifier can read the target at those columns only;
- every block sparse otherwise: the supports padded to the widest with probability 0 (padding
  adds nothing to any row's mass, and a padded id is never a drafted token's column);
- sparse and dense blocks mixed (greedy k = 1 beside a plain sampled request): every row dense,
  the same distributions written out;
- no drafts: an empty dense [0, vocab_size].

The readers (`draft_prob_of_tokens`, `dense_draft_rows`, `draft_support`) give the same numbers
whichever representation was packed; tests/test_draft_packing.py holds them to a dense reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from dspark.models.draft_types import DraftBlock


@dataclass
class SparseDraftProbs:
    """A draft distribution stored as its support: each row sums to 1 over `indices`."""

    indices: torch.Tensor  # [num_drafts, k] int64 token ids
    probs: torch.Tensor  # [num_drafts, k] float

    @property
    def shared_support(self) -> torch.Tensor | None:
        """[k] the ids of every row, when `indices` is one row expanded (stride 0), else None."""
        if self.indices.shape[0] > 0 and self.indices.stride(0) == 0:
            return self.indices[0]
        return None

    def prob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """p^d(token) per row; tokens [num_drafts] -> [num_drafts] (0 where not in the support)."""
        hit = self.indices == tokens.unsqueeze(1)  # [num_drafts, k]
        return (self.probs.float() * hit).sum(dim=1)

    def dense_rows(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Dense p^d for the given rows: rows [n] -> [n, vocab_size] float32."""
        out = torch.zeros(rows.shape[0], vocab_size, dtype=torch.float32, device=self.probs.device)
        return out.scatter_add_(1, self.indices[rows], self.probs[rows].float())


DraftProbs = Union[torch.Tensor, SparseDraftProbs]
"""[num_drafts, vocab_size] dense float, or SparseDraftProbs [num_drafts, k]."""


def pack_draft_probs(blocks: Sequence[DraftBlock], num_drafts: Sequence[int], vocab_size: int,
                     device: torch.device) -> DraftProbs:
    """The first num_drafts[i] rows of each block's p^d, flattened in order into one DraftProbs
    [sum num_drafts, ...] (the representation chosen as the module docstring says).

    blocks: [n] the admitted blocks, on `device`; num_drafts: [n] each >= 1."""
    assert len(blocks) == len(num_drafts), (len(blocks), len(num_drafts))
    if not blocks:
        return torch.zeros(0, vocab_size, device=device)
    if len({b.is_sparse for b in blocks}) > 1:  # mixed: every row dense
        return torch.cat([b.dense(vocab_size)[:n] for b, n in zip(blocks, num_drafts)])
    probs = [b.probs[:n] for b, n in zip(blocks, num_drafts)]  # [n_i, V] or [n_i, k_i]
    if not blocks[0].is_sparse:
        return torch.cat(probs)  # [num_drafts, V]
    indices = [b.indices[:n] for b, n in zip(blocks, num_drafts)]  # [n_i, k_i]
    shared = _shared_support(indices)
    if shared is not None:  # one row of ids for all
        return SparseDraftProbs(shared.expand(sum(num_drafts), -1), torch.cat(probs))
    width = max(i.shape[1] for i in indices)
    return SparseDraftProbs(torch.cat([_pad_columns(i, width) for i in indices]),  # [num_drafts, width]
                            torch.cat([_pad_columns(p, width) for p in probs]))


def _shared_support(indices: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one support row [k] when every block's ids [n, k] are views of it repeated (the
    drafter's reduced vocabulary, DraftBlock's dense rows over it), else None."""
    first = indices[0]
    if first.dim() != 2 or first.stride(0) != 0:
        return None
    if any(i.stride(0) != 0 or i.shape[1] != first.shape[1] or i.data_ptr() != first.data_ptr()
           for i in indices[1:]):
        return None
    return first[0]


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """[n, k] -> [n, width], zeros appended (index 0 with probability 0 for sparse supports)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def draft_prob_of_tokens(draft_probs: DraftProbs, tokens: torch.Tensor) -> torch.Tensor:
    """p^d_k(x_k) for every draft row: tokens [num_drafts] -> [num_drafts] float32."""
    if isinstance(draft_probs, SparseDraftProbs):
        return draft_probs.prob_of(tokens)
    return draft_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).float()


def dense_draft_rows(draft_probs: DraftProbs, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Dense p^d for selected draft rows: rows [n] -> [n, vocab_size] float32."""
    if isinstance(draft_probs, SparseDraftProbs):
        return draft_probs.dense_rows(rows, vocab_size)
    return draft_probs[rows].float()


def draft_support(draft_probs: DraftProbs, rows: torch.Tensor, vocab_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected draft rows on their support: (token ids [n, k], probabilities [n, k]); a
    dense row's support is the whole vocabulary."""
    if isinstance(draft_probs, SparseDraftProbs):
        every_row = rows.shape[0] == draft_probs.indices.shape[0]  # rows are then 0..n-1
        shared = draft_probs.shared_support
        ids = (shared.expand(rows.shape[0], -1) if shared is not None
               else draft_probs.indices if every_row else draft_probs.indices[rows])
        return ids, (draft_probs.probs if every_row else draft_probs.probs[rows]).float()
    every_row = rows.shape[0] == draft_probs.shape[0]
    ids = torch.arange(vocab_size, device=rows.device).expand(rows.shape[0], -1)
    return ids, (draft_probs if every_row else draft_probs[rows]).float()
