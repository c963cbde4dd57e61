"""A few hundred generated REST bodies and gRPC requests against the real stack (loadtest/fuzz_api.py
runs thousands): every answer a 2xx or a 4xx with OpenAI's error body, never a 5xx, a dropped
connection or a hang, while a normal streaming request keeps producing exactly its solo output."""

from __future__ import annotations

from loadtest.fuzz_api import Witness, fuzz

PROMPT = [3, 9, 27, 17]


def test_fuzzed_requests_are_answered_and_hurt_no_one(stack, embedded_greedy):
    expected = embedded_greedy(PROMPT, 40)
    with Witness(stack.http_port, stack.api_key, PROMPT, 40, expected=expected) as witness:
        counts = fuzz(stack.http_port, stack.grpc_port, stack.api_key, bodies=300,
                      grpc_requests=150)
    assert sum(counts["rest"].values()) == 300 and sum(counts["grpc"].values()) == 150
    assert counts["rest"]["400"] > 100 and counts["rest"]["200"] + counts["rest"]["200 stream"] > 5
    assert witness.errors == [] and witness.mismatches == [] and witness.runs >= 1


def test_each_hostile_body_is_a_400_with_an_error_body(stack):
    """Infinity, NaN, a 5000-digit integer, 100 000 levels of nesting, a lone surrogate, a
    non-object stream_options, invalid JSON: a 400 each (before: a 500 or a closed connection)."""
    from loadtest.fuzz_api import RAW_BODIES, check_rest

    for body in RAW_BODIES:
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert check_rest(stack.http_port, stack.api_key, "POST", path, body) == "400", body
