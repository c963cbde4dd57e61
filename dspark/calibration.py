"""Calibration of the drafter's confidences: Sequential Temperature Scaling (STS) and its metrics.

Follows docs/design.md section 4 ("Sequential Temperature Scaling") and section 9 (ECE).

Glossary
- ``c_k``: raw confidence of draft position k (1-based in prose, column k-1 in arrays): the
  drafter's predicted P(x_k accepted | x_1..x_{k-1} all accepted).
- ``a_k = prod_{i<=k} c_i``: predicted *survival* of the draft prefix of length k (what the
  scheduler of section 6 consumes, so it must be right in absolute value, not only in ranking).
- ``survived[:, k-1]``: observed outcome, True iff drafts 1..k were all accepted. From an accepted
  length ``n`` in 0..gamma: positions 1..n survived, n+1 (if any) was rejected, and every later
  prefix is dead too. A survival matrix must therefore be non-increasing along a row.
- STS: for k = 1..gamma in order, pick ``T_k`` from a grid so that the ECE of
  ``a_k = a_{k-1}' * sigmoid(logit(c_k) / T_k)`` against ``survived[:, k-1]`` is smallest, with
  the already-fitted ``T_1..T_{k-1}`` held fixed (``a_{k-1}'`` is the calibrated prefix).
- Shifted STS (``fit_sts(..., shift=True)``, our extension): the same sequential fit of the map
  ``sigmoid(logit(c_k) / T_k + b_k)``, searching ``T_k`` and a shift ``b_k`` together. A
  temperature alone cannot move the mean of predictions that sit on the wrong side of the
  observed rate without also spreading them (a head trained on other contexts over-predicts
  everywhere); the shift can. With two parameters, ECE is no longer a safe objective: it is
  minimised by a near-constant prediction at the base rate (a huge ``T_k``), which keeps the
  order but throws away the head's sharpness (Brier score worse than raw). So the shifted fit
  minimises the log-loss of the cumulative product ``a_k`` against prefix survival (a proper
  scoring rule: sequential Platt scaling), and ECE is what it is then measured by.
  Both maps are strictly increasing in ``c_k``, so the ranking of the raw head is kept
  (the *conditional* AUC per position below is unchanged up to float rounding; the AUC of the
  cumulative product can change, since positions get different temperatures).

Metric conventions (all metrics compute in float64 numpy; torch inputs are converted)
- ECE: ``num_bins`` equal-width bins over [0, 1]; bin b holds predictions p with
  ``b/num_bins <= p < (b+1)/num_bins``; the last bin also holds p == 1. (Computed as
  ``min(floor(p * num_bins), num_bins - 1)``.) ECE = sum_b (n_b / N) |mean(p in b) - mean(y in b)|;
  empty bins contribute nothing.
- ROC-AUC: the Mann-Whitney statistic from average ranks: P(score_pos > score_neg) + 0.5 P(tie).
  NaN when only one class is present.
- Brier score: mean((p - y)^2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import numpy as np
import torch

CALIBRATION_FILENAME = "calibration.json"
"""Name of the file written beside a drafter checkpoint."""

_FORMAT = "dspark.sts"
_FORMAT_VERSION = 2
"""Version 2 holds a list of fits, each with optional ``biases`` (shifts) and the sampling
temperature it was fitted at; version-1 files (one fit, temperatures only) still load, and a
single plain fit is still written as version 1."""

ArrayLike = Any  # numpy array, torch tensor, or nested sequence of numbers


# ----------------------------------------------------------------------------------------------
# Conversions


def _to_numpy_f64(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _to_numpy_bool(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype != np.bool_:
        if not np.all((x == 0) | (x == 1)):
            raise ValueError("survival outcomes must be boolean (or 0/1)")
        x = x.astype(np.bool_)
    return x


def _check_1d_pair(pred: np.ndarray, other: np.ndarray, name: str) -> None:
    if pred.ndim != 1 or other.ndim != 1:
        raise ValueError(f"pred and {name} must be 1-D, got {pred.shape} and {other.shape}")
    if pred.shape != other.shape:
        raise ValueError(f"pred {pred.shape} and {name} {other.shape} differ in length")
    if pred.size == 0:
        raise ValueError("empty input")


# ----------------------------------------------------------------------------------------------
# Metrics (docs/design.md section 9)


def _bin_index(pred: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bin of each prediction: [b/n, (b+1)/n), the last bin closed at 1."""
    return np.minimum(np.floor(pred * num_bins), num_bins - 1).astype(np.int64)


def expected_calibration_error(pred: ArrayLike, observed: ArrayLike, num_bins: int = 15) -> float:
    """ECE of predictions in [0, 1] against observed outcomes (0/1, or soft values in [0, 1]).

    pred, observed: [num_samples]. Bins as in the module docstring (left-closed, last bin closed).
    """
    pred_np = _to_numpy_f64(pred)
    obs_np = _to_numpy_f64(observed)
    _check_1d_pair(pred_np, obs_np, "observed")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if np.any(pred_np < 0.0) or np.any(pred_np > 1.0) or np.any(np.isnan(pred_np)):
        raise ValueError("predictions must lie in [0, 1]")
    bins = _bin_index(pred_np, num_bins)  # [num_samples]
    # sum over bins of |sum(p) - sum(y)| / N equals sum_b (n_b/N) |mean p - mean y|
    sum_pred = np.bincount(bins, weights=pred_np, minlength=num_bins)  # [num_bins]
    sum_obs = np.bincount(bins, weights=obs_np, minlength=num_bins)  # [num_bins]
    return float(np.abs(sum_pred - sum_obs).sum() / pred_np.size)


