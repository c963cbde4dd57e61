"""Cohorts: keep the drafter and the verifier busy at the same time.

A strict draft-then-verify loop leaves each service idle half the time. Here the running
requests are split into `n` cohorts, each served by its own EngineLoop (its own Engine, its own
RemoteDrafter stream and RemoteVerifier channel, over the *same* services). The loops run in
their own threads, so while one cohort's round is being verified the other's is being drafted:
the services serialise their own work, and the two loops fall into alternation by themselves.
Each request stays in one cohort for its whole life, so its own sequence of draft, admission and
verification is exactly the single-loop one: losslessness is untouched. Nothing of the round
logic is duplicated: a cohort *is* the ordinary engine loop.

New requests go to the cohort with the fewest live requests; another sample of a prompt
(`Submission.fork_of`) goes where its first sample is, whose prompt caches it copies. The object offers the EngineLoop
interface (submit, cancel, is_live, queue_depth, start, stop), so front ends do not care.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from dspark.serving.engine_loop import EngineLoop, Submission


class Cohorts:
    def __init__(self, loops: list[EngineLoop]) -> None:
        if not loops:
            raise ValueError("at least one cohort")
        self.loops = loops
        self._lock = threading.Lock()

    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    def submit(self, submission: Submission) -> queue.Queue:
        with self._lock:  # pick and submit together, so concurrent submissions spread out
            siblings = [lp for lp in self.loops
                        if submission.fork_of is not None and lp.is_live(submission.fork_of)]
            loop = siblings[0] if siblings else min(self.loops, key=lambda lp: lp.num_live())
            return loop.submit(submission)

    def cancel(self, request_id: str) -> None:
        for loop in self.loops:
            if loop.is_live(request_id):
                loop.cancel(request_id)

    def is_live(self, request_id: str) -> bool:
        return any(loop.is_live(request_id) for loop in self.loops)

    def queue_depth(self) -> int:
        return sum(loop.queue_depth() for loop in self.loops)

    def num_running(self) -> int:
        return sum(len(loop.engine.running) for loop in self.loops)

    def stop(self, grace_seconds: float) -> None:
        """Drain every cohort at once (the grace period is shared, not summed)."""
        with ThreadPoolExecutor(len(self.loops)) as pool:
            list(pool.map(lambda loop: loop.stop(grace_seconds), self.loops))
