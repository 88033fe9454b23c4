"""Bars -> feature arrays, vectorised in numpy, with no look-ahead.

A feature at bar t uses bars <= t only; only the targets (forward log returns) and the calendar
features (timestamps alone) look forward. Rows in a series' warm-up have NaN observed features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from features.bars import Bars, block_for
from features.calendar import infer_bar_interval_ns
from features.categories import encode, fit_vocabulary
from features.config import BUILTIN_KNOWN, FeatureConfig
from features.known import builtin_known, future_known, future_times
from features.schema import FeatureSchema
from features.sessions import learn_hours


@dataclass
class FeatureFrame:
    """Feature arrays of all series, concatenated; rows of one series are contiguous."""

    config: FeatureConfig
    symbols: list[str]  # vocabulary: symbol id i is symbols[i]
    timestamp_ns: np.ndarray  # int64   [N]
    series_id: np.ndarray  # int64   [N]     index into `symbols`
    series_bounds: np.ndarray  # int64   [S, 2]  [start, end) rows of each series present
    observed: np.ndarray  # float32 [N, n_observed]   NaN during warm-up; categorical columns hold ids
    known: np.ndarray  # float32 [N, n_known]         calendar, then user known reals and ids
    close: np.ndarray  # float64 [N]
    targets: np.ndarray  # float32 [N, H]   NaN where t + h is past the series end
    bar_interval_ns: int  # most common spacing of consecutive bars
    static_ids: np.ndarray | None = None  # int64 [N, n_static_categorical_user]  constant per series
    static_real: np.ndarray | None = None  # float32 [N, n_static_real]  constant per series
    unseen: dict[str, np.ndarray] = field(default_factory=dict)  # categorical column -> bool [N] label unseen

    @property
    def schema(self) -> FeatureSchema:
        return self.config.schema()

    def __len__(self) -> int:
        return int(self.timestamp_ns.shape[0])

    @property
    def user_known(self) -> np.ndarray:
        """float32 [N, n_known_user]: the user known variables, after the built-in known features."""
        return self.known[:, len(BUILTIN_KNOWN) + len(self.config.contract_known):]


_SMALL_ROLLING_CELLS = 3072  # up to this many [rows, window] cells the rolling std runs as whole-matrix steps


def _rolling_std(x: np.ndarray, window: int, starts: np.ndarray) -> np.ndarray:
    """Population std of the last `window` values at each row; NaN until `window` values exist in the series
    (`starts[i]`: row i's first defined row). Two passes, summed oldest first: each value depends on its window
    alone, bit for bit, so a server's few bars get what training computed. Both paths sum alike."""
    n = x.shape[0]
    ok = np.arange(n) - window + 1 >= starts
    padded = np.concatenate([np.zeros(window - 1), np.where(np.isnan(x), 0.0, x)])  # padded[i + window - 1] = x[i]
    if n * window <= _SMALL_ROLLING_CELLS:
        step = padded.strides[0]
        # cells[i, k] = padded[i + k]: sliding_window_view's view, built directly
        cells = np.ndarray((n, window), padded.dtype, padded, 0, (step, step))  # [n, window]
        cells.flags.writeable = False
        mean = np.add.accumulate(cells, axis=1)[:, -1] / window  # [n]
        dev = cells - mean[:, None]  # [n, window]
        np.multiply(dev, dev, out=dev)
        var = np.add.accumulate(dev, axis=1)[:, -1] / window  # [n]
        return np.where(ok, np.sqrt(var), np.nan)
    mean = np.zeros(n)
    for k in range(window):
        mean += padded[k : k + n]
    mean /= window
    var = np.zeros(n)
    dev = np.empty(n)
    for k in range(window):
        np.subtract(padded[k : k + n], mean, out=dev)
        np.multiply(dev, dev, out=dev)
        var += dev
    var /= window
    return np.where(ok, np.sqrt(var), np.nan)


ROWS_PER_BLOCK = 1 << 16  # rows of observed features converted at a time (a training set's history)


def _observed(o: np.ndarray, h: np.ndarray, lo: np.ndarray, c: np.ndarray, v: np.ndarray,
              user: np.ndarray | list[np.ndarray], config: FeatureConfig, starts: np.ndarray, first_row: np.ndarray,
              log_c: np.ndarray) -> np.ndarray:
    """Observed features of bars grouped by series, float32 [N, n_observed], NaN in each warm-up; for training
    and serving. `user`: a float64 [n_user, N] block or [N] columns; `starts` [S], `first_row` [N]."""
    n = c.shape[0]
    log_return = np.full(n, np.nan)
    log_return[1:] = log_c[1:] - log_c[:-1]
    log_return[starts] = np.nan  # no return across a series boundary
    vol = _rolling_std(log_return, config.volatility_window, first_row + 1)
    cols = [log_return, np.log(h / lo), np.log(c / o), np.log1p(v), vol]
    observed = np.empty((n, len(cols) + len(user)), dtype=np.float32)  # [N, n_observed]
    if isinstance(user, list):  # a block of rows at a time: no whole [n_observed, N] float64 copy
        for r in range(0, n, ROWS_PER_BLOCK):
            observed[r:r + ROWS_PER_BLOCK] = np.array([x[r:r + ROWS_PER_BLOCK] for x in cols + user], np.float32).T
    else:
        observed[:, :len(cols)] = np.array(cols, dtype=np.float32).T
        observed[:, len(cols):] = user.T
    warm = np.arange(n) - first_row < config.warmup_bars
    observed[warm] = np.nan
    return observed


@dataclass(frozen=True)
class LatestWindows:
    """Model inputs of the window ending at each series' last bar (B series), and its future bar times."""

    encoder_observed: np.ndarray  # float32 [B, L, n_observed]
    encoder_known: np.ndarray  # float32 [B, L, n_known]
    decoder_known: np.ndarray  # float32 [B, H, n_known]
    future_timestamp_ns: np.ndarray  # int64 [B, H]


def latest_windows(timestamp_ns: np.ndarray, open_: np.ndarray, high: np.ndarray, low: np.ndarray, close: np.ndarray,
                   volume: np.ndarray, user: np.ndarray | list[np.ndarray], config: FeatureConfig,
                   encoder_length: int, bar_interval_ns: int, known: np.ndarray | None = None,
                   future_user: np.ndarray | None = None, log_offset: np.ndarray | None = None,
                   roots: Sequence[str] | None = None) -> LatestWindows:
    """The window at the last bar of each of B series of n bars ([B, n] columns, oldest first): what a server
    forecasts from. `user`: the observed user variables (config.observed_user; categoricals as ids) as a
    [n_user, B * n] block or [B * n] columns; `known` float32 [B, n, n_known_user] and `future_user`
    [B, H, n_known_user]: the known user variables of the bars and of the H future bars (config.known_user);
    `log_offset` [B, n]: a continuous series' roll offsets (`features.rolls`), added to log(close); `roots` [B]:
    each series' root, for a `calendar:N` model's contract features (config.contract_known).
    Bit for bit what `build_frame` + `gather_windows` give there once n >= warm-up + L."""
    b, n = close.shape
    L = encoder_length
    if n < config.warmup_bars + L:
        raise ValueError(f"{n} bars per series; the windows need at least {config.warmup_bars + L} "
                         f"({config.warmup_bars} warm-up + {L} encoder bars)")
    starts = np.arange(b, dtype=np.int64) * n  # [B]  first row of each series
    first_row = np.repeat(starts, n)  # [B * n]
    c = close.reshape(-1)
    log_c = np.log(c) if log_offset is None else np.log(c) + log_offset.reshape(-1)
    observed = _observed(open_.reshape(-1), high.reshape(-1), low.reshape(-1), c, volume.reshape(-1), user, config,
                         starts, first_row, log_c)  # [B * n, n_observed]
    root = None if roots is None else np.asarray(roots, dtype=str)  # [B]
    encoder_known = builtin_known(timestamp_ns[:, n - L:], None if root is None else root[:, None], config)
    if config.known_columns:  # [B, L, n_known]
        assert known is not None and future_user is not None
        encoder_known = np.concatenate([encoder_known, known[:, n - L:]], axis=-1, dtype=np.float32)
    return LatestWindows(
        encoder_observed=np.ascontiguousarray(observed.reshape(b, n, -1)[:, n - L:]), encoder_known=encoder_known,
        decoder_known=future_known(timestamp_ns[:, -1], config, bar_interval_ns, root, future_user),
        future_timestamp_ns=future_times(timestamp_ns[:, -1], config, bar_interval_ns, root))


def build_frame(bars: Bars, config: FeatureConfig, symbols: list[str] | None = None,
                bar_interval_ns: int | None = None, targets: bool = True) -> FeatureFrame:
    """Every feature array of validated `bars`; `symbols` and `bar_interval_ns` fix the trained model's vocabulary
    and bar spacing; `targets=False` leaves the forward returns NaN. ValueError names a static column that varies."""
    slices = bars.series_slices()
    vocab = list(symbols) if symbols is not None else sorted(slices)
    unknown = [s for s in slices if s not in vocab]
    if unknown:
        raise ValueError(f"unknown symbol(s) {', '.join(unknown)}; the model knows {', '.join(vocab)}")
    n = len(bars)
    bounds = bars.series_bounds()
    check_static(bars, config, bounds)
    series_id = np.repeat(np.array([vocab.index(name) for name in slices], dtype=np.int64), bounds[:, 1] - bounds[:, 0])
    first_row = np.repeat(bounds[:, 0], bounds[:, 1] - bounds[:, 0])  # [N]
    log_c = np.log(bars.close) if bars.log_offset is None else np.log(bars.close) + bars.log_offset
    ids, unseen = encode_labels({name: bars.labels[name] for name in config.categorical_columns}, config)
    user_block = None if config.categorical_columns else block_for(bars.user, config.user_columns)  # [n_user, N]
    user = user_block if user_block is not None else [column(bars, ids, u) for u in config.observed_user]
    observed = _observed(bars.open, bars.high, bars.low, bars.close, bars.volume, user, config, bounds[:, 0],
                         first_row, log_c)
    forward = _forward_returns(log_c, bounds, config.horizon) if targets else \
        np.full((n, config.horizon), np.nan, dtype=np.float32)
    known = builtin_known(bars.timestamp_ns, bars.symbol, config)  # [N, 4], a calendar roll's [N, 6]
    if config.known_columns:
        known = np.concatenate([known, np.stack([column(bars, ids, u) for u in config.known_user], axis=1)],
                               axis=1, dtype=np.float32)  # [N, n_known]
    return FeatureFrame(
        config=config, symbols=vocab, timestamp_ns=bars.timestamp_ns.astype(np.int64), series_id=series_id,
        series_bounds=bounds, observed=observed, known=known, close=bars.close.astype(np.float64), targets=forward,
        bar_interval_ns=bar_interval_ns or infer_bar_interval_ns(bars.timestamp_ns, bounds),
        static_ids=np.stack([ids[u] for u in config.static_categoricals], axis=1) if config.static_categoricals
        else None,  # [N, n_static_categorical_user]
        static_real=np.stack([bars.user[u] for u in config.static_reals], axis=1).astype(np.float32)
        if config.static_reals else None,  # [N, n_static_real]
        unseen=unseen)


def column(bars: Bars, ids: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A user column as float64 [N]: its values, or a categorical's ids."""
    return ids[name].astype(np.float64) if name in ids else np.asarray(bars.user[name], dtype=np.float64)


def encode_labels(labels: Mapping[str, np.ndarray], config: FeatureConfig
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The ids (int64, each column's shape) of each categorical column in `labels` (training's bars, or a request's
    series) in its vocabulary, and where its label is unseen (bool, same shape): one encoding for both."""
    coded = {name: encode(values, config.vocabulary(name)) for name, values in labels.items()}
    return {name: ids for name, (ids, _) in coded.items()}, {name: new for name, (_, new) in coded.items()}


def with_trading_hours(config: FeatureConfig, bars: Bars, before_ns: int) -> FeatureConfig:
    """`config` with each series' trading hours (features.sessions.learn_hours) learnt from its bars before
    `before_ns` (the training split); a series whose hours are every time of the week has none."""
    slices = bars.series_slices()
    interval = infer_bar_interval_ns(bars.timestamp_ns, bars.series_bounds())
    learnt = ((name, learn_hours(ts[ts < before_ns], interval, config.calendar_tz))
              for name, ts in ((name, bars.timestamp_ns[sl]) for name, sl in slices.items()))
    return replace(config, trading_hours=tuple((name, hours) for name, hours in learnt if hours))


def with_vocabularies(config: FeatureConfig, bars: Bars, before_ns: int) -> FeatureConfig:
    """`config` with each categorical column's vocabulary fitted on the bars before `before_ns` (the training
    split); unchanged when it has no categorical column."""
    if not config.categorical_columns:
        return config
    rows = bars.timestamp_ns < before_ns
    fitted = tuple((name, fit_vocabulary(np.asarray(bars.labels[name])[rows])) for name in config.categorical_columns)
    return replace(config, vocabularies=fitted)


def check_static(bars: Bars, config: FeatureConfig, bounds: np.ndarray) -> None:
    """ValueError naming a static user column whose value changes within a series, and where."""
    for name in config.static_columns:
        values = np.asarray(bars.labels[name] if name in config.categorical_columns else bars.user[name])
        for s, e in bounds:
            same = values[s:e] == values[s]
            if name not in config.categorical_columns:
                same |= np.isnan(values[s:e]) & np.isnan(values[s])  # NaN is the values' check's to name
            if (moved := np.flatnonzero(~same)).size:
                row = int(s + moved[0])
                first, then = values[s:s + 1].tolist()[0], values[row:row + 1].tolist()[0]
                when = str(np.datetime64(int(bars.timestamp_ns[row]), "ns"))[:19].replace("T", " ")
                raise ValueError(f"static feature {name!r} varies within series {bars.symbol[s]} ({first!r} at "
                                 f"its first bar, {then!r} at {when} UTC): a static feature holds one value per "
                                 "series; give a changing column with --known-features or --features instead")


def _forward_returns(log_c: np.ndarray, bounds: np.ndarray, horizon: int) -> np.ndarray:
    """log(close[t+h] / close[t]) for h = 1..horizon, NaN past each series' end: float32 [N, H]."""
    n = log_c.shape[0]
    forward = np.full((n, horizon), np.nan, dtype=np.float32)  # [N, H]
    last_row = np.repeat(bounds[:, 1], bounds[:, 1] - bounds[:, 0]) - 1
    rows = np.arange(n)
    for k in range(1, horizon + 1):
        ok = rows + k <= last_row
        forward[ok, k - 1] = (log_c[rows[ok] + k] - log_c[rows[ok]]).astype(np.float32)
    return forward
