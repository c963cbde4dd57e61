"""The OpenAI-compatible REST API, on the standard library's threading HTTP server.

Routes: POST /v1/completions, POST /v1/chat/completions (`stream: true` -> server-sent events,
chunked), GET /v1/models, GET /v1/requests/{id} and POST /v1/requests/{id}/resume (stored request
state, see dspark.serving.store), GET /health, GET /metrics (Prometheus text). With API keys
configured every /v1 route needs `Authorization: Bearer <key>` (401 otherwise); /health and
/metrics stay open for probes and scrapers. Errors use OpenAI's body:
`{"error": {"message", "type", "param", "code"}}`, 4xx for anything the client got wrong.

A client that goes away has its request aborted and its caches freed at once: a streaming one is
noticed on the next write, a non-streaming one by polling its socket while it waits.
"""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from dspark.serving.auth import ApiKeys
from services.scheduler.gateway import Chunk, Gateway, GenerationStream, InvalidRequest, Overloaded

MAX_BODY_BYTES = 8 * 1024 * 1024
# A non-streaming request checks this often whether its client is still connected.
DISCONNECT_POLL_SECONDS = 0.25
_REQUEST_PATH = re.compile(r"^/v1/requests/([A-Za-z0-9._:-]+)(/resume)?$")


def _spec_metrics(chunk: Chunk) -> dict[str, Any] | None:
    m = chunk.metrics
    if m is None:
        return None
    return {"rounds": m.rounds, "drafts_verified": m.drafts_verified,
            "drafts_accepted": m.drafts_accepted, "acceptance_length": round(m.tau, 4),
            "accepted_per_position": list(m.accepted_per_position)}


class RestServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    """Listen backlog. socketserver's default of 5 is too small when many clients connect at once,
    e.g. a load test starting 16 users."""

    def __init__(self, address: tuple[str, int], gateway: Gateway, api_keys: ApiKeys,
                 render_metrics: Callable[[], str], health: Callable[[], dict]) -> None:
        super().__init__(address, RestHandler)
        self.gateway = gateway
        self.api_keys = api_keys
        self.render_metrics = render_metrics
        self.health = health

    def handle_error(self, request, client_address) -> None:
        """A client that drops its connection (a load test stopping, a closed browser tab) is
        normal; socketserver would print a traceback for it. Anything else still prints one."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class RestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RestServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the loop logs what matters
        pass

    # -- plumbing ---------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: InvalidRequest) -> None:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}.get(error.status,
                                                                     "invalid_request_error")
        headers = ({"Retry-After": str(error.retry_after_seconds)}
                   if isinstance(error, Overloaded) else None)
        self._send_json(error.status, {"error": {"message": error.message, "type": kind,
                                                 "param": error.param, "code": error.status}},
                        headers)

    def _check_auth(self) -> None:
        """Sets self._owner, the caller's key fingerprint that its requests are bound to."""
        owner = self.server.api_keys.owner(self.headers.get("Authorization", ""))
        if owner is None:
            raise InvalidRequest("missing or invalid API key (Authorization: Bearer <key>)", 401)
        self._owner = owner

    def _read_json(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._body_read, self.close_connection = True, True
            raise InvalidRequest("a JSON body with Content-Length is required", 411)
        if length > MAX_BODY_BYTES:
            self._body_read, self.close_connection = True, True
            raise InvalidRequest(f"body larger than {MAX_BODY_BYTES} bytes", 413)
        raw = self.rfile.read(length)
        self._body_read = True
        try:
            body = json.loads(raw)
        except RecursionError:
            raise InvalidRequest("invalid JSON body: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
            raise InvalidRequest(f"invalid JSON body: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the JSON body must be an object")
        return body

    def _dispatch(self, routes: dict[str, Callable[[], None]]) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path in routes:
                routes[path]()
                return
            match = _REQUEST_PATH.match(path)
            if match and (self.command == "GET") == (match.group(2) is None):
                self._check_auth()
                if match.group(2):
                    self._resume(match.group(1))
                else:
                    self._fetch(match.group(1))
                return
            raise InvalidRequest(f"no route {self.command} {path}", 404)
        except InvalidRequest as e:
            self._drain_body()
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:  # a bug: a 500 with a body, the traceback only in the log
            logging.getLogger("dspark.scheduler").exception("unexpected error on %s", path)
            self.close_connection = True
            try:
                self._send_error(InvalidRequest("internal server error", 500))
            except OSError:
                pass

    def _drain_body(self) -> None:
        """Read an unread body so the connection stays usable for the next request."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        if 0 < length <= MAX_BODY_BYTES and not getattr(self, "_body_read", False):
            self.rfile.read(length)
        self._body_read = True

    def do_GET(self) -> None:
        self._body_read = True
        self._dispatch({"/health": self._health, "/metrics": self._metrics,
                        "/v1/models": self._models})

    def do_POST(self) -> None:
        self._body_read = False
        self._dispatch({"/v1/completions": self._completions,
                        "/v1/chat/completions": self._chat_completions})

    # -- routes -----------------------------------------------------------------------------
    def _health(self) -> None:
        self._send_json(200, self.server.health())

    def _metrics(self) -> None:
        data = self.server.render_metrics().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _models(self) -> None:
        self._check_auth()
        g = self.server.gateway
        self._send_json(200, {"object": "list", "data": [{
            "id": g.model_name, "object": "model", "created": 0, "owned_by": "dspark",
            "max_model_len": g.max_context_tokens}]})

    def _common(self, body: dict) -> dict:
        g = self.server.gateway
        g.check_model(body.get("model"))
        if body.get("n", 1) != 1:
            raise InvalidRequest("only n = 1 is supported", param="n")
        if body.get("stop") not in (None, [], ""):
            raise InvalidRequest("stop strings are not supported", param="stop")
        if not isinstance(body.get("stream", False), bool):
            raise InvalidRequest("stream must be a boolean", param="stream")
        return {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "top_k": body.get("top_k", 0), "seed": body.get("seed"),
                "max_tokens": body.get("max_tokens", body.get("max_completion_tokens", 16))}

    def _completions(self) -> None:
        self._check_auth()
        body = self._read_json()
        self._body_read = True
        g = self.server.gateway
        params = self._common(body)
        if "prompt" not in body:
            raise InvalidRequest("'prompt' is required", param="prompt")
        spec = g.spec(g.encode_prompt(body["prompt"]), **params)
        stream = g.start(spec, g.new_request_id("cmpl"), self._owner)
        self._respond(stream, chat=False, streaming=body.get("stream", False))

    def _chat_completions(self) -> None:
        self._check_auth()
        body = self._read_json()
        self._body_read = True
        g = self.server.gateway
        params = self._common(body)
        if "messages" not in body:
            raise InvalidRequest("'messages' is required", param="messages")
        spec = g.spec(g.encode_chat(body["messages"]), **params)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):  # checked before starting: nobody would read it
            raise InvalidRequest("stream_options must be an object", param="stream_options")
        include_usage = bool(options.get("include_usage", False))
        stream = g.start(spec, g.new_request_id("chatcmpl"), self._owner)
        self._respond(stream, chat=True, streaming=body.get("stream", False),
                      include_usage=include_usage)

    def _fetch(self, request_id: str) -> None:
        g = self.server.gateway
        r = g.fetch(request_id, self._owner)
        self._send_json(200, {"id": r.request_id, "object": "dspark.request", "status": r.status,
                              "finish_reason": r.finish_reason or None,
                              "prompt_token_ids": r.prompt_ids, "output_token_ids": r.output_ids,
                              "text": g.decode(r.output_ids), "max_tokens": r.max_tokens,
                              "sampling": r.sampling, "created": int(r.created)})

    def _resume(self, request_id: str) -> None:
        body = self._read_json() if self.headers.get("Content-Length") not in (None, "0") else {}
        self._body_read = True
        stream = self.server.gateway.resume(request_id, self._owner)
        self._respond(stream, chat=False, streaming=bool(body.get("stream", False)))

    def _client_gone(self) -> bool:
        """True when the client closed its connection (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # -- responses --------------------------------------------------------------------------
    def _respond(self, stream: GenerationStream, chat: bool, streaming: bool,
                 include_usage: bool = False) -> None:
        if streaming:
            self._respond_sse(stream, chat, include_usage)
            return
        text, last = "", None
        while not stream.finished:
            chunk = stream.next_chunk(timeout=DISCONNECT_POLL_SECONDS)
            if chunk is None:
                if self._client_gone():
                    stream.cancel()  # nobody will read the answer: free the caches now
                    self.close_connection = True
                    return
                continue
            text += chunk.text
            last = chunk
        if last is not None and last.error:
            raise InvalidRequest(f"generation failed: {last.error}", 503)
        g = self.server.gateway
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._send_json(200, {
            "id": stream.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": g.model_name, "choices": [choice],
            "usage": {"prompt_tokens": last.prompt_tokens,
                      "completion_tokens": last.completion_tokens,
                      "total_tokens": last.prompt_tokens + last.completion_tokens},
            "dspark": {"token_ids": stream.output_ids, "spec_decode": _spec_metrics(last)}})

    def _respond_sse(self, stream: GenerationStream, chat: bool, include_usage: bool) -> None:
        g = self.server.gateway
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        def envelope(choice: dict, **extra) -> dict:
            return {"id": stream.request_id, "object": kind, "created": created,
                    "model": g.model_name, "choices": [choice], **extra}

        try:
            if chat:
                event(envelope({"index": 0, "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None}))
            for chunk in stream:
                if chunk.error:
                    event({"error": {"message": f"generation failed: {chunk.error}",
                                     "type": "service_unavailable", "code": 503}})
                    break
                piece = {"content": chunk.text} if chat else None
                choice = ({"index": 0, "delta": piece} if chat else
                          {"index": 0, "text": chunk.text, "logprobs": None})
                choice["finish_reason"] = chunk.finish_reason if chunk.finished else None
                extra = {"dspark": {"token_ids": chunk.token_ids}}
                if chunk.finished:
                    extra["dspark"]["spec_decode"] = _spec_metrics(chunk)
                    if include_usage or not chat:
                        extra["usage"] = {"prompt_tokens": chunk.prompt_tokens,
                                          "completion_tokens": chunk.completion_tokens,
                                          "total_tokens": chunk.prompt_tokens + chunk.completion_tokens}
                event(envelope(choice, **extra))
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            stream.cancel()  # the client is gone: free its caches now
            self.close_connection = True
