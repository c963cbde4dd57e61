"""What must outlive the scheduler process: each request's prompt, parameters and produced tokens
(appended every round), and the cost table.

Two stores with one interface: `InMemoryRequestStore` (no URL configured: lives and dies with the
process) and `RedisRequestStore` (a `redis://` URL). Redis layout, all under one key prefix:
- `{prefix}req:{id}` hash: prompt_ids, sampling, stop_token_ids (JSON), max_tokens, status,
  finish_reason, created;
- `{prefix}req:{id}:out` list: produced token ids, RPUSHed once per round (one pipeline per round
  for all requests, so a round costs one round trip whatever the batch);
- `{prefix}cost_table:{name}` string: the CostTable as JSON.
Every request expires `ttl_seconds` after its last write: a finished one after it finished, a
running one (which a dead scheduler left behind, waiting to be resumed) after its last round.
The in-memory store forgets on the same rule.

Appending is idempotent: each append names the output position of its first token, and only the
tokens beyond what the list already holds are pushed (one Lua script, atomic in Redis). A write
that timed out but had in fact succeeded, retried, adds nothing twice; tokens of rounds whose
write failed are sent again with the next round's (the engine loop keeps them).

Faults: Redis calls time out after `timeout_seconds` with no retries, and after a failure the
store answers StoreUnavailable at once for `retry_seconds` instead of waiting again, so an
unreachable Redis costs the engine thread at most one short timeout per `retry_seconds`.

Semantics after a scheduler restart: a request whose status is still `running` but that no live
scheduler holds is *interrupted*: every token produced up to its last completed round is stored
and can be fetched; resuming it continues from exactly those tokens.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


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
    """temperature, top_k, top_p, seed, and the logits-processing fields that are on
    (services.scheduler.gateway.sampling_record)."""
    max_tokens: int
    stop_token_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    status: str = RequestStatus.RUNNING
    finish_reason: str = ""
    created: float = field(default_factory=time.time)
    owner: str = ""
    """Fingerprint of the API key that made it (dspark.serving.auth); '' without keys."""


@dataclass
class RoundUpdate:
    """One request's outcome of one round (or of several, after failed writes)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    """None while the request runs on."""
    start: int | None = None
    """Output position of new_token_ids[0]; None = append after whatever is stored."""


class StoreUnavailable(RuntimeError):
    """The store cannot be reached (now, or it failed less than retry_seconds ago)."""


def _missing_tail(stored: int, update: RoundUpdate) -> list[int]:
    """The tokens of `update` beyond the `stored` ones already held."""
    if update.start is None:
        return list(update.new_token_ids)
    return list(update.new_token_ids[max(0, stored - update.start):])


class RequestStore(Protocol):
    def create(self, record: StoredRequest) -> None: ...

    def record_round(self, updates: Sequence[RoundUpdate]) -> None: ...

    def get(self, request_id: str) -> StoredRequest | None: ...

    def save_cost_table(self, name: str, table: dict[str, Any]) -> None: ...

    def load_cost_table(self, name: str) -> dict[str, Any] | None: ...


