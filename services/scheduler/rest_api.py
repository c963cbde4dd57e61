"""The OpenAI-compatible REST API: a FastAPI (ASGI) app, served by uvicorn (RestServer) or by Ray
Serve's ingress (deploy/ray_serve.py).

Routes: POST /v1/completions, POST /v1/chat/completions (`stream: true` -> server-sent events
ending in `data: [DONE]`), GET /v1/models and /v1/models/{id}, vLLM's POST /tokenize and
/detokenize, GET /version and GET|POST /ping, GET /v1/requests/{id} and POST
/v1/requests/{id}/resume (stored request state, see dspark.serving.store), GET /health, GET
/metrics (Prometheus text), GET /docs and /openapi.json. With API keys configured every /v1 route
and /tokenize, /detokenize need `Authorization: Bearer <key>` (401 otherwise); /health, /ping,
/version, /metrics and the docs stay open for probes and scrapers. A stored request belongs to
the key that made it: another key's id answers what an unknown one does (404). Every 4xx has OpenAI's body `{"error": {"message", "type",
"param", "code"}}`; a body that fails validation is a 400 whose `param` names the field
(services.scheduler.openai_models), not FastAPI's 422. A full waiting queue is a 429 with
Retry-After; anything unexpected a 500 with the same body and no internals (the traceback goes to
the log).

The engine loop is a thread that feeds each request's queue (services.scheduler.gateway); it
wakes the handler's event loop when it queues an event, and the handler reads (and detokenizes)
what arrived on the event loop: no thread waits per request, and a round's events for all
streams cost one wake-up. A client that goes away
has its request aborted and its caches freed at once: a streaming one through Starlette's
disconnect listener (it cancels the response), a non-streaming one by asking Starlette after
`STREAM_POLL_SECONDS` without events.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import uvicorn

import dspark
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.logprobs import TokenLogprobs
from dspark.serving.auth import ApiKeys
from dspark.serving.metrics import SchedulerMetrics
from services.scheduler.gateway import Chunk, Gateway, GenerationStream, InvalidRequest, Overloaded
from services.scheduler.openai_models import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                              ChatCompletionChunk, ChatCompletionRequest,
                                              ChatCompletionResponse, ChatLogprobs,
                                              CompletionChoice, CompletionLogprobs,
                                              CompletionRequest, CompletionResponse,
                                              DeltaMessage, DsparkExtras, ErrorResponse,
                                              ModelCard, ModelList, ResumeRequest,
                                              DetokenizeRequest,
                                              DetokenizeResponse, SpecDecodeMetrics,
                                              StoredRequestView, TokenizeRequest,
                                              TokenizeResponse, Usage, VersionResponse)
from services.scheduler.logprobs_view import TokenStrings, chat_logprobs, completion_logprobs
from services.scheduler.samples import SampleCounts, best_samples, start_samples
from services.scheduler.stop_strings import StopStrings

MAX_BODY_BYTES = 8 * 1024 * 1024
STREAM_POLL_SECONDS = 0.25
"""How long a non-streaming handler waits without events before checking its client is there."""
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]+$")
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


@dataclass(frozen=True)
class ServerLimits:
    """uvicorn's limits on the REST server."""

    max_connections: int = 1024
    """Concurrent connections + requests; past it uvicorn answers 503 at once (requests wait in
    the engine loop's queue, not here)."""
    keep_alive_seconds: int = 5
    """An idle kept-alive connection is closed after this."""
    backlog: int = 2048
    """Listen backlog (many clients connecting at once, e.g. a load test starting)."""


# -- errors ---------------------------------------------------------------------------------------
def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def _validation_error_response(error: RequestValidationError) -> JSONResponse:
    """The first validation error as OpenAI's 400, `param` naming the field."""
    first = error.errors()[0]
    kind, ctx = first["type"], first.get("ctx") or {}
    loc = [str(p) for p in first["loc"][1:]] if first["loc"][:1] == ("body",) else \
        [str(p) for p in first["loc"]]
    param = ctx.get("param") or (loc[0] if loc else None)
    if kind == "json_invalid":
        return error_response(400, f"invalid JSON body: {ctx.get('error', first['msg'])}")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return error_response(400, "the JSON body must be an object")
    if not loc and kind == "missing":
        return error_response(400, "a JSON body is required")
    if kind == "missing":
        return error_response(400, f"'{param}' is required", param)
    if kind == "extra_forbidden":
        return error_response(400, f"unsupported parameter '{'.'.join(loc)}'", param)
    if kind == "invalid_parameter":
        return error_response(400, first["msg"], param)
    return error_response(400, f"{'.'.join(loc) or 'body'}: {first['msg']}", param)


