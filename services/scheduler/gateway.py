"""What both client APIs (gRPC Generation, OpenAI REST) share: input validation, tokenization,
submission to the engine loop, incremental detokenization, fetch and resume of stored requests.

Validation raises InvalidRequest with the HTTP status and a message naming the problem; the REST
layer answers it as an OpenAI-style error body, the gRPC layer as INVALID_ARGUMENT (or NOT_FOUND /
FAILED_PRECONDITION). Nothing reaches the engine unvalidated: every number is checked against the
range of the field that will carry it (int32 top_k, int64 seed), so one request's parameters can
never fail in a later stage that serves a whole batch.

Ownership: each request id is 128 random bits, and its stored record carries the fingerprint of
the API key that made it (dspark.serving.auth). Fetching or resuming it with another key answers
exactly what an unknown id answers (404), so ids of others can be neither read nor probed.

Admission: beyond `max_waiting` queued requests a new one is refused with `Overloaded` (HTTP 429
with Retry-After, gRPC RESOURCE_EXHAUSTED) instead of growing the queue without bound.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from dspark.engine import RequestMetrics
from dspark.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from dspark.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, SamplingParams
from dspark.serving.cohorts import Cohorts
from dspark.serving.detokenizer import INITIAL_CONTEXT_TOKENS, IncrementalDetokenizer
from dspark.serving.engine_loop import StreamEvent, Submission
from dspark.serving.metrics import SchedulerMetrics
from dspark.serving.store import RequestStatus, RequestStore, StoredRequest
from dspark.structured_output import GrammarCompiler, GrammarSpec, InvalidGrammar

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# The ranges of the proto fields the parameters travel in (dspark.v1.SamplingParams).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_STOP_STRINGS = 64
"""Most stop strings a request may give (OpenAI allows 4, vLLM any number; each costs a search
of the held-back text per chunk, so there is a bound)."""
MAX_STOP_STRING_CHARS = 1024
"""Longest stop string: the stream holds back that many characters minus one."""
# A refused client is told to come back after this long (Retry-After): about one round of a
# loaded stack, so that a retrying client finds the next free slot.
RETRY_AFTER_SECONDS = 1


class InvalidRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


class Overloaded(InvalidRequest):
    """The waiting queue is full: HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, retry_after_seconds: int = RETRY_AFTER_SECONDS) -> None:
        super().__init__(message, status=429)
        self.retry_after_seconds = retry_after_seconds


@dataclass
class GenerationSpec:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    logprobs: int | None = None
    """Report the target's log-probability of each produced token with this many top
    alternatives (0..MAX_TOP_LOGPROBS); None = none."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence tokens (vLLM's ignore_eos): only max_tokens
    (and the front end's stop strings) end the output."""
    grammar: GrammarSpec | None = None
    """Structured output (response_format): the output follows this grammar and ends with an
    end-of-sequence token where it is complete."""


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
    logprobs: TokenLogprobs | None = None
    """One row per token of token_ids, when the request asked (GenerationSpec.logprobs)."""


