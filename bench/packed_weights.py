"""One target forward with oneDNN-packed weights against MKL's F.linear, same runner, same run.

SmolLM2 on the CPU in float32: `RunnerConfig(cpu_packed_weights=True)` (the default) against
`False`, for the shapes a decode or verification step has: R requests x k new tokens each over a
cached context of `--context` tokens, logits for every new token. Median milliseconds of
`--repeats` forwards after 2 warm-ups; the two runners alternate per shape so machine noise hits
both alike. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/packed_weights.py [--threads 2] [--context 300] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark.fetch import ensure_model
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner

SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (2, 1), (4, 1), (8, 1), (16, 1), (8, 4), (16, 4)]
"""(requests, new tokens per request)."""


def step_ms(runner: TargetRunner, requests: int, new_tokens: int, context: int, repeats: int,
            gen: torch.Generator) -> float:
    """Median ms of one forward adding `new_tokens` to each of `requests` cached requests."""
    times = []
    for rep in range(2 + repeats):
        items = [ForwardItem(("r", i), torch.randint(0, runner.vocab_size, (new_tokens,),
                                                    generator=gen).tolist(), logits_from=0)
                 for i in range(requests)]
        start = time.perf_counter()
        runner.forward(items)
        if rep >= 2:
            times.append(time.perf_counter() - start)
        for item in items:
            runner.truncate(item.request_id, context)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or ensure_model()
    gen = torch.Generator().manual_seed(0)
    runners = {packed: TargetRunner(model_dir, RunnerConfig(cpu_packed_weights=packed))
               for packed in (False, True)}
    max_requests = max(r for r, _ in SHAPES)
    for runner in runners.values():
        for i in range(max_requests):
            runner.add_request(("r", i))
            runner.forward([ForwardItem(("r", i), torch.randint(
                0, runner.vocab_size, (args.context,), generator=gen).tolist())])
    rows = []
    with torch.inference_mode():
        for requests, new_tokens in SHAPES:
            ms = {packed: step_ms(runner, requests, new_tokens, args.context, args.repeats, gen)
                  for packed, runner in runners.items()}
            rows.append({"requests": requests, "new_tokens": new_tokens, "tokens": requests * new_tokens,
                         "mkl_ms": round(ms[False], 1), "packed_ms": round(ms[True], 1),
                         "speedup": round(ms[False] / ms[True], 2)})
    print(f"SmolLM2-135M float32, {args.threads} threads, context {args.context}, "
          f"median of {args.repeats}\n")
    print("| requests x new tokens | B | MKL F.linear ms | oneDNN packed ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['requests']} x {r['new_tokens']} | {r['tokens']} | {r['mkl_ms']} | "
              f"{r['packed_ms']} | {r['speedup']}x |")
    print(json.dumps({"bench": "packed_weights", "threads": args.threads, "context": args.context,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
