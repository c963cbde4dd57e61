"""The GGUF block linear kernel against the packed float32 path, per SmolLM2 layer shape.

For each projection of the target (fused q|k|v, o, fused gate|up, down: Q4_1; the LM head: Q8_0)
and 1, 8 and 64 rows: microseconds per product of the block kernel (`quantized_linear`) on the
real GGUF's blocks, of oneDNN's packed float32 weights (`packed_linear`, the runner's float32
default) and of F.linear on the dense float32 weights; weight bytes read per product beside
them. Median of `--repeats` timings of `--iters` calls each, the kernels taken in turns.

    .venv/bin/python bench/q4_linear.py [--threads 1] [--rows 1,8,64] [--iters 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from dspark.cpu_info import cpu_description, cpu_line
from dspark.fetch import ensure_gguf
from dspark.models.config import ModelConfig
from dspark.models.gguf_blocks import read_block_weights
from dspark.models.packed_linear import pack_weight, packed_linear
from dspark.models.quantized_linear import block_linear, dequantize, kernel_isa


def per_call_us(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def median_us_in_turns(fns: dict, iters: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each of `fns` (each called once first), the functions
    taking turns `repeats` times, `iters` calls a turn, so that all see the same contention."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(per_call_us(fn, iters))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = ensure_gguf()
    config = ModelConfig.from_pretrained(gguf.parent)
    blocks = read_block_weights(gguf, config)
    shapes = {"qkv_proj": "layers.0.self_attn.qkv_proj", "o_proj": "layers.0.self_attn.o_proj",
              "gate_up_proj": "layers.0.mlp.gate_up_proj", "down_proj": "layers.0.mlp.down_proj",
              "lm_head": "lm_head"}
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode():
        for label, name in shapes.items():
            w = blocks[name]
            dense = dequantize(w)  # [out, in] float32
            packed = pack_weight(dense)
            for rows in rows_list:
                x = torch.randn(rows, w.in_features)
                fns = {"block": lambda: block_linear(x, w), "packed_f32": lambda: packed_linear(x, packed, None),
                       "F.linear_f32": lambda: F.linear(x, dense)}
                us = median_us_in_turns(fns, args.iters, args.repeats)
                row = {"layer": label, "format": w.format.name, "out": w.out_features, "in": w.in_features,
                       "rows": rows, "block_bytes": w.blocks.numel(), "f32_bytes": dense.numel() * 4,
                       **{f"{k}_us": round(v, 1) for k, v in us.items()}}
                row["packed_over_block"] = round(row["packed_f32_us"] / row["block_us"], 2)
                results.append(row)
                print(json.dumps(row), flush=True)
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; kernel path {kernel_isa()}; torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| layer (format) | out x in | rows | block kernel us | packed float32 us | F.linear float32 us | "
          "packed / block |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['layer']} ({r['format']}) | {r['out']} x {r['in']} | {r['rows']} | {r['block_us']} | "
              f"{r['packed_f32_us']} | {r['F.linear_f32_us']} | {r['packed_over_block']} |")
    print(json.dumps({"bench": "q4_linear", "kernel_isa": kernel_isa(), "threads": args.threads, **cpu,
                      "load_avg_1m": os.getloadavg()[0], "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
