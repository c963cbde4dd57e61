"""The cost table: target steps per second SPS(B) at B flattened batch tokens (DESIGN.md section 6).

Glossary
--------
- *B* (``batch_tokens``): tokens sent to the target in one verification step,
  ``B = sum_r (1 + l_r)`` (every request's anchor plus its admitted drafts).
- *step time* ``T_verify(B)``: seconds of one target forward over B flattened tokens, as measured by
  ``dspark profile`` at start-up and refreshed while serving (:meth:`CostTable.observe`).
- *SPS(B)* = ``1 / T_verify(B)``: target steps per second.
- *draft time* ``T_draft``: seconds the drafter spends on one round (all requests together).
- *Theta*: expected accepted tokens per second, ``tau * rate(B)``, where ``rate`` is either
  ``SPS(B)`` (the paper's form, :attr:`ThetaObjective.PAPER`: drafting is overlapped or free) or
  ``1 / (T_draft + T_verify(B))`` (:attr:`ThetaObjective.DISAGGREGATED`: what a system that drafts
  and verifies one after the other really pays per round), or the latter only for rounds that
  verify drafts (:attr:`ThetaObjective.SHARED_DEVICE`: a round with none skips drafting).

Lookup rules (chosen so that the async global search sees the hardware as measured, DESIGN.md
section 12: profiled tables are staircases, do not smooth them):
- at a measured B: the measured step time, exactly;
- between two measured points: :attr:`Interpolation.LINEAR` (default) interpolates the step time
  linearly, which equals the measurement wherever one exists, so a table profiled at every B keeps
  its staircase exactly; :attr:`Interpolation.NEXT` charges the step time of the next measured
  point at or above B (what an engine that pads to graph buckets really pays);
- below the first measured point: the first measured step time (a step never gets cheaper than the
  smallest measured one);
- past the last measured point: linear growth from the last point with slope
  ``(T_last - T_first) / (B_last - B_first)`` (the average marginal cost per token over the whole
  measured range, robust to a flat last bucket), or ``T_last / B_last`` when that slope is not
  positive (e.g. a single measured point, or noise); the slope is always > 0, so SPS keeps falling.

Online update (:meth:`CostTable.observe`): an exponential moving average per point,
``T[B] <- (1 - w) * lookup(B) + w * measured``, with ``w = CostTableConfig.ema_weight``. A B that is
not yet in the table is *inserted* as a new measured point initialised at the current estimate
``lookup(B)`` and moved by the same rule, so the table only ever gains real measurements and never
attributes a step time measured at one B to another B. The table grows by at most one point per
distinct batch size served.

JSON format (written by ``dspark profile``)::

    {"batch_tokens": [1, 2, ...], "step_seconds": [...], "meta": {...}, "draft_seconds": 0.0}

``draft_seconds`` is optional on input (default 0.0).
"""

from __future__ import annotations

import bisect
import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class Interpolation(enum.Enum):
    """How the step time between two measured batch sizes is estimated."""

    LINEAR = "linear"  # linear in step time between the neighbouring measured points
    NEXT = "next"  # the step time of the next measured point at or above B (bucket padding)


class ThetaObjective(enum.Enum):
    """What the admission policies maximise (DESIGN.md section 6, issue 2)."""

    PAPER = "paper"
    """Theta = tau * SPS(B): drafting is overlapped with verification (or free)."""
    DISAGGREGATED = "disaggregated"
    """Theta = tau / (T_draft + T_verify(B)) for every round: drafting and verification take
    turns, and every round drafts."""
    SHARED_DEVICE = "shared_device"
    """Drafting and verification take turns, and a round that verifies no drafts does not draft
    (async_topk knows its K before drafting): Theta = R / T_verify(R) with no drafts, and
    tau / (T_draft + T_verify(B)) with at least one. For one request per round that is
    `Theta(0) = 1 / T_verify(1)`, so a draft is only verified when its expected survival pays
    for the drafting too; the embedded engine on a CPU is this case. As a per-B rate
    (`CostTable.round_rate`) it is the rate of a round that drafts, as DISAGGREGATED."""


@dataclass(frozen=True)
class CostTableConfig:
    """How a :class:`CostTable` interpolates and learns; not part of the JSON file."""

    interpolation: Interpolation = Interpolation.LINEAR
    """Estimate between measured points (see the module docstring)."""
    ema_weight: float = 0.1
    """Weight of one new measurement in the online update; 0 freezes the table, 1 keeps only the
    latest measurement."""
    draft_ema_weight: float = 0.1
    """Weight of one new drafting-time measurement in :meth:`CostTable.observe_draft`."""

    def __post_init__(self) -> None:
        if not isinstance(self.interpolation, Interpolation):
            object.__setattr__(self, "interpolation", Interpolation(self.interpolation))
        for name in ("ema_weight", "draft_ema_weight"):
            w = getattr(self, name)
            if not (0.0 <= w <= 1.0):
                raise ValueError(f"{name} must lie in [0, 1], got {w}")