class InMemoryRequestStore:
    def __init__(self, ttl_seconds: float = 7 * 24 * 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._requests: dict[str, StoredRequest] = {}
        self._written: dict[str, float] = {}
        """Per request, when it was last written (for the expiry)."""
        self._tables: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def _expire_locked(self) -> None:
        cutoff = self._clock() - self.ttl_seconds
        for rid in [rid for rid, t in self._written.items() if t < cutoff]:
            del self._written[rid], self._requests[rid]

    def create(self, record: StoredRequest) -> None:
        with self._lock:
            self._expire_locked()
            self._requests[record.request_id] = StoredRequest(
                **{**record.__dict__, "output_ids": list(record.output_ids)})
            self._written[record.request_id] = self._clock()

    def record_round(self, updates: Sequence[RoundUpdate]) -> None:
        with self._lock:
            for u in updates:
                r = self._requests.get(u.request_id)
                if r is None:
                    continue
                r.output_ids.extend(_missing_tail(len(r.output_ids), u))
                if u.finish_reason is not None:
                    r.status, r.finish_reason = RequestStatus.FINISHED, u.finish_reason
                self._written[u.request_id] = self._clock()

    def get(self, request_id: str) -> StoredRequest | None:
        with self._lock:
            self._expire_locked()
            r = self._requests.get(request_id)
            return None if r is None else StoredRequest(**{**r.__dict__,
                                                           "output_ids": list(r.output_ids)})

    def save_cost_table(self, name: str, table: dict[str, Any]) -> None:
        self._tables[name] = dict(table)

    def load_cost_table(self, name: str) -> dict[str, Any] | None:
        return self._tables.get(name)


# KEYS[1]: the output list; ARGV[1]: output position of ARGV[2]; ARGV[2..]: tokens. Pushes only
# the tokens beyond the list's length; a gap (the list shorter than the position) pushes nothing.
_APPEND_FROM = """
local held = redis.call('LLEN', KEYS[1])
local start = tonumber(ARGV[1])
if held < start then return -1 end
for i = 2 + held - start, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
return redis.call('LLEN', KEYS[1])
"""


class RedisRequestStore:
    def __init__(self, url: str, key_prefix: str = "dspark:", ttl_seconds: float = 7 * 24 * 3600.0,
                 timeout_seconds: float = 0.5, retry_seconds: float = 1.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries: redis-py's default retries with backoff can hold the engine thread for
        # about a minute per call while Redis is down; the engine loop re-sends what failed.
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                           socket_connect_timeout=timeout_seconds,
                                           retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._redis.ping()  # fail at start-up, not on the first request
        self.prefix = key_prefix
        self.ttl_seconds = int(max(1, ttl_seconds))
        self.retry_seconds = retry_seconds
        self._append = self._redis.register_script(_APPEND_FROM)
        self._down_until = 0.0

    def _key(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """Run one Redis exchange; a failure makes the next retry_seconds fail at once."""
        import redis

        if time.monotonic() < self._down_until:
            raise StoreUnavailable("the request store (Redis) is unreachable")
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._down_until = time.monotonic() + self.retry_seconds
            raise StoreUnavailable(f"the request store (Redis) is unreachable: {e}") from e

    def create(self, record: StoredRequest) -> None:
        key = self._key(record.request_id)
        pipe = self._redis.pipeline()
        pipe.delete(key, key + ":out")
        pipe.hset(key, mapping={
            "prompt_ids": json.dumps(record.prompt_ids), "sampling": json.dumps(record.sampling),
            "max_tokens": record.max_tokens, "stop_token_ids": json.dumps(record.stop_token_ids),
            "status": record.status, "finish_reason": record.finish_reason,
            "created": record.created, "owner": record.owner})
        if record.output_ids:
            pipe.rpush(key + ":out", *record.output_ids)
        pipe.expire(key, self.ttl_seconds)
        pipe.expire(key + ":out", self.ttl_seconds)
        self._guarded(pipe.execute)

    def record_round(self, updates: Sequence[RoundUpdate]) -> None:
        if not updates:
            return
        pipe = self._redis.pipeline(transaction=False)
        for u in updates:
            key = self._key(u.request_id)
            if u.new_token_ids and u.start is None:
                pipe.rpush(key + ":out", *u.new_token_ids)
            elif u.new_token_ids:
                self._append(keys=[key + ":out"], args=[u.start, *u.new_token_ids], client=pipe)
            if u.finish_reason is not None:
                pipe.hset(key, mapping={"status": RequestStatus.FINISHED,
                                        "finish_reason": u.finish_reason})
            pipe.expire(key, self.ttl_seconds)  # a running request lives ttl past its last round
            pipe.expire(key + ":out", self.ttl_seconds)
        self._guarded(pipe.execute)

    def get(self, request_id: str) -> StoredRequest | None:
        key = self._key(request_id)
        pipe = self._redis.pipeline()
        pipe.hgetall(key)
        pipe.lrange(key + ":out", 0, -1)
        fields, out = self._guarded(pipe.execute)
        if not fields:
            return None
        return StoredRequest(request_id=request_id, prompt_ids=json.loads(fields["prompt_ids"]),
                             sampling=json.loads(fields["sampling"]),
                             max_tokens=int(fields["max_tokens"]),
                             stop_token_ids=json.loads(fields["stop_token_ids"]),
                             output_ids=[int(t) for t in out], status=fields["status"],
                             finish_reason=fields.get("finish_reason", ""),
                             created=float(fields["created"]), owner=fields.get("owner", ""))

    def save_cost_table(self, name: str, table: dict[str, Any]) -> None:
        self._guarded(lambda: self._redis.set(f"{self.prefix}cost_table:{name}",
                                              json.dumps(table)))

    def load_cost_table(self, name: str) -> dict[str, Any] | None:
        text = self._guarded(lambda: self._redis.get(f"{self.prefix}cost_table:{name}"))
        return None if text is None else json.loads(text)


def open_store(redis_url: str, key_prefix: str = "dspark:",
               ttl_seconds: float = 7 * 24 * 3600.0) -> RequestStore:
    """Redis when a URL is configured, else the in-memory store."""
    if redis_url:
        return RedisRequestStore(redis_url, key_prefix, ttl_seconds)
    return InMemoryRequestStore(ttl_seconds)
