"""Feature values against hand-computed ones, no look-ahead, windows, normalisation, schema."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from conftest import write_parquet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features import FeatureConfig, FeatureSchema, NormStats, build_frame, calendar, compute, known_features, read_bars
from features.bars import Bars, ColumnBlock, block_for
from features.calendar import NS_PER_DAY, future_timestamps
from features.compute import FeatureFrame, latest_windows
from features.config import BUILTIN_KNOWN, BUILTIN_OBSERVED
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL, TARGET
from features.windows import anchor_rows, gather_windows

MINUTE = 60 * 10**9
CONFIG = FeatureConfig(horizon=3, volatility_window=3, user_columns=("imbalance",))


def ns(year: int, month: int, day: int, hour: int, minute: int) -> int:
    return int(datetime(year, month, day, hour, minute, tzinfo=UTC).timestamp()) * 10**9


# ---- the tiny frame: two series written by hand ----------------------------------------------
# A: 16 one-minute bars from Monday 2024-01-01 06:00 UTC; B: 14 bars from Friday 2024-01-05 23:55 UTC
# (crossing midnight into Saturday). The file holds B before A, to be regrouped by symbol.
A_CLOSE = [100, 101, 100.5, 102, 101, 103, 104, 103.5, 105, 104, 106, 107, 106.5, 108, 107, 109]
A_VOLUME = [10, 5, 5, 7, 0, 9, 12, 4, 6, 8, 2, 11, 5, 7, 9, 1]
B_CLOSE = [50, 49.5, 50.25, 51, 50.5, 50.75, 52, 51.5, 51, 52.5, 53, 52, 52.75, 53.5]
B_VOLUME = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
A_T0 = ns(2024, 1, 1, 6, 0)
B_T0 = ns(2024, 1, 5, 23, 55)


def series(close: Sequence[float], volume: Sequence[float], t0: int, first_open: float) -> dict[str, np.ndarray]:
    c = np.array(close, dtype=np.float64)
    o = np.concatenate([[first_open], c[:-1]])
    return {
        "timestamp": t0 + np.arange(c.size, dtype=np.int64) * MINUTE,
        "open": o,
        "high": np.maximum(o, c) + 0.5,
        "low": np.minimum(o, c) - 0.25,
        "close": c,
        "volume": np.array(volume, dtype=np.float64),
        "imbalance": np.sin(np.arange(c.size)),
    }


A = series(A_CLOSE, A_VOLUME, A_T0, 99.5)
B = series(B_CLOSE, B_VOLUME, B_T0, 50.5)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cols = {k: np.concatenate([B[k], A[k]]) for k in A}
    cols["symbol"] = np.array(["B"] * len(B_CLOSE) + ["A"] * len(A_CLOSE), dtype=object)
    return write_parquet(tmp_path_factory.mktemp("tiny") / "tiny.parquet", cols)


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> FeatureFrame:
    return build_frame(read_bars(tiny_path, user_columns=("imbalance",)), CONFIG)


def reference_observed(s: dict[str, np.ndarray], window: int) -> np.ndarray:
    """Row by row, in plain Python: the features as the contract defines them."""
    n = s["close"].size
    out = np.full((n, 6), np.nan)
    ret = [math.nan] + [math.log(s["close"][i] / s["close"][i - 1]) for i in range(1, n)]
    for i in range(window, n):
        out[i] = [
            ret[i],
            math.log(s["high"][i] / s["low"][i]),
            math.log(s["close"][i] / s["open"][i]),
            math.log(1 + s["volume"][i]),
            statistics.pstdev(ret[i - window + 1 : i + 1]),
            s["imbalance"][i],
        ]
    return out


def reference_targets(close: Sequence[float], horizon: int) -> np.ndarray:
    n = len(close)
    return np.array([[math.log(close[i + h] / close[i]) if i + h < n else math.nan for h in range(1, horizon + 1)]
                     for i in range(n)])


def test_layout_of_the_tiny_frame(tiny: FeatureFrame) -> None:
    assert tiny.symbols == ["A", "B"]
    np.testing.assert_array_equal(tiny.series_bounds, [[0, 16], [16, 30]])
    np.testing.assert_array_equal(tiny.series_id, [0] * 16 + [1] * 14)
    assert tiny.bar_interval_ns == MINUTE
    assert tiny.schema.observed == [*BUILTIN_OBSERVED, "imbalance"]
    assert tiny.observed.shape == (30, 6) and tiny.observed.dtype == np.float32
    assert tiny.known.shape == (30, 4) and tiny.targets.shape == (30, 3)


@pytest.mark.parametrize(("name", "rows", "s"), [("A", slice(0, 16), A), ("B", slice(16, 30), B)])
def test_observed_features_match_hand_computed(tiny: FeatureFrame, name: str, rows: slice,
                                               s: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(tiny.observed[rows], reference_observed(s, 3), rtol=2e-6, atol=1e-7)


def test_literal_values(tiny: FeatureFrame) -> None:
    # A row 3: close 100.5 -> 102, open 100.5, high 102.5, low 100.25, volume 7
    log_return, log_range, log_body, log_volume, volatility, _ = tiny.observed[3]
    assert log_return == pytest.approx(0.014815085, rel=1e-6)  # ln(102 / 100.5)
    assert log_range == pytest.approx(0.022195745, rel=1e-6)  # ln(102.5 / 100.25)
    assert log_body == pytest.approx(0.014815085, rel=1e-6)  # ln(102 / 100.5)
    assert log_volume == pytest.approx(2.0794415, rel=1e-6)  # ln(1 + 7)
    # returns of rows 1..3: ln(101/100), ln(100.5/101), ln(102/100.5) = 0.0099503, -0.0049628, 0.0148151
    assert volatility == pytest.approx(0.0084145, rel=1e-4)  # their population std
    assert tiny.observed[4, 3] == 0.0  # zero volume: ln(1 + 0)
    np.testing.assert_allclose(tiny.targets[0], [0.0099503309, 0.0049875415, 0.0198026273], rtol=1e-6)


def test_warm_up_rows_are_nan_and_only_those(tiny: FeatureFrame) -> None:
    for s, e in tiny.series_bounds:
        assert np.isnan(tiny.observed[s : s + 3]).all()
        assert np.isfinite(tiny.observed[s + 3 : e]).all()
    assert CONFIG.warmup_bars == 3


def test_no_return_or_volatility_across_a_symbol_boundary(tiny: FeatureFrame, tiny_path: Path) -> None:
    # B alone gives B's features exactly: nothing of A's last bars leaks into B's first ones
    bars = read_bars(tiny_path, user_columns=("imbalance",))
    b_rows = bars.series_slices()["B"]
    alone = Bars(bars.timestamp_ns[b_rows], bars.symbol[b_rows], bars.open[b_rows], bars.high[b_rows],
                 bars.low[b_rows], bars.close[b_rows], bars.volume[b_rows],
                 {"imbalance": bars.user["imbalance"][b_rows]})
    for window in (1, 3):
        cfg = FeatureConfig(horizon=3, volatility_window=window, user_columns=("imbalance",))
        both, one = build_frame(bars, cfg), build_frame(alone, cfg)
        np.testing.assert_array_equal(both.observed[16:], one.observed)
        np.testing.assert_array_equal(both.targets[16:], one.targets)
    # with window 1 only the first bar of each series is warm-up; row 16 has no return from A's last close
    w1 = build_frame(bars, FeatureConfig(horizon=3, volatility_window=1))
    assert np.isnan(w1.observed[16]).all() and np.isfinite(w1.observed[17]).all()
    assert w1.observed[17, 0] == pytest.approx(math.log(49.5 / 50), rel=1e-6)
    assert w1.observed[17, 4] == 0.0  # std of one return


def test_targets_and_nan_past_the_series_end(tiny: FeatureFrame) -> None:
    np.testing.assert_allclose(tiny.targets[:16], reference_targets(A_CLOSE, 3), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(tiny.targets[16:], reference_targets(B_CLOSE, 3), rtol=1e-6, atol=1e-8)
    assert np.isnan(tiny.targets[15]).all()  # A's last bar: B's first bars are not its future
    assert np.isnan(tiny.targets[14, 1:]).all() and np.isfinite(tiny.targets[14, 0])
    assert np.isfinite(tiny.targets[:13]).all()


def test_calendar_features_of_known_timestamps() -> None:
    s = math.sin
    c = math.cos
    tau = 2 * math.pi
    cases = {
        ns(2024, 1, 1, 6, 0): [1.0, 0.0, 0.0, 1.0],  # Monday 06:00: a quarter of the day, weekday 0
        ns(2024, 1, 1, 18, 0): [-1.0, 0.0, 0.0, 1.0],  # Monday 18:00
        ns(2024, 1, 3, 12, 0): [0.0, -1.0, s(tau * 2 / 7), c(tau * 2 / 7)],  # Wednesday noon
        ns(2024, 1, 7, 0, 0): [0.0, 1.0, s(tau * 6 / 7), c(tau * 6 / 7)],  # Sunday midnight
        ns(2024, 1, 5, 14, 30): [s(tau * 14.5 / 24), c(tau * 14.5 / 24), s(tau * 4 / 7), c(tau * 4 / 7)],  # Friday
        ns(1969, 12, 31, 0, 0): [0.0, 1.0, s(tau * 2 / 7), c(tau * 2 / 7)],  # before the epoch: a Wednesday
    }
    got = known_features(np.array(list(cases)))
    assert got.shape == (len(cases), len(BUILTIN_KNOWN)) and got.dtype == np.float32
    np.testing.assert_allclose(got, np.array(list(cases.values())), atol=1e-6)
    # any leading shape
    assert known_features(np.zeros((2, 3), dtype=np.int64)).shape == (2, 3, 4)


@pytest.mark.parametrize(("tz", "years"), [("America/Chicago", (2019, 2026)), ("Europe/London", (2019, 2026)),
                                           ("Asia/Kathmandu", (2019, 2026)), ("Australia/Lord_Howe", (2019, 2026)),
                                           ("America/Sao_Paulo", (2017, 2020)), ("America/St_Johns", (2006, 2012))])
def test_utc_offsets_match_the_zone_database_at_every_bar(tz: str, years: tuple[int, int]) -> None:
    """Every minute of the days around each offset change of those years (Lord Howe shifts by 30 minutes,
    Kathmandu sits at +5:45, Sao Paulo dropped DST in 2019, St. John's changed at 00:01 local until 2011,
    not on a quarter hour), and random times over 1975-2060, against Python's zoneinfo one timestamp at a
    time; any leading shape."""
    zone = ZoneInfo(tz)
    rng = np.random.default_rng(5)
    spread = rng.integers(ns(1975, 1, 1, 0, 0), ns(2060, 1, 1, 0, 0), size=5000)
    minutes = np.arange(ns(years[0], 1, 1, 0, 0), ns(years[1], 1, 1, 0, 0), 60 * 10**9)
    offsets = np.array([zone.utcoffset(datetime.fromtimestamp(int(t) // 10**9, zone)).total_seconds()
                        for t in minutes[::60]])  # hourly, to find the changes
    changes = np.flatnonzero(np.diff(offsets)) * 60  # minute index of each change
    assert changes.size >= {"Asia/Kathmandu": 0, "America/Sao_Paulo": 4}.get(tz, 12)
    near = np.concatenate([minutes[max(0, c - 1440):c + 1440] for c in changes] + [spread])
    got = calendar.utc_offset_ns(near, tz)
    want = np.array([zone.utcoffset(datetime.fromtimestamp(int(t) // 10**9, zone)).total_seconds() * 10**9
                     for t in near], dtype=np.int64)
    np.testing.assert_array_equal(got, want)
    centuries = np.array([ns(1700, 6, 1, 12, 0), ns(2250, 6, 1, 12, 0), *near[:50:10]])  # beyond 100,000 days
    want_c = [zone.utcoffset(datetime.fromtimestamp(int(t) // 10**9, zone)).total_seconds() * 10**9 for t in centuries]
    np.testing.assert_array_equal(calendar.utc_offset_ns(centuries, tz), want_c)
    spread_2d = near[-12:].reshape(3, 4)  # any leading shape
    np.testing.assert_array_equal(calendar.utc_offset_ns(spread_2d, tz), want[-12:].reshape(3, 4))
    for t in near[::50]:  # a window of a few hours around each: the shortcut of one offset for all
        window = t + np.arange(-120, 120) * 60 * 10**9
        want = [zone.utcoffset(datetime.fromtimestamp(int(w) // 10**9, zone)).total_seconds() * 10**9 for w in window]
        np.testing.assert_array_equal(np.broadcast_to(calendar.utc_offset_ns(window, tz), window.shape), want)


def test_utc_offsets_of_a_servers_batch_each_series_on_its_own() -> None:
    """A batch [B, n] of series months apart (one offset each, told row by row), and one whose bars cross a
    change (the whole batch then takes the general way): every offset as zoneinfo has it."""
    zone = ZoneInfo("America/Chicago")
    minute = 60 * 10**9
    starts = [ns(2024, 1, 8, 14, 0), ns(2024, 7, 8, 13, 0), ns(2024, 12, 2, 15, 0)]
    batch = np.array([t + np.arange(40) * minute for t in starts])  # [3, 40]
    crossing = ns(2024, 3, 10, 7, 40) + np.arange(40) * minute  # 2024-03-10 08:00 UTC: CST -> CDT
    for b in (batch, np.vstack([batch, crossing])):
        got = np.broadcast_to(calendar.utc_offset_ns(b, "America/Chicago"), b.shape)
        want = [[zone.utcoffset(datetime.fromtimestamp(int(t) // 10**9, zone)).total_seconds() * 10**9 for t in row]
                for row in b]
        np.testing.assert_array_equal(got, want)
    assert len(set(np.broadcast_to(calendar.utc_offset_ns(batch, "America/Chicago"), batch.shape)[:, 0])) == 2


def test_a_day_offset_table_answers_on_its_days_and_refuses_others() -> None:
    """DayOffsets (a training run's zone table, and utc_offset_ns's long spans) gives the zone's offsets on the
    days it holds, contiguous or not."""
    tz, day = "America/Chicago", 86_400
    first, last = 19_000, 19_400  # 2022-01-08 .. 2023-02-12: both of 2022's changes
    table = calendar.DayOffsets.span(tz, first, last)
    seconds = np.arange(first * day, (last + 1) * day, 1_799)
    want = np.array([calendar._offset_ns(tz, int(x)) for x in seconds])
    np.testing.assert_array_equal(table.at(seconds), want)
    sparse = calendar.DayOffsets(tz, np.array([first, 19_066, last]))  # 2022-03-13, a change day, in the middle
    on_days = np.concatenate([np.arange(d * day, (d + 1) * day, 601) for d in (first, 19_066, last)])
    np.testing.assert_array_equal(sparse.at(on_days), [calendar._offset_ns(tz, int(x)) for x in on_days])


def test_calendar_features_in_an_exchange_time_zone_keep_the_session_open_through_daylight_saving() -> None:
    """CME's 08:30 Chicago open is 14:30 UTC in January and 13:30 UTC in July: in UTC its time of day moves
    by an hour; with calendar_tz America/Chicago it stays put, and the day of week is Chicago's."""
    winter, summer = ns(2024, 1, 8, 14, 30), ns(2024, 7, 8, 13, 30)  # both Monday 08:30 in Chicago
    utc = known_features(np.array([winter, summer]))
    assert not np.allclose(utc[0, :2], utc[1, :2])
    local = known_features(np.array([winter, summer]), "America/Chicago")
    np.testing.assert_array_equal(local[0], local[1])
    tau = 2 * math.pi
    np.testing.assert_allclose(local[0], [math.sin(tau * 8.5 / 24), math.cos(tau * 8.5 / 24), 0.0, 1.0], atol=1e-6)
    sunday_evening = known_features(np.array([ns(2024, 1, 8, 0, 0)]), "America/Chicago")  # 18:00 Sunday there
    np.testing.assert_allclose(sunday_evening[0, 2:], [math.sin(tau * 6 / 7), math.cos(tau * 6 / 7)], atol=1e-6)
    np.testing.assert_array_equal(known_features(np.array([winter]), "UTC"), utc[:1])  # UTC: as before
    with pytest.raises(ValueError, match="'Mars/Olympus' is not an IANA time zone name"):
        FeatureConfig(calendar_tz="Mars/Olympus")
    cfg = FeatureConfig(calendar_tz="America/Chicago")
    assert FeatureConfig.from_dict(cfg.to_dict()) == cfg


