"""The engine loop under faults, on the embedded engine (tiny target and drafter, in process):
a store that fails for a while never stops generation and catches up afterwards; a cancel that
arrives while the loop is adding the request is not lost; every client gets a final event even
when ending its request fails; a KV cache smaller than all requests together queues them instead
of failing the round. References: each request's solo greedy output.

Also the metrics of the KV cache: the usage gauge follows a running request's blocks (its prompt
and outputs but the anchor, in blocks of 16) and is 0 once it is released; a round that
overflows the cache preempts a request (num_preemptions), which still gets its whole output, and
only a request the cache cannot hold alone is refused (kv_cache_full)."""

from __future__ import annotations

import logging
import queue

import pytest
from opentelemetry import trace

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.loading import load_method_drafter, load_target
from dspark.sampling import SamplingParams
from dspark.serving.cohorts import Cohorts
from dspark.serving.engine_loop import EngineLoop, StreamEvent, Submission
from dspark.serving.metrics import SchedulerMetrics
from dspark.serving.store import InMemoryRequestStore, StoredRequest
from loadtest.tiny_models import LAYER_IDS
from dspark.verifier import TargetVerifier

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [8, 8, 8]]
MAX_TOKENS = 24


class NoMetrics:
    """The metrics sink, recording nothing (the metrics have tests of their own)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def make_engine(models, kv_cache_tokens: int = 4096, **config) -> Engine:
    runner = load_target(models.target_dir, LAYER_IDS, kv_cache_tokens=kv_cache_tokens)
    drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
    return Engine(TargetVerifier(runner), drafter, CostTable.load(models.cost_table),
                  EngineConfig().with_values(policy="async_topk", update_cost_table=False, **config))


@pytest.fixture(scope="module")
def solo(tiny_models):
    """Each prompt's greedy output generated alone."""
    return {tuple(p): make_engine(tiny_models).generate([p], SamplingParams(temperature=0),
                                                        MAX_TOKENS)[0].output_ids
            for p in PROMPTS}


def submission(i: int, prompt: list[int], store=None) -> Submission:
    """Request r<i>, created in `store` as the gateway does before submitting."""
    rid = f"r{i}"
    record = StoredRequest(rid, prompt, {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                         "seed": None}, MAX_TOKENS, [])
    if store is not None:
        store.create(record)
    return Submission(rid, prompt, SamplingParams(temperature=0), MAX_TOKENS, [], record)


def drain(events: queue.Queue, timeout: float = 120) -> tuple[list[int], StreamEvent]:
    tokens = []
    while True:
        event = events.get(timeout=timeout)
        tokens += event.new_token_ids
        if event.finished:
            return tokens, event


def start_loop(engine: Engine, store, metrics=None) -> EngineLoop:
    loop = EngineLoop(engine, store, metrics or NoMetrics(), trace.get_tracer("test"),
                      logging.getLogger("test.engine_loop"), "tiny")
    loop.start()
    return loop


class FlakyStore(InMemoryRequestStore):
    """Round writes fail from the `fail_from`-th to the `fail_until`-th call; a failed write may
    first have applied (a timeout after Redis did the work), as `applied_anyway` says."""

    def __init__(self, fail_from: int, fail_until: int, applied_anyway: bool) -> None:
        super().__init__()
        self.calls = 0
        self.fail_from, self.fail_until, self.applied_anyway = fail_from, fail_until, applied_anyway

    def record_round(self, updates) -> None:
        self.calls += 1
        if self.fail_from <= self.calls < self.fail_until:
            if self.applied_anyway:
                super().record_round(updates)
            raise ConnectionError("store down")
        super().record_round(updates)


@pytest.mark.parametrize("applied_anyway", [False, True])
def test_a_failing_store_neither_stops_nor_corrupts_generation(tiny_models, solo, applied_anyway):
    store = FlakyStore(fail_from=2, fail_until=6, applied_anyway=applied_anyway)
    loop = start_loop(make_engine(tiny_models), store)
    try:
        streams = [loop.submit(submission(i, p, store)) for i, p in enumerate(PROMPTS)]
        for i, (p, events) in enumerate(zip(PROMPTS, streams)):
            tokens, last = drain(events)
            assert last.finish_reason == "length" and last.error is None
            assert tokens == solo[tuple(p)]
            stored = store.get(f"r{i}")
            assert stored.output_ids == tokens and stored.finish_reason == "length"
        assert store.calls >= 6
    finally:
        loop.stop(1.0)


def test_a_cancel_while_the_request_is_being_added_is_not_lost(tiny_models):
    """The client cancels from inside the engine's add_request: after the loop took the request
    from the inbox and before it is live, the window in which a disconnect used to be dropped."""
    engine = make_engine(tiny_models)
    loop = EngineLoop(engine, InMemoryRequestStore(), NoMetrics(), trace.get_tracer("test"),
                      logging.getLogger("test.engine_loop"), "tiny")
    cohorts = Cohorts([loop])
    add_request = engine.add_request

    def add_then_cancel(*args, **kwargs):
        rid = add_request(*args, **kwargs)
        cohorts.cancel(rid)
        return rid

    engine.add_request = add_then_cancel
    loop.start()
    try:
        tokens, last = drain(loop.submit(submission(0, PROMPTS[0])))
        assert last.finish_reason == "abort" and len(tokens) < MAX_TOKENS
        assert not loop.engine.has_unfinished()
    finally:
        loop.stop(1.0)


