"""Calibration and ranking metrics (docs/design.md section 9): ECE and its noise floor, ROC-AUC
(also conditional on a draft position), Brier score. All compute in float64 numpy; torch inputs
are converted.

- ECE: ``num_bins`` equal-width bins over [0, 1]; bin b holds predictions p with
  ``b/num_bins <= p < (b+1)/num_bins``; the last bin also holds p == 1. (Computed as
  ``min(floor(p * num_bins), num_bins - 1)``.) ECE = sum_b (n_b / N) |mean(p in b) - mean(y in b)|;
  empty bins contribute nothing.
- ROC-AUC: the Mann-Whitney statistic from average ranks: P(score_pos > score_neg) + 0.5 P(tie).
  NaN when only one class is present.
- Brier score: mean((p - y)^2).
"""

from __future__ import annotations

import numpy as np

from dspark.calibration.arrays import ArrayLike, check_1d_pair, to_numpy_bool, to_numpy_f64


def bin_index(pred: np.ndarray, num_bins: int) -> np.ndarray:
    """Equal-width bin of each prediction: [b/n, (b+1)/n), the last bin closed at 1."""
    return np.minimum(np.floor(pred * num_bins), num_bins - 1).astype(np.int64)


def expected_calibration_error(pred: ArrayLike, observed: ArrayLike, num_bins: int = 15) -> float:
    """ECE of predictions in [0, 1] against observed outcomes (0/1, or soft values in [0, 1]).

    pred, observed: [num_samples]. Bins as in the module docstring (left-closed, last bin closed).
    """
    pred_np = to_numpy_f64(pred)
    obs_np = to_numpy_f64(observed)
    check_1d_pair(pred_np, obs_np, "observed")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if np.any(pred_np < 0.0) or np.any(pred_np > 1.0) or np.any(np.isnan(pred_np)):
        raise ValueError("predictions must lie in [0, 1]")
    bins = bin_index(pred_np, num_bins)  # [num_samples]
    # sum over bins of |sum(p) - sum(y)| / N equals sum_b (n_b/N) |mean p - mean y|
    sum_pred = np.bincount(bins, weights=pred_np, minlength=num_bins)  # [num_bins]
    sum_obs = np.bincount(bins, weights=obs_np, minlength=num_bins)  # [num_bins]
    return float(np.abs(sum_pred - sum_obs).sum() / pred_np.size)


def ece_many(preds: np.ndarray, observed: np.ndarray, num_bins: int) -> np.ndarray:
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
    pred_np = to_numpy_f64(pred)
    if pred_np.ndim != 1 or pred_np.size == 0:
        raise ValueError(f"pred must be 1-D and non-empty, got shape {pred_np.shape}")
    if np.any(pred_np < 0.0) or np.any(pred_np > 1.0) or np.any(np.isnan(pred_np)):
        raise ValueError("predictions must lie in [0, 1]")
    rng = np.random.default_rng(seed)
    bins = bin_index(pred_np, num_bins)  # [num_samples]
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
    pred_np = to_numpy_f64(pred)
    label_np = to_numpy_bool(label)
    check_1d_pair(pred_np, label_np, "label")
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
    pred_np = to_numpy_f64(pred)
    obs_np = to_numpy_f64(observed)
    check_1d_pair(pred_np, obs_np, "observed")
    return float(np.mean((pred_np - obs_np) ** 2))


def conditional_auc(c: ArrayLike, survived: ArrayLike, position: int) -> float:
    """AUC of c_k for the acceptance of draft k among samples whose drafts 1..k-1 were accepted.

    c: [num_samples, gamma] (raw or calibrated: STS does not change this AUC, because the
    temperature map is increasing and applied after the same clamp); survived: [num_samples,
    gamma] bool; position: k, 1-based. NaN if no sample reaches k or all at-risk samples agree.
    """
    c_np = to_numpy_f64(c)
    surv = to_numpy_bool(survived)
    k = position - 1
    at_risk = np.ones(c_np.shape[0], dtype=np.bool_) if k == 0 else surv[:, k - 1]
    if not at_risk.any():
        return float("nan")
    eps = np.finfo(np.float64).eps  # the clamp apply() uses, so raw and calibrated agree on ties
    return roc_auc(np.clip(c_np[at_risk, k], eps, 1.0 - eps), surv[at_risk, k])
