"""The clients users already run, unchanged, against the real stack: the official `openai`
client (chat, completions, streaming, n, seed), LangChain's ChatOpenAI (invoke, stream, batch,
with_structured_output), and guidellm's default streaming benchmark at 1 and 4 concurrent
requests (its JSON report parsed: requests completed, none failed, TTFT and ITL measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest

PROMPT = [3, 9, 27, 17]
CHAT = [{"role": "user", "content": "t11 t12 t13"}]
CHAT_PROMPT = [1, 11, 12, 13, 2, 3]


def words(token_ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in token_ids)


def base_url(stack) -> str:
    return f"http://127.0.0.1:{stack.http_port}/v1"


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(stack), api_key=stack.api_key, max_retries=0,
                         timeout=60)


# -- the official openai client ------------------------------------------------------------------
def test_openai_chat_and_completions_with_n(client, embedded_greedy):
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                          temperature=0, n=2)
    expected = words(embedded_greedy(CHAT_PROMPT, 8))
    assert [c.message.content for c in chat.choices] == [expected, expected]
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 16
    out = client.completions.create(model="tiny", prompt=["t3 t9 t27 t17", "t5 t6"],
                                    max_tokens=6, temperature=0)
    assert [c.text for c in out.choices] == [words(embedded_greedy(PROMPT, 6)),
                                             words(embedded_greedy([5, 6], 6))]


def test_openai_streams_with_usage(client, embedded_greedy):
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == words(embedded_greedy(CHAT_PROMPT, 8)).split()
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    pieces = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == words(embedded_greedy(PROMPT, 8))


def test_openai_seed_repeats(client):
    def sample():
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                         temperature=1.0, seed=99).choices[0].text

    assert sample() == sample()


def test_openai_model_lookup(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


# -- LangChain -----------------------------------------------------------------------------------
@pytest.fixture
def chat_model(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="tiny", base_url=base_url(stack),
                                       api_key=stack.api_key, temperature=0, max_tokens=8,
                                       max_retries=0, timeout=60)


def test_langchain_invoke_stream_batch(chat_model, embedded_greedy):
    expected = words(embedded_greedy(CHAT_PROMPT, 8))
    assert chat_model.invoke("t11 t12 t13").content == expected
    streamed = "".join(chunk.content for chunk in chat_model.stream("t11 t12 t13"))
    assert streamed.split() == expected.split()
    second = words(embedded_greedy([1, 5, 6, 2, 3], 8))
    assert [m.content for m in chat_model.batch(["t11 t12 t13", "t5 t6"])] == [expected, second]


def test_langchain_structured_output_returns_the_schemas_object(json_stack):
    """with_structured_output sends response_format json_schema; the stack samples under the
    schema's grammar (speculation included) and LangChain parses the reply into the model."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):  # a finite grammar: a random tiny model's JSON ends in time
        ok: bool
        label: Literal["yes", "no"]

    model = langchain_openai.ChatOpenAI(model="tiny", base_url=base_url(json_stack),
                                        api_key=json_stack.api_key, temperature=0,
                                        max_tokens=40, max_retries=0, timeout=60)
    structured = model.with_structured_output(Verdict, method="json_schema")
    verdict = structured.invoke("is it ok?")
    assert isinstance(verdict, Verdict)
    sampled = model.bind(temperature=1.0, seed=5).with_structured_output(Verdict,
                                                                          method="json_schema")
    assert isinstance(sampled.invoke("score it"), Verdict)


# -- guidellm ------------------------------------------------------------------------------------
GUIDELLM_SECONDS = 4


@pytest.mark.parametrize("streams", [1, 4])
def test_guidellm_default_streaming_benchmark(stack, tmp_path, streams):
    pytest.importorskip("guidellm")
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": f"http://127.0.0.1:{stack.http_port}",
                    "model": "tiny", "api_key": stack.api_key, "http2": False},
        "profile": {"kind": "concurrent", "streams": [streams]},
        "tokenizer": {"kind": "huggingface_auto", "model": str(stack.models.target_dir)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 16, "output_tokens": 12}],
        "constraints": [{"kind": "max_duration", "seconds": GUIDELLM_SECONDS}],
        "outputs": [{"kind": "json", "path": str(tmp_path / "report.json")}],
    }}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    guidellm = os.path.join(os.path.dirname(sys.executable), "guidellm")
    run = subprocess.run([guidellm, "run", "--scenario", str(path), "--disable-console"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (benchmark,) = report["benchmarks"]
    totals = benchmark["metrics"]["request_totals"] if "metrics" in benchmark else None
    assert totals is not None, list(benchmark)
    assert totals["errored"] == 0 and totals["incomplete"] <= streams, totals
    assert totals["successful"] >= 1, totals
    metrics = benchmark["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["mean"]
    itl = metrics["inter_token_latency_ms"]["successful"]["mean"]
    assert ttft > 0 and itl > 0
    print(f"guidellm {streams} streams: {totals['successful']} requests, TTFT {ttft:.1f} ms, "
          f"ITL {itl:.1f} ms (means)")
