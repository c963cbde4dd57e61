"""Scheduler metrics through prometheus_client, named like vLLM's so dashboards carry over.

vLLM exports `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`, `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:num_requests_running` / `_waiting`, `vllm:kv_cache_usage_perc`; we export the same under
`dspark:` plus what confidence
scheduling adds (verified tokens per position, batch tokens per round, chosen capacity K, mean
verification length, SPS, drafter availability, engine time by stage, from which the dashboard
takes the drafter's share of round time) and requests refused by reason. Counters end in `_total`
(prometheus_client appends it).

Each SchedulerMetrics owns its CollectorRegistry (several schedulers or tests in one process do
not collide); `/metrics` renders it with `prometheus_client.generate_latest`, and the
OpenTelemetry bridge (dspark.serving.otel_metrics) reads the same registry.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from dspark.drafting_gate import RoundMode

if TYPE_CHECKING:
    from dspark.step_result import RoundStats

# `<name>_created` series double the scrape for nothing a dashboard uses (vLLM drops them too).
disable_created_metrics()

PREFIX = "dspark:"
ROUND_STAGES = ("prefill", "draft", "admission", "verify", "verify_call", "other")
"""Stages of `dspark:round_seconds_total`: a step's `RoundStats.seconds` (StageSeconds) of those
names, and the rest of the step's wall time ("other", where handing features to the drafter and
the engine's bookkeeping fall)."""
FINISH_REASONS = ("stop", "length", "abort", "error")
"""Reasons `dspark:request_success_total` is initialised with (0 until one happens)."""
REFUSAL_REASONS = ("queue_full", "kv_cache_full")
"""Reasons of `dspark:num_requests_refused_total`: queue_full = the waiting queue was at
max_waiting (HTTP 429 / RESOURCE_EXHAUSTED before the request started); kv_cache_full = the
verifier's KV cache cannot hold a request even alone, which ends that request with finish_reason
"error" (when it cannot hold a round of several, the newest is preempted instead:
`dspark:num_preemptions_total`)."""

