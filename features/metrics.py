"""Forecast quality: pinball loss and q-risk per quantile, and coverage of the outer interval."""

from __future__ import annotations

import numpy as np


def pinball(pred: np.ndarray, target: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
    """Per-window, per-step, per-quantile pinball loss; pred [W, H, Q], target [W, H] -> [W, H, Q]."""
    err = target[..., None] - pred  # [W, H, Q]
    return np.maximum(quantiles * err, (quantiles - 1.0) * err)


def forecast_metrics(pred: np.ndarray, target: np.ndarray, quantiles: tuple[float, ...]) -> dict[str, object]:
    """Mean pinball loss, q-risk (2 sum QL / sum |y|; None when every target is 0) per quantile, and the share
    of targets inside [lowest, highest] quantile."""
    q = np.asarray(quantiles, dtype=np.float64)
    ql = pinball(pred.astype(np.float64), target.astype(np.float64), q)  # [W, H, Q]
    denom = float(np.abs(target).sum())
    inside = (target >= pred[..., 0]) & (target <= pred[..., -1])
    return {
        "pinball": {f"{x:g}": float(v) for x, v in zip(quantiles, ql.mean(axis=(0, 1)), strict=True)},
        "pinball_mean": float(ql.mean()),
        "q_risk": {f"{x:g}": float(2.0 * v / denom) if denom > 0 else None
                   for x, v in zip(quantiles, ql.sum(axis=(0, 1)), strict=True)},
        "coverage": float(inside.mean()),
        "nominal_coverage": float(quantiles[-1] - quantiles[0]),
    }


def climatology_forecast(climatology: np.ndarray, n_windows: int) -> np.ndarray:
    """The baseline's forecast for `n_windows` windows: the train-split quantiles, [W, H, Q]."""
    return np.broadcast_to(climatology[None], (n_windows, *climatology.shape))


def format_q_risk(model: dict[str, float | None], baseline: dict[str, float | None]) -> str:
    """`q0.1=0.1234/0.2345 ...` (model/baseline), `n/a` where q-risk is undefined (every target 0)."""
    def show(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    return " ".join(f"q{q}={show(model[q])}/{show(baseline[q])}" for q in model)
