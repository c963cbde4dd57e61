"""A failure on the device reaches the client as a status it can act on, with the error's
message: INTERNAL for the service's own failure (a CUDA error, a kernel refusing its tensors),
RESOURCE_EXHAUSTED for device memory, INVALID_ARGUMENT for bad input; never grpc's bare UNKNOWN.
And the drafter service keeps nothing of the target but what drafting reads."""

from __future__ import annotations

import gc

import grpc
import pytest
import torch
from opentelemetry import trace

from dspark.serving import grpc_runtime, messages
from dspark.serving.config import DrafterServiceConfig, VerifierServiceConfig
from dspark.serving.grpc_errors import status_of
from dspark.serving.protos import pb, rpc
from dspark.sampling import SamplingParams

PROMPT = [3, 9, 27, 17, 5, 6, 40]


@pytest.fixture()
def in_process_verifier(tiny_models):
    """A verifier service in this process (so a test can make its device fail); yields
    (stub, servicer)."""
    from services.verifier.main import build_servicer

    config = VerifierServiceConfig(port=0, model_dir=str(tiny_models.target_dir),
                                   drafter_dir=str(tiny_models.drafter_dir), device="cpu",
                                   kv_cache_tokens=2048, cost_table=str(tiny_models.cost_table))
    servicer = build_servicer(config, trace.get_tracer("test"))
    server, _, port = grpc_runtime.start_server(
        servicer, rpc.verifier.add_VerifierServicer_to_server, "dspark.v1.Verifier",
        "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield rpc.verifier.VerifierStub(ch), servicer
    finally:
        server.stop(None)


def test_a_device_failure_in_verification_is_internal_with_its_message(in_process_verifier,
                                                                      monkeypatch):
    stub, servicer = in_process_verifier
    greedy = messages.sampling_to_pb(SamplingParams(temperature=0))
    reply = stub.Prefill(pb.verifier.PrefillRequest(items=[pb.verifier.PrefillItem(
        request_id="r", prompt_ids=PROMPT, sampling=greedy)]), timeout=30)

    def device_fails(items):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(servicer.verifier.runner, "forward", device_fails)  # the target forward
    item = pb.verifier.VerifyItem(request_id="r", anchor_token=int(reply.results[0].first_token),
                                  sampling=greedy)
    with pytest.raises(grpc.RpcError) as e:
        stub.Verify(pb.verifier.VerifyBatchRequest(items=[item]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "illegal memory access" in e.value.details()


@pytest.mark.parametrize("error, code", [
    (RuntimeError("Expected all tensors to be on the same device"), grpc.StatusCode.INTERNAL),
    (ValueError("draft token out of range"), grpc.StatusCode.INVALID_ARGUMENT),
    (IndexError("index 70000 is out of bounds"), grpc.StatusCode.INVALID_ARGUMENT),
    (torch.OutOfMemoryError("CUDA out of memory"), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_errors_map_to_statuses_with_their_messages(error, code):
    got, message = status_of(error)
    assert got == code and str(error) in message


def test_the_drafter_service_keeps_only_the_targets_head(tiny_models):
    from dspark.models.transformer import Transformer
    from services.drafter.main import build_servicer

    gc.collect()
    before = sum(isinstance(o, Transformer) for o in gc.get_objects())
    servicer = build_servicer(DrafterServiceConfig(model_dir=str(tiny_models.target_dir),
                                                   drafter_dir=str(tiny_models.drafter_dir),
                                                   device="cpu"), trace.get_tracer("test"))
    gc.collect()
    assert sum(isinstance(o, Transformer) for o in gc.get_objects()) == before
    assert servicer.drafter.gamma > 0 and servicer.vocab_size > 0
