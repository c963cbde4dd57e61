"""vLLM's OpenAI server, parameter for parameter, against the real stack: what guidellm and
other vLLM clients send (stream_options.continuous_usage_stats, ignore_eos, content parts, a
message name, many stop strings), streamed usage as OpenAI sends it, vLLM's extra endpoints
(/v1/models/{id}, /tokenize, /detokenize, /version, /ping), and several choices per request
(n, a list of prompts, echo, best_of), each checked against single requests of the same stack."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

PROMPT = [3, 9, 27, 17]
CHAT = [{"role": "user", "content": "t11 t12 t13"}]


def words(token_ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in token_ids)


def sse(stack, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response, up to `data: [DONE]` (which must end it)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.http_port}{path}", data=json.dumps(body).encode(),
        method="POST", headers={"Content-Type": "application/json",
                                "Authorization": f"Bearer {stack.api_key}"})
    events, done = [], False
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done = True
            else:
                events.append(json.loads(line[len("data: "):]))
    assert done
    return events


def get(stack, path: str, key: str | None = "default") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}")
    if key is not None:
        request.add_header("Authorization", f"Bearer {stack.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# -- what guidellm sends -----------------------------------------------------------------------
def test_guidellm_chat_body_streams_usage_in_every_chunk(stack, embedded_greedy):
    """guidellm's default streaming chat request, byte for byte what it builds."""
    events = sse(stack, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "text",
                                                                     "text": "t11 t12 t13"}]}],
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 12, "stop": None, "ignore_eos": True, "temperature": 0})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 6,
                                                      "completion_tokens": 12,
                                                      "total_tokens": 18}
    assert all(c["usage"]["prompt_tokens"] == 6 for c in chunks)
    produced = [c["usage"]["completion_tokens"] for c in chunks]
    assert produced == sorted(produced) and produced[0] == 0 and produced[-1] == 12
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
    assert text.split() == words(embedded_greedy([1, 11, 12, 13, 2, 3], 12)).split()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_guidellm_completions_body(stack, embedded_greedy):
    events = sse(stack, "/v1/completions", {
        "model": "tiny", "prompt": "t3 t9 t27 t17", "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 10, "stop": None, "ignore_eos": True, "temperature": 0})
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert [c["usage"]["completion_tokens"] for c in chunks][-1] == 10
    assert "".join(c["choices"][0]["text"] for c in chunks) == words(embedded_greedy(PROMPT, 10))


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": False}}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}}),
])
def test_no_usage_streamed_unless_include_usage(stack, path, body):
    events = sse(stack, path, {"model": "tiny", "max_tokens": 5, "stream": True, **body})
    assert all(e.get("usage") is None for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_include_usage_is_a_last_chunk_with_empty_choices(stack):
    events = sse(stack, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 5,
                                            "stream": True,
                                            "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert all(c["usage"] is None for c in chunks) and chunks[-1]["choices"][0]["finish_reason"]
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 9
    assert last["id"] == chunks[0]["id"]


def test_content_parts_and_name_mean_what_vllm_makes_of_them(stack):
    """Text parts are joined by newlines (the tiny tokenizer splits on whitespace, so "t11\\nt12
    t13" reads as "t11 t12 t13"); a participant's name does not reach the template."""
    def chat(messages):
        status, body = stack.post("/v1/chat/completions", {"model": "tiny", "messages": messages,
                                                            "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]

    plain = chat(CHAT)
    parts = [{"type": "text", "text": "t11"}, {"type": "text", "text": "t12 t13"}]
    assert chat([{"role": "user", "content": parts}]) == plain
    assert chat([{"role": "user", "content": "t11 t12 t13", "name": "ada"}]) == plain


def test_many_stop_strings(stack, embedded_greedy):
    expected = words(embedded_greedy(PROMPT, 20))
    stop = " " + expected.split()[6]
    status, body = stack.post("/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
        "stop": [f"never{i}" for i in range(40)] + [stop]})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected[:expected.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


# -- vLLM's endpoints ----------------------------------------------------------------------------
def test_model_by_id(stack):
    status, body = get(stack, "/v1/models/tiny")
    card = json.loads(body)
    assert status == 200 and card["id"] == "tiny" and card["object"] == "model"
    status, body = get(stack, "/v1/models/other")
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    assert get(stack, "/v1/models/tiny", key=None)[0] == 401


def test_tokenize_and_detokenize(stack):
    status, body = stack.post("/tokenize", {"model": "tiny", "prompt": "t5 t6 t7",
                                            "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == [5, 6, 7] and body["count"] == 3
    assert body["token_strs"] == ["t5", "t6", "t7"] and body["max_model_len"] > 0
    status, body = stack.post("/tokenize", {"messages": CHAT})
    assert status == 200 and body["tokens"] == [1, 11, 12, 13, 2, 3], body
    status, body = stack.post("/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert body["tokens"] == [1, 11, 12, 13, 2]
    status, body = stack.post("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]})
    assert status == 200 and body == {"prompt": "t5 t6 t7"}
    status, body = stack.post("/detokenize", {"tokens": [5, 10**6]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = stack.post("/tokenize", {"prompt": "t5", "messages": CHAT})
    assert status == 400 and "exactly one of prompt, messages" in body["error"]["message"]
    assert stack.post("/tokenize", {"prompt": "t5"}, key=None)[0] == 401


def test_version_and_ping_are_open(stack):
    status, body = get(stack, "/version", key=None)
    assert status == 200 and json.loads(body)["version"]
    assert get(stack, "/ping", key=None) == (200, b"")


# -- several choices -----------------------------------------------------------------------------
def test_n_greedy_choices_each_equal_the_single_request(stack, embedded_greedy):
    status, body = stack.post("/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                                                        "max_tokens": 8, "temperature": 0,
                                                        "n": 3})
    assert status == 200, body
    expected = words(embedded_greedy([1, 11, 12, 13, 2, 3], 8))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == expected for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 24, "total_tokens": 30}


def test_n_samples_differ_at_temperature_one(stack):
    status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 16, "temperature": 1.0,
                                                   "seed": 7, "n": 3})
    assert status == 200, body
    texts = [c["text"] for c in body["choices"]]
    assert len(texts) == 3 and len(set(texts)) > 1  # seed + i per sample, not one sample thrice


def test_list_of_prompts_gives_prompt_major_choices(stack, embedded_greedy):
    for prompt in (["t3 t9 t27 t17", "t5 t6"], [PROMPT, [5, 6]]):
        status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": prompt,
                                                       "max_tokens": 6, "temperature": 0, "n": 2})
        assert status == 200, body
        first, second = words(embedded_greedy(PROMPT, 6)), words(embedded_greedy([5, 6], 6))
        assert [(c["index"], c["text"]) for c in body["choices"]] == [
            (0, first), (1, first), (2, second), (3, second)]
        assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 24


def test_streamed_choices_carry_their_index(stack, embedded_greedy):
    events = sse(stack, "/v1/chat/completions", {
        "model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0, "n": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    *chunks, last = events
    expected = words(embedded_greedy([1, 11, 12, 13, 2, 3], 8)).split()
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(m["delta"]["content"] or "" for m in mine).split() == expected
        assert mine[-1]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_output(stack, embedded_greedy, stream):
    body = {"model": "tiny", "prompt": "t3 t9 t27 t17", "max_tokens": 6, "temperature": 0,
            "echo": True}
    expected = "t3 t9 t27 t17" + words(embedded_greedy(PROMPT, 6))
    if stream:
        events = sse(stack, "/v1/completions", {**body, "stream": True})
        assert events[0]["choices"][0]["text"] == "t3 t9 t27 t17"
        assert "".join(e["choices"][0]["text"] for e in events) == expected
    else:
        status, out = stack.post("/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"] == expected, out


def test_best_of_returns_n_choices_with_logprobs_only_when_asked(stack):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
            "best_of": 3, "n": 2}
    status, out = stack.post("/v1/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 16
    status, out = stack.post("/v1/completions", {**body, "logprobs": 0})
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in out["choices"]]
    assert sums == sorted(sums, reverse=True)  # best first
