"""Time alone, no prices: the bars' spacing, calendar time zones, the calendar features of any bar time, each bar's
session and the nominal times of future bars."""

from __future__ import annotations

import functools
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import numpy as np

NS_PER_SECOND = 1_000_000_000
NS_PER_DAY = 86_400 * NS_PER_SECOND
HOUR_NS = 3_600 * NS_PER_SECOND
SLOT_NS = 15 * 60 * NS_PER_SECOND  # an intraday profile's slot of the day for bars finer than an hour
COARSE_INTERVALS = 20  # bars mostly this many intervals (and a day) apart are daily bars
INTERVAL_TOLERANCE_PARTS = 100  # off a grid, spacings within 1/100 of the one before run together
SNAP_PARTS = 40  # spacings within 1/40 of the commonest are its neighbours; a round duration this near snaps

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
OFFSET_BLOCK_DAYS = 512  # spread-out timestamps read a zone's offsets from whole blocks of days, each tabled once


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
    first_day, last_day = int(day.min()) // OFFSET_BLOCK_DAYS, int(day.max()) // OFFSET_BLOCK_DAYS
    if last_day - first_day > 100_000 // OFFSET_BLOCK_DAYS:
        return DayOffsets(tz, np.unique(day)).at(second)
    return _offset_blocks(tz, first_day * OFFSET_BLOCK_DAYS, (last_day + 1) * OFFSET_BLOCK_DAYS - 1).at(second)


def local_ns(timestamp_ns: np.ndarray, tz: str) -> np.ndarray:
    """Each timestamp's local wall-clock time in `tz`, as ns since a local 1970-01-01, int64, same shape."""
    ts = np.asarray(timestamp_ns, dtype=np.int64)
    return ts if tz == "UTC" else ts + utc_offset_ns(ts, tz)


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


@functools.lru_cache(maxsize=64)
def _offset_blocks(tz: str, first_day: int, last_day: int) -> DayOffsets:
    """The zone's offsets from `first_day` to `last_day` (whole blocks): a trainer's batches, step after step, and
    a year of windows read one table."""
    return DayOffsets.span(tz, first_day, last_day)


def known_features(timestamp_ns: np.ndarray, tz: str = "UTC") -> np.ndarray:
    """Calendar features of any timestamps, float32 [..., 4]: time of day and day of week in the zone `tz`
    (an exchange's, through daylight saving), each as a sin/cos pair."""
    ts = local_ns(timestamp_ns, tz)
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


def sessions(timestamp_ns: np.ndarray, tz: str) -> np.ndarray:
    """Each bar's session: its calendar day in `tz`, as days since 1970-01-01, int64 [n]."""
    return local_ns(timestamp_ns, tz) // NS_PER_DAY


def profile_slots(timestamp_ns: np.ndarray, bar_interval_ns: int, tz: str) -> tuple[np.ndarray, int]:
    """Each bar time's slot of the intraday profile, and the number of slots: the hour of the week (Monday 00:00
    is 0) for bars of an hour or more, else the 15-minute slot of the day; local time in `tz`."""
    local = local_ns(timestamp_ns, tz)
    if bar_interval_ns >= HOUR_NS:
        return (local // HOUR_NS + 72) % 168, 168  # 1970-01-01 was a Thursday, 72 hours after a Monday 00:00
    return (local % NS_PER_DAY) // SLOT_NS, int(NS_PER_DAY // SLOT_NS)
