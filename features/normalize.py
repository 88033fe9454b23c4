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
        mean, spread = spread_of(x, rows)
        std = np.where(spread < MIN_STD, 1.0, spread)
        return NormStats(mean.astype(np.float32), std.astype(np.float32))

    def apply(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.mean) / self.std).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.astype(float).tolist(), "std": self.std.astype(float).tolist()}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> NormStats:
        return NormStats(np.asarray(d["mean"], dtype=np.float32), np.asarray(d["std"], dtype=np.float32))


COLUMNS_PER_BLOCK = 16  # columns fitted at a time, to bound the float64 temporaries


def spread_of(x: np.ndarray, rows: np.ndarray | slice | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std (float64 [C]) of each column of `x[rows]`, ignoring NaN and inf; ValueError for a column
    with no finite value."""
    picked = slice(None) if rows is None else rows
    n_cols = x.shape[-1]
    mean, std = np.empty(n_cols), np.empty(n_cols)
    empty: list[int] = []
    starts = list(range(0, n_cols, COLUMNS_PER_BLOCK))
    if len(starts) > 1 and n_cols - starts[-1] == 1:
        starts.pop()  # a lone column sums pairwise, a block row by row: in the block before, as all at once
    for j, stop in zip(starts, [*starts[1:], n_cols], strict=True):
        block = x[picked, ..., j:stop]  # [n, ..., b]
        sub = block.reshape(-1, block.shape[-1]).astype(np.float64)  # [n * ..., b]
        finite = np.isfinite(sub)
        count = finite.sum(axis=0)
        empty += (j + np.flatnonzero(count == 0)).tolist()
        count = np.maximum(count, 1)
        m = np.where(finite, sub, 0.0).sum(axis=0) / count
        mean[j:stop] = m
        std[j:stop] = np.sqrt(np.where(finite, (sub - m) ** 2, 0.0).sum(axis=0) / count)
    if empty:
        raise ValueError(f"cannot fit normalisation: column(s) {empty} have no finite value in the fitting rows")
    return mean, std
