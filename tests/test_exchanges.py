"""The exchanges' table: last trading days by each product's published rule and its exchange's holidays, and the
exchange's trading day as the session a roll is decided in."""

from __future__ import annotations

import numpy as np
import pytest

from features.contracts import ContractConfig
from features.exchanges import CME, EUREX, last_trading_day, trading_days
from features.rolls import front_rows

HOUR = 3_600_000_000_000


def utc(text: str) -> int:
    return int(np.datetime64(text, "ns").astype(np.int64))


@pytest.mark.parametrize(("root", "year", "month", "expires"), [
    ("ES", 2025, 3, "2025-03-21"),  # the third Friday of the contract month
    ("CL", 2025, 1, "2024-12-19"),  # 3 business days before the 25th of the month before; the 25th is Christmas
    ("MCL", 2021, 8, "2021-07-19"),  # the business day before crude's (2021-07-20)
    ("NG", 2024, 1, "2023-12-27"),  # 3 business days before the first of the contract month
    ("QG", 2019, 2, "2019-01-28"),  # the business day before natural gas's (2019-01-29)
    ("ZN", 2024, 3, "2024-03-19"),  # 7 business days before the last, 2024-03-28 (Good Friday closes CBOT)
    ("ZF", 2019, 12, "2019-12-31"),  # the last business day of the contract month
    ("6E", 2024, 3, "2024-03-18"),  # 2 business days before the third Wednesday
    ("GC", 2024, 2, "2024-02-27"),  # the third last business day of the contract month
    ("MHG", 2022, 7, "2022-06-28"),  # ... of the month before: micro copper settles in cash
    ("ZW", 2024, 3, "2024-03-14"),  # the business day before the 15th
    ("HE", 2019, 4, "2019-04-12"),  # the tenth business day of the contract month
    ("FDAX", 2024, 3, "2024-03-15"),  # Eurex: the third Friday
    ("FGBL", 2019, 3, "2019-03-07"),  # 2 exchange days before delivery: the 10th is a Sunday, so the 11th
])
def test_last_trading_days_follow_each_exchanges_rule_and_holidays(root: str, year: int, month: int,
                                                                    expires: str) -> None:
    assert last_trading_day(root, year, month) == expires


def test_a_root_the_table_lacks_has_no_built_in_expiration() -> None:
    assert last_trading_day("XY", 2025, 3) is None


def test_the_trading_day_is_the_exchanges() -> None:
    """Globex's day begins at 17:00 Chicago (CST or CDT) the evening before; Eurex's is the Frankfurt date."""
    day = {name: int(np.datetime64(name, "D").astype(np.int64)) for name in ("2025-03-03", "2025-03-04",
                                                                             "2025-03-10", "2025-03-11")}
    globex = [utc("2025-03-02T23:00"), utc("2025-03-03T21:59"), utc("2025-03-03T23:00"),
              utc("2025-03-10T20:30"), utc("2025-03-10T22:00")]  # Sunday's open; Monday's close; Monday's open ...
    assert trading_days(np.array(globex), CME).tolist() == [day["2025-03-03"], day["2025-03-03"], day["2025-03-04"],
                                                            day["2025-03-10"], day["2025-03-11"]]  # ... in CDT
    eurex = [utc("2025-03-03T07:00"), utc("2025-03-03T22:59"), utc("2025-03-03T23:30")]
    assert trading_days(np.array(eurex), EUREX).tolist() == [day["2025-03-03"], day["2025-03-03"], day["2025-03-04"]]


def test_a_calendar_roll_begins_at_the_globex_sessions_open() -> None:
    """ESH5 expires 2025-03-21 (built in); `calendar:2` rolls when two sessions are left, in the session of
    Wednesday 2025-03-19, which opens at 17:00 Chicago (22:00 UTC in CDT) on Tuesday: ESM5's first bar as front."""
    hours = np.arange(utc("2025-03-16T22:00"), utc("2025-03-21T21:00"), HOUR)
    hours = hours[(hours - utc("2025-03-16T21:00")) % (24 * HOUR) != 0]  # the daily halt, 16:00-17:00 Chicago
    ts = np.concatenate([hours, hours])
    code = np.repeat([0, 1], hours.size)
    cfg = ContractConfig("calendar:2", expirations=(("ESH5", "2025-03-21"), ("ESM5", "2025-06-20")),
                         exchange_days=True)
    price = np.full(ts.size, 5000.0)
    front = front_rows(ts, code, ["ESH5", "ESM5"], price, price, np.ones(ts.size), cfg, "UTC", "ES")
    assert [(old, new, str(np.datetime64(t, "ns"))[:16]) for old, new, t in front.rolls] == [
        ("ESH5", "ESM5", "2025-03-18T22:00")]
    calendar_days = ContractConfig("calendar:2", expirations=cfg.expirations)  # a model from before: UTC dates
    before = front_rows(ts, code, ["ESH5", "ESM5"], price, price, np.ones(ts.size), calendar_days, "UTC", "ES")
    assert [str(np.datetime64(t, "ns"))[:16] for _, _, t in before.rolls] == ["2025-03-19T00:00"]
