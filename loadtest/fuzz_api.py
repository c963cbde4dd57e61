"""Fuzz the public APIs (OpenAI REST and gRPC Generation) with generated requests.

Every answer must be a 2xx (a complete completion, or a server-sent-event stream that ends with
`[DONE]`) or a 4xx with OpenAI's error body `{"error": {"message", "type", "param", "code"}}`;
gRPC calls either stream to a finished reply or end with a client-error status. Never a 5xx, a
dropped connection, an INTERNAL/UNKNOWN status or a hang. Meanwhile a normal streaming request
runs again and again, and each run must produce exactly the tokens it produces alone.

Bodies mix plausible requests (so that some generate) with what a careless or hostile client
sends: Infinity/NaN, integers of thousands of digits, numbers beyond int32/int64, wrong types,
lone surrogates, deep nesting, invalid JSON, unknown fields, non-object `stream_options`.

    .venv/bin/python -m loadtest.fuzz_api --bodies 5000 --grpc-requests 2000

starts the tiny test stack (random tiny target, untrained drafter) with an API key, runs the
fuzz, prints a table of outcomes and ends with one JSON line. The suite runs a few hundred of
each (tests/services/test_fuzz_api.py).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import math
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc

# A generated request must be answered within this (the tiny stack answers in well under 1 s;
# a hang would be caught here instead of blocking the run).
ANSWER_TIMEOUT_SECONDS = 60.0
# gRPC codes a client error may end with (UNAVAILABLE/INTERNAL/UNKNOWN/DEADLINE_EXCEEDED never).
CLIENT_ERROR_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE}

# -- generated requests ---------------------------------------------------------------------------
_words = st.lists(st.sampled_from([f"t{i}" for i in range(64)]), min_size=1, max_size=8)
_text = st.one_of(_words.map(" ".join), st.text(max_size=40),
                  st.sampled_from(["\ud800", "t3 \udfff t4", "", " ", "\x00", "t1" * 300]))
_huge = st.sampled_from([2**31, 2**63, -2**63 - 1, 10**30, 10**400, -(10**400)])
_number = st.one_of(st.integers(-5, 70), st.floats(allow_nan=True, allow_infinity=True),
                    st.integers(-2**70, 2**70), _huge, st.sampled_from([0, 1, 0.5, 1e-40, 1e-45]))
_junk = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
                  st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_value = st.one_of(_number, _junk)
_token_ids = st.lists(st.one_of(st.integers(0, 63), st.integers(-2**65, 2**65)), max_size=10)
_prompt = st.one_of(_text, _token_ids, st.lists(_text, max_size=2), st.lists(_token_ids, max_size=2),
                    _junk)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", 3]),
                           "content": st.one_of(_text, _junk)}), _junk)


_valid_prompt = st.one_of(_words.map(" ".join), st.lists(st.integers(0, 63), min_size=1,
                                                           max_size=8))
_valid_field = {"temperature": st.sampled_from([0, 0.0, 0.7, 1.0, 1e-40]),
                "top_p": st.sampled_from([1.0, 0.9]), "top_k": st.sampled_from([0, 5, 2**31 - 1]),
                "seed": st.integers(-2**63, 2**63 - 1), "stream": st.booleans(),
                "stream_options": st.just({"include_usage": True}), "n": st.just(1)}


@st.composite
def rest_body(draw) -> dict:
    """A JSON object for /v1/completions or /v1/chat/completions: two in five plausible (they
    generate), the others with fields replaced, removed or added."""
    chat = draw(st.booleans())
    body: dict = {"model": "tiny", "max_tokens": draw(st.integers(1, 8))}
    if chat:
        body["messages"] = [{"role": "user", "content": draw(_words.map(" ".join))}]
    else:
        body["prompt"] = draw(_valid_prompt)
    for name, strategy in _valid_field.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    if draw(st.integers(0, 4)) < 2:
        return body
    body["model"] = draw(st.sampled_from(["tiny", "tiny", "other", "", None]))
    if chat:
        body["messages"] = draw(st.one_of(st.lists(_message, max_size=3), _junk))
    else:
        body["prompt"] = draw(_prompt)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                 "stream_options", "max_completion_tokens", "unknown_field"):
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(_value)
    for name in draw(st.lists(st.sampled_from(list(body)), max_size=2)):
        body.pop(name, None)
    return body


def _deep(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


RAW_BODIES = [b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe", b'{"model": "tiny"', _deep(100),
              _deep(100_000), b'{"model": "tiny", "prompt": "t1", "max_tokens": ' + b"9" * 5000 + b"}",
              b'{"model": "tiny", "prompt": "t1", "max_tokens": Infinity}',
              b'{"model": "tiny", "prompt": "t1", "max_tokens": NaN}',
              b'{"model": "tiny", "prompt": "\\ud800 t2", "max_tokens": 2}',
              b'{"model": "tiny", "messages": [{"role": "user", "content": "t1"}], '
              b'"stream": true, "stream_options": [1], "max_tokens": 2}']


@st.composite
def rest_call(draw) -> tuple[str, str, bytes]:
    """(method, path, body bytes)."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return "POST", draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"])), \
            draw(st.sampled_from(RAW_BODIES))
    if kind == 1:
        rid = draw(st.one_of(st.text("abcdef0123456789-", max_size=40),
                             st.just("cmpl-" + "0" * 32)))
        method = draw(st.sampled_from(["GET", "POST"]))
        path = f"/v1/requests/{rid}" + ("/resume" if method == "POST" else "")
        return method, path, b"" if method == "GET" else b"{}"
    body = draw(rest_body())
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return "POST", path, json.dumps(body).encode()  # Infinity/NaN written as JSON5 literals


