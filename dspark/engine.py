"""The round loop: continuous batching with confidence-scheduled verification (DESIGN.md 5-7).

One `step()` is one round for every running request:
1. waiting requests join (up to `max_running`): the target reads their prompts, in chunks of at
   most `prefill_chunk_tokens` per round that ride in the round's verification forward (chunked
   prefill); a prompt's last chunk samples the request's first token, and the drafter receives
   each chunk's target features;
2. the drafter drafts a block of gamma tokens for every running request (anchor = last token);
3. the admission policy decides from the blocks' confidences how many drafts of each request
   the target verifies (l_r; capped so no request overshoots its max_tokens);
4. the verifier runs one flattened target forward over every [anchor, x_1..x_l] and does
   lossless rejection sampling; the committed tokens' features go back to the drafter (or,
   for a request this round did not draft, wait in the verifier until it is next drafted);
5. new tokens are checked against EOS / stop tokens / max_tokens and handed to the caller.
When the verifier's KV cache cannot hold a round's tokens (`KVCacheFull`, nothing changed there),
the newest request that holds cache is preempted, as vLLM's scheduler does by recomputation: its
cache is released, it waits at the head of the queue, and when it joins again the target re-reads
its prompt and output before the anchor without sampling anything, so the tokens it already has
are kept and its output is what it would have been. Joining stops until a request finishes, so
the others go on. A request that cannot fit alone ends with an error; nobody else is touched.
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
from dspark.drafting_gate import DraftingGate, DraftingGateConfig, RoundMode, RoundPlan
from dspark.gumbel_verification import request_generator
from dspark.held_features import HeldFeatures
from dspark.logprobs import TokenLogprobs, check_num_top
from dspark.models.draft_types import DraftRequest, Drafter
from dspark.models.kv_cache import KVCacheFull
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.seeded_admission import gate_bypassed, override_seeded
from dspark.verifier import PrefillChunk, TargetVerifier, VerifyOutput, VerifyRequest


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
    that verifies drafts, or at most half as many requests in the engine as at any such probe
    since (a much lighter load, down to an empty engine), brings it back to `probe_interval`;
    a request joining, or one finishing before the next arrives, does not. Under load that no
    draft can pay for, probes then cost a few tenths of a percent instead of a few percent (a
    probe drafts for every running request). = probe_interval: no backoff."""

    prefill_chunk_tokens: int = 256
    """Chunked prefill: joining requests' prompts are read in the same target forward as the
    running requests' verification, at most this many prompt tokens a round, oldest joiner
    first (a long prompt takes several rounds). A prompt's last chunk samples the request's
    first token; it is drafted and verified from the next round on. Running requests then never
    stop for a prefill forward of its own, nor wait longer than one chunk. 0 = whole prompts,
    in a forward of their own before the round (and the joiners decode in that same step)."""
    probe_requests: int = 4
    """A probe (a drafting round whose K is known to be 0, so it verifies nothing) drafts at most
    this many of the running requests (never chosen by their tokens): those the last probe drafted
    that still run, then the newest joiners; the admission fills in the others with its running
    means. Under a load where no draft pays, a probe then costs the drafting of a few requests,
    not of the whole batch, and each probe's requests bring little context the drafter has not
    seen (the same requests since the last probe, or a prompt just read); the context of requests
    that are never drafted is never projected (or, with a remote drafter, never sent). 0 = every
    probe drafts every request."""
    hold_features: bool = True
    """async_topk, once a probe found nothing to verify (until a round verifies drafts again): in
    rounds that do not draft a request (skipping, or a probe's other requests), its target
    features stay with the verifier (`VerifyRequest.hold_features`) until the drafter next
    drafts it (`take_features`). With a remote verifier they then cross the wire only for
    requests that are drafted. The drafter sees the same context in the same order either way."""

    plain_check_interval: int = 16
    """async_topk: after this many rounds in a row that verified drafts, one round drafts
    nothing (a plain check), when the decision was close (below `plain_check_gain`) and no
    prompt chunk rides in the round, so that the cost table measures the round without drafts
    now. While every round drafts, nothing else measures the option not taken, and the cost
    table extrapolates it (bf16: 126-141 ms estimated at 16 requests where such rounds
    took about 120). Decided by round counts and old decisions only, so the output stays
    exact. 0 = never."""
    plain_check_gain: float = 1.3
    """A plain check only while the planned K's expected gain over no drafts is below this:
    at one user, where drafts clearly pay, no round gives them up."""

    min_gain: float = 1.05
    """async_topk: verify drafts only when their expected Theta is at least this many times
    Theta without drafts (`AdmissionConfig.min_gain`); 1.0 = the plain argmax."""

    objective: ThetaObjective = ThetaObjective.SHARED_DEVICE
    """What admission maximises. SHARED_DEVICE (default): drafting and verification take turns
    on the same device, and a round whose K is 0 skips drafting, so a draft is verified only
    when it pays for its share of the drafting as well; the drafting time per round is measured
    (`CostTable.observe_draft`). PAPER: drafting is overlapped with verification (cohorts)."""

    kv_cache_tokens: int = 0
    """Verifier KV cache this engine may fill, in tokens; 0 = not checked. A waiting request
    joins only while the worst case of every joined request fits: prompt + max_tokens + gamma + 1
    tokens (the anchor and a full draft block are written before the rejected drafts are cut),
    rounded up to whole `kv_block_size` blocks. Beyond that it waits in the queue instead of
    running into a KVCacheFull that fails the round for everyone (vLLM's scheduler also admits
    against free blocks; it preempts where this reserves)."""
    kv_block_size: int = 1
    """The verifier's KV cache block size, in tokens."""

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < 0 or self.kv_block_size < 1:
            raise ValueError("kv_cache_tokens must be >= 0 and kv_block_size >= 1")
        if isinstance(self.policy, str):
            object.__setattr__(self, "policy", AdmissionPolicy.parse(self.policy))
        if not isinstance(self.objective, ThetaObjective):
            object.__setattr__(self, "objective", ThetaObjective(self.objective))
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        self.drafting_gate_config()  # validates the probe and plain-check fields

    def drafting_gate_config(self) -> DraftingGateConfig:
        """The drafting gate's rules (probes, their back-off, plain checks) from these fields."""
        return DraftingGateConfig(
            probe_interval=self.probe_interval, max_probe_interval=self.max_probe_interval,
            probe_requests=self.probe_requests, plain_check_interval=self.plain_check_interval,
            plain_check_gain=self.plain_check_gain)


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

    @property
    def anchor_position(self) -> int:
        """Position of the last produced token (the anchor): the target holds everything before."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def tokens_to_read(self) -> list[int]:
        """What the target reads before the request runs: its prompt, or when recomputing
        everything before its anchor."""
        return self.prompt_ids + self.output_ids[:-1] if self.recomputing else self.prompt_ids


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
class EngineStats:
    rounds: int = 0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    admission_seconds: float = 0.0
    prefill_seconds: float = 0.0
    verify_call_seconds: float = 0.0
    """Verifier calls' wall time beyond the forward they report (step_seconds): sampling and
    commits, and with a remote verifier the (de)serialising and transfers too."""
    batch_tokens: list[int] = field(default_factory=list)
    capacity: list[int] = field(default_factory=list)
    skipped_draft_rounds: int = 0
    """async_topk rounds that did not draft because their K was known to be 0."""
    sampled_probe_rounds: int = 0
    """async_topk probes that drafted only a sample of the running requests (probe_requests)."""
    plain_check_rounds: int = 0
    """async_topk rounds that drafted nothing although K could be > 0 (plain_check_interval)."""
    preemptions: int = 0
    """Requests preempted because the KV cache could not hold a round (see the module doc)."""


@dataclass
class RoundRecord:
    """What one speculative round did, for an observer (`Engine.round_observer`): evaluation and
    calibration read acceptance and confidences from it. One entry per drafted request: every
    running request, or a sampled probe's few (EngineConfig.probe_requests), which verify nothing."""

    request_ids: list[Hashable]
    confidences: torch.Tensor
    """[num_requests, positions drafted] float32 c_k exactly as the drafter returned them (the
    whole block gamma unless the policy admits fewer, see Admitter.positions_to_draft)."""
    num_admitted: list[int]
    """[num_requests] l_r: drafts sent to the target."""
    num_accepted: list[int] | None
    """[num_requests] drafts accepted (<= l_r); filled in after verification."""


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
        self.admitter = Admitter(AdmissionConfig(policy=policy, objective=config.objective,
                                                 min_gain=config.min_gain), cost_table)
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        """Joined (they hold a slot) but their prompts are not all read yet (chunked prefill)."""
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self.drafting_gate = DraftingGate(config.drafting_gate_config())
        """Decides whether each round drafts (probes, skips, plain checks); see drafting_gate.py."""
        self._held = HeldFeatures(self.speculative and config.hold_features)
        """Requests whose features the verifier holds for the drafter; see held_features.py."""
        self.round_observer: Callable[[RoundRecord], None] | None = None
        """Called once per speculative round (after verification) with its RoundRecord."""
        self._joins_paused = False
        """Set by a preemption: nobody joins until a request leaves (or none holds cache)."""

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    max_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                    request_id: Hashable | None = None, logprobs: int | None = None) -> Hashable:
        """`logprobs`: report the target's log-probabilities of the output tokens with this
        many top alternatives (0..dspark.logprobs.MAX_TOP_LOGPROBS); None = none."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if logprobs is not None:
            check_num_top(logprobs)
        rid = next(self._ids) if request_id is None else request_id
        generator = request_generator(sampling, getattr(self.verifier, "rule", None))
        self.waiting.append(Request(rid, list(prompt_ids), sampling, max_tokens,
                                    frozenset(stop_token_ids), generator, logprobs=logprobs))
        return rid

    def abort(self, request_id: Hashable) -> None:
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        for held in (self.prefilling, self.running):
            for r in [r for r in held if r.request_id == request_id]:
                self._release(r)
                held.remove(r)
                self._joins_paused = False
        self.drafting_gate.reset_if_idle(self._load())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # -- the round ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        try:
            if self.config.prefill_chunk_tokens == 0:
                outputs += self._admit_waiting()
                if self.running:
                    outputs += self._round([])
                return outputs
            self._join_waiting()
            chunks = self._plan_chunks()
            if self.running:
                outputs += self._round(chunks)
            elif chunks:
                outputs += self._prefill_only(chunks)
        except KVCacheFull as full:  # the verifier's cache is as it was before the call
            outputs += self._preempt_newest(full)
        return outputs

    def _join_waiting(self) -> None:
        """Waiting requests take the free slots (chunked prefill: their prompts come later), in
        arrival order, while their worst-case KV cache fits (EngineConfig.kv_cache_tokens)."""
        if self._joins_paused and (self.running or self.prefilling):
            return
        self._joins_paused = False
        free = self.config.max_running - len(self.running) - len(self.prefilling)
        joining = self.waiting[:max(0, free)]
        if self.config.kv_cache_tokens:
            reserved = sum(self._kv_tokens_reserved(r) for r in [*self.running, *self.prefilling])
            fitting = 0
            for r in joining:
                need = self._kv_tokens_reserved(r)
                alone = not (self.running or self.prefilling or fitting)
                if reserved + need > self.config.kv_cache_tokens and not alone:
                    break  # first come, first served: later ones do not overtake it
                reserved += need
                fitting += 1
            joining = joining[:fitting]
        if joining:
            self.waiting = self.waiting[len(joining):]
            self.prefilling += joining

    def _preempt_newest(self, full: KVCacheFull) -> list[StepOutput]:
        """The cache could not hold this step: the request that joined last gives its cache up
        and waits first in line (recomputed when it joins again), or, alone, ends with an error."""
        alone = len(self.running) + len(self.prefilling) == 1
        victim = (self.prefilling or self.running).pop()
        self._release(victim)
        if alone:
            victim.finished, victim.finish_reason = True, "error"
            self.drafting_gate.reset_if_idle(self._load())
            return [StepOutput(victim.request_id, [], True, "error",
                               error=f"the KV cache cannot hold this request ({full})")]
        victim.prefilled = 0
        victim.recomputing = bool(victim.output_ids)
        self.waiting.insert(0, victim)
        self._joins_paused = True
        self.stats.preemptions += 1
        return []

    def _kv_tokens_reserved(self, r: Request) -> int:
        gamma = self.drafter.gamma if self.speculative else 0
        block = self.config.kv_block_size
        return -(-(len(r.prompt_ids) + r.max_tokens + gamma + 1) // block) * block

    def _plan_chunks(self, budget: int | None = None, requests: Sequence[Request] | None = None
                     ) -> list[tuple[Request, PrefillChunk]]:
        """This round's prompt pieces, the oldest joiners first: up to `budget` prompt tokens
        (None: prefill_chunk_tokens) of `requests` (None: every joiner)."""
        budget = self.config.prefill_chunk_tokens if budget is None else budget
        planned = []
        for r in self.prefilling if requests is None else requests:
            if budget == 0:
                break
            tokens = r.tokens_to_read
            end = min(len(tokens), r.prefilled + budget)
            final = end == len(tokens) and not r.recomputing  # a recompute samples nothing
            planned.append((r, PrefillChunk(r.request_id, tokens[r.prefilled:end], final,
                                            r.sampling, r.generator, continued=r.prefilled > 0,
                                            logprobs=r.logprobs)))
            budget -= end - r.prefilled
        return planned

    def _prefill_only(self, planned: list[tuple[Request, PrefillChunk]]) -> list[StepOutput]:
        """A step with nothing to decode: the forward reads prompt chunks only."""
        chunks = [self._held.chunk(c, False) for _, c in planned]
        start = time.perf_counter()
        out = self.verifier.verify([], chunks)
        self.stats.prefill_seconds += time.perf_counter() - start
        outputs = self._take_chunks(planned, out.prefill, chunks)
        self._retire_finished()
        return outputs

    def _take_chunks(self, planned: list[tuple[Request, PrefillChunk]], result,
                     sent: Sequence[PrefillChunk] | None = None) -> list[StepOutput]:
        """Record what the target read; a finished prompt's request starts running with its
        first token. The drafter gets each chunk's features, unless the verifier holds them
        (`sent`: the chunks as sent, when they may say hold_features)."""
        outputs = []
        sent = [c for _, c in planned] if sent is None else sent
        logprobs = result.logprobs or [None] * len(planned)
        for (r, chunk), token, features, as_sent, first_logprobs in zip(
                planned, result.first_tokens, result.features, sent, logprobs):
            start, end = r.prefilled, r.prefilled + len(chunk.token_ids)
            if as_sent.hold_features:
                self._held.add(r.request_id)
            elif self.speculative:
                self.drafter.append_context(r.request_id, features, torch.arange(start, end),
                                            torch.tensor(list(chunk.token_ids)))
            r.prefilled = end
            if chunk.final:
                self.prefilling.remove(r)
                self.running.append(r)
                outputs.append(self._emit(r, [token], first_logprobs))
            elif r.recomputing and end == len(r.tokens_to_read):
                r.recomputing = False  # its anchor is its last output token again
                self.prefilling.remove(r)
                self.running.append(r)
        return outputs

    def _admit_waiting(self) -> list[StepOutput]:
        """Unchunked prefill: the joiners' whole prompts in one prompt-only forward, before the
        round; a joiner runs from its first token on."""
        self._join_waiting()
        outputs = []
        again = [r for r in self.prefilling if r.recomputing]
        if again:  # preempted requests re-read their tokens without sampling
            outputs += self._prefill_only(self._plan_chunks(
                sum(len(r.tokens_to_read) for r in again), again))
        planned = self._plan_chunks(budget=sum(len(r.prompt_ids) for r in self.prefilling))
        if not planned:
            return outputs
        joining = [r for r, _ in planned]
        start = time.perf_counter()
        asked = [r.logprobs for r in joining]
        out = self.verifier.prefill([r.request_id for r in joining], [r.prompt_ids for r in joining],
                                    [r.sampling for r in joining], [r.generator for r in joining],
                                    asked if any(k is not None for k in asked) else None)
        self.stats.prefill_seconds += time.perf_counter() - start
        outputs += self._take_chunks(planned, out)
        self._retire_finished()
        return outputs

    def _round(self, planned: list[tuple[Request, PrefillChunk]]) -> list[StepOutput]:
        """One round: plan (the drafting gate) -> draft -> admit -> verify -> commit."""
        running = list(self.running)
        gamma = self.drafter.gamma if self.speculative else 0
        plan = self._plan_round(running, gamma, reads_prompt=bool(planned))
        blocks, lengths = [None] * len(running), np.zeros(len(running), dtype=np.int64)
        draft_start = time.perf_counter()
        drafted_ids: set = set()
        if plan.mode.drafts:
            blocks, lengths, record, steady = self._draft_and_admit(running, gamma,
                                                                    plan.probe_sample)
            drafted_ids = set(record.request_ids)
        verify_start = time.perf_counter()
        if plan.mode.drafts and steady and self.config.update_cost_table:
            # Drafting as the round pays for it: the drafter's call and the admission after it.
            self.cost_table.observe_draft(verify_start - draft_start, len(running))
        holding = self._held.round_holds(plan.mode, self.drafting_gate.found_nothing_to_verify,
                                         len(drafted_ids), len(running))
        hold = self._held.verify_holds([r.request_id for r in running], drafted_ids, holding)
        chunks = [self._held.chunk(chunk, holding) for _, chunk in planned]

        result = self.verifier.verify(
            [VerifyRequest(r.request_id, r.output_ids[-1], block, int(n), r.sampling, r.generator,
                           hold_features=h, logprobs=r.logprobs)
             for r, block, n, h in zip(running, blocks, lengths, hold)],
            chunks)
        self._record_verify_step(result, time.perf_counter() - verify_start)
        if self.round_observer is not None and plan.mode.drafts:
            if record.num_accepted is None:  # every running request: its acceptance is known now
                record.num_accepted = list(result.num_accepted)
            self.round_observer(record)
        outputs = self._commit(running, lengths, hold, result, gamma)
        if self.config.update_cost_table and not result.prefill_tokens:
            # The round as it pays for it, less drafting (timed above): with a remote verifier
            # the call's (de)serialising and transfers, which grow with the drafts sent and
            # accepted (features), and the commit of the accepted tokens to the drafter, not
            # only the forward the verifier reports in result.step_seconds. A forward that also
            # read prompt chunks is no sample of SPS(B).
            self.cost_table.observe(len(running), result.batch_tokens,
                                    time.perf_counter() - verify_start)
        outputs += self._take_chunks(planned, result.prefill, chunks) if planned else []
        self._retire_finished()
        return outputs

    def _plan_round(self, running: list[Request], gamma: int, reads_prompt: bool) -> RoundPlan:
        """What this round does before verification (the drafting gate decides from the
        admission's old decision, the load and which requests run); a round that drafts nothing
        is recorded with the admission here."""
        self.drafting_gate.reset_if_load_fell(self._load())
        if not self.speculative:
            return RoundPlan(RoundMode.TARGET_ONLY)
        if gate_bypassed(self.admitter.config.policy.kind, [r.generator.seeded for r in running]):
            return RoundPlan(RoundMode.DRAFT)  # a seeded request's rounds ignore timing
        plan = self.drafting_gate.plan_round(
            [r.request_id for r in running], self.admitter.capacity_known_zero(),
            self.admitter.planned_gain(), reads_prompt)
        if plan.mode is RoundMode.PLAIN_CHECK:
            self.admitter.plain_check(len(running), gamma)
            self.stats.plain_check_rounds += 1
            self.stats.capacity.append(0)
        elif plan.mode is RoundMode.SKIP:
            self.admitter.skip(len(running), gamma)
            self.stats.skipped_draft_rounds += 1
            self.stats.capacity.append(0)
        return plan

    def _draft_and_admit(self, running: list[Request], gamma: int, sample: list[int] | None
                         ) -> tuple[list, np.ndarray, RoundRecord, bool]:
        """Draft (every running request, or a probe's `sample` of indices into `running`) and
        decide l_r: the blocks [R] (None where not drafted), lengths [R], the round's record
        (num_accepted None until verified, zeros for a sample, which verifies nothing), and
        whether this round's drafting time is a sample of what drafting a round costs
        (`steady`: DraftingGate.record_draft)."""
        drafted = running if sample is None else [running[i] for i in sample]
        start = time.perf_counter()
        self._held.take([r.request_id for r in drafted], self.verifier, self.drafter)
        seeded = [r.generator.seeded for r in running]
        policy = self.admitter.config.policy.kind
        num_positions = (gamma if gate_bypassed(policy, seeded)
                         else self.admitter.positions_to_draft(gamma))
        drafted_blocks = self.drafter.draft(
            [DraftRequest(r.request_id, r.output_ids[-1], r.anchor_position, r.sampling,
                          r.generator) for r in drafted],
            sparse_top_k=self.config.sparse_top_k, num_positions=num_positions)
        mid = time.perf_counter()
        confidences = torch.stack([b.confidences for b in drafted_blocks]).float()  # [S, num_positions]
        if sample is None:
            blocks = drafted_blocks
            # No request verifies more drafts than it may still emit (the bonus is the +1).
            caps = np.array([max(0, min(num_positions, r.max_tokens - len(r.output_ids) - 1))
                             for r in running])
            lengths = self.admitter.admit(confidences, max_lengths=caps, block_size=gamma)
            lengths = override_seeded(policy, lengths, confidences, caps, seeded)
            record = RoundRecord([r.request_id for r in running], confidences,
                                 [int(n) for n in lengths], None)
        else:  # a sampled probe: K is 0, nothing is verified, the blocks only inform K
            self.admitter.probe(confidences, len(running), gamma)
            self.stats.sampled_probe_rounds += 1
            blocks, lengths = [None] * len(running), np.zeros(len(running), dtype=np.int64)
            record = RoundRecord([r.request_id for r in drafted], confidences,
                                 [0] * len(drafted), [0] * len(drafted))
        self.stats.draft_seconds += mid - start
        self.stats.admission_seconds += time.perf_counter() - mid
        steady = self.drafting_gate.record_draft(
            [r.request_id for r in running] if sample is None else None)
        if self.admitter.capacity_used is not None:
            self.stats.capacity.append(self.admitter.capacity_used)
            self.drafting_gate.record_capacity(self.admitter.capacity_used, self._load())
        return blocks, lengths, record, steady

    def _record_verify_step(self, result: VerifyOutput, verify_seconds: float) -> None:
        """The verification step's times and tokens into the stats."""
        self.stats.rounds += 1
        # A forward that also read prompt chunks: its time is split by tokens between the stages.
        prompt_share = result.prefill_tokens / (result.prefill_tokens + result.batch_tokens)
        self.stats.prefill_seconds += result.step_seconds * prompt_share
        self.stats.verify_seconds += result.step_seconds * (1.0 - prompt_share)
        self.stats.verify_call_seconds += max(0.0, verify_seconds - result.step_seconds)
        self.stats.batch_tokens.append(result.batch_tokens)

    def _commit(self, running: list[Request], lengths: np.ndarray, hold: list[bool],
                result: VerifyOutput, gamma: int) -> list[StepOutput]:
        """The verified tokens into the requests and their metrics; the committed tokens'
        features to the drafter, or held by the verifier (`hold` [R])."""
        outputs = []
        logprobs = result.logprobs or [None] * len(running)
        for r, n, accepted, tokens, features, held, token_logprobs in zip(
                running, lengths, result.num_accepted, result.output_tokens, result.features,
                hold, logprobs):
            self._record_metrics(r, int(n), accepted, gamma)
            if held:
                self._held.add(r.request_id)
            elif self.speculative:
                first = r.anchor_position
                self.drafter.append_context(r.request_id, features,
                                            torch.arange(first, first + 1 + accepted),
                                            torch.tensor([r.output_ids[-1]] + tokens[:accepted]))
            outputs.append(self._emit(r, tokens, token_logprobs))
        return outputs

    def _load(self) -> int:
        """Requests in the engine: waiting, reading their prompts or running."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

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

    def _emit(self, r: Request, tokens: list[int],
              logprobs: TokenLogprobs | None = None) -> StepOutput:
        """Append tokens to the request, cutting at a stop token or max_tokens (their
        log-probabilities, one row per token, with them)."""
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
        if r.logprobs is not None:
            if logprobs is None or len(logprobs) != len(tokens):
                raise RuntimeError(f"request {r.request_id!r} asked for logprobs; the verifier "
                                   f"returned {'none' if logprobs is None else len(logprobs)} "
                                   f"for {len(tokens)} tokens")
            logprobs = logprobs[:len(new)]
        return StepOutput(r.request_id, new, r.finished, r.finish_reason,
                          logprobs if r.logprobs is not None else None)

    def _retire_finished(self) -> None:
        for r in [r for r in self.running if r.finished]:
            self._release(r)
            self.running.remove(r)
            self._joins_paused = False
        self.drafting_gate.reset_if_idle(self._load())

    def _release(self, r: Request) -> None:
        self._held.forget(r.request_id)
        self.drafting_gate.forget(r.request_id)
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
