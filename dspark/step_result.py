"""What one engine step did: `Engine.step() -> StepResult`.

The engine loop, the metrics, the traces, the evaluation and the benchmarks read a step's numbers
here, instead of observing the engine from the side or subtracting running counters. The engine
keeps running totals too (`EngineStats`), summed from these results in one place (`add`).

Glossary
- *round*: the part of a step that decodes the running requests (one verification forward); a
  step may also read prompts, and a step that only reads prompts has no round (`mode` None).
- *proposed* drafts: draft tokens the drafter drafted this step; *admitted*: those sent to the
  target (sum of l_r); *accepted*: those the target accepted (the bonus token not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Hashable

import torch

from dspark.drafting_gate import RoundMode
from dspark.logprobs import TokenLogprobs


@dataclass
class StepOutput:
    """What one request got in one round."""

    request_id: Hashable
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None
    """The new tokens' log-probabilities (one row each) when the request asked."""
    error: str | None = None
    """finish_reason "error": why (the KV cache cannot hold the request even alone)."""


@dataclass
class RoundRecord:
    """The drafted requests of one speculative round, for evaluation and calibration (acceptance
    and confidences). One entry per drafted request: every running request, or a sampled probe's
    few (DraftingGateConfig.probe_requests), which verify nothing."""

    request_ids: list[Hashable]
    confidences: torch.Tensor
    """[num_requests, positions drafted] float32 c_k exactly as the drafter returned them (the
    whole block gamma unless the policy admits fewer, see Admitter.positions_to_draft)."""
    num_admitted: list[int]
    """[num_requests] l_r: drafts sent to the target."""
    num_accepted: list[int] | None
    """[num_requests] drafts accepted (<= l_r); filled in after verification."""


@dataclass
class StageSeconds:
    """Wall seconds of a step by stage. Together they are not the whole step: the rest is the
    engine's own bookkeeping."""

    prefill: float = 0.0
    """Reading prompts: whole prefill forwards, and the prompt tokens' share (by tokens) of a
    verification forward that also read prompt chunks."""
    draft: float = 0.0
    """The drafter's call (with the held features it is handed just before)."""
    admission: float = 0.0
    """The admission policy's decision."""
    verify: float = 0.0
    """The verification forward, less the prompt tokens' share (what the verifier reports)."""
    verify_call: float = 0.0
    """The verifier call's wall time beyond the forward: sampling and commits, and with a remote
    verifier the (de)serialising and transfers too."""
    drafter_context: float = 0.0
    """Handing committed tokens' target features to the drafter (`append_context`) after
    verification and after prompt chunks."""

    def add(self, other: StageSeconds) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class RoundStats:
    """The numbers of one step."""

    mode: RoundMode | None = None
    """What the round did before verification (also when a preemption then undid it); None:
    the step had no round (it only read prompts)."""
    batch_size: int = 0
    """Running requests in the round (each verifies its anchor and its admitted drafts)."""
    batch_tokens: int | None = None
    """Tokens of the verification forward (None: no verification forward this step)."""
    capacity: int | None = None
    """async_topk: the K the round used (0 for a round that drafted nothing); None otherwise."""
    drafts_proposed: int = 0
    drafts_admitted: int = 0
    drafts_accepted: int = 0
    preemptions: int = 0
    """Requests preempted because the KV cache could not hold the step."""
    prompt_tokens: int = 0
    """Prompt tokens the target read this step (a preempted request's re-read included)."""
    forked_tokens: int = 0
    """Prompt tokens requests took from a sibling's KV cache this step instead of reading them
    (dspark/forks.py)."""
    seconds: StageSeconds = field(default_factory=StageSeconds)
    drafted: RoundRecord | None = None
    """The drafted requests (None: the round drafted nothing, or a preemption undid it before
    its drafts were verified)."""

    @property
    def verified(self) -> bool:
        """Whether the step ran a verification forward (a round)."""
        return self.batch_tokens is not None


@dataclass
class StepResult:
    """What `Engine.step()` did: every request's new tokens, and the step's numbers."""

    outputs: list[StepOutput]
    stats: RoundStats

    @property
    def finished(self) -> list[StepOutput]:
        """The outputs of requests that finished this step."""
        return [o for o in self.outputs if o.finished]

    @property
    def new_tokens(self) -> int:
        return sum(len(o.new_token_ids) for o in self.outputs)


@dataclass
class EngineStats:
    """Running totals of every step's RoundStats (`add`)."""

    rounds: int = 0
    seconds: StageSeconds = field(default_factory=StageSeconds)
    batch_tokens: list[int] = field(default_factory=list)
    capacity: list[int] = field(default_factory=list)
    skipped_draft_rounds: int = 0
    """async_topk rounds that did not draft because their K was known to be 0."""
    sampled_probe_rounds: int = 0
    """async_topk probes that drafted only a sample of the running requests (probe_requests)."""
    plain_check_rounds: int = 0
    """async_topk rounds that drafted nothing although K could be > 0 (plain_check_interval)."""
    preemptions: int = 0
    """Requests preempted because the KV cache could not hold a round (see dspark.batching)."""
    prompt_tokens: int = 0
    """Prompt tokens the target read (RoundStats.prompt_tokens summed)."""
    forked_tokens: int = 0
    """Prompt tokens taken from a sibling's KV cache instead (RoundStats.forked_tokens summed)."""

    def add(self, step: RoundStats) -> None:
        self.seconds.add(step.seconds)
        if step.verified:
            self.rounds += 1
            self.batch_tokens.append(step.batch_tokens)
        if step.capacity is not None:
            self.capacity.append(step.capacity)
        self.skipped_draft_rounds += step.mode is RoundMode.SKIP
        self.sampled_probe_rounds += step.mode is RoundMode.PROBE_SAMPLE
        self.plain_check_rounds += step.mode is RoundMode.PLAIN_CHECK
        self.preemptions += step.preemptions
        self.prompt_tokens += step.prompt_tokens
        self.forked_tokens += step.forked_tokens

    # The totals by stage, under the names the benchmarks and tests have read.
    @property
    def prefill_seconds(self) -> float:
        return self.seconds.prefill

    @property
    def draft_seconds(self) -> float:
        return self.seconds.draft

    @property
    def admission_seconds(self) -> float:
        return self.seconds.admission

    @property
    def verify_seconds(self) -> float:
        return self.seconds.verify

    @property
    def verify_call_seconds(self) -> float:
        return self.seconds.verify_call
