"""The backtest's picture: calibration and skill of every forecaster, from the scores in `backtest.scores`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer.report import write_panels


def write_figure(path: Path, scores: dict[str, Any]) -> None:
    """Four panels, over all folds unless named: reliability, q-risk per step, models' ratio per fold, PIT histogram."""
    write_panels(path, (_reliability, _q_risk_by_step, _fold_ratios, _pit), scores)


def _reliability(ax: Any, scores: dict[str, Any]) -> None:
    q = scores["quantiles"]
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    for name, s in scores["all"]["forecasters"].items():
        ax.plot(q, s["coverage"], "o-", label=name)
    ax.set(title="reliability: share of realised returns below each quantile", xlabel="quantile level",
           ylabel="observed share", xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left")


def _q_risk_by_step(ax: Any, scores: dict[str, Any]) -> None:
    steps = np.arange(1, scores["horizon"] + 1)
    for name, s in scores["all"]["forecasters"].items():
        by_step = np.array(s["q_risk_by_step"], dtype=np.float64)  # [H, Q], NaN where q-risk is undefined
        ax.plot(steps, by_step.mean(axis=1), "o-", label=name)
    ax.set(title="q-risk per horizon step, mean over quantiles (lower is better)", xlabel="step (bars ahead)",
           ylabel="2 Σ pinball / Σ |y|")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()


def _fold_ratios(ax: Any, scores: dict[str, Any]) -> None:
    folds = list(scores["folds"])
    models = [n for n, s in scores["all"]["forecasters"].items() if "ratio_to" in s]
    for name in models:
        ratios = [scores["folds"][k]["forecasters"][name]["ratio_to"]["best_baseline"] for k in folds]
        ax.plot([int(k) for k in folds], ratios, "o-", label=name)
    ax.set_xticks([int(k) for k in folds])
    ax.axhline(1.0, color="grey", ls="--", label="best baseline")
    ax.set(title="mean pinball / the fold's best baseline (below 1: the model wins)", xlabel="fold", ylabel="ratio")
    ax.legend()


def _pit(ax: Any, scores: dict[str, Any]) -> None:
    q = scores["quantiles"]
    edges = np.array([0.0, *q, 1.0])  # the Q + 1 bins between quantile levels
    for name, s in scores["all"]["forecasters"].items():
        density = np.array(s["pit"]["observed"]) / np.diff(edges)  # 1 everywhere when calibrated
        ax.stairs(density, edges, label=name)
    ax.axhline(1.0, color="grey", ls="--", label="calibrated")
    ax.set(title="PIT histogram: observed share / nominal share per bin between quantiles",
           xlabel="quantile level", ylabel="density", xlim=(0, 1))
    ax.legend()
