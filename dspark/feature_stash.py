"""Held target features: context the drafter does not need yet stays with the verifier.

Every target forward yields the hidden features of the tokens it commits; the drafter needs
them as context, but only for a request it drafts. Under a load where drafts do not pay,
`async_topk` skips drafting for most rounds and a probe drafts a few requests, so most features
would cross the wire every round (verifier -> scheduler -> drafter buffer) and never be used.
A verify item or prefill chunk marked `hold_features` leaves its features here instead; the
engine takes a request's pieces (`take`) just before the drafter next drafts it, so the drafter
sees exactly the context it would have seen, in the same order, only later.

Glossary: a *piece* is one round's committed tokens of one request: their features
[n, num_layers * hidden_size], absolute positions [n] and token ids [n]. A request's pieces are
kept in the order they were committed; `take` returns and forgets all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch


@dataclass
class FeaturePiece:
    """Target features of consecutive committed tokens of one request."""

    features: torch.Tensor
    """[n, num_layers * hidden_size] in the target's dtype."""
    positions: torch.Tensor
    """[n] int64 absolute positions."""
    token_ids: torch.Tensor
    """[n] int64 the tokens at those positions."""

    def __post_init__(self) -> None:
        n = self.features.shape[0]
        assert self.features.dim() == 2 and self.positions.shape == (n,) == self.token_ids.shape, (
            self.features.shape, self.positions.shape, self.token_ids.shape)


def joined(pieces: Sequence[FeaturePiece]) -> FeaturePiece:
    """Consecutive pieces of one request as one."""
    if len(pieces) == 1:
        return pieces[0]
    return FeaturePiece(torch.cat([p.features for p in pieces]),  # [sum n, d]
                        torch.cat([p.positions for p in pieces]),  # [sum n]
                        torch.cat([p.token_ids for p in pieces]))  # [sum n]


class FeatureStash:
    """Per request, the pieces held since its features were last taken."""

    def __init__(self) -> None:
        self._pieces: dict[Hashable, list[FeaturePiece]] = {}

    def hold(self, request_id: Hashable, piece: FeaturePiece) -> None:
        """Keep a piece; it must follow the request's last held piece."""
        if not piece.features.shape[0]:
            return
        held = self._pieces.setdefault(request_id, [])
        if held and int(piece.positions[0]) != int(held[-1].positions[-1]) + 1:
            raise ValueError(f"{request_id!r}: held features end at position "
                             f"{int(held[-1].positions[-1])}, the next piece starts at "
                             f"{int(piece.positions[0])}")
        # A clone: a slice would keep the whole forward's hidden states alive.
        held.append(FeaturePiece(piece.features.clone(), piece.positions, piece.token_ids))

    def take(self, request_id: Hashable) -> list[FeaturePiece]:
        """The request's held pieces in order (empty if none); they are forgotten here."""
        return self._pieces.pop(request_id, [])

    def drop(self, request_id: Hashable) -> None:
        self._pieces.pop(request_id, None)

    def __contains__(self, request_id: Hashable) -> bool:
        return bool(self._pieces.get(request_id))
