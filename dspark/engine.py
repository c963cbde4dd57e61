"""The round loop: continuous batching with confidence-scheduled verification (docs/design.md 5-7).

One `step()` is one round for every running request:
1. waiting requests join (up to `max_running`): the target reads their prompts, in chunks of at
   most `prefill_chunk_tokens` per round that ride in the round's verification forward (chunked
   prefill); a prompt's last chunk samples the request's first token, and the drafter receives
   each chunk's target features; a request that is another sample of a running request's
   prompt (`fork_of`) copies its KV cache and drafter context instead and reads only the
   prompt's last token (dspark/forks.py);
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

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Sequence

import numpy as np
import torch

from dspark.admission import AdmissionConfig, Admitter
from dspark.batching import Batcher, BatchingConfig
from dspark.cost_table import CostTable
from dspark.drafting_gate import DraftingGateConfig, RoundMode, RoundPlan
from dspark.drafts_to_host import drafts_to_host
from dspark.forks import fork_joined
from dspark.gumbel_verification import request_generator
from dspark.held_features import HeldFeatures
from dspark.logprobs import TokenLogprobs, check_num_top
from dspark.models.draft_types import DraftRequest, Drafter
from dspark.models.kv_cache import KVCacheFull
from dspark.request import Request, RequestMetrics  # noqa: F401 (RequestMetrics: re-exported)
from dspark.round_policy import make_round_policy
from dspark.sampling import SamplingParams
from dspark.seeded_admission import gate_bypassed, override_seeded
from dspark.structured_output import GrammarRequest, GrammarSpec
from dspark.step_result import (EngineStats, RoundRecord, RoundStats, StepOutput,  # noqa: F401
                                StepResult)
from dspark.verifier import PrefillChunk, TargetVerifier, VerifyOutput, VerifyRequest


@dataclass(frozen=True)
class EngineConfig:
    """How the embedded engine runs: its parts' own configs, and what only the engine decides.

    Each part's fields (and their defaults) are written once, in the part's config; nothing here
    repeats them (tests/test_engine_config.py holds that). `with_values` sets fields by their
    names wherever they live, for flags and tests that name them flat."""

    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """The admission policy and its parameters (objective, lag, min_gain, ...)."""
    gate: DraftingGateConfig = field(default_factory=DraftingGateConfig)
    """async_topk: whether a round drafts at all (probes, their back-off, plain checks)."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Which requests run together: slots, chunked prefill, the KV cache reservation."""
    sparse_top_k: int | None = None
    """Ship draft distributions as top-k (indices, probs); None = dense. The drafter samples from
    exactly this truncation, so verification stays lossless."""
    update_cost_table: bool = True
    """Refresh SPS(B) from measured verification step times, and the drafting time per round
    from measured drafting, while serving."""
    hold_features: bool = True
    """async_topk, once a probe found nothing to verify (until a round verifies drafts again): in
    rounds that do not draft a request (skipping, or a probe's other requests), its target
    features stay with the verifier (`VerifyRequest.hold_features`) until the drafter next
    drafts it (`take_features`). With a remote verifier they then cross the wire only for
    requests that are drafted. The drafter sees the same context in the same order either way."""

    def __post_init__(self) -> None:
        for name, kind in self.parts().items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"EngineConfig.{name} must be a {kind.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")

    @classmethod
    def parts(cls) -> dict[str, type]:
        """The composed configs: field name -> config class."""
        return {"admission": AdmissionConfig, "gate": DraftingGateConfig,
                "batching": BatchingConfig}

    @classmethod
    def field_path(cls, name: str) -> tuple[str, ...]:
        """Where the field `name` lives: (name,) for the engine's own, (part, name) for a part's."""
        if name in {f.name for f in dataclasses.fields(cls)} and name not in cls.parts():
            return (name,)
        for part, kind in cls.parts().items():
            if name in {f.name for f in dataclasses.fields(kind)}:
                return (part, name)
        raise TypeError(f"EngineConfig has no field {name!r} (nor has any of its parts)")

    def value(self, name: str) -> Any:
        """The value of field `name`, wherever it lives (`field_path`)."""
        value = self
        for attr in self.field_path(name):
            value = getattr(value, attr)
        return value

    def with_values(self, **values: Any) -> "EngineConfig":
        """A copy with fields set by name, wherever they live (`field_path`)."""
        own, parts = {}, {}
        for name, v in values.items():
            path = self.field_path(name)
            if len(path) == 1:
                own[name] = v
            else:
                parts.setdefault(path[0], {})[name] = v
        for part, changes in parts.items():
            own[part] = dataclasses.replace(getattr(self, part), **changes)
        return dataclasses.replace(self, **own)


