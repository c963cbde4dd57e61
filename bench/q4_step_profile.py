"""Where one q4 target pass goes at one stream: a 1-row decode step and an 8-row verification pass.

The target runs on its GGUF blocks (weights=q4). One chat prompt is prefilled; then, for each
pass shape (1 new token; 8 new tokens with logits for all 8, the K/V dropped again after each
pass so the context stays put):

- the thread's CPU time per pass (`time.thread_time`: on a shared machine the wall time also
  counts the time other processes hold the core), median of `--steps`;
- the same with every block product replaced by a ready zero tensor of its shape (no kernel
  call, no allocation): what the pass costs outside the products;
- the products alone: the same inputs' products called back to back in model order;
- `--profile-steps` passes under the torch profiler, self CPU time grouped into block products,
  attention kernel, norms, RoPE / residual / SiLU arithmetic, K/V writes and the rest (views,
  copies, metadata), with the operator count per pass.

With `--paired N`, also N rounds of passes of each shape in turns: the layers' kernel loop
(`BlockLayerLoop`, the default), the module path on the same fused kernels
(`rope_write_attention`, `fused_norm`), and the module path on the separate steps those kernels
replace (`Attention.fused_step` off, torch's rms_norm); the median per-round ratio of CPU times to
the loop's, and whether the logits bits agree.

The profiler adds its own cost to every operator, so its groups say where the operators' time
goes, not the time a pass takes; the CPU-time rows are the numbers to compare. The fused kernels
(`rope_write_attention`, `fused_norm`) carry no profiler label but the attention's, so a norm's time
shows under no group. Usage:
    .venv/bin/python bench/q4_step_profile.py [--steps 30] [--profile-steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from target_decode import chat_prompts  # noqa: E402

from dspark.cpu_info import cpu_description, cpu_line  # noqa: E402
from dspark.fetch import ensure_gguf  # noqa: E402
from dspark.models import block_layer_loop, fused_norm, quantized_linear  # noqa: E402
from dspark.models import transformer as transformer_module  # noqa: E402
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner  # noqa: E402
from dspark.paths import EVAL_PROMPTS_DIR  # noqa: E402

GROUPS = {
    "block products": ("dspark::block_linear",),
    "attention kernel": ("dspark::paged_attention",),
    "norms": ("aten::rms_norm", "aten::_fused_rms_norm", "aten::rsqrt", "aten::mean", "aten::pow"),
    "RoPE / residual / SiLU arithmetic": ("aten::mul", "aten::add", "aten::neg", "aten::cat", "aten::silu",
                                          "aten::cos", "aten::sin", "aten::sub", "aten::add_", "aten::mul_"),
    "K/V writes": ("aten::index_copy_",),
}


def group_of(name: str) -> str:
    for group, names in GROUPS.items():
        if name in names:
            return group
    return "views, copies, metadata, other"


def run_pass(runner: TargetRunner, rid, token: int, rows: int) -> int:
    """One pass of `rows` new tokens (all with logits); a verification pass's K/V is dropped again."""
    out = runner.forward([ForwardItem(rid, [token] * rows, logits_from=0)])
    if rows > 1:
        runner.truncate(rid, runner.length(rid) - rows)
        return token
    return int(out.logits[-1].argmax())


PAIRED_SETUPS = ("loop", "modules", "separate")
"""What `paired` runs in turns: the layers' kernel loop (`BlockLayerLoop`, the default path), the
module path on the same fused kernels, and the module path on the separate steps the fused
kernels replace (`Attention.fused_step` off, torch's rms_norm)."""


def paired(runner: TargetRunner, rid, token: int, rows: int, passes: int) -> dict:
    """`passes` rounds of one pass per `PAIRED_SETUPS` entry (the same tokens, K/V dropped after
    each): CPU ms medians, the median per-round ratio to the loop, whether all logits bits agree."""
    lanes, loop = fused_norm.lanes, runner.model.block_loop
    times = {name: [] for name in PAIRED_SETUPS}
    same = True
    try:
        for _ in range(passes):
            logits = []
            for name in PAIRED_SETUPS:
                runner.model.block_loop = loop if name == "loop" else None
                transformer_module.Attention.fused_step = name != "separate"
                fused_norm.lanes = lanes if name != "separate" else (lambda: None)
                t0 = time.thread_time()
                out = runner.forward([ForwardItem(rid, [token] * rows, logits_from=0)])
                times[name].append(time.thread_time() - t0)
                logits.append(out.logits)
                runner.truncate(rid, runner.length(rid) - rows)
            same &= all(torch.equal(logits[0], other) for other in logits[1:])
    finally:
        runner.model.block_loop = loop
        transformer_module.Attention.fused_step = True
        fused_norm.lanes = lanes
    return {**{f"{name}_cpu_ms": round(1e3 * statistics.median(times[name]), 2) for name in PAIRED_SETUPS},
            **{f"{name}_over_loop": round(statistics.median(t / l for l, t in zip(times["loop"], times[name])), 3)
               for name in PAIRED_SETUPS[1:]},
            "same_bits": same}


