"""The admission's estimate of each round against what the round realised, in the embedded engine
under a closed loop of users, beside policy `none` in the same run.

What a load-test user does to the engine, minus the network (as `bench/closed_loop.py`):
`--users` greedy requests of `--max-tokens` run at once, and a finished one is replaced at once
by the next of the eval sets' first turns. The policies alternate, `--repeats` times, each
counted for `--seconds` after `--warmup-s`. For the first policy (a speculative one), every round
is logged:

- R (requests verified), B (tokens verified), prompt tokens read in the same forward;
- the cost table's estimate of the round, ``T_draft(R) + T(R, B)`` as the table stands at the
  round's verifier call (its drafting time already folded in), and the round's wall time
  (planning, drafting, verification, commit); a round that reads prompt tokens is estimated
  without them, as the admission does;
- the drafts' expected accepted tokens (sum over requests of the survival products of their
  confidences up to their admitted length) against the accepted tokens.

Prints, per kind of round (decode; verifies drafts; each with and without prompt tokens), the
rounds, the mean estimated and measured ms, the expected and accepted drafts, and the tokens/s
of each policy with their ratio; writes every round to `--out` as CSV. Usage:

    .venv/bin/python bench/admission_rounds.py [--users 16] [--policies async_topk,none]
        [--dtype bfloat16] [--seconds 60] [--repeats 2] [--threads 2] [--out runs/rounds.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from closed_loop import drive  # noqa: E402
from target_decode import chat_prompts  # noqa: E402

from dspark.admission import survival_probs  # noqa: E402
from dspark.devices import add_device_argument, resolve_device  # noqa: E402
from dspark.cost_table import CostTable  # noqa: E402
from dspark.cpu_info import cpu_description  # noqa: E402
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig  # noqa: E402
from dspark.fetch import ensure_model  # noqa: E402
from dspark.loading import build_engine, load_method_drafter, load_target  # noqa: E402
from dspark.models.drafter_io import DrafterConfig  # noqa: E402
from dspark.paths import EVAL_PROMPTS_DIR, REPO_ROOT  # noqa: E402
from dspark.step_result import RoundRecord, StepResult  # noqa: E402
from dspark.step_timing import startup_cost_table  # noqa: E402
from dspark.stop_tokens import stop_token_ids  # noqa: E402
from dspark.verifier import TargetVerifier  # noqa: E402

FIELDS = ["kind", "requests", "batch_tokens", "prompt_tokens", "estimated_ms", "measured_ms",
          "expected_accepted", "accepted"]


@dataclass
class Round:
    """One engine step that ran a target forward for running requests."""

    requests: int
    batch_tokens: int
    prompt_tokens: int
    estimated_ms: float
    measured_ms: float = 0.0
    expected_accepted: float = 0.0
    accepted: int = 0

    @property
    def kind(self) -> str:
        base = "verifies drafts" if self.batch_tokens > self.requests else "decode"
        return base + (" + prompt" if self.prompt_tokens else "")


@dataclass
class LoopResult:
    tokens: int = 0
    seconds: float = 0.0
    rounds: list[Round] = field(default_factory=list)


class RoundLog:
    """Wraps the engine's verifier call and round observer to build one :class:`Round` a step."""

    def __init__(self, engine: Engine) -> None:
        self.current: Round | None = None
        verify = engine.verifier.verify

        def logged_verify(requests, chunks=()):
            table, r = engine.cost_table, len(requests)
            if r == 0:  # a forward that only reads prompts
                return verify(requests, chunks)
            b = r + sum(int(q.num_drafts) for q in requests)
            drafting = table.draft_time(r) if b > r else 0.0
            estimate = drafting + float(table.step_time(b, num_requests=r))
            out = verify(requests, chunks)
            self.current = Round(r, out.batch_tokens, out.prefill_tokens, 1000 * estimate)
            return out

        engine.verifier.verify = logged_verify

    def observe(self, record: RoundRecord | None) -> None:
        """The round's drafted requests (`RoundStats.drafted`), if it drafted."""
        if self.current is None or record is None or record.num_accepted is None:
            return
        if len(record.request_ids) != self.current.requests:
            return  # a probe: its sample's drafts were not verified
        c = record.confidences.double().numpy()  # [R, positions drafted]
        lengths = np.asarray(record.num_admitted)  # [R]
        survival = survival_probs(c)  # [R, positions]
        mask = np.arange(c.shape[1])[None, :] < lengths[:, None]  # [R, positions]
        self.current.expected_accepted = float((survival * mask).sum())
        self.current.accepted = int(sum(record.num_accepted))

    def take(self) -> Round | None:
        done, self.current = self.current, None
        return done


