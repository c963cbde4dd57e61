"""response_format through the whole stack (REST and gRPC, remote verifier and drafter): every
output is JSON valid under its schema, a stream is the same text, and a bad response_format is
a 400 / INVALID_ARGUMENT naming it."""

from __future__ import annotations

import json

import grpc
import pytest

from dspark.serving.protos import pb, rpc

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "pick"],
          "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["ab", "cd", "e"]},
                         "note": {"type": "string", "maxLength": 4}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA,
                                                        "strict": True}}


def check(value: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_outputs_follow_the_schema(json_stack, temperature):
    status, body = json_stack.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "pick one"}],
        "max_tokens": 48, "temperature": temperature, "seed": 3, "n": 4,
        "response_format": SCHEMA_FORMAT})
    assert status == 200, body
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        check(json.loads(choice["message"]["content"]))


def test_streamed_completion_is_the_same_json(json_stack):
    request = {"model": "tiny", "prompt": "say it", "max_tokens": 48, "temperature": 0,
               "response_format": SCHEMA_FORMAT}
    status, whole = json_stack.post("/v1/completions", request)
    assert status == 200, whole
    check(json.loads(whole["choices"][0]["text"]))
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{json_stack.http_port}/v1",
                           api_key=json_stack.api_key, max_retries=0, timeout=60)
    pieces = client.completions.create(stream=True, extra_body={
        "response_format": SCHEMA_FORMAT}, **{k: v for k, v in request.items()
                                             if k != "response_format"})
    assert "".join(p.choices[0].text for p in pieces) == whole["choices"][0]["text"]


def test_json_object_mode_ends_in_an_object_or_at_max_tokens(json_stack):
    status, body = json_stack.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "json"}], "max_tokens": 24,
        "temperature": 0, "response_format": {"type": "json_object"}})
    assert status == 200, body
    choice = body["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
    ({"type": "grammar"}, "response_format.type must be"),
])
def test_bad_response_format_is_a_400_naming_it(json_stack, response_format, words):
    status, body = json_stack.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": response_format})
    assert status == 400, body
    assert body["error"]["param"] == "response_format" and words in body["error"]["message"]
    status, body = json_stack.post("/v1/completions", {
        "model": "tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True,
        "response_format": {"type": "json_object"}})
    assert status == 400 and "ignore_eos" in body["error"]["message"], body


def test_grpc_generate_takes_response_format(json_stack):
    channel = grpc.insecure_channel(f"127.0.0.1:{json_stack.grpc_port}")
    stub = rpc.generation.GenerationStub(channel)
    metadata = [("authorization", f"Bearer {json_stack.api_key}")]
    request = pb.generation.GenerateRequest(
        model="tiny", prompt="go", max_tokens=48, sampling=pb.common.SamplingParams(top_p=1.0),
        response_format=json.dumps(SCHEMA_FORMAT))
    text = "".join(r.text for r in stub.Generate(request, metadata=metadata, timeout=60))
    check(json.loads(text))
    bad = pb.generation.GenerateRequest(model="tiny", prompt="go", max_tokens=4,
                                        response_format="{not json")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=metadata, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in e.value.details()
    channel.close()
