"""Normalisation statistics fitted on one slice of rows and applied to any other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_STD = 1e-8


@dataclass(frozen=True)
class NormStats:
    """Per-column mean and standard deviation; columns with no spread get std 1."""

    mean: np.ndarray  # float32 [C]
    std: np.ndarray  # float32 [C]

    @staticmethod
    def fit(x: np.ndarray, rows: np.ndarray | slice | None = None) -> NormStats:
        """Fit on `x[rows]` (all rows if None), ignoring NaN; x is [N, C] or [N, ..., C]."""
        sub = x if rows is None else x[rows]
        sub = sub.reshape(-1, sub.shape[-1]).astype(np.float64)
        finite = np.isfinite(sub)
        count = finite.sum(axis=0)
        if np.any(count == 0):
            raise ValueError(f"cannot fit normalisation: column(s) {np.flatnonzero(count == 0).tolist()} "
                             "have no finite value in the fitting rows")
        z = np.where(finite, sub, 0.0)
        mean = z.sum(axis=0) / count
        var = np.where(finite, (sub - mean) ** 2, 0.0).sum(axis=0) / count
        std = np.sqrt(var)
        std = np.where(std < MIN_STD, 1.0, std)
        return NormStats(mean.astype(np.float32), std.astype(np.float32))

    def apply(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.mean) / self.std).astype(np.float32)

    def invert(self, z: np.ndarray) -> np.ndarray:
        return (z * self.std + self.mean).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.astype(float).tolist(), "std": self.std.astype(float).tolist()}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> NormStats:
        return NormStats(np.asarray(d["mean"], dtype=np.float32), np.asarray(d["std"], dtype=np.float32))