def _ece_many(preds: np.ndarray, observed: np.ndarray, num_bins: int) -> np.ndarray:
    """ECE of each row of preds [num_candidates, num_samples] against observed [num_samples]."""
    num_candidates, num_samples = preds.shape
    bins = (preds * num_bins).astype(np.intp)  # truncation == floor for preds >= 0
    np.minimum(bins, num_bins - 1, out=bins)  # [num_candidates, num_samples]
    bins += (num_bins * np.arange(num_candidates))[:, None]  # one block of bins per candidate
    flat = bins.ravel()
    size = num_candidates * num_bins
    sum_pred = np.bincount(flat, weights=preds.ravel(), minlength=size)
    sum_obs = np.bincount(flat, weights=np.tile(observed, num_candidates), minlength=size)
    diff = np.abs(sum_pred - sum_obs).reshape(num_candidates, num_bins)
    return diff.sum(axis=1) / num_samples  # [num_candidates]


def ece_noise_floor(pred: ArrayLike, num_bins: int = 15, draws: int = 200, seed: int = 0) -> float:
    """Expected ECE of a *perfectly calibrated* predictor making these predictions.

    ECE is biased upward on a finite sample: outcomes drawn from exactly the predicted
    probabilities still leave each bin's observed rate off by about sqrt(p(1-p)/n_b). This draws
    outcomes y ~ Bernoulli(pred) `draws` times (seeded) and returns the mean ECE, the level below
    which a measured ECE on this many samples says nothing. pred: [num_samples] in [0, 1].
    """
    pred_np = _to_numpy_f64(pred)
    if pred_np.ndim != 1 or pred_np.size == 0:
        raise ValueError(f"pred must be 1-D and non-empty, got shape {pred_np.shape}")
    if np.any(pred_np < 0.0) or np.any(pred_np > 1.0) or np.any(np.isnan(pred_np)):
        raise ValueError("predictions must lie in [0, 1]")
    rng = np.random.default_rng(seed)
    bins = _bin_index(pred_np, num_bins)  # [num_samples]
    sum_pred = np.bincount(bins, weights=pred_np, minlength=num_bins)  # [num_bins]
    outcomes = rng.random((draws, pred_np.size)) < pred_np[None, :]  # [draws, num_samples]
    flat = (bins[None, :] + num_bins * np.arange(draws)[:, None]).ravel()
    sum_obs = np.bincount(flat, weights=outcomes.ravel().astype(np.float64),
                          minlength=draws * num_bins).reshape(draws, num_bins)
    return float((np.abs(sum_obs - sum_pred[None, :]).sum(axis=1) / pred_np.size).mean())


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing the mean of their ranks (exact half-integers)."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # start of each run of equal values
    is_start = np.empty(x.size, dtype=np.bool_)
    is_start[0] = True
    is_start[1:] = sorted_x[1:] != sorted_x[:-1]
    run_id = np.cumsum(is_start) - 1  # [num_samples]
    starts = np.flatnonzero(is_start)
    ends = np.append(starts[1:], x.size)  # exclusive
    run_rank = (starts + 1 + ends) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = run_rank[run_id]
    return ranks


