"""Scheduler metrics in the Prometheus text format, named like vLLM's so dashboards carry over.

vLLM exports `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`
and `..._num_accepted_tokens_per_pos`; we export the same under `dspark:` plus what confidence
scheduling adds (verified tokens per position, batch tokens per round, chosen capacity K, SPS,
drafter availability). Counters end in `_total`. No client library: the format is a few lines.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PREFIX = "dspark:"
ROUND_STAGES = ("prefill", "draft", "admission", "verify", "verify_call", "other")
"""Stages of `dspark:round_seconds_total` (the engine's EngineStats, plus the rest of each step)."""


@dataclass
class MetricFamily:
    name: str
    """Without the `dspark:` prefix."""
    kind: str
    """"counter" | "gauge"."""
    help: str
    samples: list[tuple[dict[str, str], float]]
    """(labels besides model_name, value)."""


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1


class SchedulerMetrics:
    """Thread-safe: the engine loop writes, HTTP handler threads render."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.requests_total: dict[str, int] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.rounds_total = 0
        self.spec_rounds_total = 0
        self.draft_tokens_total = 0
        self.accepted_tokens_total = 0
        self.accepted_per_pos: list[int] = []
        self.verified_per_pos: list[int] = []
        self.fallback_rounds_total = 0
        self.verifier_restores_total = 0
        self.running: dict[int, int] = {}
        """By cohort (dspark.serving.cohorts); the gauges show the sums."""
        self.waiting: dict[int, int] = {}
        self.capacity_k = 0
        self.sps = 0.0
        self.drafter_available = 1
        self.batch_tokens = _Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.tokens_per_round = _Histogram((1, 2, 3, 4, 5, 6, 8, 12, 16))
        self.stage_seconds: dict[str, float] = {stage: 0.0 for stage in ROUND_STAGES}
        """Engine time by stage, summed over rounds (ROUND_STAGES)."""
        self.skipped_draft_rounds_total = 0

    def record_finished(self, reason: str) -> None:
        with self._lock:
            self.requests_total[reason] = self.requests_total.get(reason, 0) + 1

    def record_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens_total += num_tokens

    def record_round(self, generated: int, batch_tokens: int | None, step_seconds: float | None,
                     capacity: int | None, running: int, waiting: int, cohort: int = 0) -> None:
        with self._lock:
            self.generation_tokens_total += generated
            self.running[cohort], self.waiting[cohort] = running, waiting
            if batch_tokens is not None:
                self.rounds_total += 1
                self.batch_tokens.observe(batch_tokens)
            if step_seconds:
                self.sps = 1.0 / step_seconds
            if capacity is not None:
                self.capacity_k = capacity

    def record_stage_seconds(self, seconds: dict[str, float], skipped_draft_rounds: int = 0) -> None:
        """One engine step's time by stage (keys from ROUND_STAGES) and its skipped drafting rounds."""
        with self._lock:
            for stage, value in seconds.items():
                self.stage_seconds[stage] += value
            self.skipped_draft_rounds_total += skipped_draft_rounds

    def record_speculation(self, num_admitted: list[int], num_accepted: list[int]) -> None:
        """One speculative round: per request, drafts verified (l_r) and accepted."""
        with self._lock:
            self.spec_rounds_total += 1
            for verified, accepted in zip(num_admitted, num_accepted):
                need = max(verified, accepted)
                if len(self.verified_per_pos) < need:
                    grow = need - len(self.verified_per_pos)
                    self.verified_per_pos += [0] * grow
                    self.accepted_per_pos += [0] * grow
                for k in range(verified):
                    self.verified_per_pos[k] += 1
                for k in range(accepted):
                    self.accepted_per_pos[k] += 1
                self.draft_tokens_total += verified
                self.accepted_tokens_total += accepted
                self.tokens_per_round.observe(accepted + 1)

    def set_drafter_available(self, available: bool) -> None:
        with self._lock:
            self.drafter_available = int(available)

    def set_fallback_rounds(self, total: int) -> None:
        """The drafter proxies count their fallback rounds; the scheduler copies the sum here."""
        with self._lock:
            self.fallback_rounds_total = total

    def add_verifier_restores(self, n: int) -> None:
        with self._lock:
            self.verifier_restores_total += n

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        with self._lock:
            families = self._families()
            histograms = [("spec_decode_verify_batch_tokens",
                           "Tokens the target verified per round (B).", self.batch_tokens)]
            label = f'model_name="{self.model_name}"'
            lines = []
            for f in families:
                lines.append(f"# HELP {PREFIX}{f.name} {f.help}\n# TYPE {PREFIX}{f.name} {f.kind}\n")
                for labels, value in f.samples:
                    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
                    lines.append(f"{PREFIX}{f.name}{{{label}{extra}}} {value}\n")
            for name, help_text, h in histograms:
                lines += list(self._histogram(name, help_text, h, label))
            return "".join(lines)

    def families(self) -> list["MetricFamily"]:
        """Counters and gauges as data (the OpenTelemetry bridge reads these)."""
        with self._lock:
            return self._families()

    def _families(self) -> list["MetricFamily"]:
        tau = self.tokens_per_round.total / self.tokens_per_round.n if self.tokens_per_round.n else 0
        F = MetricFamily
        return [
            F("num_requests_running", "gauge", "Requests in the running batch.",
              [({}, sum(self.running.values()))]),
            F("num_requests_waiting", "gauge", "Requests queued (queue depth).",
              [({}, sum(self.waiting.values()))]),
            F("request_success_total", "counter", "Finished requests by reason.",
              [({"finished_reason": r}, n) for r, n in sorted(self.requests_total.items())]
              or [({"finished_reason": "stop"}, 0)]),
            F("prompt_tokens_total", "counter", "Prompt tokens prefilled.",
              [({}, self.prompt_tokens_total)]),
            F("generation_tokens_total", "counter", "Tokens generated.",
              [({}, self.generation_tokens_total)]),
            F("spec_decode_num_drafts_total", "counter",
              "Draft blocks verified (one per request per speculative round).",
              [({}, self.tokens_per_round.n)]),
            F("spec_decode_num_draft_tokens_total", "counter", "Draft tokens sent to the target.",
              [({}, self.draft_tokens_total)]),
            F("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
              [({}, self.accepted_tokens_total)]),
            F("spec_decode_num_accepted_tokens_per_pos_total", "counter",
              "Accepted drafts by block position (1-based).",
              [({"position": str(k + 1)}, n) for k, n in enumerate(self.accepted_per_pos)]),
            F("spec_decode_num_verified_tokens_per_pos_total", "counter",
              "Verified drafts by block position (1-based).",
              [({"position": str(k + 1)}, n) for k, n in enumerate(self.verified_per_pos)]),
            F("spec_decode_acceptance_length", "gauge",
              "Mean tokens per request per round (accepted drafts + 1).", [({}, tau)]),
            F("spec_decode_capacity_k", "gauge",
              "Capacity K the async top-K admission chose for the last round.",
              [({}, self.capacity_k)]),
            F("spec_decode_target_steps_per_second", "gauge",
              "SPS of the last verification step (1 / step seconds).", [({}, self.sps)]),
            F("spec_decode_drafter_available", "gauge",
              "1 while the drafter service answers; 0 = plain decoding fallback.",
              [({}, self.drafter_available)]),
            F("spec_decode_fallback_rounds_total", "counter",
              "Rounds run as plain decoding because the drafter was unavailable.",
              [({}, self.fallback_rounds_total)]),
            F("round_seconds_total", "counter",
              "Engine time by stage: prefill (a fused forward's prompt-token share), draft (incl. "
              "the drafter service round trip), admission, verify (the target's step), verify_call "
              "(the verifier call beyond that step: sampling, commits, transfers), other "
              "(the scheduler's own work).",
              [({"stage": stage}, round(value, 6)) for stage, value in self.stage_seconds.items()]),
            F("spec_decode_skipped_draft_rounds_total", "counter",
              "async_topk rounds that did not draft because their capacity K was 0.",
              [({}, self.skipped_draft_rounds_total)]),
            F("verifier_restores_total", "counter",
              "Requests whose KV cache was rebuilt after a verifier restart.",
              [({}, self.verifier_restores_total)]),
        ]

    @staticmethod
    def _histogram(name: str, help_text: str, h: _Histogram, label: str):
        yield f"# HELP {PREFIX}{name} {help_text}\n# TYPE {PREFIX}{name} histogram\n"
        for edge, count in zip(h.buckets, h.counts):
            yield f'{PREFIX}{name}_bucket{{{label},le="{edge:g}"}} {count}\n'
        yield f'{PREFIX}{name}_bucket{{{label},le="+Inf"}} {h.n}\n'
        yield f"{PREFIX}{name}_sum{{{label}}} {h.total}\n{PREFIX}{name}_count{{{label}}} {h.n}\n"
