"""The cost table: target steps per second SPS(B) at B flattened batch tokens (docs/design.md section 6).

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

Lookup rules (chosen so that the async global search sees the hardware as measured, docs/design.md
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

Online update (:meth:`CostTable.observe`): the profile gives the *shape* of the step time in B
(how much each extra token costs), measured once and kept as measured; serving measures how far
above the profile each request count R runs, and how that changes with the drafts a round
verifies. A round of R requests over B tokens costs ``T(R, B) = T_profile(B) + above(R, n)``
with ``n = B - R`` drafts, where

- ``above(R, n)`` is fitted to R's rounds in two parts (:class:`RequestCountFit`), each by
  exponentially weighted least squares (:class:`LevelFit`): each round's ``measured -
  T_profile(B)`` enters with weight ``CostTableConfig.ema_weight`` and every earlier round *of
  its kind* fades by ``1 - ema_weight`` (the first taken whole). Rounds without drafts give the
  level at n = 0 (their EMA); rounds with drafts give a straight line in n, its slope
  ridge-shrunk toward 0 (:data:`SLOPE_RIDGE`), so it is flat until R has verified different n.
  A run of decode rounds therefore never fades what the verifying rounds measured;
- between n = 0 and the fewest drafts served, ``above`` runs straight from the decode level to
  the drafts' line; past the most drafts served, the line is held flat: a slope fitted over 1-3
  drafts is not trusted at 30;
- an R never served takes the fit of the nearest served R (the lower on a tie), and 0 before any;
  an R served only without drafts keeps its own decode level and adds what drafts cost above
  the decode level at the nearest R that verified drafts. At 16 users most verifying rounds
  came at R = 15 and 14, just after a request finished, where the rounds served were nearly all
  decode rounds (or read the joiner's prompt, which the table never sees): priced by the
  start-up profile alone, drafts there looked several times cheaper than at R = 16 (bf16:
  172 ms a verifying round of 16 requests against 53 ms a decode round).

Why not refresh each B on its own: the profile spreads B over at most a few
requests at a short context, while many requests cost more per round (attention over each
request's context, per-request work); a per-B update raised the B that is served every round (R
requests, no drafts) and left the rarely served larger B at the profile's cheaper level, so
verifying drafts looked cheaper than decoding at high load (fp32, one thread: the
profile said 176 / 245 ms at B = 16 / 32, 16 requests at context 300 cost 336 / 408 ms). Why a
line in n, not a point per served (R, B): rounds that verify drafts seldom
verify the same number twice (at 16 requests, B ran 40-52 in one minute), so each point had a
few samples, started at R's level (mostly rounds without drafts) and moved 10% a sample; the
admission judged drafts at about that level while they cost more (bf16, 16 requests: 158-175 ms
estimated for 46 tokens, 180-236 measured). One line per R pools every verifying round's
evidence on what a draft costs. The drafting time is learned per
R as well (:meth:`CostTable.observe_draft`): drafting 16 requests costs more than drafting one.

JSON format (written by ``dspark profile``)::

    {"batch_tokens": [1, 2, ...], "step_seconds": [...], "meta": {...}, "draft_seconds": 0.0}

``draft_seconds`` is optional on input (default 0.0).

A table is valid for one model, dtype and device kind only (a CPU's step times say nothing of a
GPU's): its default file, :func:`default_cost_table_path`, names all three, and ``dspark
profile`` records them in ``meta``.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np


SLOPE_RIDGE = 0.01
"""Ridge on a :class:`LevelFit` slope, in squared drafts: the slope is shrunk by
``var(n) / (var(n) + SLOPE_RIDGE)`` where ``var(n)`` is the weighted variance of the served n,
so it is 0 while one n is served and unbiased (to 1% at a variance of 1) once several are."""

MIN_STEP_FRACTION = 0.1
"""Floor of a step time with a learned level, as a fraction of the profile's step time there: a
negative level (serving faster than the profile) never makes a step free or negative where the
profile is lower than at the B that was served."""


class Interpolation(enum.Enum):
    """How the step time between two measured batch sizes is estimated."""

    LINEAR = "linear"  # linear in step time between the neighbouring measured points
    NEXT = "next"  # the step time of the next measured point at or above B (bucket padding)


class ThetaObjective(enum.Enum):
    """What the admission policies maximise (docs/design.md section 6)."""

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
    """Weight of one new measurement in the online update of a request count's level (the first
    one is taken whole); 0 freezes the table, 1 keeps only the latest measurement."""
    draft_ema_weight: float = 0.1
    """Weight of one new drafting-time measurement in :meth:`CostTable.observe_draft`."""

    def __post_init__(self) -> None:
        if not isinstance(self.interpolation, Interpolation):
            object.__setattr__(self, "interpolation", Interpolation(self.interpolation))
        for name in ("ema_weight", "draft_ema_weight"):
            w = getattr(self, name)
            if not (0.0 <= w <= 1.0):
                raise ValueError(f"{name} must lie in [0, 1], got {w}")


@dataclass
class LevelFit:
    """Exponentially weighted least-squares line ``y = level + slope * n`` over a run of rounds,
    n = drafts verified, y = seconds above the profile. Holds the weighted sums only."""

    weight: float = 0.0  # sum w
    n_sum: float = 0.0  # sum w n
    n2_sum: float = 0.0  # sum w n^2
    y_sum: float = 0.0  # sum w y
    ny_sum: float = 0.0  # sum w n y
    n_min: int | None = None  # the served range of n
    n_max: int | None = None

    def add(self, n: int, y: float, ema_weight: float) -> None:
        """Fold in one round (n drafts, y seconds above the profile); the first is taken whole."""
        fade, w = (0.0, 1.0) if self.weight == 0.0 else (1.0 - ema_weight, ema_weight)
        self.weight = fade * self.weight + w
        self.n_sum = fade * self.n_sum + w * n
        self.n2_sum = fade * self.n2_sum + w * n * n
        self.y_sum = fade * self.y_sum + w * y
        self.ny_sum = fade * self.ny_sum + w * n * y
        self.n_min = n if self.n_min is None else min(self.n_min, n)
        self.n_max = n if self.n_max is None else max(self.n_max, n)

    @property
    def slope(self) -> float:
        """Seconds per draft above the profile's own slope (ridge-shrunk toward 0)."""
        s0 = self.weight
        spread = s0 * self.n2_sum - self.n_sum ** 2  # s0^2 var(n)
        covariance = s0 * self.ny_sum - self.n_sum * self.y_sum  # s0^2 cov(n, y)
        return covariance / (max(spread, 0.0) + SLOPE_RIDGE * s0 * s0)

    @property
    def level(self) -> float:
        """The line at n = 0."""
        return self.line()[0]

    def line(self) -> tuple[float, float]:
        """(level, slope), the slope's sums read once."""
        slope = self.slope
        return (self.y_sum - slope * self.n_sum) / self.weight, slope

    def above(self, n: np.ndarray) -> np.ndarray:
        """``level + slope * n`` with n clipped to the served range (same shape as n)."""
        level, slope = self.line()
        return level + slope * np.clip(n, self.n_min, self.n_max)


