"""Block verification against the token rule on the same drafted blocks: expected accepted drafts.

The shipped drafter generates each eval set's first `--limit` prompts at `--temperature` with the
whole block verified every round (`dspark eval`'s protocol, token rule), or only its first
`--verify-len` drafts (a served admission verifies shorter blocks). Every sampled round's block
is also scored exactly, without drawing: the expected number of drafts the token rule keeps,
sum_k prod_{i<=k} min(1, P_i(x_i) / Q_i(x_i)), and the block rule's, sum_i i P(tau = i) from
`dspark.block_verification.stop_probabilities`. Both are expectations over the verifier's draws on
the same blocks, so the ratio carries none of the sampling noise that comparing two runs would.
Also the mean cost of one verification under each rule, timed on the recorded batches. Prints a
markdown table and one JSON line. Usage:
    .venv/bin/python bench/block_verification.py [--limit 10] [--max-tokens 128]
        [--temperature 1] [--threads 2] [--dtype bfloat16] [--verify-len 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.devices import add_device_argument, resolve_device
from dspark.block_verification import stop_probabilities
from dspark.cpu_info import cpu_line
from dspark.draft_packing import dense_draft_rows
from dspark.evaluation.acceptance import CollectConfig, collect_records
from dspark.evaluation.eval_cli import read_eval_prompts
from dspark.fetch import ensure_model
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.models.runner import TargetRunner
from dspark.paths import DEFAULT_DRAFTER, EVAL_PROMPTS_DIR
from dspark.random_draws import CounterGenerator, draw_uniforms
from dspark.rejection import VerificationRule, VerifyBatch, verify
from dspark.sampling import SamplingTensors, probs_from_logits
from dspark.stop_tokens import stop_token_ids
from dspark.training.data import encode_chat
from dspark.verifier import PackedRound, RoundVerdict, TargetVerifier, verify_round

SETS = ("gsm8k", "math500", "humaneval", "mt-bench")


def expected_accepted(batch: VerifyBatch) -> list[tuple[float, float]]:
    """(token rule, block rule) expected accepted drafts of every sampled request with drafts."""
    out = []
    starts = batch.draft_start().tolist()
    for r, (n, params) in enumerate(zip(batch.draft_lens.tolist(), batch.sampling)):
        if n == 0 or params.is_greedy:
            continue
        first = starts[r] + r
        P = probs_from_logits(batch.target_logits[first: first + n + 1],
                              SamplingTensors.from_params([params] * (n + 1))).double()
        Q = dense_draft_rows(batch.draft_probs, torch.arange(starts[r], starts[r] + n),
                             batch.vocab_size).double()
        x = batch.draft_tokens[starts[r]: starts[r] + n]
        ratio = P[torch.arange(n), x] / Q[torch.arange(n), x]
        token_rule = float(torch.cumprod(ratio.clamp(max=1.0), 0).sum())
        h = stop_probabilities(P, Q, x).tolist()
        block_rule, never_later = 0.0, 1.0
        for i in range(n, 0, -1):  # P(tau = i) = h_i prod_{j > i} (1 - h_j)
            block_rule += i * never_later * h[i - 1]
            never_later *= 1.0 - h[i - 1]
        out.append((token_rule, block_rule))
    return out


class ScoringVerifier(TargetVerifier):
    """The token-rule verifier whose verify step (`verify_round`) also scores every batch it
    verifies (`expected_accepted`) and keeps the first `keep` batches for timing."""

    def __init__(self, runner: TargetRunner, keep: int) -> None:
        super().__init__(runner, VerificationRule.TOKEN)
        self.keep = keep
        self.scores: list[tuple[float, float]] = []
        """(token rule, block rule) expected accepted drafts of every sampled round."""
        self.batches: list[VerifyBatch] = []
        """The first `keep` verified batches."""

    def verify_packed(self, packed: PackedRound, logits: torch.Tensor) -> RoundVerdict:
        verdict = verify_round(packed, logits, self.rule)
        if verdict.batch is not None:
            self.scores.extend(expected_accepted(verdict.batch))
            if len(self.batches) < self.keep:
                self.batches.append(verdict.batch)
        return verdict


def verify_ms(batches: list[VerifyBatch], rule: VerificationRule, repeats: int) -> float:
    """Median milliseconds of one `verify` over the recorded batches."""
    times = []
    for _ in range(repeats):
        for batch in batches:
            draws = draw_uniforms(batch.draft_lens, CounterGenerator(0),
                                  torch.arange(batch.num_requests))
            start = time.perf_counter()
            verify(batch, draws, rule)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--verify-len", type=int, default=None,
                        help="drafts verified a round (default: the whole block)")
    parser.add_argument("--timed-batches", type=int, default=40,
                        help="recorded batches each rule verifies again, timed")
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("the rules differ only for sampled requests: --temperature must be > 0")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model_dir or ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DrafterConfig.load(args.checkpoint)
    runner = load_target(model_dir, tuple(config.target_layer_ids),
                         kv_cache_tokens=args.max_running * 4096, dtype=args.dtype, device=resolve_device(args.device))
    drafter = load_method_drafter(args.checkpoint, runner)
    verify_len = args.verify_len or drafter.gamma
    if not 1 <= verify_len <= drafter.gamma:
        parser.error(f"--verify-len must lie in 1..{drafter.gamma}")
    print(f"# {cpu_line()}; torch {torch.__version__}, {args.threads} threads, {args.dtype}; "
          f"{args.checkpoint}, temperature {args.temperature:g}, the first {verify_len} of "
          f"{drafter.gamma} drafts verified", flush=True)
    print("| set | sampled rounds | E[accepted] token rule | E[accepted] block rule | "
          "tau token | tau block | block / token tau |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows, recorded = {}, []
    for name in args.sets.split(","):
        prompts = [encode_chat(tokenizer, t)
                   for t in read_eval_prompts(args.eval_dir / f"{name}.jsonl", args.limit)]
        verifier = ScoringVerifier(runner, keep=args.timed_batches - len(recorded))
        collect_records(verifier, drafter, prompts,
                        CollectConfig(verify_len=verify_len, temperature=args.temperature,
                                      max_tokens=args.max_tokens, max_running=args.max_running,
                                      stop_token_ids=stop_token_ids(tokenizer)))
        scores = verifier.scores
        recorded += verifier.batches
        if not scores:
            parser.error(f"{name}: no sampled round verified a draft")
        token_rule = statistics.fmean(s[0] for s in scores)
        block_rule = statistics.fmean(s[1] for s in scores)
        rows[name] = {"rounds": len(scores), "token": token_rule, "block": block_rule}
        print(f"| {name} | {len(scores)} | {token_rule:.3f} | {block_rule:.3f} | "
              f"{1 + token_rule:.3f} | {1 + block_rule:.3f} | "
              f"{(1 + block_rule) / (1 + token_rule):.3f} |", flush=True)
    token_macro = statistics.fmean(1 + r["token"] for r in rows.values())
    block_macro = statistics.fmean(1 + r["block"] for r in rows.values())
    print(f"| macro | | | | {token_macro:.3f} | {block_macro:.3f} | "
          f"{block_macro / token_macro:.3f} |")
    costs = {rule.value: verify_ms(recorded, rule, repeats=3) for rule in VerificationRule}
    print(f"\none verification of the recorded batches ({len(recorded)} of up to "
          f"{args.max_running} requests x {verify_len} drafts), median ms: "
          + ", ".join(f"{k} rule {v:.2f}" for k, v in costs.items()))
    print(json.dumps({"bench": "block_verification", "cpu": cpu_line(), "threads": args.threads,
                      "temperature": args.temperature, "verify_len": verify_len, "sets": rows,
                      "tau_macro": {"token": round(token_macro, 4), "block": round(block_macro, 4)},
                      "verify_ms": {k: round(v, 3) for k, v in costs.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
