"""`n` through the services (scheduler, verifier and drafter processes): the samples after a
prompt's first fork its caches over the Fork RPC and the DraftRound's forks (dspark/forks.py),
so the target reads the prompt once, counted by the scheduler's /metrics; each sample is what
the same request sent alone gives (greedy: the embedded engine's output; seeded: the request
with seed + i sent by itself)."""

from __future__ import annotations

import http.client

PROMPT = [3, 9, 27, 17, 5, 6, 11, 12, 13, 14, 40, 8]


def counters(stack) -> dict[str, float]:
    """The scheduler's prompt-token counters (summed over their labels)."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {"read": 0.0, "forked": 0.0}
    for line in text.splitlines():
        for key in out:
            if line.startswith(f"dspark:prompt_tokens_{key}_total{{"):
                out[key] += float(line.split()[-1])
    return out


def completions(stack, **body) -> list[str]:
    status, reply = stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, **body})
    assert status == 200, reply
    return [c["text"] for c in reply["choices"]]


def test_n_greedy_samples_read_the_prompt_once(stack, embedded_greedy):
    expected = " ".join(f"t{t}" for t in embedded_greedy(PROMPT, 12))
    before = counters(stack)
    texts = completions(stack, max_tokens=12, temperature=0, n=3)
    after = counters(stack)
    assert texts == [expected] * 3
    assert after["read"] - before["read"] == len(PROMPT) + 2  # then each fork its last token
    assert after["forked"] - before["forked"] == 2 * (len(PROMPT) - 1)


def test_seeded_samples_equal_the_requests_sent_alone(stack):
    """Sample i of a request with seed s is the request with seed s + i (vLLM's seeding); on a
    prompt where the peaked tiny target's samples differ."""
    body = dict(prompt=PROMPT[:4], max_tokens=16, temperature=1.0)
    forked = completions(stack, **body, seed=7, n=3)
    alone = [completions(stack, **body, seed=7 + i)[0] for i in range(3)]
    assert forked == alone
    assert len(set(alone)) > 1
