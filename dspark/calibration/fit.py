"""Fitting STS (docs/design.md section 4): the sequential per-position search of ``T_k`` (plain,
by ECE) or of ``T_k`` and a shift ``b_k`` together (shifted, by log-loss), and the cross-fitted
ECE of fits on rounds they were not fitted on."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from dspark.calibration.arrays import ArrayLike, to_numpy_f64
from dspark.calibration.metrics import ece_many, expected_calibration_error
from dspark.calibration.outcomes import resolve_outcomes
from dspark.calibration.sts_map import STSCalibration, logit_np, sigmoid_np


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
                          lambda preds: ece_many(preds, observed, config.num_bins), config.chunk)
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
        preds = prefix[None, :] * sigmoid_np(logit_c[None, :] / t + b)  # [chunk, num_samples]
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
    c_np = to_numpy_f64(c_raw)
    surv = resolve_outcomes(c_np, survived, accepted_len)
    if shift:
        if grid is not None:
            raise ValueError("an explicit temperature grid is for the plain fit (shift=False)")
        return _fit_sts_shifted(c_np, surv, config)
    coarse = config.coarse_grid() if grid is None else np.asarray(sorted(float(t) for t in grid))
    if coarse.size == 0 or np.any(coarse <= 0) or not np.all(np.isfinite(coarse)):
        raise ValueError("grid must hold positive finite temperatures")
    num_samples, gamma = c_np.shape
    logits = logit_np(c_np)  # [num_samples, gamma]
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
        prefix = prefix * sigmoid_np(logits[:, k] / t_best)
    return STSCalibration(temperatures)


def _fit_sts_shifted(c_np: np.ndarray, surv: np.ndarray, config: STSFitConfig) -> STSCalibration:
    """fit_sts(shift=True): c_np [num_samples, gamma] float64, surv the same shape, bool."""
    num_samples, gamma = c_np.shape
    logits = logit_np(c_np)  # [num_samples, gamma]
    observed = surv.astype(np.float64)  # [num_samples, gamma]
    prefix = np.ones(num_samples)  # calibrated a_{k-1}, [num_samples]
    temperatures, biases = [], []
    for k in range(gamma):
        t_best, b_best = _fit_position_shifted(prefix, logits[:, k], observed[:, k], config)
        temperatures.append(t_best)
        biases.append(b_best)
        prefix = prefix * sigmoid_np(logits[:, k] / t_best + b_best)
    return STSCalibration(temperatures, biases)


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
    c_np = to_numpy_f64(c_raw)
    surv = resolve_outcomes(c_np, survived, None)
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
