"""What one drafting round costs: `drafter.draft` for R requests, split by operator.

The engine drafts a block for every running request in one call each round; at 8 streams that
call is the cost that decides whether verification's savings turn into speed
(`docs/results/e2e_shipped_dspark.md`). Here R chat prompts (the eval sets' first turns) are
prefilled by the target runner, their features go into the drafter's context cache, and then
`--rounds` draft calls of R requests (anchors after the prompts, at each of `--temperatures`) are
timed for each of `--drafters` (dense float32 or bfloat16 tensors, or q8: Q8_0 blocks of the
float32 weights, `dspark.models.drafter_block_weights`; the target runs in float32, as served by
default), the drafters taking turns round by round so that each sees the same contention, and
`--profile-rounds` more run under the torch profiler, grouped into matrix products, attention
and everything else, under each of `--attention`'s ways of attending to the contexts
(`ContextAttention`: one SDPA call a layer for all requests, or one a request and layer), whose
greedy tokens must agree. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/draft_step.py [--streams 1,8,16] [--drafters float32,bfloat16,q8]
        [--temperatures 0,1] [--attention batched,per_request] [--threads 2] [--top-ops 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_breakdown import ATTENTION_OPS, MATMUL_OPS  # noqa: E402
from target_decode import chat_prompts  # noqa: E402

from dspark.devices import add_device_argument, resolve_device  # noqa: E402
from dspark.cpu_info import cpu_line  # noqa: E402
from dspark.fetch import ensure_model  # noqa: E402
from dspark.loading import load_method_drafter, load_target  # noqa: E402
from dspark.models.draft_types import DraftRequest  # noqa: E402
from dspark.models.drafter import ContextAttention  # noqa: E402
from dspark.models.drafter_config import DrafterConfig  # noqa: E402
from dspark.models.quantized_linear import PROFILER_LABEL as BLOCK_LINEAR_LABEL  # noqa: E402
from dspark.models.runner import ForwardItem  # noqa: E402
from dspark.paths import DEFAULT_DRAFTER, EVAL_PROMPTS_DIR  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402


def prompt_features(runner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The target's features of every prompt token: [len(prompt), m * hidden] each."""
    for i in range(len(prompts)):
        runner.add_request(i)
    out = runner.forward([ForwardItem(i, p) for i, p in enumerate(prompts)])
    feats = [out.hidden_of(i).reshape(len(p), -1).float() for i, p in enumerate(prompts)]
    for i in range(len(prompts)):
        runner.free(i)
    return feats


def draft_round(drafter, prompts: list[list[int]], temperature: float) -> list:
    sampling = SamplingParams(temperature=temperature)
    return drafter.draft([DraftRequest(i, p[-1], len(p), sampling) for i, p in enumerate(prompts)])


def profile_split(drafter, prompts: list[list[int]], temperature: float, rounds: int,
                  top_ops: int) -> dict[str, float]:
    """Milliseconds a round of self CPU time: matrix products, attention, everything else; the
    `top_ops` operators with the most self time are printed."""
    with profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            draft_round(drafter, prompts, temperature)
    if top_ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top_ops))
    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        key = ("matmul" if event.key in MATMUL_OPS or event.key == BLOCK_LINEAR_LABEL else
               "attention" if event.key in ATTENTION_OPS else "other")
        split[key] += event.self_cpu_time_total / 1e3 / rounds
    return split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--drafters", default="float32,bfloat16,q8",
                        help="dense float32 / bfloat16 tensors, or q8 (Q8_0 blocks, float32 math)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--attention", default=",".join(a.value for a in ContextAttention),
                        help="ContextAttention values, comma-separated (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--profile-rounds", type=int, default=5)
    parser.add_argument("--top-ops", type=int, default=0,
                        help="also print the profiler's table of this many operators by self time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    streams = [int(s) for s in args.streams.split(",")]
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), max(streams), args.eval_dir)
    layer_ids = tuple(DrafterConfig.load(args.checkpoint).target_layer_ids)
    print(f"# {cpu_line()}; torch {torch.__version__}, {args.threads} threads", flush=True)
    print("| drafter | attention | temperature | streams | ms a round (median) | ms a request | "
          "products | attention ops | other |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    modes = [ContextAttention(a) for a in args.attention.split(",")]
    greedy_tokens: dict[tuple, list] = {}  # (drafter, streams) -> the first mode's greedy tokens
    rows = []
    runner = load_target(model_dir, layer_ids, kv_cache_tokens=len(prompts) * 1024,
                         dtype="float32", device=resolve_device(args.device))
    features = prompt_features(runner, prompts)
    drafters = {}
    for variant in args.drafters.split(","):
        drafters[variant] = (load_method_drafter(args.checkpoint, runner, apply_calibration=True,
                                                 weights="q8") if variant == "q8" else
                             load_method_drafter(args.checkpoint, runner, apply_calibration=True,
                                                 weights="dense", dtype=getattr(torch, variant)))
        for i, (p, f) in enumerate(zip(prompts, features)):
            drafters[variant].append_context(i, f, torch.arange(len(p)))
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for r in streams:
            batch = prompts[:r]
            for variant, drafter in drafters.items():
                for mode in modes:
                    drafter.context_attention = mode
                    blocks = draft_round(drafter, batch, temperature)  # absorbs the pending context
                    if temperature == 0:
                        tokens = [b.tokens.tolist() for b in blocks]
                        first = greedy_tokens.setdefault((variant, r), tokens)
                        if tokens != first:
                            raise SystemExit(f"{mode.value} drafts other greedy tokens than "
                                             f"{modes[0].value} at {r} streams ({variant})")
            times = {(variant, mode): [] for variant in drafters for mode in modes}
            for _ in range(args.rounds):  # drafters and modes take turns: the same contention
                for variant, drafter in drafters.items():
                    for mode in modes:
                        drafter.context_attention = mode
                        start = time.perf_counter()
                        draft_round(drafter, batch, temperature)
                        times[variant, mode].append(time.perf_counter() - start)
            for variant, drafter in drafters.items():
                for mode in modes:
                    drafter.context_attention = mode
                    ms = statistics.median(times[variant, mode]) * 1e3
                    split = profile_split(drafter, batch, temperature, args.profile_rounds,
                                          args.top_ops)
                    rows.append({"drafter": variant, "context_attention": mode.value,
                                 "temperature": temperature, "streams": r,
                                 "ms_round": round(ms, 2),
                                 **{k: round(v, 2) for k, v in split.items()}})
                    print(f"| {variant} | {mode.value} | {temperature:g} | {r} | {ms:.2f} | "
                          f"{ms / r:.2f} | {split['matmul']:.2f} | {split['attention']:.2f} | "
                          f"{split['other']:.2f} |", flush=True)
    print(json.dumps({"bench": "draft_step", "cpu": cpu_line(), "threads": args.threads,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
