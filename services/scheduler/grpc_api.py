"""The gRPC Generation API of the scheduler, and the API-key interceptor.

Generate validates exactly as the REST API does (the shared Gateway), then streams one
GenerateReply per round with the request's new tokens and text (and their log-probabilities
when the request set `logprobs`), the last one carrying usage and speculative metrics. A client
that cancels or disconnects has its request aborted at once. Stop strings end the output
before the first one it contains, as in the REST API: the last reply's tokens end with the one
that completed it, its text before it. `max_tokens` absent means 16; 0 is refused.

`n` and `best_of` start the samples exactly as the REST API does (services.scheduler.samples:
sample i seeded with seed + i, the prompt read once and forked): each sample streams its own
replies, interleaved as they come, `GenerateReply.index` telling them apart. With best_of > n
the n best are known only when every sample has finished, so their replies come then, in
choice order.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Iterator

import grpc

from dspark.serving import messages
from dspark.serving.auth import ApiKeys, deny_handler
from dspark.serving.protos import pb, rpc
from services.scheduler.gateway import (Chunk, Gateway, GenerationStream, InvalidRequest,
                                       Overloaded, check_stop_strings, sampling_from_record)
from services.scheduler.samples import SampleCounts, best_samples, sample_counts, start_samples
from services.scheduler.stop_strings import StopStrings

_LOGGER = logging.getLogger("dspark.scheduler")
_GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.FAILED_PRECONDITION,
              429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
_WAKE_SECONDS = 1.0
"""Longest wait for the samples' next event before their queues are read again (a safety net:
every event wakes the reader)."""


def _authorization(context: grpc.ServicerContext) -> str:
    return str(dict(context.invocation_metadata() or ()).get("authorization", ""))


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <key>` metadata (health checks excepted)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if not self.keys.enabled or handler_call_details.method.startswith("/grpc.health."):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.owner(str(metadata.get("authorization", ""))) is not None:
            return handler
        return deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid API key (metadata authorization: Bearer <key>)")


class GenerationServicer(rpc.generation.GenerationServicer):
    def __init__(self, gateway: Gateway, keys: ApiKeys) -> None:
        self.gateway = gateway
        self.keys = keys

    def _owner(self, context: grpc.ServicerContext) -> str:
        """The caller's key fingerprint (the interceptor already refused unknown keys)."""
        owner = self.keys.owner(_authorization(context))
        if owner is None:
            raise InvalidRequest("missing or invalid API key", 401)
        return owner

    def _start(self, request, owner: str) -> tuple[list[GenerationStream], SampleCounts]:
        """Validate and submit the request's samples (samples.start_samples, as REST does)."""
        g = self.gateway
        counts = sample_counts(request.n if request.HasField("n") else None,
                               request.best_of if request.HasField("best_of") else None)
        if request.resume_request_id:
            for name in ("logprobs", "n", "best_of"):
                if request.HasField(name):
                    raise InvalidRequest(f"{name} is not stored: give it to the first request "
                                         "only", param=name)
            if request.stop:
                raise InvalidRequest("stop strings are not stored: give them to the first "
                                     "request only", param="stop")
            if request.response_format:
                raise InvalidRequest("a resumed request keeps its stored response_format: give "
                                     "it to the first request only", param="response_format")
            return [g.resume(request.resume_request_id, owner)], counts
        g.check_model(request.model)
        given = [bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of prompt, prompt_token_ids, messages")
        if request.messages:
            prompt_ids = g.encode_chat([{"role": m.role, "content": m.content}
                                        for m in request.messages])
        else:
            prompt_ids = g.encode_prompt(request.prompt or list(request.prompt_token_ids))
        s = request.sampling
        sampling = dict(temperature=s.temperature,
                        top_p=s.top_p if s.top_p else 1.0,  # proto3 default 0 = unset
                        top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
                        max_tokens=request.max_tokens if request.HasField("max_tokens") else 16,
                        logprobs=request.logprobs if request.HasField("logprobs") else None,
                        ignore_eos=request.ignore_eos, min_p=s.min_p,
                        presence_penalty=s.presence_penalty,
                        frequency_penalty=s.frequency_penalty,
                        repetition_penalty=(s.repetition_penalty
                                            if s.HasField("repetition_penalty") else 1.0),
                        logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
                        response_format=_response_format(request.response_format))
        return start_samples(g, [prompt_ids], counts, sampling, "gen", owner), counts

    def Generate(self, request, context):
        try:
            stop = check_stop_strings(list(request.stop))
            streams, counts = self._start(request, self._owner(context))
        except Overloaded as e:
            context.set_trailing_metadata([("retry-after", str(e.retry_after_seconds))])
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message)
        except InvalidRequest as e:
            context.abort(_GRPC_CODE.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), e.message)
        except Exception:  # a bug: INTERNAL without internals (gRPC would send the message)
            _LOGGER.exception("unexpected error in Generate")
            context.abort(grpc.StatusCode.INTERNAL, "internal error")

        def cancel_all() -> None:  # no-op for the finished ones
            for stream in streams:
                stream.cancel()

        context.add_callback(cancel_all)
        samples = [_SampleReplies(stream, stop) for stream in streams]
        try:
            if not counts.ranked:
                for index, chunk in _merged_chunks(streams):
                    reply = samples[index].reply(chunk, context)
                    reply.index = index
                    yield reply
                return
            # best_of > n: every sample to its end, then the n best in choice order.
            kept: list[list] = [[] for _ in streams]
            cumulative_logprobs = [0.0] * len(streams)
            for index, chunk in _merged_chunks(streams):
                kept[index].append(samples[index].reply(chunk, context))
                if chunk.logprobs is not None:  # cut at a stop string by reply()
                    cumulative_logprobs[index] += float(chunk.logprobs.token_logprobs.sum())
            for choice, index in enumerate(best_samples(cumulative_logprobs, counts)):
                for reply in kept[index]:
                    reply.index = choice
                    if not request.HasField("logprobs"):  # asked for ranking only
                        del reply.logprobs[:]
                    yield reply
        finally:
            cancel_all()

    def GetRequest(self, request, context):
        try:
            r = self.gateway.fetch(request.request_id, self._owner(context))
        except InvalidRequest as e:
            context.abort(_GRPC_CODE.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), e.message)
        except Exception:
            _LOGGER.exception("unexpected error in GetRequest")
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        return pb.generation.RequestRecord(
            request_id=r.request_id, prompt_ids=r.prompt_ids, output_ids=r.output_ids,
            sampling=messages.sampling_to_pb(sampling_from_record(r.sampling)),
            max_tokens=r.max_tokens, status=r.status, finish_reason=r.finish_reason,
            text=self.gateway.decode(r.output_ids))


