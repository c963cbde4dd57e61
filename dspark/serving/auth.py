"""Secrets of the service stack: client API keys (the scheduler's public APIs) and the shared
internal token (scheduler -> verifier / drafter).

- Keys are compared in constant time (`hmac.compare_digest` against every configured key, no
  early exit), so response timing says nothing about how much of a guess was right.
- A request is bound to the key that made it by the key's *fingerprint* (a SHA-256 prefix), so
  the store never holds a key, and another key's GET / resume of that request is a 404.
- Secrets come from the environment or a file, never from a command line (visible to every user
  in `ps`) or from `--help` defaults.
- The internal services accept a call only with `x-dspark-internal-token: <token>` metadata
  (health checks excepted); the scheduler's channels add it to every call.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

INTERNAL_TOKEN_METADATA = "x-dspark-internal-token"
_HEALTH_PREFIX = "/grpc.health."


def read_secret_file(path: str) -> str:
    """A secret file's text without surrounding whitespace ('' for no path)."""
    return Path(path).read_text().strip() if path else ""


def parse_keys(text: str) -> frozenset[str]:
    """Keys separated by commas or newlines (a keys file has one a line; '#' starts a comment)."""
    keys = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        keys.update(k.strip() for k in line.split(",") if k.strip())
    return frozenset(keys)


def fingerprint(key: str) -> str:
    """What a stored request records of the key that made it (not the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class ApiKeys:
    """The accepted Bearer keys; empty = authentication off (every caller is the same owner '')."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in sorted(keys)]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def owner(self, authorization: str) -> str | None:
        """The caller's fingerprint from an `Authorization: Bearer <key>` value; None when the key
        is missing or unknown ('' when authentication is off)."""
        if not self._digests:
            return ""
        if not authorization.startswith("Bearer "):
            return None
        key = authorization[len("Bearer "):].strip()
        digest = hashlib.sha256(key.encode()).digest()
        matched = False
        for known in self._digests:  # every key compared: the time does not depend on which
            matched |= hmac.compare_digest(digest, known)
        return fingerprint(key) if matched else None


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                               hashlib.sha256(token.encode()).digest())


def deny_handler(handler, code: grpc.StatusCode, message: str):
    """A method handler of `handler`'s kind that aborts every call with `code`."""

    def deny(request, context):
        context.abort(code, message)

    deserializer = handler.request_deserializer if handler is not None else None
    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, request_deserializer=deserializer)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, request_deserializer=deserializer)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, request_deserializer=deserializer)
    return grpc.unary_unary_rpc_method_handler(deny, request_deserializer=deserializer)


class InternalTokenInterceptor(grpc.ServerInterceptor):
    """The verifier's and drafter's gate: calls without the shared token are UNAUTHENTICATED.
    An empty token turns the check off (a stack on loopback started without one)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if not self.token or handler_call_details.method.startswith(_HEALTH_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if token_matches(str(metadata.get(INTERNAL_TOKEN_METADATA, "")), self.token):
            return handler
        return deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                            "missing or invalid internal token")


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the internal token to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _with_token(self, details):
        metadata = list(details.metadata or []) + [(INTERNAL_TOKEN_METADATA, self.token)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (credentials, wait_for_ready,
                                                                   compression)


def with_internal_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """The channel, sending the internal token on every call (unchanged when there is none)."""
    return grpc.intercept_channel(channel, _TokenMetadata(token)) if token else channel
