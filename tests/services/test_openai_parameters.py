"""The REST API's OpenAI surface against the real stack: the official client (sync and async,
streamed and not), the parameters users send (null = default, stop strings, seed, usage,
stream_options), validation errors as OpenAI's 400 with `param`, and the OpenAPI schema."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.request

import openai
import pytest

PROMPT = [3, 9, 27, 17]


def base_url(stack) -> str:
    return f"http://127.0.0.1:{stack.http_port}"


def words(token_ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in token_ids)


def test_async_client_streamed_and_not(stack, embedded_greedy):
    expected = embedded_greedy(PROMPT, 12)

    async def run():
        client = openai.AsyncOpenAI(base_url=base_url(stack) + "/v1", api_key=stack.api_key,
                                    max_retries=0, timeout=60)
        whole = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                                temperature=0)
        stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                                 temperature=0, stream=True)
        pieces = [chunk async for chunk in stream]
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t11 t12 t13"}], max_tokens=6,
            temperature=0)
        await client.close()
        return whole, pieces, chat

    whole, pieces, chat = asyncio.run(run())
    assert whole.choices[0].text == words(expected)
    assert "".join(p.choices[0].text for p in pieces) == words(expected)
    # No usage unless stream_options.include_usage asks (OpenAI's and vLLM's completions).
    assert all(p.usage is None for p in pieces) and pieces[-1].choices[0].finish_reason == "length"
    assert chat.choices[0].message.content == words(embedded_greedy([1, 11, 12, 13, 2, 3], 6))
    assert chat.usage.prompt_tokens == 6 and chat.usage.total_tokens == 12


def test_sync_chat_not_streamed_has_usage(stack, embedded_greedy):
    client = openai.OpenAI(base_url=base_url(stack) + "/v1", api_key=stack.api_key, max_retries=0,
                           timeout=60)
    out = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0,
                                         messages=[{"role": "user", "content": "t4 t5"}])
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == words(embedded_greedy([1, 4, 5, 2, 3], 5))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 5)


def test_null_means_the_default(stack):
    status, body = stack.post("/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": None, "temperature": None,
        "top_p": None, "seed": None, "stop": None, "stream": None, "n": None, "user": None,
        "stream_options": None, "logprobs": None})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_output_before_it(stack, embedded_greedy, stream):
    expected = words(embedded_greedy(PROMPT, 20))
    stop = " " + expected.split()[6]  # the 7th token's word
    cut = expected[:expected.find(stop)]
    client = openai.OpenAI(base_url=base_url(stack) + "/v1", api_key=stack.api_key, max_retries=0,
                           timeout=60)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                    stop=[stop, "never-produced"], stream=stream)
    assert text_and_reason(out, stream) == (cut, "stop")


def text_and_reason(out, stream: bool) -> tuple[str, str]:
    """A completion's text and finish_reason, streamed (chunks joined) or not."""
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = list(out)
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_wait_for_min_tokens(stack, embedded_greedy, stream):
    """vLLM's rule: no stop string ends within the first min_tokens tokens' text. The third
    token's text as the stop string cuts the output there with min_tokens 0; with min_tokens 5
    only a later occurrence may (the reference: tests/services/test_stop_strings.py)."""
    from .test_stop_strings import reference_min_tokens

    tokens = embedded_greedy(PROMPT, 20)
    pieces = [("" if i == 0 else " ") + f"t{t}" for i, t in enumerate(tokens)]
    client = openai.OpenAI(base_url=base_url(stack) + "/v1", api_key=stack.api_key, max_retries=0,
                           timeout=60)
    results = {}
    for min_tokens in (0, 5):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                        stop=[pieces[2]], stream=stream,
                                        extra_body={"min_tokens": min_tokens})
        text, reason = text_and_reason(out, stream)
        cut, stopped = reference_min_tokens(pieces, [pieces[2]], min_tokens)
        assert (text, reason) == (cut, "stop" if stopped else "length"), min_tokens
        results[min_tokens] = text
    assert results[0] != results[5]


