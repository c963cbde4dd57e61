"""On real processes: a stack with an internal token and two API keys from a keys file.
- the verifier and the drafter refuse calls without the token (health checks excepted);
- no secret is on a command line or in --help;
- another key can neither read nor resume my request (REST and gRPC), and is told what an
  unknown id is told;
- beyond the waiting queue a request is refused (429 + Retry-After / RESOURCE_EXHAUSTED) while
  health answers at once, and the admitted requests complete with their solo greedy outputs;
  /metrics counts both refusals (dspark:num_requests_refused_total{reason="queue_full"}) and
  shows the verifier's KV cache in use while a request runs, back to 0 once it is done.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from dspark.serving.auth import INTERNAL_TOKEN_METADATA
from dspark.serving.grpc_runtime import channel
from dspark.serving.local_stack import REPO_ROOT, wait_grpc, wait_http
from dspark.serving.protos import pb, rpc

TOKEN = "internal-token-for-tests-0123456789"
ALICE, BOB = "alice-key-0123456789", "bob-key-9876543210"
PROMPT = [3, 9, 27, 17]


@pytest.fixture(scope="module")
def guarded(launcher, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(f"# API keys\n{ALICE}\n{BOB}\n")
    verifier, verifier_address = launcher.verifier(
        "verifier_guarded", env={"DSPARK_VERIFIER_INTERNAL_TOKEN": TOKEN})
    drafter, drafter_address = launcher.drafter(
        "drafter_guarded", env={"DSPARK_DRAFTER_INTERNAL_TOKEN": TOKEN})
    scheduler, http_port, grpc_port = launcher.scheduler(
        verifier_address, drafter_address, "scheduler_guarded",
        extra=("--max-running", "1", "--max-waiting", "1"),
        env={"DSPARK_SCHEDULER_INTERNAL_TOKEN": TOKEN,
             "DSPARK_SCHEDULER_API_KEYS_FILE": str(keys_file)})
    procs = [scheduler, drafter, verifier]
    try:
        wait_grpc(verifier, verifier_address)
        wait_grpc(drafter, drafter_address)
        wait_http(scheduler, http_port)
        yield {"verifier": verifier_address, "drafter": drafter_address, "http": http_port,
               "grpc": grpc_port, "processes": {p.name: p for p in procs}}
    finally:
        for p in procs:
            p.stop()


def request(port: int, method: str, path: str, body=None, key: str | None = ALICE,
            timeout: float = 120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, response.headers, json.loads(data) if data else None


def test_internal_services_refuse_calls_without_the_token(guarded):
    for address, stub_class in ((guarded["verifier"], rpc.verifier.VerifierStub),
                                (guarded["drafter"], rpc.drafter.DrafterStub)):
        for token in (None, "wrong-token"):
            stub = stub_class(channel(address, token or ""))
            with pytest.raises(grpc.RpcError) as e:
                stub.Info(pb.common.InfoRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub_class(channel(address, TOKEN)).Info(pb.common.InfoRequest(), timeout=30)
        health = health_pb2_grpc.HealthStub(channel(address)).Check(
            health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    verifier = rpc.verifier.VerifierStub(channel(guarded["verifier"]))
    for call, message in ((verifier.Release, pb.verifier.ReleaseRequest(request_ids=["x"])),
                          (verifier.Prefill, pb.verifier.PrefillRequest())):
        with pytest.raises(grpc.RpcError) as e:
            call(message, timeout=30, metadata=[(INTERNAL_TOKEN_METADATA, "")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    drafter = rpc.drafter.DrafterStub(channel(guarded["drafter"]))
    with pytest.raises(grpc.RpcError) as e:
        list(drafter.Draft(iter([pb.drafter.DraftRound(round_id=1)]), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_no_secret_on_a_command_line_or_in_help(guarded):
    for proc in guarded["processes"].values():
        with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
            cmdline = f.read().decode()
        for secret in (TOKEN, ALICE, BOB):
            assert secret not in cmdline
    env = {**os.environ, "DSPARK_SCHEDULER_API_KEYS": ALICE,
           "DSPARK_SCHEDULER_INTERNAL_TOKEN": TOKEN, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-m", "services.scheduler", "--help"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT).stdout
    assert "--api-keys-file" in out and "--internal-token" in out
    assert ALICE not in out and TOKEN not in out


def test_another_key_cannot_read_or_resume_my_request(guarded):
    port = guarded["http"]
    status, _, body = request(port, "POST", "/v1/completions",
                              {"model": "tiny", "prompt": PROMPT, "max_tokens": 6,
                               "temperature": 0})
    assert status == 200
    rid = body["id"]
    assert len(rid.split("-")[1]) == 32
    status, _, mine = request(port, "GET", f"/v1/requests/{rid}")
    assert status == 200 and mine["prompt_token_ids"] == PROMPT
    _, _, unknown = request(port, "GET", "/v1/requests/cmpl-0123456789abcdef0123456789abcdef",
                            key=BOB)
    for method, path in (("GET", f"/v1/requests/{rid}"), ("POST", f"/v1/requests/{rid}/resume")):
        status, _, theirs = request(port, method, path, key=BOB)
        assert status == 404 and rid not in json.dumps(theirs)
        assert theirs == unknown
    stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{guarded['grpc']}"))
    with pytest.raises(grpc.RpcError) as e:
        stub.GetRequest(pb.generation.GetRequestRequest(request_id=rid), timeout=30,
                        metadata=[("authorization", f"Bearer {BOB}")])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and rid not in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.generation.GenerateRequest(resume_request_id=rid), timeout=30,
                           metadata=[("authorization", f"Bearer {BOB}")]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    record = stub.GetRequest(pb.generation.GetRequestRequest(request_id=rid), timeout=30,
                             metadata=[("authorization", f"Bearer {ALICE}")])
    assert list(record.prompt_ids) == PROMPT


def scraped(port: int, name: str, **labels: str) -> float:
    """One sample of the scheduler's /metrics (model "tiny")."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    wanted = {"model_name": "tiny", **labels}
    return next(s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name and s.labels == wanted)