def _install_error_handlers(app: FastAPI) -> None:
    async def invalid_request(request: Request, e: InvalidRequest) -> JSONResponse:
        headers = ({"Retry-After": str(e.retry_after_seconds)} if isinstance(e, Overloaded)
                   else None)
        return error_response(e.status, e.message, e.param, headers)

    async def validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _validation_error_response(e)

    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}")
        if e.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}")
        return error_response(e.status_code, str(e.detail))

    async def internal(request: Request, e: Exception) -> JSONResponse:
        """A bug: a 500 with OpenAI's body and no internals; the traceback goes to the log."""
        logging.getLogger("dspark.scheduler").error(
            "unexpected error on %s %s", request.method, request.url.path,
            exc_info=(type(e), e, e.__traceback__))
        return error_response(500, "internal server error")

    app.add_exception_handler(InvalidRequest, invalid_request)
    app.add_exception_handler(Exception, internal)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)


# -- ASGI middleware ------------------------------------------------------------------------------
class BodyLimit:
    """A 413 for a body over `max_bytes`: at once from Content-Length, else while it arrives."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        too_large = f"body larger than {self.max_bytes} bytes"
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, too_large)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, limited_receive, send)


class ResponseCounter:
    """Counts responses by route template, method and status (`dspark:http_requests_total`)."""

    def __init__(self, app, metrics: SchedulerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def recording_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.record_http_response(route, scope["method"], status)


# -- generation -----------------------------------------------------------------------------------
@dataclass
class Piece:
    """What one chunk of the engine's output adds to the response."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    """Set on the last piece only."""
    chunk: Chunk
    """The engine's chunk (usage counts, speculation metrics, error)."""
    counted: int | None = None
    """How many of token_ids the text reaches (a stop string ends with the one that completed
    it); None = all. Log-probabilities are reported for these."""

    def logprobs(self) -> tuple[list[int], TokenLogprobs] | None:
        """(token ids, their log-probabilities) of the counted tokens, when the request asked."""
        if self.chunk.logprobs is None:
            return None
        n = len(self.token_ids) if self.counted is None else self.counted
        return self.token_ids[:n], self.chunk.logprobs[:n]


class _ClientGone(Exception):
    pass


