"""The CPU a measurement ran on: model, core count and the vector flags that pick the kernels.

Speed results differ between CPU kinds (AVX2-only, AVX-512, AVX512-BF16, AMX), so every benchmark
prints this beside its numbers.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_description() -> dict:
    """The CPU model and the vector flags that decide which kernels run."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    described = {"cpu": model, "flags": [f for f in wanted if f in flags], "cores": os.cpu_count()}
    # Code paths capped below the CPU's (an AVX2-only CPU's paths on an AVX-512 one): torch's
    # own kernels, oneDNN, MKL, and the runners' attention kernel (dspark.models.paged_attention).
    caps = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                "MKL_ENABLE_INSTRUCTIONS", "DSPARK_KERNEL_ISA_FLAGS")
            if os.environ.get(name)}
    if caps:
        described["isa_caps"] = caps
        described["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return described


def cpu_line(described: dict | None = None) -> str:
    """'<model>, <cores> cores, flags <flags>': the line a benchmark prints beside its numbers."""
    cpu = cpu_description() if described is None else described
    return f"{cpu['cpu']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}"