@contextlib.contextmanager
def frozen(process):
    process.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.proc.send_signal(signal.SIGCONT)


def test_beyond_the_queue_is_a_429_and_health_stays_responsive(guarded, embedded_greedy):
    """max_running 1, max_waiting 1: with the verifier frozen after the first request's first
    tokens, a second request waits and a third is refused."""
    port = guarded["http"]
    results: dict[str, list] = {"first": [], "second": []}
    first_started = threading.Event()

    def stream(name: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
             "stream": True}), headers={"Authorization": f"Bearer {ALICE}",
                                        "Content-Type": "application/json"})
        response = conn.getresponse()
        results[name].append(response.status)
        for line in response:
            if line.startswith(b"data: {"):
                results[name] += json.loads(line[6:])["dspark"]["token_ids"]
                first_started.set()
        conn.close()

    refused_before = scraped(port, "dspark:num_requests_refused_total", reason="queue_full")
    first = threading.Thread(target=stream, args=("first",))
    first.start()
    assert first_started.wait(120)
    verifier = guarded["processes"]["verifier_guarded"]
    with frozen(verifier):
        second = threading.Thread(target=stream, args=("second",))
        second.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, _, health = request(port, "GET", "/health", key=None)
            if health["waiting"] >= 1:
                break
            time.sleep(0.05)
        start = time.monotonic()
        status, headers, body = request(port, "POST", "/v1/completions",
                                        {"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert body["error"]["code"] == 429 and body["error"]["type"] == "rate_limit_error"
        stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{guarded['grpc']}"))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.generation.GenerateRequest(model="tiny", prompt_token_ids=PROMPT,
                                                             max_tokens=4), timeout=30,
                               metadata=[("authorization", f"Bearer {ALICE}")]))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert scraped(port, "dspark:num_requests_refused_total",
                       reason="queue_full") == refused_before + 2
        # The first request's prompt and tokens so far hold blocks of the verifier's cache.
        assert 0 < scraped(port, "dspark:kv_cache_usage_perc") < 1
        status, _, health = request(port, "GET", "/health", key=None)
        assert status == 200 and health["waiting"] >= 1
        grpc_health = health_pb2_grpc.HealthStub(channel(f"127.0.0.1:{guarded['grpc']}")).Check(
            health_pb2.HealthCheckRequest(), timeout=5)
        assert grpc_health.status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - start < 10
    first.join(300)
    second.join(300)
    expected = embedded_greedy(PROMPT, 40)
    assert results["first"] == [200, *expected] and results["second"] == [200, *expected]
    # Both released: the gauge is 0 after the loop's last round (recorded just after the
    # clients' final events, so allow it a moment).
    deadline = time.monotonic() + 10
    while scraped(port, "dspark:kv_cache_usage_perc") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scraped(port, "dspark:kv_cache_usage_perc") == 0
    assert scraped(port, "dspark:num_requests_refused_total",
                   reason="kv_cache_full") == 0
