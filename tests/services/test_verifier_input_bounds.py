"""The verifier's gRPC service refuses, call by call, every index or probability that would reach a
gather, scatter or sampling kernel out of range (on a GPU a device-side assert loses the process's
CUDA context for everyone); the refused call leaves its request usable. The public gRPC port
refuses a message above its 4 MiB limit before parsing it, and keeps serving."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark.sampling import SamplingParams
from dspark.serving import messages, tensor_codec
from dspark.serving.grpc_runtime import PUBLIC_MAX_MESSAGE_BYTES, channel
from dspark.serving.protos import pb, rpc
from loadtest.tiny_models import VOCAB

PROMPT = [3, 9, 27, 17, 5, 6, 40]
GREEDY = messages.sampling_to_pb(SamplingParams(temperature=0))


def enc(t):
    return tensor_codec.encode(t)


def verify(stub, item):
    return stub.Verify(pb.verifier.VerifyBatchRequest(items=[item]), timeout=30)


@pytest.fixture()
def prefilled(shared_verifier):
    """A request with its prompt read; yields (stub, request id, anchor token)."""
    with grpc.insecure_channel(shared_verifier.address) as ch:
        stub = rpc.verifier.VerifierStub(ch)
        rid = "bounds"
        reply = stub.Prefill(pb.verifier.PrefillRequest(items=[pb.verifier.PrefillItem(
            request_id=rid, prompt_ids=PROMPT, sampling=GREEDY)]), timeout=30)
        try:
            yield stub, rid, int(reply.results[0].first_token)
        finally:
            stub.Release(pb.verifier.ReleaseRequest(request_ids=[rid]), timeout=30)


def drafts(tokens, probs, indices=None):
    return dict(draft_tokens=enc(torch.tensor(tokens)), draft_probs=enc(probs),
                draft_indices=enc(indices))


BAD_ITEMS = {
    "anchor above the vocabulary": (dict(anchor_token=VOCAB), "anchor_token"),
    "negative anchor": (dict(anchor_token=-1), "anchor_token"),
    "draft token above the vocabulary":
        (drafts([VOCAB], torch.full((1, VOCAB), 1.0 / VOCAB)), "vocabulary"),
    "draft index above the vocabulary":
        (drafts([1], torch.tensor([[0.5, 0.5]]), torch.tensor([[1, VOCAB]])), "draft_indices"),
    "negative draft index":
        (drafts([1], torch.tensor([[0.5, 0.5]]), torch.tensor([[1, -3]])), "draft_indices"),
    "float draft indices":
        (drafts([1], torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 2.0]])), "draft_indices"),
    "indices of another shape":
        (drafts([1], torch.tensor([[0.5, 0.5]]), torch.tensor([[1, 2, 3]])), "shape"),
    "NaN probability": (drafts([1], torch.full((1, VOCAB), float("nan"))), "draft_probs"),
    "probability above one": (drafts([1], torch.full((1, VOCAB), 2.0)), "draft_probs"),
    "dense probabilities of the wrong width": (drafts([1], torch.ones(1, 5) / 5), "columns"),
}


@pytest.mark.parametrize("case", BAD_ITEMS, ids=list(BAD_ITEMS))
def test_out_of_range_verify_items_are_invalid_argument_and_harm_nothing(prefilled, case):
    stub, rid, anchor = prefilled
    fields, named = BAD_ITEMS[case]
    item = pb.verifier.VerifyItem(request_id=rid, anchor_token=anchor,
                                  sampling=GREEDY)
    for key, value in fields.items():
        if isinstance(value, int):
            setattr(item, key, value)
        else:
            getattr(item, key).CopyFrom(value)
    with pytest.raises(grpc.RpcError) as e:
        verify(stub, item)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in e.value.details()
    # The request is where it was: a plain step from the same anchor goes on.
    good = pb.verifier.VerifyItem(request_id=rid, anchor_token=anchor,
                                  sampling=GREEDY)
    reply = verify(stub, good)
    assert reply.results[0].num_accepted == 0 and len(reply.results[0].output_tokens) == 1
    assert 0 <= reply.results[0].output_tokens[0] < VOCAB


def test_public_grpc_refuses_a_message_above_its_limit_and_keeps_serving(stack):
    stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{stack.grpc_port}"))
    metadata = [("authorization", f"Bearer {stack.api_key}")]
    huge = pb.generation.GenerateRequest(
        model="tiny", prompt="t3 " * (PUBLIC_MAX_MESSAGE_BYTES // 3 + 1), max_tokens=4)
    assert huge.ByteSize() > PUBLIC_MAX_MESSAGE_BYTES
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(huge, metadata=metadata, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = pb.generation.GenerateRequest(model="tiny", prompt_token_ids=[11, 12, 13], max_tokens=3,
                                       sampling=pb.common.SamplingParams(temperature=0.0))
    replies = list(stub.Generate(ok, metadata=metadata, timeout=60))
    assert replies[-1].finished and sum(len(r.token_ids) for r in replies) == 3
