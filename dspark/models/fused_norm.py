"""RMSNorm of float32 rows on a CPU in one kernel call, with the bits of torch's `F.rms_norm`
(`csrc/rms_norm.cpp`), and the decoder layer's residual add fused in front of it.

torch's CPU RMSNorm is seven operators (pow, sum, div, add, rsqrt, mul, mul); at one decode row
of SmolLM2 (576 numbers) they cost ~30 us, almost all operator overhead, and a decode step runs
61 of them. The kernel computes the same float32 steps in the same order, the sum of squares
as ATen's cascade sum does it, whose lane count is ATen's float vector width on this CPU (8 or
16). That width is not asked of torch: at first use the kernel is run with each candidate on a
fixed set of rows and compared with `F.rms_norm` bit for bit; the width that matches everywhere
is used, and where none does (another torch, another reduction) `lanes()` is None and callers keep
`F.rms_norm`.

The kernel is compiled on first use with `torch.utils.cpp_extension` and cached under a name
that carries a digest of the source and flags, as the attention kernel is.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.models.paged_attention import KERNEL_ISA_FLAGS_ENV

__all__ = ["lanes", "rms_norm", "add_rms_norm", "MIN_FEATURES"]

_SOURCE = Path(__file__).with_name("csrc") / "rms_norm.cpp"
_log = logging.getLogger(__name__)
MIN_FEATURES = 16
"""Rows narrower than this take torch's scalar sum (another order): they keep `F.rms_norm`."""


def _build(flags: tuple[str, ...]):
    from dspark.models.kernel_load import load_kernel

    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    return load_kernel(f"dspark_rms_norm_{digest}", sources=[str(_SOURCE)],
                       extra_cflags=["-O3", "-march=native", *flags, "-ffp-contract=off"],
                       verbose=False)


@functools.cache
def _extension():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    try:
        return _build(tuple(os.environ.get(KERNEL_ISA_FLAGS_ENV, "").split()))
    except Exception as exc:  # no compiler headers, no ninja: say why once
        _log.warning("fused RMSNorm kernel unavailable (%s); torch's rms_norm is used", exc)
        return None


def _matches_torch(ext, num_lanes: int) -> bool:
    """Whether the kernel with `num_lanes` gives F.rms_norm's bits on rows of several widths
    (multiples of 4, 8 and 16 vectors and ragged tails) and magnitudes."""
    g = torch.Generator().manual_seed(0)
    for n in (16, 24, 32, 64, 100, 128, 576, 960, 1536, 2048, 4100):
        for rows in (1, 3, 8):
            x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, rows)[:, None]
            w = torch.rand(n, generator=g) + 0.5
            for eps in (1e-5, 1e-6):
                if not torch.equal(ext.rms_norm(x, w, eps, num_lanes), F.rms_norm(x, (n,), w, eps)):
                    return False
    return True


@functools.cache
def lanes() -> int | None:
    """ATen's float vector width as the kernel needs it (8 or 16), found by comparing with
    F.rms_norm; None: no kernel here, or no width gives torch's bits (use F.rms_norm)."""
    ext = _extension()
    if ext is None:
        return None
    with torch.inference_mode():
        for num_lanes in (8, 16):
            if _matches_torch(ext, num_lanes):
                return num_lanes
    _log.warning("fused RMSNorm kernel does not reproduce torch's rms_norm here; torch's is used")
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (n,), weight, eps), same bits: x [rows, n] float32 contiguous (CPU),
    weight [n]. Only where `lanes()` is not None."""
    return _extension().rms_norm(x, weight, eps, lanes())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, F.rms_norm(h, (n,), weight, eps)) with h = x + residual, same bits, one call:
    x, residual [rows, n] float32 contiguous (CPU). Only where `lanes()` is not None."""
    h, normed = _extension().add_rms_norm(x, residual, weight, eps, lanes())
    return h, normed
