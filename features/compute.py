"""Bars -> feature arrays, vectorised in numpy, with no look-ahead.

A feature at bar t uses bars <= t only; only the targets (forward log returns) and the calendar
features (timestamps alone) look forward. Rows in a series' warm-up have NaN observed features.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import numpy as np

from features.bars import Bars, block_for
from features.categories import encode, fit_vocabulary
from features.contracts import ContractConfig, roll_sessions
from features.schema import FeatureSchema, FeatureSpec, Kind, Role

NS_PER_SECOND = 1_000_000_000
NS_PER_DAY = 86_400 * NS_PER_SECOND
COARSE_INTERVALS = 20  # bars mostly this many intervals (and a day) apart are daily bars
INTERVAL_TOLERANCE_PARTS = 100  # off a grid, spacings within 1/100 of the one before run together
SNAP_PARTS = 40  # spacings within 1/40 of the commonest are its neighbours; a round duration this near snaps

BUILTIN_OBSERVED: tuple[str, ...] = ("log_return", "log_range", "log_body", "log_volume", "volatility")
BUILTIN_KNOWN: tuple[str, ...] = ("tod_sin", "tod_cos", "dow_sin", "dow_cos")
# after the calendar, for a model rolling by `calendar:N` (expirations known, so known ahead; a volume roll is not)
CONTRACT_KNOWN: tuple[str, ...] = ("sessions_to_expiry", "roll_session")
STATIC_SYMBOL = "symbol"


@dataclass(frozen=True)
class FeatureConfig:
    """How bars become features; saved with every checkpoint and model.

    User columns come in three roles: observed (`user_columns`, encoder only), known for future bars
    (`known_columns`, encoder and decoder) and static (`static_columns`, constant per series). Those named in
    `categorical_columns` are labels, embedded by id with the `vocabularies` fitted on the training split."""

    horizon: int = 5  # forecast steps H: targets are log(close[t+h]/close[t]) for h = 1..H
    volatility_window: int = 20  # bars in the rolling standard deviation of log returns
    user_columns: tuple[str, ...] = ()  # user columns observed up to the last bar (encoder only)
    calendar_tz: str = "UTC"  # IANA time zone of the calendar features (time of day, day of week)
    known_columns: tuple[str, ...] = ()  # user columns whose future values the caller knows
    static_columns: tuple[str, ...] = ()  # user columns constant within a series
    categorical_columns: tuple[str, ...] = ()  # which user columns, of any role, are categorical
    vocabularies: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (column, sorted labels) once fitted
    contracts: ContractConfig | None = None  # per-contract bars rolled into one series per root; None: as given

    def __post_init__(self) -> None:
        if self.horizon < 1 or self.volatility_window < 1:
            raise ValueError(f"horizon ({self.horizon}) and volatility_window ({self.volatility_window}) "
                             "must be at least 1")
        check_time_zone(self.calendar_tz)
        check_roles(self)

    @property
    def warmup_bars(self) -> int:
        return self.volatility_window

    def _real(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in names if n not in self.categorical_columns)

    def _categorical(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in names if n in self.categorical_columns)

    @property
    def known_reals(self) -> tuple[str, ...]:
        """The known real user columns: their future values travel in the wire's future_features."""
        return self._real(self.known_columns)

    @property
    def known_categoricals(self) -> tuple[str, ...]:
        """The known categorical user columns: their future labels travel in future_categorical_features."""
        return self._categorical(self.known_columns)

    @property
    def observed_user(self) -> tuple[str, ...]:
        """Observed user variables in the model's order: reals, then categoricals."""
        return self._real(self.user_columns) + self._categorical(self.user_columns)

    @property
    def known_user(self) -> tuple[str, ...]:
        """Known user variables in the model's order: reals, then categoricals."""
        return self._real(self.known_columns) + self._categorical(self.known_columns)

    @property
    def static_categoricals(self) -> tuple[str, ...]:
        return self._categorical(self.static_columns)

    @property
    def static_reals(self) -> tuple[str, ...]:
        return self._real(self.static_columns)

    @property
    def real_columns(self) -> tuple[str, ...]:
        """Every real user column a file must hold: observed, known, static."""
        return self._real(self.user_columns) + self._real(self.known_columns) + self.static_reals

    @property
    def series_reals(self) -> tuple[str, ...]:
        """The real user columns sent per bar (the wire's user_features): observed, then known."""
        return self._real(self.user_columns) + self._real(self.known_columns)

    @property
    def series_categoricals(self) -> tuple[str, ...]:
        """The categorical user columns sent per bar: observed, then known."""
        return self._categorical(self.user_columns) + self._categorical(self.known_columns)

    @property
    def has_user_inputs(self) -> bool:
        """Whether any user column beyond observed reals is used (known, static or categorical)."""
        return bool(self.known_columns or self.static_columns or self.categorical_columns)

    def vocabulary(self, name: str) -> tuple[str, ...]:
        return dict(self.vocabularies)[name]

    @property
    def contract_known(self) -> tuple[str, ...]:
        """The built-in known contract features: CONTRACT_KNOWN for a `calendar:N` roll, else none."""
        rolls_by_calendar = self.contracts is not None and roll_sessions(self.contracts.roll) is not None
        return CONTRACT_KNOWN if rolls_by_calendar else ()

    def schema(self) -> FeatureSchema:
        return _schema(self)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"horizon": self.horizon, "volatility_window": self.volatility_window,
                             "user_columns": list(self.user_columns), "calendar_tz": self.calendar_tz}
        if self.has_user_inputs:  # a model without them keeps the same metadata
            d |= {"known_columns": list(self.known_columns), "static_columns": list(self.static_columns),
                  "categorical_columns": list(self.categorical_columns),
                  "vocabularies": {name: list(v) for name, v in self.vocabularies}}
        if self.contracts is not None:
            d["contracts"] = self.contracts.to_dict()
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FeatureConfig:
        return FeatureConfig(int(d["horizon"]), int(d["volatility_window"]), tuple(d["user_columns"]),
                             str(d["calendar_tz"]), tuple(d.get("known_columns", ())),
                             tuple(d.get("static_columns", ())), tuple(d.get("categorical_columns", ())),
                             tuple((name, tuple(v)) for name, v in d.get("vocabularies", {}).items()),
                             ContractConfig.from_dict(d["contracts"]) if d.get("contracts") else None)


