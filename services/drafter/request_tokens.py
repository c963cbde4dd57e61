"""What the drafter service knows of each request's tokens: the replay that the penalties and the
grammar of its drafts read (dspark.models.draft_processing).

In the embedded engine a draft request carries its tokens (`DraftRequest.token_ids`) and the
verifier's grammar matcher (`DraftRequest.grammar`). Over the services neither crosses the wire
per round: the drafter already receives every token of a request's context, in order, as the
token ids of its context updates (positions < the anchor's), and each draft item names the
anchor and how many of the tokens are output (`num_output`). This record keeps those tokens by
position, so that

- a penalised request's tokens are its record before the anchor, then the anchor;
- a constrained request's matcher (built from the item's grammar spec, compiled once per spec by
  the GrammarCompiler's cache) is advanced through the output tokens it has not seen yet, the
  anchor included: the same state the verifier's matcher has after the committed output.

A request's record follows its context: a reset or a release drops it, a fork copies the
parent's tokens before the fork position (the child gets its own matcher).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dspark.structured_output import GrammarCompiler, GrammarRequest, GrammarState

MISSING = -1
"""A position whose token the context did not carry (an update without token ids)."""


@dataclass
class _Matcher:
    grammar: GrammarRequest
    state: GrammarState
    fed: list[int] = field(default_factory=list)
    """The output tokens the state has accepted, in order."""


class RequestTokens:
    """Each request's context tokens by position, and its grammar matcher."""

    def __init__(self, grammars: GrammarCompiler | None) -> None:
        self.grammars = grammars
        """Compiles the specs of constrained requests (None: a constrained item is refused)."""
        self._tokens: dict[str, list[int]] = {}
        self._matchers: dict[str, _Matcher] = {}

    def record(self, request_id: str, positions: Sequence[int],
               token_ids: Sequence[int] | None) -> None:
        """A context update's tokens at their positions (None: not carried)."""
        held = self._tokens.setdefault(request_id, [])
        for i, position in enumerate(positions):
            token = MISSING if token_ids is None else int(token_ids[i])
            if position >= len(held):
                held.extend([MISSING] * (position + 1 - len(held)))
            held[position] = token

    def fork(self, parent_id: str, child_id: str, num_positions: int) -> None:
        self.release(child_id)
        self._tokens[child_id] = list(self._tokens.get(parent_id, [])[:num_positions])

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def through_anchor(self, request_id: str, anchor_token: int,
                       anchor_position: int) -> list[int]:
        """The request's tokens at positions 0..anchor_position: its context's, then the anchor.
        ValueError when the context lacks some (not sent, or sent without token ids)."""
        held = self._tokens.get(request_id, [])[:anchor_position]
        if len(held) < anchor_position or MISSING in held:
            raise ValueError(f"{request_id}: its penalties or grammar read the tokens before the "
                             f"anchor, but the context holds no token ids for some of positions "
                             f"0..{anchor_position - 1}")
        return [*held, int(anchor_token)]

    def grammar_state(self, request_id: str, grammar: GrammarRequest,
                      output: Sequence[int]) -> GrammarState:
        """The request's matcher after `output` (its output tokens, the anchor last): the one
        held, advanced through the tokens it has not seen; built anew for a new request, a new
        spec, or an output that does not continue what it saw."""
        if self.grammars is None:
            raise ValueError(f"{request_id}: this drafter has no tokenizer to compile "
                             "structured-output grammars with")
        matcher = self._matchers.get(request_id)
        output = [int(t) for t in output]
        if (matcher is None or matcher.grammar != grammar or len(output) < len(matcher.fed)
                or output[:len(matcher.fed)] != matcher.fed):
            matcher = _Matcher(grammar, self.grammars.start(grammar.spec, grammar.stop_token_ids))
            self._matchers[request_id] = matcher
        new = output[len(matcher.fed):]
        try:
            matcher.state.observe(new)
        except RuntimeError as e:  # a token the grammar refuses: the replay is not its output
            self._matchers.pop(request_id, None)
            raise ValueError(f"{request_id}: {e}") from None
        matcher.fed.extend(new)
        return matcher.state
