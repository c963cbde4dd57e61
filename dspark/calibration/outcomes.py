"""Observed outcomes of draft blocks: the prefix-survival matrix ``survived [num_samples, gamma]``
(True iff drafts 1..k were all accepted), from accepted lengths or given, and its checks."""

from __future__ import annotations

import numpy as np
import torch

from dspark.calibration.arrays import ArrayLike, to_numpy_bool


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


def resolve_outcomes(
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
        surv = to_numpy_bool(survived)
    _check_survival(surv)
    if surv.shape != (num_samples, gamma):
        raise ValueError(f"outcomes shape {surv.shape} does not match c_raw {c_raw.shape}")
    if num_samples == 0:
        raise ValueError("no samples")
    return surv