def roc_auc(pred: ArrayLike, label: ArrayLike) -> float:
    """ROC-AUC of scores against binary labels; ties count one half. NaN if a class is absent.

    Exact: average ranks are half-integers, so the rank sum is exact in float64 for any
    realistic size.
    """
    pred_np = _to_numpy_f64(pred)
    label_np = _to_numpy_bool(label)
    _check_1d_pair(pred_np, label_np, "label")
    if np.any(np.isnan(pred_np)):
        raise ValueError("scores contain NaN")
    num_pos = int(label_np.sum())
    num_neg = label_np.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    ranks = _average_ranks(pred_np)
    rank_sum_pos = ranks[label_np].sum()
    return float((rank_sum_pos - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def brier_score(pred: ArrayLike, observed: ArrayLike) -> float:
    """Mean squared difference between predictions and outcomes."""
    pred_np = _to_numpy_f64(pred)
    obs_np = _to_numpy_f64(observed)
    _check_1d_pair(pred_np, obs_np, "observed")
    return float(np.mean((pred_np - obs_np) ** 2))


# ----------------------------------------------------------------------------------------------
# Outcomes


def survival_from_accepted_len(accepted_len: ArrayLike, gamma: int) -> np.ndarray:
    """Survival matrix [num_samples, gamma] bool from accepted lengths [num_samples] in 0..gamma.

    survived[:, k] is True iff drafts 1..k+1 were all accepted, i.e. accepted_len >= k + 1.
    """
    if isinstance(accepted_len, torch.Tensor):
        accepted_len = accepted_len.detach().cpu().numpy()
    n = np.asarray(accepted_len)
    if n.ndim != 1:
        raise ValueError(f"accepted_len must be 1-D, got shape {n.shape}")
    if not np.issubdtype(n.dtype, np.integer):
        if not np.all(n == np.round(n)):
            raise ValueError("accepted_len must hold integers")
        n = n.astype(np.int64)
    if np.any(n < 0) or np.any(n > gamma):
        raise ValueError(f"accepted_len must lie in 0..{gamma}")
    return n[:, None] >= np.arange(1, gamma + 1)[None, :]  # [num_samples, gamma]


def _check_survival(survived: np.ndarray) -> None:
    if survived.ndim != 2:
        raise ValueError(f"survived must be [num_samples, gamma], got shape {survived.shape}")
    if np.any(survived[:, 1:] & ~survived[:, :-1]):
        raise ValueError(
            "survived is not a prefix-survival matrix (a row has True after False); pass "
            "survived[:, k] = drafts 1..k+1 all accepted, not per-position acceptance"
        )


def _resolve_outcomes(
    c_raw: np.ndarray, survived: ArrayLike | None, accepted_len: ArrayLike | None
) -> np.ndarray:
    if (survived is None) == (accepted_len is None):
        raise ValueError("pass exactly one of survived and accepted_len")
    if c_raw.ndim != 2:
        raise ValueError(f"c_raw must be [num_samples, gamma], got shape {c_raw.shape}")
    num_samples, gamma = c_raw.shape
    if survived is None:
        surv = survival_from_accepted_len(accepted_len, gamma)
    else:
        surv = _to_numpy_bool(survived)
    _check_survival(surv)
    if surv.shape != (num_samples, gamma):
        raise ValueError(f"outcomes shape {surv.shape} does not match c_raw {c_raw.shape}")
    if num_samples == 0:
        raise ValueError("no samples")
    return surv


# ----------------------------------------------------------------------------------------------
# Temperature scaling


def _logit_np(c: np.ndarray) -> np.ndarray:
    eps = np.finfo(np.float64).eps  # keeps logit finite for c in {0, 1}
    c = np.clip(c, eps, 1.0 - eps)
    return np.log(c) - np.log1p(-c)


def _sigmoid_np(z: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-z)): relative error ~eps everywhere; exp overflow (z < -709) gives exactly 0."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


@dataclasses.dataclass(frozen=True)
class STSCalibration:
    """Fitted per-position maps c_k -> sigmoid(logit(c_k) / T_k + b_k) (``b_k = 0``: plain STS)."""

    temperatures: list[float]
    """One positive temperature per draft position (length gamma); ``temperatures[k-1]`` is T_k."""
    biases: list[float] | None = None
    """One shift per draft position, added after the temperature; None means all zero."""
    sampling_temperature: float | None = None
    """The sampling temperature of the rounds it was fitted on (None: unknown, any)."""

    def __post_init__(self) -> None:
        temps = [float(t) for t in self.temperatures]
        if not temps:
            raise ValueError("STSCalibration needs at least one temperature")
        if not all(math.isfinite(t) and t > 0.0 for t in temps):
            raise ValueError(f"temperatures must be positive and finite, got {temps}")
        biases = [0.0] * len(temps) if self.biases is None else [float(b) for b in self.biases]
        if len(biases) != len(temps):
            raise ValueError(f"{len(biases)} biases for {len(temps)} temperatures")
        if not all(math.isfinite(b) for b in biases):
            raise ValueError(f"biases must be finite, got {biases}")
        object.__setattr__(self, "temperatures", temps)
        object.__setattr__(self, "biases", biases)
        if self.sampling_temperature is not None:
            t = float(self.sampling_temperature)
            if not (math.isfinite(t) and t >= 0.0):
                raise ValueError(f"sampling_temperature must be >= 0, got {t}")
            object.__setattr__(self, "sampling_temperature", t)

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    @property
    def shifted(self) -> bool:
        """True when some position has a nonzero shift (not the paper's plain STS)."""
        return any(b != 0.0 for b in self.biases)

    @classmethod
    def identity(cls, gamma: int) -> "STSCalibration":
        """All temperatures 1, no shift: apply() only clamps (for drafters not yet calibrated)."""
        return cls([1.0] * gamma)

    def apply(self, c: ArrayLike) -> ArrayLike:
        """Calibrated per-position confidences sigmoid(logit(c_k) / T_k + b_k).

        c: [..., gamma] torch tensor (any device; half types computed in float32 and cast back)
        or numpy array / sequence (returned as float64 numpy). c is clamped to [eps, 1 - eps] of
        its float type first so 0 and 1 give finite logits (a half-type result may still round
        to exactly 0 or 1 when cast back). Returns the conditional
        confidences; the prefix survival is their cumulative product (``survival``).
        """
        if isinstance(c, torch.Tensor):
            if c.shape[-1] != self.gamma:
                raise ValueError(f"last dim of c is {c.shape[-1]}, calibration has gamma={self.gamma}")
            compute_dtype = c.dtype if c.dtype in (torch.float32, torch.float64) else torch.float32
            x = c.to(compute_dtype)
            eps = torch.finfo(compute_dtype).eps
            x = x.clamp(eps, 1.0 - eps)
            temps = torch.tensor(self.temperatures, dtype=compute_dtype, device=c.device)  # [gamma]
            biases = torch.tensor(self.biases, dtype=compute_dtype, device=c.device)  # [gamma]
            z = torch.log(x) - torch.log1p(-x)  # [..., gamma]
            out = torch.sigmoid(z / temps + biases)
            return out.to(c.dtype if c.is_floating_point() else compute_dtype)
        x = _to_numpy_f64(c)
        if x.ndim == 0 or x.shape[-1] != self.gamma:
            raise ValueError(f"c must have shape [..., {self.gamma}], got {x.shape}")
        temps = np.asarray(self.temperatures, dtype=np.float64)  # [gamma]
        biases = np.asarray(self.biases, dtype=np.float64)  # [gamma]
        return _sigmoid_np(_logit_np(x) / temps + biases)

    def survival(self, c: ArrayLike) -> ArrayLike:
        """Calibrated prefix survival a_k = prod_{i<=k} calibrated c_i, shape [..., gamma]."""
        calibrated = self.apply(c)
        if isinstance(calibrated, torch.Tensor):
            return torch.cumprod(calibrated, dim=-1)
        return np.cumprod(calibrated, axis=-1)

    def fit_dict(self) -> dict:
        """This fit as one entry of a version-2 file's ``fits``."""
        out: dict = {"temperatures": list(self.temperatures)}
        if self.shifted:
            out["biases"] = list(self.biases)
        if self.sampling_temperature is not None:
            out["sampling_temperature"] = self.sampling_temperature
        return out

    @classmethod
    def from_fit_dict(cls, data: dict) -> "STSCalibration":
        biases = data.get("biases")
        return cls([float(t) for t in data["temperatures"]],
                   None if biases is None else [float(b) for b in biases],
                   data.get("sampling_temperature"))

    def to_dict(self) -> dict:
        return CalibrationSet([self]).to_dict()

    @classmethod
    def from_dict(cls, data: dict) -> "STSCalibration":
        return CalibrationSet.from_dict(data).only()

    def save(self, path: str | os.PathLike) -> None:
        """Write a one-fit file (see CalibrationSet.save)."""
        CalibrationSet([self]).save(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "STSCalibration":
        """Read a one-fit file (a file, or a checkpoint directory holding ``calibration.json``)."""
        return CalibrationSet.load(path).only()


@dataclasses.dataclass(frozen=True)
class CalibrationSet:
    """The fits of one drafter, one per sampling temperature it was calibrated at.

    Acceptance depends on the sampling temperature (greedy drafts survive more often than T=1
    samples), so `dspark calibrate` fits each temperature it is given; a request uses the fit of
    the nearest sampling temperature (``for_temperature``).
    """

    fits: list[STSCalibration]
    """Sorted by sampling temperature; several only if every one names its temperature."""

    def __post_init__(self) -> None:
        fits = list(self.fits)
        if not fits:
            raise ValueError("a calibration needs at least one fit")
        if len({f.gamma for f in fits}) != 1:
            raise ValueError(f"fits disagree on gamma: {[f.gamma for f in fits]}")
        if len(fits) > 1:
            temps = [f.sampling_temperature for f in fits]
            if any(t is None for t in temps):
                raise ValueError("with several fits, each needs its sampling_temperature")
            if len(set(temps)) != len(temps):
                raise ValueError(f"two fits for the same sampling temperature: {temps}")
            fits.sort(key=lambda f: f.sampling_temperature)
        object.__setattr__(self, "fits", fits)

    @property
    def gamma(self) -> int:
        return self.fits[0].gamma

    def only(self) -> STSCalibration:
        if len(self.fits) != 1:
            raise ValueError(f"the calibration holds {len(self.fits)} fits (one per sampling "
                             f"temperature); use CalibrationSet")
        return self.fits[0]

    def for_temperature(self, temperature: float) -> STSCalibration:
        """The fit of the nearest sampling temperature (the lower one on a tie)."""
        if len(self.fits) == 1:
            return self.fits[0]
        return min(self.fits, key=lambda f: abs(f.sampling_temperature - float(temperature)))

    def to_dict(self) -> dict:
        """One plain fit of no stated temperature is written as version 1 (what older code
        reads); anything else as version 2."""
        first = self.fits[0]
        if len(self.fits) == 1 and not first.shifted and first.sampling_temperature is None:
            return {"format": _FORMAT, "version": 1, "temperatures": list(first.temperatures)}
        return {"format": _FORMAT, "version": _FORMAT_VERSION,
                "fits": [f.fit_dict() for f in self.fits]}

    @classmethod
    def from_dict(cls, data: dict) -> "CalibrationSet":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not an STS calibration (format={data.get('format')!r})")
        version = data.get("version")
        if version == 1:
            return cls([STSCalibration([float(t) for t in data["temperatures"]])])
        if version == _FORMAT_VERSION:
            return cls([STSCalibration.from_fit_dict(f) for f in data["fits"]])
        raise ValueError(f"unsupported STS calibration version {version!r}")

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON to path (a file, or a checkpoint directory: then ``calibration.json`` in it)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, CALIBRATION_FILENAME)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)  # never leave a half-written file beside a checkpoint

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CalibrationSet":
        """Read JSON from path (a file, or a checkpoint directory holding ``calibration.json``)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, CALIBRATION_FILENAME)
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


@dataclasses.dataclass(frozen=True)
class STSFitConfig:
    """How fit_sts searches temperatures."""

    num_bins: int = 15
    """ECE bins (docs/design.md section 9: 15)."""
    t_min: float = 0.05
    """Smallest temperature of the coarse grid."""
    t_max: float = 20.0
    """Largest temperature of the coarse grid."""
    num_grid: int = 301
    """Points of the coarse geometric grid from t_min to t_max."""
    num_refine: int = 41
    """Points of a second geometric grid between the coarse best's neighbours (0: no refinement)."""
    chunk: int = 64
    """Candidate temperatures scored at once (bounds memory to chunk x num_samples floats)."""
    b_min: float = -4.0
    """Smallest shift of the shifted fit's grid (a logit offset)."""
    b_max: float = 4.0
    """Largest shift of the shifted fit's grid."""
    num_bias_grid: int = 81
    """Points of the shifted fit's coarse shift grid (uniform from b_min to b_max)."""
    num_shift_temperatures: int = 61
    """Points of the shifted fit's coarse temperature grid (geometric, t_min to t_max): the joint
    grid is num_shift_temperatures x num_bias_grid candidates, refined around the best."""

    def __post_init__(self) -> None:
        if self.num_bins < 1:
            raise ValueError("num_bins must be >= 1")
        if not (0.0 < self.t_min < self.t_max and math.isfinite(self.t_max)):
            raise ValueError("need 0 < t_min < t_max < inf")
        if self.num_grid < 2 or self.num_refine < 0 or self.chunk < 1:
            raise ValueError("num_grid >= 2, num_refine >= 0 and chunk >= 1 required")
        if not (self.b_min < self.b_max and math.isfinite(self.b_min) and math.isfinite(self.b_max)):
            raise ValueError("need finite b_min < b_max")
        if self.num_bias_grid < 2 or self.num_shift_temperatures < 2:
            raise ValueError("num_bias_grid >= 2 and num_shift_temperatures >= 2 required")

    def coarse_grid(self) -> np.ndarray:
        return np.geomspace(self.t_min, self.t_max, self.num_grid)


