"""Faults on real processes: a drafter killed mid-stream, a verifier restarted mid-stream, a client
that disconnects, a scheduler killed and restarted with Redis.

To make "mid-stream" deterministic, the shared verifier is frozen with SIGSTOP right after the
client has its first tokens (so the request cannot finish meanwhile), the fault is injected, and
SIGCONT lets the stream go on.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import time
import uuid

import openai

from dspark.serving.grpc_runtime import channel
from dspark.serving.local_stack import free_port, wait_grpc, wait_http
from dspark.serving.protos import pb, rpc

PROMPT = [3, 9, 27, 17]
MAX_TOKENS = 60


@contextlib.contextmanager
def frozen(service):
    """The service process is stopped (SIGSTOP) inside the block."""
    service.process.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        service.process.proc.send_signal(signal.SIGCONT)


def client(port: int, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0,
                         timeout=120)


def metric(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise KeyError(name)


def stream_tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.model_extra["dspark"]["token_ids"]]


def test_drafter_killed_mid_stream_then_back(launcher, shared_verifier, embedded_greedy):
    port = free_port()
    drafter, drafter_address = launcher.drafter("drafter_faulty", port=port)
    scheduler, http_port, _ = launcher.scheduler(shared_verifier.address, drafter_address,
                                                 name="scheduler_drafter_fault")
    try:
        wait_grpc(drafter, drafter_address)
        wait_http(scheduler, http_port)
        expected = embedded_greedy(PROMPT, MAX_TOKENS)
        stream = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                      max_tokens=MAX_TOKENS, temperature=0,
                                                      stream=True)
        first = next(iter(stream))
        tokens = list(first.model_extra["dspark"]["token_ids"])
        with frozen(shared_verifier):
            drafter.stop(signal.SIGKILL)
        tokens += stream_tokens(stream)
        assert tokens == expected  # completed, and exact, without a drafter
        assert metric(http_port, "dspark:spec_decode_drafter_available") == 0
        assert metric(http_port, "dspark:spec_decode_fallback_rounds_total") > 0

        # The drafter comes back on its address: speculation resumes, output still exact. The
        # scheduler tries the drafter again when a round drafts (at most every 0.3 s here), and
        # while it was down its fallback drafts backed the probes off (up to 64 rounds apart,
        # DraftingGateConfig.max_probe_interval), so the first request after it may decode
        # plainly to its end: requests until one finds it, each exact.
        drafter, _ = launcher.drafter("drafter_faulty_again", port=port)
        wait_grpc(drafter, drafter_address)
        verified_before = metric(http_port, "dspark:spec_decode_num_draft_tokens_total")
        time.sleep(0.5)  # past the scheduler's retry interval (0.3 s)
        for _ in range(8):  # 8 x 60 tokens: past the longest probe interval
            out = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                       max_tokens=MAX_TOKENS, temperature=0)
            assert out.model_extra["dspark"]["token_ids"] == expected
            if metric(http_port, "dspark:spec_decode_drafter_available") == 1:
                break
        assert metric(http_port, "dspark:spec_decode_drafter_available") == 1
        out = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                   max_tokens=MAX_TOKENS, temperature=0)
        assert out.model_extra["dspark"]["token_ids"] == expected
        assert metric(http_port, "dspark:spec_decode_num_draft_tokens_total") > verified_before
    finally:
        scheduler.stop()
        drafter.stop()


def test_slow_drafter_times_out_then_resyncs(launcher, shared_verifier, embedded_greedy):
    """A drafter that stops answering (frozen, not dead) past the draft timeout: rounds fall back
    to plain decoding; when it answers again the scheduler opens a new stream, resends every
    live request's context with `reset`, and speculates again; output exact throughout."""
    drafter, drafter_address = launcher.drafter("drafter_slow")
    scheduler, http_port, _ = launcher.scheduler(shared_verifier.address, drafter_address,
                                                 name="scheduler_slow_drafter",
                                                 extra=("--draft-timeout-seconds", "0.5"))
    try:
        wait_grpc(drafter, drafter_address)
        wait_http(scheduler, http_port)
        stream = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                      max_tokens=MAX_TOKENS, temperature=0,
                                                      stream=True)
        chunks = iter(stream)
        tokens = list(next(chunks).model_extra["dspark"]["token_ids"])
        drafter.proc.send_signal(signal.SIGSTOP)
        tokens += next(chunks).model_extra["dspark"]["token_ids"]  # progress without a drafter
        time.sleep(1.0)
        drafter.proc.send_signal(signal.SIGCONT)
        tokens += stream_tokens(stream)
        assert tokens == embedded_greedy(PROMPT, MAX_TOKENS)
        assert metric(http_port, "dspark:spec_decode_fallback_rounds_total") > 0
        verified_before = metric(http_port, "dspark:spec_decode_num_draft_tokens_total")
        out = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                   max_tokens=MAX_TOKENS, temperature=0)
        assert out.model_extra["dspark"]["token_ids"] == embedded_greedy(PROMPT, MAX_TOKENS)
        assert metric(http_port, "dspark:spec_decode_drafter_available") == 1
        assert metric(http_port, "dspark:spec_decode_num_draft_tokens_total") > verified_before
    finally:
        drafter.proc.send_signal(signal.SIGCONT)
        scheduler.stop()
        drafter.stop()


