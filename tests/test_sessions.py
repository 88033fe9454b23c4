"""Trading hours learnt from the bars, and future bar times inside them: a forecast made on Friday afternoon is
of Monday's bars, not of Friday night's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from features.calendar import HOUR_NS, NS_PER_DAY, known_features
from features.config import FeatureConfig
from features.known import future_known
from features.schema import DECODER_KNOWN
from features.sessions import MINUTE_NS, learn_hours, next_bar_times
from tests.conftest import write_parquet
from trainer.config import TrainConfig
from trainer.data import prepare

CHICAGO = "America/Chicago"
MONDAY_NS = 19_723 * NS_PER_DAY  # 2024-01-01, a Monday (00:00 UTC; CST is UTC-6)
CST = 6 * HOUR_NS


def day_session_bars(weeks: int, skip_days: tuple[int, ...] = ()) -> np.ndarray:
    """Hourly bar times of a day session, 08:00-13:00 Chicago (six bars), Monday to Friday, in winter (CST)."""
    days = [w * 7 + d for w in range(weeks) for d in range(5) if w * 7 + d not in skip_days]
    return np.array([MONDAY_NS + day * NS_PER_DAY + CST + h * HOUR_NS for day in days for h in range(8, 14)],
                    dtype=np.int64)


def test_the_hours_are_the_slots_the_bars_fill_in_most_weeks() -> None:
    ts = day_session_bars(weeks=10, skip_days=(2, 15, 30))  # three holidays
    stray = MONDAY_NS + 5 * NS_PER_DAY + CST + 20 * HOUR_NS  # one Saturday-evening print
    hours = learn_hours(np.sort(np.append(ts, stray)), HOUR_NS, CHICAGO)
    assert hours == ",".join(f"{d * 1440 + 480}-{d * 1440 + 840}" for d in range(5))  # 08:00-14:00, Mon-Fri


def test_nothing_is_learnt_from_bars_at_every_hour_or_too_few_weeks() -> None:
    every = MONDAY_NS + np.arange(8 * 7 * 24, dtype=np.int64) * HOUR_NS
    assert learn_hours(every, HOUR_NS, "UTC") == ""
    assert learn_hours(day_session_bars(weeks=2), HOUR_NS, CHICAGO) == ""
    assert learn_hours(every, 7 * MINUTE_NS + 1, "UTC") == ""  # off the week's grid of minutes


def test_future_bars_skip_the_close_the_weekend_and_a_gap_in_the_session() -> None:
    hours = learn_hours(day_session_bars(weeks=6), HOUR_NS, CHICAGO)
    friday_13 = MONDAY_NS + 4 * NS_PER_DAY + CST + 13 * HOUR_NS
    thursday_12 = friday_13 - NS_PER_DAY - HOUR_NS
    got = next_bar_times(np.array([friday_13, thursday_12]), HOUR_NS, 8, CHICAGO, np.array([hours, hours]))
    monday = MONDAY_NS + 7 * NS_PER_DAY + CST
    np.testing.assert_array_equal(got[0], monday + np.array([8, 9, 10, 11, 12, 13, 24 + 8, 24 + 9]) * HOUR_NS)
    np.testing.assert_array_equal(got[1] - thursday_12, np.array([1, 20, 21, 22, 23, 24, 25, 92]) * HOUR_NS)
    nominal = next_bar_times(np.array([friday_13]), HOUR_NS, 3, CHICAGO, np.array([""]))
    np.testing.assert_array_equal(nominal[0], friday_13 + np.arange(1, 4) * HOUR_NS)


def globex_hours() -> str:
    """CME Globex's week learnt from hourly bars: Sunday 17:00 to Friday 16:00 Chicago, halted 16:00-17:00 daily."""
    sunday_17 = MONDAY_NS - 7 * HOUR_NS + CST
    week = [sunday_17 + h * HOUR_NS for h in range(5 * 24 - 1) if h % 24 != 23]  # no bar in the halt's hour
    return learn_hours(np.array([t + w * 7 * NS_PER_DAY for w in range(6) for t in week]), HOUR_NS, CHICAGO)


def chicago(stamp: str) -> int:
    return int(np.datetime64(stamp, "ns").astype(np.int64)) + CST  # a winter (CST) time in Chicago, as UTC ns