# vLLM's bucket edges, so percentiles from both servers are comparable on one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class SchedulerMetrics:
    """Thread-safe: the engine loops and the front ends write, the /metrics route renders."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, model = self.registry, ("model_name",)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, (*model, *labels), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, model, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, model, buckets=buckets,
                             registry=r).labels(model_name)

        self._lock = threading.Lock()
        """Guards the Python-side state below (the prometheus_client objects lock themselves)."""
        self._running: dict[int, int] = {}
        """By cohort (dspark.serving.cohorts); the gauges show the sums."""
        self._waiting: dict[int, int] = {}
        self._drafts = self._draft_tokens = self._accepted_tokens = 0
        self._fallback_rounds = 0

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests queued (queue depth).")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc",
            "Fraction of the verifier's KV cache blocks in use (0..1; 1 = full).")
        self.num_requests_refused = counter("num_requests_refused",
                                            "Requests refused or failed for lack of capacity, "
                                            "by reason.", "reason")
        for reason in REFUSAL_REASONS:
            self.num_requests_refused.labels(model_name, reason)
        self.num_preemptions = counter(
            "num_preemptions",
            "Requests preempted (cache released, recomputed later) because the verifier's KV "
            "cache could not hold a round.").labels(model_name)
        self.request_success = counter("request_success", "Finished requests by reason.",
                                       "finished_reason")
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(model_name)
        self.prompt_tokens_read = counter(
            "prompt_tokens_read",
            "Prompt tokens the target read (a preempted request's re-read included).").labels(
                model_name)
        self.prompt_tokens_forked = counter(
            "prompt_tokens_forked",
            "Prompt tokens a sample of n took from its prompt's first sample's KV cache instead "
            "of reading them (dspark/forks.py).").labels(model_name)
        self.generation_tokens = counter("generation_tokens",
                                         "Tokens generated.").labels(model_name)
        self.num_drafts = counter(
            "spec_decode_num_drafts",
            "Draft blocks verified (one per request per speculative round).").labels(model_name)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                        "Draft tokens sent to the target.").labels(model_name)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.").labels(model_name)
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafts by block position (1-based).", "position")
        self.verified_per_pos = counter("spec_decode_num_verified_tokens_per_pos",
                                        "Verified drafts by block position (1-based).", "position")
        self.acceptance_length = gauge(
            "spec_decode_acceptance_length",
            "Mean tokens per request per speculative round (accepted drafts + 1), since start.")
        self.mean_verification_length = gauge(
            "spec_decode_mean_verification_length",
            "Mean drafts verified per request per speculative round (l_r), since start.")
        self.capacity_k = gauge("spec_decode_capacity_k",
                                "Capacity K the async top-K admission chose for the last round.")
        self.target_steps_per_second = gauge(
            "spec_decode_target_steps_per_second",
            "SPS of the last verification step (1 / step seconds).")
        self.drafter_available = gauge(
            "spec_decode_drafter_available",
            "1 while the drafter service answers; 0 = plain decoding fallback.")
        self.drafter_available.set(1)
        self.fallback_rounds = counter(
            "spec_decode_fallback_rounds",
            "Rounds run as plain decoding because the drafter was unavailable.").labels(model_name)
        self.round_seconds = counter(
            "round_seconds",
            "Engine time by stage: prefill (a fused forward's prompt-token share), draft (incl. "
            "the drafter service round trip), admission, verify (the target's step), verify_call "
            "(the verifier call beyond that step: sampling, commits, transfers), other "
            "(the scheduler's own work).", "stage")
        for stage in ROUND_STAGES:
            self.round_seconds.labels(model_name, stage)
        self.skipped_draft_rounds = counter(
            "spec_decode_skipped_draft_rounds",
            "async_topk rounds that did not draft because their capacity K was 0.").labels(model_name)
        self.verifier_restores = counter(
            "verifier_restores",
            "Requests whose KV cache was rebuilt after a verifier restart.").labels(model_name)
        self.verify_batch_tokens = histogram("spec_decode_verify_batch_tokens",
                                             "Tokens the target verified per round (B).",
                                             BATCH_TOKEN_BUCKETS)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Seconds between a request's successive outputs (one per round that gave it tokens; "
            "a speculative round can give several).", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
            E2E_BUCKETS)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP responses by route and status.",
                                     ("model_name", "handler", "method", "status"), registry=r)

    # -- written by the engine loops ----------------------------------------------------------
    def record_step(self, stats: RoundStats, wall_seconds: float, generated: int, running: int,
                    waiting: int, cohort: int = 0) -> None:
        """One engine step, from what it returned (`StepResult`): `wall_seconds` of the whole
        step, `generated` tokens, the requests running and waiting after it."""
        if stats.drafted is not None:
            self.record_speculation(stats.drafted.num_admitted, stats.drafted.num_accepted)
        stages = {stage: getattr(stats.seconds, stage) for stage in ROUND_STAGES[:-1]}
        stages["other"] = max(0.0, wall_seconds - sum(stages.values()))
        self.record_stage_seconds(stages, int(stats.mode is RoundMode.SKIP))
        self.record_preemptions(stats.preemptions)
        self.prompt_tokens_read.inc(stats.prompt_tokens)
        self.prompt_tokens_forked.inc(stats.forked_tokens)
        self.record_round(generated, stats.batch_tokens,
                          stats.seconds.verify if stats.verified else None, stats.capacity,
                          running, waiting, cohort=cohort)

    def record_finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def record_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def record_round(self, generated: int, batch_tokens: int | None, step_seconds: float | None,
                     capacity: int | None, running: int, waiting: int, cohort: int = 0) -> None:
        self.generation_tokens.inc(generated)
        with self._lock:
            self._running[cohort], self._waiting[cohort] = running, waiting
            self.num_requests_running.set(sum(self._running.values()))
            self.num_requests_waiting.set(sum(self._waiting.values()))
        if batch_tokens is not None:
            self.verify_batch_tokens.observe(batch_tokens)
        if step_seconds:
            self.target_steps_per_second.set(1.0 / step_seconds)
        if capacity is not None:
            self.capacity_k.set(capacity)

    def set_kv_cache_usage(self, usage: float) -> None:
        self.kv_cache_usage_perc.set(usage)

    def record_refused(self, reason: str, num_requests: int = 1) -> None:
        """`reason` from REFUSAL_REASONS."""
        self.num_requests_refused.labels(self.model_name, reason).inc(num_requests)

    def record_preemptions(self, num_requests: int) -> None:
        self.num_preemptions.inc(num_requests)

    def record_stage_seconds(self, seconds: dict[str, float], skipped_draft_rounds: int = 0) -> None:
        """One engine step's time by stage (keys from ROUND_STAGES) and its skipped drafting rounds."""
        for stage, value in seconds.items():
            self.round_seconds.labels(self.model_name, stage).inc(value)
        self.skipped_draft_rounds.inc(skipped_draft_rounds)

    def record_speculation(self, num_admitted: list[int], num_accepted: list[int]) -> None:
        """One speculative round: per request, drafts verified (l_r) and accepted."""
        for verified, accepted in zip(num_admitted, num_accepted):
            for k in range(verified):
                self.verified_per_pos.labels(self.model_name, str(k + 1)).inc()
            for k in range(accepted):
                self.accepted_per_pos.labels(self.model_name, str(k + 1)).inc()
        drafts, verified, accepted = len(num_admitted), sum(num_admitted), sum(num_accepted)
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(verified)
        self.num_accepted_tokens.inc(accepted)
        with self._lock:
            self._drafts += drafts
            self._draft_tokens += verified
            self._accepted_tokens += accepted
            if self._drafts:
                self.acceptance_length.set((self._accepted_tokens + self._drafts) / self._drafts)
                self.mean_verification_length.set(self._draft_tokens / self._drafts)

    # -- written by the front ends and the drafter proxies ------------------------------------
    def record_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def record_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def record_request_latency(self, seconds: float) -> None:
        self.e2e_request_latency.observe(seconds)

    def record_http_response(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(self.model_name, handler, method, str(status)).inc()

    def set_drafter_available(self, available: bool) -> None:
        self.drafter_available.set(int(available))

    def set_fallback_rounds(self, total: int) -> None:
        """The drafter proxies count their fallback rounds; the scheduler copies the sum here
        (the counter advances by the difference, so it stays monotonic)."""
        with self._lock:
            grown, self._fallback_rounds = total - self._fallback_rounds, max(total,
                                                                                self._fallback_rounds)
        if grown > 0:
            self.fallback_rounds.inc(grown)

    def add_verifier_restores(self, n: int) -> None:
        self.verifier_restores.inc(n)

    # -- read -----------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return generate_latest(self.registry)
