"""Where a speculative policy's rounds go at one stream: every round tallied by what it did (its
`RoundMode`) and how many tokens it verified, beside the same prompts decoded by the target alone.

The e2e prompts (`--limit` first turns of each eval set, chat-formatted; or with `--heldout N` the
first N held-out prompts of the drafter's answers file) run one after another,
greedy, `--max-tokens` each, through the embedded engine under `--policy` (with the shipped
drafter), then under policy `none`, `--repeats` times in turns, on one target runner (`--weights`,
default the CPU's: q4 where the block kernel builds). The table gives, per (mode, tokens
verified): rounds, drafts proposed / admitted / accepted, and the mean drafting, verification
and whole-step milliseconds a round (TARGET_ONLY: policy `none`'s rounds); a drafting round that
verified nothing (B = 1) is a probe or a round whose admission took none. Then the cost table's learned drafting time and T(B) at one
request, and each run's wall seconds. Usage:

    .venv/bin/python bench/round_modes.py [--policy async_topk] [--limit 2 | --heldout 12] [--max-tokens 96] [--repeats 2]
        [--weights q4] [--drafter-weights q8|dense] [--threads 1] [--model-dir DIR] [--drafter-dir DIR]
        [--eval-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from dspark.cpu_info import cpu_description, cpu_line
from dspark.paths import EVAL_PROMPTS_DIR, REPO_ROOT

DATASETS = ("gsm8k", "humaneval", "mt-bench")


def run_prompts(engine, prompts, max_tokens: int, stops, tally: dict) -> tuple[int, float]:
    """Each prompt to completion, one after another, greedy; adds every verified round to `tally`
    [(mode, batch_tokens)] -> counts and seconds (`step_s`: the whole step, from the step before
    it to its result). Returns (tokens, wall seconds)."""
    from dspark.sampling import SamplingParams

    tokens, start = 0, time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0.0), max_tokens, stops)
        before = time.perf_counter()
        for result in engine.steps():
            now = time.perf_counter()
            step_s, before = now - before, now
            tokens += result.new_tokens
            s = result.stats
            if not s.verified:
                continue
            row = tally[(s.mode.name if s.mode is not None else "-", s.batch_tokens)]
            row["rounds"] += 1
            row["step_s"] += step_s
            row["proposed"] += s.drafts_proposed
            row["admitted"] += s.drafts_admitted
            row["accepted"] += s.drafts_accepted
            row["draft_s"] += s.seconds.draft
            row["verify_s"] += s.seconds.verify
    return tokens, time.perf_counter() - start


@dataclasses.dataclass
class OneStream:
    """A target runner, the drafter on it and the e2e prompts, for engines of one request at a time."""

    model_dir: Path
    prompts: list[list[int]]
    stops: list[int]
    runner: object
    drafter: object
    table: object
    """The start-up cost table measured on the runner (each engine gets a copy)."""

    def engines(self, policies: list[str], variants: dict[str, dict] | None = None) -> dict[str, object]:
        """One engine per policy over the runner and drafter, max_running 1, warmed up (kernels
        built, first-call costs paid); `variants`: more engines, label -> (policy and other
        EngineConfig fields by name, `EngineConfig.with_values`)."""
        from dspark.cost_table import CostTable
        from dspark.engine import BatchingConfig, EngineConfig
        from dspark.loading import build_engine
        from dspark.sampling import SamplingParams

        specs = {policy: {"policy": policy} for policy in policies} | (variants or {})
        base = EngineConfig(batching=BatchingConfig(max_running=1))
        engines = {label: build_engine(self.runner, self.drafter, CostTable.from_dict(self.table.to_dict()),
                                       base.with_values(**values))
                   for label, values in specs.items()}
        for engine in engines.values():
            engine.generate([self.prompts[0]], SamplingParams(temperature=0.0), 8, self.stops)
        return engines


def parse_variant(text: str, policy: str) -> dict:
    """`NAME=VALUE[,NAME=VALUE...]` (EngineConfig fields by name; values as Python literals where
    they parse, else strings) over `policy`."""
    import ast

    values = {"policy": policy}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--variant wants NAME=VALUE, got {item!r}")
        try:
            values[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            values[name.strip()] = value.strip()
    return values


def add_one_stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments `one_stream` reads (this script's and bench/speculation_ceiling.py's)."""
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--drafter-dir", default=str(REPO_ROOT / "checkpoints" / "dspark-markov"))
    parser.add_argument("--eval-dir", default=str(EVAL_PROMPTS_DIR))
    parser.add_argument("--limit", type=int, default=2, help="prompts per eval set")
    parser.add_argument("--heldout", type=int, default=0,
                        help="instead of the eval sets' prompts, the first N of the held-out split of "
                             "--answers (prompts the drafter never trained on, from its own data)")
    parser.add_argument("--answers", default=str(REPO_ROOT / "data" / "answers" / "greedy.jsonl.gz"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--weights", default=None, help="the target's: q4 or dense (default: the CPU's)")
    parser.add_argument("--drafter-weights", default=None, choices=["q8", "dense"],
                        help="the drafter's (dspark.loading.choose_drafter_weights; default dense)")
    parser.add_argument("--threads", type=int, default=1)


def one_stream(args: argparse.Namespace, table_sizes: tuple[int, ...]) -> OneStream:
    """The runner (`--weights`), the drafter (`--drafter-weights`), the start-up cost table at
    `table_sizes` and the prompts: the e2e prompts (`--limit` first turns of each eval set,
    chat-formatted) or `--heldout` held-out ones."""
    from transformers import AutoTokenizer

    from dspark.evaluation.eval_cli import read_eval_prompts
    from dspark.fetch import ensure_model
    from dspark.loading import load_method_drafter, load_target
    from dspark.models.drafter_config import DrafterConfig
    from dspark.step_timing import startup_cost_table
    from dspark.stop_tokens import stop_token_ids
    from dspark.training.data import encode_chat

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.heldout:
        from served_vs_teacher_forced import heldout_prompts
        prompts = heldout_prompts(args.answers, "heldout", args.heldout)
    else:
        prompts = [encode_chat(tokenizer, t) for name in DATASETS
                   for t in read_eval_prompts(Path(args.eval_dir) / f"{name}.jsonl", args.limit)]
    drafter_dir = Path(args.drafter_dir)
    drafter_config = DrafterConfig.load(drafter_dir)
    layer_ids = tuple(int(i) for i in drafter_config.target_layer_ids)
    # one request at a time (its prompt, its tokens, two blocks of drafts), and room for the
    # start-up cost table's 4 profile requests
    kv_tokens = max(4096, max(len(p) for p in prompts) + args.max_tokens + 2 * drafter_config.block_size + 256)
    runner = load_target(model_dir, layer_ids, kv_cache_tokens=kv_tokens, device="cpu", dtype="float32",
                         weights=args.weights)
    drafter = load_method_drafter(drafter_dir, runner, apply_calibration=True, weights=args.drafter_weights)
    return OneStream(model_dir, prompts, stop_token_ids(tokenizer), runner, drafter,
                     startup_cost_table(runner, sizes=table_sizes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=VALUE[,NAME=VALUE]: also run --policy with these EngineConfig fields "
                             "(e.g. fresh_trim=False), in turns with the others; repeatable")
    add_one_stream_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    setup = one_stream(args, table_sizes=(1, 2, 4, 8, 16))
    prompts, stops = setup.prompts, setup.stops
    variants = {f"{args.policy} {v}": parse_variant(v, args.policy) for v in args.variant}
    engines = setup.engines([args.policy, "none"], variants)

    tallies: dict[str, dict] = {label: collections.defaultdict(collections.Counter) for label in engines}
    walls: dict[str, list[float]] = {p: [] for p in engines}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for label, engine in engines.items():
            n, wall = run_prompts(engine, prompts, args.max_tokens, stops, tallies[label])
            walls[label].append(wall)
            tokens[label] = n

    print(f"\nCPU: {cpu_line()}; torch threads {args.threads}; load average {os.getloadavg()[0]:.1f}; "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, one stream, {args.repeats} repeats\n")
    print("| engine | mode | tokens verified | rounds | proposed | admitted | accepted | draft ms a round | verify ms a round | step ms a round |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for label, tally in tallies.items():
        for (mode, b), row in sorted(tally.items(), key=lambda kv: kv[0]):
            n = row["rounds"]
            rows.append({"engine": label, "mode": mode, "batch_tokens": b, "rounds": n, "proposed": row["proposed"],
                         "admitted": row["admitted"], "accepted": row["accepted"],
                         "draft_ms": round(row["draft_s"] / n * 1e3, 2), "verify_ms": round(row["verify_s"] / n * 1e3, 2),
                         "step_ms": round(row["step_s"] / n * 1e3, 2)})
            r = rows[-1]
            print(f"| {label} | {mode} | {b} | {n} | {r['proposed']} | {r['admitted']} | {r['accepted']} | "
                  f"{r['draft_ms']} | {r['verify_ms']} | {r['step_ms']} |")
    learned = {}
    for label in engines:
        if label == "none":
            continue
        table = engines[label].cost_table
        learned[label] = {"draft_ms": round(table.draft_time(1) * 1e3, 2),
                          "step_ms": [round(float(table.step_time(b, 1)) * 1e3, 1) for b in range(1, 9)]}
        print(f"\n{label}, learned at one request: drafting {learned[label]['draft_ms']} ms a round; "
              f"T(1..8) {learned[label]['step_ms']} ms")
    for label, w in walls.items():
        print(f"{label}: {tokens[label]} tokens; wall s {[round(x, 2) for x in w]}; "
              f"{tokens[label] / statistics.median(w):.1f} tok/s (median)")
    ratios = {label: round(statistics.median(walls["none"]) / statistics.median(w), 3)
              for label, w in walls.items() if label != "none"}
    for label, ratio in ratios.items():
        print(f"{label} / none: {ratio:.2f}x")
    print(json.dumps({"bench": "round_modes", "policy": args.policy, "threads": args.threads, **cpu_description(),
                      "load_avg_1m": os.getloadavg()[0], "rounds": rows, "learned": learned,
                      "wall_s": walls, "tokens": tokens, "ratio_vs_none": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
