"""Where one plain decoding run's time goes: prefill, and one decode step split by operator.

The 16-stream case of bench/target_decode.py, taken apart. The 16 chat prompts are prefilled
together (one `TargetRunner.forward`, chunked). Then `--steps` decode steps of 16 x 1 token are
timed, and `--profile-steps` more run under the torch profiler. The profiler's self-CPU time is
grouped into matrix products, attention (SDPA) and everything else; `--top-ops N` also prints the
profiler's N operators with the most self time. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/decode_breakdown.py [--streams 16] [--threads 2] [--steps 20] [--top-ops 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from target_decode import chat_prompts  # noqa: E402

from dspark.fetch import ensure_model  # noqa: E402
from dspark.models.paged_attention import PROFILER_LABEL  # noqa: E402
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner  # noqa: E402
from dspark.models.transformer import AttentionImpl  # noqa: E402
from dspark.paths import EVAL_PROMPTS_DIR  # noqa: E402

MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
ATTENTION_OPS = (PROFILER_LABEL, "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention")


def decode_step(runner: TargetRunner, ids: list, tokens: list[int]) -> list[int]:
    out = runner.forward([ForwardItem(r, [t]) for r, t in zip(ids, tokens)])
    return out.logits.argmax(-1).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR, help="prompts: the first turns of *.jsonl")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default=None, choices=[a.value for a in AttentionImpl],
                        help="attention implementation (default: the runner's)")
    parser.add_argument("--top-ops", type=int, default=0,
                        help="also print the profiler's table of this many operators by self time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), args.streams, args.eval_dir)
    attention = AttentionImpl(args.attention) if args.attention else None
    kv_tokens = sum(len(p) for p in prompts) + args.streams * (args.steps + args.profile_steps + 16)
    runner = TargetRunner(model_dir, RunnerConfig(dtype=args.dtype, attention=attention,
                                                  kv_cache_tokens=max(16384, kv_tokens)))
    with torch.inference_mode():
        prefill_seconds = []
        for rep in range(3):  # the first one warms up
            ids = [("breakdown", rep, i) for i in range(args.streams)]
            for rid in ids:
                runner.add_request(rid)
            start = time.perf_counter()
            out = runner.forward([ForwardItem(rid, p) for rid, p in zip(ids, prompts)])
            prefill_seconds.append(time.perf_counter() - start)
            if rep < 2:
                for rid in ids:
                    runner.free(rid)
        tokens = out.logits.argmax(-1).tolist()
        step_seconds = []
        for _ in range(args.steps):
            start = time.perf_counter()
            tokens = decode_step(runner, ids, tokens)
            step_seconds.append(time.perf_counter() - start)
        with profile() as prof:
            for _ in range(args.profile_steps):
                tokens = decode_step(runner, ids, tokens)
    groups = {"matrix products": 0.0, "attention (SDPA)": 0.0, "everything else": 0.0}
    for event in prof.key_averages():
        if event.key in MATMUL_OPS:
            group = "matrix products"
        elif event.key in ATTENTION_OPS:
            group = "attention (SDPA)"
        else:
            group = "everything else"
        groups[group] += event.self_cpu_time_total / 1000 / args.profile_steps  # ms per step
    prefill = statistics.median(prefill_seconds[1:])
    step_ms = 1000 * statistics.median(step_seconds)
    print(f"{args.streams} prompts, {sum(len(p) for p in prompts)} prompt tokens, "
          f"{args.threads} threads, {args.dtype}, attention {runner.attention.value}\n")
    print("| part | time |")
    print("|---|---:|")
    print(f"| prefill of all prompts | {prefill:.2f} s |")
    print(f"| one decode step ({args.streams} x 1 token), median of {args.steps} | {step_ms:.1f} ms |")
    for name, ms in groups.items():
        print(f"| - {name} (profiler self time per step) | {ms:.1f} ms |")
    if args.top_ops:
        print("\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top_ops))
    print(json.dumps({"bench": "decode_breakdown", "streams": args.streams, "threads": args.threads,
                      "dtype": args.dtype, "attention": runner.attention.value,
                      "prompt_tokens": sum(len(p) for p in prompts),
                      "prefill_seconds": round(prefill, 3), "step_ms": round(step_ms, 1),
                      "profile_ms_per_step": {k: round(v, 1) for k, v in groups.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
