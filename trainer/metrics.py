"""Forecast quality: pinball loss and q-risk per quantile, and coverage of the outer interval."""

from __future__ import annotations

import numpy as np


def pinball(pred: np.ndarray, target: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
    """Per-window, per-step, per-quantile pinball loss; pred [W, H, Q], target [W, H] -> [W, H, Q]."""
    err = target[..., None] - pred  # [W, H, Q]
    return np.maximum(quantiles * err, (quantiles - 1.0) * err)


def forecast_metrics(pred: np.ndarray, target: np.ndarray, quantiles: tuple[float, ...]) -> dict[str, object]:
    """Pinball loss (mean), q-risk (2 sum QL / sum |y|, as in the TFT paper) per quantile,
    and the share of targets inside [lowest, highest] quantile."""
    q = np.asarray(quantiles, dtype=np.float64)
    ql = pinball(pred.astype(np.float64), target.astype(np.float64), q)  # [W, H, Q]
    denom = max(float(np.abs(target).sum()), 1e-12)
    inside = (target >= pred[..., 0]) & (target <= pred[..., -1])
    return {
        "pinball": {f"{x:g}": float(v) for x, v in zip(quantiles, ql.mean(axis=(0, 1)), strict=True)},
        "pinball_mean": float(ql.mean()),
        "q_risk": {f"{x:g}": float(v) for x, v in zip(quantiles, 2.0 * ql.sum(axis=(0, 1)) / denom, strict=True)},
        "coverage": float(inside.mean()),
        "nominal_coverage": float(quantiles[-1] - quantiles[0]),
    }


def climatology_forecast(climatology: np.ndarray, n_windows: int) -> np.ndarray:
    """The baseline's forecast for `n_windows` windows: the train-split quantiles, [W, H, Q]."""
    return np.broadcast_to(climatology[None], (n_windows, *climatology.shape))
