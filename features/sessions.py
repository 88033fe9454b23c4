"""The weekly trading hours of each series, learnt from its training bars, and the times of its next bars.

A future bar's time decides its calendar features and its place in the volatility profile. Stepping one bar
interval at a time from the last bar runs through the exchange's daily halt and the weekend, where no bar comes:
a Friday-afternoon forecast of 12 hourly bars would describe Friday night and Saturday. The hours are learnt from
the bars, as the vendor stamps them, rather than taken from a packaged exchange calendar: a product's hours differ
within one exchange (Eurex's DAX future trades from 01:10 CET, its packaged calendar opens at 08:00), and a
vendor's bars are the grid the model forecasts on. What a week's hours cannot know ahead, the exchange's holidays and
early closes, comes from the root's exchange calendar (features.exchanges, pandas-market-calendars).
"""

from __future__ import annotations

import functools
from datetime import datetime
from zoneinfo import ZoneInfo

import numpy as np

from features.calendar import NS_PER_DAY, NS_PER_SECOND, future_timestamps, local_ns
from features.exchanges import PRODUCTS, Exchange, business_days

MINUTE_NS = 60_000_000_000
WEEK_MINUTES = 7 * 24 * 60
SESSION_WEEKS_SHARE = 0.5  # a slot of the week is in session when the bars fill it in this share of their weeks
MIN_SESSION_WEEKS = 4  # fewer weeks of bars: no hours are learnt (every bar time is in session)
MONDAY_OFFSET_DAYS = 3  # 1970-01-01 was a Thursday: local days since then, plus this, count from a Monday


def _week_minute(local_ns: np.ndarray) -> np.ndarray:
    """Minutes since Monday 00:00 of local times (local_ns), int64, same shape."""
    return (local_ns // MINUTE_NS + MONDAY_OFFSET_DAYS * 24 * 60) % WEEK_MINUTES


def _slot_minutes(bar_interval_ns: int) -> int:
    """The bar interval in whole minutes when it divides the week; 0 otherwise (no hours can be learnt)."""
    if bar_interval_ns % MINUTE_NS or not bar_interval_ns:
        return 0
    minutes = bar_interval_ns // MINUTE_NS
    return minutes if WEEK_MINUTES % minutes == 0 else 0


def learn_hours(timestamp_ns: np.ndarray, bar_interval_ns: int, tz: str) -> str:
    """The trading hours of one series' bars (sorted bar times), as minute-of-week ranges in `tz` ("1020-2400,
    ..."; Monday 00:00 is 0): each bar interval's slot of the week that the bars fill in half their weeks or more.
    "" where nothing is learnt: bars finer than a minute or off the week's grid, fewer than MIN_SESSION_WEEKS
    weeks, or bars in every slot."""
    slot = _slot_minutes(bar_interval_ns)
    if not slot or np.size(timestamp_ns) == 0:
        return ""
    local = local_ns(timestamp_ns, tz)  # [n]
    week = (local // NS_PER_DAY + MONDAY_OFFSET_DAYS) // 7  # [n]
    weeks = int(week[-1] - week[0]) + 1
    if weeks < MIN_SESSION_WEEKS:
        return ""
    n_slots = WEEK_MINUTES // slot
    cell = np.unique(week * n_slots + _week_minute(local) // slot)  # distinct (week, slot) pairs
    filled = np.bincount(cell % n_slots, minlength=n_slots)  # [slots] weeks with a bar in the slot
    open_ = filled >= SESSION_WEEKS_SHARE * weeks
    if open_.all() or not open_.any():
        return ""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], open_.astype(np.int8), [0]])))  # starts, then ends
    return ",".join(f"{a * slot}-{b * slot}" for a, b in zip(edges[::2], edges[1::2], strict=True))


@functools.lru_cache(maxsize=64)
def _skips(hours: str, slot: int) -> np.ndarray:
    """Per slot of the week: how many slots on to the next slot in session (0 when in session), int64 [slots].
    A slot is in session when it overlaps one of the hours' ranges."""
    n_slots = WEEK_MINUTES // slot
    minute_open = np.zeros(WEEK_MINUTES, dtype=bool)
    for part in hours.split(","):
        a, b = (int(x) for x in part.split("-"))
        minute_open[a:b] = True
    open_ = minute_open.reshape(n_slots, slot).any(axis=1)  # [slots]
    ahead = np.flatnonzero(np.tile(open_, 2))  # in-session slots over two weeks
    return ahead[np.searchsorted(ahead, np.arange(n_slots))] - np.arange(n_slots)


def _day_start_ns(day: np.datetime64, exchange: Exchange) -> int:
    """When the exchange's trading day `day` begins (UTC ns): its local midnight less the hours it starts early."""
    local = (day - np.timedelta64(exchange.day_starts, "h")).astype(datetime)
    return int(local.replace(tzinfo=ZoneInfo(exchange.tz)).timestamp()) * NS_PER_SECOND


