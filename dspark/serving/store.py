"""What must outlive the scheduler process: each request's prompt, parameters and produced tokens
(appended every round), and the cost table.

Two stores with one interface: `InMemoryRequestStore` (no URL configured: lives and dies with the
process) and `RedisRequestStore` (a `redis://` URL). Redis layout, all under one key prefix:
- `{prefix}req:{id}` hash: prompt_ids, sampling, stop_token_ids (JSON), max_tokens, status,
  finish_reason, created;
- `{prefix}req:{id}:out` list: produced token ids, RPUSHed once per round (one pipeline per round
  for all requests, so a round costs one round trip whatever the batch);
- `{prefix}cost_table:{name}` string: the CostTable as JSON.
Finished requests expire after `finished_ttl_seconds`; a running one never does (it would be
lost while waiting to be resumed).

Semantics after a scheduler restart: a request whose status is still `running` but that no live
scheduler holds is *interrupted*: every token produced up to its last completed round is stored
and can be fetched; resuming it continues from exactly those tokens.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence


class RequestStatus:
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"
    """Running in the store but held by no live scheduler (reported, never written)."""


@dataclass
class StoredRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    """temperature, top_k, top_p, seed (dspark.sampling.SamplingParams fields)."""
    max_tokens: int
    stop_token_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    status: str = RequestStatus.RUNNING
    finish_reason: str = ""
    created: float = field(default_factory=time.time)


@dataclass
class RoundUpdate:
    """One request's outcome of one round."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    """None while the request runs on."""


class RequestStore(Protocol):
    def create(self, record: StoredRequest) -> None: ...

    def record_round(self, updates: Sequence[RoundUpdate]) -> None: ...

    def get(self, request_id: str) -> StoredRequest | None: ...

    def save_cost_table(self, name: str, table: dict[str, Any]) -> None: ...

    def load_cost_table(self, name: str) -> dict[str, Any] | None: ...


class InMemoryRequestStore:
    def __init__(self) -> None:
        self._requests: dict[str, StoredRequest] = {}
        self._tables: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def create(self, record: StoredRequest) -> None:
        with self._lock:
            self._requests[record.request_id] = record

    def record_round(self, updates: Sequence[RoundUpdate]) -> None:
        with self._lock:
            for u in updates:
                r = self._requests.get(u.request_id)
                if r is None:
                    continue
                r.output_ids.extend(u.new_token_ids)
                if u.finish_reason is not None:
                    r.status, r.finish_reason = RequestStatus.FINISHED, u.finish_reason

    def get(self, request_id: str) -> StoredRequest | None:
        with self._lock:
            r = self._requests.get(request_id)
            return None if r is None else StoredRequest(**{**r.__dict__,
                                                           "output_ids": list(r.output_ids)})

    def save_cost_table(self, name: str, table: dict[str, Any]) -> None:
        self._tables[name] = dict(table)

    def load_cost_table(self, name: str) -> dict[str, Any] | None:
        return self._tables.get(name)


class RedisRequestStore:
    def __init__(self, url: str, key_prefix: str = "dspark:",
                 finished_ttl_seconds: int = 7 * 24 * 3600) -> None:
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=5.0, decode_responses=True)
        self._redis.ping()  # fail at start-up, not on the first request
        self.prefix = key_prefix
        self.finished_ttl_seconds = finished_ttl_seconds

    def _key(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def create(self, record: StoredRequest) -> None:
        key = self._key(record.request_id)
        pipe = self._redis.pipeline()
        pipe.delete(key, key + ":out")
        pipe.hset(key, mapping={
            "prompt_ids": json.dumps(record.prompt_ids), "sampling": json.dumps(record.sampling),
            "max_tokens": record.max_tokens, "stop_token_ids": json.dumps(record.stop_token_ids),
            "status": record.status, "finish_reason": record.finish_reason,
            "created": record.created})
        if record.output_ids:
            pipe.rpush(key + ":out", *record.output_ids)
        pipe.execute()

    def record_round(self, updates: Sequence[RoundUpdate]) -> None:
        if not updates:
            return
        pipe = self._redis.pipeline(transaction=False)
        for u in updates:
            key = self._key(u.request_id)
            if u.new_token_ids:
                pipe.rpush(key + ":out", *u.new_token_ids)
            if u.finish_reason is not None:
                pipe.hset(key, mapping={"status": RequestStatus.FINISHED,
                                        "finish_reason": u.finish_reason})
                pipe.expire(key, self.finished_ttl_seconds)
                pipe.expire(key + ":out", self.finished_ttl_seconds)
        pipe.execute()

    def get(self, request_id: str) -> StoredRequest | None:
        key = self._key(request_id)
        pipe = self._redis.pipeline()
        pipe.hgetall(key)
        pipe.lrange(key + ":out", 0, -1)
        fields, out = pipe.execute()
        if not fields:
            return None
        return StoredRequest(request_id=request_id, prompt_ids=json.loads(fields["prompt_ids"]),
                             sampling=json.loads(fields["sampling"]),
                             max_tokens=int(fields["max_tokens"]),
                             stop_token_ids=json.loads(fields["stop_token_ids"]),
                             output_ids=[int(t) for t in out], status=fields["status"],
                             finish_reason=fields.get("finish_reason", ""),
                             created=float(fields["created"]))

    def save_cost_table(self, name: str, table: dict[str, Any]) -> None:
        self._redis.set(f"{self.prefix}cost_table:{name}", json.dumps(table))

    def load_cost_table(self, name: str) -> dict[str, Any] | None:
        text = self._redis.get(f"{self.prefix}cost_table:{name}")
        return None if text is None else json.loads(text)


def open_store(redis_url: str, key_prefix: str = "dspark:") -> RequestStore:
    """Redis when a URL is configured, else the in-memory store."""
    return RedisRequestStore(redis_url, key_prefix) if redis_url else InMemoryRequestStore()
