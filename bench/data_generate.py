"""Answer generation for drafter data (`dspark data generate`'s loop): our runner's default
attention against per-request SDPA (the path before the block-table kernel), side by side.

Both sides answer the same training prompts greedily with continuous batching
(`generate_answers`, `--batch-size` in flight, `--max-new-tokens` each), taken in turns
`--repeats` times. Reports answer tokens per second of wall time and of this process's CPU time
(the CPU figure is steadier on a machine shared with other jobs) and the ratio, with the CPU model
and flags. Prints a table and ends with one JSON line. Usage:
    .venv/bin/python bench/data_generate.py [--prompts 128] [--batch-size 64] [--max-new-tokens 64]
        [--threads 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspark.cpu_info import cpu_description
from dspark.fetch import ensure_model
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.models.transformer import AttentionImpl
from dspark.sampling import SamplingParams
from dspark.paths import TRAIN_PROMPTS_DIR
from dspark.training.data import encode_chat, generate_answers, select_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--train-dir", type=Path, default=TRAIN_PROMPTS_DIR)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = select_prompts(args.train_dir, args.prompts, seed=0)
    encoded = [(p.id, encode_chat(tokenizer, p.text)) for p in prompts]
    eos = {tokenizer.eos_token_id}
    kv_tokens = args.batch_size * (max(len(ids) for _, ids in encoded) + args.max_new_tokens + 16)
    sides = {"ours": None, "per_request": AttentionImpl.PER_REQUEST}
    runners = {name: TargetRunner(model_dir, RunnerConfig(dtype=args.dtype, attention=impl,
                                                          kv_cache_tokens=kv_tokens))
               for name, impl in sides.items()}
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    answers: dict[str, dict] = {}
    tokens = 0
    for _ in range(args.repeats):
        for name, runner in runners.items():
            w, c = time.perf_counter(), time.process_time()
            got = {key: answer for key, answer, _ in generate_answers(
                runner, encoded, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                sampling=SamplingParams(temperature=0.0), eos_token_ids=eos)}
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
            tokens = sum(len(a) for a in got.values())
            answers[name] = got
    rows = {name: {"wall_tok_s": round(tokens / statistics.median(wall[name]), 1),
                   "cpu_tok_s": round(tokens / statistics.median(cpu[name]), 1)} for name in sides}
    ratio_wall = round(rows["ours"]["wall_tok_s"] / rows["per_request"]["wall_tok_s"], 2)
    ratio_cpu = round(rows["ours"]["cpu_tok_s"] / rows["per_request"]["cpu_tok_s"], 2)
    same = answers["ours"] == answers["per_request"]
    info = cpu_description()
    print(f"CPU: {info['cpu']}, flags {' '.join(info['flags'])}; {args.threads} thread(s); "
          f"{len(encoded)} prompts, {args.batch_size} in flight, {tokens} answer tokens, {args.dtype}\n")
    print("| runner | tok/s (wall) | tok/s (CPU time) |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_tok_s']} | {r['cpu_tok_s']} |")
    print(f"| ours / per-request | {ratio_wall}x | {ratio_cpu}x |")
    print(json.dumps({"bench": "data_generate", **vars(args) | {"model_dir": str(model_dir),
                                                                "train_dir": str(args.train_dir)},
                      **info, "answer_tokens": tokens, "rows": rows, "ratio_wall": ratio_wall,
                      "ratio_cpu": ratio_cpu, "same_answers": same}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
