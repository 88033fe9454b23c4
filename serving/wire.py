"""Numpy in, numpy out: `make_series` builds a request `Series` from a symbol's latest bars and
`forecast_arrays` reads a `Forecast` as [horizon, quantile] arrays. The caller keeps its own channel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb

PRICE_FIELDS = ("open", "high", "low", "close", "volume")


def make_series(symbol: str, timestamp_ns: ArrayLike, open: ArrayLike, high: ArrayLike, low: ArrayLike,
                close: ArrayLike, volume: ArrayLike, user: Mapping[str, ArrayLike] | None = None,
                packed: bool = True, *, future: Mapping[str, ArrayLike] | None = None,
                labels: Mapping[str, Sequence[str | int] | np.ndarray] | None = None,
                future_labels: Mapping[str, Sequence[str | int] | np.ndarray] | None = None,
                static: Mapping[str, float | str] | None = None,
                contracts: Sequence[str] | np.ndarray | None = None) -> pb.Series:
    """One series of a PredictRequest: GetModelInfo.bars_required bars oldest first, `timestamp_ns` in UTC nanoseconds,
    `user` the model's real user feature columns by name (GetModelInfo.user_feature_columns, fastest in that order),
    packed as one block unless `packed` is False. A model with known, static or categorical user features also takes:
    `future`, each known real column's values for the H future bars; `labels`, each time-varying categorical column's
    labels, one per bar; `future_labels`, each known categorical column's labels for the H future bars; `static`, each
    static column's value (a str goes to static_categorical_features, a number to static_features). Integer labels are
    sent as their decimal text. A futures model (GetModelInfo.roll_rule set) also takes `contracts`: each bar's contract
    name (ESM5), so that the bars may span a roll; the server picks the front contract as training did. Raises
    ValueError naming a column of the wrong shape or type."""
    ts = np.asarray(timestamp_ns)
    if ts.ndim != 1:
        raise ValueError(f"timestamp_ns has shape {ts.shape}; give one value per bar (a 1-D array)")
    if ts.size and not np.issubdtype(ts.dtype, np.integer):
        raise ValueError(f"timestamp_ns has dtype {ts.dtype}; give int64 UTC nanoseconds since the Unix epoch "
                         "(a datetime64 array: .astype('datetime64[ns]').astype('int64'))")
    n = ts.shape[0]
    prices = zip(PRICE_FIELDS, (open, high, low, close, volume), strict=True)
    series = pb.Series(symbol=symbol, timestamp_ns=ts.astype(np.int64).tolist(),
                       **{name: _column(name, values, n).tolist() for name, values in prices})
    _add_covariates(series, n, future or {}, labels or {}, future_labels or {}, static or {})
    if contracts is not None:
        series.contracts.extend(_names("contracts", contracts, n))
    if user is None or len(user) == 0:  # a DataFrame has no truth value
        return series
    names = list(user)
    block = np.array([_column(f"user feature {name!r}", user[name], n) for name in names],
                     dtype="<f8")  # [names, bars]: the wire's row-major order
    if packed:
        series.user_feature_names.extend(names)
        series.user_features_raw = block.tobytes()
    else:
        series.user_features.extend(pb.Column(name=name, values=row.tolist()) for name, row in zip(names, block,
                                                                                                      strict=True))
    return series


def _add_covariates(series: pb.Series, n: int, future: Mapping[str, ArrayLike],
                    labels: Mapping[str, Sequence[str | int] | np.ndarray],
                    future_labels: Mapping[str, Sequence[str | int] | np.ndarray],
                    static: Mapping[str, float | str]) -> None:
    series.future_features.extend(pb.Column(name=name, values=_column(f"future feature {name!r}", v).tolist())
                                  for name, v in future.items())
    series.categorical_features.extend(pb.Labels(name=name, values=_labels(f"labels {name!r}", v, n))
                                       for name, v in labels.items())
    series.future_categorical_features.extend(pb.Labels(name=name, values=_labels(f"future labels {name!r}", v))
                                              for name, v in future_labels.items())
    for name, value in static.items():
        if isinstance(value, str):
            series.static_categorical_features[name] = value
        elif isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool):
            series.static_features[name] = float(value)
        else:
            raise ValueError(f"static feature {name!r} is {value!r}; give a number (a static real) or a str (a "
                             "static categorical's label)")


def _column(name: str, values: ArrayLike, n: int | None = None) -> np.ndarray:
    """float64 [n] (any length when n is None), or ValueError naming the column."""
    try:
        col = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:  # numpy's message names neither the column nor the fix
        raise ValueError(f"{name} is not numeric ({exc}); give numbers, one per bar") from None
    if col.ndim != 1 or (n is not None and col.shape[0] != n):
        raise ValueError(f"{name} has shape {col.shape}" + (f", timestamp_ns has {n} bars; give one value per bar"
                                                            if n is not None else "; give a 1-D array"))
    return col


def _labels(name: str, values: Sequence[str | int] | np.ndarray, n: int | None = None) -> list[str]:
    """Labels as the wire's text: strs as they are, integers as their decimal text; ValueError for others."""
    array = np.asarray(values)
    if array.ndim != 1 or (n is not None and array.shape[0] != n):
        raise ValueError(f"{name} has shape {array.shape}" + (f", timestamp_ns has {n} bars; give one label per bar"
                                                              if n is not None else "; give a 1-D sequence"))
    if bad := [x for x in array.tolist() if not isinstance(x, str | int) or isinstance(x, bool)]:
        raise ValueError(f"{name} holds {bad[0]!r} ({type(bad[0]).__name__}); give labels as str or integers")
    return [str(x) for x in array.tolist()]


