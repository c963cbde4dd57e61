"""Which requests' target features the verifier holds for the drafter (`EngineConfig.hold_features`).

Every verification (and every prompt chunk) yields the target's hidden features of the tokens it
commits, and the drafter needs them as context before it next drafts the request. Under a load
where drafts do not pay, `async_topk` skips drafting in most rounds and a probe drafts only a few
requests, so the engine can mark a request's items `hold_features`: the verifier keeps those
features (dspark/feature_stash.py, where the pieces and their shapes are) instead of returning
them, and the engine takes them back just before the drafter next drafts the request. The drafter
then sees the same context in the same order, only later.

A round *holds* when it leaves the features of the requests it does not draft with the verifier;
the policy decides which rounds do (`AsyncTopKPolicy.holds`, dspark/round_policy.py: once a probe
found nothing to verify, and no round has verified drafts since, a round that skips drafting or
is a probe). A request is *held* from its first held item until its features are taken (or it
is released).

Invariants:
- a held request's later items are held too, drafted this round or not, so that its context
  reaches the drafter in order (all of it through `take`, none beside it);
- a request's features are taken (`take`) before the drafter drafts it, and then it is not held;
- a released request is forgotten (the verifier drops what it held with its cache).

The decisions depend only on the round's plan and on which requests are held, never on this
round's drafts or tokens, so the output stays exact.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Hashable, Sequence

if TYPE_CHECKING:
    from dspark.models.draft_types import Drafter
    from dspark.verifier import PrefillChunk, TargetVerifier


class HeldFeatures:
    """The requests whose features the verifier holds, and which items a round holds."""

    def __init__(self) -> None:
        self._held: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._held

    def verify_holds(self, request_ids: Sequence[Hashable], drafted: set,
                     holding: bool) -> list[bool]:
        """[R] whether each running request's verify item holds its features: in a holding
        round those not `drafted`, and whichever request is held already."""
        return [holding and rid not in drafted or rid in self._held for rid in request_ids]

    def chunk(self, chunk: PrefillChunk, holding: bool) -> PrefillChunk:
        """The chunk, its features held by the verifier in a round that holds features (or when
        the request's earlier features are held: its context stays in order)."""
        if holding or chunk.request_id in self._held:
            return dataclasses.replace(chunk, hold_features=True)
        return chunk

    def add(self, request_id: Hashable) -> None:
        """The verifier now holds (more of) this request's features."""
        self._held.add(request_id)

    def forget(self, request_id: Hashable) -> None:
        """The request left the engine; the verifier dropped what it held."""
        self._held.discard(request_id)

    def take(self, request_ids: Sequence[Hashable], verifier: TargetVerifier,
             drafter: Drafter) -> None:
        """Before drafting: hand the drafter the features the verifier held for these requests."""
        wanted = [rid for rid in request_ids if rid in self._held]
        if not wanted:
            return
        for rid, pieces in zip(wanted, verifier.take_features(wanted)):
            for piece in pieces:
                drafter.append_context(rid, piece.features, piece.positions, piece.token_ids)
            self._held.discard(rid)