class _SampleReplies:
    """One sample's chunks as GenerateReply messages, cut at the first stop string."""

    def __init__(self, stream: GenerationStream, stop: list[str]) -> None:
        self.stream = stream
        self.matcher = StopStrings(stop)

    def reply(self, chunk: Chunk, context: grpc.ServicerContext):
        """The reply of `chunk` (modified in place where a stop string ends it: its tokens and
        log-probabilities end with the one that completed it, it is the finished one)."""
        stream, matcher = self.stream, self.matcher
        if chunk.error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"generation failed: {chunk.error}")
        text, stopped = matcher.feed(chunk.text, stream.stop_protected_chars())
        if stopped:  # the tokens up to the one that completed the stop string
            kept = stream.tokens_for_text(chunk.token_ids, matcher.stop_end)
            stream.cancel()
            chunk.completion_tokens -= len(chunk.token_ids) - kept
            chunk.token_ids, chunk.finished, chunk.finish_reason = (
                chunk.token_ids[:kept], True, "stop")
            if chunk.logprobs is not None:
                chunk.logprobs = chunk.logprobs[:kept]
        elif chunk.finished:
            text += matcher.flush()
        reply = pb.generation.GenerateReply(request_id=stream.request_id,
                                            token_ids=chunk.token_ids, text=text,
                                            finished=chunk.finished,
                                            finish_reason=chunk.finish_reason or "")
        if chunk.logprobs is not None:
            reply.logprobs.extend(_token_logprobs(chunk))
        if chunk.finished:
            reply.usage.prompt_tokens = chunk.prompt_tokens
            reply.usage.completion_tokens = chunk.completion_tokens
            m = chunk.metrics
            if m is not None:
                reply.metrics.rounds = m.rounds
                reply.metrics.drafts_verified = m.drafts_verified
                reply.metrics.drafts_accepted = m.drafts_accepted
                reply.metrics.acceptance_length = m.tau
        return reply


def _merged_chunks(streams: list[GenerationStream]) -> Iterator[tuple[int, Chunk]]:
    """(stream index, chunk) of every stream as they arrive, each stream up to its finished
    chunk (a chunk that a stop string ended counts as finished: the caller cancelled it)."""
    if len(streams) == 1:
        for chunk in streams[0]:
            yield 0, chunk
            if chunk.finished:
                return
        return
    arrived = threading.Event()
    for stream in streams:
        stream.call_on_event(arrived.set)  # set after the event is queued
    open_streams = set(range(len(streams)))
    while open_streams:
        arrived.clear()  # a later event's set() comes after its chunk is queued: none is lost
        for index in sorted(open_streams):
            while (chunk := streams[index].next_chunk(0)) is not None:
                yield index, chunk
                if chunk.finished:
                    open_streams.discard(index)
                    break
        if open_streams:
            arrived.wait(_WAKE_SECONDS)


def _token_logprobs(chunk) -> list:
    """GenerateReply.logprobs of a chunk's tokens (dspark.logprobs.TokenLogprobs, one row each)."""
    lp = chunk.logprobs
    return [pb.generation.TokenLogprob(token_id=t, logprob=v, top_token_ids=ids, top_logprobs=vs)
            for t, v, ids, vs in zip(chunk.token_ids, lp.token_logprobs.tolist(),
                                     lp.top_token_ids.tolist(), lp.top_logprobs.tolist())]


def _response_format(text: str) -> dict | None:
    """GenerateRequest.response_format: OpenAI's object as JSON text ('' = text)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"response_format is not JSON: {e}", param="response_format") from None
