"""Conversions every calibration module applies to its inputs: numpy float64 and bool arrays
from numpy arrays, torch tensors (any device) or nested sequences."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


ArrayLike = Any  # numpy array, torch tensor, or nested sequence of numbers


def to_numpy_f64(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def to_numpy_bool(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype != np.bool_:
        if not np.all((x == 0) | (x == 1)):
            raise ValueError("survival outcomes must be boolean (or 0/1)")
        x = x.astype(np.bool_)
    return x


def check_1d_pair(pred: np.ndarray, other: np.ndarray, name: str) -> None:
    if pred.ndim != 1 or other.ndim != 1:
        raise ValueError(f"pred and {name} must be 1-D, got {pred.shape} and {other.shape}")
    if pred.shape != other.shape:
        raise ValueError(f"pred {pred.shape} and {name} {other.shape} differ in length")
    if pred.size == 0:
        raise ValueError("empty input")
