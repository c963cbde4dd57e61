"""Timing the target's forward at chosen flattened batch sizes: the measurement behind
`dspark profile` and the quick start-up cost table SPS(B) that `dspark generate`, the verifier
service and the benchmarks take when none is given (docs/design.md section 6)."""

from __future__ import annotations

import statistics
import time

import torch

from dspark.cost_table import CostTable
from dspark.models.runner import ForwardItem, TargetRunner


def split_tokens(batch_tokens: int, max_requests: int) -> list[int]:
    """B tokens over min(B, max_requests) requests, as evenly as possible (larger shares first)."""
    n = min(batch_tokens, max_requests)
    return [batch_tokens // n + (1 if i < batch_tokens % n else 0) for i in range(n)]


def measure_step_seconds(runner: TargetRunner, batch_sizes: list[int], context_len: int,
                         requests: int, repeats: int, warmup: int,
                         seed: int = 0) -> list[float]:
    """Median seconds of one forward at each batch size (see the module docstring)."""
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
                start = time.perf_counter()
                runner.forward(items)
                if rep >= warmup:
                    b_times.append(time.perf_counter() - start)
                for it in items:
                    runner.truncate(it.request_id, context_len)
        return [statistics.median(b_times) for b_times in times]
    finally:
        for rid in rids:
            runner.free(rid)



# Batch sizes (flattened tokens) measured by the start-up profile: 36 forwards, 2-3 s for SmolLM2.
STARTUP_PROFILE_SIZES = (1, 2, 4, 8, 16, 32)


def startup_cost_table(runner, sizes=STARTUP_PROFILE_SIZES, context_len: int = 64) -> CostTable:
    """Measure SPS(B) quickly on this machine (a short `dspark profile`): B tokens over up to 4
    requests of `context_len` cached tokens, median of 5 forwards after 1 warm-up.

    Median of 5, not fewer: the admission policies only re-measure the batch sizes they choose,
    so a size that one slow start-up forward made look expensive would never be chosen again
    (a median of 2 once profiled B=2 at 122 ms against 77 ms at B=4)."""
    seconds = measure_step_seconds(runner, list(sizes), context_len=context_len, requests=4,
                                   repeats=5, warmup=1)
    return CostTable.from_step_seconds(dict(zip(sizes, seconds)),
                                       meta={"source": "dspark generate start-up profile",
                                             "context_len": context_len})
