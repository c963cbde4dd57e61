"""The drafter-invariant rule's cost in acceptance: tau against the token rule, end to end.

The embedded engine generates each eval set's first `--limit` prompts (chat template) at
`--temperature` with the shipped drafter, every round verifying the whole block (policy
fixed:gamma, so tau measures acceptance only), once under the token rule and once under the
drafter-invariant rule (dspark.gumbel_verification), every request seeded (seed = its index).
tau = tokens per round of the requests' rounds. Also checks, on the first prompt, that the
invariant rule's output equals target-only decoding (policy none) with the same seed. Prints a
markdown table and one JSON line. Usage:
    .venv/bin/python bench/drafter_invariant.py [--limit 8] [--max-tokens 96]
        [--temperature 1] [--threads 2] [--dtype float32] [--device auto|cpu|cuda[:N]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from dspark.cost_table import CostTable
from dspark.cpu_info import cpu_line
from dspark.devices import add_device_argument, resolve_device
from dspark.engine import Engine, EngineConfig
from dspark.evaluation.eval_cli import read_eval_prompts
from dspark.fetch import ensure_model
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.paths import DEFAULT_DRAFTER, EVAL_PROMPTS_DIR
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from dspark.stop_tokens import stop_token_ids
from dspark.training.data import encode_chat
from dspark.verifier import TargetVerifier

SETS = ("gsm8k", "math500", "humaneval", "mt-bench")
# A flat cost table: admission plays no part under fixed:gamma and none.
FLAT = CostTable.from_step_seconds({b: 0.05 for b in (1, 2, 4, 8, 16, 32, 64)})


def run(runner, drafter, rule: VerificationRule, policy: str, prompts, temperature: float,
        max_tokens: int, max_running: int, stops) -> list:
    engine = Engine(TargetVerifier(runner, rule), drafter, FLAT,
                    EngineConfig().with_values(
                        policy=policy, max_running=max_running, update_cost_table=False))
    ids = [engine.add_request(p, SamplingParams(temperature=temperature, seed=i), max_tokens,
                              stops) for i, p in enumerate(prompts)]
    by_id = {r.request_id: r for r in engine.waiting}
    while engine.has_unfinished():
        engine.step()
    return [by_id[i] for i in ids]


def tau(requests) -> float:
    rounds = sum(r.metrics.rounds for r in requests)
    accepted = sum(r.metrics.drafts_accepted for r in requests)
    return (rounds + accepted) / rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = args.model_dir or ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DrafterConfig.load(args.checkpoint)
    runner = load_target(model_dir, tuple(config.target_layer_ids),
                         kv_cache_tokens=args.max_running * 4096, dtype=args.dtype,
                         device=resolve_device(args.device))
    drafter = load_method_drafter(args.checkpoint, runner, apply_calibration=True)
    stops = stop_token_ids(tokenizer)
    whole = f"fixed:{drafter.gamma}"
    print(f"# {cpu_line()}; torch {torch.__version__}, {args.threads} threads, {args.dtype}; "
          f"{args.checkpoint}, temperature {args.temperature:g}, {whole}, {args.limit} prompts "
          f"a set, {args.max_tokens} tokens", flush=True)
    print("| set | tokens | tau token rule | tau drafter-invariant | ratio |")
    print("|---|---:|---:|---:|---:|")
    rows, identical = {}, None
    for name in args.sets.split(","):
        prompts = [encode_chat(tokenizer, t)
                   for t in read_eval_prompts(args.eval_dir / f"{name}.jsonl", args.limit)]
        token = run(runner, drafter, VerificationRule.TOKEN, whole, prompts, args.temperature,
                    args.max_tokens, args.max_running, stops)
        invariant = run(runner, drafter, VerificationRule.DRAFTER_INVARIANT, whole, prompts,
                        args.temperature, args.max_tokens, args.max_running, stops)
        if identical is None:
            target_only = run(runner, None, VerificationRule.DRAFTER_INVARIANT, "none",
                              prompts[:1], args.temperature, args.max_tokens, 1, stops)
            identical = target_only[0].output_ids == invariant[0].output_ids
        rows[name] = {"tokens": sum(len(r.output_ids) for r in token),
                      "token": tau(token), "invariant": tau(invariant)}
        r = rows[name]
        print(f"| {name} | {r['tokens']} | {r['token']:.3f} | {r['invariant']:.3f} | "
              f"{r['invariant'] / r['token']:.3f} |", flush=True)
    token_macro = statistics.fmean(r["token"] for r in rows.values())
    invariant_macro = statistics.fmean(r["invariant"] for r in rows.values())
    print(f"| macro | | {token_macro:.3f} | {invariant_macro:.3f} | "
          f"{invariant_macro / token_macro:.3f} |")
    print(f"\nfirst prompt under the drafter-invariant rule == target-only decoding with the "
          f"same seed: {identical}")
    print(json.dumps({"bench": "drafter_invariant", "cpu": cpu_line(), "threads": args.threads,
                      "dtype": args.dtype, "temperature": args.temperature,
                      "policy": whole, "limit": args.limit, "max_tokens": args.max_tokens,
                      "sets": rows, "tau_macro": {"token": round(token_macro, 4),
                                                  "invariant": round(invariant_macro, 4)},
                      "identical_to_target_only": identical}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
