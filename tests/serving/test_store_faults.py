"""The request store against a real Redis: appends are idempotent by output position (a retried
write adds nothing twice), keys of running requests expire, an unreachable Redis answers within
its short timeout instead of blocking the engine thread, and the in-memory store forgets on the
same rule."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pytest
import redis

from dspark.serving.local_stack import free_port
from dspark.serving.store import (
    InMemoryRequestStore,
    RedisRequestStore,
    RoundUpdate,
    StoredRequest,
    StoreUnavailable,
)

REDIS_URL = "redis://127.0.0.1:6379/0"


def record(rid: str) -> StoredRequest:
    return StoredRequest(rid, [1, 2, 3], {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                          "seed": None}, 16, [0], owner="f" * 32)


@pytest.fixture
def store():
    prefix = f"dspark-test-{uuid.uuid4().hex[:8]}:"
    s = RedisRequestStore(REDIS_URL, prefix, ttl_seconds=3600)
    yield s
    r = redis.Redis.from_url(REDIS_URL)
    for key in r.scan_iter(prefix + "*"):
        r.delete(key)


def test_a_retried_append_adds_nothing_twice(store):
    store.create(record("a"))
    store.record_round([RoundUpdate("a", [7, 8], None, start=0)])
    store.record_round([RoundUpdate("a", [7, 8], None, start=0)])  # the same write, retried
    store.record_round([RoundUpdate("a", [8, 9, 10], None, start=1)])  # overlapping catch-up
    store.record_round([RoundUpdate("a", [11], "length", start=4)])
    got = store.get("a")
    assert got.output_ids == [7, 8, 9, 10, 11] and got.finish_reason == "length"
    assert got.owner == "f" * 32


def test_running_and_finished_keys_expire(store):
    store.create(record("b"))
    store.record_round([RoundUpdate("b", [4], None, start=0)])
    r = redis.Redis.from_url(REDIS_URL)
    for key in (f"{store.prefix}req:b", f"{store.prefix}req:b:out"):
        assert 0 < r.ttl(key) <= 3600


def test_an_unreachable_redis_answers_at_once():
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    proc = subprocess.Popen([redis_server, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                s = RedisRequestStore(f"redis://127.0.0.1:{port}/0", "t:", timeout_seconds=0.5,
                                      retry_seconds=1.0)
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        s.create(record("c"))
        proc.send_signal(19)  # SIGSTOP: Redis hangs (the worst case: nothing answers, no reset)
        start = time.monotonic()
        with pytest.raises(StoreUnavailable):
            s.record_round([RoundUpdate("c", [5], None, start=0)])
        assert time.monotonic() - start < 2.0
        start = time.monotonic()
        for _ in range(20):  # within retry_seconds: refused without waiting again
            with pytest.raises(StoreUnavailable):
                s.record_round([RoundUpdate("c", [5], None, start=0)])
        assert time.monotonic() - start < 0.5
        proc.send_signal(18)  # SIGCONT
        time.sleep(1.1)
        s.record_round([RoundUpdate("c", [5, 6], None, start=0)])
        assert s.get("c").output_ids == [5, 6]
    finally:
        proc.kill()
        proc.wait()


def test_the_in_memory_store_forgets_after_the_ttl():
    now = [0.0]
    s = InMemoryRequestStore(ttl_seconds=100, clock=lambda: now[0])
    s.create(record("old"))
    now[0] = 60
    s.create(record("new"))
    now[0] = 150
    s.record_round([RoundUpdate("old", [1], None, start=0)])  # a round keeps it alive
    assert s.get("old").output_ids == [1] and s.get("new") is not None
    now[0] = 200
    assert s.get("new") is None and s.get("old") is not None
    now[0] = 251
    assert s.get("old") is None
