"""Benchmark of the exact core on CPU: one admission decision and one batched verification.

- Admission: one decision for 256 requests x gamma = 16 under every policy (goal: < 1 ms median
  for async_topk and sync_greedy), beside a literal Python loop of Algorithm 1 as the in-process
  baseline.
- Verification: one `dspark.rejection.verify` for 64 requests x gamma = 7 at vocabulary 49152,
  dense and sparse (top-k) draft distributions, greedy and temperature 1.0 with top-p 0.9, beside
  the per-request `verify_reference` as the baseline.

Prints a markdown table and ends with one JSON line. Usage:
    .venv/bin/python bench/core_ops.py [--repeats 300] [--verify-repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np
import torch

from dspark.admission import AdmissionConfig, Admitter, survival_probs
from dspark.cost_table import CostTable, ThetaObjective
from dspark.cpu_info import cpu_line
from dspark.draft_packing import SparseDraftProbs
from dspark.random_draws import CounterGenerator, draw_uniforms
from dspark.rejection import VerifyBatch, verify, verify_reference
from dspark.sampling import SamplingParams

ADMISSION_GOAL_MS = 1.0


def median_ms(fn: Callable[[int], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of fn(i) in milliseconds over `repeats` calls (after `warmup` calls)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def staircase_table(max_b: int) -> CostTable:
    """A GPU-like profile: 8 ms plus 1 ms per started bucket of 128 tokens, measured every 16 tokens."""
    return CostTable.from_step_seconds(
        {b: 0.008 + 0.001 * ((b + 127) // 128) for b in range(16, max_b + 1, 16)} | {1: 0.009},
        meta={"source": "synthetic staircase for bench/core_ops.py"},
    )


def algorithm_1_loop(c: np.ndarray, table: CostTable) -> list[int]:
    """Baseline: the paper's Algorithm 1 as a literal Python loop (sort, then admit with break)."""
    a = survival_probs(c)
    num_requests, gamma = a.shape
    cands = sorted(
        ((a[r, j], j, r) for r in range(num_requests) for j in range(gamma) if a[r, j] > 0),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    lengths, best = [0] * num_requests, [0] * num_requests
    batch, tau = num_requests, float(num_requests)
    theta_best = tau * table.sps(batch)
    for value, j, r in cands:
        lengths[r], batch, tau = j + 1, batch + 1, tau + value
        theta = tau * table.sps(batch)
        if theta <= theta_best:
            break
        theta_best, best = theta, list(lengths)
    return best


def bench_admission(num_requests: int, gamma: int, repeats: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    table = staircase_table(2 * num_requests * (gamma + 1))
    # A pool of confidence blocks [num_requests, gamma] (float32, as the drafter emits them):
    # confident early positions, with some exact 1.0 (tie) values.
    pool = []
    for _ in range(16):
        c = 0.55 + 0.45 * torch.rand(num_requests, gamma, generator=g)
        c[torch.rand(num_requests, gamma, generator=g) < 0.05] = 1.0
        pool.append(c)
    rows = []
    for policy in ("none", "fixed:1", f"fixed:{gamma}", "threshold:0.5", "sync_greedy", "async_topk"):
        admitter = Admitter(AdmissionConfig(policy=policy, objective=ThetaObjective.PAPER), table)
        ms = median_ms(lambda i: admitter.admit(pool[i % len(pool)], step_index=i), repeats)
        lengths = admitter.admit(pool[0], step_index=10**6)
        rows.append({"op": f"admit {policy}", "ms": ms, "verified_tokens": int(lengths.sum())})

    # async_topk as served: the cost table also learns the last step's time before each decision.
    admitter = Admitter(AdmissionConfig(policy="async_topk", objective=ThetaObjective.PAPER), table)

    def served(i: int) -> None:
        table.observe(num_requests, num_requests + 64 * (i % 8), 0.012)
        admitter.admit(pool[i % len(pool)], step_index=i)

    rows.append({"op": "admit async_topk + cost_table.observe", "ms": median_ms(served, repeats)})
    loop_repeats = max(3, repeats // 30)
    c0 = pool[0].numpy()
    ms = median_ms(lambda i: algorithm_1_loop(c0, table), loop_repeats)
    rows.append({"op": "baseline: Algorithm 1 as a Python loop", "ms": ms})
    return rows


def make_verify_batch(num_requests: int, gamma: int, vocab_size: int, sparse_k: int, sampling: SamplingParams,
                      g: torch.Generator) -> VerifyBatch:
    """A full-block batch whose drafts come from top-k-truncated draft distributions (argmax in
    greedy mode) and whose target logits are the draft's plus noise, so some drafts are accepted."""
    num_drafts = num_requests * gamma
    draft_logits = 3.0 * torch.randn(num_drafts, vocab_size, generator=g)  # [num_drafts, vocab_size]
    top = torch.topk(draft_logits, sparse_k, dim=1)
    top_probs = torch.softmax(top.values, dim=1)  # [num_drafts, sparse_k]
    if sampling.is_greedy:
        pick = torch.zeros(num_drafts, dtype=torch.int64)
    else:
        pick = torch.multinomial(top_probs, 1, generator=g).squeeze(1)  # [num_drafts]
    draft_tokens = top.indices.gather(1, pick.unsqueeze(1)).squeeze(1)  # [num_drafts]
    # target row of draft k of request r is row k + r; the bonus rows get their own noise
    target_logits = 3.0 * torch.randn(num_drafts + num_requests, vocab_size, generator=g)
    draft_rows = torch.arange(num_drafts) + torch.arange(num_drafts) // gamma  # [num_drafts]
    target_logits[draft_rows] = draft_logits + 1.0 * torch.randn(num_drafts, vocab_size, generator=g)
    return VerifyBatch(
        draft_tokens=draft_tokens,
        draft_lens=torch.full((num_requests,), gamma, dtype=torch.int64),
        draft_probs=SparseDraftProbs(indices=top.indices, probs=top_probs),
        target_logits=target_logits,
        sampling=[sampling] * num_requests,
    )


def densify(batch: VerifyBatch) -> VerifyBatch:
    sparse = batch.draft_probs
    dense = torch.zeros(sparse.indices.shape[0], batch.vocab_size).scatter_(1, sparse.indices, sparse.probs)
    return VerifyBatch(batch.draft_tokens, batch.draft_lens, dense, batch.target_logits, batch.sampling)


def bench_verify(num_requests: int, gamma: int, vocab_size: int, sparse_k: int, repeats: int,
                 seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    modes = {"greedy": SamplingParams(temperature=0.0), "T=1.0 top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9)}
    for mode, params in modes.items():
        sparse_batch = make_verify_batch(num_requests, gamma, vocab_size, sparse_k, params, g)
        dense_batch = densify(sparse_batch)
        draws = draw_uniforms(sparse_batch.draft_lens, CounterGenerator(0),
                              torch.arange(num_requests))
        for probs_kind, batch in (("dense", dense_batch), (f"sparse top-{sparse_k}", sparse_batch)):
            ms = median_ms(lambda i: verify(batch, draws), repeats, warmup=1)
            result = verify(batch, draws)
            rows.append({"op": f"verify {probs_kind}, {mode}", "ms": ms,
                         "mean_accepted": float(result.num_accepted.float().mean())})
        ms = median_ms(lambda i: verify_reference(dense_batch, draws), max(1, repeats // 2), warmup=0)
        rows.append({"op": f"baseline: verify_reference dense, {mode}", "ms": ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="admission: requests")
    parser.add_argument("--gamma", type=int, default=16, help="admission: draft block size")
    parser.add_argument("--repeats", type=int, default=300, help="admission: timed calls per policy")
    parser.add_argument("--verify-requests", type=int, default=64)
    parser.add_argument("--verify-gamma", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--sparse-k", type=int, default=32, help="support size of sparse draft distributions")
    parser.add_argument("--verify-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on the shared 2-core machines two OpenMP threads "
                             "competing with other processes run several times slower)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    admission = bench_admission(args.requests, args.gamma, args.repeats, args.seed)
    verification = bench_verify(args.verify_requests, args.verify_gamma, args.vocab, args.sparse_k,
                                args.verify_repeats, args.seed)
    print(f"CPU: {cpu_line()}; torch threads: {torch.get_num_threads()}")
    print(f"\nAdmission, {args.requests} requests x gamma={args.gamma} (median of {args.repeats})\n")
    print("| op | median ms | verified tokens |\n|---|---|---|")
    for row in admission:
        print(f"| {row['op']} | {row['ms']:.3f} | {row.get('verified_tokens', '')} |")
    print(f"\nVerification, {args.verify_requests} requests x gamma={args.verify_gamma}, vocab {args.vocab} "
          f"(median of {args.verify_repeats})\n")
    print("| op | median ms | mean accepted |\n|---|---|---|")
    for row in verification:
        acc = f"{row['mean_accepted']:.2f}" if "mean_accepted" in row else ""
        print(f"| {row['op']} | {row['ms']:.1f} | {acc} |")
    by_op = {row["op"]: round(row["ms"], 4) for row in admission + verification}
    goal_met = all(by_op[f"admit {p}"] < ADMISSION_GOAL_MS for p in ("sync_greedy", "async_topk"))
    print(json.dumps({"bench": "core_ops", "admission_ms": {r["op"]: round(r["ms"], 4) for r in admission},
                      "verify_ms": {r["op"]: round(r["ms"], 2) for r in verification},
                      "admission_goal_ms": ADMISSION_GOAL_MS, "admission_goal_met": goal_met,
                      "config": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
