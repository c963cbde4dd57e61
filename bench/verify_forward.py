"""One target forward of a decode step or a verification block, with this tree's attention kernel
against another revision's: what a kernel change is worth where speculation pays for it.

`--streams` chat prompts are prefilled into one TargetRunner (the block-table kernel, the runner's
default on a CPU). Each timed call is one `TargetRunner.forward` in which every stream appends
k tokens with logits for all of them (k = 1: a decode step; k > 1: the anchor and k - 1 drafts of a
verification), after which the streams are truncated back to their prompts. With `--against REV`
the kernel source of git revision REV is compiled too (`paged_attention_kernel.kernel_at`) and the
two kernels take turns call by call, so a busy or throttled machine slows both alike. *k / k=1* is
a verification's cost over a decode step's with this tree's kernel: the price of each verified
draft position. Prints the CPU model and flags, a markdown table and one JSON line. Usage:
    .venv/bin/python bench/verify_forward.py [--streams 8,64] [--new-tokens 1,2,4,8]
        [--dtypes float32,bfloat16] [--threads 2] [--repeats 20] [--against REV]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_attention_kernel import kernel_at  # noqa: E402
from target_decode import chat_prompts  # noqa: E402

import dspark.models.paged_attention as paged  # noqa: E402
from dspark.cpu_info import cpu_description  # noqa: E402
from dspark.fetch import ensure_model  # noqa: E402
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner  # noqa: E402
from dspark.models.transformer import AttentionImpl  # noqa: E402
from dspark.paths import EVAL_PROMPTS_DIR  # noqa: E402

def timed_forward(runner: TargetRunner, ids: list[int], prompt_lengths: list[int], k: int) -> float:
    """Seconds of one forward appending k tokens to every stream (logits for all), then the
    streams truncated back to their prompts. The tokens are the streams' ids (any in-vocabulary
    id: the forward's cost does not depend on which tokens they are)."""
    start = time.perf_counter()
    runner.forward([ForwardItem(i, [i] * k, logits_from=0) for i in ids])
    seconds = time.perf_counter() - start
    for i, n in zip(ids, prompt_lengths):
        runner.truncate(i, n)
    return seconds


def measure(runner: TargetRunner, ids: list[int], prompt_lengths: list[int], k: int, repeats: int,
            kernels: dict[str, object]) -> dict[str, float]:
    """Median seconds of a k-token forward per kernel, the kernels taking turns call by call
    (after one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for rep in range(repeats + 1):
        for name, ext in kernels.items():
            with mock.patch.object(paged, "_cpu_extension", lambda ext=ext: ext):
                seconds = timed_forward(runner, ids, prompt_lengths, k)
            if rep:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR, help="prompts: the first turns of *.jsonl")
    parser.add_argument("--streams", default="8,64")
    parser.add_argument("--new-tokens", default="1,2,4,8", help="k: tokens each stream appends")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--against", default="", help="git revision whose kernel is timed alongside")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    if not paged.cpu_kernel_available():
        print("the block-table kernel does not build here (no C++ compiler)", file=sys.stderr)
        return 1
    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kernels = {"ours": paged._cpu_extension()}
    if args.against:
        kernels[args.against] = kernel_at(args.against)
    ks = [int(x) for x in args.new_tokens.split(",")]
    print(f"CPU: {cpu_description()}; torch threads {args.threads}\n")
    against = f" | {args.against} ms | speed-up" if args.against else ""
    print(f"| dtype | streams | k | mean context | ours ms | k / k=1{against} |")
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.against else ""))
    rows = []
    for dtype in args.dtypes.split(","):
        for streams in (int(x) for x in args.streams.split(",")):
            prompts = chat_prompts(tokenizer, streams, args.eval_dir)
            kv_tokens = sum(len(p) for p in prompts) + streams * (max(ks) + 16)
            runner = TargetRunner(model_dir, RunnerConfig(dtype=dtype, attention=AttentionImpl.PAGED,
                                                          kv_cache_tokens=max(16384, kv_tokens)))
            with torch.inference_mode():
                ids = list(range(streams))
                for i in ids:
                    runner.add_request(i)
                runner.forward([ForwardItem(i, p) for i, p in zip(ids, prompts)])
                lengths = [runner.length(i) for i in ids]
                decode = None
                for k in ks:
                    sec = measure(runner, ids, lengths, k, args.repeats, kernels)
                    decode = sec["ours"] if k == 1 else decode
                    row = {"dtype": dtype, "streams": streams, "k": k,
                           "mean_context": round(sum(lengths) / streams),
                           "ms": {name: round(1000 * s, 2) for name, s in sec.items()}}
                    relative = f"{sec['ours'] / decode:.2f}" if decode else "-"
                    line = (f"| {dtype} | {streams} | {k} | {row['mean_context']} | "
                            f"{1000 * sec['ours']:.1f} | {relative} |")
                    if args.against:
                        row["speed_up"] = round(sec[args.against] / sec["ours"], 3)
                        line += f" {1000 * sec[args.against]:.1f} | {row['speed_up']:.2f}x |"
                    print(line, flush=True)
                    rows.append(row)
    print(json.dumps({"bench": "verify_forward", "threads": args.threads, "cpu": cpu_description(),
                      "against": args.against or None, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
