"""gRPC Generate streaming, API keys on both APIs, and a 4xx naming the problem for each bad input."""

from __future__ import annotations

import grpc
import openai
import pytest

from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc


def generation_stub(stack):
    return rpc.generation.GenerationStub(channel(f"127.0.0.1:{stack.grpc_port}"))


def auth(stack):
    return [("authorization", f"Bearer {stack.api_key}")]


def test_grpc_generate_streams_embedded_tokens(stack, embedded_greedy):
    request = pb.generation.GenerateRequest(
        model="tiny", prompt_token_ids=[11, 12, 13, 14, 15, 16, 2], max_tokens=24,
        sampling=pb.common.SamplingParams(temperature=0.0))
    replies = list(generation_stub(stack).Generate(request, metadata=auth(stack), timeout=60))
    tokens = [t for r in replies for t in r.token_ids]
    assert tokens == embedded_greedy([11, 12, 13, 14, 15, 16, 2], 24)
    assert len(replies) > 1 and replies[-1].finished and not replies[0].finished
    last = replies[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 24
    assert last.metrics.rounds >= 1 and last.metrics.acceptance_length >= 1.0
    assert "".join(r.text for r in replies).split() == [f"t{t}" for t in tokens]
    # The stored record is there by id.
    record = generation_stub(stack).GetRequest(
        pb.generation.GetRequestRequest(request_id=last.request_id), metadata=auth(stack))
    assert list(record.output_ids) == tokens and record.status == "finished"


def test_grpc_rejects_missing_key_and_bad_input(stack):
    stub = generation_stub(stack)
    good = dict(model="tiny", prompt="t3 t4", max_tokens=4)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.generation.GenerateRequest(**good), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.generation.GenerateRequest(**good), timeout=30,
                           metadata=[("authorization", "Bearer wrong")]))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = pb.generation.GenerateRequest(model="tiny", prompt="t3", max_tokens=4,
                                        sampling=pb.common.SamplingParams(temperature=-1.0))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=auth(stack), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.generation.GenerateRequest(model="other", prompt="t3", max_tokens=4),
                           metadata=auth(stack), timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "other" in e.value.details()


def test_rest_api_key_required(stack):
    for key in ("wrong-key",):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=key,
                          max_retries=0).completions.create(model="tiny", prompt="t3", max_tokens=2)
    status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": "t3"}, key=None)
    assert status == 401 and "API key" in body["error"]["message"]


BASE = {"model": "tiny", "prompt": "t3 t4", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "t3"}], "max_tokens": 4}


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", {**BASE, "model": "gpt-nothing"}, 404, "unknown model"),
    ("/v1/completions", {k: v for k, v in BASE.items() if k != "model"}, 400, "model"),
    ("/v1/completions", {**BASE, "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("/v1/completions", {**BASE, "max_tokens": 65}, 400, "max_tokens must be <= 64"),
    ("/v1/completions", {**BASE, "max_tokens": "many"}, 400, "max_tokens must be a number"),
    ("/v1/completions", {**BASE, "prompt": " ".join(["t5"] * 260)}, 400, "longer than the context"),
    ("/v1/completions", {**BASE, "prompt": ""}, 400, "prompt is empty"),
    ("/v1/completions", {**BASE, "prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {**BASE, "prompt": {"x": 1}}, 400, "'prompt' must be"),
    ("/v1/completions", {**BASE, "temperature": -0.5}, 400, "temperature must be >= 0"),
    ("/v1/completions", {**BASE, "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {**BASE, "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {**BASE, "n": 0}, 400, "n must be in 1..128"),
    ("/v1/chat/completions", {**CHAT, "messages": "hello"}, 400, "'messages' must be"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "'messages' must be"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "t3"}]}, 400,
     "messages[0] must be an object with a role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content must be a string"),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, 400,
     "'messages' is required"),
    ("/v1/nothing", BASE, 404, "no route"),
])
def test_each_bad_input_gets_its_4xx(stack, path, body, status, words):
    got, reply = stack.post(path, body)
    assert got == status, reply
    assert words in reply["error"]["message"]


def test_bad_json_and_non_object_body(stack):
    got, reply = stack.post("/v1/completions", None, raw=b"{not json")
    assert got == 400 and "invalid JSON" in reply["error"]["message"]
    got, reply = stack.post("/v1/completions", None, raw=b"[1, 2]")
    assert got == 400 and "must be an object" in reply["error"]["message"]
    # The server is still fine afterwards.
    got, reply = stack.post("/v1/completions", BASE)
    assert got == 200 and reply["choices"][0]["finish_reason"] == "length"


def test_grpc_stop_strings_end_the_output_before_them(stack, embedded_greedy):
    expected = embedded_greedy([11, 12, 13, 14, 15, 16, 2], 24)
    stop = f" t{expected[6]}"  # the 7th token's word
    text = " ".join(f"t{t}" for t in expected)
    request = pb.generation.GenerateRequest(
        model="tiny", prompt_token_ids=[11, 12, 13, 14, 15, 16, 2], max_tokens=24,
        sampling=pb.common.SamplingParams(temperature=0.0), stop=["never-produced", stop],
        logprobs=0)
    replies = list(generation_stub(stack).Generate(request, metadata=auth(stack), timeout=60))
    last = replies[-1]
    assert last.finished and last.finish_reason == "stop"
    assert "".join(r.text for r in replies) == text[:text.find(stop)]
    tokens = [t for r in replies for t in r.token_ids]
    # up to the token whose word completes the stop string (each token is one word here)
    assert tokens == expected[:len(text[:text.find(stop) + len(stop)].split())]
    assert sum(len(r.logprobs) for r in replies) == len(tokens)
    assert last.usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("fields, words", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"stop": [f"s{i}" for i in range(65)]}, "at most 64 stop strings"),
])
def test_grpc_refuses_zero_max_tokens_and_too_many_stops(stack, fields, words):
    request = pb.generation.GenerateRequest(model="tiny", prompt="t3 t4",
                                            **{"max_tokens": 4, **fields})
    with pytest.raises(grpc.RpcError) as e:
        list(generation_stub(stack).Generate(request, metadata=auth(stack), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_grpc_max_tokens_absent_means_16(stack):
    request = pb.generation.GenerateRequest(model="tiny", prompt="t3 t4", ignore_eos=True,
                                            sampling=pb.common.SamplingParams(temperature=0.0))
    replies = list(generation_stub(stack).Generate(request, metadata=auth(stack), timeout=60))
    assert replies[-1].usage.completion_tokens == 16