def test_every_client_gets_a_final_event_when_ending_fails(tiny_models):
    engine = make_engine(tiny_models)
    loop = start_loop(engine, InMemoryRequestStore())
    try:
        streams = [loop.submit(submission(i, p)) for i, p in enumerate(PROMPTS)]
        for events in streams:  # every request is running
            assert not events.get(timeout=120).finished

        def broken(*args, **kwargs):
            raise RuntimeError("verifier gone")

        engine.step = broken  # the round fails ...
        engine.abort = broken  # ... and so does releasing each request
        for events in streams:
            _, last = drain(events, timeout=30)
            assert last.finish_reason == "error" and "verifier gone" in last.error
    finally:
        loop.stop(1.0)


def test_requests_beyond_the_kv_cache_wait_instead_of_failing(tiny_models, solo):
    """96 KV tokens hold two of these requests' worst cases (prompt + 24 + gamma + 1 tokens in
    blocks of 16), not all four: without the reservation the cache overflows mid-round
    (KVCacheFull, which fails the round for every request)."""
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=96)
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    manager = runner.cache.manager
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                    EngineConfig(AdmissionConfig(policy="async_topk"),
                                 batching=BatchingConfig(kv_cache_tokens=manager.capacity_tokens,
                                                         kv_block_size=manager.block_size),
                                 update_cost_table=False))
    done = engine.generate(PROMPTS, SamplingParams(temperature=0), MAX_TOKENS)
    assert [r.output_ids for r in done] == [solo[tuple(p)] for p in PROMPTS]


def test_a_top_k_request_verified_beside_greedy_ones_hurts_no_one(tiny_models, solo):
    """The drafter returns a greedy request's block sparse with k = 1 and a top_k = 5 request's
    with k = 5; one round verifies both. Their supports have different widths and were
    concatenated as they were, failing the round for every request."""
    engine = make_engine(tiny_models)
    for p in PROMPTS[:2]:
        engine.add_request(p, SamplingParams(temperature=0), MAX_TOKENS)
    engine.add_request(PROMPTS[2], SamplingParams(temperature=1.0, top_k=5, seed=7), MAX_TOKENS)
    engine.add_request(PROMPTS[3], SamplingParams(temperature=0.8, top_k=2, seed=8), MAX_TOKENS)
    done = {}
    for out in engine.stream():
        done.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [done[i] for i in range(2)] == [solo[tuple(p)] for p in PROMPTS[:2]]
    assert all(len(done[i]) == MAX_TOKENS for i in (2, 3))


class RecordingMetrics(SchedulerMetrics):
    """The real metrics, also keeping (tokens generated so far, KV cache usage) each time the loop
    reports the usage (after each round's record_round, after each abort)."""

    def __init__(self) -> None:
        super().__init__("tiny")
        self.generated = 0
        self.kv_cache_usages: list[tuple[int, float]] = []

    def record_round(self, generated: int, *args, **kwargs) -> None:
        self.generated += generated
        super().record_round(generated, *args, **kwargs)

    def set_kv_cache_usage(self, usage: float) -> None:
        self.kv_cache_usages.append((self.generated, usage))
        super().set_kv_cache_usage(usage)

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, {"model_name": "tiny", **labels})
        assert value is not None, name
        return value


def test_kv_cache_usage_follows_a_running_request_and_returns_to_0(tiny_models, solo):
    engine = make_engine(tiny_models, kv_cache_tokens=4096)
    block_size = engine.verifier.runner.cache.manager.block_size
    num_blocks = engine.verifier.runner.cache.manager.num_blocks
    assert (block_size, num_blocks) == (16, 256)
    metrics = RecordingMetrics()
    loop = start_loop(engine, InMemoryRequestStore(), metrics)
    prompt = PROMPTS[2]  # 7 tokens
    try:
        tokens, last = drain(loop.submit(submission(0, prompt)))
        assert tokens == solo[tuple(prompt)] and last.finish_reason == "length"
    finally:
        loop.stop(1.0)  # joins the loop thread: its last report (after the final event) is in
    *running, finished = metrics.kv_cache_usages
    assert running and finished == (MAX_TOKENS, 0.0)
    for generated, usage in running:  # the cache holds prompt + outputs but the anchor
        assert 0 < generated < MAX_TOKENS
        assert usage == -(-(len(prompt) + generated - 1) // block_size) / num_blocks
    assert {usage for _, usage in running} == {1 / 256, 2 / 256}  # 7 + 23 tokens: 2 blocks
    assert metrics.sample("dspark:kv_cache_usage_perc") == 0.0


def test_rounds_that_overflow_the_kv_cache_preempt_and_lose_nothing(tiny_models, solo):
    """48 KV tokens (3 blocks) and no reservation in the engine: two requests outgrow the cache
    mid-generation; the newest is preempted and recomputed, both streams get their solo output,
    and a third request whose prompt the cache cannot hold even alone ends with an error."""
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=48)
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                    EngineConfig(AdmissionConfig(policy="async_topk"), update_cost_table=False))
    metrics = RecordingMetrics()
    loop = start_loop(engine, InMemoryRequestStore(), metrics)
    try:
        streams = [loop.submit(submission(i, p)) for i, p in enumerate(PROMPTS[:2])]
        too_long = loop.submit(submission(9, [5] * 60))
        for p, events in zip(PROMPTS[:2], streams):
            tokens, last = drain(events)
            assert last.finish_reason == "length" and last.error is None
            assert tokens == solo[tuple(p)]
        tokens, last = drain(too_long)
        assert tokens == [] and last.finish_reason == "error" and "KV cache" in last.error
    finally:
        loop.stop(1.0)
    assert engine.stats.preemptions > 0
    assert metrics.sample("dspark:num_preemptions_total") == engine.stats.preemptions
    assert metrics.sample("dspark:num_requests_refused_total", reason="kv_cache_full") == 1
    assert metrics.sample("dspark:num_requests_refused_total", reason="queue_full") == 0
    assert metrics.sample("dspark:kv_cache_usage_perc") == 0.0
    assert runner.cache.manager.usage == 0.0