@st.composite
def grpc_request(draw) -> "pb.generation.GenerateRequest":
    request = pb.generation.GenerateRequest(
        model=draw(st.sampled_from(["tiny", "tiny", "other", ""])),
        max_tokens=draw(st.one_of(st.integers(0, 8), st.integers(-2**31, 2**31 - 1))))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        request.prompt = draw(_words.map(" ".join) | st.text(max_size=20))
    elif kind == 1:
        request.prompt_token_ids.extend(draw(st.lists(
            st.one_of(st.integers(0, 63), st.integers(-2**63, 2**63 - 1)), max_size=8)))
    elif kind == 2:
        for _ in range(draw(st.integers(0, 3))):
            request.messages.add(role=draw(st.sampled_from(["user", "system", "x", ""])),
                                 content=draw(_words.map(" ".join) | st.text(max_size=10)))
    else:
        request.resume_request_id = draw(st.text(max_size=40))
    if draw(st.booleans()):
        s = request.sampling
        s.temperature = draw(st.floats(allow_nan=True, allow_infinity=True))
        s.top_p = draw(st.floats(allow_nan=True, allow_infinity=True))
        s.top_k = draw(st.integers(-2**31, 2**31 - 1))
        if draw(st.booleans()):
            s.seed = draw(st.integers(-2**63, 2**63 - 1))
    for name in ("n", "best_of"):  # samples: mostly few, sometimes any int32
        if draw(st.integers(0, 3)) == 0:
            setattr(request, name, draw(st.one_of(st.integers(0, 3),
                                                  st.integers(-2**31, 2**31 - 1))))
    return request


