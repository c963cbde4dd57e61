"""`dspark bench` (and `bench/e2e.py`, the same flags): the end-to-end speed tables.

The rows take turns wave by wave on each dataset, at each (temperature, concurrency); the tables
go to stdout, one JSON line last. What the rows, waves and figures are:
dspark/evaluation/speed/__init__.py."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from dspark.cpu_info import cpu_line
from dspark.devices import add_device_argument, resolve_device
from dspark.evaluation.speed.prepare import Setup, load_setup, log, prompts_needed
from dspark.evaluation.speed.rows import ROWS, RowKind, parse_rows
from dspark.evaluation.speed.tables import format_breakdown, format_table, goals, summarize
from dspark.evaluation.speed.waves import Tally, run_engine_wave, run_hf_wave
from dspark.paths import EVAL_PROMPTS_DIR

DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench")


def _parse_list(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: cannot parse {text!r}") from None
    if not values:
        raise ValueError(f"{what}: empty")
    return list(dict.fromkeys(values))


def run_wave(setup: Setup, name: str, concurrency: int, prompts, temperature: float,
             max_tokens: int, args: argparse.Namespace, seed: int, tally: Tally | None) -> None:
    spec = ROWS[name]
    if spec.kind is RowKind.ENGINE:
        run_engine_wave(setup.engines[(name, concurrency)], prompts, temperature, max_tokens,
                        setup.stops, seed, tally)
    else:
        run_hf_wave(setup.hf_model, spec.kind, prompts, temperature, max_tokens, setup.stops,
                    setup.pad_id, seed, args.prompt_lookup_tokens, args.max_ngram, tally)


def measure(setup: Setup, rows: list[str], temperature: float, concurrency: int,
            args: argparse.Namespace) -> dict[str, dict[str, Tally]]:
    """row -> dataset -> Tally; the rows take turns wave by wave."""
    active = [n for n in rows if setup.status[n] == "ok"]
    tallies = {n: {d: Tally() for d in setup.prompts} for n in active}
    for d, all_prompts in setup.prompts.items():
        prompts = all_prompts[:prompts_needed(args.limit, concurrency)]
        for w in range(0, len(prompts), concurrency):
            wave = prompts[w:w + concurrency]
            for n in active:
                run_wave(setup, n, concurrency, wave, temperature, args.max_tokens, args,
                         args.seed + w, tallies[n][d])
        log(f"T={temperature:g} C={concurrency} {d}: " + ", ".join(
            f"{n} {tallies[n][d].tokens_per_s:.1f} tok/s" for n in active))
    return tallies


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="folder with dspark-markov/ and dflash/ (default: ./checkpoints, "
                             "else the repository's)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: the prepared SmolLM2)")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR,
                        help="folder of the eval prompt files (<dataset>.jsonl)")
    parser.add_argument("--datasets", default=",".join(DEFAULT_DATASETS),
                        help="comma-separated eval file names without .jsonl")
    parser.add_argument("--limit", type=int, default=4,
                        help="prompts per dataset (rounded up to whole waves of each concurrency)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--temperatures", default="0,1.0", help="comma-separated; 0 = greedy")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated stream counts")
    parser.add_argument("--methods", default=",".join(ROWS),
                        help=f"rows to run, from {','.join(ROWS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_device_argument(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="of the target and the transformers peers (the drafter: dspark.loading.drafter_dtype)")
    parser.add_argument("--weights", default=None, choices=["q4", "dense"],
                        help="the target's linears (RunnerConfig.weights; default: q4 where the "
                             "model folder has its GGUF and the CPU its kernel, else dense)")
    parser.add_argument("--drafter-weights", default=None, choices=["q8", "dense"],
                        help="engine rows that do not name their drafter's weights: "
                             "q8: Q8_0 blocks of the drafter's float32 weights (float32 math); dense (default): "
                             "its dtype tensors")
    parser.add_argument("--sparse-top-k", type=int, default=None,
                        help="engine: ship draft distributions as top-k (default dense)")
    parser.add_argument("--verification", default="token",
                        choices=["token", "block", "drafter-invariant"],
                        help="engine: how sampled drafts are accepted (dspark.rejection)")
    parser.add_argument("--cost-table", type=Path, default=None,
                        help="SPS(B) table JSON (default: measured at start-up)")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10,
                        help="transformers prompt_lookup_num_tokens")
    parser.add_argument("--max-ngram", type=int, default=2,
                        help="transformers max_matching_ngram_size for prompt lookup")
    parser.add_argument("--warmup-tokens", type=int, default=8,
                        help="each row first generates one wave of this many tokens, untimed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    try:
        rows = parse_rows(args.methods)
        temperatures = _parse_list(args.temperatures, float, "--temperatures")
        concurrencies = _parse_list(args.concurrency, int, "--concurrency")
        args.datasets = _parse_list(args.datasets, str.strip, "--datasets")
        if any(t < 0 or not math.isfinite(t) for t in temperatures):
            raise ValueError("--temperatures must be finite and >= 0")
        if any(c < 1 for c in concurrencies):
            raise ValueError("--concurrency must be >= 1")
        if args.limit < 1 or args.max_tokens < 1:
            raise ValueError("--limit and --max-tokens must be >= 1")
        args.device = resolve_device(args.device)
    except ValueError as e:
        print(f"dspark bench: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = load_setup(args, rows, concurrencies)
    active = [n for n in rows if setup.status[n] == "ok"]
    first = next(iter(setup.prompts.values()))
    for c in concurrencies:  # untimed: first calls allocate and pick kernels
        for n in active:
            run_wave(setup, n, c, first[:c], 0.0, min(args.warmup_tokens, args.max_tokens), args,
                     args.seed, None)

    print(f"CPU: {cpu_line()}; torch threads: {torch.get_num_threads()}, dtype: {args.dtype}, "
          f"device: {args.device}")
    tables = []
    for temperature in temperatures:
        for c in concurrencies:
            tallies = measure(setup, rows, temperature, c, args)
            summary = summarize(setup, rows, tallies, temperature)
            tables.append({"temperature": temperature, "concurrency": c,
                           "prompts_per_dataset": prompts_needed(args.limit, c), "rows": summary})
            print()
            print(format_table(summary, args.datasets, temperature, c,
                               prompts_needed(args.limit, c), args.max_tokens))
            breakdown = format_breakdown(summary, temperature, c)
            if breakdown:
                print()
                print(breakdown)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if not k.startswith("_")}
    payload = {"bench": "e2e", "threads": torch.get_num_threads(), "tables": tables,
               "goals": goals(tables), "config": config}
    line = json.dumps(payload, allow_nan=False, default=str)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    configure(parser)
    return run(parser.parse_args(argv))
