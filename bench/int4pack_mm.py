"""torch's own 4-bit CPU matmul (`_weight_int4pack_mm_for_cpu`) on the target's Q4_1 blocks,
against our block kernel: does it compute the same float32 model, is a row's result the same
bits alone, in 8 and in 64 rows, and how fast is it.

torch's int4 weights are w = (q - 8) * scale + zero per group of 32 along the input, q in 0..15,
scale and zero in the activations' dtype. A Q4_1 block (w = d * q + m, d and m fp16) maps onto it
with scale = d, zero = m + 8 * d, q unchanged (no requantisation). With float32 activations and
float32 scales, (q - 8) * d is exact and so is m + 8 * d wherever d's and m's exponents are close
enough (checked below, weight by weight, through the identity matrix), so torch then widens to
our float32 weights. With bfloat16 activations and scales (the dtype torch's fast 4-bit paths
are written for) the scales, the zeros and the activations are rounded to bfloat16: another
model, measured here for its speed and its distance only.

For the four Q4_1 projections of a layer (fused q|k|v, o, fused gate|up, down; the Q8_0 LM head
has no int4 form) and 1, 8 and 64 rows: microseconds per product, median of `--repeats` timings
of `--iters` calls each, the kernels taken in turns.

    .venv/bin/python bench/int4pack_mm.py [--threads 1] [--rows 1,8,64] [--iters 20] [--repeats 5]
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
from dspark.models.quantized_linear import (BLOCK_WEIGHTS, BlockFormat, BlockWeight, block_linear,  # noqa: E402
                                            dequantize, kernel_isa)

SHAPES = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
          "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}


def int4pack_operands(weight: BlockWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks (outputs a multiple of 16, as torch packs them) -> (torch's packed int4 weight,
    scales_and_zeros [in / 32, out, 2] in `dtype`)."""
    if weight.format is not BlockFormat.Q4_1:
        raise ValueError("only Q4_1 blocks have an int4 form")
    out, nb = weight.out_features, weight.in_features // BLOCK_WEIGHTS
    b = weight.blocks.reshape(out, nb, weight.format.value)
    d = b[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [out, nb]
    m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    qs = b[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(out, weight.in_features).to(torch.int32)  # [out, in]
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scales_and_zeros


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, packed, BLOCK_WEIGHTS, scales_and_zeros)


def widened_weights(packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int) -> torch.Tensor:
    """The weights torch's product uses, [out, in] float32: the product with the identity (each
    output is one weight times 1 plus exact zeros, whatever the summation order)."""
    eye = torch.eye(in_features, dtype=scales_and_zeros.dtype)
    return int4pack_linear(eye, packed, scales_and_zeros).T.float()


def batch_invariant(fn, x64: torch.Tensor) -> bool:
    """Row 0's outputs the same bits alone, in the first 8 rows and in all 64."""
    alone, in8, in64 = fn(x64[:1]), fn(x64[:8])[:1], fn(x64)[:1]
    return torch.equal(alone, in8) and torch.equal(alone, in64)


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
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)

    # Same weights? Every Q4_1 projection of every layer, weight by weight.
    differing = {"float32": 0, "bfloat16": 0}
    total = 0
    with torch.inference_mode():
        for layer in range(config.num_hidden_layers):
            for part in SHAPES.values():
                w = blocks[f"layers.{layer}.{part}"]
                dense = dequantize(w)
                total += dense.numel()
                for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                    packed, sz = int4pack_operands(w, dtype)
                    differing[name] += int((widened_weights(packed, sz, w.in_features) != dense).sum())
    same_weights = {name: f"{total - n} of {total}" for name, n in differing.items()}
    print(json.dumps({"weights_equal_to_dequantised": same_weights}), flush=True)

    results = []
    with torch.inference_mode():
        for label, part in SHAPES.items():
            w = blocks[f"layers.0.{part}"]
            p32, sz32 = int4pack_operands(w, torch.float32)
            p16, sz16 = int4pack_operands(w, torch.bfloat16)
            x64 = torch.randn(64, w.in_features)
            exact = x64.double() @ dequantize(w).double().T
            products = {"block": lambda x: block_linear(x, w),
                        "int4pack_f32": lambda x: int4pack_linear(x, p32, sz32),
                        "int4pack_bf16": lambda x: int4pack_linear(x.bfloat16(), p16, sz16)}
            scale = exact.abs().max().item()
            error = {k: round((fn(x64).double() - exact).abs().max().item() / scale, 9) for k, fn in products.items()}
            invariant = {k: batch_invariant(fn, x64) for k, fn in products.items()}
            for rows in rows_list:
                x = torch.randn(rows, w.in_features)
                xb = x.bfloat16()
                fns = {"block": lambda: block_linear(x, w), "int4pack_f32": lambda: int4pack_linear(x, p32, sz32),
                       "int4pack_bf16": lambda: int4pack_linear(xb, p16, sz16)}
                us = median_us_in_turns(fns, args.iters, args.repeats)
                row = {"layer": label, "out": w.out_features, "in": w.in_features, "rows": rows,
                       **{f"{k}_us": round(v, 1) for k, v in us.items()},
                       "max_error_over_max_output": error, "row_alone_in_8_in_64_same_bits": invariant}
                results.append(row)
                print(json.dumps(row), flush=True)
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; block kernel path {kernel_isa()}; torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}\n")
    print(f"weights equal to the dequantised model's: float32 scales {same_weights['float32']}, "
          f"bfloat16 scales {same_weights['bfloat16']}\n")
    print("| layer | out x in | rows | block kernel us | int4pack float32 us | int4pack bf16 us | "
          "int4pack f32 time / block time | same bits alone/8/64 (block, f32, bf16) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        inv = r["row_alone_in_8_in_64_same_bits"]
        print(f"| {r['layer']} | {r['out']} x {r['in']} | {r['rows']} | {r['block_us']} | {r['int4pack_f32_us']} | "
              f"{r['int4pack_bf16_us']} | {r['int4pack_f32_us'] / r['block_us']:.2f}x | "
              f"{inv['block']}, {inv['int4pack_f32']}, {inv['int4pack_bf16']} |")
    print(json.dumps({"bench": "int4pack_mm", "kernel_isa": kernel_isa(), "threads": args.threads,
                      "torch": torch.__version__, **cpu, "load_avg_1m": os.getloadavg()[0],
                      "weights_equal_to_dequantised": same_weights, "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
