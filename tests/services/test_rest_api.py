"""The OpenAI-compatible REST API through the official `openai` client, against the real stack."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai


def client(stack, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1",
                         api_key=key or stack.api_key, max_retries=0, timeout=60)


def test_completion_equals_embedded_engine(stack, embedded_greedy):
    prompt = "t3 t9 t27 t17"
    out = client(stack).completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                           temperature=0)
    expected = embedded_greedy([3, 9, 27, 17], 20)
    choice = out.choices[0]
    assert choice.text == " ".join(f"t{t}" for t in expected)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 20
    assert out.model_extra["dspark"]["token_ids"] == expected


def test_completion_from_token_ids(stack, embedded_greedy):
    out = client(stack).completions.create(model="tiny", prompt=[5, 6], max_tokens=12,
                                           temperature=0)
    assert out.model_extra["dspark"]["token_ids"] == embedded_greedy([5, 6], 12)


def test_streamed_chat_completion(stack, embedded_greedy):
    messages = [{"role": "user", "content": "t11 t12 t13"}]
    chunks = list(client(stack).chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    # OpenAI's form: the usage rides on a last chunk of its own, with empty choices.
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # The chat template: t1 <content> t2 t3 (see conftest.build_tokenizer).
    expected = embedded_greedy([1, 11, 12, 13, 2, 3], 16)
    assert text.split() == [f"t{t}" for t in expected]
    assert len(chunks) > 3  # really streamed, not one blob


def test_models_health_and_metrics(stack):
    models = client(stack).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health") as r:
        assert json.loads(r.read())["status"] == "ok"
    client(stack).completions.create(model="tiny", prompt="t8 t8", max_tokens=8, temperature=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/metrics") as r:
        text = r.read().decode()
    for name in ("dspark:spec_decode_num_drafts_total", "dspark:spec_decode_num_draft_tokens_total",
                 "dspark:spec_decode_num_accepted_tokens_total",
                 "dspark:spec_decode_num_accepted_tokens_per_pos_total",
                 "dspark:spec_decode_acceptance_length",
                 "dspark:spec_decode_verify_batch_tokens_count", "dspark:spec_decode_capacity_k",
                 "dspark:spec_decode_target_steps_per_second", "dspark:num_requests_waiting",
                 "dspark:generation_tokens_total", "dspark:request_success_total"):
        assert name in text, name
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("dspark:") and "position" not in line and "le=" not in line}
    assert values["dspark:generation_tokens_total"] >= 8
    assert values["dspark:spec_decode_num_draft_tokens_total"] > 0  # it really speculates
    assert values["dspark:spec_decode_drafter_available"] == 1
    stage = {line.split('stage="')[1].split('"')[0]: float(line.split()[-1])
             for line in text.splitlines() if line.startswith("dspark:round_seconds_total{")}
    assert set(stage) == {"prefill", "draft", "admission", "verify", "verify_call", "other"}
    assert stage["prefill"] > 0 and stage["draft"] > 0 and stage["verify"] > 0
    assert stage["verify_call"] > 0  # a remote call always costs more than its forward


def test_a_client_resetting_its_connection_is_not_an_error(stack):
    """A client that drops its connection mid-request (a load test stopping) must not leave a
    traceback in the scheduler's log, and the server keeps serving."""
    import socket
    import struct
    import time

    before = stack.processes["scheduler"].log_text().count("Traceback")
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", stack.http_port), timeout=5)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(1)  # the server has read the request and is answering on a kept-alive connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # linger 0: the close is a reset (RST), not a FIN
    time.sleep(0.5)
    with urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{stack.http_port}/v1/models",
            headers={"Authorization": f"Bearer {stack.api_key}"}), timeout=10) as resp:
        assert resp.status == 200
    assert stack.processes["scheduler"].log_text().count("Traceback") == before
