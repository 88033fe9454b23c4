"""Bars -> feature arrays, vectorised in numpy, with no look-ahead.

A feature at bar t uses bars <= t only; only the targets (forward log returns) and the calendar
features (timestamps alone) look forward. Rows in a series' warm-up have NaN observed features.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import numpy as np

from features.bars import Bars, block_for
from features.schema import FeatureSchema, FeatureSpec, Kind, Role

NS_PER_SECOND = 1_000_000_000
NS_PER_DAY = 86_400 * NS_PER_SECOND
COARSE_INTERVALS = 20  # bars mostly this many intervals (and a day) apart are daily bars
INTERVAL_TOLERANCE_PARTS = 100  # off a grid, spacings within 1/100 of the one before run together
SNAP_PARTS = 40  # spacings within 1/40 of the commonest are its neighbours; a round duration this near snaps

BUILTIN_OBSERVED: tuple[str, ...] = ("log_return", "log_range", "log_body", "log_volume", "volatility")
BUILTIN_KNOWN: tuple[str, ...] = ("tod_sin", "tod_cos", "dow_sin", "dow_cos")
STATIC_SYMBOL = "symbol"


@dataclass(frozen=True)
class FeatureConfig:
    """How bars become features; saved with every checkpoint and model."""

    horizon: int = 5  # forecast steps H: targets are log(close[t+h]/close[t]) for h = 1..H
    volatility_window: int = 20  # bars in the rolling standard deviation of log returns
    user_columns: tuple[str, ...] = ()  # extra numeric parquet columns used as observed features
    calendar_tz: str = "UTC"  # IANA time zone of the calendar features (time of day, day of week)

    def __post_init__(self) -> None:
        if self.horizon < 1 or self.volatility_window < 1:
            raise ValueError(f"horizon ({self.horizon}) and volatility_window ({self.volatility_window}) "
                             "must be at least 1")
        check_time_zone(self.calendar_tz)

    @property
    def warmup_bars(self) -> int:
        return self.volatility_window

    def schema(self) -> FeatureSchema:
        return _schema(self.user_columns)

    def to_dict(self) -> dict[str, Any]:
        return {"horizon": self.horizon, "volatility_window": self.volatility_window,
                "user_columns": list(self.user_columns), "calendar_tz": self.calendar_tz}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FeatureConfig:
        return FeatureConfig(int(d["horizon"]), int(d["volatility_window"]), tuple(d["user_columns"]),
                             str(d["calendar_tz"]))


@dataclass
class FeatureFrame:
    """Feature arrays of all series, concatenated; rows of one series are contiguous."""

    config: FeatureConfig
    symbols: list[str]  # vocabulary: symbol id i is symbols[i]
    timestamp_ns: np.ndarray  # int64   [N]
    series_id: np.ndarray  # int64   [N]     index into `symbols`
    series_bounds: np.ndarray  # int64   [S, 2]  [start, end) rows of each series present
    observed: np.ndarray  # float32 [N, n_observed]   NaN during warm-up
    known: np.ndarray  # float32 [N, n_known]
    close: np.ndarray  # float64 [N]
    targets: np.ndarray  # float32 [N, H]   NaN where t + h is past the series end
    bar_interval_ns: int  # most common spacing of consecutive bars
    schema: FeatureSchema = field(init=False)

    def __post_init__(self) -> None:
        self.schema = self.config.schema()

    def __len__(self) -> int:
        return int(self.timestamp_ns.shape[0])


def infer_bar_interval_ns(timestamp_ns: np.ndarray, series_bounds: np.ndarray) -> int:
    """The most common spacing of consecutive bars of a series (0 when none), when it recurs (2% of spacings)
    and is most of those within 2.5% of it; else the bars are off their grid: `_off_grid_interval`."""
    diffs = [np.diff(timestamp_ns[s:e]) for s, e in series_bounds if e - s > 1]
    if not diffs:
        return 0
    d = np.concatenate(diffs)
    d = np.sort(d[d > 0])
    if d.size == 0:
        return 0
    first = np.concatenate([[0], np.flatnonzero(d[1:] != d[:-1]) + 1])  # each distinct spacing's first place
    values, counts = d[first], np.diff(np.append(first, d.size))
    common = int(np.argmax(counts))  # the first of equals: the shortest spacing
    v = int(values[common])
    near = np.searchsorted(d, v + v // SNAP_PARTS, "right") - np.searchsorted(d, v - v // SNAP_PARTS, "left")
    if counts[common] >= min(2, d.size) and 50 * int(counts[common]) >= d.size and 2 * int(counts[common]) >= near:
        return v
    return _off_grid_interval(d)


def _off_grid_interval(d: np.ndarray) -> int:
    """The bar size of sorted off-grid spacings `d`: the median near the largest run of spacings (each within 1%
    of the one before), snapped to the coarsest round unit within 2.5% (59.997 s -> 60 s)."""
    starts = np.flatnonzero(np.diff(d) > d[:-1] // INTERVAL_TOLERANCE_PARTS) + 1  # where a new run begins
    edges = np.concatenate([[0], starts, [d.size]])
    best = int(np.argmax(np.diff(edges)))
    run = d[edges[best]:edges[best + 1]]
    if run[0] == run[-1]:  # one spacing alone
        return int(run[0])
    size = int(np.median(run))
    lo, hi = np.searchsorted(d, [size - size // 2, size + size // 2], "left")
    middle = int(np.median(d[lo:hi]))
    for unit in (NS_PER_DAY, 3_600_000_000_000, 60_000_000_000, NS_PER_SECOND, 1_000_000, 1_000):
        snapped = round(middle / unit) * unit
        if snapped and abs(snapped - middle) * SNAP_PARTS <= middle:
            return snapped
    return middle


def check_time_zone(name: str) -> None:
    """ValueError when `name` is not an IANA time zone this machine knows; `localtime` (the machine's) is refused."""
    if name == "UTC":
        return
    example = "(e.g. UTC, America/Chicago, Europe/London, Asia/Tokyo)"
    if name in ("localtime", "posixrules"):
        raise ValueError(f"calendar time zone {name!r} means this machine's setting, which the serving machine "
                         f"need not share: name the zone {example}")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a directory of zones (America), a long name
        if not available_timezones():
            raise ValueError(f"calendar time zone {name!r}: this machine has no time zone database; install the "
                             "tzdata package (pip install tzdata)") from None
        raise ValueError(f"calendar time zone {name!r} is not an IANA time zone name {example}") from None


SMALL_ZONE_ROWS = 256  # up to this many series of timestamps, each gets its own two offset look-ups


@functools.lru_cache(maxsize=8192)
def _offset_ns(tz: str, second: int) -> int:
    """The zone's UTC offset at `second` (since the Unix epoch), in ns."""
    delta = datetime.fromtimestamp(second, ZoneInfo(tz)).utcoffset()
    return int(delta.total_seconds()) * NS_PER_SECOND if delta is not None else 0


def _change_second(tz: str, lo: int, hi: int) -> int:
    """The first second in (lo, hi] with hi's offset, when lo's differs (one change between them)."""
    end = _offset_ns(tz, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _offset_ns(tz, mid) == end else (mid, hi)
    return hi


def utc_offset_ns(timestamp_ns: np.ndarray, tz: str) -> np.ndarray | int:
    """The zone's UTC offset at each timestamp in ns (local = UTC + offset); one int when it is the same for all.
    No zone changed twice within two days since 1970: a two-day span with one offset at both ends has it."""
    ts = np.asarray(timestamp_ns, dtype=np.int64)
    if ts.size == 0:
        return 0
    lo, hi = int(ts.min()) // NS_PER_SECOND, int(ts.max()) // NS_PER_SECOND
    if hi - lo <= 2 * 86_400 and (first := _offset_ns(tz, lo)) == _offset_ns(tz, hi):
        return first
    second = ts // NS_PER_SECOND
    if ts.ndim >= 2 and ts.size // ts.shape[-1] <= SMALL_ZONE_ROWS:  # a server's batch: each series alone
        rows_lo, rows_hi = second.min(axis=-1).reshape(-1), second.max(axis=-1).reshape(-1)
        per_row = [(_offset_ns(tz, int(a)), _offset_ns(tz, int(b))) for a, b in zip(rows_lo, rows_hi, strict=True)]
        if all(a == b for a, b in per_row) and int((rows_hi - rows_lo).max()) <= 2 * 86_400:
            return np.array([a for a, _ in per_row], dtype=np.int64).reshape(*ts.shape[:-1], 1)
    day = second // 86_400
    first_day, last_day = int(day.min()), int(day.max())
    days = np.arange(first_day, last_day + 1) if last_day - first_day <= 100_000 else np.unique(day)
    return DayOffsets(tz, days).at(second)


class DayOffsets:
    """A zone's UTC offset on given UTC days: per day, the offset at its first and last second and the second
    it changes (by bisection). `at` answers any seconds on those days with array operations alone."""

    NEVER = np.iinfo(np.int64).max

    @classmethod
    def span(cls, tz: str, first_day: int, last_day: int) -> DayOffsets:
        return cls(tz, np.arange(first_day, last_day + 1, dtype=np.int64))

    def __init__(self, tz: str, days: np.ndarray) -> None:
        self.days = np.asarray(days, dtype=np.int64)  # [D] sorted, distinct days since the epoch
        self.contiguous = int(self.days[-1] - self.days[0]) + 1 == self.days.size
        self.start = np.array([_offset_ns(tz, int(d) * 86_400) for d in self.days], dtype=np.int64)  # [D]
        self.end = np.array([_offset_ns(tz, int(d) * 86_400 + 86_399) for d in self.days], dtype=np.int64)  # [D]
        self.change = np.full(self.days.size, self.NEVER, dtype=np.int64)  # [D]  first second with `end`'s offset
        for k in np.flatnonzero(self.start != self.end):  # the offset changes within this day, once
            midnight = int(self.days[k]) * 86_400
            self.change[k] = _change_second(tz, midnight, midnight + 86_399)

    def at(self, second: np.ndarray) -> np.ndarray:
        """The offset (ns) at each of `second` (on the table's days), same shape."""
        day = second // 86_400
        k = day - self.days[0] if self.contiguous else np.searchsorted(self.days, day)
        return np.where(second >= self.change[k], self.end[k], self.start[k])


def known_features(timestamp_ns: np.ndarray, tz: str = "UTC") -> np.ndarray:
    """Calendar features of any timestamps, float32 [..., 4]: time of day and day of week in the zone `tz`
    (an exchange's, through daylight saving), each as a sin/cos pair."""
    ts = np.asarray(timestamp_ns, dtype=np.int64)
    if tz != "UTC":
        ts = ts + utc_offset_ns(ts, tz)  # local wall-clock time, as ns since a local 1970-01-01
    tod = (ts % NS_PER_DAY).astype(np.float64) / NS_PER_DAY  # [...]  fraction of the day
    dow = ((ts // NS_PER_DAY + 3) % 7).astype(np.float64) / 7.0  # 1970-01-01 was a Thursday
    out = np.empty((*ts.shape, 4), dtype=np.float32)  # [..., 4]
    tod_angle, dow_angle = 2 * np.pi * tod, 2 * np.pi * dow
    out[..., 0] = np.sin(tod_angle)
    out[..., 1] = np.cos(tod_angle)
    out[..., 2] = np.sin(dow_angle)
    out[..., 3] = np.cos(dow_angle)
    return out


def future_timestamps(last_ns: np.ndarray, bar_interval_ns: int, horizon: int) -> np.ndarray:
    """Nominal timestamps of the next `horizon` bars after each `last_ns`, [..., H]: training and serving alike."""
    steps = np.arange(1, horizon + 1, dtype=np.int64) * np.int64(bar_interval_ns)
    return np.asarray(last_ns, dtype=np.int64)[..., None] + steps


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
    if isinstance(user, list):
        # a block of rows at a time: no whole [n_observed, N] float64 copy
        observed = np.empty((n, len(cols) + len(user)), dtype=np.float32)  # [N, n_observed]
        columns = cols + user
        for r in range(0, n, ROWS_PER_BLOCK):
            observed[r:r + ROWS_PER_BLOCK] = np.array([x[r:r + ROWS_PER_BLOCK] for x in columns], dtype=np.float32).T
    else:
        observed = np.empty((n, len(cols) + user.shape[0]), dtype=np.float32)  # [N, n_observed]
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
                   encoder_length: int, bar_interval_ns: int) -> LatestWindows:
    """The window at the last bar of each of B series of n bars ([B, n] columns, oldest first): what a server
    forecasts from. Bit for bit what `build_frame` + `gather_windows` give there once n >= warm-up + L."""
    b, n = close.shape
    L = encoder_length
    if n < config.warmup_bars + L:
        raise ValueError(f"{n} bars per series; the windows need at least {config.warmup_bars + L} "
                         f"({config.warmup_bars} warm-up + {L} encoder bars)")
    starts = np.arange(b, dtype=np.int64) * n  # [B]  first row of each series
    first_row = np.repeat(starts, n)  # [B * n]
    c = close.reshape(-1)
    observed = _observed(open_.reshape(-1), high.reshape(-1), low.reshape(-1), c, volume.reshape(-1), user, config,
                         starts, first_row, np.log(c))  # [B * n, n_observed]
    future = future_timestamps(timestamp_ns[:, -1], bar_interval_ns, config.horizon)  # [B, H]
    return LatestWindows(
        encoder_observed=np.ascontiguousarray(observed.reshape(b, n, -1)[:, n - L:]),  # [B, L, n_observed]
        encoder_known=known_features(timestamp_ns[:, n - L:], config.calendar_tz),  # [B, L, n_known]
        decoder_known=known_features(future, config.calendar_tz),  # [B, H, n_known]
        future_timestamp_ns=future,
    )


@functools.lru_cache(maxsize=32)
def _schema(user_columns: tuple[str, ...]) -> FeatureSchema:
    specs = [FeatureSpec(STATIC_SYMBOL, Role.STATIC, Kind.CATEGORICAL)]
    specs += [FeatureSpec(n, Role.OBSERVED, Kind.REAL) for n in BUILTIN_OBSERVED]
    specs += [FeatureSpec(n, Role.OBSERVED, Kind.REAL, source="user") for n in user_columns]
    specs += [FeatureSpec(n, Role.KNOWN, Kind.REAL) for n in BUILTIN_KNOWN]
    return FeatureSchema(tuple(specs))


def build_frame(bars: Bars, config: FeatureConfig, symbols: list[str] | None = None,
                bar_interval_ns: int | None = None, targets: bool = True) -> FeatureFrame:
    """Every feature array of validated `bars`. `symbols` and `bar_interval_ns` fix the trained model's
    vocabulary and bar spacing; `targets=False` leaves the forward returns NaN."""
    slices = bars.series_slices()
    vocab = list(symbols) if symbols is not None else sorted(slices)
    unknown = [s for s in slices if s not in vocab]
    if unknown:
        raise ValueError(f"unknown symbol(s) {', '.join(unknown)}; the model knows {', '.join(vocab)}")
    n = len(bars)
    bounds = np.array([[sl.start, sl.stop] for sl in slices.values()], dtype=np.int64).reshape(-1, 2)
    series_id = np.repeat(np.array([vocab.index(name) for name in slices], dtype=np.int64), bounds[:, 1] - bounds[:, 0])
    first_row = np.repeat(bounds[:, 0], bounds[:, 1] - bounds[:, 0])  # [N]
    log_c = np.log(bars.close)
    user_block = block_for(bars.user, config.user_columns)  # [n_user, N] when the columns come as one block
    user = user_block if user_block is not None else [bars.user[u] for u in config.user_columns]
    observed = _observed(bars.open, bars.high, bars.low, bars.close, bars.volume, user, config, bounds[:, 0],
                         first_row, log_c)
    forward = _forward_returns(log_c, bounds, config.horizon) if targets else \
        np.full((n, config.horizon), np.nan, dtype=np.float32)
    return FeatureFrame(
        config=config,
        symbols=vocab,
        timestamp_ns=bars.timestamp_ns.astype(np.int64),
        series_id=series_id,
        series_bounds=bounds,
        observed=observed,
        known=known_features(bars.timestamp_ns, config.calendar_tz),  # [N, n_known]
        close=bars.close.astype(np.float64),
        targets=forward,
        bar_interval_ns=bar_interval_ns or infer_bar_interval_ns(bars.timestamp_ns, bounds),
    )


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