def _names(name: str, values: Sequence[str] | np.ndarray, n: int) -> list[str]:
    """One str per bar, or ValueError naming the column."""
    array = np.asarray(values, dtype=object)
    if array.ndim != 1 or array.shape[0] != n:
        raise ValueError(f"{name} has shape {array.shape}, timestamp_ns has {n} bars; give one contract name per bar")
    if bad := [x for x in array.tolist() if not isinstance(x, str) or not x]:
        raise ValueError(f"{name} holds {bad[0]!r}; give each bar's contract name as a str, e.g. 'ESM5'")
    return list(array.tolist())


@dataclass(frozen=True)
class WeightArrays:
    """Variable-selection weights: row per step, column per variable (each row sums to 1)."""

    variables: tuple[str, ...]
    weights: np.ndarray  # float32 [steps, len(variables)]


@dataclass(frozen=True)
class ExplanationArrays:
    """A Forecast's explanation (PredictRequest.explain) as arrays."""

    attention: np.ndarray  # float32 [horizon, encoder_length + horizon]: decoder attention, mean over heads
    attention_timestamp_ns: np.ndarray  # int64 [encoder_length + horizon]: each attention column's bar time
    static: WeightArrays  # steps 1
    encoder: WeightArrays  # steps encoder_length: observed, then known variables
    decoder: WeightArrays  # steps horizon: known variables


@dataclass(frozen=True)
class ForecastArrays:
    """One Forecast as arrays: row h is the h-th next bar, column q the q-th quantile level."""

    symbol: str
    model_version: str
    last_timestamp_ns: int  # the forecast origin: the series' last bar
    last_close: float
    timestamp_ns: np.ndarray  # int64 [horizon]: nominal future bar times
    quantile_levels: np.ndarray  # float64 [n_quantiles], increasing
    log_return: np.ndarray  # float64 [horizon, n_quantiles]: cumulative log return from last_close
    price: np.ndarray  # float64 [horizon, n_quantiles]: in the units of the closes sent
    explanation: ExplanationArrays | None  # set when the request asked for explain

    def quantile(self, level: float) -> int:
        """The column of `level` (e.g. 0.5), or ValueError listing the model's levels."""
        hits = np.flatnonzero(np.isclose(self.quantile_levels, level, rtol=0.0, atol=1e-9))
        if not hits.size:
            raise ValueError(f"quantile {level} is not among the model's levels {self.quantile_levels.tolist()}")
        return int(hits[0])


def forecast_arrays(forecast: pb.Forecast) -> ForecastArrays:
    """A Forecast's repeated fields as [horizon, n_quantiles] arrays (the wire's row-major order)."""
    levels = np.array(forecast.quantile_levels, dtype=np.float64)
    shape = (forecast.horizon, levels.shape[0])
    return ForecastArrays(
        symbol=forecast.symbol, model_version=forecast.model_version,
        last_timestamp_ns=forecast.last_timestamp_ns, last_close=forecast.last_close,
        timestamp_ns=np.array(forecast.timestamp_ns, dtype=np.int64), quantile_levels=levels,
        log_return=np.array(forecast.log_return, dtype=np.float64).reshape(shape),
        price=np.array(forecast.price, dtype=np.float64).reshape(shape),
        explanation=_explanation(forecast.explanation) if forecast.HasField("explanation") else None,
    )


def _explanation(e: pb.Explanation) -> ExplanationArrays:
    return ExplanationArrays(
        attention=np.array(e.attention, dtype=np.float32).reshape(e.attention_rows, e.attention_cols),
        attention_timestamp_ns=np.array(e.attention_timestamp_ns, dtype=np.int64),
        static=_weight_arrays(e.static_weights), encoder=_weight_arrays(e.encoder_weights),
        decoder=_weight_arrays(e.decoder_weights),
    )


def _weight_arrays(w: pb.VariableWeights) -> WeightArrays:
    return WeightArrays(tuple(w.variables),
                        np.array(w.weights, dtype=np.float32).reshape(w.steps, len(w.variables)))