class GenerationStream:
    """Iterates a request's Chunks; `cancel()` (client gone) aborts it and frees its caches."""

    def __init__(self, gateway: "Gateway", request_id: str, prompt_ids: list[int],
                 already: list[int], events: queue.Queue, logprobs: int | None = None,
                 min_tokens: int = 0) -> None:
        self.gateway = gateway
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.logprobs = logprobs
        self.min_tokens = min_tokens
        """The request's min_tokens: no stop string ends within its first tokens' text."""
        self._protected: int | None = None
        """The request's top count when it asked for log-probabilities (GenerationSpec), else None."""
        self._events = events
        self._text = IncrementalDetokenizer(gateway.decode, already)
        self.finished = False
        self._started = self._last_output = time.monotonic()
        self._first_output = True

    @property
    def output_ids(self) -> list[int]:
        """Tokens produced before this stream (a resumed request) and during it."""
        return self._text.token_ids

    def __iter__(self) -> Iterator[Chunk]:
        while not self.finished:
            yield self.next_chunk()

    def next_chunk(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk, or None if none came within `timeout` seconds."""
        try:
            event: StreamEvent = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        self._record_latency(event)
        delta = self._text.push(event.new_token_ids, final=event.finished)
        self.finished = event.finished
        return Chunk(event.new_token_ids, delta, event.finished, event.finish_reason,
                     len(self.prompt_ids), len(self.output_ids), event.metrics, event.error,
                     event.logprobs)

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

    def stop_protected_chars(self) -> int | None:
        """The characters of this stream's text in which no stop string may end (StopStrings'
        `protected`): those of the first min_tokens output tokens once more tokens came, None
        while the output holds no more than min_tokens (vLLM's rule)."""
        if not self.min_tokens:
            return 0
        if len(self.output_ids) <= self.min_tokens:
            return None
        if self._protected is None:  # decoded once, when the output first passes min_tokens
            self._protected = len(self.gateway.decode(self.output_ids[:self.min_tokens]))
        return self._protected

    def tokens_for_text(self, last_token_ids: list[int], chars: int) -> int:
        """How many of `last_token_ids` (the tokens of the last chunk read) it takes for their
        text to reach `chars` characters (at least 1): where a stop string ends, the tokens
        after it do not count. Decodes a window per token, once per request."""
        before = self.output_ids[:len(self.output_ids) - len(last_token_ids)]
        context = before[max(0, len(before) - INITIAL_CONTEXT_TOKENS):]
        base = len(self.gateway.decode(context))
        for count in range(1, len(last_token_ids)):
            if len(self.gateway.decode(context + last_token_ids[:count])) - base >= chars:
                return count
        return len(last_token_ids)

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
                 stop_token_ids: Sequence[int], metrics: SchedulerMetrics | None = None,
                 max_waiting: int = 64, max_prompt_chars: int = 262144) -> None:
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
        self.max_waiting = max_waiting
        """Requests queued (not yet running) beyond which new ones are refused (Overloaded)."""
        self.max_prompt_chars = max_prompt_chars
        """Longest prompt text tokenized; tokenizing runs under one lock for every client."""
        # Rust fast tokenizers can raise "Already borrowed" when one object is used from several
        # threads at once (HTTP and gRPC handlers run in threads): one call at a time.
        self._tokenizer_lock = threading.Lock()
        self.grammars = (GrammarCompiler(tokenizer=tokenizer, vocab_size=vocab_size)
                         if tokenizer is not None else None)
        """Compiles response_format grammars to check them before they reach the engine."""
        # Admission check, resume's liveness check and the submission happen together, so two
        # concurrent resumes of one id cannot both start it and the queue bound holds.
        self._submit_lock = threading.Lock()

    # -- validation -------------------------------------------------------------------------
    def check_model(self, name: Any) -> None:
        if name is None or name == "":
            raise InvalidRequest("'model' is required", param="model")
        if name != self.model_name:
            raise InvalidRequest(f"unknown model {name!r}; this server serves {self.model_name!r}",
                                 status=404, param="model")

    def spec(self, prompt_ids: list[int], temperature: Any = 1.0, top_p: Any = 1.0,
             top_k: Any = 0, seed: Any = None, max_tokens: Any = 16,
             logprobs: Any = None, ignore_eos: bool = False, min_p: Any = 0.0,
             presence_penalty: Any = 0.0, frequency_penalty: Any = 0.0,
             repetition_penalty: Any = 1.0, logit_bias: Any = None,
             min_tokens: Any = 0, response_format: Any = None) -> GenerationSpec:
        """`logprobs`: top alternatives per produced token (None = no log-probabilities).
        min_p .. min_tokens: vLLM's parameters (dspark.sampling.SamplingParams), in vLLM's
        ranges; logit_bias maps token ids (ints, or their decimal strings as JSON keys are) to
        biases. `response_format`: OpenAI's (None = text)."""
        max_tokens = _number(max_tokens, "max_tokens", int)
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {_short(max_tokens)}",
                                 param="max_tokens")
        if max_tokens > self.max_tokens_limit:
            raise InvalidRequest(f"max_tokens must be <= {self.max_tokens_limit}, got "
                                 f"{_short(max_tokens)}", param="max_tokens")
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
        if not 0 <= top_k <= INT32_MAX:
            raise InvalidRequest(f"top_k must be in 0..{INT32_MAX}, got {_short(top_k)}",
                                 param="top_k")
        if seed is not None:
            seed = _number(seed, "seed", int)
            if not INT64_MIN <= seed <= INT64_MAX:
                raise InvalidRequest(f"seed must be a 64-bit signed integer, got {_short(seed)}",
                                     param="seed")
        if logprobs is not None:
            logprobs = _number(logprobs, "logprobs", int)
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got "
                                     f"{_short(logprobs)}", param="logprobs")
        processing = self._processing(max_tokens, min_p, presence_penalty, frequency_penalty,
                                      repetition_penalty, logit_bias, min_tokens)
        return GenerationSpec(prompt_ids, SamplingParams(temperature, top_k, top_p, seed,
                                                         **processing),
                              max_tokens, logprobs, bool(ignore_eos),
                              self.grammar(response_format, bool(ignore_eos),
                                           processing["min_tokens"]))

    def grammar(self, response_format: Any, ignore_eos: bool = False,
                min_tokens: int = 0) -> GrammarSpec | None:
        """OpenAI's response_format as a grammar, compiled once here so that a bad schema is a
        400 naming response_format (None for text)."""
        try:
            spec = GrammarSpec.from_response_format(response_format)
            if spec is None:
                return None
            if ignore_eos:
                raise InvalidGrammar("response_format needs the end-of-sequence token to end "
                                     "the output: not with ignore_eos")
            if min_tokens:
                raise InvalidGrammar("response_format cannot be combined with min_tokens: a "
                                     "complete output allows only the stop tokens min_tokens "
                                     "holds back")
            if self.grammars is None:
                raise InvalidGrammar("response_format needs the model's tokenizer")
            with self._tokenizer_lock:  # the first compile reads the tokenizer's vocabulary
                self.grammars.compile(spec)
            if not self.grammars.start(spec, self.stop_token_ids).can_start():
                raise InvalidGrammar("the model's vocabulary cannot write this response_format")
        except InvalidGrammar as e:
            raise InvalidRequest(str(e), param="response_format") from None
        return spec

    def _processing(self, max_tokens: int, min_p: Any, presence_penalty: Any,
                    frequency_penalty: Any, repetition_penalty: Any, logit_bias: Any,
                    min_tokens: Any) -> dict[str, Any]:
        """The logits-processing fields of SamplingParams, checked (InvalidRequest naming the
        field) against vLLM's ranges, the vocabulary and max_tokens."""
        min_p = _number(min_p, "min_p", float)
        if not 0 <= min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {min_p}", param="min_p")
        penalties = {}
        for name, value in (("presence_penalty", presence_penalty),
                            ("frequency_penalty", frequency_penalty)):
            penalties[name] = _number(value, name, float)
            if not -MAX_PENALTY <= penalties[name] <= MAX_PENALTY:
                raise InvalidRequest(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                     f"got {penalties[name]}", param=name)
        repetition_penalty = _number(repetition_penalty, "repetition_penalty", float)
        if not repetition_penalty > 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {repetition_penalty}",
                                 param="repetition_penalty")
        min_tokens = _number(min_tokens, "min_tokens", int)
        if not 0 <= min_tokens <= max_tokens:
            raise InvalidRequest(f"min_tokens must be in 0..max_tokens ({max_tokens}), got "
                                 f"{_short(min_tokens)}", param="min_tokens")
        return dict(min_p=min_p, repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                    logit_bias=self._logit_bias(logit_bias), **penalties)

    def _logit_bias(self, logit_bias: Any) -> dict[int, float]:
        """{token id: bias}: ids in the vocabulary (ints or decimal strings), biases in
        [-100, 100]; else InvalidRequest naming logit_bias."""
        if logit_bias is None:
            return {}
        if not isinstance(logit_bias, dict):
            raise InvalidRequest("logit_bias must be an object of token id: bias",
                                 param="logit_bias")
        out = {}
        for key, value in logit_bias.items():
            try:
                token = int(key) if isinstance(key, (int, str)) and not isinstance(key, bool) \
                    else None
            except ValueError:
                token = None
            if token is None or not 0 <= token < self.vocab_size:
                raise InvalidRequest(f"logit_bias keys must be token ids in "
                                     f"0..{self.vocab_size - 1}, got {_short(key)}",
                                     param="logit_bias")
            bias = _number(value, "logit_bias", float)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token}",
                                     param="logit_bias")
            if token in out:
                raise InvalidRequest(f"logit_bias names token {token} twice", param="logit_bias")
            out[token] = bias
        return out

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A string, a list of token ids, or a one-element list of either (OpenAI's forms)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                return []
            self._check_text(prompt, "prompt")
            with self._tokenizer_lock:
                return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
            if len(prompt) > self.max_context_tokens:
                raise InvalidRequest(f"prompt of {len(prompt)} tokens is longer than the context "
                                     f"of {self.max_context_tokens} tokens", param="prompt")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids outside the vocabulary 0..{self.vocab_size - 1}: "
                                     f"{bad[:5]}", param="prompt")
            return list(prompt)
        raise InvalidRequest("'prompt' must be a string or a list of token ids (one prompt)",
                             param="prompt")

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids (/tokenize)."""
        if not isinstance(text, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt")
        self._check_text(text, "prompt")
        with self._tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        """Token ids inside the vocabulary, else a 400 naming `param`."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{param} token ids outside the vocabulary 0..{self.vocab_size - 1}: "
                                 f"{bad[:5]}", param=param)
        return token_ids

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens kept (/detokenize)."""
        self.check_token_ids(token_ids, "tokens")
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's vocabulary entry (/tokenize with return_token_strs)."""
        with self._tokenizer_lock:
            return list(self.tokenizer.convert_ids_to_tokens(token_ids))

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
        """The chat template's text of `messages`, tokenized (the template writes the special
        tokens; `add_special_tokens` adds the tokenizer's too, as vLLM's /tokenize can)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}] must be an object with a role in {CHAT_ROLES}",
                                     param="messages")
            if not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}].content must be a string", param="messages")
        if sum(len(m["content"]) for m in messages) > self.max_prompt_chars:
            raise InvalidRequest(f"messages longer than {self.max_prompt_chars} characters",
                                 param="messages")
        for m in messages:
            self._check_text(m["content"], "messages")
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(
                clean, tokenize=False, add_generation_prompt=add_generation_prompt)
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _check_text(self, text: str, param: str) -> None:
        """Before tokenizing: bounded length, and encodable (a JSON \\ud800 is a lone surrogate)."""
        if len(text) > self.max_prompt_chars:
            raise InvalidRequest(f"{param} longer than {self.max_prompt_chars} characters",
                                 param=param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{param} is not valid Unicode (a lone surrogate)",
                                 param=param) from None

    # -- generation -------------------------------------------------------------------------
    @staticmethod
    def new_request_id(kind: str = "cmpl") -> str:
        """128 random bits: unguessable, and unique across replicas without coordination."""
        return f"{kind}-{secrets.token_hex(16)}"

    def start(self, spec: GenerationSpec, request_id: str, owner: str = "",
              fork_of: str | None = None) -> GenerationStream:
        """`owner`: the fingerprint of the caller's API key ('' with authentication off).
        `fork_of`: the request id of another sample of the same prompt, started before: this
        one copies its prompt's caches instead of reading the prompt (dspark/forks.py)."""
        sampling = spec.sampling
        stop_token_ids = [] if spec.ignore_eos else list(self.stop_token_ids)
        stored_sampling = sampling_record(sampling)
        if spec.grammar is not None:  # a resumed request goes on under its grammar
            stored_sampling["grammar"] = spec.grammar.to_json()
        stored = StoredRequest(request_id, spec.prompt_ids, stored_sampling,
                               spec.max_tokens, stop_token_ids, owner=owner)
        with self._submit_lock:
            events = self._submit(Submission(request_id, spec.prompt_ids, sampling,
                                             spec.max_tokens, stop_token_ids, stored,
                                             logprobs=spec.logprobs, grammar=spec.grammar,
                                             fork_of=fork_of))
        return GenerationStream(self, request_id, spec.prompt_ids, [], events, spec.logprobs,
                                sampling.min_tokens)

    def fetch(self, request_id: str, owner: str = "") -> StoredRequest:
        """The caller's stored request. Another key's request is answered as an unknown one, and
        the message never echoes the id (a 404 page must not carry someone else's id)."""
        record = self.store.get(request_id) if isinstance(request_id, str) else None
        if record is None or not _same_owner(record.owner, owner):
            raise InvalidRequest("no such request", status=404, param="request_id")
        if record.status == RequestStatus.RUNNING and not self.loop.is_live(request_id):
            record.status = RequestStatus.INTERRUPTED
        return record

    def resume(self, request_id: str, owner: str = "") -> GenerationStream:
        """Continue an interrupted request from its stored tokens (same id, same record).

        A finished one is replayed: one chunk with everything it produced."""
        with self._submit_lock:  # two concurrent resumes of one id: the second finds it live
            record = self.fetch(request_id, owner)
            if self.loop.is_live(request_id):
                raise InvalidRequest("the request is running; fetch it instead", status=409,
                                     param="request_id")
            remaining = record.max_tokens - len(record.output_ids)
            resumable = record.finish_reason in ("abort", "error")
            if (record.status == RequestStatus.FINISHED and not resumable) or remaining < 1:
                done: queue.Queue = queue.Queue()
                done.put(StreamEvent([], True, record.finish_reason or "length"))
                return GenerationStream(self, request_id, record.prompt_ids, record.output_ids,
                                        done)
            sampling = sampling_from_record(record.sampling)
            record.status, record.finish_reason = RequestStatus.RUNNING, ""
            grammar = (GrammarSpec.from_json(record.sampling["grammar"])
                       if record.sampling.get("grammar") else None)
            events = self._submit(Submission(request_id, record.prompt_ids + record.output_ids,
                                             sampling, remaining, record.stop_token_ids, record,
                                             grammar=grammar,
                                             earlier_output=list(record.output_ids)))
        return GenerationStream(self, request_id, record.prompt_ids, record.output_ids, events)

    def _submit(self, submission: Submission) -> queue.Queue:
        """Admit, store, then queue (under _submit_lock). Storing here, before the response has
        started, lets a store that is down refuse the request with a 503 instead of failing it
        after its 200."""
        waiting = self.loop.queue_depth()
        if waiting >= self.max_waiting:
            if self.metrics is not None:
                self.metrics.record_refused("queue_full")
            raise Overloaded(f"the server is at capacity ({waiting} requests waiting); retry "
                             f"after {RETRY_AFTER_SECONDS} s")
        if submission.stored is not None:
            try:
                self.store.create(submission.stored)
            except Exception as e:
                raise InvalidRequest(f"the request store is unavailable: {type(e).__name__}; "
                                     "retry shortly", status=503) from e
        try:
            return self.loop.submit(submission)
        except RuntimeError as e:
            raise InvalidRequest(str(e), status=503) from e

    def token_piece(self, token_id: int) -> tuple[str, str]:
        """(the token decoded alone, special tokens kept; its vocabulary entry)."""
        if self.tokenizer is None:
            return "", ""
        with self._tokenizer_lock:
            return (self.tokenizer.decode([token_id], skip_special_tokens=False),
                    self.tokenizer.convert_ids_to_tokens(token_id))

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        stops = set(self.stop_token_ids)
        with self._tokenizer_lock:
            return self.tokenizer.decode([t for t in token_ids if t not in stops],
                                         skip_special_tokens=True)