ROLE_FLAGS = {"user_columns": "--features", "known_columns": "--known-features", "static_columns": "--static-features"}


def check_roles(config: FeatureConfig) -> None:
    """ValueError for a user column in two roles, or a categorical column in none."""
    seen: dict[str, str] = {}
    for field_name, flag in ROLE_FLAGS.items():
        for name in getattr(config, field_name):
            if name in seen and seen[name] != flag:
                raise ValueError(f"user feature {name!r} is given to {seen[name]} and {flag}: a column has one "
                                 "role; keep it in one of them")
            seen[name] = flag
    if stray := [c for c in config.categorical_columns if c not in seen]:
        raise ValueError(f"--categorical-features {', '.join(stray)}: not given a role; add each to --features, "
                         "--known-features or --static-features too")
    if config.vocabularies and (lacking := [c for c in config.categorical_columns
                                            if c not in dict(config.vocabularies)]):
        raise ValueError(f"no vocabulary for categorical feature(s) {', '.join(lacking)}")


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
                   encoder_length: int, bar_interval_ns: int, known: np.ndarray | None = None,
                   future_known: np.ndarray | None = None, log_offset: np.ndarray | None = None,
                   roots: Sequence[str] | None = None) -> LatestWindows:
    """The window at the last bar of each of B series of n bars ([B, n] columns, oldest first): what a server
    forecasts from. `user`: the observed user variables (config.observed_user; categoricals as ids) as a
    [n_user, B * n] block or [B * n] columns; `known` float32 [B, n, n_known_user] and `future_known`
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
    future = future_timestamps(timestamp_ns[:, -1], bar_interval_ns, config.horizon)  # [B, H]
    encoder_known = known_features(timestamp_ns[:, n - L:], config.calendar_tz)  # [B, L, 4]
    decoder_known = known_features(future, config.calendar_tz)  # [B, H, 4]
    if config.contract_known:
        encoder_known, decoder_known = _with_contract_known(config, roots, timestamp_ns[:, n - L:], future,
                                                            encoder_known, decoder_known)
    if config.known_columns and known is not None and future_known is not None:
        encoder_known = np.concatenate([encoder_known, known[:, n - L:]], axis=-1, dtype=np.float32)
        decoder_known = np.concatenate([decoder_known, future_known], axis=-1, dtype=np.float32)
    return LatestWindows(
        encoder_observed=np.ascontiguousarray(observed.reshape(b, n, -1)[:, n - L:]),  # [B, L, n_observed]
        encoder_known=encoder_known,  # [B, L, n_known]
        decoder_known=decoder_known,  # [B, H, n_known]
        future_timestamp_ns=future,
    )


def _with_contract_known(config: FeatureConfig, roots: Sequence[str] | None, encoder_ns: np.ndarray,
                         future_ns: np.ndarray, encoder_known: np.ndarray, decoder_known: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The calendar features [B, L, 4] and [B, H, 4] followed by the contract features of the encoder bars
    (encoder_ns [B, L]) and of the future bars (future_ns [B, H])."""
    from features.rolls import contract_known  # features.rolls builds on this module

    assert config.contracts is not None
    if roots is None:
        raise ValueError("latest_windows: a calendar-rolled model's contract features need each series' root (roots=)")
    root = np.asarray(roots, dtype=str)[:, None]  # [B, 1]
    tz = config.calendar_tz
    return (np.concatenate([encoder_known, contract_known(encoder_ns, root, config.contracts, tz)], axis=-1),
            np.concatenate([decoder_known, contract_known(future_ns, root, config.contracts, tz)], axis=-1))


