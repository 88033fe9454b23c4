"""What the exchanges publish about common futures roots: the trading day, and each contract's last trading day.

`PRODUCTS` is the one table: for each root of CME, CBOT, NYMEX, COMEX and Eurex (equity index, rates, FX, energy,
metals, grains, livestock; full-size, E-mini and micro), its exchange, the exchange calendar whose holidays its
business days skip (pandas-market-calendars), and its last-trading-day rule. A user's expiration column or `--roots`
file overrides it. The trading day is the exchange's: CME Globex's runs from 17:00 Chicago to 16:00 the next day,
so an evening bar belongs to the next day's session; Eurex's is the Frankfurt calendar day.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from features.calendar import HOUR_NS, NS_PER_DAY, local_ns


@dataclass(frozen=True)
class Exchange:
    name: str
    tz: str  # IANA zone of its trading day
    day_starts: int  # hours before midnight (local) that its next trading day begins: Globex's 17:00 is 7


CME, CBOT, NYMEX, COMEX = (Exchange(name, "America/Chicago", 7) for name in ("CME", "CBOT", "NYMEX", "COMEX"))
EUREX = Exchange("Eurex", "Europe/Berlin", 0)


@dataclass(frozen=True)
class Product:
    exchange: Exchange
    calendar: str  # pandas-market-calendars calendar of its business days (holidays)
    rule: str  # key of RULES: its last trading day


# A rule's arguments: the contract's year and month, and the exchange's business days (sorted datetime64[D])
Rule = Callable[[int, int, np.ndarray], np.datetime64]


def _first(year: int, month: int, day: int = 1) -> np.datetime64:
    return np.datetime64(f"{year:04d}-{month:02d}-{day:02d}", "D")


def _month_days(year: int, month: int, days: np.ndarray) -> np.ndarray:
    """The business days of the month."""
    start = _first(year, month)
    return days[(days >= start) & (days < (start.astype("datetime64[M]") + 1).astype("datetime64[D]"))]


def _before(day: np.datetime64, n: int, days: np.ndarray) -> np.datetime64:
    """The business day `n` business days before `day` (which need not be one)."""
    return days[np.searchsorted(days, day) - n]


def _on_or_before(day: np.datetime64, days: np.ndarray) -> np.datetime64:
    return days[np.searchsorted(days, day, side="right") - 1]


def _weekday(year: int, month: int, weekday: int, nth: int) -> np.datetime64:
    """The `nth` (1-based) `weekday` (Monday 0) of the month."""
    first = _first(year, month)
    shift = (weekday - (first.astype(np.int64) + 3) % 7) % 7  # 1970-01-01 was a Thursday (3)
    return first + shift + 7 * (nth - 1)


def _month_before(year: int, month: int) -> tuple[int, int]:
    return (year, month - 1) if month > 1 else (year - 1, 12)


def _crude(y: int, m: int, days: np.ndarray) -> np.datetime64:
    """Three business days before the 25th of the month before the contract month, or before the last business
    day before the 25th when the 25th is none."""
    return _before(_on_or_before(_first(*_month_before(y, m), 25), days), 3, days)


def _natural_gas(y: int, m: int, days: np.ndarray) -> np.datetime64:
    """Three business days before the first day of the contract month."""
    return _before(_first(y, m), 3, days)


RULES: dict[str, Rule] = {  # a product's last trading day from its contract's year y, month m and business days d
    # the third Friday of the contract month; the business day before it when it is none
    "third_friday": lambda y, m, d: _on_or_before(_weekday(y, m, 4, 3), d),
    # two business days before the third Wednesday of the contract month; one for the Canadian dollar
    "fx": lambda y, m, d: _before(_weekday(y, m, 2, 3), 2, d),
    "fx_cad": lambda y, m, d: _before(_weekday(y, m, 2, 3), 1, d),
    "crude": _crude,
    "micro_crude": lambda y, m, d: _before(_crude(y, m, d), 1, d),  # the day before crude's: micro and E-mini
    "natural_gas": _natural_gas,
    "emini_natural_gas": lambda y, m, d: _before(_natural_gas(y, m, d), 1, d),  # the business day before NG's
    # seven business days before the last business day of the contract month
    "long_treasury": lambda y, m, d: _before(_month_days(y, m, d)[-1], 7, d),
    "last_business_day": lambda y, m, d: _month_days(y, m, d)[-1],  # of the contract month
    "metal": lambda y, m, d: _month_days(y, m, d)[-3],  # the third last business day of the contract month
    "micro_copper": lambda y, m, d: _month_days(*_month_before(y, m), d)[-3],  # the same, of the month before
    "grain": lambda y, m, d: _before(_first(y, m, 15), 1, d),  # the business day before the contract month's 15th
    "lean_hogs": lambda y, m, d: _month_days(y, m, d)[9],  # the tenth business day of the contract month
    # two exchange days before the delivery day: the 10th of the contract month, or the exchange day after
    "eurex_bond": lambda y, m, d: _before(d[np.searchsorted(d, _first(y, m, 10))], 2, d),
}


def _products(exchange: Exchange, calendar: str, rule: str, *roots: str) -> dict[str, Product]:
    return dict.fromkeys(roots, Product(exchange, calendar, rule))


PRODUCTS: dict[str, Product] = {
    **_products(CME, "CME_Equity", "third_friday", "ES", "MES", "NQ", "MNQ", "RTY", "M2K", "EMD"),
    **_products(CBOT, "CBOT_Equity", "third_friday", "YM", "MYM"),
    **_products(CBOT, "CBOT_Bond", "long_treasury", "ZN", "ZB", "UB", "TN"),
    **_products(CBOT, "CBOT_Bond", "last_business_day", "ZF", "ZT"),
    **_products(CME, "CMEGlobex_FX", "fx", "6E", "M6E", "6A", "M6A", "6B", "M6B", "6J", "6S", "6N"),
    **_products(CME, "CMEGlobex_FX", "fx_cad", "6C", "M6C"),
    **_products(NYMEX, "CMEGlobex_Crude", "crude", "CL"),
    **_products(NYMEX, "CMEGlobex_Crude", "micro_crude", "MCL", "QM"),
    **_products(NYMEX, "CMEGlobex_NatGas", "natural_gas", "NG"),
    **_products(NYMEX, "CMEGlobex_NatGas", "emini_natural_gas", "QG"),
    **_products(COMEX, "CMEGlobex_Metals", "metal", "GC", "MGC", "SI", "SIL", "HG"),
    **_products(COMEX, "CMEGlobex_Metals", "micro_copper", "MHG"),
    **_products(CBOT, "CMEGlobex_Grains", "grain", "ZC", "ZS", "ZW", "ZM", "ZL", "KE"),
    **_products(CME, "CMEGlobex_Lean_Hog", "lean_hogs", "HE"),
    **_products(CME, "CMEGlobex_Live_Cattle", "last_business_day", "LE"),
    **_products(EUREX, "XEUR", "third_friday", "FDAX", "FDXM", "FDXS", "FESX", "FSMI"),
    **_products(EUREX, "XEUR", "eurex_bond", "FGBL", "FGBM", "FGBS", "FGBX"),
}


@functools.lru_cache(maxsize=64)
def business_days(calendar: str, year: int) -> np.ndarray:
    """The exchange calendar's business days from the year before `year` to the year after, datetime64[D]."""
    import pandas_market_calendars as mcal

    days = mcal.get_calendar(calendar).valid_days(f"{year - 1}-01-01", f"{year + 1}-12-31")
    return np.asarray(days.tz_localize(None).values.astype("datetime64[D]"))