@pytest.mark.parametrize(("last", "expected"), [
    # Christmas 2022 (a Sunday) is kept on Monday the 26th: Globex reopens for Tuesday's session that evening
    ("2022-12-23T15:00", ["2022-12-26T17:00", "2022-12-26T18:00", "2022-12-26T19:00"]),
    # Thanksgiving: equity futures stop at 12:00 and reopen at 17:00 for Friday's session
    ("2022-11-24T10:00", ["2022-11-24T11:00", "2022-11-24T17:00", "2022-11-24T18:00"]),
])
def test_future_bars_skip_the_exchanges_holidays_and_early_closes(last: str, expected: list[str]) -> None:
    hours = globex_hours()
    got = next_bar_times(np.array([chicago(last)] * 2), HOUR_NS, 3, CHICAGO, np.array([hours] * 2),
                         np.array(["MES", "XYZ"]))  # XYZ: a root without an exchange calendar
    np.testing.assert_array_equal(got[0], [chicago(t) for t in expected])
    weekly = next_bar_times(np.array([chicago(last)]), HOUR_NS, 3, CHICAGO, np.array([hours]))[0]
    np.testing.assert_array_equal(got[1], weekly)
    assert not np.array_equal(weekly, got[0])


@pytest.mark.parametrize(("last_utc", "open_utc"), [
    ("2022-11-04T20:00", "2022-11-06T23:00"),  # Friday 15:00 CDT; daylight saving time ends: Sunday 17:00 CST
    ("2023-03-10T21:00", "2023-03-12T22:00"),  # Friday 15:00 CST; daylight saving time begins: Sunday 17:00 CDT
])
def test_the_weekend_ends_at_the_local_open_across_a_daylight_saving_change(last_utc: str, open_utc: str) -> None:
    last = np.datetime64(last_utc, "ns").astype(np.int64)
    got = next_bar_times(np.array([last]), HOUR_NS, 2, CHICAGO, np.array([globex_hours()]))
    opens = np.datetime64(open_utc, "ns").astype(np.int64)
    np.testing.assert_array_equal(got[0], [opens, opens + HOUR_NS])


def test_a_config_keeps_its_hours_and_one_stored_without_them_forecasts_every_interval() -> None:
    hours = learn_hours(day_session_bars(weeks=6), HOUR_NS, CHICAGO)
    config = FeatureConfig(horizon=3, calendar_tz=CHICAGO, trading_hours=(("HE", hours),))
    assert FeatureConfig.from_dict(config.to_dict()) == config
    stored = FeatureConfig(horizon=3, calendar_tz=CHICAGO).to_dict()
    assert "trading_hours" not in stored
    friday_13 = np.array([MONDAY_NS + 4 * NS_PER_DAY + CST + 13 * HOUR_NS])
    old = future_known(friday_13, FeatureConfig.from_dict(stored), HOUR_NS, np.array(["HE"]))
    np.testing.assert_array_equal(old[0], known_features(friday_13 + np.arange(1, 4) * HOUR_NS, CHICAGO))
    other = future_known(friday_13, config, HOUR_NS, np.array(["ES"]))  # a series without hours
    np.testing.assert_array_equal(other, old)


@pytest.fixture(scope="module")
def session_bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ts = day_session_bars(weeks=9)  # winter: every bar 08:00-13:00 CST
    close = 100.0 * np.exp(np.cumsum(1e-3 * np.random.default_rng(0).standard_normal(ts.size)))
    return write_parquet(tmp_path_factory.mktemp("sessions") / "bars.parquet", {
        "timestamp": ts, "symbol": ["HE"] * ts.size, "open": close, "high": close * 1.001, "low": close * 0.999,
        "close": close, "volume": np.full(ts.size, 10.0)})


def test_training_learns_the_hours_and_its_windows_see_the_real_next_bars(session_bars: Path) -> None:
    cfg = TrainConfig(encoder_length=12, horizon=8, val_fraction=0.3, threads=1, device="cpu", calendar_tz=CHICAGO)
    data = prepare(session_bars, cfg)
    frame = data.frame
    assert dict(frame.config.trading_hours)["HE"] == learn_hours(day_session_bars(weeks=6), HOUR_NS, CHICAGO)
    anchors = data.train_anchors[-40:]
    decoder = data.tensors.batch(torch.from_numpy(anchors))[DECODER_KNOWN].numpy()  # [W, H, n_known]
    real_next = frame.timestamp_ns[anchors[:, None] + np.arange(1, 9)]  # [W, H] the bars that came
    np.testing.assert_array_equal(decoder[..., :4], known_features(real_next, CHICAGO))
