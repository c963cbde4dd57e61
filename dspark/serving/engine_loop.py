"""The scheduler's round loop: one thread that owns a dspark.engine.Engine and nothing else does.

The engine is the same object the embedded mode uses (continuous batching, admission, lossless
verification); here its verifier and drafter are remote proxies. Front ends (gRPC, REST) never
touch it: they `submit` a request and read its events from a queue, or `cancel` it, and the loop
applies those between rounds. Each round it also appends the new tokens to the request store,
updates the metrics, and opens a `scheduler.round` span (parent: the oldest request's span;
links: every request in the round), under which the drafter and verifier calls are traced.

Faults: a store that cannot be written never stops generation. The tokens a failed write did not
store stay with their request and are sent again with its next round's (the store's appends are
idempotent by output position), so the stored output catches up once the store is back. Every
request the loop accepted ends with exactly one final event, whatever fails.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from dspark.engine import Engine
from dspark.logprobs import TokenLogprobs
from dspark.request import Request, RequestMetrics
from dspark.sampling import SamplingParams
from dspark.serving.metrics import SchedulerMetrics
from dspark.serving.store import RequestStore, RoundUpdate, StoredRequest
from dspark.structured_output import GrammarSpec

# Save the (live-refreshed) cost table to the store every this many rounds.
COST_TABLE_SAVE_ROUNDS = 200


@dataclass
class Submission:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: list[int]
    stored: StoredRequest | None = None
    """The request's record, already in the store (the gateway writes it before submitting, so
    that a store that is down refuses the request before its response starts); its output_ids
    are the tokens stored before this submission (a resumed request). None: nothing stored."""
    logprobs: int | None = None
    """Stream the target's log-probability of each new token with this many top alternatives
    (dspark.logprobs); None = none. They go to the client only, never to the store."""
    grammar: GrammarSpec | None = None
    """Structured output (dspark.structured_output); None = none."""
    earlier_output: list[int] = field(default_factory=list)
    """The end of the prompt that is output already (a resumed request's earlier output): the
    grammar, min_tokens and the penalties count it as output (Engine.add_request)."""
    fork_of: str | None = None
    """Another sample of the same prompt, submitted before (its request id): this one copies
    its prompt's caches instead of reading the prompt (dspark/forks.py). None: it reads it."""


@dataclass
class StreamEvent:
    """What a front end reads for its request: new tokens, then a last event with the outcome."""

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """"stop" | "length" | "abort" | "error"."""
    metrics: RequestMetrics | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    """One row per new token, when the request asked (Submission.logprobs)."""


@dataclass
class _Live:
    request: Request
    events: queue.Queue
    span: trace.Span
    stored: int
    """Output tokens the store holds (a resumed request starts with its earlier ones)."""
    unstored: list[int] = field(default_factory=list)
    """Tokens produced (and streamed) whose store write failed: sent again next round."""


@dataclass
class _Inbox:
    submissions: list[tuple[Submission, queue.Queue]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine: Engine, store: RequestStore, metrics: SchedulerMetrics,
                 tracer: trace.Tracer, logger, cost_table_name: str, cohort: int = 0) -> None:
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.tracer = tracer
        self.logger = logger
        self.cost_table_name = cost_table_name
        self.cohort = cohort
        self._inbox = _Inbox()
        self._inbox_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._live: dict[str, _Live] = {}
        self._adding: set[str] = set()
        """Submissions taken from the inbox, not yet in _live (is_live must still see them, or a
        cancel arriving meanwhile would be lost)."""
        self._store_failing = False
        self._accepting = True
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-loop-{cohort}",
                                        daemon=True)

    # -- front-end side (any thread) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, submission: Submission) -> queue.Queue:
        """Queue a request; its StreamEvents arrive on the returned queue."""
        events: queue.Queue = queue.Queue()
        with self._inbox_lock:
            if not self._accepting:
                raise RuntimeError("the scheduler is shutting down")
            self._inbox.submissions.append((submission, events))
        self._wakeup.set()
        return events

    def cancel(self, request_id: str) -> None:
        """The client went away: abort the request and free its caches (between rounds)."""
        with self._inbox_lock:
            self._inbox.cancels.append(request_id)
        self._wakeup.set()

    def is_live(self, request_id: str) -> bool:
        with self._inbox_lock:
            pending = (request_id in self._adding
                       or any(s.request_id == request_id for s, _ in self._inbox.submissions))
        return pending or request_id in self._live

    def queue_depth(self) -> int:
        return len(self.engine.waiting) + len(self._inbox.submissions)

    def num_live(self) -> int:
        """Requests this loop holds or is about to (the cohort router balances on this)."""
        return len(self._live) + len(self._inbox.submissions)

    def stop(self, grace_seconds: float) -> None:
        """Accept nothing new; let running requests finish for up to grace_seconds; abort the rest."""
        with self._inbox_lock:
            self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and (self._live or self._inbox.submissions):
            time.sleep(0.05)
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=30)

    # -- the loop thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._apply_inbox()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                self._one_round()
            except Exception as e:  # the loop thread must never die with clients waiting
                self.logger.exception("engine loop error; failing the live requests")
                self._fail_all(f"{type(e).__name__}: {e}")
        for rid in list(self._live):
            self._finish_aborted(rid, "abort")
        self._save_cost_table()

    def _apply_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, _Inbox()
            self._adding = {s.request_id for s, _ in inbox.submissions}
        for submission, events in inbox.submissions:
            try:
                self._add(submission, events)
            except Exception as e:  # e.g. the store is unreachable: tell this client, go on
                self.logger.warning("could not add request %s: %s", submission.request_id, e)
                self.engine.abort(submission.request_id)
                self._live.pop(submission.request_id, None)
                events.put(StreamEvent([], True, "error", None, f"{type(e).__name__}: {e}"))
        with self._inbox_lock:
            self._adding = set()
        for rid in inbox.cancels:
            if rid in self._live:
                self.engine.abort(rid)
                self._finish_aborted(rid, "abort")

    def _add(self, s: Submission, events: queue.Queue) -> None:
        span = self.tracer.start_span("scheduler.request", attributes={
            "dspark.request_id": s.request_id, "dspark.prompt_tokens": len(s.prompt_ids),
            "dspark.max_tokens": s.max_tokens})
        rid = self.engine.add_request(s.prompt_ids, s.sampling, s.max_tokens, s.stop_token_ids,
                                      request_id=s.request_id, logprobs=s.logprobs,
                                      grammar=s.grammar, earlier_output=s.earlier_output,
                                      fork_of=s.fork_of)
        already = len(s.stored.output_ids) if s.stored is not None else 0
        self._live[s.request_id] = _Live(self.engine.request(rid), events, span, already)
        self.metrics.record_prompt(len(s.prompt_ids))

    def _round_parent(self):
        """The oldest live request's span is the round's parent; all of them are links."""
        spans = [live.span for live in self._live.values()]
        links = [trace.Link(sp.get_span_context()) for sp in spans]
        return trace.set_span_in_context(spans[0]) if spans else None, links

    def _one_round(self) -> None:
        step_start = time.perf_counter()
        parent, links = self._round_parent()
        with self.tracer.start_as_current_span("scheduler.round", context=parent,
                                               links=links) as span:
            try:
                result = self.engine.step()
            except Exception as e:  # a service failed past its retries: fail, never hang
                self.logger.exception("round failed; failing its requests")
                self._fail_all(f"{type(e).__name__}: {e}")
                self._record_kv_cache_usage()
                return
            step_seconds = time.perf_counter() - step_start
            stats = result.stats
            span.set_attribute("dspark.num_requests", len(self.engine.running))
            span.set_attribute("dspark.cohort", self.cohort)
            if stats.mode is not None:
                span.set_attribute("dspark.round_mode", stats.mode.value)
            if stats.batch_tokens is not None:
                span.set_attribute("dspark.batch_tokens", stats.batch_tokens)
            if stats.capacity is not None:
                span.set_attribute("dspark.capacity_k", stats.capacity)
            if stats.drafts_admitted:
                span.set_attribute("dspark.drafts_admitted", stats.drafts_admitted)
                span.set_attribute("dspark.drafts_accepted", stats.drafts_accepted)
        # Store first, then stream: while the store works, a token a client has seen is in it.
        outputs = result.outputs
        self._store_round(outputs)
        for out in outputs:
            rid = str(out.request_id)
            live = self._live.get(rid)
            if live is None:
                continue
            live.events.put(StreamEvent(list(out.new_token_ids), out.finished, out.finish_reason,
                                        copy.deepcopy(live.request.metrics) if out.finished else None,
                                        out.error, logprobs=out.logprobs))
            if out.error is not None:  # the KV cache cannot hold it even alone
                self.metrics.record_refused("kv_cache_full")
            if out.finished:
                self._close(rid, out.finish_reason)
        self.metrics.record_step(stats, step_seconds, result.new_tokens, len(self.engine.running),
                                 self.queue_depth(), cohort=self.cohort)
        self._record_kv_cache_usage()
        if stats.verified and self.engine.stats.rounds % COST_TABLE_SAVE_ROUNDS == 0:
            self._save_cost_table()

    def _store_round(self, outputs) -> None:
        """Write the round's tokens (and any a failed write left) by output position."""
        updates, written = [], []
        for o in outputs:
            live = self._live.get(str(o.request_id))
            if live is None:
                continue
            tokens = live.unstored + list(o.new_token_ids)
            updates.append(RoundUpdate(str(o.request_id), tokens,
                                       o.finish_reason if o.finished else None, live.stored))
            written.append((live, tokens))
        try:
            self.store.record_round(updates)
        except Exception as e:  # generation goes on; the tokens are sent again next round
            if not self._store_failing:
                self.logger.warning("request store write failed; generating on: %s", e)
            self._store_failing = True
            for live, tokens in written:
                live.unstored = tokens
            return
        if self._store_failing:
            self.logger.warning("request store writes succeed again")
        self._store_failing = False
        for live, tokens in written:
            live.stored += len(tokens)
            live.unstored = []

    def _close(self, rid: str, reason: str | None) -> None:
        live = self._live.pop(rid)
        live.span.set_attribute("dspark.finish_reason", reason or "")
        live.span.set_attribute("dspark.output_tokens", len(live.request.output_ids))
        live.span.end()
        self.metrics.record_finished(reason or "unknown")

    def _finish_aborted(self, rid: str, reason: str, error: str | None = None) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        try:
            self.engine.abort(rid)
        except Exception:  # releasing on a dead service must not keep the client waiting
            self.logger.exception("releasing %s failed", rid)
        try:
            self.store.record_round([RoundUpdate(rid, list(live.unstored), reason, live.stored)])
        except Exception as e:
            self.logger.warning("store unreachable while ending %s: %s", rid, e)
        live.events.put(StreamEvent([], True, reason, copy.deepcopy(live.request.metrics), error))
        self._close(rid, reason)
        self._record_kv_cache_usage()

    def _record_kv_cache_usage(self) -> None:
        """The verifier's KV cache usage after this loop's last call to it (a remote verifier
        reports it with every reply; the embedded one reads its block manager)."""
        self.metrics.set_kv_cache_usage(self.engine.verifier.kv_cache_usage)

    def _fail_all(self, error: str) -> None:
        for rid in list(self._live):
            try:
                self._finish_aborted(rid, "error", error)
            except Exception:  # whatever failed, the client still gets its final event
                self.logger.exception("ending %s failed", rid)
                live = self._live.pop(rid, None)
                if live is not None:
                    live.events.put(StreamEvent([], True, "error", None, error))
                    live.span.end()

    def _save_cost_table(self) -> None:
        try:
            self.store.save_cost_table(self.cost_table_name, self.engine.cost_table.to_dict())
        except Exception:
            self.logger.exception("saving the cost table failed")