def _best_temperature(
    prefix: np.ndarray, logit_c: np.ndarray, observed: np.ndarray, grid: np.ndarray, config: STSFitConfig
) -> tuple[float, float]:
    """argmin over grid of ECE(prefix * sigmoid(logit_c / T), observed); first minimum on ties.

    prefix, logit_c, observed: [num_samples]; grid: [num_candidates]. Returns (T, ece).
    """
    t, _, ece = _best_map(prefix, logit_c, grid, np.zeros(1),
                          lambda preds: _ece_many(preds, observed, config.num_bins), config.chunk)
    return t, ece


def _best_map(
    prefix: np.ndarray, logit_c: np.ndarray, temps: np.ndarray, shifts: np.ndarray, score,
    chunk: int,
) -> tuple[float, float, float]:
    """argmin over temps x shifts of score(prefix * sigmoid(logit_c / T + b)), first minimum in
    (T, b) row-major order on ties.

    prefix, logit_c: [num_samples]; temps: [num_t]; shifts: [num_b]; score maps predictions
    [candidates, num_samples] to [candidates]; chunk candidates are scored at once.
    Returns (T, b, score).
    """
    cand_t = np.repeat(temps, shifts.size)  # [num_t * num_b]
    cand_b = np.tile(shifts, temps.size)  # [num_t * num_b]
    scores = []
    for start in range(0, cand_t.size, chunk):
        t = cand_t[start : start + chunk, None]  # [chunk, 1]
        b = cand_b[start : start + chunk, None]  # [chunk, 1]
        preds = prefix[None, :] * _sigmoid_np(logit_c[None, :] / t + b)  # [chunk, num_samples]
        scores.append(score(preds))
    scores_all = np.concatenate(scores)  # [num_t * num_b]
    best = int(np.argmin(scores_all))
    return float(cand_t[best]), float(cand_b[best]), float(scores_all[best])