@functools.lru_cache(maxsize=512)
def closed_spans(root: str, year: int) -> tuple[np.ndarray, np.ndarray]:
    """When `root` does not trade in `year` though its week's hours would (UTC ns, int64 starts [S] and ends [S],
    by start): a weekday holiday of its exchange calendar, the whole trading day; an early close, the rest of its
    trading day. None of either for a root the exchanges' table lacks."""
    if (product := PRODUCTS.get(root)) is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    import pandas_market_calendars as mcal

    calendar = mcal.get_calendar(product.calendar)
    schedule = calendar.schedule(f"{year}-01-01", f"{year}-12-31")
    days = np.arange(np.datetime64(f"{year}-01-01"), np.datetime64(f"{year + 1}-01-01"))
    weekdays = days[(days.astype(np.int64) + MONDAY_OFFSET_DAYS) % 7 < 5]
    holidays = np.setdiff1d(weekdays, business_days(product.calendar, year))
    early = calendar.early_closes(schedule)["market_close"]
    ex = product.exchange
    starts = [*(_day_start_ns(d, ex) for d in holidays), *early.to_numpy("datetime64[ns]").astype(np.int64)]
    ends = [_day_start_ns(d + 1, ex) for d in (*holidays, *early.index.values.astype("datetime64[D]"))]
    order = np.argsort(starts)
    return np.asarray(starts, np.int64)[order], np.asarray(ends, np.int64)[order]


@functools.lru_cache(maxsize=64)
def _spans(root: str, first_year: int, last_year: int) -> tuple[np.ndarray, np.ndarray]:
    """`root`'s closed spans of the years `first_year` to `last_year`, by start."""
    spans = [closed_spans(root, year) for year in range(first_year, last_year + 1)]
    return np.concatenate([a for a, _ in spans]), np.concatenate([b for _, b in spans])


def _year(ns: int) -> int:
    return int(np.datetime64(ns, "ns").astype("datetime64[Y]").astype(int)) + 1970


def _leave_spans(x: np.ndarray, spans: tuple[np.ndarray, np.ndarray], interval: int) -> bool:
    """Moves each time of `x` inside a span on by whole intervals to the span's end or past it; True if any moved."""
    starts, ends = spans
    k = np.searchsorted(starts, x, "right") - 1
    inside = (k >= 0) & (x < ends[np.maximum(k, 0)])
    x[inside] += -((x[inside] - ends[k[inside]]) // interval) * interval
    return bool(inside.any())


def _stepped(last: np.ndarray, interval: int, horizon: int, tz: str, hours: np.ndarray, slot: int,
             spans: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """next_bar_times of `last` [B] with `hours` [B], out of `spans` as well when given: int64 [B, H]."""
    names, which = np.unique(hours, return_inverse=True)
    groups = [(np.flatnonzero(which == k), _skips(str(name), slot)) for k, name in enumerate(names) if name]
    out = np.empty((last.size, horizon), dtype=np.int64)
    x = last.copy()
    for h in range(horizon):
        x += interval
        for rows, skips in groups:
            y = x[rows]
            _into_session(y, skips, tz, slot, interval)
            while spans is not None and _leave_spans(y, spans, interval):
                _into_session(y, skips, tz, slot, interval)
            x[rows] = y
        out[:, h] = x
    return out


def _into_session(y: np.ndarray, skips: np.ndarray, tz: str, slot: int, interval: int) -> None:
    """Moves each time of `y` out of session on to the next slot in session; intraday bars on the local clock (a
    weekend that ends daylight saving time opens at 17:00 local, not at 16:00), daily bars by whole days (their
    stamps are dates)."""
    local = local_ns(y, tz)
    jump = skips[_week_minute(local) // slot] * np.int64(interval)
    if interval >= NS_PER_DAY:
        y += jump
    elif jump.any():
        moved = jump > 0
        target = local[moved] + jump[moved]  # the local wall-clock time to land on
        to = y[moved] + jump[moved]
        y[moved] = to - (local_ns(to, tz) - target)  # less the change in the zone's offset on the way


def next_bar_times(last_ns: np.ndarray, bar_interval_ns: int, horizon: int, tz: str,
                   hours: np.ndarray | None = None, series: np.ndarray | None = None) -> np.ndarray:
    """The times of the next `horizon` bars after each `last_ns` [B], int64 [B, H]: one bar interval on, then on
    to the next slot in session of the window's `hours` [B] (learn_hours' ranges; "" or None: every time is in
    session, the nominal times last + h * interval) and, for a window with hours whose series [B] is a root the
    exchanges' table knows, out of its exchange's holidays and early closes (closed_spans)."""
    last = np.asarray(last_ns, dtype=np.int64)
    slot = _slot_minutes(bar_interval_ns)
    if hours is None or not slot or not any(hours):
        return future_timestamps(last, bar_interval_ns, horizon)
    hours = np.broadcast_to(np.asarray(hours, dtype=str), last.shape).reshape(-1)
    flat = last.reshape(-1)
    out = _stepped(flat, bar_interval_ns, horizon, tz, hours, slot)  # [B, H] by the week alone
    roots = np.broadcast_to(np.asarray("" if series is None else series, dtype=str), last.shape).reshape(-1)
    for root in set(roots[hours != ""]) & PRODUCTS.keys():
        rows = np.flatnonzero((roots == root) & (hours != ""))
        # a closed span holds none of the week's times unless it begins before their last and ends after the start;
        # a year on covers where skipping it takes them
        starts, ends = spans = _spans(root, _year(int(flat[rows].min())), _year(int(out[rows, -1].max())) + 1)
        meets = np.searchsorted(starts, out[rows, -1], "right") > np.searchsorted(ends, flat[rows], "right")
        if meets.any():
            hit = rows[meets]
            out[hit] = _stepped(flat[hit], bar_interval_ns, horizon, tz, hours[hit], slot, spans)
    return out.reshape(*last.shape, horizon)
