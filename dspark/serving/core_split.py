"""How a stack of local service processes shares the machine's cores between its two models.

`dspark up` and the load test's stacks start the verifier and the drafter on one machine, each a
process with its own torch thread pool. With one scheduler cohort (the default) the two take
turns: a round drafts, then verifies, and neither model runs while the other does, so each gets
every core the launcher may use. With several cohorts (`--cohorts N`, dspark.serving.cohorts) one
cohort drafts while another verifies; two pools that together ask for more cores than there are
slow both down, so the drafter (a two-layer model) gets one core and the verifier (the target,
the bulk of the arithmetic) the rest. Without a drafter the verifier gets them all. The
scheduler, the gateway and their clients are light and share those cores.

Measured on a 2-core AVX512-BF16 EPYC, 16 Locust users, float32 (`docs/results/target_decode.md`):
policy `none`, the verifier on 2 threads serves 1.18x the aggregate tokens/s of 1 thread;
`async_topk` with one cohort, 2 threads each 1.16-1.27x 1 thread each.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
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


def scheduler_cohorts(scheduler_args: Sequence[str]) -> int:
    """The cohorts a scheduler started with `scheduler_args` runs, resolved as the scheduler
    resolves its flags (its `--cohorts`, else DSPARK_SCHEDULER_COHORTS, else SchedulerConfig's
    default)."""
    from dspark.serving.config import SCHEDULER_ENV_PREFIX, SchedulerConfig, add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, SchedulerConfig, SCHEDULER_ENV_PREFIX)  # as the scheduler reads them
    known, _ = parser.parse_known_args(list(scheduler_args))
    return known.cohorts


def split_cores(use_drafter: bool, cohorts: int = 1, cores: int | None = None,
                verifier: int = 0, drafter: int = 0) -> CoreSplit:
    """The threads each model service gets out of `cores` (default: usable_cores()).

    `verifier` / `drafter` > 0 are taken as asked (the user's flags); 0 = automatic: all the
    cores while the models take turns (no drafter, or one cohort), else the drafter one core and
    the verifier the remaining ones (at least one)."""
    if verifier < 0 or drafter < 0:
        raise ValueError(f"thread counts must be >= 0 (0 = automatic), got {verifier}, {drafter}")
    cores = usable_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if not use_drafter:
        return CoreSplit(verifier or cores, 0)
    if cohorts <= 1:
        return CoreSplit(verifier or cores, drafter or cores)
    drafter = drafter or 1
    return CoreSplit(verifier or max(1, cores - drafter), drafter)