async def _pieces(stream: GenerationStream, stop: list[str],
                  request: Request | None = None) -> AsyncIterator[list[Piece]]:
    """The stream's output cut at the first stop string, in batches of what had arrived.

    The engine loop's thread wakes this coroutine's event loop when it queues an event (one
    cross-thread hop per event; no thread waits per request). With `request` (a non-streaming
    response), raises _ClientGone when its client closed the connection, checked every
    STREAM_POLL_SECONDS without events. The request is aborted when this ends before the
    stream does (a stop string, a client gone, a cancelled response)."""
    matcher = StopStrings(stop)
    loop = asyncio.get_running_loop()
    arrived = asyncio.Event()
    stream.call_on_event(lambda: loop.call_soon_threadsafe(arrived.set))
    try:
        while not stream.finished:
            chunks = []
            while not stream.finished and (chunk := stream.next_chunk(0)) is not None:
                chunks.append(chunk)
            if not chunks:
                arrived.clear()  # a later event's set() runs after this: no wake-up is lost
                try:
                    await asyncio.wait_for(arrived.wait(), STREAM_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        raise _ClientGone()
                continue
            batch = []
            for chunk in chunks:
                if chunk.error:
                    batch.append(Piece("", chunk.token_ids, "error", chunk))
                    break
                text, stopped = matcher.feed(chunk.text, stream.stop_protected_chars())
                if stopped:
                    counted = (stream.tokens_for_text(chunk.token_ids, matcher.stop_end)
                               if chunk.logprobs is not None else None)
                    batch.append(Piece(text, chunk.token_ids, "stop", chunk, counted))
                    break
                if chunk.finished:
                    text += matcher.flush()
                batch.append(Piece(text, chunk.token_ids,
                                   chunk.finish_reason if chunk.finished else None, chunk))
            yield batch
            if batch[-1].finish_reason is not None:
                return
    finally:
        stream.cancel()  # nothing if it finished; else nobody reads it: free its caches now


def _spec_metrics(chunk: Chunk) -> SpecDecodeMetrics | None:
    m = chunk.metrics
    if m is None:
        return None
    return SpecDecodeMetrics(rounds=m.rounds, drafts_verified=m.drafts_verified,
                             drafts_accepted=m.drafts_accepted,
                             acceptance_length=round(m.tau, 4),
                             accepted_per_position=list(m.accepted_per_position))


def _usage(chunk: Chunk) -> Usage:
    return Usage.of(chunk.prompt_tokens, chunk.completion_tokens)


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


@dataclass
class Output:
    """One generation read to its end (a non-streaming response)."""

    text: str
    last: Piece
    logprobs: list[tuple[list[int], TokenLogprobs]]
    """(token ids, their log-probabilities) of the counted tokens of each piece, when asked."""

    @property
    def cumulative_logprob(self) -> float:
        return float(sum(float(values.token_logprobs.sum()) for _, values in self.logprobs))


async def _collect(stream: GenerationStream, stop: list[str], request: Request) -> Output:
    text, last, logprobs = "", None, []
    async for batch in _pieces(stream, stop, request):
        text += "".join(piece.text for piece in batch)
        logprobs += [lp for lp in map(Piece.logprobs, batch) if lp is not None]
        last = batch[-1]
    assert last is not None, "a generation stream ends with a finished chunk"
    return Output(text, last, logprobs)


async def _merged(streams: list[GenerationStream],
                  stop: list[str]) -> AsyncIterator[tuple[int, list[Piece]]]:
    """(choice index, batch of pieces) of every stream as they arrive, until all ended. Ending
    early (a client gone) cancels every stream that has not finished (_pieces' finally)."""
    if len(streams) == 1:
        async for batch in _pieces(streams[0], stop):
            yield 0, batch
        return
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: GenerationStream) -> None:
        try:
            async for batch in _pieces(stream, stop):
                arrived.put_nowait((index, batch))
        except Exception as e:
            arrived.put_nowait((index, e))
        finally:
            arrived.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            index, batch = await arrived.get()
            if batch is None:
                ended += 1
            elif isinstance(batch, Exception):
                raise batch
            else:
                yield index, batch
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class Generation:
    """The engine requests one API request started: `samples` per prompt, prompt by prompt."""

    streams: list[GenerationStream]
    prompt_tokens: list[int]
    """Each prompt's length (usage counts a prompt once, whatever its samples)."""
    samples: int
    """Generations per prompt (best_of, else n)."""
    n: int
    """Choices returned per prompt."""
    echo: list[str]
    """Each prompt's text, when the request asked for echo."""
    report_logprobs: bool
    """Whether the client asked for log-probabilities (best_of asks for them internally)."""

    def prompt_of(self, stream_index: int) -> int:
        return stream_index // self.samples

    def prompt_tokens_of(self, stream_index: int) -> int:
        return self.prompt_tokens[self.prompt_of(stream_index)]

    def echo_of(self, stream_index: int) -> str:
        return self.echo[self.prompt_of(stream_index)] if self.echo else ""

    def choose(self, outputs: list[Output]) -> list[int]:
        """The streams whose outputs are returned, in choice order (samples.best_samples)."""
        return best_samples([out.cumulative_logprob for out in outputs],
                            SampleCounts(self.n, self.samples))


