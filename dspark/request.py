"""One request's state in the engine: its prompt, sampling, output so far and how far the
target has read it (`Request`), and its speculative-decoding figures (`RequestMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.structured_output import GrammarRequest, GrammarSpec


@dataclass
class RequestMetrics:
    """Speculative-decoding figures of one request."""

    rounds: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[gamma] how often position k was accepted."""
    verified_per_position: list[int] = field(default_factory=list)
    """[gamma] how often position k was verified."""

    @property
    def tau(self) -> float:
        """Tokens per round (accepted drafts + 1)."""
        return (self.drafts_accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class Request:
    request_id: Hashable
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    generator: CounterGenerator
    output_ids: list[int] = field(default_factory=list)
    prefilled: int = 0
    """Prompt tokens the target has read so far (chunked prefill)."""
    finished: bool = False
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: int | None = None
    """Report the target's log-probability of each output token with this many top
    alternatives (dspark.logprobs); None = none."""
    recomputing: bool = False
    """Preempted after it had output: the target re-reads `tokens_to_read` (prompt and output
    before the anchor) and samples nothing; it runs again from its anchor."""
    grammar: GrammarSpec | None = None
    """Structured output: every token is sampled under this grammar (dspark.structured_output)."""
    earlier_output: tuple[int, ...] = ()
    """The end of the prompt that is output already (a resumed request's earlier output, given
    back as prompt): the grammar has read it, and min_tokens and the frequency and presence
    penalties count it as output, as if the request had never stopped."""
    fork_of: Hashable | None = None
    """The n samples of one prompt (dspark/forks.py): the request with the same prompt whose KV
    cache and drafter context this one copies when it joins, instead of reading its prompt
    (None: it reads its prompt)."""
    grammar_held: bool = False
    """The verifier holds the request's grammar state (false until its first token, and again
    after the verifier released it)."""

    @property
    def must_repeat(self) -> bool:
        """Sampled with a seed: its rounds must depend on its own prefix and seed only
        (dspark.seeded_admission). A greedy request repeats whatever its rounds, seed or not."""
        return self.generator.seeded and self.sampling.temperature > 0

    @property
    def num_output(self) -> int:
        """Output tokens so far, a resumed request's earlier output included."""
        return len(self.earlier_output) + len(self.output_ids)

    @property
    def prompt_length(self) -> int:
        """The length of the prompt proper: prompt_ids without the earlier output."""
        return len(self.prompt_ids) - len(self.earlier_output)

    @property
    def anchor_position(self) -> int:
        """Position of the last produced token (the anchor): the target holds everything before."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def grammar_request(self) -> GrammarRequest | None:
        """What the verifier's next item of this request carries about its grammar: the state
        to rebuild from the output so far unless the verifier holds it (None: no grammar)."""
        if self.grammar is None:
            return None
        return GrammarRequest(self.grammar, tuple(sorted(self.stop_token_ids)),
                              None if self.grammar_held
                              else self.earlier_output + tuple(self.output_ids))

    @property
    def tokens_to_read(self) -> list[int]:
        """What the target reads before the request runs: its prompt, or when recomputing
        everything before its anchor."""
        return self.prompt_ids + self.output_ids[:-1] if self.recomputing else self.prompt_ids
