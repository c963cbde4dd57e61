"""The gateway's checks at the edge, on the gateway alone (a recording engine loop, the in-memory
store): every accepted parameter fits the proto field that will carry it, unexpected values are a
400 naming the field, prompts are bounded before tokenizing, request ids are random and bound to
the caller's key, two resumes of one id cannot both start it, and a full queue is a 429."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark.serving import messages
from dspark.serving.engine_loop import StreamEvent, Submission
from dspark.serving.store import InMemoryRequestStore, RequestStatus, StoredRequest
from services.scheduler.gateway import Gateway, InvalidRequest, Overloaded


class RecordingLoop:
    """The Cohorts interface, recording submissions; `live_check_seconds` widens the window
    between a resume's liveness check and its submission."""

    def __init__(self, live_check_seconds: float = 0.0) -> None:
        self.submitted: list[Submission] = []
        self.waiting = 0
        self.live_check_seconds = live_check_seconds

    def submit(self, submission: Submission) -> queue.Queue:
        self.submitted.append(submission)
        return queue.Queue()

    def is_live(self, request_id: str) -> bool:
        time.sleep(self.live_check_seconds)
        return any(s.request_id == request_id for s in self.submitted)

    def queue_depth(self) -> int:
        return self.waiting

    def cancel(self, request_id: str) -> None:
        pass


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.calls += 1
        return {"input_ids": [1 + len(w) % 60 for w in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(f"t{i}" for i in ids)


def make_gateway(loop=None, max_waiting: int = 8, max_prompt_chars: int = 1000) -> Gateway:
    return Gateway(loop or RecordingLoop(), InMemoryRequestStore(), CountingTokenizer(), "tiny",
                   max_tokens_limit=64, max_context_tokens=256, vocab_size=64,
                   stop_token_ids=[0], max_waiting=max_waiting, max_prompt_chars=max_prompt_chars)


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**31), ("top_k", 10**30), ("seed", 2**63), ("seed", -2**63 - 1),
    ("seed", 10**30), ("max_tokens", float("inf")), ("max_tokens", float("nan")),
    ("top_k", float("inf")), ("seed", float("-inf")), ("seed", float("nan")),
    ("max_tokens", 10**5000), ("temperature", 10**400), ("top_p", 10**400),
    ("temperature", float("nan")), ("max_tokens", "16"), ("seed", True), ("top_k", [1]),
], ids=lambda v: v if isinstance(v, str) else f"{type(v).__name__}")
def test_out_of_range_parameters_are_a_400_naming_the_field(field, value):
    g = make_gateway()
    with pytest.raises(InvalidRequest) as e:
        g.spec([1, 2, 3], **{field: value})
    assert e.value.status == 400 and e.value.param == field
    assert len(e.value.message) < 200  # a huge number is not echoed back


def test_extreme_accepted_parameters_fit_the_proto():
    spec = make_gateway().spec([1], top_k=2**31 - 1, seed=2**63 - 1, temperature=1e300)
    assert messages.sampling_to_pb(spec.sampling).top_k == 2**31 - 1
    assert make_gateway().spec([1], seed=-2**63).sampling.seed == -2**63


numbers = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(),
                    st.booleans(), st.none(), st.text(max_size=3))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=numbers, top_p=numbers, top_k=numbers, seed=numbers, max_tokens=numbers)
def test_whatever_the_gateway_accepts_travels(temperature, top_p, top_k, seed, max_tokens):
    """A spec the gateway accepts must convert to the proto the engine thread sends: a failure
    there would fail every request of the round, not this one."""
    try:
        spec = make_gateway().spec([1, 2], temperature=temperature, top_p=top_p, top_k=top_k,
                                   seed=seed, max_tokens=max_tokens)
    except InvalidRequest as e:
        assert e.status == 400
        return
    msg = messages.sampling_to_pb(spec.sampling)
    assert messages.sampling_from_pb(msg).top_k == spec.sampling.top_k


def test_prompt_text_is_bounded_before_tokenizing():
    g = make_gateway(max_prompt_chars=100)
    with pytest.raises(InvalidRequest, match="longer than 100 characters"):
        g.encode_prompt("t1 " * 40)
    with pytest.raises(InvalidRequest, match="longer than 100 characters"):
        g.encode_chat([{"role": "user", "content": "t1 " * 20}] * 2)
    with pytest.raises(InvalidRequest, match="longer than the context"):
        g.encode_prompt([1] * 257)
    assert g.tokenizer.calls == 0
    assert g.encode_prompt("t1 t2") == [3, 3] and g.tokenizer.calls == 1


