"""Forget requests nobody has touched for a while.

A scheduler that dies (killed, host lost) never releases its requests, so the verifier's KV
caches and the drafter's contexts would stay allocated forever. Each service notes when a
request was last used and, on its next call, frees the ones idle longer than the expiry. A
request that was in fact still alive loses nothing essential: the scheduler's RemoteVerifier
re-prefills a request the verifier no longer holds (NOT_FOUND), and a drafter without context
just drafts worse (verification stays exact).
"""

from __future__ import annotations

import time
from typing import Callable


class IdleExpiry:
    """Not thread-safe: call under the owning servicer's lock."""

    def __init__(self, expiry_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.expiry_seconds = expiry_seconds
        """0 = never expire."""
        self._clock = clock
        self._last_used: dict[str, float] = {}

    def touch(self, request_id: str) -> None:
        self._last_used[request_id] = self._clock()

    def forget(self, request_id: str) -> None:
        self._last_used.pop(request_id, None)

    def expired(self) -> list[str]:
        """Requests idle past the expiry (and no longer tracked)."""
        if not self.expiry_seconds:
            return []
        cutoff = self._clock() - self.expiry_seconds
        gone = [rid for rid, t in self._last_used.items() if t < cutoff]
        for rid in gone:
            del self._last_used[rid]
        return gone
