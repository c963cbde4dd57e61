"""A request nobody touches for `--idle-expiry-seconds` is freed (its scheduler died), and a later
call for it gets NOT_FOUND, which the scheduler's RemoteVerifier answers by re-prefilling.
The verifier servicer runs in a real gRPC server in this process (no model process needed)."""

from __future__ import annotations

import time

import grpc
import pytest
from opentelemetry import trace

from dspark.serving import grpc_runtime
from dspark.serving.config import VerifierServiceConfig
from dspark.serving.protos import pb, rpc
from services.verifier.main import build_servicer

GREEDY = pb.common.SamplingParams(temperature=0.0, top_p=1.0)


@pytest.fixture
def verifier_stub(tiny_models):
    config = VerifierServiceConfig(model_dir=str(tiny_models.target_dir),
                                   drafter_dir=str(tiny_models.drafter_dir),
                                   cost_table=str(tiny_models.cost_table), kv_cache_tokens=1024,
                                   max_context_tokens=256, idle_expiry_seconds=0.5)
    server, _ = grpc_runtime.new_server()
    rpc.verifier.add_VerifierServicer_to_server(build_servicer(config, trace.NoOpTracer()), server)
    port = grpc_runtime.bind(server, "127.0.0.1", 0)
    server.start()
    try:
        yield rpc.verifier.VerifierStub(grpc_runtime.channel(f"127.0.0.1:{port}"))
    finally:
        server.stop(0)


def prefill(stub, request_id: str) -> int:
    reply = stub.Prefill(pb.verifier.PrefillRequest(items=[pb.verifier.PrefillItem(
        request_id=request_id, prompt_ids=[3, 9, 27], sampling=GREEDY)]))
    return reply.results[0].first_token


def held(stub) -> list[str]:
    return list(stub.Info(pb.common.InfoRequest()).active_requests)


def test_idle_requests_are_freed(verifier_stub):
    first = prefill(verifier_stub, "orphan")
    assert held(verifier_stub) == ["orphan"]
    time.sleep(0.8)
    prefill(verifier_stub, "fresh")  # any call sweeps the idle ones
    assert held(verifier_stub) == ["fresh"]
    with pytest.raises(grpc.RpcError) as e:
        verifier_stub.Verify(pb.verifier.VerifyBatchRequest(items=[pb.verifier.VerifyItem(
            request_id="orphan", anchor_token=first, sampling=GREEDY)]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "orphan" in e.value.details()


def test_busy_requests_are_kept(verifier_stub):
    token = prefill(verifier_stub, "busy")
    for _ in range(4):  # touched every 0.3 s: never idle for 0.5 s
        time.sleep(0.3)
        reply = verifier_stub.Verify(pb.verifier.VerifyBatchRequest(items=[pb.verifier.VerifyItem(
            request_id="busy", anchor_token=token, sampling=GREEDY)]))
        token = reply.results[0].output_tokens[-1]
    assert held(verifier_stub) == ["busy"]
