"""Scores of every forecaster on the backtest's out-of-sample origins, per fold and over all folds.

`backtest_scores` returns (every value a plain number, list or dict, ready for json.dump):

    quantiles: [Q]              the forecast quantile levels
    horizon: H                  steps per forecast
    forecasters: [names]        in the order given; baselines: the names among BASELINES
    folds: {"0": block, ...}    one block per fold, keyed by the fold number
    all: block                  every origin of every fold together

    block:
      origins: W                origins scored (rows per origin and symbol)
      best_baseline: name       the baseline of the lowest pinball_mean in this block (None without baselines)
      series: {symbol: block}   the same figures per series (root), without a `series` of their own; only when
                                backtest_scores is given each origin's series
      forecasters: {name: {
        pinball_mean            mean pinball loss over origins, steps and quantiles
        pinball_by_step [H], pinball_by_quantile [Q], pinball [H][Q]
        q_risk [Q]              2 * sum(pinball) / sum(|y|) per quantile (Lim et al.); None when every y is 0
        q_risk_by_step [H][Q]   the same per step
        coverage [Q]            share of realised returns y below the forecast quantile, a tie counting half
                                (ticked prices make y == 0 common; a zero median is neither above nor below it)
        interval {lower, upper, nominal, coverage}
                                the outer interval [lowest, highest quantile]: levels, nominal width, and the
                                share of y inside it
        pit {nominal [Q+1], observed [Q+1]}
                                shares of y in the bins below, between and above the forecast quantiles
                                (differences of coverage; quantiles do not cross)
        ratio_to {baseline: r, ..., best_baseline: r}, best_baseline: name
                                only for names starting with "model": its pinball_mean over each baseline's,
                                and over the lowest baseline pinball_mean in this block
      }}
    all.fold_mean_ratio_to_best_baseline: {model name: mean over folds of ratio_to.best_baseline}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backtest.baselines import BASELINES
from features.metrics import inside, pinball, quantile_coverage

MAX_SUMMARY_FOLDS = 8  # more folds than this: the summary shows the overall rows only, to stay on one screen
MAX_SUMMARY_SERIES = 16  # more series than this: the per-series table is in the JSON file only
RATIO_WIDTH = len("0.000 ()") + max(len(b) for b in BASELINES)  # a model's ratio cell: "1.042 (seasonal_garch)"


def backtest_scores(forecasts: Mapping[str, np.ndarray], actual: np.ndarray, fold: np.ndarray,
                    quantiles: Sequence[float], series: np.ndarray | None = None) -> dict[str, Any]:
    """Forecasts [W, H, Q] scored against `actual` [W, H] per `fold` [W], over all, and per `series` [W] if given."""
    q = np.asarray(quantiles, dtype=np.float64)
    folds = {str(k): _block(forecasts, actual, fold == k, q, series) for k in np.unique(fold).tolist()}
    every = _block(forecasts, actual, np.ones(actual.shape[0], dtype=bool), q, series)
    every["fold_mean_ratio_to_best_baseline"] = {
        name: float(np.mean([b["forecasters"][name]["ratio_to"]["best_baseline"] for b in folds.values()]))
        for name, s in every["forecasters"].items() if s.get("best_baseline")}
    return {"quantiles": q.tolist(), "horizon": int(actual.shape[1]), "forecasters": list(forecasts),
            "baselines": [b for b in BASELINES if b in forecasts], "folds": folds, "all": every}


def _block(forecasts: Mapping[str, np.ndarray], actual: np.ndarray, rows: np.ndarray, q: np.ndarray,
           series: np.ndarray | None = None) -> dict[str, Any]:
    """The figures of `rows` [W] (bool), and per series among them when `series` [W] is given."""
    y = actual[rows].astype(np.float64)  # [w, H]
    scores = {name: _forecaster_scores(f[rows].astype(np.float64), y, q) for name, f in forecasts.items()}
    baselines = {b: scores[b]["pinball_mean"] for b in BASELINES if b in scores}
    best = min(baselines, key=baselines.__getitem__) if baselines else None
    for name, s in scores.items():
        if name.startswith("model") and best is not None:
            s["ratio_to"] = {b: s["pinball_mean"] / v for b, v in baselines.items()}
            s["ratio_to"]["best_baseline"] = s["pinball_mean"] / baselines[best]
            s["best_baseline"] = best
    block = {"origins": int(rows.sum()), "best_baseline": best, "forecasters": scores}
    if series is not None:
        block["series"] = {str(name): _block(forecasts, actual, rows & (series == name), q)
                           for name in np.unique(series[rows]).tolist()}
    return block


def _forecaster_scores(pred: np.ndarray, y: np.ndarray, q: np.ndarray) -> dict[str, Any]:
    """One forecaster's figures on one block: pred [w, H, Q], y [w, H]."""
    ql = pinball(pred, y, q)  # [w, H, Q]
    abs_by_step = np.abs(y).sum(axis=0)  # [H]
    coverage = quantile_coverage(pred, y)  # [Q]  a tie counting half
    return {
        "pinball_mean": float(ql.mean()),
        "pinball_by_step": ql.mean(axis=(0, 2)).tolist(),
        "pinball_by_quantile": ql.mean(axis=(0, 1)).tolist(),
        "pinball": ql.mean(axis=0).tolist(),
        "q_risk": _q_risk(ql.sum(axis=(0, 1)), float(abs_by_step.sum())),
        "q_risk_by_step": [_q_risk(s, float(a)) for s, a in zip(ql.sum(axis=0), abs_by_step, strict=True)],
        "coverage": coverage.tolist(),
        "interval": {"lower": float(q[0]), "upper": float(q[-1]), "nominal": float(q[-1] - q[0]),
                     "coverage": float(inside(pred, y).mean())},
        "pit": {"nominal": np.diff(q, prepend=0.0, append=1.0).tolist(),
                "observed": np.diff(coverage, prepend=0.0, append=1.0).tolist()},
    }


