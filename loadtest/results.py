"""The sweep's results: one row per (policy, concurrency level), the SLA table, and per-user
speed at matched aggregate throughput.

A level's per-user speed is the mean over its responses of the tokens/s after the first token;
its aggregate throughput is every token the clients received in the run window divided by the
window's length. A level *holds* an SLA of X tokens/s when at least `attainment` (default 90%) of
its responses reached X; the throughput a policy holds at X is the highest aggregate throughput
among its levels that hold X (0 when none does).

Matched throughput (the paper's comparison, section 5.4): at each level of a baseline policy, the
other policy's per-user speed at the same aggregate throughput, read off its frontier (its levels
in order of users, joined by straight lines; never extrapolated past its first or last level).
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.prometheus import SpeculationDelta


@dataclass
class LevelResult:
    policy: str
    users: int
    seconds: float
    responses: int
    errors: int
    per_user_tokens_per_s: float
    per_user_tokens_per_s_p50: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    aggregate_tokens_per_s: float
    mean_verification_length: float
    acceptance_length: float
    scheduler_generated_tokens: float
    sla_attainment: dict[float, float] = field(default_factory=dict)
    """SLA (tokens/s) -> share of responses at or above it."""
    stage_share: dict[str, float] = field(default_factory=dict)
    """Engine stage (prefill, draft, admission, verify, verify_call, other) -> its share of the
    engine's time over the level (the scheduler's `round_seconds_total`)."""

    @classmethod
    def from_run(cls, policy: str, users: int, summary: dict, delta: SpeculationDelta,
                 sla_levels: list[float]) -> "LevelResult":
        responses = summary["responses"]
        speeds = [r["tokens_per_s"] for r in responses if r["tokens_per_s"] is not None]
        ttfts = [r["ttft_ms"] for r in responses]

        def mean(xs):
            return statistics.fmean(xs) if xs else math.nan

        def median(xs):
            return statistics.median(xs) if xs else math.nan

        attainment = {s: (sum(v >= s for v in speeds) / len(speeds) if speeds else 0.0)
                      for s in sla_levels}
        return cls(policy, users, summary["seconds"], len(responses), summary["errors"],
                   mean(speeds), median(speeds), mean(ttfts), median(ttfts),
                   summary["aggregate_tokens_per_s"], delta.mean_verification_length,
                   delta.acceptance_length, delta.generated_tokens, attainment,
                   _shares(delta.stage_seconds))

    def row(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("sla_attainment", "stage_share")}
        for sla, share in self.sla_attainment.items():
            out[f"sla_{sla:g}_attainment"] = share
        for stage, share in self.stage_share.items():
            out[f"{stage}_share"] = share
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


@dataclass(frozen=True)
class SlaHold:
    policy: str
    sla_tokens_per_s: float
    attainment: float
    aggregate_tokens_per_s: float
    users: int | None
    """The concurrency level that holds it; None when no level does."""


def sla_table(results: list[LevelResult], sla_levels: list[float],
              attainment: float) -> list[SlaHold]:
    table = []
    for policy in dict.fromkeys(r.policy for r in results):
        levels = [r for r in results if r.policy == policy]
        for sla in sla_levels:
            holding = [r for r in levels if r.sla_attainment.get(sla, 0.0) >= attainment]
            best = max(holding, key=lambda r: r.aggregate_tokens_per_s, default=None)
            table.append(SlaHold(policy, sla, attainment,
                                 best.aggregate_tokens_per_s if best else 0.0,
                                 best.users if best else None))
    return table


@dataclass(frozen=True)
class MatchedSpeed:
    """`policy`'s per-user speed where its frontier reaches one level of `baseline`'s throughput."""

    policy: str
    baseline: str
    baseline_users: int
    aggregate_tokens_per_s: float
    baseline_per_user: float
    policy_per_user: float | None
    """None when `policy`'s frontier does not reach this throughput."""

    @property
    def ratio(self) -> float | None:
        return None if self.policy_per_user is None else self.policy_per_user / self.baseline_per_user

    def row(self) -> dict:
        return {"policy": self.policy, "baseline": self.baseline,
                "baseline_users": self.baseline_users,
                "aggregate_tokens_per_s": round(self.aggregate_tokens_per_s, 3),
                "baseline_per_user_tokens_per_s": round(self.baseline_per_user, 3),
                "policy_per_user_tokens_per_s": ("" if self.policy_per_user is None
                                                 else round(self.policy_per_user, 3)),
                "ratio": "" if self.ratio is None else round(self.ratio, 3)}


def per_user_at(levels: list[LevelResult], aggregate: float) -> float | None:
    """Per-user speed of one policy's frontier at this aggregate throughput: linear between the
    first pair of consecutive levels (by users) that brackets it; None if none does."""
    points = sorted(levels, key=lambda r: r.users)
    for a, b in zip(points, points[1:]):
        lo, hi = sorted((a.aggregate_tokens_per_s, b.aggregate_tokens_per_s))
        if lo <= aggregate <= hi:
            if hi == lo:
                return max(a.per_user_tokens_per_s, b.per_user_tokens_per_s)
            t = (aggregate - a.aggregate_tokens_per_s) / (b.aggregate_tokens_per_s
                                                          - a.aggregate_tokens_per_s)
            return a.per_user_tokens_per_s + t * (b.per_user_tokens_per_s - a.per_user_tokens_per_s)
    exact = [p.per_user_tokens_per_s for p in points if p.aggregate_tokens_per_s == aggregate]
    return exact[0] if exact else None


def matched_speeds(results: list[LevelResult]) -> list[MatchedSpeed]:
    """For every ordered pair of policies, at each of the baseline's levels."""
    policies = list(dict.fromkeys(r.policy for r in results))
    table = []
    for policy in policies:
        mine = [r for r in results if r.policy == policy]
        for baseline in policies:
            if baseline == policy:
                continue
            for level in sorted((r for r in results if r.policy == baseline), key=lambda r: r.users):
                table.append(MatchedSpeed(policy, baseline, level.users,
                                          level.aggregate_tokens_per_s,
                                          level.per_user_tokens_per_s,
                                          per_user_at(mine, level.aggregate_tokens_per_s)))
    return table


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        raise ValueError(f"nothing to write to {path}")
    with path.open("w", newline="") as f:
        columns = list(dict.fromkeys(key for row in rows for key in row))  # every row's, in order
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _shares(seconds: dict[str, float]) -> dict[str, float]:
    total = sum(seconds.values())
    return {stage: round(value / total, 4) for stage, value in seconds.items()} if total > 0 else {}