@dataclass
class RequestCountFit:
    """Seconds above the profile of a round of one request count R, against the drafts n it
    verifies (module docstring): the rounds without drafts and the rounds with drafts are fitted
    apart, each fading only by rounds of its own kind.

    Why apart: at high load most rounds verify nothing and verifying ones come in short runs
    tens of rounds apart. In one pooled line each of the decode rounds between two verifying
    runs faded the drafts' evidence by ``1 - ema_weight`` (0.9^35, about 3%, left after a typical
    gap at 16 users), so the slope rested on about one round and swung from 0 to 1.4 ms a draft
    between consecutive verifying rounds (bf16, 16 requests)."""

    decode: LevelFit = field(default_factory=LevelFit)
    """Rounds with n = 0 (its line is their EMA: one n served, slope 0)."""
    drafts: LevelFit = field(default_factory=LevelFit)
    """Rounds with n >= 1: a line over the draft counts served."""

    def add(self, n: int, y: float, ema_weight: float) -> None:
        (self.drafts if n > 0 else self.decode).add(n, y, ema_weight)

    def above(self, n: np.ndarray) -> np.ndarray:
        """Seconds above the profile at n drafts (same shape as n, float64): without draft
        rounds, the decode level at every n; without decode rounds, the drafts' line clipped to
        its served range; with both, the decode level at n = 0, the drafts' line from the fewest
        drafts served on (held flat past the most), and a straight line between the two."""
        n = np.asarray(n, dtype=np.float64)
        if self.drafts.weight == 0.0:
            return np.full_like(n, self.decode.level)
        line = self.drafts.above(n)
        if self.decode.weight == 0.0:
            return line
        zero, first = self.decode.level, float(self.drafts.above(np.float64(self.drafts.n_min)))
        between = zero + (first - zero) * n / self.drafts.n_min
        return np.where(n < self.drafts.n_min, between, line)


def _check_seconds(seconds: float, what: str) -> float:
    seconds = float(seconds)
    if not (math.isfinite(seconds) and seconds > 0.0):
        raise ValueError(f"{what} must be a finite positive number of seconds, got {seconds}")
    return seconds