def last_trading_day(root: str, year: int, month: int) -> str | None:
    """The contract's last trading day by its exchange's rule and calendar ("YYYY-MM-DD"); None for a root the table
    lacks."""
    if (product := PRODUCTS.get(root)) is None:
        return None
    return str(RULES[product.rule](year, month, business_days(product.calendar, year)))


EXCHANGE_ZONE = "exchange"  # --calendar-tz exchange: the zone of the exchange of most of a file's roots


def exchange_zone(roots: Iterable[str]) -> tuple[str, list[str]] | None:
    """The time zone of the exchange most of `roots` (one per series) trade on, and those roots; None when the
    table knows none of them. A tie goes to the zone that comes first by name."""
    zones: dict[str, list[str]] = {}
    for root in roots:
        if (product := PRODUCTS.get(root)) is not None:
            zones.setdefault(product.exchange.tz, []).append(root)
    if not zones:
        return None
    tz = min(zones, key=lambda z: (-len(zones[z]), z))
    return tz, zones[tz]


def trading_days(timestamp_ns: np.ndarray, exchange: Exchange) -> np.ndarray:
    """Each bar's trading day at `exchange` (days since 1970-01-01, int64 [n]): its local date, a day later from the
    hour the next trading day begins."""
    return (local_ns(timestamp_ns, exchange.tz) + exchange.day_starts * HOUR_NS) // NS_PER_DAY
