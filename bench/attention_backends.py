"""The runner's attention implementations side by side on one device, on SmolLM2-135M's attention
shape (9 query heads, 3 KV heads, head_dim 64, 30 layers, KV blocks of 16): which one should a
device run? (docs/gpu.md, "Attention".)

Each row is one pass of the target over a flattened batch: `--batches` requests with `--context`
tokens each in the cache (blocks scattered over it in a random order, as in a long-running
server), and per request `--new-tokens` new tokens (8: a verification block; 1: a decode row);
the "mixed" rows add one request with a `--chunk`-token prompt chunk (default 256, the runner's
max_tokens_per_pass) continuing a context of as many tokens.
A pass is what the runner does for it: the per-pass setup an implementation needs (FLEX's
BlockMask), then one attention call per layer, each layer with its own cache. Implementations:
`paged` (the C++ CPU kernel), `padded` (one SDPA call over contexts gathered into a padded
batch), `flex` (FlexAttention with a block-table BlockMask; compiled on CUDA), `triton` (the
Triton kernel; on a CPU only under TRITON_INTERPRET=1, very slow). Beside each time, the largest
difference from the per-request SDPA reference on the first layer (`max |diff|`): a backend that
is fast but wrong shows it here. Prints a table and ends with one JSON line (per batch shape the
fastest backend). Usage:
    .venv/bin/python bench/attention_backends.py [--device auto|cpu|cuda] [--backends padded,flex,triton]
        [--batches 1,8,32,64] [--new-tokens 8,1] [--context 512] [--chunk 256] [--layers 30]
        [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark.models.flex_paged_attention import build_flex_mask, flex_paged_attention
from dspark.models.paged_attention import (cpu_kernel_available, padded_attention, paged_attention,
                                           reference_attention)
from dspark.models.triton_paged_attention import triton_available, triton_paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--backends", default=None,
                   help="comma-separated; default: paged,padded on a CPU, padded,flex,triton on CUDA")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--new-tokens", default="8,1", help="new tokens per request (8: verify, 1: decode)")
    p.add_argument("--context", type=int, default=512, help="cached tokens per request before the pass")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--chunk", type=int, default=256, help="prompt chunk of the mixed rows (0: none)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


class Pass:
    """One flattened batch's inputs on `device`: per-layer caches, queries and block tables."""

    def __init__(self, query_lens: list[int], context_lens: list[int], layers: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        needed = [-(-c // BLOCK_SIZE) for c in context_lens]
        num_blocks = sum(needed) + 1
        order = torch.randperm(num_blocks, generator=g).tolist()
        self.tables, used = [], 0
        for n in needed:
            self.tables.append(order[used:used + n])
            used += n
        width = max(needed)
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                                         dtype=torch.int64, device=device)  # [R, width]
        self.query_lens, self.context_lens = query_lens, context_lens
        self.q_lens_t = torch.tensor(query_lens, device=device)  # [R]
        self.ctx_lens_t = torch.tensor(context_lens, device=device)  # [R]
        self.query_start = torch.tensor([0] + torch.cumsum(torch.tensor(query_lens), 0).tolist(),
                                        device=device)  # [R + 1]
        self.positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)]
                                   ).to(device)  # [num_tokens]
        shape = (layers, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        # the tables' blocks drawn, the rest zero: unwritten slots finite, as in a `zeroed` cache
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        written = torch.tensor(order[:used], device=device)
        self.k[:, written] = torch.randn(layers, used, *shape[2:], generator=g).to(device, dtype)
        self.v[:, written] = torch.randn(layers, used, *shape[2:], generator=g).to(device, dtype)
        self.q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=g).to(device, dtype)
        self.scale = HEAD_DIM ** -0.5

    def layer_call(self, backend: str):
        """fn(layer) -> out [num_tokens, HEADS, HEAD_DIM] for one layer, after the per-pass setup."""
        if backend == "paged":
            return lambda i: paged_attention(self.q, self.k[i], self.v[i], self.block_tables,
                                             self.query_start, self.ctx_lens_t, self.scale)
        if backend == "padded":
            max_q, max_ctx = max(self.query_lens), max(self.context_lens)
            return lambda i: padded_attention(self.q, self.k[i], self.v[i], self.block_tables,
                                              self.q_lens_t, self.ctx_lens_t, self.scale, max_q, max_ctx)
        if backend == "flex":
            mask = build_flex_mask(self.block_tables, self.query_start, self.ctx_lens_t, self.positions,
                                   self.k.shape[1], BLOCK_SIZE)
            return lambda i: flex_paged_attention(self.q, self.k[i], self.v[i], mask, self.scale)
        if backend == "triton":
            max_q = max(self.query_lens)
            return lambda i: triton_paged_attention(self.q, self.k[i], self.v[i], self.block_tables,
                                                    self.query_start, self.ctx_lens_t, self.scale, max_q)
        raise ValueError(f"unknown backend {backend!r}")

    def run(self, backend: str) -> torch.Tensor:
        """One pass: setup and every layer; returns the last layer's output."""
        call = self.layer_call(backend)
        out = None
        for i in range(self.k.shape[0]):
            out = call(i)
        return out

    def max_diff(self, backend: str) -> float:
        """max |backend - reference| on layer 0 (float32)."""
        got = self.layer_call(backend)(0).float()
        expected = reference_attention(self.q, self.k[0], self.v[0], self.tables, self.query_lens,
                                       self.context_lens, self.scale).float()
        return (got - expected).abs().max().item()


def seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() (device work included), after two warm-up calls (compilation)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def available(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` (None: it can)."""
    if backend == "paged" and (device.type != "cpu" or not cpu_kernel_available()):
        return "the C++ kernel runs on a CPU with a compiler"
    if backend == "triton" and not triton_available(device):
        return "needs Triton and CUDA (or TRITON_INTERPRET=1)"
    return None


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
                          else args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    backends = (args.backends.split(",") if args.backends else
                ["padded", "flex", "triton"] if device.type == "cuda" else ["paged", "padded"])
    skipped = {b: why for b in backends if (why := available(b, device))}
    backends = [b for b in backends if b not in skipped]
    shapes = []  # (label, query_lens, context_lens)
    for new in (int(x) for x in args.new_tokens.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            shapes.append((f"{batch} x {new}", [new] * batch, [args.context + new] * batch))
            if args.chunk and new > 1:
                shapes.append((f"{batch} x {new} + chunk {args.chunk}", [new] * batch + [args.chunk],
                               [args.context + new] * batch + [2 * args.chunk]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, {dtype}, {args.layers} layers, context {args.context}, "
          f"heads {HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, block {BLOCK_SIZE}")
    for b, why in skipped.items():
        print(f"  {b}: skipped ({why})")
    print(f"{'batch':>24} {'backend':>8} {'pass ms':>9} {'max |diff|':>11}")
    rows, fastest = [], {}
    for label, query_lens, context_lens in shapes:
        inputs = Pass(query_lens, context_lens, args.layers, dtype, device)
        for backend in backends:
            try:
                diff = inputs.max_diff(backend)
                ms = 1e3 * seconds(lambda: inputs.run(backend), device, args.repeats)
            except Exception as exc:  # a backend that fails on this device is a result too
                print(f"{label:>24} {backend:>8} failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append(dict(batch=label, backend=backend, error=f"{type(exc).__name__}: {exc}"[:500]))
                continue
            print(f"{label:>24} {backend:>8} {ms:9.3f} {diff:11.2e}")
            rows.append(dict(batch=label, backend=backend, pass_ms=round(ms, 4), max_diff=diff))
            if label not in fastest or ms < fastest[label][1]:
                fastest[label] = (backend, ms)
        del inputs
    print(json.dumps(dict(bench="attention_backends", device=name, dtype=str(dtype).removeprefix("torch."),
                          layers=args.layers, context=args.context, skipped=skipped, rows=rows,
                          fastest={label: b for label, (b, _) in fastest.items()})))


if __name__ == "__main__":
    main()