def test_known_features_are_float64_sin_cos_rounded_once_to_float32() -> None:
    """Bit for bit what exported models were trained on: sin and cos in float64 over the whole array,
    then one rounding to float32 (not float32 arithmetic, not per element)."""
    ts = np.random.default_rng(3).integers(-10**18, 4 * 10**18, size=(1001, 3))
    tod = (ts % NS_PER_DAY).astype(np.float64) / NS_PER_DAY
    dow = ((ts // NS_PER_DAY + 3) % 7).astype(np.float64) / 7.0
    tau = 2 * np.pi
    expected = np.stack([np.sin(tau * tod), np.cos(tau * tod), np.sin(tau * dow), np.cos(tau * dow)], axis=-1)
    got = known_features(ts)
    assert got.dtype == np.float32 and got.shape == (1001, 3, 4)
    assert got.tobytes() == expected.astype(np.float32).tobytes()
    assert known_features(ts[:1, 0]).tobytes() == got[:1, 0].tobytes()  # a row's values do not depend on the rest


def test_known_features_of_the_frame_are_the_calendar_of_each_bar(tiny: FeatureFrame) -> None:
    np.testing.assert_array_equal(tiny.known, known_features(tiny.timestamp_ns))
    np.testing.assert_allclose(tiny.known[0], [1.0, 0.0, 0.0, 1.0], atol=1e-6)  # A: Monday 06:00
    # B's 6th bar is Saturday 00:00: weekday 5
    assert tiny.timestamp_ns[16 + 5] == ns(2024, 1, 6, 0, 0)
    np.testing.assert_allclose(tiny.known[16 + 5], [0.0, 1.0, math.sin(2 * math.pi * 5 / 7),
                                                     math.cos(2 * math.pi * 5 / 7)], atol=1e-6)


def test_vocabulary_is_fixed_by_the_caller(tiny_path: Path) -> None:
    bars = read_bars(tiny_path, user_columns=("imbalance",))
    frame = build_frame(bars, CONFIG, symbols=["Z", "B", "A"])
    assert frame.symbols == ["Z", "B", "A"]
    np.testing.assert_array_equal(frame.series_id, [2] * 16 + [1] * 14)
    with pytest.raises(ValueError, match="unknown symbol"):
        build_frame(bars, CONFIG, symbols=["A"])


def test_volatility_matches_a_direct_rolling_std_on_sample_data(sample_bars: Path) -> None:
    window = 20
    frame = build_frame(read_bars(sample_bars), FeatureConfig(volatility_window=window))
    for s, e in frame.series_bounds:
        c = frame.close[s:e]
        ret = np.diff(np.log(c))  # returns of rows s+1 .. e-1
        direct = np.lib.stride_tricks.sliding_window_view(ret, window).std(axis=1)  # rows s+window .. e-1
        np.testing.assert_allclose(frame.observed[s + window : e, 4], direct, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(frame.observed[s + window : e, 0], ret[window - 1 :], rtol=1e-5, atol=1e-9)


# ---- no look-ahead -----------------------------------------------------------------------------


def bars_copy(bars: Bars, keep: np.ndarray | None = None) -> Bars:
    k = slice(None) if keep is None else keep
    return Bars(bars.timestamp_ns[k].copy(), bars.symbol[k].copy(), bars.open[k].copy(), bars.high[k].copy(),
                bars.low[k].copy(), bars.close[k].copy(), bars.volume[k].copy(),
                {u: v[k].copy() for u, v in bars.user.items()})


@pytest.fixture(scope="module")
def sample(sample_bars: Path) -> Bars:
    return read_bars(sample_bars)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=50, max_value=2999), seed=st.integers(0, 2**32 - 1), truncate=st.booleans())
def test_no_look_ahead(sample: Bars, cut: int, seed: int, truncate: bool) -> None:
    """Changing (or dropping) every bar after time t changes no feature and no encoder input at <= t;
    only targets may change."""
    cfg = FeatureConfig(horizon=4, volatility_window=5)
    t = sample.timestamp_ns[cut]  # the sample's series share one calendar
    after = sample.timestamp_ns > t
    if truncate:
        changed = bars_copy(sample, ~after)
    else:
        changed = bars_copy(sample)
        rng = np.random.default_rng(seed)
        k = int(after.sum())
        scale = np.exp(rng.normal(0, 0.05, k))
        for name in ("open", "high", "low", "close"):
            getattr(changed, name)[after] *= scale
        changed.volume[after] = rng.integers(0, 10_000, k)
    base, other = build_frame(sample, cfg), build_frame(changed, cfg)
    keep_base = base.timestamp_ns <= t
    keep_other = other.timestamp_ns <= t
    np.testing.assert_array_equal(base.timestamp_ns[keep_base], other.timestamp_ns[keep_other])
    np.testing.assert_array_equal(base.observed[keep_base], other.observed[keep_other])
    np.testing.assert_array_equal(base.known[keep_base], other.known[keep_other])
    assert base.bar_interval_ns == other.bar_interval_ns
    # windows ending at <= t: every model input equal
    L = 8
    a_base = anchor_rows(base, L, require_targets=False)
    a_other = anchor_rows(other, L, require_targets=False)
    a_base, a_other = a_base[keep_base[a_base]], a_other[keep_other[a_other]]
    assert a_base.size == a_other.size
    wb, wo = gather_windows(base, a_base, L), gather_windows(other, a_other, L)
    for name in (STATIC_CATEGORICAL, ENCODER_OBSERVED, ENCODER_KNOWN, DECODER_KNOWN):
        np.testing.assert_array_equal(wb[name], wo[name])
    # the perturbation did reach the future: targets of the bar at t change
    if cut < 2999:
        assert not np.array_equal(base.targets[base.timestamp_ns == t], other.targets[other.timestamp_ns == t],
                                  equal_nan=True)


# ---- windows -------------------------------------------------------------------------------------


@pytest.mark.parametrize("require_targets", [True, False])
def test_anchors_never_cross_a_boundary_or_start_in_warm_up(tiny: FeatureFrame, require_targets: bool) -> None:
    L, H = 4, CONFIG.horizon
    anchors = anchor_rows(tiny, L, require_targets)
    ends = 0 if not require_targets else H
    # A: rows 0..15, warm-up 3: first anchor 3 + 4 - 1 = 6; B: rows 16..29 -> 22
    expected = [*range(6, 16 - ends), *range(22, 30 - ends)]
    np.testing.assert_array_equal(anchors, expected)
    for a in anchors:
        start, end = next((s, e) for s, e in tiny.series_bounds if s <= a < e)
        assert a - L + 1 >= start + CONFIG.warmup_bars
        assert a < end - (H if require_targets else 0)
    w = gather_windows(tiny, anchors, L)
    assert np.isfinite(w[ENCODER_OBSERVED]).all()
    if require_targets:
        assert np.isfinite(w[TARGET]).all()


def test_anchor_row_range(tiny: FeatureFrame) -> None:
    # per-series [lo, hi): A rows 8..12, B rows 16..28; targets must lie inside too
    anchors = anchor_rows(tiny, 4, True, (np.array([8, 16]), np.array([13, 29])))
    np.testing.assert_array_equal(anchors, [8, 9, *range(22, 26)])
    assert anchor_rows(tiny, 20).size == 0  # longer than any series


def test_gather_windows_shapes_and_values(tiny: FeatureFrame) -> None:
    L, H = 4, CONFIG.horizon
    anchors = np.array([6, 12, 22, 26])
    w = gather_windows(tiny, anchors, L)
    assert w[STATIC_CATEGORICAL].shape == (4, 1) and w[STATIC_CATEGORICAL].dtype == np.int64
    assert w[ENCODER_OBSERVED].shape == (4, L, 6) and w[ENCODER_OBSERVED].dtype == np.float32
    assert w[ENCODER_KNOWN].shape == (4, L, 4)
    assert w[DECODER_KNOWN].shape == (4, H, 4) and w[DECODER_KNOWN].dtype == np.float32
    assert w[TARGET].shape == (4, H)
    np.testing.assert_array_equal(w[STATIC_CATEGORICAL][:, 0], [0, 0, 1, 1])
    for b, a in enumerate(anchors):
        np.testing.assert_array_equal(w[ENCODER_OBSERVED][b], tiny.observed[a - L + 1 : a + 1])
        np.testing.assert_array_equal(w[ENCODER_KNOWN][b], tiny.known[a - L + 1 : a + 1])
        np.testing.assert_array_equal(w[TARGET][b], tiny.targets[a])
        future = tiny.timestamp_ns[a] + np.arange(1, H + 1) * tiny.bar_interval_ns
        np.testing.assert_array_equal(w[DECODER_KNOWN][b], known_features(future))
    # inside a series the decoder's nominal times are the next bars' real times
    np.testing.assert_array_equal(w[DECODER_KNOWN][0], tiny.known[7:10])
    np.testing.assert_array_equal(future_timestamps(np.array([0, 10]), 5, 2), [[5, 10], [15, 20]])


# ---- normalisation -------------------------------------------------------------------------------


def test_norm_stats_fit_on_a_slice_and_apply_to_another() -> None:
    x = np.array([[1.0, 5.0, 2.0], [3.0, 5.0, np.nan], [5.0, 5.0, 4.0], [100.0, -7.0, 1000.0]], dtype=np.float32)
    stats = NormStats.fit(x, slice(0, 3))  # the last row is outside the fitting slice
    np.testing.assert_allclose(stats.mean, [3.0, 5.0, 3.0])
    np.testing.assert_allclose(stats.std, [math.sqrt(8 / 3), 1.0, 1.0])  # NaN ignored; zero spread -> 1
    z = stats.apply(x[3:])
    assert z.dtype == np.float32
    np.testing.assert_allclose(z, [[97 / math.sqrt(8 / 3), -12.0, 997.0]], rtol=1e-6)
    assert np.isnan(stats.apply(x[1:2])[0, 2])  # NaN stays NaN
    rows = NormStats.fit(x, np.array([0, 2]))  # index arrays work too
    np.testing.assert_allclose(rows.mean, [3.0, 5.0, 3.0])
    np.testing.assert_allclose(rows.std, [2.0, 1.0, 1.0])


def test_norm_stats_fit_a_block_of_columns_at_a_time_as_all_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A training set's many columns are fitted a few at a time (memory): the same statistics as one block,
    for [N, C] and [N, H, C] arrays, rows by slice or index; a column with no value is named by its index."""
    import features.normalize

    rng = np.random.default_rng(5)
    x = rng.normal(3.0, 2.0, size=(500, 37)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    x[:, 5] = 7.0  # no spread
    cube = x.reshape(100, 5, 37)
    cases = [(x, None), (x, slice(10, 400)), (x, np.arange(0, 500, 3)), (cube, slice(0, 80))]
    monkeypatch.setattr(features.normalize, "COLUMNS_PER_BLOCK", 1000)
    whole = [NormStats.fit(a, rows) for a, rows in cases]
    monkeypatch.setattr(features.normalize, "COLUMNS_PER_BLOCK", 4)
    for (a, rows), want in zip(cases, whole, strict=True):
        got = NormStats.fit(a, rows)
        np.testing.assert_array_equal(got.mean, want.mean)
        np.testing.assert_array_equal(got.std, want.std)
    assert whole[0].std[5] == 1.0
    x[:, 2] = x[:, 30] = np.nan  # in two blocks: both named
    with pytest.raises(ValueError, match=r"column\(s\) \[2, 30\] have no finite value"):
        NormStats.fit(x)


def test_norm_stats_on_windows_and_round_trip(tiny: FeatureFrame) -> None:
    stats = NormStats.fit(tiny.observed, slice(0, 16))  # fitted on A, warm-up NaN ignored
    np.testing.assert_allclose(stats.mean, np.nanmean(tiny.observed[:16].astype(np.float64), axis=0), rtol=1e-5)
    np.testing.assert_allclose(stats.std, np.nanstd(tiny.observed[:16].astype(np.float64), axis=0), rtol=1e-5)
    w = gather_windows(tiny, np.array([22, 23]), 4)[ENCODER_OBSERVED]  # [B, L, C] from B
    np.testing.assert_allclose(stats.apply(w), (w - stats.mean) / stats.std, rtol=1e-6)
    back = NormStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    np.testing.assert_array_equal(back.mean, stats.mean)
    np.testing.assert_array_equal(back.std, stats.std)
    assert back.mean.dtype == np.float32
    with pytest.raises(ValueError, match="no finite value"):
        NormStats.fit(tiny.observed, slice(0, 3))  # warm-up only


# ---- schema --------------------------------------------------------------------------------------


def test_schema_round_trip() -> None:
    schema = CONFIG.schema()
    assert schema.static == ["symbol"]
    assert schema.observed == [*BUILTIN_OBSERVED, "imbalance"]
    assert schema.known == list(BUILTIN_KNOWN)
    assert schema.user_columns == ["imbalance"]
    back = FeatureSchema.from_list(json.loads(json.dumps(schema.to_list())))
    assert back == schema
    assert FeatureConfig.from_dict(json.loads(json.dumps(CONFIG.to_dict()))) == CONFIG
    assert FeatureConfig().schema() != schema
    with pytest.raises(ValueError, match="at least 1"):
        FeatureConfig(horizon=0)
    with pytest.raises(ValueError, match="at least 1"):
        FeatureConfig(volatility_window=0)


def test_features_import_without_torch() -> None:
    code = "import features, features.windows, features.check, features.synth, sys; assert 'torch' not in sys.modules"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr


def test_features_of_recent_bars_equal_those_of_the_whole_history(sample: Bars) -> None:
    """The server computes features from a series' last bars only: past the warm-up they must be the
    training features bit for bit (no dependence on earlier history through running sums)."""
    cfg = FeatureConfig(horizon=2, volatility_window=20)
    full = build_frame(sample, cfg)
    es = sample.series_slices()["ES"]
    assert es.stop - es.start - 2960 == 2 * cfg.volatility_window  # the last first: the few bars a server sees
    for first in (1, 777, 2900, 2960):
        keep = np.zeros(len(sample), dtype=bool)
        keep[es.start + first : es.stop] = True
        recent = build_frame(bars_copy(sample, keep), cfg, symbols=full.symbols)
        w = cfg.warmup_bars
        np.testing.assert_array_equal(recent.observed[w:], full.observed[es.start + first + w : es.stop])
        np.testing.assert_array_equal(recent.known, full.known[es.start + first : es.stop])


@pytest.mark.parametrize("window", [1, 2, 5, 20, 37])
def test_rolling_std_paths_agree_bit_for_bit(window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The few-bars (matrix) and long-history (loop) ways of the rolling std give the same bits, also
    with NaN, +-0 and series starts: a server's features are training's only if they do."""
    rng = np.random.default_rng(window)
    for n in (1, window - 1, window, window + 1, 40, 151, 2000):
        if n < 1:
            continue
        x = rng.normal(0.0, 0.01, n) * np.exp(rng.normal(0.0, 3.0, n))  # magnitudes over many octaves
        x[rng.random(n) < 0.05] = np.nan
        x[rng.random(n) < 0.05] = 0.0
        x[rng.random(n) < 0.05] = -0.0
        starts = np.zeros(n, dtype=np.int64)
        starts[n // 3:] = n // 3  # a second series from row n // 3
        monkeypatch.setattr(compute, "_SMALL_ROLLING_CELLS", 0)
        loop = compute._rolling_std(x, window, starts)
        monkeypatch.setattr(compute, "_SMALL_ROLLING_CELLS", 1 << 62)
        matrix = compute._rolling_std(x, window, starts)
        assert loop.tobytes() == matrix.tobytes(), (n, window)
        assert np.isnan(loop[: min(n, window - 1)]).all()


@pytest.mark.parametrize(("user_form", "tz"), [("none", "UTC"), ("columns", "America/Chicago"),
                                               ("block", "Asia/Kathmandu")])
def test_latest_windows_equal_the_training_windows_at_those_bars(sample: Bars, user_form: str, tz: str) -> None:
    """What a server computes from each series' last bars alone (`latest_windows`, B series at once) is
    bit for bit the window training cuts at the same bar from the whole history."""
    user_columns = () if user_form == "none" else ("u1", "u2")
    cfg = FeatureConfig(horizon=3, volatility_window=20, user_columns=user_columns, calendar_tz=tz)
    bars = bars_copy(sample)
    rng = np.random.default_rng(11)
    bars.user = {u: rng.normal(size=len(bars)) * 10.0 ** k for k, u in enumerate(user_columns)}
    full = build_frame(bars, cfg)
    L = 16
    n = cfg.warmup_bars + L
    ends = [e for sl in bars.series_slices().values() for e in (sl.start + n - 1, sl.start + 777, sl.stop - 1)]
    for picked in (ends[-1:], ends[:1], ends):  # a lone series, the earliest possible window, a batch
        anchors = np.array(picked, dtype=np.int64)  # [B]
        rows = anchors[:, None] + np.arange(-n + 1, 1)  # [B, n]  each window's last n bars
        flat = rows.reshape(-1)
        cols = [getattr(bars, c)[rows] for c in ("timestamp_ns", "open", "high", "low", "close", "volume")]
        user: np.ndarray | list[np.ndarray] = [bars.user[u][flat] for u in user_columns]
        if user_form == "block":
            user = np.array(user)  # [U, B * n]
        got = latest_windows(*cols, user, cfg, L, full.bar_interval_ns)
        want = gather_windows(full, anchors, L)
        for name, value in ((ENCODER_OBSERVED, got.encoder_observed), (ENCODER_KNOWN, got.encoder_known),
                            (DECODER_KNOWN, got.decoder_known)):
            assert value.dtype == want[name].dtype and value.shape == want[name].shape, name
            assert value.tobytes() == want[name].tobytes(), name
        assert np.isfinite(got.encoder_observed).all()
        np.testing.assert_array_equal(got.future_timestamp_ns,
                                      future_timestamps(full.timestamp_ns[anchors], full.bar_interval_ns, cfg.horizon))
    with pytest.raises(ValueError, match="at least 36"):
        latest_windows(*(c[:, 1:] for c in cols), [], FeatureConfig(horizon=3, volatility_window=20), L,
                       full.bar_interval_ns)


def test_a_frame_without_targets_has_the_same_features(sample: Bars) -> None:
    """What the server builds (targets=False, the model's bar interval) differs from training's frame
    in the targets alone, which stay NaN."""
    cfg = FeatureConfig(horizon=3, volatility_window=20)
    full = build_frame(sample, cfg)
    lean = build_frame(sample, cfg, bar_interval_ns=full.bar_interval_ns, targets=False)
    np.testing.assert_array_equal(lean.observed, full.observed)
    np.testing.assert_array_equal(lean.known, full.known)
    np.testing.assert_array_equal(lean.series_id, full.series_id)
    assert lean.bar_interval_ns == full.bar_interval_ns
    assert lean.targets.shape == full.targets.shape and np.isnan(lean.targets).all()
    assert np.isfinite(full.targets).any()


def test_a_column_block_is_a_read_only_mapping_of_its_rows() -> None:
    block = np.arange(12, dtype=np.float64).reshape(3, 4)
    cols = ColumnBlock(("b", "a", "c"), block)
    assert list(cols) == ["b", "a", "c"] and len(cols) == 3
    assert "a" in cols and "z" not in cols and 3 not in cols
    np.testing.assert_array_equal(cols["a"], block[1])
    assert np.shares_memory(cols["c"], block)  # a view of the block's row, not a copy
    assert dict(cols).keys() == {"a", "b", "c"}
    with pytest.raises(KeyError):
        cols["z"]
    assert block_for(cols, ("b", "a", "c")) is block
    assert block_for(cols, ("a", "b", "c")) is None and block_for(dict(cols), ("b", "a", "c")) is None


@pytest.mark.parametrize("order", [("imbalance", "depth"), ("depth", "imbalance")])
def test_user_columns_as_one_block_give_the_same_features_bit_for_bit(sample: Bars, order: tuple[str, ...],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The server hands build_frame a request's user columns as one [columns, bars] block; the features
    must be exactly those of the same columns given one by one (as training reads them)."""
    rng = np.random.default_rng(3)
    user = {"imbalance": rng.normal(size=len(sample)), "depth": rng.lognormal(size=len(sample)) * 1e5}
    plain = Bars(sample.timestamp_ns, sample.symbol, sample.open, sample.high, sample.low, sample.close,
                 sample.volume, user)
    cfg = FeatureConfig(horizon=2, volatility_window=20, user_columns=("imbalance", "depth"))
    expected = build_frame(plain, cfg)
    block = Bars(sample.timestamp_ns, sample.symbol, sample.open, sample.high, sample.low, sample.close,
                 sample.volume, ColumnBlock(order, np.array([user[u] for u in order])))
    got = build_frame(block, cfg)
    np.testing.assert_array_equal(got.observed, expected.observed)
    assert got.observed.flags.c_contiguous and got.observed.dtype == np.float32
    # a training set's columns are converted a block of rows at a time: blocks that split series change nothing
    import features.compute

    monkeypatch.setattr(features.compute, "ROWS_PER_BLOCK", 1000)
    in_blocks = build_frame(plain, cfg)
    np.testing.assert_array_equal(in_blocks.observed, expected.observed)
    assert in_blocks.observed.flags.c_contiguous and len(sample) > 4 * 1000
    np.testing.assert_array_equal(got.known, expected.known)


def test_a_stop_signal_leaves_no_temporary_file(tmp_path: Path) -> None:
    """atomic_output under Ctrl-C or SIGTERM turned interrupt (as serving.score sets it): the temporary file
    goes and the target is never made."""
    import signal

    from features.files import atomic_output

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), atomic_output(tmp_path / "out.parquet") as tmp:
            Path(tmp).write_bytes(b"partial")
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []
