"""gRPC Generate's `n` and `best_of` through the services: the samples are started as the REST
API starts them (services.scheduler.samples), so the prompt is read once (the scheduler's
/metrics), greedy samples equal the embedded engine's output, sample i of a seeded request is
the request with seed + i sent alone, best_of returns the samples of highest cumulative
log-probability, and bad counts are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from dspark.serving.protos import pb

from .test_forks_through_services import PROMPT, counters
from .test_grpc_and_auth import auth, generation_stub


def generate(stack, **fields) -> list:
    """Every reply of one Generate call."""
    sampling = fields.pop("sampling", {})
    request = pb.generation.GenerateRequest(model="tiny", sampling=pb.common.SamplingParams(
        **sampling), **fields)
    return list(generation_stub(stack).Generate(request, metadata=auth(stack), timeout=120))


def by_sample(replies: list) -> dict[int, list]:
    """Each sample's replies, in the order they came."""
    out: dict[int, list] = {}
    for reply in replies:
        out.setdefault(reply.index, []).append(reply)
    return out


def tokens_of(replies: list) -> list[int]:
    return [t for r in replies for t in r.token_ids]


def test_greedy_samples_equal_one_and_read_the_prompt_once(stack, embedded_greedy):
    one = tokens_of(generate(stack, prompt_token_ids=PROMPT, max_tokens=12))
    assert one == embedded_greedy(PROMPT, 12)
    before = counters(stack)
    samples = by_sample(generate(stack, prompt_token_ids=PROMPT, max_tokens=12, n=3))
    after = counters(stack)
    assert sorted(samples) == [0, 1, 2]
    for replies in samples.values():
        assert tokens_of(replies) == one
        # One finished reply per sample, its last, with that sample's usage.
        assert [r.finished for r in replies].count(True) == 1 and replies[-1].finished
        assert replies[-1].usage.completion_tokens == 12
        assert replies[-1].usage.prompt_tokens == len(PROMPT)
        assert len({r.request_id for r in replies}) == 1
    assert len({replies[0].request_id for replies in samples.values()}) == 3
    assert after["read"] - before["read"] == len(PROMPT) + 2  # then each fork its last token
    assert after["forked"] - before["forked"] == 2 * (len(PROMPT) - 1)


def test_seeded_samples_equal_the_requests_sent_alone_and_rest(stack):
    """Sample i of seed s is the request with seed s + i, over gRPC alone and over REST's n; on a
    prompt where the peaked tiny target's samples differ."""
    fields = dict(prompt_token_ids=PROMPT[:4], max_tokens=16)
    samples = by_sample(generate(stack, **fields, n=3,
                                 sampling={"temperature": 1.0, "seed": 7}))
    forked = [tokens_of(samples[i]) for i in range(3)]
    alone = [tokens_of(generate(stack, **fields, sampling={"temperature": 1.0, "seed": 7 + i}))
             for i in range(3)]
    assert forked == alone
    assert len({tuple(t) for t in alone}) > 1
    status, reply = stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT[:4],
                                                   "max_tokens": 16, "temperature": 1.0,
                                                   "seed": 7, "n": 3})
    assert status == 200, reply
    assert [c["text"] for c in reply["choices"]] == [
        "".join(r.text for r in samples[i]) for i in range(3)]


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(stack):
    fields = dict(prompt_token_ids=PROMPT[:4], max_tokens=16)
    sampling = {"temperature": 1.5}  # the tiny target is peaked: diverse samples
    alone = []
    for i in range(4):
        replies = generate(stack, **fields, logprobs=0, sampling={**sampling, "seed": 11 + i})
        alone.append((tokens_of(replies), sum(lp.logprob for r in replies for lp in r.logprobs)))
    best_first = sorted(range(4), key=lambda i: -alone[i][1])  # ties: the first, as best_of
    sums = [alone[i][1] for i in best_first]
    assert sums[0] > sums[-1] + 1e-3  # a wrong pick can show
    # Where the second and third are apart by no more than rounding, they are the same tokens.
    assert sums[1] > sums[2] + 1e-3 or alone[best_first[1]][0] == alone[best_first[2]][0]
    # n 2 of 4, logprobs not asked: the two best, best first, without log-probabilities.
    samples = by_sample(generate(stack, **fields, n=2, best_of=4,
                                 sampling={**sampling, "seed": 11}))
    assert sorted(samples) == [0, 1]
    assert [tokens_of(samples[c]) for c in range(2)] == [alone[i][0] for i in best_first[:2]]
    assert not any(r.logprobs for replies in samples.values() for r in replies)
    # Asked for, the log-probabilities come with them.
    asked = by_sample(generate(stack, **fields, n=1, best_of=4, logprobs=0,
                               sampling={**sampling, "seed": 11}))
    assert tokens_of(asked[0]) == alone[best_first[0]][0]
    assert sum(lp.logprob for r in asked[0] for lp in r.logprobs) == pytest.approx(
        sums[0], abs=1e-4)


def test_samples_end_at_their_own_stop_strings(stack, embedded_greedy):
    expected = embedded_greedy(PROMPT, 12)
    stop = f"t{expected[3]}"
    samples = by_sample(generate(stack, prompt_token_ids=PROMPT, max_tokens=12, n=2, stop=[stop]))
    assert sorted(samples) == [0, 1]
    one = generate(stack, prompt_token_ids=PROMPT, max_tokens=12, stop=[stop])
    for replies in samples.values():
        assert replies[-1].finish_reason == "stop"
        assert "".join(r.text for r in replies) == "".join(r.text for r in one)
        assert tokens_of(replies) == tokens_of(one)


@pytest.mark.parametrize("fields,words", [
    ({"n": 0}, "n must be in 1..128, got 0"),
    ({"n": 129}, "n must be in 1..128, got 129"),
    ({"n": -1}, "n must be in 1..128"),
    ({"best_of": 0}, "best_of must be in 1..128, got 0"),
    ({"best_of": 200, "n": 2}, "best_of must be in 1..128"),
    ({"n": 3, "best_of": 2}, "best_of must be >= n, got best_of 2 and n 3"),
    ({"n": 4, "best_of": 3}, "best_of must be >= n"),
    ({"resume_request_id": "gen-0", "n": 2}, "n is not stored"),
    ({"resume_request_id": "gen-0", "best_of": 2}, "best_of is not stored"),
])
def test_bad_counts_are_invalid_argument(stack, fields, words):
    if "resume_request_id" not in fields:
        fields = {"prompt_token_ids": PROMPT, "max_tokens": 4, **fields}
    with pytest.raises(grpc.RpcError) as e:
        generate(stack, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert words in e.value.details()
