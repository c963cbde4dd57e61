"""What both client APIs (gRPC Generation, OpenAI REST) share: input validation, tokenization,
submission to the engine loop, incremental detokenization, fetch and resume of stored requests.

Validation raises InvalidRequest with the HTTP status and a message naming the problem; the REST
layer answers it as an OpenAI-style error body, the gRPC layer as INVALID_ARGUMENT (or NOT_FOUND /
FAILED_PRECONDITION). Nothing reaches the engine unvalidated.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from dspark.engine import RequestMetrics
from dspark.sampling import SamplingParams
from dspark.serving.cohorts import Cohorts
from dspark.serving.engine_loop import StreamEvent, Submission
from dspark.serving.metrics import SchedulerMetrics
from dspark.serving.store import RequestStatus, RequestStore, StoredRequest

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class InvalidRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


@dataclass
class GenerationSpec:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int


@dataclass
class Chunk:
    """One piece of a streamed generation."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None


class GenerationStream:
    """Iterates a request's Chunks; `cancel()` (client gone) aborts it and frees its caches."""

    def __init__(self, gateway: "Gateway", request_id: str, prompt_ids: list[int],
                 already: list[int], events: queue.Queue) -> None:
        self.gateway = gateway
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids = list(already)
        """Tokens produced before this stream (a resumed request) and during it."""
        self._events = events
        self._printed = gateway.decode(self.output_ids)
        self.finished = False
        self._started = self._last_output = time.monotonic()
        self._first_output = True

    def __iter__(self) -> Iterator[Chunk]:
        while not self.finished:
            yield self.next_chunk()

    def next_chunk(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk, or None if none came within `timeout` seconds."""
        try:
            event: StreamEvent = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        self.output_ids += event.new_token_ids
        self._record_latency(event)
        text = self.gateway.decode(self.output_ids)
        # Hold back an incomplete UTF-8 character (decodes to U+FFFD until complete).
        delta = ""
        if event.finished or not text.endswith("\ufffd"):
            delta, self._printed = text[len(self._printed):], text
        self.finished = event.finished
        return Chunk(event.new_token_ids, delta, event.finished, event.finish_reason,
                     len(self.prompt_ids), len(self.output_ids), event.metrics, event.error)

    def _record_latency(self, event: StreamEvent) -> None:
        """Time to first token, between outputs, and to the end, into the gateway's metrics."""
        metrics, now = self.gateway.metrics, time.monotonic()
        if metrics is None:
            return
        if event.new_token_ids:
            if self._first_output:
                metrics.record_first_token(now - self._started)
            else:
                metrics.record_inter_token(now - self._last_output)
            self._first_output, self._last_output = False, now
        if event.finished:
            metrics.record_request_latency(now - self._started)

    def call_on_event(self, callback: Callable[[], None]) -> None:
        """Have `callback` called on the engine loop's thread after each event is queued for
        this stream, so that an asyncio front end can wait for events without a thread of its
        own (it then reads them with `next_chunk(timeout=0)`)."""
        put = self._events.put

        def put_then_call(*args, **kwargs) -> None:
            put(*args, **kwargs)
            callback()

        self._events.put = put_then_call

    def cancel(self) -> None:
        if not self.finished:
            self.gateway.loop.cancel(self.request_id)


class Gateway:
    def __init__(self, loop: Cohorts, store: RequestStore, tokenizer, model_name: str,
                 max_tokens_limit: int, max_context_tokens: int, vocab_size: int,
                 stop_token_ids: list[int], metrics: SchedulerMetrics | None = None) -> None:
        self.loop = loop
        self.metrics = metrics
        """Where the streams record their latencies (None: nowhere)."""
        self.store = store
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.max_context_tokens = max_context_tokens
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._counter = itertools.count()
        # Rust fast tokenizers can raise "Already borrowed" when one object is used from several
        # threads at once (HTTP and gRPC handlers run in threads): one call at a time.
        self._tokenizer_lock = threading.Lock()
        self._id_prefix = f"{os.getpid():x}{int(time.time()):x}"

    # -- validation -------------------------------------------------------------------------
    def check_model(self, name: Any) -> None:
        if name is None or name == "":
            raise InvalidRequest("'model' is required", param="model")
        if name != self.model_name:
            raise InvalidRequest(f"unknown model {name!r}; this server serves {self.model_name!r}",
                                 status=404, param="model")

    def spec(self, prompt_ids: list[int], temperature: Any = 1.0, top_p: Any = 1.0,
             top_k: Any = 0, seed: Any = None, max_tokens: Any = 16) -> GenerationSpec:
        max_tokens = _number(max_tokens, "max_tokens", int)
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if max_tokens > self.max_tokens_limit:
            raise InvalidRequest(f"max_tokens must be <= {self.max_tokens_limit}, got {max_tokens}",
                                 param="max_tokens")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt_ids) + max_tokens > self.max_context_tokens:
            raise InvalidRequest(f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} is "
                                 f"longer than the context of {self.max_context_tokens} tokens",
                                 param="prompt")
        temperature = _number(temperature, "temperature", float)
        if temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {temperature}", param="temperature")
        top_p = _number(top_p, "top_p", float)
        if not 0 < top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}", param="top_p")
        top_k = _number(top_k, "top_k", int)
        if top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {top_k}", param="top_k")
        if seed is not None:
            seed = _number(seed, "seed", int)
        return GenerationSpec(prompt_ids, SamplingParams(temperature, top_k, top_p, seed),
                              max_tokens)

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A string, a list of token ids, or a one-element list of either (OpenAI's forms)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                return []
            with self._tokenizer_lock:
                return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids outside the vocabulary 0..{self.vocab_size - 1}: "
                                     f"{bad[:5]}", param="prompt")
            return list(prompt)
        raise InvalidRequest("'prompt' must be a string or a list of token ids (one prompt)",
                             param="prompt")

    def encode_chat(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}] must be an object with a role in {CHAT_ROLES}",
                                     param="messages")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content must be a string", param="messages")
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(clean, tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # -- generation -------------------------------------------------------------------------
    def new_request_id(self, kind: str = "cmpl") -> str:
        return f"{kind}-{self._id_prefix}-{next(self._counter)}"

    def start(self, spec: GenerationSpec, request_id: str) -> GenerationStream:
        sampling = spec.sampling
        stored = StoredRequest(request_id, spec.prompt_ids,
                               {"temperature": sampling.temperature, "top_k": sampling.top_k,
                                "top_p": sampling.top_p, "seed": sampling.seed},
                               spec.max_tokens, list(self.stop_token_ids))
        events = self._submit(Submission(request_id, spec.prompt_ids, sampling, spec.max_tokens,
                                         list(self.stop_token_ids), stored))
        return GenerationStream(self, request_id, spec.prompt_ids, [], events)

    def fetch(self, request_id: str) -> StoredRequest:
        record = self.store.get(request_id)
        if record is None:
            raise InvalidRequest(f"no request {request_id!r}", status=404, param="request_id")
        if record.status == RequestStatus.RUNNING and not self.loop.is_live(request_id):
            record.status = RequestStatus.INTERRUPTED
        return record

    def resume(self, request_id: str) -> GenerationStream:
        """Continue an interrupted request from its stored tokens (same id, same record).

        A finished one is replayed: one chunk with everything it produced."""
        record = self.fetch(request_id)
        if self.loop.is_live(request_id):
            raise InvalidRequest(f"request {request_id!r} is running; fetch it instead",
                                 status=409, param="request_id")
        remaining = record.max_tokens - len(record.output_ids)
        resumable = record.finish_reason in ("abort", "error")
        if (record.status == RequestStatus.FINISHED and not resumable) or remaining < 1:
            done: queue.Queue = queue.Queue()
            done.put(StreamEvent([], True, record.finish_reason or "length"))
            return GenerationStream(self, request_id, record.prompt_ids, record.output_ids, done)
        s = record.sampling
        sampling = SamplingParams(s["temperature"], s["top_k"], s["top_p"], s.get("seed"))
        record.status, record.finish_reason = RequestStatus.RUNNING, ""
        events = self._submit(Submission(request_id, record.prompt_ids + record.output_ids,
                                         sampling, remaining, record.stop_token_ids, record))
        return GenerationStream(self, request_id, record.prompt_ids, record.output_ids, events)

    def _submit(self, submission: Submission) -> queue.Queue:
        try:
            return self.loop.submit(submission)
        except RuntimeError as e:
            raise InvalidRequest(str(e), status=503) from e

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        stops = set(self.stop_token_ids)
        with self._tokenizer_lock:
            return self.tokenizer.decode([t for t in token_ids if t not in stops],
                                         skip_special_tokens=True)


def _number(value: Any, name: str, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", param=name)
    if kind is int and int(value) != value:
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", param=name)
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidRequest(f"{name} must be finite, got {value!r}", param=name)
    return kind(value)
