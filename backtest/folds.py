"""Rolling-origin folds: an expanding training window, then a test span that starts after an embargo.

Fold k trains on every bar before its cut (the trainer takes its own validation split from the end of
those bars) and forecasts the origins of [cut_k, cut_k+1); each series' first `embargo` bars after the cut
are not origins, so a test origin lies at least `embargo` bars after the last training bar, and no
training target (which ends before the cut) overlaps a test target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from features.bars import Bars
from features.compute import FeatureFrame
from features.windows import anchor_rows


class BacktestError(ValueError):
    """Settings or data a backtest cannot run with; the message says what to change."""


@dataclass(frozen=True)
class Fold:
    index: int  # 1-based
    cut_ns: int  # the fold trains on bars before this time and forecasts from it on
    end_ns: int  # test origins lie before this time


def make_folds(timestamp_ns: np.ndarray, folds: int, test_span: float) -> list[Fold]:
    """`folds` test spans of equal numbers of distinct timestamps over the last `test_span` of them."""
    ts = np.unique(timestamp_ns)
    first = int(ts.size * (1.0 - test_span))
    edges = np.linspace(first, ts.size, folds + 1).round().astype(np.int64)
    if first < 1 or np.any(np.diff(edges) < 1):
        raise BacktestError(f"{ts.size} distinct bar times cannot make {folds} test spans over the last "
                            f"{test_span:.0%} of them: give more bars, fewer --folds or a larger --test-span")
    end = [int(ts[e]) if e < ts.size else int(ts[-1]) + 1 for e in edges[1:]]
    return [Fold(k + 1, int(ts[edges[k]]), end[k]) for k in range(folds)]


def cut_rows(frame: FeatureFrame, cut_ns: int) -> np.ndarray:
    """Each series' first row at or after `cut_ns` (its end when none): int64 [S]."""
    return np.array([s + np.searchsorted(frame.timestamp_ns[s:e], cut_ns) for s, e in frame.series_bounds],
                    dtype=np.int64)


def fold_origins(frame: FeatureFrame, fold: Fold, encoder_length: int, embargo: int) -> np.ndarray:
    """Rows from `embargo` bars after each series' cut, before fold.end_ns, with every target in the file: int64 [W]."""
    anchors = anchor_rows(frame, encoder_length, require_targets=True,
                          row_range=(cut_rows(frame, fold.cut_ns) + embargo, frame.series_bounds[:, 1]))
    return anchors[frame.timestamp_ns[anchors] < fold.end_ns]


def bars_before(bars: Bars, cut_ns: int) -> Bars:
    """The rows of `bars` before `cut_ns`, grouped as before."""
    return bars.take(bars.timestamp_ns < cut_ns)
