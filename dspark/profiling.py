"""`dspark profile`: measure the target's steps per second SPS(B) (docs/design.md section 6).

For each flattened batch size B = 1..max_batch, B new tokens are spread as evenly as possible
over min(B, requests) requests that each hold `context_len` tokens of KV cache (a verification
step's shape: several requests, a few tokens each), one forward is timed `repeats` times after
`warmup` untimed ones, and the median is kept (the sizes take turns, one forward each per round); each request is truncated back to its context
after every forward, so the context length stays fixed. The cost table JSON (dspark.cost_table
format) and a PNG plot of SPS(B) are written; a markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

from dspark.cost_table import CostTable, default_cost_table_path
from dspark.devices import add_device_argument, device_kind, resolve_device
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.step_timing import measure_step_seconds


def plot_sps(table: CostTable, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(table.batch_tokens, [1.0 / s for s in table.step_seconds], marker="o", markersize=3)
    ax.set_xlabel("batch tokens B (flattened, all requests)")
    ax.set_ylabel("target steps per second SPS(B)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: dspark fetch-model's)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    add_device_argument(parser)
    parser.add_argument("--max-batch", type=int, default=64, help="largest B measured")
    parser.add_argument("--step", type=int, default=1, help="measure B = 1, 1+step, ... (and max-batch)")
    parser.add_argument("--context-len", type=int, default=300, help="KV cache tokens per request")
    parser.add_argument("--requests", type=int, default=8, help="requests the B tokens are spread over")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="cost table JSON (default: $DSPARK_HOME/cost_table_<model>_<dtype>_<device kind>.json); "
                             "the plot goes beside it as .png")


def run(args: argparse.Namespace) -> int:
    from dspark.fetch import dspark_home, ensure_model

    if args.max_batch < 1 or args.step < 1 or args.repeats < 1:
        raise SystemExit("--max-batch, --step and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir or ensure_model()
    args.device = resolve_device(args.device)
    out = args.out or default_cost_table_path(dspark_home(), Path(model_dir).name, args.dtype,
                                              args.device)
    batch_sizes = sorted(set(range(1, args.max_batch + 1, args.step)) | {args.max_batch})
    runner = TargetRunner(model_dir, RunnerConfig(
        device=args.device, dtype=args.dtype,
        kv_cache_tokens=args.requests * (args.context_len + args.max_batch + 16)))
    print(f"profiling {model_dir} ({args.dtype}, {args.device}, {torch.get_num_threads()} threads) "
          f"at B = {batch_sizes[0]}..{batch_sizes[-1]}", file=sys.stderr)
    seconds = measure_step_seconds(runner, batch_sizes, args.context_len, args.requests,
                                   args.repeats, args.warmup)
    table = CostTable(batch_sizes, seconds, meta={
        "model": Path(model_dir).name, "dtype": args.dtype, "device": args.device,
        "device_kind": device_kind(args.device),
        "context_len": args.context_len, "requests": args.requests, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    plot_path = out.with_suffix(".png")
    plot_sps(table, plot_path, f"{Path(model_dir).name} {args.dtype} {args.device}, "
                               f"context {args.context_len}")
    print("| B | step ms | SPS |\n|---|---|---|")
    for b, s in zip(batch_sizes, seconds):
        print(f"| {b} | {s * 1e3:.1f} | {1.0 / s:.2f} |")
    print(f"wrote {out} and {plot_path}", file=sys.stderr)
    return 0