def run_loop(engine: Engine, prompts: list[list[int]], stops: list[int], args,
             log: RoundLog | None) -> LoopResult:
    result = LoopResult()

    def keep_round(step_seconds: float, counted: bool, step: StepResult) -> None:
        if log is not None:
            log.observe(step.stats.drafted)
        done = log.take() if log is not None else None
        if counted and done is not None:
            done.measured_ms = 1000 * step_seconds
            result.rounds.append(done)

    window = drive(engine, prompts, stops, args.users, args.max_tokens, args.warmup_s,
                   args.seconds, keep_round)
    result.tokens, result.seconds = window.tokens, window.seconds
    return result


def summarise(rounds: list[Round]) -> list[dict]:
    rows = []
    for kind in ("decode", "decode + prompt", "verifies drafts", "verifies drafts + prompt"):
        these = [r for r in rounds if r.kind == kind]
        if not these:
            continue
        rows.append({
            "kind": kind, "rounds": len(these),
            "mean_requests": round(statistics.fmean(r.requests for r in these), 1),
            "mean_batch_tokens": round(statistics.fmean(r.batch_tokens for r in these), 1),
            "estimated_ms": round(statistics.fmean(r.estimated_ms for r in these), 1),
            "measured_ms": round(statistics.fmean(r.measured_ms for r in these), 1),
            "expected_accepted": round(statistics.fmean(r.expected_accepted for r in these), 2),
            "accepted": round(statistics.fmean(r.accepted for r in these), 2),
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--drafter-dir", type=Path, default=REPO_ROOT / "checkpoints" / "dspark-markov")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--policies", default="async_topk,none",
                        help="two policies, alternated; the first one's rounds are logged")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=256, help="distinct prompts in the loop")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="CSV of every logged round")
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if len(policies) != 2:
        parser.error("--policies takes two policies")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, args.prompts, args.eval_dir)
    stops = list(stop_token_ids(tokenizer))
    layer_ids = tuple(int(i) for i in DrafterConfig.load(args.drafter_dir).target_layer_ids)
    kv_tokens = args.users * (max(len(p) for p in prompts) + args.max_tokens + 64) + 256
    table = None
    runs: dict[str, list[LoopResult]] = {p: [] for p in policies}
    for _ in range(args.repeats):
        for policy in policies:  # a fresh target and drafter a run: nothing cached carries over
            runner = load_target(model_dir, layer_ids, kv_cache_tokens=kv_tokens, dtype=args.dtype, device=resolve_device(args.device))
            drafter = load_method_drafter(args.drafter_dir, runner, apply_calibration=True)
            table = table or startup_cost_table(runner)
            config = EngineConfig(AdmissionConfig(policy=policy),
                                  batching=BatchingConfig(max_running=args.users))
            engine = build_engine(TargetVerifier(runner), drafter,
                                  CostTable.from_dict(table.to_dict()), config)
            log = RoundLog(engine) if policy == policies[0] else None
            runs[policy].append(run_loop(engine, prompts, stops, args, log))
            del engine, drafter, runner

    logged = [r for result in runs[policies[0]] for r in result.rounds]
    rates = {p: [r.tokens / r.seconds for r in results] for p, results in runs.items()}
    ratios = [a / b for a, b in zip(rates[policies[0]], rates[policies[1]])]
    rows = summarise(logged)
    print(f"{args.users} users, {args.max_tokens} tokens, {args.dtype}, {args.threads} thread(s), "
          f"{cpu_description()}")
    print(f"\n| policy | tok/s (each run) |\n|---|---|")
    for p in policies:
        print(f"| {p} | {', '.join(f'{x:.1f}' for x in rates[p])} |")
    print(f"\n{policies[0]} / {policies[1]} per alternation: "
          f"{', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"\n{policies[0]}'s rounds:\n\n| kind | rounds | R | B | estimated ms | measured ms | "
          "expected accepted | accepted |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['kind']} | {row['rounds']} | {row['mean_requests']} | "
              f"{row['mean_batch_tokens']} | {row['estimated_ms']} | {row['measured_ms']} | "
              f"{row['expected_accepted']} | {row['accepted']} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(FIELDS)
            for r in logged:
                writer.writerow([r.kind, r.requests, r.batch_tokens, r.prompt_tokens,
                                 round(r.estimated_ms, 2), round(r.measured_ms, 2),
                                 round(r.expected_accepted, 3), r.accepted])
    print(json.dumps({"bench": "admission_rounds", "users": args.users, "max_tokens": args.max_tokens,
                      "dtype": args.dtype, "threads": args.threads, "policies": policies,
                      "tok_s": rates, "ratios": ratios, "rounds": rows, **cpu_description()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