@dataclass
class CostTable:
    """Profiled target step times by batch size, plus the levels learned while serving, with O(1)
    lookup of the step time of a round of R requests over any B >= 1 tokens.

    The profiled points (``batch_tokens``, ``step_seconds``) are never changed by serving (see
    the module docstring); lookups of them are served from a dense cache by B.
    """

    batch_tokens: list[int]
    """Measured batch sizes, strictly increasing, each >= 1."""
    step_seconds: list[float]
    """Measured seconds of one target step at each of ``batch_tokens``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (model, dtype, device, date) written by ``dspark profile``."""
    draft_seconds: float = 0.0
    """Seconds of drafting per round before any is measured for a request count (the profile's
    value, or 0); :meth:`draft_time` prefers a measured one."""
    config: CostTableConfig = field(default_factory=CostTableConfig)
    request_fits: dict[int, RequestCountFit] = field(default_factory=dict)
    """Serving state, not in the JSON file: the line of seconds above the profile against drafts
    verified, for a round of R requests, by R (:meth:`observe`)."""
    draft_seconds_by_requests: dict[int, float] = field(default_factory=dict)
    """Serving state, not in the JSON file: measured drafting seconds of a round that drafts R
    requests, by R (:meth:`observe_draft`)."""

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
        """Cached profile step seconds for B = 0..max_b (index 0 repeats B = 1); grown on demand."""
        if self._dense is None or len(self._dense) <= max_b:
            size = max(max_b + 1, 2 * (len(self._dense) if self._dense is not None else 0), 64)
            b = np.arange(size, dtype=np.int64)
            b[0] = 1
            self._dense = self._estimate(b)  # [size]
        return self._dense

    def step_time(self, batch_tokens: int | np.ndarray,
                  num_requests: int | None = None) -> float | np.ndarray:
        """Estimated seconds of one target step at B tokens (B >= 1; scalar or integer array): the
        profile's, plus the learned level of a round of ``num_requests`` requests when given."""
        b = np.asarray(batch_tokens)
        if b.size and (not np.issubdtype(b.dtype, np.integer) or b.min() < 1):
            raise ValueError("batch_tokens must be integers >= 1")
        max_b = int(b.max()) if b.size else 1
        values = self._dense_upto(max_b)[b]
        if num_requests is not None:
            values = self._lift(values, b, num_requests)
        return float(values) if values.ndim == 0 else values

    def _lift(self, profile: np.ndarray, b: np.ndarray, num_requests: int) -> np.ndarray:
        """Profile step seconds at batch sizes ``b`` (same shape) lifted to what R requests were
        measured to cost: R's (or the nearest R's) line at n = B - R; floored
        (MIN_STEP_FRACTION)."""
        fit = self._fit(num_requests)
        if fit is None:
            return profile
        n = b.astype(np.float64) - num_requests
        above = fit.above(n)
        if fit.drafts.weight == 0.0:  # R never verified drafts: the nearest R that did prices them
            donor = self._nearest_fit(num_requests, lambda f: f.drafts.weight > 0.0)
            if donor is not None:
                above = above + donor.above(n) - donor.above(np.float64(0.0))
        return np.maximum(profile + above, MIN_STEP_FRACTION * profile)

    def rate(self, step: float | np.ndarray, objective: ThetaObjective,
             num_requests: int | None) -> float | np.ndarray:
        """Rounds per second of rounds whose target step takes `step` seconds (under
        DISAGGREGATED and SHARED_DEVICE with the drafting time of `num_requests` requests)."""
        if objective is ThetaObjective.PAPER:
            return 1.0 / step
        if objective in (ThetaObjective.DISAGGREGATED, ThetaObjective.SHARED_DEVICE):
            return 1.0 / (self.draft_time(num_requests) + step)
        raise ValueError(f"unknown objective {objective!r}")

    def sps(self, batch_tokens: int | np.ndarray,
            num_requests: int | None = None) -> float | np.ndarray:
        """Target steps per second SPS(B) (of a round of ``num_requests`` requests when given)."""
        return 1.0 / self.step_time(batch_tokens, num_requests)

    def round_rate(
        self, batch_tokens: int | np.ndarray, objective: ThetaObjective = ThetaObjective.PAPER,
        num_requests: int | None = None,
    ) -> float | np.ndarray:
        """Rounds per second at B tokens, so that ``Theta = tau * round_rate(B, objective)``; with
        ``num_requests``, the learned level and drafting time of a round of that many requests."""
        return self.rate(self.step_time(batch_tokens, num_requests), objective, num_requests)

    def round_rate_range(
        self, num_requests: int, count: int, objective: ThetaObjective = ThetaObjective.PAPER
    ) -> np.ndarray:
        """Rounds per second of a round of R = ``num_requests`` requests verifying n = 0 ..
        count - 1 drafts, i.e. B = R .. R + count - 1: ``[count]`` float64."""
        return self.rate(self.round_step_range(num_requests, count), objective, num_requests)

    def round_step_range(self, num_requests: int, count: int) -> np.ndarray:
        """Estimated target-step seconds of a round of R = ``num_requests`` requests verifying
        n = 0 .. count - 1 drafts (B = R .. R + count - 1): ``[count]`` float64."""
        if num_requests < 1 or count < 0:
            raise ValueError(f"need num_requests >= 1 and count >= 0, got {num_requests}, {count}")
        b = np.arange(num_requests, num_requests + count)  # [count]
        profile = self._dense_upto(num_requests + count - 1)[b]  # [count]
        return self._lift(profile, b, num_requests)

    # ----------------------------------------------------------------------------- online update
    def _fit(self, num_requests: int) -> RequestCountFit | None:
        """R's fit, else the nearest served R's (the lower on a tie), else None."""
        return self._nearest_fit(num_requests, lambda f: True)

    def _nearest_fit(self, num_requests: int,
                     usable: Callable[[RequestCountFit], bool]) -> RequestCountFit | None:
        """The usable fit of R, else of the nearest R with one (the lower on a tie), else None."""
        own = self.request_fits.get(num_requests)
        if own is not None and usable(own):
            return own
        counts = [c for c, f in self.request_fits.items() if usable(f)]
        if not counts:
            return None
        return self.request_fits[min(counts, key=lambda c: (abs(c - num_requests), c))]

    def offset(self, num_requests: int) -> float:
        """Learned seconds above the profile of a round of R requests without drafts (the
        line's level; module docstring)."""
        fit = self._fit(num_requests)
        return 0.0 if fit is None else float(fit.above(np.float64(0.0)))

    def draft_time(self, num_requests: int | None = None) -> float:
        """Seconds of drafting a round of R requests: the measurement for the nearest measured R,
        else :attr:`draft_seconds`."""
        if num_requests is None:
            return self.draft_seconds
        return _nearest(self.draft_seconds_by_requests, num_requests, self.draft_seconds)

    def observe(self, num_requests: int, batch_tokens: int, seconds: float) -> None:
        """Fold one step time measured while serving (R requests, B tokens) into R's line
        (module docstring)."""
        r = _check_count(num_requests, "num_requests")
        b = _check_count(batch_tokens, "batch_tokens")
        seconds = _check_seconds(seconds, "seconds")
        if self.config.ema_weight == 0.0:  # a frozen table
            return
        above = seconds - float(self.step_time(b))
        self.request_fits.setdefault(r, RequestCountFit()).add(b - r, above, self.config.ema_weight)

    def observe_draft(self, seconds: float, num_requests: int | None = None) -> None:
        """Fold one measured drafting time into R's (or, without R, :attr:`draft_seconds`) by an
        EMA with weight ``draft_ema_weight``; the first measurement replaces "never measured"."""
        seconds = float(seconds)
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        w = self.config.draft_ema_weight
        if num_requests is not None:
            _ema_update(self.draft_seconds_by_requests, _check_count(num_requests, "num_requests"),
                        seconds, w)
        elif self.draft_seconds == 0.0:
            self.draft_seconds = seconds
        else:
            self.draft_seconds = (1.0 - w) * self.draft_seconds + w * seconds


