"""Timing the target's forward at chosen flattened batch sizes: the measurement behind
`dspark profile` and the quick start-up cost table SPS(B) that `dspark generate`, the verifier
service and the benchmarks take when none is given (docs/design.md section 6).

The start-up table is cached in a file and drives the admission until the file is deleted, so
one measured on a busy machine must not be kept: each size is timed by its fastest forward,
and a table whose step times are not plausible for a forward (see :func:`implausibility`) is
measured again a bounded number of times, then used for the run but never cached, and a cached
one that fails the same check is measured again."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from dspark.cost_table import CostTable
from dspark.models.runner import ForwardItem, TargetRunner

logger = logging.getLogger(__name__)


def split_tokens(batch_tokens: int, max_requests: int) -> list[int]:
    """B tokens over min(B, max_requests) requests, as evenly as possible (larger shares first)."""
    n = min(batch_tokens, max_requests)
    return [batch_tokens // n + (1 if i < batch_tokens % n else 0) for i in range(n)]


def measure_step_seconds(runner: TargetRunner, batch_sizes: list[int], context_len: int,
                         requests: int, repeats: int, warmup: int, seed: int = 0,
                         statistic: Callable[[list[float]], float] = statistics.median,
                         clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """`statistic` (the median unless told) of the seconds of one forward at each batch size,
    over `repeats` forwards after `warmup`, timed by `clock`."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rids = [("profile", i) for i in range(requests)]
    for rid in rids:
        runner.add_request(rid)
    try:
        runner.forward([ForwardItem(rid, tokens(context_len)) for rid in rids])
        # Rounds over all sizes, not all repeats of one size in a row: a slow spell of the
        # machine (another process, a page-cache flush) then lands on one repeat of every size
        # instead of on every repeat of one size, which the median could not remove.
        times: list[list[float]] = [[] for _ in batch_sizes]
        for rep in range(warmup + repeats):
            for b, b_times in zip(batch_sizes, times):
                items = [ForwardItem(rid, tokens(n), logits_from=0)
                         for rid, n in zip(rids, split_tokens(b, requests))]
                start = clock()
                runner.forward(items)
                if rep >= warmup:
                    b_times.append(clock() - start)
                for it in items:
                    runner.truncate(it.request_id, context_len)
        return [statistic(b_times) for b_times in times]
    finally:
        for rid in rids:
            runner.free(rid)


# Batch sizes (flattened tokens) measured by the start-up profile: 36 forwards, 2-3 s for SmolLM2.
STARTUP_PROFILE_SIZES = (1, 2, 4, 8, 16, 32)

STARTUP_ATTEMPTS = 3
"""Most measurements of the start-up table (each 1 warm-up and 5 timed forwards a size) before
an implausible one is used for the run without being cached."""

MONOTONE_TOLERANCE = 0.2
"""How far (a fraction) a step time may fall below that of a smaller batch size and still be
plausible: a forward over more tokens does at least the same work, and measured staircases
(docs/design.md section 12) are flat, not falling, so a larger drop is a disturbed measurement."""

LINEAR_SLACK = 1.5
"""How far (a factor) T(B) may exceed B * T(1): a step costs a fixed part plus a part per token,
``T(B) = c + B * t`` with c, t >= 0, so ``T(B) <= B * T(1)``; the slack absorbs timing noise."""


def implausibility(batch_tokens: Sequence[int], step_seconds: Sequence[float]) -> str | None:
    """Why a profile (step seconds at increasing batch sizes) cannot be a forward's cost, or None
    when it can: a step time falling more than MONOTONE_TOLERANCE below a smaller size's, or
    above LINEAR_SLACK * B * T(B_first) / B_first. A table measured under interference reads
    e.g. 408 ms for 1 token, 1,435 ms for 2 and 490 ms for 4 (fails both)."""
    b0, t0 = batch_tokens[0], step_seconds[0]
    slowest_b, slowest = b0, t0
    for b, t in zip(batch_tokens, step_seconds):
        if t < (1.0 - MONOTONE_TOLERANCE) * slowest:
            return (f"T({b}) = {1000 * t:.1f} ms is more than {MONOTONE_TOLERANCE:.0%} below "
                    f"T({slowest_b}) = {1000 * slowest:.1f} ms")
        if t > LINEAR_SLACK * (b / b0) * t0:
            return (f"T({b}) = {1000 * t:.1f} ms exceeds {LINEAR_SLACK} * {b / b0:g} * "
                    f"T({b0}) = {1000 * LINEAR_SLACK * (b / b0) * t0:.1f} ms")
        if t > slowest:
            slowest_b, slowest = b, t
    return None


def startup_cost_table(runner, sizes=STARTUP_PROFILE_SIZES, context_len: int = 64,
                       attempts: int = STARTUP_ATTEMPTS,
                       clock: Callable[[], float] = time.perf_counter) -> CostTable:
    """Measure SPS(B) quickly on this machine (a short `dspark profile`): B tokens over up to 4
    requests of `context_len` cached tokens, the fastest of 5 forwards after 1 warm-up; while
    the table is implausible (:func:`implausibility`), up to `attempts` measurements in all,
    each size keeping its fastest forward over all of them.

    The fastest forward, not the median: interference (other processes, a page-cache flush)
    only ever adds time to a forward, so the least disturbed one estimates its cost best; a
    median of 5 on a machine at load 12 read 408 ms for 1 token, 1,435 ms for 2 and 490 ms for
    4. Sizes take turns (:func:`measure_step_seconds`), so a slow spell lands on one forward of
    every size. A size must not read too expensive: the admission policies only re-measure the
    batch sizes they choose, so one that looked expensive at start-up would never be chosen."""
    sizes = list(sizes)
    seconds = [float("inf")] * len(sizes)
    for attempt in range(1, attempts + 1):
        measured = measure_step_seconds(runner, sizes, context_len=context_len, requests=4,
                                        repeats=5, warmup=1, statistic=min, clock=clock)
        seconds = [min(a, b) for a, b in zip(seconds, measured)]
        problem = implausibility(sizes, seconds)
        if problem is None:
            break
        logger.warning("start-up cost table measurement %d of %d is implausible: %s",
                       attempt, attempts, problem)
    return CostTable.from_step_seconds(dict(zip(sizes, seconds)),
                                       meta={"source": "dspark generate start-up profile",
                                             "context_len": context_len,
                                             "forwards_per_size": 5 * attempt})


def cached_startup_cost_table(runner, path: Path | None, **measure_kwargs) -> CostTable:
    """The start-up table cached at `path`: read from it when it exists and is plausible, else
    measured (:func:`startup_cost_table`, given `measure_kwargs`) and written there when
    plausible. An implausible table, cached or measured, is never written: the cache would
    keep it for every later run."""
    if path is not None and Path(path).exists():
        table = CostTable.load(path)
        problem = implausibility(table.batch_tokens, table.step_seconds)
        if problem is None:
            return table
        logger.warning("ignoring the cost table %s (%s): measuring it again", path, problem)
    table = startup_cost_table(runner, **measure_kwargs)
    problem = implausibility(table.batch_tokens, table.step_seconds)
    if path is not None:
        if problem is None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            table.save(path)
        else:
            logger.warning("not caching the start-up cost table in %s (%s): using it for this "
                           "run only", path, problem)
    return table