def _q_risk(pinball_sum: np.ndarray, abs_sum: float) -> list[float | None]:
    """2 * sum(pinball) / sum(|y|) per quantile; None when every y is 0."""
    return [2.0 * float(v) / abs_sum if abs_sum > 0 else None for v in pinball_sum]


def summary_lines(scores: dict[str, Any]) -> list[str]:
    """A one-screen summary: each forecaster's mean pinball per fold and overall, then for each model its ratio
    to the best baseline, the outer interval's coverage and the P50's (when 0.5 is a quantile); then, with the
    per-series scores, each series' best baseline over all folds and each model's ratio to it."""
    q = scores["quantiles"]
    blocks = dict(scores["folds"]) if len(scores["folds"]) <= MAX_SUMMARY_FOLDS else {}
    blocks["all"] = scores["all"]
    lines = [f"backtest: {len(scores['folds'])} folds, {scores['all']['origins']} origins, "
             f"horizon {scores['horizon']}, quantiles {' '.join(f'{x:g}' for x in q)}"]
    if len(scores["folds"]) > MAX_SUMMARY_FOLDS:
        lines.append(f"(per-fold figures: over {MAX_SUMMARY_FOLDS} folds, see the JSON file)")
    lines += _pinball_table(blocks, scores["forecasters"])
    models = [n for n in scores["forecasters"] if n.startswith("model")]
    lines += _model_table(blocks, models, q) if models else []
    if fold_mean := scores["all"]["fold_mean_ratio_to_best_baseline"]:
        lines.append("mean over folds of the ratio to the best baseline: "
                     + ", ".join(f"{m} {r:.3f}" for m, r in fold_mean.items()))
    if "series" in scores["all"]:
        lines += _series_table(scores["all"]["series"], models)
    return lines


def _pinball_table(blocks: dict[str, Any], names: list[str]) -> list[str]:
    widths = [max(len(n), 11) for n in names]
    head = f"{'fold':>4} {'origins':>8}  " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))
    rows = [f"{k:>4} {b['origins']:>8}  " + " ".join(f"{b['forecasters'][n]['pinball_mean']:>{w}.4e}"
                                                     for n, w in zip(names, widths, strict=True))
            for k, b in blocks.items()]
    return ["mean pinball loss (lower is better)", head, *rows]


def _model_table(blocks: dict[str, Any], models: list[str], q: list[float]) -> list[str]:
    p50 = q.index(0.5) if 0.5 in q else None
    outer = f"P{q[0] * 100:g}-P{q[-1] * 100:g}"
    cols = f"{'/ best baseline':>{RATIO_WIDTH}} {outer + ' cov':>12}" + (f" {'P50 cov':>8}" if p50 is not None else "")
    width = len(cols)
    head1 = (f"{'':>4}  " + " | ".join(f"{m[:width]:^{width}}" for m in models)).rstrip()
    head2 = f"{'fold':>4}  " + " | ".join(cols for _ in models)
    rows = [f"{k:>4}  " + " | ".join(_model_cells(b["forecasters"][m], p50) for m in models)
            for k, b in blocks.items()]
    return [f"model: mean pinball / the best baseline's; {outer} coverage (nominal {(q[-1] - q[0]) * 100:g}%)",
            head1, head2, *rows]


def _series_table(blocks: dict[str, Any], models: list[str]) -> list[str]:
    """Per series over all folds: origins, the best baseline and its mean pinball, each model's ratio to it."""
    if len(blocks) > MAX_SUMMARY_SERIES:
        return [f"(per-series figures: over {MAX_SUMMARY_SERIES} series, see the JSON file)"]
    width = max(len(b) for b in BASELINES)
    head = f"{'series':<8} {'origins':>8}  {'best baseline':<{width}} {'pinball':>11}" + "".join(
        f" {m[:18]:>18}" for m in models)
    rows = []
    for name, b in blocks.items():
        best = b["best_baseline"]
        pinball = f"{b['forecasters'][best]['pinball_mean']:>11.4e}" if best else f"{'n/a':>11}"
        rows.append(f"{name[:8]:<8} {b['origins']:>8}  {best or 'n/a':<{width}} {pinball}" + "".join(
            f" {b['forecasters'][m]['ratio_to']['best_baseline'] if best else float('nan'):>18.3f}" for m in models))
    return ["per series, all folds: the best baseline, its mean pinball, each model's over it", head, *rows]


def _model_cells(s: dict[str, Any], p50: int | None) -> str:
    ratio = f"{s['ratio_to']['best_baseline']:.3f} ({s['best_baseline']})" if "ratio_to" in s else "n/a"
    cells = f"{ratio:>{RATIO_WIDTH}} {s['interval']['coverage'] * 100:>11.1f}%"
    return cells + (f" {s['coverage'][p50] * 100:>7.1f}%" if p50 is not None else "")