class Engine:
    """The embedded DSpark engine: drafter + admission + verifier in one process."""

    def __init__(self, verifier: TargetVerifier, drafter: Drafter | None, cost_table: CostTable,
                 config: EngineConfig = EngineConfig()) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.cost_table = cost_table
        self.config = config
        self.policy = make_round_policy(config.admission, config.gate, cost_table,
                                        config.hold_features, drafter is not None)
        """Plans each round, admits drafts and owns the policy's state; see round_policy.py."""
        self.speculative = self.policy.speculative
        self.batcher = Batcher(config.batching, drafter.gamma if self.speculative else 0)
        """The waiting / prefilling / running queues, joins and preemption; see batching.py."""
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._held = HeldFeatures()
        """Requests whose features the verifier holds for the drafter; see held_features.py."""
        self._step = RoundStats()
        """The step in progress: its numbers, written by the stages, summed into `stats`."""

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    max_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                    request_id: Hashable | None = None, logprobs: int | None = None,
                    grammar: GrammarSpec | None = None,
                    earlier_output: Sequence[int] = (),
                    fork_of: Hashable | None = None) -> Hashable:
        """`logprobs`: report the target's log-probabilities of the output tokens with this
        many top alternatives (0..dspark.logprobs.MAX_TOP_LOGPROBS); None = none. A sampling
        with min_tokens holds `stop_token_ids` back until then (SamplingParams.stop_token_ids).
        `grammar`: structured output (dspark.structured_output), which needs a stop token to end
        on (and no min_tokens, which could hold it back where the grammar allows nothing else);
        `earlier_output`: the prompt's last tokens that are output already (a resumed request's:
        the grammar, min_tokens and the penalties count them as output; max_tokens counts only
        what comes after).
        `fork_of`: another sample of the prompt of this request (added before, the same
        prompt): this one copies its prompt's KV cache when it joins instead of reading the
        prompt (dspark/forks.py); its tokens are what it would give alone."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if logprobs is not None:
            check_num_top(logprobs)
        if grammar is not None and not stop_token_ids:
            raise ValueError("a request with a grammar needs stop tokens (its output ends with "
                             "one where the grammar is complete)")
        if grammar is not None and sampling.min_tokens:
            raise ValueError("a request with a grammar cannot have min_tokens: a complete "
                             "output allows only its stop tokens")
        if len(earlier_output) >= len(prompt_ids):
            raise ValueError("earlier_output must be the end of a longer prompt")
        if sampling.min_tokens > len(earlier_output) + max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {sampling.min_tokens} > "
                             f"{len(earlier_output) + max_tokens}")
        if sampling.min_tokens:  # the tokens it holds back: this request's stop tokens
            sampling = dataclasses.replace(sampling, stop_token_ids=tuple(
                set(sampling.stop_token_ids) | set(stop_token_ids)))
        rid = next(self._ids) if request_id is None else request_id
        generator = request_generator(sampling, getattr(self.verifier, "rule", None))
        self.batcher.add(Request(rid, list(prompt_ids), sampling, max_tokens,
                                 frozenset(stop_token_ids), generator, logprobs=logprobs,
                                 grammar=grammar, earlier_output=tuple(earlier_output),
                                 fork_of=fork_of))
        return rid

    def abort(self, request_id: Hashable) -> None:
        for r in self.batcher.remove(request_id):
            self._release(r)
        self.policy.reset_if_idle(self.batcher.load)

    def has_unfinished(self) -> bool:
        return self.batcher.has_unfinished()

    @property
    def admitter(self) -> Admitter:
        """The policy's admission decisions (dspark.admission)."""
        return self.policy.admitter

    @property
    def waiting(self) -> list[Request]:
        return self.batcher.waiting

    @property
    def prefilling(self) -> list[Request]:
        """Joined (they hold a slot) but their prompts are not all read yet (chunked prefill)."""
        return self.batcher.prefilling

    @property
    def running(self) -> list[Request]:
        return self.batcher.running

    # -- the round ---------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One step: joins, prompt chunks and one round for every running request."""
        outputs: list[StepOutput] = []
        self._step = step = RoundStats()
        try:
            if self.config.batching.prefill_chunk_tokens == 0:
                outputs += self._admit_waiting()
                if self.running:
                    outputs += self._round([])
                return StepResult(outputs, step)
            self._join_waiting()
            chunks = self.batcher.plan_chunks()
            if self.running:
                outputs += self._round(chunks)
            elif chunks:
                outputs += self._prefill_only(chunks)
        except KVCacheFull as full:  # the verifier's cache is as it was before the call
            step.drafted = None  # its drafts were never verified
            outputs += self._preempt_newest(full)
        finally:
            self.stats.add(step)
        return StepResult(outputs, step)

    def request(self, request_id: Hashable) -> Request:
        """The request in the engine (waiting, reading its prompt or running) with this id."""
        return self.batcher.find(request_id)

    def _preempt_newest(self, full: KVCacheFull) -> list[StepOutput]:
        """The cache could not hold this step: the request that joined last gives its cache up
        and waits first in line (recomputed when it joins again), or, alone, ends with an error."""
        victim, alone = self.batcher.preempt_newest()
        self._release(victim)
        if alone:
            victim.finished, victim.finish_reason = True, "error"
            self.policy.reset_if_idle(self.batcher.load)
            return [StepOutput(victim.request_id, [], True, "error",
                               error=f"the KV cache cannot hold this request ({full})")]
        self._step.preemptions += 1
        return []

    def _join_waiting(self) -> None:
        """Waiting requests take free slots; those that fork a running request copy its
        prompt's caches (dspark/forks.py)."""
        before = len(self.prefilling)
        self.batcher.join_waiting()
        joined = self.prefilling[before:]
        if any(r.fork_of is not None for r in joined):
            self._step.forked_tokens += fork_joined(
                joined, self.running, self.verifier, self.drafter if self.speculative else None,
                self._held)

    def _prefill_only(self, planned: list[tuple[Request, PrefillChunk]]) -> list[StepOutput]:
        """A step with nothing to decode: the forward reads prompt chunks only."""
        chunks = [self._held.chunk(c, False) for _, c in planned]
        start = time.perf_counter()
        out = self.verifier.verify([], chunks)
        self._step.seconds.prefill += time.perf_counter() - start
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
        for r, chunk in planned:
            if chunk.grammar is not None:  # the final chunk built the state
                r.grammar_held = True
        logprobs = result.logprobs or [None] * len(planned)
        for (r, chunk), token, features, as_sent, first_logprobs in zip(
                planned, result.first_tokens, result.features, sent, logprobs):
            start, end = r.prefilled, r.prefilled + len(chunk.token_ids)
            self._step.prompt_tokens += end - start
            if as_sent.hold_features:
                self._held.add(r.request_id)
            elif self.speculative:
                self._append_context(r.request_id, features, torch.arange(start, end),
                                     torch.tensor(list(chunk.token_ids)))
            r.prefilled = end
            if chunk.final:
                self.batcher.start_running(r)
                outputs.append(self._emit(r, [token], first_logprobs))
            elif r.recomputing and end == len(r.tokens_to_read):
                r.recomputing = False  # its anchor is its last output token again
                self.batcher.start_running(r)
        return outputs

    def _admit_waiting(self) -> list[StepOutput]:
        """Unchunked prefill: the joiners' whole prompts in one prompt-only forward, before the
        round; a joiner runs from its first token on."""
        self._join_waiting()
        outputs = []
        again = [r for r in self.prefilling if r.recomputing]
        if again:  # preempted requests re-read their tokens without sampling
            outputs += self._prefill_only(self.batcher.plan_chunks(
                sum(len(r.tokens_to_read) for r in again), again))
        forked = [r for r in self.prefilling if r.prefilled]
        if forked:  # forks read their prompts' last tokens
            outputs += self._prefill_only(self.batcher.plan_chunks(
                sum(len(r.prompt_ids) - r.prefilled for r in forked), forked))
        fresh = [r for r in self.prefilling if not r.prefilled]
        planned = self.batcher.plan_chunks(
            budget=sum(len(r.prompt_ids) for r in fresh), requests=fresh)
        if not planned:
            return outputs
        joining = [r for r, _ in planned]
        start = time.perf_counter()
        asked = [r.logprobs for r in joining]
        grammars = [c.grammar for _, c in planned]
        lengths = [c.prompt_length for _, c in planned]  # a resumed request's prompt proper
        out = self.verifier.prefill([r.request_id for r in joining], [r.prompt_ids for r in joining],
                                    [r.sampling for r in joining], [r.generator for r in joining],
                                    asked if any(k is not None for k in asked) else None,
                                    prompt_lengths=(lengths if any(n is not None for n in lengths)
                                                    else None),
                                    grammars=grammars if any(g is not None for g in grammars)
                                    else None)
        self._step.seconds.prefill += time.perf_counter() - start
        outputs += self._take_chunks(planned, out)
        self._retire_finished()
        return outputs

    def _round(self, planned: list[tuple[Request, PrefillChunk]]) -> list[StepOutput]:
        """One round: plan (the drafting gate) -> draft -> admit -> verify -> commit."""
        running = list(self.running)
        gamma = self.drafter.gamma if self.speculative else 0
        step = self._step
        step.batch_size = len(running)
        plan = self._plan_round(running, gamma, reads_prompt=bool(planned))
        step.mode = plan.mode
        blocks, lengths = [None] * len(running), np.zeros(len(running), dtype=np.int64)
        draft_start = time.perf_counter()
        drafted_ids: set = set()
        if plan.mode.drafts:
            blocks, lengths, record, steady = self._draft_and_admit(running, gamma,
                                                                    plan.probe_sample)
            drafted_ids = set(record.request_ids)
            step.drafted = record
        verify_start = time.perf_counter()
        if plan.mode.drafts and steady and self.config.update_cost_table:
            # Drafting as the round pays for it: the drafter's call and the admission after it.
            self.cost_table.observe_draft(verify_start - draft_start, len(running))
        holding = self.policy.holds(plan.mode, len(drafted_ids), len(running))
        hold = self._held.verify_holds([r.request_id for r in running], drafted_ids, holding)
        chunks = [self._held.chunk(chunk, holding) for _, chunk in planned]

        call_start = time.perf_counter()
        result = self.verifier.verify(
            [VerifyRequest(r.request_id, r.output_ids[-1], block, int(n), r.sampling, r.generator,
                           hold_features=h, logprobs=r.logprobs, grammar=r.grammar_request())
             for r, block, n, h in zip(running, blocks, lengths, hold)],
            chunks)
        for r in running:
            r.grammar_held = r.grammar is not None  # the verifier advanced its state
        self._record_verify_step(result, time.perf_counter() - call_start)
        step.drafts_admitted = int(lengths.sum())
        step.drafts_accepted = int(sum(result.num_accepted))
        if step.drafted is not None and step.drafted.num_accepted is None:
            # every running request was drafted: its acceptance is known now
            step.drafted.num_accepted = list(result.num_accepted)
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
        """What this round does before verification (the policy decides from old rounds, the
        load and which requests run); a round that drafts nothing records its K (0) here."""
        if self.speculative and gate_bypassed(self.config.admission.policy.kind,
                                              [r.must_repeat for r in running]):
            return RoundPlan(RoundMode.DRAFT)  # a seeded sampled request's rounds ignore timing
        plan = self.policy.plan([r.request_id for r in running], gamma, reads_prompt,
                                self.batcher.load)
        if plan.mode in (RoundMode.SKIP, RoundMode.PLAIN_CHECK):
            self._step.capacity = self.policy.capacity_used
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
        seeded = [r.must_repeat for r in running]
        kind = self.config.admission.policy.kind
        num_positions = (gamma if gate_bypassed(kind, seeded)
                         else self.policy.positions_to_draft(gamma))
        # A verifier in this process (the embedded engine) holds the requests' grammar states
        # at their committed output: the drafter masks its drafts with them. A drafter in
        # another process builds its own from the grammar's spec (RemoteDrafter).
        grammars = getattr(self.verifier, "grammar_states", {})
        drafted_blocks = self.drafter.draft(
            [DraftRequest(r.request_id, r.output_ids[-1], r.anchor_position, r.sampling,
                          r.generator, r.num_output,
                          grammars.get(r.request_id) if r.grammar is not None else None,
                          GrammarRequest(r.grammar, tuple(sorted(r.stop_token_ids)))
                          if r.grammar is not None else None,
                          # The penalties count the tokens before each draft.
                          r.prompt_ids + r.output_ids if r.sampling.has_penalties else None)
             for r in drafted],
            sparse_top_k=self.config.sparse_top_k, num_positions=num_positions)
        # Confidences [S, num_positions] for the admission and the draft tokens for the target's
        # forward, on the host in the round's one copy before verification.
        drafted_blocks, confidences = drafts_to_host(drafted_blocks)
        mid = time.perf_counter()
        # No request verifies more drafts than it may still emit (the bonus is the +1).
        caps = np.array([max(0, min(num_positions, r.max_tokens - len(r.output_ids) - 1))
                         for r in running])
        lengths = self.policy.admit(confidences, caps, gamma, len(running), sample)
        if sample is None:
            lengths = override_seeded(kind, lengths, confidences, caps, seeded)
            blocks = drafted_blocks
            record = RoundRecord([r.request_id for r in running], confidences,
                                 [int(n) for n in lengths], None)
        else:  # a sampled probe verifies nothing: the blocks only inform K
            blocks = [None] * len(running)
            record = RoundRecord([r.request_id for r in drafted], confidences,
                                 [0] * len(drafted), [0] * len(drafted))
        self._step.seconds.draft += mid - start
        self._step.seconds.admission += time.perf_counter() - mid
        self._step.drafts_proposed += int(confidences.numel())
        steady = self.policy.observe_draft(
            [r.request_id for r in running] if sample is None else None, self.batcher.load)
        if self.policy.capacity_used is not None:
            self._step.capacity = self.policy.capacity_used
        return blocks, lengths, record, steady

    def _record_verify_step(self, result: VerifyOutput, call_seconds: float) -> None:
        """The verification call's times and tokens into the step's numbers."""
        seconds = self._step.seconds
        # A forward that also read prompt chunks: its time is split by tokens between the stages.
        prompt_share = result.prefill_tokens / (result.prefill_tokens + result.batch_tokens)
        seconds.prefill += result.step_seconds * prompt_share
        seconds.verify += result.step_seconds * (1.0 - prompt_share)
        seconds.verify_call += max(0.0, call_seconds - result.step_seconds)
        self._step.batch_tokens = result.batch_tokens

    def _append_context(self, request_id: Hashable, features: torch.Tensor,
                        positions: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Committed tokens' target features [n, d] at `positions` [n] to the drafter."""
        start = time.perf_counter()
        self.drafter.append_context(request_id, features, positions, token_ids)
        self._step.seconds.drafter_context += time.perf_counter() - start

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
                self._append_context(r.request_id, features,
                                     torch.arange(first, first + 1 + accepted),
                                     torch.tensor([r.output_ids[-1]] + tokens[:accepted]))
            outputs.append(self._emit(r, tokens, token_logprobs))
        return outputs

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
        for r in self.batcher.retire_finished():
            self._release(r)
        self.policy.reset_if_idle(self.batcher.load)

    def _release(self, r: Request) -> None:
        r.grammar_held = False
        self._held.forget(r.request_id)
        self.policy.forget(r.request_id)
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

    def steps(self) -> Iterator[StepResult]:
        """Step until nothing is left, yielding what each step did."""
        while self.has_unfinished():
            yield self.step()

    def stream(self) -> Iterator[StepOutput]:
        """Step until nothing is left, yielding every request's new tokens as they come."""
        for result in self.steps():
            yield from result.outputs
