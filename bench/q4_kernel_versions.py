"""Two versions of the GGUF block kernel on a decode step's products: this checkout's
`dspark/models/csrc/block_linear.cpp` against another copy of that file (an older commit's).

All 121 products of a SmolLM2 step in model order (qkv, o, gate_up, down of the 30 layers on
their Q4_1 blocks, then the LM head on its Q8_0 blocks; 96 MB, so the weights come from memory
as in a real step), at each row count, the two builds taken in turns `--repeats` times; median
milliseconds per step's products. Also checks that both give the same bits and that row 0
alone gives the bits it gets in the batch (batch invariance). Usage:

    git show main:dspark/models/csrc/block_linear.cpp > /tmp/base_block_linear.cpp
    .venv/bin/python bench/q4_kernel_versions.py --base /tmp/base_block_linear.cpp [--rows 1,8,16] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from dspark.cpu_info import cpu_description, cpu_line
from dspark.fetch import ensure_gguf
from dspark.models.config import ModelConfig
from dspark.models.gguf_blocks import read_block_weights
from dspark.models.kernel_load import load_kernel
from dspark.models.quantized_linear import BlockFormat, BlockWeight


def build_from(source: Path, tag: str):
    """The kernel built from `source` (the flags `quantized_linear.build_kernel` uses) under a
    name of its own, so two versions load side by side."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:10]
    return load_kernel(f"dspark_block_linear_{tag}_{digest}", sources=[str(source)],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       verbose=False)


def step_products(ext, weights: list[BlockWeight], xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """One step's products in model order: xs[in_features] [rows, in_features] float32."""
    outs = []
    for w in weights:
        fn = ext.q4_1_linear if w.format is BlockFormat.Q4_1 else ext.q8_0_linear
        outs.append(fn(xs[w.in_features], w.blocks, None))
    return outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other block_linear.cpp")
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    this = Path(__file__).resolve().parents[1] / "dspark" / "models" / "csrc" / "block_linear.cpp"
    exts = {"base": build_from(args.base, "base"), "this": build_from(this, "this")}
    gguf = ensure_gguf()
    blocks = read_block_weights(gguf, ModelConfig.from_pretrained(gguf.parent))
    weights = [w for name, w in blocks.items() if name != "lm_head"] + [blocks["lm_head"]]
    results = []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(rows, k) for k in {w.in_features for w in weights}}
            outs = {k: step_products(e, weights, xs) for k, e in exts.items()}
            alone = step_products(exts["this"], weights, {k: v[:1].contiguous() for k, v in xs.items()})
            times: dict[str, list[float]] = {k: [] for k in exts}
            for _ in range(args.repeats):
                for k, e in exts.items():
                    t0 = time.perf_counter()
                    step_products(e, weights, xs)
                    times[k].append(time.perf_counter() - t0)
            row = {"rows": rows, "base_ms": round(statistics.median(times["base"]) * 1e3, 1),
                   "this_ms": round(statistics.median(times["this"]) * 1e3, 1),
                   "same_bits": all(torch.equal(a, b) for a, b in zip(outs["base"], outs["this"])),
                   "row0_alone_same_bits": all(torch.equal(a[:1], b) for a, b in zip(outs["this"], alone))}
            row["base_over_this"] = round(row["base_ms"] / row["this_ms"], 2)
            results.append(row)
            print(json.dumps(row), flush=True)
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; torch threads {args.threads}; load average {os.getloadavg()[0]:.1f}\n")
    print("| rows | base ms | this ms | base / this | same bits | row 0 alone same bits |")
    print("|---:|---:|---:|---:|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['base_ms']} | {r['this_ms']} | {r['base_over_this']} | {r['same_bits']} | "
              f"{r['row0_alone_same_bits']} |")
    print(json.dumps({"bench": "q4_kernel_versions", "threads": args.threads, **cpu,
                      "load_avg_1m": os.getloadavg()[0], "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