# -- answers --------------------------------------------------------------------------------------
def check_rest(port: int, key: str, method: str, path: str, body: bytes) -> str:
    """Send one request; raise AssertionError unless the answer is a valid 2xx or 4xx. Returns
    the outcome class ('200', '200 stream', '400', ...)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=ANSWER_TIMEOUT_SECONDS)
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        conn.request(method, path, body=body if method == "POST" else None, headers=headers)
        response = conn.getresponse()
        data = response.read()
        kind = response.getheader("Content-Type", "")
    finally:
        conn.close()
    status = response.status
    assert 200 <= status < 500, (status, path, body[:200], data[:500])
    if status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), data
        assert "Traceback" not in error["message"]
        assert set(error) >= {"message", "type", "param", "code"}, data
        return str(status)
    if kind.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", data[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
        return f"{status} stream"
    json.loads(data)
    return str(status)


def check_grpc(stub, key: str, request) -> str:
    try:
        replies = list(stub.Generate(request, metadata=[("authorization", f"Bearer {key}")],
                                     timeout=ANSWER_TIMEOUT_SECONDS))
    except grpc.RpcError as e:
        assert e.code() in CLIENT_ERROR_CODES, (e.code(), e.details(), request)
        assert "Traceback" not in (e.details() or "")
        return e.code().name
    assert replies and replies[-1].finished, request
    finished = sorted(r.index for r in replies if r.finished)  # one per choice, 0..n-1
    assert finished == list(range(len(finished))), (finished, request)
    return "OK"


@dataclass
class Witness:
    """A normal streaming request, repeated while the fuzz runs; each run must equal `expected`."""

    port: int
    key: str
    prompt: list[int]
    max_tokens: int
    expected: list[int] | None = None
    runs: int = 0
    mismatches: list[list[int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def once(self) -> list[int]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_TIMEOUT_SECONDS)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens,
             "temperature": 0, "stream": True}),
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.status
        tokens = []
        for line in response:
            if line.startswith(b"data: {"):
                tokens += json.loads(line[6:])["dspark"]["token_ids"]
        conn.close()
        return tokens

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                tokens = self.once()
            except Exception as e:  # recorded and reported: the run fails on it
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            self.runs += 1
            if tokens != self.expected:
                self.mismatches.append(tokens)

    def __enter__(self) -> "Witness":
        if self.expected is None:
            self.expected = self.once()  # alone: nothing else runs yet
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(ANSWER_TIMEOUT_SECONDS * 2)


def fuzz(http_port: int, grpc_port: int, key: str, bodies: int, grpc_requests: int,
         seed: int = 0) -> dict[str, collections.Counter]:
    """Run the fuzz (raising AssertionError on the first bad answer); outcome counts per API."""
    counts = {"rest": collections.Counter(), "grpc": collections.Counter()}
    common = dict(deadline=None, database=None, derandomize=seed == 0,
                  suppress_health_check=list(HealthCheck))

    @settings(max_examples=bodies, **common)
    @given(call=rest_call())
    def rest(call):
        counts["rest"][check_rest(http_port, key, *call)] += 1

    stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{grpc_port}"))

    @settings(max_examples=grpc_requests, **common)
    @given(request=grpc_request())
    def grpc_api(request):
        counts["grpc"][check_grpc(stub, key, request)] += 1

    if bodies:
        rest()
    if grpc_requests:
        grpc_api()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.fuzz_api", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bodies", type=int, default=5000, help="REST requests to generate")
    parser.add_argument("--grpc-requests", type=int, default=2000)
    parser.add_argument("--work", default="", help="folder for the tiny models and logs")
    args = parser.parse_args(argv)
    import os

    from loadtest.stack import start_stack, tiny_models

    work = Path(args.work or tempfile.mkdtemp(prefix="dspark-fuzz-"))
    key = "fuzz-key-0123456789"
    os.environ["DSPARK_SCHEDULER_API_KEYS"] = key  # inherited by the scheduler, never argv
    stack = start_stack(tiny_models(work / "models"), "async_topk", work / "logs",
                        extra_scheduler_args=("--max-tokens-limit", "64"))
    start = time.monotonic()
    try:
        with Witness(stack.http_port, key, [3, 9, 27, 17], 48) as witness:
            counts = fuzz(stack.http_port, stack.grpc_port, key, args.bodies, args.grpc_requests)
    finally:
        stack.stop()
    seconds = time.monotonic() - start
    print(f"{'api':6} {'outcome':22} {'count':>7}")
    for api, counter in counts.items():
        for outcome, n in sorted(counter.items()):
            print(f"{api:6} {outcome:22} {n:7d}")
    print(f"witness: {witness.runs} streamed runs, {len(witness.mismatches)} differing from the "
          f"solo output, {len(witness.errors)} errors")
    summary = {"rest_bodies": sum(counts["rest"].values()),
               "grpc_requests": sum(counts["grpc"].values()),
               "rest": dict(counts["rest"]), "grpc": dict(counts["grpc"]),
               "server_errors": sum(n for o, n in counts["rest"].items() if o.startswith("5")),
               "witness_runs": witness.runs, "witness_mismatches": len(witness.mismatches),
               "witness_errors": len(witness.errors), "seconds": round(seconds, 1)}
    print(json.dumps(summary))
    return 0 if not witness.mismatches and not witness.errors else 1


if __name__ == "__main__":
    sys.exit(main())
