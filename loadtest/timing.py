"""Timing of one streamed response and the summary of a whole Locust run.

Per response: time to first token (TTFT) and the per-user output speed, i.e. the tokens after the
first chunk divided by the time from the first to the last chunk (tokens arrive in verification
rounds, several at once; the first chunk carries the prefill's token). A response with a single
chunk has no speed: nothing was decoded after the first token.

The run summary counts every token received, also of streams cut off when the run stops, so the
aggregate throughput of a level is tokens received / seconds of the run, not biased towards
short responses.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class StreamTiming:
    """Clock readings of one streamed response (time.perf_counter seconds)."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    first_chunk_tokens: int = 0
    tokens: int = 0

    def on_tokens(self, count: int, now: float | None = None) -> None:
        if count <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.first_token_at is None:
            self.first_token_at, self.first_chunk_tokens = now, count
        self.last_token_at = now
        self.tokens += count

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_at is None else 1000 * (self.first_token_at - self.started)

    @property
    def tokens_per_s(self) -> float | None:
        """Output speed after the first token; None when no token came after the first chunk."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        seconds = self.last_token_at - self.first_token_at
        after_first = self.tokens - self.first_chunk_tokens
        return after_first / seconds if after_first > 0 and seconds > 0 else None


@dataclass
class ResponseRecord:
    user_class: str
    ttft_ms: float
    tokens_per_s: float | None
    tokens: int
    sla_met: bool | None


@dataclass
class RunSummary:
    """What the sweep needs from one Locust run (written as JSON by the locustfile)."""

    sla_tokens_per_s: float
    started_at: float | None = None
    stopped_at: float | None = None
    tokens_received: int = 0
    """Every streamed token in the run window, also of responses cut off at the end."""
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    """The first few error messages, so a failed run says why."""
    responses: list[ResponseRecord] = field(default_factory=list)

    def start(self) -> None:
        self.started_at, self.stopped_at, self.tokens_received = time.perf_counter(), None, 0
        self.errors, self.first_errors, self.responses = 0, [], []

    def stop(self) -> None:
        if self.started_at is not None and self.stopped_at is None:
            self.stopped_at = time.perf_counter()

    @property
    def running(self) -> bool:
        return self.started_at is not None and self.stopped_at is None

    def count_tokens(self, n: int) -> None:
        if self.running:
            self.tokens_received += n

    def note_error(self, message: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(message)

    def add(self, record: ResponseRecord) -> None:
        if self.running:
            self.responses.append(record)

    def to_json(self) -> dict:
        seconds = (self.stopped_at or time.perf_counter()) - (self.started_at or 0)
        speeds = [r.tokens_per_s for r in self.responses if r.tokens_per_s is not None]
        return {"sla_tokens_per_s": self.sla_tokens_per_s, "seconds": seconds,
                "tokens_received": self.tokens_received, "errors": self.errors,
                "first_errors": self.first_errors,
                "aggregate_tokens_per_s": self.tokens_received / seconds if seconds > 0 else 0.0,
                "mean_tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
                "responses": [asdict(r) for r in self.responses]}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))
