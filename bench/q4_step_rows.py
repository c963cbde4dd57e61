"""Where the block kernel stops paying: a decode step's products at many rows, GGUF blocks
against the packed float32 weights (the runner's `q4_max_rows` switches between the two).

All 121 products of a SmolLM2 step in model order (qkv, o, gate_up, down of the 30 layers on
their Q4_1 blocks, then the LM head on its Q8_0 blocks; 96 MB of blocks, 540 MB of float32, so
both read their weights from memory as in a real pass), at each row count, block kernel and
oneDNN-packed float32 taken in turns `--repeats` times; median milliseconds per step's products.

Beside them, the arithmetic floor of an exact float32 step: rows x the step's multiply-adds (134.5 M
a row for SmolLM2) at the highest rate a large float32 GEMM reached in the run (`--gemm-size`,
oneDNN, the same threads, timed between the row counts; a GEMM that large runs near the core's FMA
peak, and the highest rate gives the lowest floor). Both paths multiply in float32
with float32 FMAs, one per weight and row, so neither can take less than that floor: at a row count
where the packed path is already within 2x of the floor, no exact float32 kernel can be 2x faster.

    .venv/bin/python bench/q4_step_rows.py [--rows 1,8,16,32,64,128] [--threads 1] [--repeats 5]
        [--gemm-size 1536]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from q4_linear import median_us_in_turns  # noqa: E402

from dspark.cpu_info import cpu_description, cpu_line  # noqa: E402
from dspark.fetch import ensure_gguf  # noqa: E402
from dspark.models.config import ModelConfig  # noqa: E402
from dspark.models.gguf_blocks import read_block_weights  # noqa: E402
from dspark.models.packed_linear import pack_weight, packed_linear  # noqa: E402
from dspark.models.quantized_linear import block_linear, dequantize, kernel_isa  # noqa: E402


def gemm_rate(size: int, repeats: int) -> float:
    """Multiply-adds per second of a float32 [size, size] @ [size, size] product (median of
    `repeats` after one warm-up): this core's practical float32 FMA rate at the set threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    us = median_us_in_turns({"mm": lambda: torch.mm(a, b)}, 1, repeats)["mm"]
    return size ** 3 / (us * 1e-6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-size", type=int, default=1536,
                        help="side of the square float32 GEMM whose rate sets the floor")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = ensure_gguf()
    blocks = read_block_weights(gguf, ModelConfig.from_pretrained(gguf.parent))
    weights = [w for name, w in blocks.items() if name != "lm_head"] + [blocks["lm_head"]]
    packed = [pack_weight(dequantize(w)) for w in weights]  # [out, in] float32, oneDNN layout
    macs_per_row = sum(w.in_features * w.out_features for w in weights)  # a step's multiply-adds, one row
    results, rates = [], []
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(rows, k) for k in {w.in_features for w in weights}}
            steps = {"block": lambda: [block_linear(xs[w.in_features], w) for w in weights],
                     "packed_f32": lambda: [packed_linear(xs[w.in_features], p, None) for w, p in zip(weights, packed)]}
            # each step once first (its first pass also faults in the weights' pages), then in turns
            us = median_us_in_turns(steps, 1, args.repeats)
            row = {"rows": rows, **{f"{k}_ms": round(v / 1e3, 1) for k, v in us.items()}}
            row["packed_over_block"] = round(row["packed_f32_ms"] / row["block_ms"], 2)
            rates.append(gemm_rate(args.gemm_size, args.repeats))  # taken between the row counts
            results.append(row)
            print(json.dumps(row), flush=True)
    rate = max(rates)  # multiply-adds a second
    for row in results:
        row["floor_ms"] = round(row["rows"] * macs_per_row / rate * 1e3, 1)
        row["block_over_floor"] = round(row["block_ms"] / row["floor_ms"], 2)
        row["packed_over_floor"] = round(row["packed_f32_ms"] / row["floor_ms"], 2)
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; kernel path {kernel_isa()}; torch threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.1f}; {macs_per_row / 1e6:.1f} M multiply-adds a row; "
          f"floor at the best {args.gemm_size}^3 float32 GEMM rate of the run, {rate / 1e9:.1f} G "
          f"multiply-adds/s ({', '.join(f'{r / 1e9:.1f}' for r in rates)})\n")
    print("| rows | block kernel ms | packed float32 ms | packed / block | float32 floor ms "
          "| block / floor | packed / floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['rows']} | {r['block_ms']} | {r['packed_f32_ms']} | {r['packed_over_block']} "
              f"| {r['floor_ms']} | {r['block_over_floor']} | {r['packed_over_floor']} |")
    print(json.dumps({"bench": "q4_step_rows", "kernel_isa": kernel_isa(), "threads": args.threads, **cpu,
                      "load_avg_1m": os.getloadavg()[0], "macs_per_row": macs_per_row,
                      "gemm_size": args.gemm_size, "gemm_macs_per_s": rates, "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
