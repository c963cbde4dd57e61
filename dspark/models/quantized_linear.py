"""Weight-only linears on GGUF blocks: y = x W^T (+ b) with W read as the file's own Q4_1 / Q8_0
blocks, float32 activations and accumulation (`csrc/block_linear.cpp`).

The SmolLM2 target we serve IS a GGUF file: every weight of its layers' projections is Q4_1
(`d * q + m` per 32 weights) and its tied embedding / LM head is Q8_0 (`d * q`). The kernel widens
each block in registers to exactly the float32 weights of the dequantised model
(`dequantize` here, and transformers' GGUF loader, give the same bits) and multiplies in float32:
the same float32 model, read from a sixth of the bytes, in another (fixed) summation order than
a float32 GEMM's. That order does not depend on the number of rows, the tiling or the thread
count: a row's result is bit-identical alone, in a verification block of 8 or in a batch of 64
(batch invariance), and the AVX-512, AVX2 and portable paths agree bit for bit.

The kernel is compiled on first use with `torch.utils.cpp_extension` and cached, as the paged
attention kernel is (`-march=native`; `DSPARK_KERNEL_ISA_FLAGS` builds a narrower path). Where no
C++ compiler is found `kernel_available()` is False and the runner keeps float32 weights.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from dspark.models.paged_attention import KERNEL_ISA_FLAGS_ENV

__all__ = ["BlockFormat", "BlockWeight", "block_linear", "dequantize", "quantize_q8_0", "kernel_available",
           "build_kernel", "kernel_isa"]

_SOURCE = Path(__file__).with_name("csrc") / "block_linear.cpp"
_log = logging.getLogger(__name__)
PROFILER_LABEL = "dspark::block_linear"
BLOCK_WEIGHTS = 32
"""Weights per GGUF block (ggml's QK4_1 and QK8_0)."""


class BlockFormat(enum.Enum):
    """GGUF block formats the kernel reads: value = bytes per block of 32 weights."""

    Q4_1 = 20  # fp16 d, fp16 m, 16 bytes of nibbles (low nibbles: weights 0..15, high: 16..31)
    Q8_0 = 34  # fp16 d, 32 int8


@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """W [out_features, in_features] as GGUF blocks: `blocks` [out_features, in_features / 32 *
    format.value] uint8, row n holding output n's blocks in order."""

    format: BlockFormat
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"blocks must be [out, bytes] uint8, got {tuple(self.blocks.shape)} {self.blocks.dtype}")
        if self.in_features % BLOCK_WEIGHTS or self.blocks.shape[1] != self.in_features // BLOCK_WEIGHTS * self.format.value:
            raise ValueError(f"{self.format.name} blocks of {self.blocks.shape[1]} bytes per output do not hold "
                             f"{self.in_features} weights")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Outputs of several weights stacked (fused q|k|v, gate|up): rows of blocks concatenated."""
        fmt, in_features = parts[0].format, parts[0].in_features
        if any(p.format != fmt or p.in_features != in_features for p in parts):
            raise ValueError("only weights of one format and input size are stacked")
        return BlockWeight(fmt, torch.cat([p.blocks for p in parts]), in_features)


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float32 weights [out_features, in_features] the blocks stand for (ggml's and gguf-py's
    dequantisation: d * q + m in float32, d * q exact)."""
    out, nb = weight.out_features, weight.in_features // BLOCK_WEIGHTS
    b = weight.blocks.reshape(out, nb, weight.format.value)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [out, nb, 1]
    if weight.format is BlockFormat.Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # [out, nb, 32]
        w = d * q + m
    else:
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    return w.reshape(out, weight.in_features)


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Float weights W [out_features, in_features] (in_features a multiple of 32) -> Q8_0 blocks:
    per 32 weights d = max|w| / 127 stored as fp16 (rounded up where rounding to nearest would
    leave it below max|w| / 127), q = round(w / d) with that fp16 d (halves away from zero, as
    ggml rounds), so every dequantised weight is within d / 2 of w. For
    weights that are themselves Q8_0 blocks dequantised (the target's LM head) this returns
    those blocks bit for bit: d * 127 / 127 is d again and d * q / d is q."""
    out, in_features = weight.shape
    if in_features % BLOCK_WEIGHTS:
        raise ValueError(f"Q8_0 needs in_features a multiple of {BLOCK_WEIGHTS}, got {in_features}")
    w = weight.detach().float().reshape(out, in_features // BLOCK_WEIGHTS, BLOCK_WEIGHTS)  # [out, nb, 32]
    step = w.abs().amax(dim=-1, keepdim=True) / 127  # [out, nb, 1]
    d = step.half()
    # fp16 rounded d below the step (most often a subnormal d, max|w| < 0.008) would put
    # max|w| / d past 127: take the next fp16 up, so q stays in range and within half a step
    d = torch.where(d.float() < step, torch.nextafter(d, torch.full_like(d, float("inf"))), d)
    d32 = d.float()
    scaled = torch.where(d32 > 0, w / d32, torch.zeros_like(w))  # an all-zero block: d = 0, q = 0
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)  # [out, nb, 32]
    blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [out, nb, 34]
    return BlockWeight(BlockFormat.Q8_0, blocks.reshape(out, -1).contiguous(), in_features)


def build_kernel(name: str, isa_flags: tuple[str, ...] = ()):
    """Compile csrc/block_linear.cpp into extension `name` for this CPU (-march=native), with
    `isa_flags` after it for a narrower path (("-mno-avx512f",): AVX2; ("-mno-avx512f",
    "-mno-avx2", "-mno-fma"): portable)."""
    from dspark.models.kernel_load import load_kernel

    return load_kernel(name, sources=[str(_SOURCE)],
                       extra_cflags=["-O3", "-march=native", *isa_flags, "-fopenmp"],
                       extra_ldflags=["-fopenmp"], verbose=False)


def _kernel_name(flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256((_SOURCE.read_bytes() + " ".join(flags).encode())).hexdigest()[:10]
    return f"dspark_block_linear_{digest}"


@functools.cache
def _extension():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    try:
        flags = tuple(os.environ.get(KERNEL_ISA_FLAGS_ENV, "").split())
        return build_kernel(_kernel_name(flags), flags)
    except Exception as exc:  # no compiler headers, no ninja: say why once
        _log.warning("GGUF block linear kernel unavailable (%s); float32 weights are used", exc)
        return None


def kernel_available() -> bool:
    """Whether the block kernel builds (or is already built) here."""
    return _extension() is not None


def kernel_isa() -> str | None:
    """The path the kernel runs: "avx512", "avx2" or "portable"; None: no kernel."""
    ext = _extension()
    return None if ext is None else ext.isa()


def block_linear(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features] float32 -> [..., out_features] float32 (CPU).

    A decode step calls this 121 times for SmolLM2 (4 products x 30 layers + the LM head), so the
    Python around the kernel call is kept to a few operations: the profiler label is entered only
    while a profiler runs (entering it costs ~6 us), and a 2-D x is passed as it is."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the GGUF block linear kernel is not available on this machine")
    fn = ext.q4_1_linear if weight.format is BlockFormat.Q4_1 else ext.q8_0_linear
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(PROFILER_LABEL):
            return _product(fn, x, weight, bias)
    return _product(fn, x, weight, bias)


def _product(fn, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() == 2:
        return fn(x, weight.blocks, bias)
    return fn(x.reshape(-1, x.shape[-1]), weight.blocks, bias).view(*x.shape[:-1], weight.out_features)
