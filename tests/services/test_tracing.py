"""One request's trace holds spans from the scheduler, the drafter and the verifier."""

from __future__ import annotations

import time

import openai


def test_one_trace_spans_all_three_services(stack, read_spans):
    out = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=stack.api_key,
                        max_retries=0).completions.create(model="tiny", prompt="t21 t22 t23",
                                                          max_tokens=12, temperature=0)
    request_id = out.id
    deadline = time.monotonic() + 10
    while True:  # spans are written when they end; the request span ends with the request
        spans = read_spans()
        roots = [s for s in spans if s["name"] == "scheduler.request"
                 and s["attributes"].get("dspark.request_id") == request_id]
        if roots or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(roots) == 1
    trace_id = roots[0]["trace_id"]
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    services = {s["service"] for s in in_trace}
    assert services == {"scheduler", "drafter", "verifier"}, services
    names = {s["name"] for s in in_trace}
    assert {"scheduler.request", "scheduler.round", "verifier.verify", "drafter.round"} <= names
    # chunked prefill: the prompt was read in a Verify call (nothing else was running)
    assert any(s["attributes"].get("dspark.prefill_tokens", 0) > 0 for s in in_trace
               if s["name"] == "verifier.verify")
    rounds = [s for s in in_trace if s["name"] == "scheduler.round"]
    assert all(s["parent_span_id"] == roots[0]["span_id"] for s in rounds)
    assert any("dspark.batch_tokens" in s["attributes"] for s in rounds)  # admission figures
    # The remote spans are children of the scheduler's rounds (context crossed the wire).
    round_ids = {s["span_id"] for s in rounds}
    remote = [s for s in in_trace if s["service"] != "scheduler"]
    assert remote and all(s["parent_span_id"] in round_ids for s in remote)