def _check_seconds(seconds: float, what: str) -> float:
    seconds = float(seconds)
    if not (math.isfinite(seconds) and seconds > 0.0):
        raise ValueError(f"{what} must be a finite positive number of seconds, got {seconds}")
    return seconds


@dataclass
class CostTable:
    """Measured target step times by batch size, with O(1) lookup of SPS(B) for any B >= 1.

    Lookups are served from a dense cache by B; change the measured points only through
    :meth:`observe` (which keeps the cache exact), not by editing the lists in place.
    """

    batch_tokens: list[int]
    """Measured batch sizes, strictly increasing, each >= 1."""
    step_seconds: list[float]
    """Measured seconds of one target step at each of ``batch_tokens``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (model, dtype, device, date) written by ``dspark profile``."""
    draft_seconds: float = 0.0
    """Seconds of drafting per round; used only by :attr:`ThetaObjective.DISAGGREGATED`."""
    config: CostTableConfig = field(default_factory=CostTableConfig)

    def __post_init__(self) -> None:
        xs = [int(b) for b in self.batch_tokens]
        ys = [_check_seconds(s, "step_seconds") for s in self.step_seconds]
        if not xs:
            raise ValueError("a cost table needs at least one measured point")
        if len(xs) != len(ys):
            raise ValueError(f"{len(xs)} batch sizes but {len(ys)} step times")
        if xs[0] < 1 or any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError(f"batch_tokens must be strictly increasing and >= 1, got {xs}")
        self.batch_tokens, self.step_seconds = xs, ys
        self.draft_seconds = float(self.draft_seconds)
        if not (math.isfinite(self.draft_seconds) and self.draft_seconds >= 0.0):
            raise ValueError(f"draft_seconds must be finite and >= 0, got {self.draft_seconds}")
        self._dense: np.ndarray | None = None  # [max_batch_tokens + 1] step seconds by B, lazily
        # Same layout, rounds per second, keyed by (objective, draft_seconds) so that assigning
        # draft_seconds directly cannot leave a stale cache behind.
        self._dense_rate: dict[tuple[ThetaObjective, float], np.ndarray] = {}

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_step_seconds(cls, step_seconds_by_b: dict[int, float], **kwargs: Any) -> "CostTable":
        """Build from ``{B: seconds}`` in any order."""
        items = sorted(step_seconds_by_b.items())
        return cls([b for b, _ in items], [s for _, s in items], **kwargs)

    @classmethod
    def from_sps(cls, sps_by_b: dict[int, float], **kwargs: Any) -> "CostTable":
        """Build from ``{B: steps per second}`` (the paper states its examples this way)."""
        return cls.from_step_seconds({b: 1.0 / float(s) for b, s in sps_by_b.items()}, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_tokens": list(self.batch_tokens),
            "step_seconds": list(self.step_seconds),
            "meta": dict(self.meta),
            "draft_seconds": self.draft_seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], config: CostTableConfig | None = None) -> "CostTable":
        return cls(
            batch_tokens=list(data["batch_tokens"]),
            step_seconds=list(data["step_seconds"]),
            meta=dict(data.get("meta", {})),
            draft_seconds=float(data.get("draft_seconds", 0.0)),
            config=config or CostTableConfig(),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, config: CostTableConfig | None = None) -> "CostTable":
        return cls.from_dict(json.loads(Path(path).read_text()), config)

    # ----------------------------------------------------------------------------- lookup
    @property
    def extrapolation_slope(self) -> float:
        """Seconds per extra token past the last measured point; always > 0."""
        xs, ys = self.batch_tokens, self.step_seconds
        if len(xs) >= 2:
            slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
            if slope > 0.0:
                return slope
        return ys[-1] / xs[-1]

    def _estimate(self, b: np.ndarray) -> np.ndarray:
        """Step seconds for integer batch sizes ``b`` (any shape), from the measured points."""
        xs = np.asarray(self.batch_tokens, dtype=np.float64)  # [num_points]
        ys = np.asarray(self.step_seconds, dtype=np.float64)  # [num_points]
        bf = b.astype(np.float64)
        if self.config.interpolation is Interpolation.LINEAR:
            # np.interp clamps to ys[0] below xs[0]; past xs[-1] it is overwritten below.
            out = np.interp(bf, xs, ys)
        else:  # Interpolation.NEXT: the first measured point at or above B.
            idx = np.searchsorted(xs, bf, side="left")
            out = ys[np.minimum(idx, len(ys) - 1)]
        past = bf > xs[-1]
        out = np.where(past, ys[-1] + self.extrapolation_slope * (bf - xs[-1]), out)
        return out

    def _dense_upto(self, max_b: int) -> np.ndarray:
        """Cached step seconds for B = 0..max_b (index 0 repeats B = 1); rebuilt on growth/update."""
        if self._dense is None or len(self._dense) <= max_b:
            size = max(max_b + 1, 2 * (len(self._dense) if self._dense is not None else 0), 64)
            b = np.arange(size, dtype=np.int64)
            b[0] = 1
            self._dense = self._estimate(b)  # [size]
            self._dense_rate = {}
        return self._dense

    def step_time(self, batch_tokens: int | np.ndarray) -> float | np.ndarray:
        """Estimated seconds of one target step at B tokens (B >= 1; scalar or integer array)."""
        b = np.asarray(batch_tokens)
        if b.size and (not np.issubdtype(b.dtype, np.integer) or b.min() < 1):
            raise ValueError("batch_tokens must be integers >= 1")
        max_b = int(b.max()) if b.size else 1
        values = self._dense_upto(max_b)[b]
        return float(values) if values.ndim == 0 else values

    def sps(self, batch_tokens: int | np.ndarray) -> float | np.ndarray:
        """Target steps per second SPS(B)."""
        return 1.0 / self.step_time(batch_tokens)

    def round_rate(
        self, batch_tokens: int | np.ndarray, objective: ThetaObjective = ThetaObjective.PAPER
    ) -> float | np.ndarray:
        """Rounds per second at B tokens, so that ``Theta = tau * round_rate(B, objective)``."""
        step = self.step_time(batch_tokens)
        if objective is ThetaObjective.PAPER:
            return 1.0 / step
        if objective in (ThetaObjective.DISAGGREGATED, ThetaObjective.SHARED_DEVICE):
            return 1.0 / (self.draft_seconds + step)
        raise ValueError(f"unknown objective {objective!r}")

    def round_rate_range(
        self, first_b: int, count: int, objective: ThetaObjective = ThetaObjective.PAPER
    ) -> np.ndarray:
        """``round_rate(B)`` for B = first_b .. first_b + count - 1: ``[count]`` (a cached view)."""
        if first_b < 1 or count < 0:
            raise ValueError(f"need first_b >= 1 and count >= 0, got {first_b}, {count}")
        dense = self._dense_upto(first_b + count - 1)
        key = (objective, self.draft_seconds)
        rate = self._dense_rate.get(key)
        if rate is None:
            rate = self.round_rate(np.arange(1, len(dense)), objective)  # [len(dense) - 1]
            rate = np.concatenate([rate[:1], rate])  # index 0 repeats B = 1, like the step times
            self._dense_rate[key] = rate
        return rate[first_b : first_b + count]

    # ----------------------------------------------------------------------------- online update
    def observe(self, batch_tokens: int, seconds: float) -> None:
        """Fold one step time measured while serving into the table (module docstring: EMA)."""
        b = int(batch_tokens)
        if b < 1 or b != batch_tokens:
            raise ValueError(f"batch_tokens must be an integer >= 1, got {batch_tokens}")
        seconds = _check_seconds(seconds, "seconds")
        w = self.config.ema_weight
        new = (1.0 - w) * float(self.step_time(b)) + w * seconds
        i = bisect.bisect_left(self.batch_tokens, b)
        if i < len(self.batch_tokens) and self.batch_tokens[i] == b:
            self.step_seconds[i] = new
        else:
            self.batch_tokens.insert(i, b)
            self.step_seconds.insert(i, new)
        self._refresh_cache_around(i)

    def _refresh_cache_around(self, i: int) -> None:
        """Bring the cached lookups up to date after point i changed (serving calls this per step).

        An interior point only changes the estimates between its two neighbours (both interpolation
        rules), and not the extrapolation slope (which uses the first and last points only), so
        only that slice of the cache is recomputed; a first or last point rebuilds it all.
        """
        xs = self.batch_tokens
        if self._dense is None or i == 0 or i == len(xs) - 1:
            self._dense, self._dense_rate = None, {}
            return
        lo, hi = xs[i - 1], min(xs[i + 1], len(self._dense) - 1)
        if lo > hi:
            return
        b = np.arange(lo, hi + 1)  # [hi - lo + 1]
        self._dense[lo : hi + 1] = self._estimate(b)
        for (objective, draft_seconds), rate in self._dense_rate.items():
            step = self._dense[lo : hi + 1]
            rate[lo : hi + 1] = 1.0 / (step if objective is ThetaObjective.PAPER else draft_seconds + step)

    def observe_draft(self, seconds: float) -> None:
        """Fold one measured drafting time per round into :attr:`draft_seconds` (EMA).

        The first measurement replaces a zero (never measured) value outright.
        """
        seconds = float(seconds)
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        if self.draft_seconds == 0.0:
            self.draft_seconds = seconds
        else:
            w = self.config.draft_ema_weight
            self.draft_seconds = (1.0 - w) * self.draft_seconds + w * seconds
        self._dense_rate = {}  # keys hold old draft_seconds values: drop them