def cost_table_name(model: str, dtype: str, device_kind: str, weights: str | None = None) -> str:
    """The file name of the table for one model, dtype, device kind
    (dspark.devices.device_kind: "cpu", "cuda-nvidia-h100-80gb-hbm3", ...) and weight format
    (RunnerConfig.weights: "q4" names itself; dense weights, or None, add nothing)."""
    safe = lambda s: "".join(c if c.isalnum() or c in "-._" else "-" for c in str(s))  # noqa: E731
    fmt = f"_{safe(weights)}" if weights not in (None, "dense") else ""
    return f"cost_table_{safe(model)}_{safe(dtype)}{fmt}_{safe(device_kind)}.json"


def default_cost_table_path(home: str | Path, model: str, dtype: str, device: str,
                            weights: str | None = None) -> Path:
    """Where `dspark profile` writes, and `dspark generate` reads, the table of `model` in
    `dtype` on `device` (a resolved torch device: "cpu", "cuda:0") with `weights`."""
    from dspark.devices import device_kind

    return Path(home) / cost_table_name(model, dtype, device_kind(device), weights)


def _check_count(value: int, what: str) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value}")
    return int(value)


def _nearest(values_by_count: dict[int, float], count: int, default: float) -> float:
    """The value stored for `count`, else for the nearest stored count (the lower on a tie)."""
    if not values_by_count:
        return default
    if count in values_by_count:
        return values_by_count[count]
    return values_by_count[min(values_by_count, key=lambda c: (abs(c - count), c))]


def _ema_update(values_by_count: dict[int, float], count: int, measured: float,
                weight: float) -> None:
    """EMA of `measured` under `count`; the first measurement is stored as it is."""
    old = values_by_count.get(count)
    values_by_count[count] = measured if old is None else (1.0 - weight) * old + weight * measured