def _prompt_list(prompt: Any) -> list[Any]:
    """The prompts of a completions `prompt`: one string or token-id list, or a list of them."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt]


class RestApi:
    """The routes' logic over one Gateway (the FastAPI app's handlers call these)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.token_strings = TokenStrings(gateway.tokenizer, gateway.token_piece)
        """The strings and bytes of tokens in `logprobs` objects."""

    def start(self, body: CompletionRequest | ChatCompletionRequest,
              owner: str) -> "Generation":
        """Validate against the model, tokenize and submit every generation the request asks
        for (samples.start_samples: each prompt best_of times, sample i of a seeded request
        with seed + i, the samples after a prompt's first forking its caches), on the event
        loop: a hand-off to a worker thread costs more GIL switches than tokenizing
        one prompt. `owner`: the caller's key fingerprint, which the requests are bound to
        (ApiKeys.owner). Gateway.start also writes each request to the store: with Redis down
        that holds this loop for at most the store's 0.5 s timeout, once a second (the store
        refuses at once in between)."""
        g = self.gateway
        g.check_model(body.model)
        echo: list[str] = []
        if isinstance(body, ChatCompletionRequest):
            prompts = [g.encode_chat([m.model_dump(exclude_none=True) for m in body.messages])]
            kind = "chatcmpl"
        else:
            texts = _prompt_list(body.prompt)
            prompts, kind = [g.encode_prompt(p) for p in texts], "cmpl"
            if body.echo:
                echo = [p if isinstance(p, str) else g.decode(p) for p in texts]
        counts = body.counts
        sampling = body.sampling()
        streams = start_samples(g, prompts, counts, sampling, kind, owner)
        return Generation(streams, [len(ids) for ids in prompts], counts.best_of, counts.n, echo,
                          sampling["logprobs"] is not None)

    async def respond(self, generation: "Generation", request: Request, chat: bool,
                      streaming: bool, stop: list[str], include_usage: bool,
                      continuous_usage: bool = False) -> Response:
        if streaming:
            return StreamingResponse(
                self._events(generation, chat, stop, include_usage, continuous_usage),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        gone = False
        try:
            async with asyncio.TaskGroup() as group:  # one fails: the others are cancelled
                tasks = [group.create_task(_collect(stream, stop, request))
                         for stream in generation.streams]
        except* _ClientGone:
            gone = True
        if gone:
            return Response(status_code=499)  # nobody reads it; the requests were aborted
        outputs = [task.result() for task in tasks]
        for out in outputs:
            if out.last.chunk.error:
                raise InvalidRequest(f"generation failed: {out.last.chunk.error}", 503)
        chosen = generation.choose(outputs)
        completion_tokens = sum(outputs[i].last.chunk.completion_tokens for i in chosen)
        first = outputs[chosen[0]]
        common = {"id": generation.streams[0].request_id, "created": int(time.time()),
                  "model": self.gateway.model_name,
                  "usage": Usage.of(sum(generation.prompt_tokens), completion_tokens),
                  "dspark": DsparkExtras(token_ids=generation.streams[chosen[0]].output_ids,
                                         spec_decode=_spec_metrics(first.last.chunk))}
        choices = []
        for index, i in enumerate(chosen):
            out, stream = outputs[i], generation.streams[i]
            whole, ids = None, []
            if generation.report_logprobs and stream.logprobs is not None:
                whole = (TokenLogprobs.cat([values for _, values in out.logprobs])
                         if out.logprobs else TokenLogprobs.empty(stream.logprobs))
                ids = [t for token_ids, _ in out.logprobs for t in token_ids]
            if chat:
                choices.append(ChatChoice(
                    index=index, message=AssistantMessage(content=out.text),
                    finish_reason=out.last.finish_reason,
                    logprobs=None if whole is None else chat_logprobs(whole, ids,
                                                                      self.token_strings)))
            else:
                choices.append(CompletionChoice(
                    index=index, text=generation.echo_of(i) + out.text,
                    finish_reason=out.last.finish_reason,
                    logprobs=None if whole is None else completion_logprobs(
                        whole, ids, self.token_strings, 0)[0]))
        response = ChatCompletionResponse if chat else CompletionResponse
        return _json(response(choices=choices, **common))

    async def _events(self, generation: "Generation", chat: bool, stop: list[str],
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: each choice's chunks as they come (`index` telling them apart),
        with include_usage a last chunk with empty `choices` and the usage of all of them,
        with continuous_usage also each chunk's choice's usage so far, then `[DONE]`."""
        created, model = int(time.time()), self.gateway.model_name
        request_id = generation.streams[0].request_id
        count = len(generation.streams)
        text_offset = [0] * count  # completions: where each choice's next tokens start
        completion_tokens = [0] * count

        def event(index: int, text: str, finish_reason: str | None, extras: DsparkExtras | None,
                  usage: Usage | None, role: bool = False,
                  logprobs: ChatLogprobs | CompletionLogprobs | None = None) -> bytes:
            # model_construct: the values are ours and already valid; this runs once per
            # chunk of every stream, on the thread that also serves every other request.
            common = {"id": request_id, "created": created, "model": model,
                      "usage": usage, "dspark": extras}
            if chat:
                delta = DeltaMessage.model_construct(role="assistant" if role else None,
                                                     content=text)
                body = ChatCompletionChunk.model_construct(choices=[
                    ChatChunkChoice.model_construct(index=index, delta=delta,
                                                    finish_reason=finish_reason,
                                                    logprobs=logprobs)],
                    **common)
            else:
                body = CompletionResponse.model_construct(choices=[
                    CompletionChoice.model_construct(index=index, text=text,
                                                     finish_reason=finish_reason,
                                                     logprobs=logprobs)],
                    **common)
            return _sse(body.model_dump_json())

        def usage_of(index: int) -> Usage | None:
            if not continuous_usage:
                return None
            return Usage.of(generation.prompt_tokens_of(index), completion_tokens[index])

        opening = []
        for index in range(count):
            if chat:
                opening.append(event(index, "", None, DsparkExtras.model_construct(token_ids=[]),
                                     usage_of(index), role=True))
            elif generation.echo:
                opening.append(event(index, generation.echo_of(index), None,
                                     DsparkExtras.model_construct(token_ids=[]),
                                     usage_of(index)))
        if opening:
            yield b"".join(opening)
        async for index, batch in _merged(generation.streams, stop):
            events = []
            for piece in batch:
                if piece.chunk.error:
                    events.append(_sse(ErrorResponse(error={
                        "message": f"generation failed: {piece.chunk.error}",
                        "type": "service_unavailable", "code": 503}).model_dump_json()))
                    yield b"".join(events)
                    yield _sse("[DONE]")
                    return
                completion_tokens[index] = piece.chunk.completion_tokens
                extras = DsparkExtras.model_construct(token_ids=piece.token_ids)
                if piece.finish_reason is not None:
                    extras.spec_decode = _spec_metrics(piece.chunk)
                logprobs, asked = None, piece.logprobs()
                if asked is not None:  # the logprobs of this chunk's tokens
                    token_ids, values = asked
                    if chat:
                        logprobs = chat_logprobs(values, token_ids, self.token_strings)
                    else:
                        logprobs, text_offset[index] = completion_logprobs(
                            values, token_ids, self.token_strings, text_offset[index])
                events.append(event(index, piece.text, piece.finish_reason, extras,
                                    usage_of(index), logprobs=logprobs))
            yield b"".join(events)
        if include_usage:
            usage = Usage.of(sum(generation.prompt_tokens), sum(completion_tokens))
            cls = ChatCompletionChunk if chat else CompletionResponse
            yield _sse(cls.model_construct(id=request_id, created=created, model=model,
                                           choices=[], usage=usage, dspark=None
                                           ).model_dump_json())
        yield _sse("[DONE]")

    def stored(self, request_id: str, owner: str) -> StoredRequestView:
        g = self.gateway
        r = g.fetch(request_id, owner)
        return StoredRequestView(id=r.request_id, status=str(r.status),
                                 finish_reason=r.finish_reason or None,
                                 prompt_token_ids=r.prompt_ids, output_token_ids=r.output_ids,
                                 text=g.decode(r.output_ids), max_tokens=r.max_tokens,
                                 sampling=r.sampling, created=int(r.created))


def _json(model) -> Response:
    """A pydantic response serialized once (pydantic's own JSON encoder)."""
    return Response(model.model_dump_json(), media_type="application/json")


def build_app(gateway: Gateway, api_keys: ApiKeys, metrics: SchedulerMetrics,
              render_metrics: Callable[[], bytes], health: Callable[[], dict]) -> FastAPI:
    """The ASGI app of the REST API over `gateway`."""
    api = RestApi(gateway)
    app = FastAPI(title="DSpark Serve", version="1",
                  description="OpenAI-compatible completions and chat completions with "
                              "speculative decoding (DSpark).",
                  responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                             404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    _install_error_handlers(app)
    bearer = HTTPBearer(auto_error=False, description="An API key, when the server has some.")

    def caller(request: Request,
               _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
        """The fingerprint of the caller's key, which its requests are bound to ('' with
        authentication off); a 401 without a valid key. (`bearer` documents the scheme in the
        OpenAPI schema; the header is checked by ApiKeys, in constant time.)"""
        owner = api_keys.owner(request.headers.get("Authorization", ""))
        if owner is None:
            raise InvalidRequest("missing or invalid API key (Authorization: Bearer <key>)", 401)
        return owner

    authorized = [Depends(caller)]

    @app.get("/health", tags=["probes"])
    def health_route() -> dict[str, Any]:
        return health()

    @app.get("/metrics", tags=["probes"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics_route() -> Response:
        return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/ping", methods=["GET", "POST"], tags=["probes"], response_class=Response)
    def ping() -> Response:
        """vLLM's liveness probe: an empty 200."""
        return Response(status_code=200)

    @app.get("/version", tags=["probes"], response_model=VersionResponse)
    def version() -> VersionResponse:
        return VersionResponse(version=dspark.__version__)

    card = ModelCard(id=gateway.model_name, max_model_len=gateway.max_context_tokens)

    @app.get("/v1/models", dependencies=authorized, response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", dependencies=authorized, response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        if model_id != gateway.model_name:
            raise InvalidRequest("no such model; see GET /v1/models", status=404, param="model")
        return card

    @app.post("/tokenize", dependencies=authorized, response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize (the API key is needed, as on /v1)."""
        if body.model is not None:
            gateway.check_model(body.model)
        if body.messages is not None:
            ids = gateway.encode_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                      add_generation_prompt=body.add_generation_prompt
                                      is not False,
                                      add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = gateway.encode_text(body.prompt, body.add_special_tokens is not False)
        return TokenizeResponse(count=len(ids), max_model_len=gateway.max_context_tokens,
                                tokens=ids, token_strs=gateway.token_strings(ids)
                                if body.return_token_strs else None)

    @app.post("/detokenize", dependencies=authorized, response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids, special tokens kept."""
        if body.model is not None:
            gateway.check_model(body.model)
        return DetokenizeResponse(prompt=gateway.detokenize(body.tokens))

    @app.post("/v1/completions", dependencies=authorized,
              responses={200: {"model": CompletionResponse,
                               "content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request,
                          owner: str = Depends(caller)) -> Response:
        return await api.respond(api.start(body, owner), request, chat=False,
                                 streaming=bool(body.stream), stop=body.stop,
                                 include_usage=body.include_usage,
                                 continuous_usage=body.continuous_usage)

    @app.post("/v1/chat/completions", dependencies=authorized,
              responses={200: {"model": ChatCompletionResponse,
                               "content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               owner: str = Depends(caller)) -> Response:
        return await api.respond(api.start(body, owner), request, chat=True,
                                 streaming=bool(body.stream), stop=body.stop,
                                 include_usage=body.include_usage,
                                 continuous_usage=body.continuous_usage)

    @app.get("/v1/requests/{request_id}", dependencies=authorized,
             response_model=StoredRequestView)
    def stored_request(request_id: str, owner: str = Depends(caller)) -> StoredRequestView:
        _check_request_id(request_id)
        return api.stored(request_id, owner)

    @app.post("/v1/requests/{request_id}/resume", dependencies=authorized,
              responses={200: {"model": CompletionResponse,
                               "content": {"text/event-stream": {}}}})
    async def resume(request_id: str, request: Request, body: ResumeRequest | None = None,
                     owner: str = Depends(caller)) -> Response:
        _check_request_id(request_id)
        stream = await run_in_threadpool(gateway.resume, request_id, owner)  # reads the store
        generation = Generation([stream], [len(stream.prompt_ids)], 1, 1, [], False)
        return await api.respond(generation, request, chat=False,
                                 streaming=bool(body and body.stream), stop=[],
                                 include_usage=False)

    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(ResponseCounter, metrics=metrics)
    return app


def _check_request_id(request_id: str) -> None:
    if not REQUEST_ID.match(request_id):
        # What an unknown or another key's id answers (Gateway.fetch): the id is never echoed.
        raise InvalidRequest("no such request", status=404, param="request_id")


class RestServer:
    """The app on uvicorn in a thread of this process (the engine loop and gRPC run beside it)."""

    def __init__(self, app: FastAPI, host: str, port: int,
                 limits: ServerLimits = ServerLimits()) -> None:
        # Bound here, so the port is known (port 0 = any free one) before the thread starts.
        self._socket = socket.create_server((host, port), backlog=limits.backlog)
        self.port: int = self._socket.getsockname()[1]
        # loop="asyncio", not uvloop: the stdlib transport's socket writes release the GIL, so
        # the engine loop's thread runs during them (tiny-model bench, 16 / 64 streams: 0.80 /
        # 0.86x the old gateway's throughput on uvloop, 0.94 / 1.06x on asyncio, back-to-back runs).
        self._server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", loop="asyncio",
            limit_concurrency=limits.max_connections,
            timeout_keep_alive=limits.keep_alive_seconds, backlog=limits.backlog,
            # The engine loop has drained its requests before `stop`: whatever is still open
            # gets this long.
            timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                         name="rest", daemon=True)

    def start(self) -> "RestServer":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()