def test_lone_surrogates_are_a_400():
    g = make_gateway()
    for bad in ("t1 \ud800", "\udfff"):
        with pytest.raises(InvalidRequest, match="lone surrogate"):
            g.encode_prompt(bad)
        with pytest.raises(InvalidRequest, match="lone surrogate"):
            g.encode_chat([{"role": "user", "content": bad}])
    assert g.tokenizer.calls == 0


def test_request_ids_are_128_random_bits():
    ids = {Gateway.new_request_id("cmpl") for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        kind, bits = rid.split("-")
        assert kind == "cmpl" and len(bits) == 32 and int(bits, 16) >= 0


def test_another_key_cannot_fetch_or_resume_and_is_told_nothing():
    g = make_gateway()
    rid = g.new_request_id()
    g.store.create(StoredRequest(rid, [1, 2], {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                               "seed": None}, 8, [0], owner="alice"))
    g.store.record_round([])
    assert g.fetch(rid, "alice").prompt_ids == [1, 2]
    for owner in ("bob", ""):
        for call in (g.fetch, g.resume):
            with pytest.raises(InvalidRequest) as e:
                call(rid, owner)
            assert e.value.status == 404 and rid not in e.value.message
    with pytest.raises(InvalidRequest) as unknown:
        g.fetch(g.new_request_id(), "bob")
    assert unknown.value.message == e.value.message  # the same answer as for an unknown id
    assert g.resume(rid, "alice") and len(g.loop.submitted) == 1


def test_a_started_request_is_bound_to_its_owner():
    g = make_gateway()
    stream = g.start(g.spec([1, 2], max_tokens=4), g.new_request_id(), owner="alice")
    assert g.loop.submitted[0].stored.owner == "alice"
    g.store.create(g.loop.submitted[0].stored)
    with pytest.raises(InvalidRequest):
        g.fetch(stream.request_id, "bob")


def test_two_concurrent_resumes_start_one_request():
    loop = RecordingLoop(live_check_seconds=0.05)
    g = make_gateway(loop)
    rid = g.new_request_id()
    g.store.create(StoredRequest(rid, [1, 2], {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                               "seed": None}, 8, [0], output_ids=[5],
                                 status=RequestStatus.RUNNING))
    outcomes: list[object] = []

    def resume() -> None:
        try:
            outcomes.append(g.resume(rid))
        except InvalidRequest as e:
            outcomes.append(e.status)

    threads = [threading.Thread(target=resume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loop.submitted) == 1 and 409 in outcomes


def test_a_full_queue_is_a_429_with_retry_after():
    loop = RecordingLoop()
    g = make_gateway(loop, max_waiting=3)
    loop.waiting = 3
    with pytest.raises(Overloaded) as e:
        g.start(g.spec([1], max_tokens=2), g.new_request_id())
    assert e.value.status == 429 and e.value.retry_after_seconds >= 1
    assert loop.submitted == []
    loop.waiting = 2
    g.start(g.spec([1], max_tokens=2), g.new_request_id())
    assert len(loop.submitted) == 1


def test_a_stream_emits_the_text_of_its_tokens():
    g = make_gateway()
    events: queue.Queue = queue.Queue()
    for tokens, finished in (([3, 4], False), ([], False), ([5], True)):
        events.put(StreamEvent(tokens, finished, "length" if finished else None))
    from services.scheduler.gateway import GenerationStream

    stream = GenerationStream(g, "cmpl-x", [1], [2], events)
    text = "".join(chunk.text for chunk in stream)
    assert text == " t3 t4 t5" and stream.output_ids == [2, 3, 4, 5]


def test_a_store_that_is_down_refuses_before_the_response_starts():
    class DownStore(InMemoryRequestStore):
        def create(self, record) -> None:
            raise ConnectionError("redis down")

    g = make_gateway()
    g.store = DownStore()
    with pytest.raises(InvalidRequest) as e:
        g.start(g.spec([1], max_tokens=2), g.new_request_id())
    assert e.value.status == 503 and g.loop.submitted == []


def test_ignore_eos_submits_no_stop_tokens_and_stores_that():
    loop = RecordingLoop()
    gateway = make_gateway(loop)
    gateway.start(gateway.spec([5, 6], max_tokens=4, ignore_eos=True), "r-ignore")
    gateway.start(gateway.spec([5, 6], max_tokens=4), "r-stops")
    ignoring, stopping = loop.submitted
    assert ignoring.stop_token_ids == [] and ignoring.stored.stop_token_ids == []
    assert stopping.stop_token_ids == list(gateway.stop_token_ids) != []
