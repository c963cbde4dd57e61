"""The gRPC Generation API of the scheduler, and the API-key interceptor.

Generate validates exactly as the REST API does (the shared Gateway), then streams one
GenerateReply per round with the request's new tokens and text (and their log-probabilities
when the request set `logprobs`), the last one carrying usage and speculative metrics. A client
that cancels or disconnects has its request aborted at once. Stop strings end the output
before the first one it contains, as in the REST API: the last reply's tokens end with the one
that completed it, its text before it. `max_tokens` absent means 16; 0 is refused.
"""

from __future__ import annotations

import json
import logging

import grpc

from dspark.serving import messages
from dspark.serving.auth import ApiKeys, deny_handler
from dspark.serving.protos import pb, rpc
from services.scheduler.gateway import (Gateway, GenerationStream, InvalidRequest, Overloaded,
                                       check_stop_strings, sampling_from_record)
from services.scheduler.stop_strings import StopStrings

_LOGGER = logging.getLogger("dspark.scheduler")
_GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.FAILED_PRECONDITION,
              429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


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

    def _start(self, request, owner: str) -> GenerationStream:
        g = self.gateway
        if request.resume_request_id:
            if request.HasField("logprobs"):
                raise InvalidRequest("logprobs are not stored: a resumed request cannot return "
                                     "them", param="logprobs")
            if request.stop:
                raise InvalidRequest("stop strings are not stored: give them to the first "
                                     "request only", param="stop")
            if request.response_format:
                raise InvalidRequest("a resumed request keeps its stored response_format: give "
                                     "it to the first request only", param="response_format")
            return g.resume(request.resume_request_id, owner)
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
        spec = g.spec(prompt_ids, temperature=s.temperature,
                      top_p=s.top_p if s.top_p else 1.0,  # proto3 default 0 = unset
                      top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
                      max_tokens=request.max_tokens if request.HasField("max_tokens") else 16,
                      logprobs=request.logprobs if request.HasField("logprobs") else None,
                      ignore_eos=request.ignore_eos, min_p=s.min_p,
                      presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                      repetition_penalty=(s.repetition_penalty
                                          if s.HasField("repetition_penalty") else 1.0),
                      logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
                      response_format=_response_format(request.response_format))
        return g.start(spec, g.new_request_id("gen"), owner)

    def Generate(self, request, context):
        try:
            stop = check_stop_strings(list(request.stop))
            stream = self._start(request, self._owner(context))
        except Overloaded as e:
            context.set_trailing_metadata([("retry-after", str(e.retry_after_seconds))])
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message)
        except InvalidRequest as e:
            context.abort(_GRPC_CODE.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), e.message)
        except Exception:  # a bug: INTERNAL without internals (gRPC would send the message)
            _LOGGER.exception("unexpected error in Generate")
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        context.add_callback(stream.cancel)  # no-op once finished
        matcher = StopStrings(stop)
        for chunk in stream:
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
            yield reply
            if chunk.finished:
                return

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
