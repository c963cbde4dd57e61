"""The STS map ``c_k -> sigmoid(logit(c_k) / T_k + b_k)`` of one drafter (``STSCalibration``), the
maps of several sampling temperatures (``CalibrationSet``) and their JSON file beside a drafter
checkpoint (``calibration.json``, format ``dspark.sts`` version 1 or 2)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import torch

from dspark.calibration.arrays import ArrayLike, to_numpy_f64


CALIBRATION_FILENAME = "calibration.json"
"""Name of the file written beside a drafter checkpoint."""

_FORMAT = "dspark.sts"
_FORMAT_VERSION = 2
"""Version 2 holds a list of fits, each with optional ``biases`` (shifts) and the sampling
temperature it was fitted at; version-1 files (one fit, temperatures only) still load, and a
single plain fit is still written as version 1."""


def logit_np(c: np.ndarray) -> np.ndarray:
    eps = np.finfo(np.float64).eps  # keeps logit finite for c in {0, 1}
    c = np.clip(c, eps, 1.0 - eps)
    return np.log(c) - np.log1p(-c)


def sigmoid_np(z: np.ndarray) -> np.ndarray:
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
        x = to_numpy_f64(c)
        if x.ndim == 0 or x.shape[-1] != self.gamma:
            raise ValueError(f"c must have shape [..., {self.gamma}], got {x.shape}")
        temps = np.asarray(self.temperatures, dtype=np.float64)  # [gamma]
        biases = np.asarray(self.biases, dtype=np.float64)  # [gamma]
        return sigmoid_np(logit_np(x) / temps + biases)

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
