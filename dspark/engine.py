"""The round loop: continuous batching with confidence-scheduled verification (DESIGN.md 5-7).

One `step()` is one round for every running request:
1. waiting requests join (up to `max_running`): the verifier prefills their prompts, samples
   each one's first token, and the drafter receives the prompt's target features;
2. the drafter drafts a block of gamma tokens for every running request (anchor = last token);
3. the admission policy decides from the blocks' confidences how many drafts of each request
   the target verifies (l_r; capped so no request overshoots its max_tokens);
4. the verifier runs one flattened target forward over every [anchor, x_1..x_l] and does
   lossless rejection sampling; the committed tokens' features go back to the drafter;
5. new tokens are checked against EOS / stop tokens / max_tokens and handed to the caller.
The drafter, the admission and the verifier are separate objects with narrow interfaces; the
loop does not know whether they are in-process or remote.

With no drafter (or policy `none`) every round is an ordinary decoding step, still exact.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np
import torch

from dspark.admission import AdmissionConfig, AdmissionPolicy, Admitter, PolicyKind
from dspark.cost_table import CostTable, ThetaObjective
from dspark.models.drafter import DraftRequest, Drafter
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier, VerifyRequest


@dataclass(frozen=True)
class EngineConfig:
    """How the embedded engine runs."""

    policy: AdmissionPolicy = field(default_factory=lambda: AdmissionPolicy.parse("async_topk"))
    """Admission policy (DESIGN.md section 6); `none` = target only."""
    max_running: int = 16
    """Requests verified together in one round; the rest wait."""
    sparse_top_k: int | None = None
    """Ship draft distributions as top-k (indices, probs); None = dense. The drafter samples from
    exactly this truncation, so verification stays lossless."""
    update_cost_table: bool = True
    """Refresh SPS(B) from measured verification step times, and the drafting time per round
    from measured drafting, while serving."""
    probe_interval: int = 8
    """`async_topk`: a round whose K (decided two rounds earlier) is 0 verifies no drafts, so it
    skips drafting; but at least every `probe_interval` rounds the drafter drafts anyway, so that
    fresh confidences can raise K again. 0 = always draft. When drafter and verifier share one
    device, drafting costs the round time; this keeps a weak drafter from slowing decoding."""
    max_probe_interval: int = 64
    """A probe that again leads to K = 0 doubles the interval, up to this many rounds; a round
    that verifies drafts, or a request joining the batch, brings it back to `probe_interval`.
    Under load that no draft can pay for, probes then cost a few tenths of a percent instead
    of a few percent (a probe drafts for every running request). = probe_interval: no backoff."""

    objective: ThetaObjective = ThetaObjective.SHARED_DEVICE
    """What admission maximises. SHARED_DEVICE (default): drafting and verification take turns
    on the same device, and a round whose K is 0 skips drafting, so a draft is verified only
    when it pays for its share of the drafting as well; the drafting time per round is measured
    (`CostTable.observe_draft`). PAPER: drafting is overlapped with verification (cohorts)."""

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", AdmissionPolicy.parse(self.policy))
        if not isinstance(self.objective, ThetaObjective):
            object.__setattr__(self, "objective", ThetaObjective(self.objective))
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.probe_interval < 0:
            raise ValueError("probe_interval must be >= 0")
        if self.max_probe_interval < self.probe_interval:
            raise ValueError(f"max_probe_interval ({self.max_probe_interval}) must be >= "
                             f"probe_interval ({self.probe_interval})")


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
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def anchor_position(self) -> int:
        """Position of the last produced token (the anchor): the target holds everything before."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


@dataclass
class StepOutput:
    """What one request got in one round."""

    request_id: Hashable
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class EngineStats:
    rounds: int = 0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    admission_seconds: float = 0.0
    prefill_seconds: float = 0.0
    batch_tokens: list[int] = field(default_factory=list)
    capacity: list[int] = field(default_factory=list)
    skipped_draft_rounds: int = 0
    """async_topk rounds that did not draft because their K was known to be 0."""


@dataclass
class RoundRecord:
    """What one speculative round did, for an observer (`Engine.round_observer`): evaluation and
    calibration read acceptance and confidences from it. One entry per running request."""

    request_ids: list[Hashable]
    confidences: torch.Tensor
    """[num_requests, positions drafted] float32 c_k exactly as the drafter returned them (the
    whole block gamma unless async_topk drafted fewer, see Engine._positions_to_draft)."""
    num_admitted: list[int]
    """[num_requests] l_r: drafts sent to the target."""
    num_accepted: list[int]
    """[num_requests] drafts accepted (<= l_r)."""


