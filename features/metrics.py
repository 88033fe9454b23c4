"""Forecast quality: pinball loss and q-risk per quantile, each quantile's coverage and the outer interval's. Every
command that scores forecasts (the trainer's report, export's calibration, serving.score, the backtest) counts
coverage by these functions."""

from __future__ import annotations

import numpy as np


def pinball(pred: np.ndarray, target: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
    """Per-window, per-step, per-quantile pinball loss; pred [W, H, Q], target [W, H] -> [W, H, Q]."""
    err = target[..., None] - pred  # [W, H, Q]
    return np.maximum(quantiles * err, (quantiles - 1.0) * err)


def below(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Whether each target lies below each forecast quantile, a tie counting half: ticked prices make a target equal
    to a quantile common (a zero return at a zero median is neither above nor below it). pred [W, H, Q], target
    [W, H] -> float64 [W, H, Q] of 0, 0.5 and 1."""
    return (target[..., None] < pred) + 0.5 * (target[..., None] == pred)


def quantile_coverage(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The share of targets below each forecast quantile (`below`), float64 [Q]: its level, when calibrated."""
    return below(pred, target).mean(axis=(0, 1))


def inside(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Whether each target lies in the outer interval [lowest, highest quantile], bounds included: bool [W, H]."""
    return (target >= pred[..., 0]) & (target <= pred[..., -1])


def forecast_metrics(pred: np.ndarray, target: np.ndarray, quantiles: tuple[float, ...]) -> dict[str, object]:
    """Mean pinball loss, q-risk (2 sum QL / sum |y|; None when every target is 0) per quantile, and the share
    of targets inside [lowest, highest] quantile."""
    q = np.asarray(quantiles, dtype=np.float64)
    ql = pinball(pred.astype(np.float64), target.astype(np.float64), q)  # [W, H, Q]
    denom = float(np.abs(target).sum())
    return {"pinball": {f"{x:g}": float(v) for x, v in zip(quantiles, ql.mean(axis=(0, 1)), strict=True)},
            "pinball_mean": float(ql.mean()),
            "q_risk": {f"{x:g}": float(2.0 * v / denom) if denom > 0 else None
                       for x, v in zip(quantiles, ql.sum(axis=(0, 1)), strict=True)},
            "coverage": float(inside(pred, target).mean()), "nominal_coverage": float(quantiles[-1] - quantiles[0])}


def climatology_forecast(climatology: np.ndarray, n_windows: int) -> np.ndarray:
    """The baseline's forecast for `n_windows` windows: the train-split quantiles, [W, H, Q]."""
    return np.broadcast_to(climatology[None], (n_windows, *climatology.shape))


def format_q_risk(model: dict[str, float | None], baseline: dict[str, float | None]) -> str:
    """`q0.1=0.1234/0.2345 ...` (model/baseline), `n/a` where q-risk is undefined (every target 0)."""
    def show(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    return " ".join(f"q{q}={show(model[q])}/{show(baseline[q])}" for q in model)