@functools.lru_cache(maxsize=32)
def _schema(config: FeatureConfig) -> FeatureSchema:
    """Static: the symbol, user categoricals, user reals. Observed and known: built-in, then user reals, then user
    categoricals: the column order of every array of that role."""
    cat, real = Kind.CATEGORICAL, Kind.REAL

    def user(names: tuple[str, ...], role: Role) -> list[FeatureSpec]:
        return [FeatureSpec(n, role, cat if n in config.categorical_columns else real, source="user") for n in names]

    specs = [FeatureSpec(STATIC_SYMBOL, Role.STATIC, cat)]
    specs += user(config.static_categoricals + config.static_reals, Role.STATIC)
    specs += [FeatureSpec(n, Role.OBSERVED, real) for n in BUILTIN_OBSERVED] + user(config.observed_user, Role.OBSERVED)
    specs += [FeatureSpec(n, Role.KNOWN, real) for n in BUILTIN_KNOWN + config.contract_known]
    specs += user(config.known_user, Role.KNOWN)
    return FeatureSchema(tuple(specs))


def build_frame(bars: Bars, config: FeatureConfig, symbols: list[str] | None = None,
                bar_interval_ns: int | None = None, targets: bool = True) -> FeatureFrame:
    """Every feature array of validated `bars`. `symbols` and `bar_interval_ns` fix the trained model's
    vocabulary and bar spacing; `targets=False` leaves the forward returns NaN. ValueError names a static user
    column that varies within a series."""
    slices = bars.series_slices()
    vocab = list(symbols) if symbols is not None else sorted(slices)
    unknown = [s for s in slices if s not in vocab]
    if unknown:
        raise ValueError(f"unknown symbol(s) {', '.join(unknown)}; the model knows {', '.join(vocab)}")
    n = len(bars)
    bounds = np.array([[sl.start, sl.stop] for sl in slices.values()], dtype=np.int64).reshape(-1, 2)
    check_static(bars, config, bounds)
    series_id = np.repeat(np.array([vocab.index(name) for name in slices], dtype=np.int64), bounds[:, 1] - bounds[:, 0])
    first_row = np.repeat(bounds[:, 0], bounds[:, 1] - bounds[:, 0])  # [N]
    log_c = np.log(bars.close) if bars.log_offset is None else np.log(bars.close) + bars.log_offset
    ids, unseen = encode_labels(bars, config)
    user_block = None if config.categorical_columns else block_for(bars.user, config.user_columns)  # [n_user, N]
    user = user_block if user_block is not None else [column(bars, ids, u) for u in config.observed_user]
    observed = _observed(bars.open, bars.high, bars.low, bars.close, bars.volume, user, config, bounds[:, 0],
                         first_row, log_c)
    forward = _forward_returns(log_c, bounds, config.horizon) if targets else \
        np.full((n, config.horizon), np.nan, dtype=np.float32)
    known = known_features(bars.timestamp_ns, config.calendar_tz)  # [N, 4]
    if config.contract_known:
        from features.rolls import contract_known  # features.rolls builds on this module

        assert config.contracts is not None
        known = np.concatenate([known, contract_known(bars.timestamp_ns, bars.symbol, config.contracts,
                                                      config.calendar_tz)], axis=1)  # [N, 6]
    if config.known_columns:
        known = np.concatenate([known, np.stack([column(bars, ids, u) for u in config.known_user], axis=1)],
                               axis=1, dtype=np.float32)  # [N, n_known]
    return FeatureFrame(
        config=config,
        symbols=vocab,
        timestamp_ns=bars.timestamp_ns.astype(np.int64),
        series_id=series_id,
        series_bounds=bounds,
        observed=observed,
        known=known,
        close=bars.close.astype(np.float64),
        targets=forward,
        bar_interval_ns=bar_interval_ns or infer_bar_interval_ns(bars.timestamp_ns, bounds),
        static_ids=np.stack([ids[u] for u in config.static_categoricals], axis=1) if config.static_categoricals
        else None,  # [N, n_static_categorical_user]
        static_real=np.stack([bars.user[u] for u in config.static_reals], axis=1).astype(np.float32)
        if config.static_reals else None,  # [N, n_static_real]
        unseen=unseen,
    )


def column(bars: Bars, ids: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A user column as float64 [N]: its values, or a categorical's ids."""
    return ids[name].astype(np.float64) if name in ids else np.asarray(bars.user[name], dtype=np.float64)


def encode_labels(bars: Bars, config: FeatureConfig) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each categorical column's ids (int64 [N]) in its vocabulary, and where its label is unseen (bool [N])."""
    ids, unseen = {}, {}
    for name in config.categorical_columns:
        ids[name], unseen[name] = encode(bars.labels[name], config.vocabulary(name))
    return ids, unseen


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
