"""How a stack of local service processes shares the machine's cores between its two models.

`dspark up` and the load test's stacks start the verifier and the drafter on one machine. Each
process runs torch with its own thread pool, and two pools that together ask for more cores than
there are slow both down (threads wait on each other's cores). So the launcher splits the cores
it may use: the drafter (a two-layer model, a block at a time) gets one, the verifier (the
target, the bulk of the arithmetic) gets the rest, and without a drafter the verifier gets them
all. The scheduler, the gateway and their clients are light and share those cores.

Measured on a 2-core AVX512-BF16 EPYC, 16 Locust users, policy `none`: the verifier with 2
threads serves 1.18x the aggregate tokens/s of 1 thread (`docs/results/target_decode.md`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreSplit:
    verifier: int
    """torch threads of the verifier service."""
    drafter: int
    """torch threads of the drafter service; 0 = no drafter process."""


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity: a container's or taskset's limit)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def split_cores(use_drafter: bool, cores: int | None = None, verifier: int = 0,
                drafter: int = 0) -> CoreSplit:
    """The threads each model service gets out of `cores` (default: usable_cores()).

    `verifier` / `drafter` > 0 are taken as asked (the user's flags); 0 = split automatically:
    the drafter one core, the verifier the remaining ones (at least one)."""
    if verifier < 0 or drafter < 0:
        raise ValueError(f"thread counts must be >= 0 (0 = automatic), got {verifier}, {drafter}")
    cores = usable_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if not use_drafter:
        return CoreSplit(verifier or cores, 0)
    drafter = drafter or 1
    return CoreSplit(verifier or max(1, cores - drafter), drafter)
