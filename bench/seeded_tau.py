"""What seeding costs in acceptance: tau of seeded against unseeded T = 1 requests, end to end.

The embedded engine generates each eval set's first `--limit` prompts (chat template) at
`--temperature` with the shipped drafter under `--policy` (async_topk by default), once with
every request seeded (seed = its index) and once unseeded (a fresh seed at admission). Under
async_topk and sync_greedy the two take different paths: a seeded request's drafts verified come
from its own confidences against the fixed cost model of dspark/seeded_admission.py, every block
position drafted and the drafting gate bypassed; unseeded requests are admitted together against
the cost table. tau = tokens per round of the requests' rounds; drafts = drafts verified per
round. The cost table is a fixed smooth one (TABLE), so the unseeded admission does not move with
the machine's load. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/seeded_tau.py [--limit 3] [--max-tokens 64] [--temperature 1]
        [--policy async_topk] [--sets gsm8k,math500,humaneval,mt-bench] [--threads 2]
        [--device auto|cpu|cuda[:N]]
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
from dspark.sampling import SamplingParams
from dspark.stop_tokens import stop_token_ids
from dspark.training.data import encode_chat
from dspark.verifier import TargetVerifier

SETS = ("gsm8k", "math500", "humaneval", "mt-bench")
# A smooth cost table (seconds per target step at each batch size): fixed, so that the unseeded
# requests' admission does not depend on how loaded the machine is while the table is measured.
TABLE = CostTable.from_step_seconds({b: 0.03 + 0.002 * b for b in (1, 2, 4, 8, 16, 32, 64)})


def run(runner, drafter, policy: str, prompts, temperature: float, max_tokens: int,
        max_running: int, stops, seeded: bool) -> list:
    engine = Engine(TargetVerifier(runner), drafter, TABLE,
                    EngineConfig().with_values(policy=policy, max_running=max_running,
                                               update_cost_table=False))
    ids = [engine.add_request(p, SamplingParams(temperature=temperature,
                                                seed=i if seeded else None), max_tokens, stops)
           for i, p in enumerate(prompts)]
    by_id = {r.request_id: r for r in engine.waiting}
    while engine.has_unfinished():
        engine.step()
    return [by_id[i] for i in ids]


def tau(requests) -> float:
    rounds = sum(r.metrics.rounds for r in requests)
    return (rounds + sum(r.metrics.drafts_accepted for r in requests)) / rounds


def drafts_per_round(requests) -> float:
    return sum(r.metrics.drafts_verified for r in requests) / sum(r.metrics.rounds
                                                                  for r in requests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    from transformers import AutoTokenizer

    model_dir = args.model_dir or ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DrafterConfig.load(args.checkpoint)
    runner = load_target(model_dir, tuple(config.target_layer_ids),
                         kv_cache_tokens=args.max_running * 4096, dtype=args.dtype, device=device)
    drafter = load_method_drafter(args.checkpoint, runner, apply_calibration=True)
    stops = stop_token_ids(tokenizer)
    print(f"# {cpu_line()}; torch {torch.__version__}, {device}, {args.threads} threads, "
          f"{args.dtype}; {args.checkpoint}, temperature {args.temperature:g}, {args.policy}, "
          f"{args.limit} prompts a set, {args.max_tokens} tokens", flush=True)
    print("| set | tokens seeded | tokens unseeded | tau seeded | tau unseeded | ratio "
          "| drafts/round seeded | unseeded |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name in args.sets.split(","):
        prompts = [encode_chat(tokenizer, t)
                   for t in read_eval_prompts(args.eval_dir / f"{name}.jsonl", args.limit)]
        by = {label: run(runner, drafter, args.policy, prompts, args.temperature,
                         args.max_tokens, args.max_running, stops, seeded)
              for label, seeded in (("seeded", True), ("unseeded", False))}
        rows[name] = {f"{k} {label}": v for label, reqs in by.items()
                      for k, v in (("tokens", sum(len(r.output_ids) for r in reqs)),
                                   ("tau", tau(reqs)), ("drafts", drafts_per_round(reqs)))}
        r = rows[name]
        print(f"| {name} | {r['tokens seeded']} | {r['tokens unseeded']} | {r['tau seeded']:.3f} "
              f"| {r['tau unseeded']:.3f} | {r['tau seeded'] / r['tau unseeded']:.3f} "
              f"| {r['drafts seeded']:.2f} | {r['drafts unseeded']:.2f} |", flush=True)
    macro = {label: statistics.fmean(r[f"tau {label}"] for r in rows.values())
             for label in ("seeded", "unseeded")}
    print(f"| macro | | | {macro['seeded']:.3f} | {macro['unseeded']:.3f} | "
          f"{macro['seeded'] / macro['unseeded']:.3f} | | |")
    print(json.dumps({"bench": "seeded_tau", "cpu": cpu_line(), "device": device,
                      "threads": args.threads, "dtype": args.dtype,
                      "temperature": args.temperature, "policy": args.policy,
                      "limit": args.limit, "max_tokens": args.max_tokens, "sets": rows,
                      "tau_macro": {k: round(v, 4) for k, v in macro.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
