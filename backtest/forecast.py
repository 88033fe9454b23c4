"""A fold's forecasts at its origins: the exported model through ONNX Runtime, and the baselines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from backtest.baselines import BarClock, baseline_forecasts, baseline_names, trading_days
from features.compute import FeatureFrame
from features.schema import QUANTILES
from features.windows import model_inputs
from serving.model import LoadedModel

BATCH = 1024  # windows per ONNX Runtime run


def model_forecasts(model: LoadedModel, frame: FeatureFrame, anchors: np.ndarray) -> np.ndarray:
    """The model's quantiles at `anchors`, the windows built as serving.score builds them: [W, H, Q]."""
    parts = [model.run(model_inputs(frame, chunk, model.meta.encoder_length))[QUANTILES]
             for chunk in np.split(anchors, range(BATCH, anchors.size, BATCH))]
    return np.concatenate(parts).astype(np.float64)


def baselines_at(frame: FeatureFrame, anchors: np.ndarray, cuts: np.ndarray, quantiles: Sequence[float],
                 window: int) -> dict[str, np.ndarray]:
    """Each baseline of the frame's bars (`frame_baselines`) at `anchors` (grouped by series, as fold_origins gives
    them), fitted per series on its rows before `cuts` [S], on the closes its targets are made of: name -> [W, H, Q]."""
    names = frame_baselines(frame)
    parts: dict[str, list[np.ndarray]] = {}
    for i, (s, e) in enumerate(frame.series_bounds):
        here = anchors[(anchors >= s) & (anchors < e)]
        if here.size == 0:
            continue
        symbol = frame.symbols[int(frame.series_id[s])]
        clock = BarClock(frame.timestamp_ns[s:e], frame.bar_interval_ns, frame.config.calendar_tz)
        got = baseline_forecasts(target_close(frame, s, e), int(cuts[i] - s), here - s, frame.config.horizon,
                                 quantiles, window, series=symbol, clock=clock, names=names)
        for name, values in got.items():
            parts.setdefault(name, []).append(values)
    return {name: np.concatenate(values) for name, values in parts.items()}


def frame_baselines(frame: FeatureFrame) -> tuple[str, ...]:
    """The baselines of the frame's bar interval and horizon, one set for every series (the fold's forecasts are
    one table): the bars per trading day is the median over every series' days."""
    tz = frame.config.calendar_tz
    per_day = np.concatenate([np.bincount(trading_days(frame.timestamp_ns[s:e], tz)) for s, e in frame.series_bounds])
    return baseline_names(frame.bar_interval_ns, frame.config.horizon, float(np.median(per_day)))


def target_close(frame: FeatureFrame, s: int, e: int) -> np.ndarray:
    """The closes of series rows [s, e) whose log returns are its 1-bar targets: roll-adjusted for a continuous
    futures series (no return spans a roll's price gap), the first close as read. float64 [e - s]."""
    steps = frame.targets[s:e - 1, 0].astype(np.float64)  # [n - 1], row t: log(close[t + 1] / close[t])
    return frame.close[s] * np.exp(np.concatenate([[0.0], np.cumsum(steps)]))


def column(name: str, h: int, q: float) -> str:
    """The forecasts file's column of forecaster `name`, step h (1-based), quantile q."""
    return f"{name}_h{h}_q{q:g}"


def fold_table(fold: int, frame: FeatureFrame, anchors: np.ndarray, forecasts: Mapping[str, np.ndarray],
               quantiles: Sequence[float]) -> pa.Table:
    """A row per origin and symbol: fold, symbol, origin, close, forecasts (`column`), realised returns actual_hH."""
    horizon = frame.config.horizon
    return pa.table({
        "fold": pa.array(np.full(anchors.size, fold, dtype=np.int16)),
        "symbol": pa.array(np.asarray(frame.symbols, dtype=object)[frame.series_id[anchors]], type=pa.string()),
        "origin": pa.array(frame.timestamp_ns[anchors], type=pa.timestamp("ns", tz="UTC")),
        "close": pa.array(frame.close[anchors]),
        **{column(name, h + 1, q): pa.array(values[:, h, j])
           for name, values in forecasts.items() for h in range(horizon) for j, q in enumerate(quantiles)},
        **{f"actual_h{h + 1}": pa.array(frame.targets[anchors, h].astype(np.float64)) for h in range(horizon)},
    })


def table_arrays(table: pa.Table, names: Sequence[str], horizon: int, quantiles: Sequence[float]
                 ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """fold_table's columns back as arrays: forecasts name -> [W, H, Q] for each of `names` in the table (a
    baseline the bars have no use for is not), actual [W, H], fold [W]."""
    def grid(name: str) -> np.ndarray:
        return np.stack([np.stack([table.column(column(name, h, q)).to_numpy() for q in quantiles], axis=-1)
                         for h in range(1, horizon + 1)], axis=1)

    actual = np.stack([table.column(f"actual_h{h}").to_numpy() for h in range(1, horizon + 1)], axis=1)
    present = [name for name in names if column(name, 1, quantiles[0]) in table.column_names]
    return {name: grid(name) for name in present}, actual, table.column("fold").to_numpy().astype(np.int64)