def sampling_record(params: SamplingParams) -> dict[str, Any]:
    """What a stored request keeps of its sampling (JSON): SamplingParams' fields, the
    logits-processing ones only where they are on; the stop tokens travel beside them."""
    out = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
           "seed": params.seed}
    defaults = SamplingParams()
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "min_tokens"):
        if getattr(params, name) != getattr(defaults, name):
            out[name] = getattr(params, name)
    if params.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in params.logit_bias}
    return out


def sampling_from_record(record: dict[str, Any]) -> SamplingParams:
    """The SamplingParams of a stored request. A resume gives its earlier output back as the
    end of the prompt (Submission.earlier_output): min_tokens and the frequency and presence
    penalties count it as output, so the stored values stand as they are."""
    processing = {name: record[name] for name in ("min_p", "presence_penalty",
                                                  "frequency_penalty", "repetition_penalty")
                  if name in record}
    return SamplingParams(record["temperature"], record["top_k"], record["top_p"],
                          record.get("seed"), **processing,
                          logit_bias={int(t): b for t, b in record.get("logit_bias", {}).items()},
                          min_tokens=record.get("min_tokens", 0))


def check_stop_strings(strings: list[str]) -> list[str]:
    """The non-empty stop strings, within the bounds, else InvalidRequest naming `stop`."""
    strings = [s for s in strings if s]
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}",
                             param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in strings):
        raise InvalidRequest(f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters",
                             param="stop")
    return strings


def _same_owner(stored: str, caller: str) -> bool:
    return secrets.compare_digest(stored.encode(), caller.encode())


def _number(value: Any, name: str, kind: type) -> Any:
    """A finite number of `kind` (an int may be a float with no fraction: 16.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {_short(value)}", param=name)
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise InvalidRequest(f"{name} must be finite, got {value!r}", param=name)
    if kind is int:
        if int(value) != value:
            raise InvalidRequest(f"{name} must be an integer, got {value!r}", param=name)
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an integer beyond the float range (10**400)
        raise InvalidRequest(f"{name} is out of range, got {_short(value)}", param=name) from None


def _short(value: Any) -> str:
    """repr() for a message, at most 40 characters (a 10**4300-digit integer must not be echoed)."""
    try:
        text = repr(value)
    except ValueError:  # int -> str of more than sys.get_int_max_str_digits() digits
        return "a number too large to print"
    return text if len(text) <= 40 else text[:37] + "..."