def test_verifier_restarted_mid_stream(launcher, stack, embedded_greedy):
    verifier, verifier_address = launcher.verifier("verifier_restarting")
    wait_grpc(verifier, verifier_address)
    port = verifier_address.rsplit(":", 1)[1]
    scheduler, http_port, _ = launcher.scheduler(verifier_address, stack.drafter_address,
                                                 name="scheduler_verifier_fault")
    try:
        wait_http(scheduler, http_port)
        stream = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                      max_tokens=MAX_TOKENS, temperature=0,
                                                      stream=True)
        tokens = list(next(iter(stream)).model_extra["dspark"]["token_ids"])
        verifier.proc.send_signal(signal.SIGSTOP)  # freeze first: the request cannot finish
        verifier.stop(signal.SIGKILL)
        verifier, _ = launcher.verifier("verifier_restarted", port=int(port))
        tokens += stream_tokens(stream)
        assert tokens == embedded_greedy(PROMPT, MAX_TOKENS)
        assert metric(http_port, "dspark:verifier_restores_total") >= 1
    finally:
        scheduler.stop()
        verifier.stop()


def test_client_disconnect_frees_caches(stack, shared_verifier):
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True}), {"Content-Type": "application/json",
                           "Authorization": f"Bearer {stack.api_key}"})
    response = conn.getresponse()
    line = b""
    while not line.startswith(b"data: "):
        line = response.fp.readline()
    request_id = json.loads(line[len(b"data: "):])["id"]
    with frozen(shared_verifier):
        conn.sock.close()
        conn.close()
    wait_until_released(shared_verifier.address, request_id)
    record = fetch(stack.http_port, request_id, stack.api_key)
    assert record["finish_reason"] == "abort" and len(record["output_token_ids"]) < MAX_TOKENS


def wait_until_released(verifier_address: str, request_id: str, seconds: float = 30) -> None:
    """Until the verifier no longer holds the request (its KV cache given back)."""
    verifier = rpc.verifier.VerifierStub(channel(verifier_address))
    deadline = time.monotonic() + seconds
    while request_id in verifier.Info(pb.common.InfoRequest()).active_requests:
        assert time.monotonic() < deadline, f"the verifier still holds {request_id}"
        time.sleep(0.1)


def fetch(port: int, request_id: str, key: str = "none") -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", f"/v1/requests/{request_id}", headers={"Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 200, body
    return body


def post_json(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    reply = json.loads(response.read())
    conn.close()
    assert response.status == 200, reply
    return reply


def test_scheduler_restart_with_redis_keeps_tokens(launcher, stack, shared_verifier, redis_url,
                                                   embedded_greedy):
    prefix = f"dspark-test-{uuid.uuid4().hex[:8]}:"
    extra = ("--redis-url", redis_url, "--redis-prefix", prefix)
    first, http_port, grpc_port = launcher.scheduler(shared_verifier.address, stack.drafter_address,
                                                     name="scheduler_before_restart", extra=extra)
    second = None
    try:
        wait_http(first, http_port)
        stream = client(http_port).completions.create(model="tiny", prompt=PROMPT,
                                                      max_tokens=MAX_TOKENS, temperature=0,
                                                      stream=True)
        chunks = iter(stream)
        chunk = next(chunks)
        request_id = chunk.id
        seen = list(chunk.model_extra["dspark"]["token_ids"])
        seen += next(chunks).model_extra["dspark"]["token_ids"]
        with frozen(shared_verifier):
            first.stop(signal.SIGKILL)
        stream.close()
        second, http_port, _ = launcher.scheduler(shared_verifier.address, stack.drafter_address,
                                                  name="scheduler_after_restart", extra=extra,
                                                  http_port=http_port, grpc_port=grpc_port)
        wait_http(second, http_port)
        expected = embedded_greedy(PROMPT, MAX_TOKENS)
        record = fetch(http_port, request_id)
        assert record["status"] == "interrupted"
        stored = record["output_token_ids"]
        assert stored[:len(seen)] == seen and len(stored) < MAX_TOKENS  # nothing produced is lost
        assert stored == expected[:len(stored)]
        resumed = post_json(http_port, f"/v1/requests/{request_id}/resume", {})
        assert resumed["dspark"]["token_ids"] == expected
        record = fetch(http_port, request_id)
        assert record["status"] == "finished" and record["output_token_ids"] == expected
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_grpc_client_cancel_frees_caches(stack, shared_verifier):
    stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{stack.grpc_port}"))
    call = stub.Generate(pb.generation.GenerateRequest(
        model="tiny", prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS,
        sampling=pb.common.SamplingParams(temperature=0.0)),
        metadata=[("authorization", f"Bearer {stack.api_key}")], timeout=60)
    request_id = next(call).request_id
    with frozen(shared_verifier):
        call.cancel()
    wait_until_released(shared_verifier.address, request_id)
    record = fetch(stack.http_port, request_id, stack.api_key)
    assert record["finish_reason"] == "abort" and len(record["output_token_ids"]) < MAX_TOKENS


def test_non_streaming_client_disconnect_frees_caches(stack, shared_verifier):
    verifier = rpc.verifier.VerifierStub(channel(shared_verifier.address))
    before = set(verifier.Info(pb.common.InfoRequest()).active_requests)
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {stack.api_key}"})
    deadline = time.monotonic() + 30
    while True:  # wait until the verifier holds it, then freeze the stack and hang up
        new = set(verifier.Info(pb.common.InfoRequest()).active_requests) - before
        if new:
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with frozen(shared_verifier):
        conn.sock.close()
        conn.close()
        time.sleep(1.0)  # the handler notices meanwhile (it polls every 0.25 s)
    (request_id,) = new
    while request_id in verifier.Info(pb.common.InfoRequest()).active_requests:
        assert time.monotonic() < deadline + 30, "the verifier still holds the abandoned request"
        time.sleep(0.1)
    record = fetch(stack.http_port, request_id, stack.api_key)
    assert record["finish_reason"] == "abort" and len(record["output_token_ids"]) < MAX_TOKENS
