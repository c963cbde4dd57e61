"""Where the block kernel stops paying: a decode step's products at many rows, GGUF blocks
against the packed float32 weights (the runner's `q4_max_rows` switches between the two).

All 121 products of a SmolLM2 step in model order (qkv, o, gate_up, down of the 30 layers on
their Q4_1 blocks, then the LM head on its Q8_0 blocks; 96 MB of blocks, 540 MB of float32, so
both read their weights from memory as in a real pass), at each row count, block kernel and
oneDNN-packed float32 taken in turns `--repeats` times; median milliseconds per step's products.

    .venv/bin/python bench/q4_step_rows.py [--rows 1,8,16,32,64,128] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dspark.cpu_info import cpu_description, cpu_line
from dspark.fetch import ensure_gguf
from dspark.models.config import ModelConfig
from dspark.models.gguf_blocks import read_block_weights
from dspark.models.packed_linear import pack_weight, packed_linear
from dspark.models.quantized_linear import block_linear, dequantize, kernel_isa


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = ensure_gguf()
    blocks = read_block_weights(gguf, ModelConfig.from_pretrained(gguf.parent))
    weights = [w for name, w in blocks.items() if name != "lm_head"] + [blocks["lm_head"]]
    packed = [pack_weight(dequantize(w)) for w in weights]  # [out, in] float32, oneDNN layout
    results = []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(rows, k) for k in {w.in_features for w in weights}}
            steps = {"block": lambda: [block_linear(xs[w.in_features], w) for w in weights],
                     "packed_f32": lambda: [packed_linear(xs[w.in_features], p, None) for w, p in zip(weights, packed)]}
            times: dict[str, list[float]] = {k: [] for k in steps}
            for _ in range(args.repeats):
                for k, step in steps.items():
                    t0 = time.perf_counter()
                    step()
                    times[k].append(time.perf_counter() - t0)
            row = {"rows": rows, **{f"{k}_ms": round(statistics.median(v) * 1e3, 1) for k, v in times.items()}}
            row["packed_over_block"] = round(row["packed_f32_ms"] / row["block_ms"], 2)
            results.append(row)
            print(json.dumps(row), flush=True)
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; kernel path {kernel_isa()}; torch threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| rows | block kernel ms | packed float32 ms | packed / block |")
    print("|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['rows']} | {r['block_ms']} | {r['packed_f32_ms']} | {r['packed_over_block']} |")
    print(json.dumps({"bench": "q4_step_rows", "kernel_isa": kernel_isa(), "threads": args.threads, **cpu,
                      "load_avg_1m": os.getloadavg()[0], "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
