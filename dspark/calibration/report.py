"""What a calibration does, per draft position: the report (ECE before and after, its noise
floor, AUC, Brier, optionally the cross-fitted ECE) and the reliability diagram's PNG."""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from dspark.calibration.arrays import ArrayLike, check_1d_pair, to_numpy_f64
from dspark.calibration.fit import crossfit_ece
from dspark.calibration.metrics import (bin_index, brier_score, conditional_auc,
                                        ece_noise_floor, expected_calibration_error, roc_auc)
from dspark.calibration.outcomes import resolve_outcomes
from dspark.calibration.sts_map import STSCalibration


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
    c_np = to_numpy_f64(c_raw)
    surv = resolve_outcomes(c_np, survived, accepted_len)
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


def reliability_curve(pred: ArrayLike, observed: ArrayLike, num_bins: int = 15) -> dict[str, np.ndarray]:
    """Per-bin mean prediction, observed rate and count (ECE's bins), for plotting.

    Returns arrays of length num_bins; empty bins hold NaN means and count 0.
    """
    pred_np = to_numpy_f64(pred)
    obs_np = to_numpy_f64(observed)
    check_1d_pair(pred_np, obs_np, "observed")
    bins = bin_index(pred_np, num_bins)
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

    c_np = to_numpy_f64(c_raw)
    surv = resolve_outcomes(c_np, survived, accepted_len)
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