@contextlib.contextmanager
def products_as(fn):
    """Every block product of a pass, on the module path (`transformer.block_linear`) and in the
    layers' kernel loop (`block_layer_loop._product`), goes to fn(x, weight, bias) meanwhile."""
    module_product, loop_product = transformer_module.block_linear, block_layer_loop._product
    transformer_module.block_linear = fn
    block_layer_loop._product = lambda ext, x, weight, bias, profiling: fn(x, weight, bias)
    try:
        yield
    finally:
        transformer_module.block_linear, block_layer_loop._product = module_product, loop_product


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8", help="new tokens per pass, comma-separated")
    parser.add_argument("--top-ops", type=int, default=0, help="also print the profiler's top operators")
    parser.add_argument("--paired", type=int, default=0,
                        help="rounds of the kernel loop, the module path and the separate steps, in turns (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_gguf().parent
    prompt = chat_prompts(AutoTokenizer.from_pretrained(model_dir), 1, args.eval_dir)[0]
    runner = TargetRunner(model_dir, RunnerConfig(dtype="float32", weights="q4",
                                                  kv_cache_tokens=len(prompt) + 4 * args.steps + 256))
    rid = "profile"
    runner.add_request(rid)
    report = {}
    with torch.inference_mode():
        token = int(runner.forward([ForwardItem(rid, prompt)]).logits[-1].argmax())
        for rows in (int(r) for r in args.rows.split(",")):
            for _ in range(3):  # warm-up
                token = run_pass(runner, rid, token, rows)
            whole = []
            for _ in range(args.steps):
                t0 = time.thread_time()
                token = run_pass(runner, rid, token, rows)
                whole.append(time.thread_time() - t0)
            # record each product's input once, then time the same products back to back
            calls = []
            real = quantized_linear.block_linear

            def recording(x, weight, bias=None):
                calls.append((x.clone(), weight, bias))
                return real(x, weight, bias)

            with products_as(recording):
                token = run_pass(runner, rid, token, rows)
            products = []
            for _ in range(args.steps):
                t0 = time.thread_time()
                for x, weight, bias in calls:
                    real(x, weight, bias)
                products.append(time.thread_time() - t0)
            zeros = {}

            def no_product(x, weight, bias=None):
                shape = (*x.shape[:-1], weight.out_features)
                if shape not in zeros:
                    zeros[shape] = torch.zeros(shape)
                return zeros[shape]

            with products_as(no_product):
                outside = []
                for _ in range(args.steps):
                    t0 = time.thread_time()
                    token_kept = run_pass(runner, rid, token, rows)
                    outside.append(time.thread_time() - t0)
                    if rows == 1:  # keep the context length as the real passes had it
                        runner.truncate(rid, runner.length(rid) - 1)
                del token_kept
            with profile() as prof:
                for _ in range(args.profile_steps):
                    token = run_pass(runner, rid, token, rows)
            groups = collections.Counter()
            counts = collections.Counter()
            for event in prof.key_averages():
                groups[group_of(event.key)] += event.self_cpu_time_total / 1e3 / args.profile_steps
                counts[group_of(event.key)] += event.count / args.profile_steps
            ms = {"whole pass": 1e3 * statistics.median(whole),
                  "products replaced by zeros": 1e3 * statistics.median(outside),
                  f"the {len(calls)} products alone": 1e3 * statistics.median(products)}
            report[rows] = {"cpu_ms": {k: round(v, 2) for k, v in ms.items()},
                            "profiler_self_ms": {k: round(v, 2) for k, v in groups.most_common()},
                            "operators_per_pass": {k: round(v) for k, v in counts.most_common()}}
            print(f"\n{rows} new token(s) per pass, context ~{runner.length(rid)}")
            print("| part | CPU ms per pass |\n|---|---:|")
            for k, v in ms.items():
                print(f"| {k} | {v:.2f} |")
            print("\n| profiler group | self ms per pass | operators per pass |\n|---|---:|---:|")
            for k, v in groups.most_common():
                print(f"| {k} | {v:.2f} | {counts[k]:.0f} |")
            if args.top_ops:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top_ops))
        if args.paired:
            report["paired"] = {rows: paired(runner, rid, token, rows, args.paired)
                                for rows in (int(r) for r in args.rows.split(","))}
            for rows, r in report["paired"].items():
                print(f"{rows} row(s): loop {r['loop_cpu_ms']} ms, modules {r['modules_cpu_ms']} ms, separate steps "
                      f"{r['separate_cpu_ms']} ms; paired over the loop: modules {r['modules_over_loop']}, "
                      f"separate {r['separate_over_loop']}; same bits {r['same_bits']}")
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    if 1 in report:
        for rows, r in report.items():
            if rows not in (1, "paired"):
                print(f"{rows}-row pass / 1-row pass: "
                      f"{r['cpu_ms']['whole pass'] / report[1]['cpu_ms']['whole pass']:.2f}")
    print(json.dumps({"bench": "q4_step_profile", "threads": args.threads, **cpu,
                      "load_avg_1m": os.getloadavg()[0], "passes": report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
