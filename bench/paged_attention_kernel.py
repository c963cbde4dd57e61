"""The block-table attention kernel alone, against the memory it must read: is decode attention
bound by arithmetic or by memory traffic on this CPU?

One layer of SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64, KV blocks of 16)
for `--streams` requests with `--context` cached tokens each, their blocks scattered over the
cache in a random order, as in a long-running server. Each row times one kernel call for
`--new-tokens` new tokens per request (1: a decode step; 8: a verification block), and beside it
the time to copy the same K/V bytes (a contiguous `clone` of that much cache: the memory ceiling
of this core, measured in the same run). Alone, one layer's K/V stays in the caches from call
to call; `--layers 30` calls 30 layers' caches in turn, as a SmolLM2 decode step does, and reads a
layer's share of a q4 step's weights (3.2 MB, untimed) before each call, so that each layer's K/V
comes from memory, as it does in a step. *kernel GB/s* is the K/V bytes the call reads over its
time; when it nears the copy rate, a faster kernel cannot help much and only fewer bytes (bf16 KV,
more threads, fewer layers) can. Prints a table with the CPU model and flags and ends with one
JSON line. `--against REV` also compiles the kernel source of git revision REV and times it on
the same inputs in the same run, interleaved (columns REV ms and speed-up). `--isa-flags=...` builds
both kernels with compiler flags after -march=native: `--isa-flags=-mno-avx512f` times what an AVX2-only CPU
runs, on a CPU that also has AVX-512. `--against-isa-flags=...` builds the other kernel with its own
flags; alone, it times this tree's source against itself built so (`=-mno-avx512bf16`: without the
bf16 dot products). Usage:
    .venv/bin/python bench/paged_attention_kernel.py [--streams 16,128] [--context 128]
        [--new-tokens 1,8] [--dtypes float32,bfloat16] [--threads 1] [--repeats 20] [--layers 30]
        [--against REV] [--isa-flags=-mno-avx512f] [--against-isa-flags=-mno-avx512bf16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dspark.cpu_info import cpu_description
from dspark.models.paged_attention import (build_cpu_kernel, cpu_kernel_available,
                                           paged_attention)
from dspark.paths import REPO_ROOT


KERNEL_SOURCE = "dspark/models/csrc/paged_attention.cpp"

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16

STEP_WEIGHT_BYTES = 96 * 2**20
"""What a q4 SmolLM2 decode step reads of weights (the GGUF's blocks), between two reads of a layer's K/V."""


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_at(revision: str, isa_flags: tuple[str, ...] = ()):
    """The kernel of a git revision ("" for the working tree), compiled here with `isa_flags`
    (module name by its blob and flags, so builds cache)."""
    if not revision:
        path = REPO_ROOT / KERNEL_SOURCE
        tag = hashlib.sha256(path.read_bytes() + " ".join(isa_flags).encode()).hexdigest()
        return build_cpu_kernel(path, f"paged_attention_{tag[:12]}", isa_flags)
    source = subprocess.run(["git", "show", f"{revision}:{KERNEL_SOURCE}"], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout
    blob = subprocess.run(["git", "rev-parse", f"{revision}:{KERNEL_SOURCE}"], cwd=REPO_ROOT,
                          check=True, capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.mkdtemp()) / "paged_attention.cpp"
    path.write_text(source)
    flags_tag = hashlib.sha256(" ".join(isa_flags).encode()).hexdigest()[:6] if isa_flags else ""
    return build_cpu_kernel(path, f"paged_attention_{blob[:12]}{flags_tag}", isa_flags)


def time_case(streams: int, context: int, new_tokens: int, dtype: torch.dtype, repeats: int,
              ours, baseline=None, layers: int = 1) -> dict:
    """ours, baseline: kernel modules (`.paged_attention(..., long_min_q_len)`). With `layers`
    > 1, each timing calls `layers` layers' caches in turn (the same block tables), reading a
    layer's share of a q4 step's weights (`STEP_WEIGHT_BYTES` / 30, untimed) before each call,
    and counts the kernel's time a layer: each layer's K/V then comes from memory, as in a
    decode step."""
    gen = torch.Generator().manual_seed(0)
    blocks_each = -(-context // BLOCK_SIZE)
    num_blocks = streams * blocks_each + 1
    caches = [(torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
               torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
              for _ in range(layers)]  # (k_cache, v_cache) a layer
    order = torch.randperm(num_blocks, generator=gen)[:streams * blocks_each]
    block_tables = order.view(streams, blocks_each).contiguous()  # [R, blocks_each]
    query_start = torch.arange(streams + 1) * new_tokens  # [R + 1]
    context_lens = torch.full((streams,), context)  # [R]
    q = torch.randn(streams * new_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = (block_tables, query_start, context_lens, HEAD_DIM ** -0.5, 0)

    weights = ([torch.ones(STEP_WEIGHT_BYTES // 30 // 4) for _ in range(layers)] if layers > 1
               else [])  # float32, a layer's share of the step's weight reads

    def every_layer(kernel) -> float:
        """Seconds in the kernel, over all layers."""
        seconds = 0.0
        for i, (k_cache, v_cache) in enumerate(caches):
            if weights:
                weights[i].sum()  # streams through the caches, as a layer's products do
            start = time.perf_counter()
            kernel.paged_attention(q, k_cache, v_cache, *meta)
            seconds += time.perf_counter() - start
        return seconds

    def median_kernel_seconds(kernel) -> float:
        every_layer(kernel)  # warm-up
        return statistics.median(every_layer(kernel) for _ in range(repeats)) / layers

    kernel = median_kernel_seconds(ours)
    old = None
    if baseline is not None:  # interleaved with a second timing of ours: load drifts hit both
        old = median_kernel_seconds(baseline)
        kernel = min(kernel, median_kernel_seconds(ours))
        args = (q, *caches[0], *meta)
        torch.testing.assert_close(ours.paged_attention(*args).float(),
                                   baseline.paged_attention(*args).float(),
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    kv_bytes = 2 * streams * context * KV_HEADS * HEAD_DIM * q.element_size()  # q: the caches' dtype
    # The same bytes as one contiguous tensor, copied: what this core's memory moves per second.
    flat = torch.randn(kv_bytes // q.element_size(), generator=gen).to(dtype)
    copy = median_seconds(flat.clone, repeats)
    return {"streams": streams, "context": context, "new_tokens": new_tokens, "layers": layers,
            "dtype": str(dtype).removeprefix("torch."), "kernel_ms": round(1000 * kernel, 3),
            "kv_mb": round(kv_bytes / 2**20, 2), "kernel_gb_s": round(kv_bytes / kernel / 1e9, 2),
            "copy_gb_s": round(kv_bytes / copy / 1e9, 2),
            **({} if old is None else {"baseline_ms": round(1000 * old, 3),
                                       "speedup": round(old / kernel, 2)})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="16,128")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", default="1,8")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=1,
                        help="layers' caches called in turn (30: a SmolLM2 step, K/V from memory)")
    parser.add_argument("--against", default="",
                        help="a git revision whose kernel to time beside this one (e.g. HEAD~1)")
    parser.add_argument("--isa-flags", default="",
                        help='compiler flags for both kernels after -march=native, e.g. --isa-flags=-mno-avx512f')
    parser.add_argument("--against-isa-flags", default=None,
                        help="flags for the kernel timed beside this one instead of --isa-flags; with no "
                             "--against it is this tree's source: --against-isa-flags=-mno-avx512bf16 "
                             "times the bf16 dot products against the same kernel without them")
    args = parser.parse_args()
    if not cpu_kernel_available():
        print("the paged attention CPU kernel does not build here (no C++ compiler)")
        return 1
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    isa_flags = tuple(args.isa_flags.split())
    ours = kernel_at("", isa_flags) if isa_flags else SimpleNamespace(paged_attention=paged_attention)
    baseline, label = None, ""
    if args.against or args.against_isa_flags is not None:  # REV's source, or this tree's ("")
        own_flags = args.against_isa_flags is not None
        baseline = kernel_at(args.against, tuple(args.against_isa_flags.split()) if own_flags else isa_flags)
        label = (args.against or "this tree") + (f" {args.against_isa_flags}" if own_flags else "")
    rows = [time_case(s, args.context, n, getattr(torch, d), args.repeats, ours, baseline, args.layers)
            for d in args.dtypes.split(",") for s in map(int, args.streams.split(","))
            for n in map(int, args.new_tokens.split(","))]
    built = f"; kernels built with {args.isa_flags}" if isa_flags else ""
    print(f"CPU: {cpu['cpu']}, flags {' '.join(cpu['flags'])}; {args.threads} thread(s); "
          f"context {args.context} tokens a stream; {args.layers} layer(s) in turn{built}\n")
    against = f" | {label} ms | speed-up" if baseline else ""
    print(f"| dtype | streams | new tokens | kernel ms (one layer) | K/V MB | kernel GB/s | "
          f"copy GB/s{against} |")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if baseline else ""))
    for r in rows:
        extra = f" | {r['baseline_ms']} | {r['speedup']}x" if baseline else ""
        print(f"| {r['dtype']} | {r['streams']} | {r['new_tokens']} | {r['kernel_ms']} | "
              f"{r['kv_mb']} | {r['kernel_gb_s']} | {r['copy_gb_s']}{extra} |")
    print(json.dumps({"bench": "paged_attention_kernel", "cpu": cpu["cpu"], "flags": cpu["flags"],
                      "threads": args.threads, "against": label or None,
                      "isa_flags": args.isa_flags or None, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