def _log_loss_many(preds: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Mean log-loss of each row of preds [num_candidates, num_samples] against observed
    [num_samples] in {0, 1}; predictions are clipped to [1e-12, 1 - 1e-12]."""
    p = np.clip(preds, 1e-12, 1.0 - 1e-12)
    return -(observed * np.log(p) + (1.0 - observed) * np.log1p(-p)).mean(axis=1)


def _best_temperature_and_shift(
    prefix: np.ndarray, logit_c: np.ndarray, observed: np.ndarray, temps: np.ndarray,
    shifts: np.ndarray, config: STSFitConfig,
) -> tuple[float, float, float]:
    """argmin over temps x shifts of log-loss(prefix * sigmoid(logit_c / T + b), observed).

    prefix, logit_c, observed: [num_samples]; temps: [num_t]; shifts: [num_b]. Ties go to the
    first candidate in (T, b) row-major order. Returns (T, b, log-loss).
    """
    return _best_map(prefix, logit_c, temps, shifts,
                     lambda preds: _log_loss_many(preds, observed), config.chunk)


def _fit_position_shifted(
    prefix: np.ndarray, logit_c: np.ndarray, observed: np.ndarray, config: STSFitConfig
) -> tuple[float, float]:
    """(T_k, b_k) of one position: a joint coarse grid, then a finer one around its best point."""
    temps = np.geomspace(config.t_min, config.t_max, config.num_shift_temperatures)
    shifts = np.linspace(config.b_min, config.b_max, config.num_bias_grid)
    t_best, b_best, _ = _best_temperature_and_shift(prefix, logit_c, observed, temps, shifts, config)
    if config.num_refine > 0:
        i = int(np.searchsorted(temps, t_best))
        t_fine = np.geomspace(temps[max(i - 1, 0)], temps[min(i + 1, temps.size - 1)], 21)
        step = shifts[1] - shifts[0]
        b_fine = np.linspace(b_best - step, b_best + step, 21)
        t_fine = np.unique(np.append(t_fine, t_best))
        b_fine = np.unique(np.append(b_fine, b_best))
        t_best, b_best, _ = _best_temperature_and_shift(prefix, logit_c, observed, t_fine, b_fine,
                                                        config)
    return t_best, b_best


def fit_sts(
    c_raw: ArrayLike,
    survived: ArrayLike | None = None,
    *,
    accepted_len: ArrayLike | None = None,
    config: STSFitConfig | None = None,
    grid: Sequence[float] | None = None,
    shift: bool = False,
) -> STSCalibration:
    """Sequential Temperature Scaling on a held-out set (docs/design.md section 4).

    c_raw: [num_samples, gamma] raw confidences. Outcomes: either survived [num_samples, gamma]
    bool (survived[:, k] = drafts 1..k+1 all accepted) or accepted_len [num_samples] in 0..gamma.
    grid: explicit candidate temperatures (overrides the config's coarse grid; refinement, if
    config.num_refine > 0, then searches between the best point's neighbours in it).
    For k = 1..gamma, T_k minimises the ECE of the cumulative calibrated product at k against
    survived[:, k-1], with T_1..T_{k-1} fixed.
    shift: also fit a per-position shift b_k (map sigmoid(logit(c_k) / T_k + b_k)), searching
    (T_k, b_k) jointly on the config's shifted grids for the least log-loss of the cumulative
    product (see the module docstring for why not ECE); ``grid`` is then not allowed.
    """
    config = config or STSFitConfig()
    c_np = _to_numpy_f64(c_raw)
    surv = _resolve_outcomes(c_np, survived, accepted_len)
    if shift:
        if grid is not None:
            raise ValueError("an explicit temperature grid is for the plain fit (shift=False)")
        return _fit_sts_shifted(c_np, surv, config)
    coarse = config.coarse_grid() if grid is None else np.asarray(sorted(float(t) for t in grid))
    if coarse.size == 0 or np.any(coarse <= 0) or not np.all(np.isfinite(coarse)):
        raise ValueError("grid must hold positive finite temperatures")
    num_samples, gamma = c_np.shape
    logits = _logit_np(c_np)  # [num_samples, gamma]
    observed = surv.astype(np.float64)  # [num_samples, gamma]
    prefix = np.ones(num_samples)  # calibrated a_{k-1}, [num_samples]
    temperatures = []
    for k in range(gamma):
        t_best, _ = _best_temperature(prefix, logits[:, k], observed[:, k], coarse, config)
        if config.num_refine > 0 and coarse.size > 1:
            i = int(np.searchsorted(coarse, t_best))
            lo = coarse[max(i - 1, 0)]
            hi = coarse[min(i + 1, coarse.size - 1)]
            fine = np.unique(np.append(np.geomspace(lo, hi, config.num_refine), t_best))
            t_best, _ = _best_temperature(prefix, logits[:, k], observed[:, k], fine, config)
        temperatures.append(t_best)
        prefix = prefix * _sigmoid_np(logits[:, k] / t_best)
    return STSCalibration(temperatures)


def _fit_sts_shifted(c_np: np.ndarray, surv: np.ndarray, config: STSFitConfig) -> STSCalibration:
    """fit_sts(shift=True): c_np [num_samples, gamma] float64, surv the same shape, bool."""
    num_samples, gamma = c_np.shape
    logits = _logit_np(c_np)  # [num_samples, gamma]
    observed = surv.astype(np.float64)  # [num_samples, gamma]
    prefix = np.ones(num_samples)  # calibrated a_{k-1}, [num_samples]
    temperatures, biases = [], []
    for k in range(gamma):
        t_best, b_best = _fit_position_shifted(prefix, logits[:, k], observed[:, k], config)
        temperatures.append(t_best)
        biases.append(b_best)
        prefix = prefix * _sigmoid_np(logits[:, k] / t_best + b_best)
    return STSCalibration(temperatures, biases)


# ----------------------------------------------------------------------------------------------
# Report


@dataclasses.dataclass(frozen=True)
class PositionCalibration:
    """Calibration figures of one draft position k (1-based)."""

    position: int
    num_at_risk: int
    """Samples whose drafts 1..k-1 were all accepted (those that test position k)."""
    observed_survival: float
    """Fraction of all samples whose prefix 1..k survived."""
    mean_pred_before: float
    mean_pred_after: float
    ece_before: float
    """ECE of the raw cumulative product a_k against prefix survival, over all samples."""
    ece_after: float
    ece_floor_after: float
    """ECE a perfectly calibrated predictor would show with the calibrated a_k on this many
    samples (``ece_noise_floor``): ece_after near it is as good as this sample can tell."""
    brier_before: float
    brier_after: float
    auc_conditional: float
    """AUC of c_k for acceptance of x_k among the at-risk samples; STS leaves it unchanged."""
    auc_prefix_before: float
    """AUC of the raw cumulative product a_k for prefix survival, over all samples."""
    auc_prefix_after: float


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
    positions: list[PositionCalibration]
    temperatures: list[float]
    num_samples: int
    num_bins: int
    biases: list[float]
    """The calibration's shifts b_k (all zero: plain STS)."""
    ece_crossfit: list[float] | None = None
    """Per position, the ECE of fits on rounds they were not fitted on (``crossfit_ece``);
    None unless asked for."""

    @property
    def mean_ece_before(self) -> float:
        return float(np.mean([p.ece_before for p in self.positions]))

    @property
    def mean_ece_after(self) -> float:
        return float(np.mean([p.ece_after for p in self.positions]))

    def to_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "num_bins": self.num_bins,
            "temperatures": list(self.temperatures),
            "biases": list(self.biases),
            "mean_ece_before": self.mean_ece_before,
            "mean_ece_after": self.mean_ece_after,
            "ece_crossfit": None if self.ece_crossfit is None else list(self.ece_crossfit),
            "positions": [dataclasses.asdict(p) for p in self.positions],
        }

    def format_table(self) -> str:
        crossfit = self.ece_crossfit is not None
        header = (
            f"{'pos':>3} {'T':>7} {'shift':>7} {'at_risk':>8} {'surv':>6} {'ECE raw':>8} {'ECE sts':>8} "
            + (f"{'ECE cv':>7} " if crossfit else "")
            + f"{'floor':>6} {'AUC':>6} {'Brier raw':>9} {'Brier sts':>9}"
        )
        lines = [header]
        for i, (p, t, b) in enumerate(zip(self.positions, self.temperatures, self.biases)):
            lines.append(
                f"{p.position:>3} {t:>7.3f} {b:>+7.3f} {p.num_at_risk:>8d} {p.observed_survival:>6.3f} "
                f"{100 * p.ece_before:>7.2f}% {100 * p.ece_after:>7.2f}% "
                + (f"{100 * self.ece_crossfit[i]:>6.2f}% " if crossfit else "")
                + f"{100 * p.ece_floor_after:>5.2f}% {p.auc_conditional:>6.3f} "
                f"{p.brier_before:>9.4f} {p.brier_after:>9.4f}"
            )
        lines.append(
            f"mean ECE {100 * self.mean_ece_before:.2f}% -> {100 * self.mean_ece_after:.2f}% "
            + (f"(cross-fitted {100 * float(np.mean(self.ece_crossfit)):.2f}%) " if crossfit else "")
            + f"({self.num_samples} samples, {self.num_bins} bins)"
        )
        return "\n".join(lines)


def conditional_auc(c: ArrayLike, survived: ArrayLike, position: int) -> float:
    """AUC of c_k for the acceptance of draft k among samples whose drafts 1..k-1 were accepted.

    c: [num_samples, gamma] (raw or calibrated: STS does not change this AUC, because the
    temperature map is increasing and applied after the same clamp); survived: [num_samples,
    gamma] bool; position: k, 1-based. NaN if no sample reaches k or all at-risk samples agree.
    """
    c_np = _to_numpy_f64(c)
    surv = _to_numpy_bool(survived)
    k = position - 1
    at_risk = np.ones(c_np.shape[0], dtype=np.bool_) if k == 0 else surv[:, k - 1]
    if not at_risk.any():
        return float("nan")
    eps = np.finfo(np.float64).eps  # the clamp apply() uses, so raw and calibrated agree on ties
    return roc_auc(np.clip(c_np[at_risk, k], eps, 1.0 - eps), surv[at_risk, k])


def calibration_report(
    c_raw: ArrayLike,
    survived: ArrayLike | None,
    sts: STSCalibration,
    *,
    accepted_len: ArrayLike | None = None,
    num_bins: int = 15,
    crossfit_folds: int = 0,
) -> CalibrationReport:
    """Per-position ECE before/after STS, AUC and Brier (see PositionCalibration for each field).

    c_raw: [num_samples, gamma]; survived: [num_samples, gamma] bool (or None and accepted_len).
    crossfit_folds: with 2 or more, also the cross-fitted ECE (``crossfit_ece``, refitting STS
    the way ``sts`` was fitted: shifted or not, default settings).
    """
    c_np = _to_numpy_f64(c_raw)
    surv = _resolve_outcomes(c_np, survived, accepted_len)
    if sts.gamma != c_np.shape[1]:
        raise ValueError(f"calibration has gamma={sts.gamma}, confidences have {c_np.shape[1]}")
    calibrated = sts.apply(c_np)  # [num_samples, gamma]
    a_before = np.cumprod(c_np, axis=1)  # [num_samples, gamma]
    a_after = np.cumprod(calibrated, axis=1)  # [num_samples, gamma]
    positions = []
    for k in range(c_np.shape[1]):
        at_risk = np.ones(c_np.shape[0], dtype=np.bool_) if k == 0 else surv[:, k - 1]
        y = surv[:, k]
        positions.append(
            PositionCalibration(
                position=k + 1,
                num_at_risk=int(at_risk.sum()),
                observed_survival=float(y.mean()),
                mean_pred_before=float(a_before[:, k].mean()),
                mean_pred_after=float(a_after[:, k].mean()),
                ece_before=expected_calibration_error(a_before[:, k], y, num_bins),
                ece_after=expected_calibration_error(a_after[:, k], y, num_bins),
                ece_floor_after=ece_noise_floor(a_after[:, k], num_bins),
                brier_before=brier_score(a_before[:, k], y),
                brier_after=brier_score(a_after[:, k], y),
                auc_conditional=conditional_auc(c_np, surv, k + 1),
                auc_prefix_before=roc_auc(a_before[:, k], y),
                auc_prefix_after=roc_auc(a_after[:, k], y),
            )
        )
    crossfit = (crossfit_ece(c_np, surv, shift=sts.shifted, folds=crossfit_folds,
                             num_bins=num_bins) if crossfit_folds else None)
    return CalibrationReport(positions, list(sts.temperatures), int(c_np.shape[0]), num_bins,
                             list(sts.biases), crossfit)


def crossfit_ece(
    c_raw: ArrayLike,
    survived: ArrayLike,
    *,
    shift: bool = False,
    folds: int = 2,
    num_bins: int = 15,
) -> list[float]:
    """Per-position ECE of STS on rounds it was not fitted on: [gamma] floats.

    The rounds (c_raw [num_samples, gamma], survived the same shape, bool) are cut into `folds`
    contiguous parts; each part's cumulative products a_k are calibrated by the fit on all the
    other parts, and the ECE of the pooled a_k against prefix survival is taken per position.
    An in-sample ECE after fitting (``calibration_report``'s ece_after) can only flatter the fit;
    this one shows what a calibration does on rounds it has not seen. Contiguous parts keep
    most of one prompt's rounds together (the calibration runs generate few prompts at a time).
    """
    c_np = _to_numpy_f64(c_raw)
    surv = _resolve_outcomes(c_np, survived, None)
    num_samples, gamma = c_np.shape
    if folds < 2 or num_samples < folds:
        raise ValueError(f"cross-fitting needs 2 <= folds <= num_samples, got folds={folds} "
                         f"for {num_samples} samples")
    bounds = np.linspace(0, num_samples, folds + 1).astype(np.int64)
    a_held = np.empty_like(c_np)  # [num_samples, gamma]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        fit_rows = np.ones(num_samples, dtype=np.bool_)
        fit_rows[lo:hi] = False
        sts = fit_sts(c_np[fit_rows], surv[fit_rows], shift=shift)
        a_held[lo:hi] = np.cumprod(sts.apply(c_np[lo:hi]), axis=1)
    return [expected_calibration_error(a_held[:, k], surv[:, k], num_bins) for k in range(gamma)]


# ----------------------------------------------------------------------------------------------
# Reliability diagram


def reliability_curve(pred: ArrayLike, observed: ArrayLike, num_bins: int = 15) -> dict[str, np.ndarray]:
    """Per-bin mean prediction, observed rate and count (ECE's bins), for plotting.

    Returns arrays of length num_bins; empty bins hold NaN means and count 0.
    """
    pred_np = _to_numpy_f64(pred)
    obs_np = _to_numpy_f64(observed)
    _check_1d_pair(pred_np, obs_np, "observed")
    bins = _bin_index(pred_np, num_bins)
    count = np.bincount(bins, minlength=num_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(bins, weights=pred_np, minlength=num_bins) / count
        mean_obs = np.bincount(bins, weights=obs_np, minlength=num_bins) / count
    return {"mean_pred": mean_pred, "observed": mean_obs, "count": count}


def plot_reliability(
    path: str | os.PathLike,
    c_raw: ArrayLike,
    survived: ArrayLike | None,
    sts: STSCalibration | None = None,
    *,
    accepted_len: ArrayLike | None = None,
    positions: Sequence[int] | None = None,
    num_bins: int = 15,
    title: str | None = None,
) -> str:
    """Write a reliability-diagram PNG: one panel per position (1-based), raw and (if sts) calibrated.

    Each panel shows observed prefix survival against predicted survival a_k per ECE bin, the
    diagonal, and the sample count per bin (raw predictions) as a shaded histogram. Uses the Agg
    canvas directly, so the global matplotlib backend is left alone. Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c_np = _to_numpy_f64(c_raw)
    surv = _resolve_outcomes(c_np, survived, accepted_len)
    gamma = c_np.shape[1]
    positions = list(positions) if positions is not None else list(range(1, gamma + 1))
    if not positions or any(not 1 <= p <= gamma for p in positions):
        raise ValueError(f"positions must be in 1..{gamma}, got {positions}")
    a_before = np.cumprod(c_np, axis=1)
    a_after = sts.survival(c_np) if sts is not None else None
    centers = (np.arange(num_bins) + 0.5) / num_bins

    fig = Figure(figsize=(3.2 * len(positions), 3.4), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(positions), squeeze=False)[0]
    for ax, pos in zip(axes, positions):
        k = pos - 1
        y = surv[:, k]
        raw = reliability_curve(a_before[:, k], y, num_bins)
        hist_ax = ax.twinx()
        hist_ax.bar(centers, raw["count"] / raw["count"].sum(), width=1.0 / num_bins, color="0.85", zorder=0)
        hist_ax.set_ylim(0, 1)
        hist_ax.set_yticks([])
        ax.set_zorder(hist_ax.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect")
        ok = raw["count"] > 0
        ece_raw = expected_calibration_error(a_before[:, k], y, num_bins)
        label = f"raw (ECE {100 * ece_raw:.1f}%)"
        ax.plot(raw["mean_pred"][ok], raw["observed"][ok], "o-", color="tab:red", markersize=3, label=label)
        if a_after is not None:
            cal = reliability_curve(a_after[:, k], y, num_bins)
            ok = cal["count"] > 0
            ece_cal = expected_calibration_error(a_after[:, k], y, num_bins)
            ax.plot(
                cal["mean_pred"][ok], cal["observed"][ok], "s-", color="tab:blue", markersize=3,
                label=f"STS (ECE {100 * ece_cal:.1f}%)",
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        auc = conditional_auc(c_np, surv, pos)
        ax.set_title(f"Position {pos} (AUC {auc:.3f})")
        ax.set_xlabel("predicted prefix survival")
        if pos == positions[0]:
            ax.set_ylabel("observed survival")
        ax.legend(loc="upper left", fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path