class Engine:
    """The embedded DSpark engine: drafter + admission + verifier in one process."""

    def __init__(self, verifier: TargetVerifier, drafter: Drafter | None, cost_table: CostTable,
                 config: EngineConfig = EngineConfig()) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.cost_table = cost_table
        self.config = config
        policy = config.policy if drafter is not None else AdmissionPolicy(PolicyKind.NONE)
        self.speculative = policy.kind is not PolicyKind.NONE
        self.admitter = Admitter(AdmissionConfig(policy=policy, objective=config.objective), cost_table)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._rounds_without_draft = 0
        self._probe_interval = config.probe_interval
        """Rounds between probes now: probe_interval, doubled after each fruitless probe."""
        self.round_observer: Callable[[RoundRecord], None] | None = None
        """Called once per speculative round (after verification) with its RoundRecord."""

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    max_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                    request_id: Hashable | None = None) -> Hashable:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        rid = next(self._ids) if request_id is None else request_id
        self.waiting.append(Request(rid, list(prompt_ids), sampling, max_tokens,
                                    frozenset(stop_token_ids), sampling.generator()))
        return rid

    def abort(self, request_id: Hashable) -> None:
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        for r in [r for r in self.running if r.request_id == request_id]:
            self._release(r)
            self.running.remove(r)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the round ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        outputs += self._admit_waiting()
        if self.running:
            outputs += self._round()
        return outputs

    def _admit_waiting(self) -> list[StepOutput]:
        joining = self.waiting[:max(0, self.config.max_running - len(self.running))]
        if not joining:
            return []
        self.waiting = self.waiting[len(joining):]
        self._probe_interval = self.config.probe_interval  # new requests: new evidence soon
        start = time.perf_counter()
        out = self.verifier.prefill([r.request_id for r in joining], [r.prompt_ids for r in joining],
                                    [r.sampling for r in joining], [r.generator for r in joining])
        self.stats.prefill_seconds += time.perf_counter() - start
        outputs = []
        for r, token, features in zip(joining, out.first_tokens, out.features):
            if self.speculative:
                self.drafter.append_context(r.request_id, features,
                                            torch.arange(len(r.prompt_ids)),
                                            torch.tensor(r.prompt_ids))
            self.running.append(r)
            outputs.append(self._emit(r, [token]))
        self._retire_finished()
        return outputs

    def _round(self) -> list[StepOutput]:
        running = self.running
        gamma = self.drafter.gamma if self.speculative else 0
        blocks = [None] * len(running)
        lengths = np.zeros(len(running), dtype=np.int64)
        drafting = self.speculative and not self._skip_drafting()
        if self.speculative and not drafting:
            self.admitter.skip(len(running), gamma)
            self._rounds_without_draft += 1
            self.stats.skipped_draft_rounds += 1
            self.stats.capacity.append(0)
        if drafting:
            self._rounds_without_draft = 0
            start = time.perf_counter()
            num_positions = self._positions_to_draft(gamma)
            blocks = self.drafter.draft(
                [DraftRequest(r.request_id, r.output_ids[-1], r.anchor_position, r.sampling,
                              r.generator) for r in running],
                sparse_top_k=self.config.sparse_top_k, num_positions=num_positions)
            mid = time.perf_counter()
            confidences = torch.stack([b.confidences for b in blocks]).float()  # [R, num_positions]
            # No request verifies more drafts than it may still emit (the bonus is the +1).
            caps = np.array([max(0, min(num_positions, r.max_tokens - len(r.output_ids) - 1))
                             for r in running])
            lengths = self.admitter.admit(confidences, max_lengths=caps, block_size=gamma)
            end = time.perf_counter()
            self.stats.draft_seconds += mid - start
            self.stats.admission_seconds += end - mid
            if self.config.update_cost_table:
                self.cost_table.observe_draft(mid - start)
            if self.admitter.capacity_used is not None:
                self.stats.capacity.append(self.admitter.capacity_used)
                self._back_off_probes(self.admitter.capacity_used)

        result = self.verifier.verify([
            VerifyRequest(r.request_id, r.output_ids[-1], block, int(n), r.sampling, r.generator)
            for r, block, n in zip(running, blocks, lengths)])
        self.stats.rounds += 1
        self.stats.verify_seconds += result.step_seconds
        self.stats.batch_tokens.append(result.batch_tokens)
        if self.config.update_cost_table:
            self.cost_table.observe(result.batch_tokens, result.step_seconds)
        if self.round_observer is not None and drafting:
            self.round_observer(RoundRecord([r.request_id for r in running], confidences,
                                            [int(n) for n in lengths], list(result.num_accepted)))

        outputs = []
        for r, n, accepted, tokens, features in zip(running, lengths, result.num_accepted,
                                                    result.output_tokens, result.features):
            self._record_metrics(r, int(n), accepted, gamma)
            if self.speculative:
                first = r.anchor_position
                self.drafter.append_context(r.request_id, features,
                                            torch.arange(first, first + 1 + accepted),
                                            torch.tensor([r.output_ids[-1]] + tokens[:accepted]))
            outputs.append(self._emit(r, tokens))
        self._retire_finished()
        return outputs

    def _positions_to_draft(self, gamma: int) -> int:
        """Positions per block worth drafting this round. With `async_topk` and a known K, no
        draft past position K can be admitted (Admitter.planned_capacity), so K + 1 positions are
        drafted: the extra one lets the confidences of this round raise K for a later one. The
        admitted drafts are the same as with whole blocks; K is the stale value, never this
        round's tokens."""
        planned = self.admitter.planned_capacity()
        return gamma if planned is None else min(gamma, planned + 1)

    def _skip_drafting(self) -> bool:
        """Whether this round's K is known to be 0 (async_topk) and no probe is due."""
        interval = self._probe_interval
        return (interval > 0 and self._rounds_without_draft < interval - 1
                and self.admitter.capacity_known_zero())

    def _back_off_probes(self, capacity_used: int) -> None:
        """After a drafting round: a probe (K was 0, so it verified nothing) doubles the probe
        interval, up to max_probe_interval; a round that could verify drafts resets it. Only
        past rounds' K decide, never this round's drafts."""
        base = self.config.probe_interval
        if capacity_used > 0 or base == 0:
            self._probe_interval = base
        else:
            self._probe_interval = min(2 * self._probe_interval, self.config.max_probe_interval)

    # -- bookkeeping -------------------------------------------------------------------------
    def _record_metrics(self, r: Request, verified: int, accepted: int, gamma: int) -> None:
        m = r.metrics
        if len(m.accepted_per_position) < gamma:
            m.accepted_per_position += [0] * (gamma - len(m.accepted_per_position))
            m.verified_per_position += [0] * (gamma - len(m.verified_per_position))
        m.rounds += 1
        m.drafts_verified += verified
        m.drafts_accepted += accepted
        for k in range(verified):
            m.verified_per_position[k] += 1
        for k in range(accepted):
            m.accepted_per_position[k] += 1

    def _emit(self, r: Request, tokens: list[int]) -> StepOutput:
        """Append tokens to the request, cutting at a stop token or max_tokens."""
        new = []
        for t in tokens:
            new.append(t)
            if t in r.stop_token_ids:
                r.finished, r.finish_reason = True, "stop"
                break
            if len(r.output_ids) + len(new) >= r.max_tokens:
                r.finished, r.finish_reason = True, "length"
                break
        r.output_ids += new
        return StepOutput(r.request_id, new, r.finished, r.finish_reason)

    def _retire_finished(self) -> None:
        for r in [r for r in self.running if r.finished]:
            self._release(r)
            self.running.remove(r)

    def _release(self, r: Request) -> None:
        self.verifier.release(r.request_id)
        if self.speculative:
            self.drafter.release(r.request_id)

    # -- convenience -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(),
                 max_tokens: int = 128, stop_token_ids: Sequence[int] = ()) -> list[Request]:
        """Run prompts to completion (all submitted at once); returns the finished requests."""
        requests = {}
        for p in prompts:
            rid = self.add_request(p, sampling, max_tokens, stop_token_ids)
            requests[rid] = None
        by_id = {r.request_id: r for r in self.waiting if r.request_id in requests}
        while self.has_unfinished():
            self.step()
        return [by_id[rid] for rid in requests]

    def stream(self) -> Iterator[StepOutput]:
        """Step until nothing is left, yielding every request's new tokens as they come."""
        while self.has_unfinished():
            yield from self.step()