def test_seed_makes_sampling_reproducible(stack):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    first = stack.post("/v1/completions", body)[1]["dspark"]["token_ids"]
    second = stack.post("/v1/completions", body)[1]["dspark"]["token_ids"]
    assert first == second and len(first) == 12


def test_stream_without_include_usage_has_no_chat_usage(stack):
    client = openai.OpenAI(base_url=base_url(stack) + "/v1", api_key=stack.api_key, max_retries=0,
                           timeout=60)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t3"}], max_tokens=4, temperature=0,
        stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param, words_in_message", [
    ({"logprobs": 6}, "logprobs", "logprobs must be in 0..5"),
    ({"best_of": 3, "n": 4}, "best_of", "best_of must be >= n"),
    ({"best_of": 3, "stream": True}, "best_of", "best_of > n cannot be streamed"),
    ({"echo": True, "logprobs": 1}, "echo", "echo with logprobs is not supported"),
    ({"n": 0}, "n", "n must be in 1..128"),
    ({"n": 129}, "n", "n must be in 1..128"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "end-of-sequence token"),  # the word-level tiny tokenizer has none
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", "the schema cannot be compiled"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be"),
    ({"response_format": "json"}, "response_format", "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 1}, "response_format",
     "cannot be combined with min_tokens"),
    ({"tools": []}, "tools", "unsupported parameter 'tools'"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"stream": "yes"}, "stream", "stream"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64 stop strings"),
    ({"stop": ["x" * 1025]}, "stop", "longer than 1024 characters"),
    ({"stream_options": {"include_usage": True, "colour": 1}}, "stream_options",
     "unsupported parameter 'stream_options.colour'"),
])
def test_unsupported_or_invalid_parameter_is_a_400_naming_it(stack, extra, param,
                                                             words_in_message):
    status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert words_in_message in body["error"]["message"]


def test_chat_top_logprobs_out_of_range_and_image_parts_are_refused_by_name(stack):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "t3"}], "max_tokens": 4}
    status, body = stack.post("/v1/chat/completions", {**chat, "logprobs": True,
                                                        "top_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    status, body = stack.post("/v1/chat/completions", {**chat, "messages": image})
    assert status == 400 and body["error"]["param"] == "messages"
    assert "only text parts are supported" in body["error"]["message"]


def test_body_over_the_limit_is_a_413_before_it_is_sent(stack):
    from services.scheduler.rest_api import MAX_BODY_BYTES

    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Authorization", f"Bearer {stack.api_key}")
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()  # the server answers from the headers alone
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 413 and "larger than" in body["error"]["message"]


def test_openapi_schema_and_docs(stack):
    with urllib.request.urlopen(base_url(stack) + "/openapi.json", timeout=30) as r:
        schema = json.loads(r.read())
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
            "/metrics"} <= set(schema["paths"])
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "stop", "seed", "stream_options"} <= set(request)
    with urllib.request.urlopen(base_url(stack) + "/docs", timeout=30) as r:
        assert r.status == 200 and b"swagger" in r.read().lower()


def test_latency_histograms_and_errors_by_status_are_exported(stack):
    from prometheus_client.parser import text_string_to_metric_families

    stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0})
    with urllib.request.urlopen(base_url(stack) + "/metrics", timeout=30) as r:
        samples = [s for f in text_string_to_metric_families(r.read().decode()) for s in f.samples]
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    tiny = ("model_name", "tiny")
    assert value[("dspark:time_to_first_token_seconds_count", (tiny,))] >= 1
    assert value[("dspark:inter_token_latency_seconds_count", (tiny,))] >= 1
    assert value[("dspark:e2e_request_latency_seconds_count", (tiny,))] >= 1
    refused = ("dspark:http_requests_total", (("handler", "/v1/completions"), ("method", "POST"),
                                              tiny, ("status", "400")))
    assert value[refused] >= 1
