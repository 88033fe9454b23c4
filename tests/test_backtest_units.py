"""The backtest's fold training, baselines, scores and picture, on sample bars and hand-made series."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from artifacts import TINY_TRAIN_FLAGS, run

from backtest.baselines import (
    BASELINES,
    BarClock,
    baseline_forecasts,
    baseline_names,
    har_design,
    har_fit,
    realized_variance,
    season_of,
    trading_days,
)
from backtest.folds import bars_before
from backtest.forecast import table_arrays
from backtest.plots import write_figure
from backtest.scores import backtest_scores, summary_lines
from features.bars import ColumnMap
from features.calendar import NS_PER_DAY, profile_slots
from features.metrics import forecast_metrics
from features.series import read_contract_bars
from features.synth import generate

TRAIN_END, HORIZON, WINDOW = 2000, 5, 60
ORIGINS = np.arange(TRAIN_END, 2800)
QUANTILES = (0.1, 0.5, 0.9)
CUT = 2400  # an origin: the bars after it are changed below
HOUR_NS = 3_600_000_000_000
MINUTE_BARS = BarClock(generate(["ES"], 3000, seed=3).column("timestamp").to_numpy().astype(np.int64), 60_000_000_000)
INTRADAY = baseline_names(MINUTE_BARS.bar_interval_ns, HORIZON, 390.0)  # minute bars: seasonal_garch, no har_rv


@pytest.fixture(scope="module")
def close() -> np.ndarray:
    return generate(["ES"], 3000, seed=3).column("close").to_numpy()


@pytest.fixture(scope="module")
def base(close: np.ndarray) -> dict[str, np.ndarray]:
    return forecasts(close)


def forecasts(close: np.ndarray) -> dict[str, np.ndarray]:
    return baseline_forecasts(close, TRAIN_END, ORIGINS, HORIZON, QUANTILES, WINDOW, series="ES", clock=MINUTE_BARS,
                              names=INTRADAY)


def test_baselines_ignore_the_bars_after_the_origin(close: np.ndarray, base: dict[str, np.ndarray]) -> None:
    later = close.copy()
    later[CUT + 1:] *= np.exp(np.cumsum(np.random.default_rng(0).normal(0.0, 0.003, close.size - CUT - 1)))
    changed = forecasts(later)
    upto = ORIGINS <= CUT
    assert set(base) == {"climatology", "rolling_vol", "garch", "seasonal_garch"}
    for name in base:
        np.testing.assert_allclose(changed[name][upto], base[name][upto], rtol=1e-12, atol=0, err_msg=name)
    for name in ("rolling_vol", "garch", "seasonal_garch"):  # the change reaches the origins after it
        assert not np.allclose(changed[name][~upto], base[name][~upto]), name


def test_baselines_read_the_bars_before_the_origin(close: np.ndarray, base: dict[str, np.ndarray]) -> None:
    jump = close.copy()
    jump[CUT - 10:] *= 1.01  # one 1 % return, 10 bars before the origin CUT, after the training bars
    changed = forecasts(jump)
    at = ORIGINS == CUT
    for name in ("rolling_vol", "garch", "seasonal_garch"):
        assert np.all(changed[name][at][..., -1] > base[name][at][..., -1]), name
    np.testing.assert_array_equal(changed["climatology"], base["climatology"])


def test_climatology_uses_only_the_training_bars(close: np.ndarray, base: dict[str, np.ndarray]) -> None:
    after = close.copy()
    after[TRAIN_END:] *= 1.05
    np.testing.assert_array_equal(forecasts(after)["climatology"], base["climatology"])
    before = close.copy()
    before[TRAIN_END - 3:] *= 1.05  # a 5 % return inside the training bars
    assert not np.allclose(forecasts(before)["climatology"], base["climatology"])
    clim = base["climatology"]
    assert np.all(clim == clim[:1])  # the same forecast at every origin
    log_close = np.log(close[:TRAIN_END])
    np.testing.assert_allclose(clim[0, 2], np.quantile(log_close[3:] - log_close[:-3], QUANTILES))


def test_rolling_vol_is_the_trailing_root_mean_square() -> None:
    returns = np.array([0.01, -0.02, 0.03, 0.0, -0.01, 0.02])
    close = 100.0 * np.exp(np.concatenate([[0.0], np.cumsum(returns)]))  # [7]
    f = baseline_forecasts(close, 7, np.array([2, 5]), 2, (0.1, 0.9), window=3)["rolling_vol"]
    sigma = np.sqrt([(0.01**2 + 0.02**2) / 2, (0.03**2 + 0.0 + 0.01**2) / 3])  # rows 1-2 (fewer than 3), rows 3-5
    z90 = 1.2815515655446004  # Phi^-1(0.9)
    np.testing.assert_allclose(f[:, 1, 1], np.sqrt(2) * sigma * z90, rtol=1e-9)
    np.testing.assert_allclose(f[:, 0, 0], -sigma * z90, rtol=1e-9)


def test_garch_quantiles_widen_with_the_horizon_around_zero(base: dict[str, np.ndarray]) -> None:
    g = base["garch"]  # [W, H, Q]
    assert np.all(np.diff(g[..., 2], axis=1) > 0)
    np.testing.assert_allclose(g[..., 0], -g[..., 2], rtol=1e-12)
    np.testing.assert_array_equal(g[..., 1], 0.0)


def weekday_hours(n_days: int, hours: int = 24) -> np.ndarray:
    """The first `hours` hourly bar times (ns, UTC) of `n_days` weekdays from Monday 2021-01-04: int64
    [n_days * hours]."""
    days = np.datetime64("2021-01-04", "ns").astype(np.int64) + np.arange(n_days * 7 // 5 + 7) * NS_PER_DAY
    days = days[(days // NS_PER_DAY + 3) % 7 < 5][:n_days]  # Monday = 0
    return (days[:, None] + np.arange(hours) * HOUR_NS).reshape(-1)


def seasonal_process(n_days: int, seed: int) -> tuple[BarClock, np.ndarray, np.ndarray]:
    """Hourly weekday bars whose log returns are a GARCH(1,1)-t times a known profile by hour of the day (3 from
    13:00 to 16:00 UTC, 0.4 before 06:00, 1 else): the clock, the closes [N] and the profile [N]."""
    rng = np.random.default_rng(seed)
    ts = weekday_hours(n_days)
    hour = ts // HOUR_NS % 24
    profile = np.where((hour >= 13) & (hour < 17), 3.0, np.where(hour < 6, 0.4, 1.0))  # [N]
    z = rng.standard_t(6, ts.size) / np.sqrt(1.5)  # unit variance
    r, h = np.empty(ts.size), 1.0
    for i in range(ts.size):
        h = 0.05 + 0.08 * (r[i - 1] ** 2 if i else 1.0) + 0.87 * h
        r[i] = np.sqrt(h) * z[i]
    return BarClock(ts, HOUR_NS), 100.0 * np.exp(np.cumsum(0.001 * profile * r)), profile


def test_seasonal_garch_recovers_the_profile_and_covers_busy_and_quiet_hours() -> None:
    clock, close, profile = seasonal_process(300, seed=1)
    train_end, origins = 5400, np.arange(5400, close.size - 1)
    log_returns = np.concatenate([[np.nan], np.diff(np.log(close))])
    fitted = season_of(log_returns, clock, train_end, origins, 3).rows  # [N]
    assert np.mean(fitted[profile == 3.0]) / np.mean(fitted[profile == 0.4]) == pytest.approx(3.0 / 0.4, rel=0.2)
    assert np.corrcoef(fitted, profile)[0, 1] > 0.95
    f = baseline_forecasts(close, train_end, origins, 3, QUANTILES, WINDOW, clock=clock,
                           names=("garch", "seasonal_garch"))
    y = log_returns[origins + 1]  # [W], the 1-bar return each step-1 forecast is of
    busy, quiet = profile[origins + 1] == 3.0, profile[origins + 1] == 0.4
    inside = {name: (y > v[:, 0, 0]) & (y < v[:, 0, -1]) for name, v in f.items()}  # the P10-P90 interval
    assert inside["seasonal_garch"][busy].mean() == pytest.approx(0.8, abs=0.06)
    assert inside["seasonal_garch"][quiet].mean() == pytest.approx(0.8, abs=0.06)
    assert inside["garch"][busy].mean() < 0.7 and inside["garch"][quiet].mean() > 0.9  # one variance for all hours


def test_the_profile_reads_the_training_bars_alone() -> None:
    clock, close, _ = seasonal_process(60, seed=2)
    train_end, origins = 1000, np.arange(1000, 1400)
    log_returns = np.concatenate([[np.nan], np.diff(np.log(close))])
    fitted = season_of(log_returns, clock, train_end, origins, 3)
    later = log_returns.copy()
    later[train_end:] *= np.where(clock.timestamp_ns[train_end:] // HOUR_NS % 24 == 3, 10.0, 1.0)  # after the cut
    np.testing.assert_array_equal(season_of(later, clock, train_end, origins, 3).rows, fitted.rows)
    hour = clock.timestamp_ns // HOUR_NS % 24  # [N]
    earlier = log_returns.copy()
    earlier[:train_end] *= np.where(hour[:train_end] == 3, 10.0, 1.0)  # before the cut
    moved = season_of(earlier, clock, train_end, origins, 3).rows

    def ratio(rows: np.ndarray) -> float:  # 03:00's profile over 10:00's
        return float(rows[hour == 3].mean() / rows[hour == 10].mean())

    assert ratio(moved) == pytest.approx(10.0 * ratio(fitted.rows), rel=1e-9)
    weekend = BarClock(np.append(clock.timestamp_ns, clock.timestamp_ns[-1] + np.arange(1, 30) * HOUR_NS), HOUR_NS)
    saturday = season_of(np.append(log_returns, np.full(29, 0.01)), weekend, train_end, origins, 3).rows[-10:]
    np.testing.assert_array_equal(saturday, 1.0)  # hours no training bar had: the overall RMS


def test_profile_slots_are_hours_of_the_week_or_quarter_hours_in_the_calendar_zone() -> None:
    winter, summer = (np.datetime64(t, "ns").astype(np.int64) for t in ("2024-01-08T14:37", "2024-07-08T14:37"))
    assert profile_slots(np.array([winter, summer]), HOUR_NS, "UTC")[0].tolist() == [14, 14]  # Monday 14:00
    assert profile_slots(np.array([winter, summer]), HOUR_NS, "America/Chicago")[0].tolist() == [8, 9]
    slots, n = profile_slots(np.array([winter + 5 * NS_PER_DAY]), 60_000_000_000, "UTC")  # a Saturday, 1-min bars
    assert n == 96 and slots.tolist() == [14 * 4 + 2]


def har_process(n_days: int, seed: int, coef: tuple[float, ...]) -> np.ndarray:
    """Daily realized variance [n_days] of a HAR process: the mean HAR gives, times a Gamma(4, 1/4) surprise."""
    rng = np.random.default_rng(seed)
    rv = np.full(n_days, coef[0] / (1.0 - sum(coef[1:])))
    for d in range(22, n_days):
        mean = coef[0] + coef[1] * rv[d - 1] + coef[2] * rv[d - 5:d].mean() + coef[3] * rv[d - 22:d].mean()
        rv[d] = mean * rng.gamma(4.0, 0.25)
    return rv


def test_har_rv_recovers_the_coefficients_from_intraday_bars() -> None:
    coef = (0.1, 0.35, 0.3, 0.2)
    rv = har_process(4000, seed=5, coef=coef)  # [D]
    g = np.random.default_rng(6).normal(size=(4000, 24))
    r = g * np.sqrt(rv[:, None] / (g**2).sum(axis=1, keepdims=True))  # [D, 24], each day's squares sum to its RV
    ts = weekday_hours(4000)
    day = trading_days(ts, "UTC")
    np.testing.assert_array_equal(day, np.repeat(np.arange(4000), 24))
    got_rv, _ = realized_variance(np.concatenate([[np.nan], r.reshape(-1)[1:]]), day)
    np.testing.assert_allclose(got_rv[1:], rv[1:], rtol=1e-9)
    np.testing.assert_allclose(har_fit(got_rv), coef, atol=0.08)


def test_trading_days_join_a_sunday_evening_open_to_monday() -> None:
    week = weekday_hours(5, hours=22)  # Monday to Friday 00:00 .. 21:00 UTC
    sunday = week[0] - 2 * HOUR_NS  # 22:00 on the Sunday before
    ts = np.concatenate([[sunday - HOUR_NS, sunday], week])
    assert trading_days(ts, "UTC").tolist() == [0] * 24 + [1] * 22 + [2] * 22 + [3] * 22 + [4] * 22


def daily_har_bars(n_days: int, seed: int) -> tuple[BarClock, np.ndarray]:
    """Daily bars whose returns have the variance of a HAR process: the clock and the closes [n_days]."""
    rv = har_process(n_days, seed, (2e-5, 0.3, 0.3, 0.25))  # daily variance about 1.3e-4
    r = np.sqrt(rv) * np.random.default_rng(seed + 1).normal(size=n_days)
    return BarClock(weekday_hours(n_days, hours=1), NS_PER_DAY), 100.0 * np.exp(np.cumsum(r))


def test_har_rv_is_the_har_forecast_times_the_standardised_quantile_and_ignores_later_bars() -> None:
    clock, close = daily_har_bars(400, seed=7)
    train_end, origins = 300, np.arange(300, 398)
    assert baseline_names(NS_PER_DAY, 2, 1.0)[-1] == "har_rv"
    f = baseline_forecasts(close, train_end, origins, 2, QUANTILES, WINDOW, clock=clock, names=("har_rv",))["har_rv"]
    rv = np.diff(np.log(close), prepend=np.nan) ** 2
    rv[0] = 0.0  # [D], one bar a day: its squared return
    coef = har_fit(rv[:train_end])
    day_var = har_design(rv)[origins - 21] @ coef  # [W], the next day's variance from the days up to the origin
    assert np.all(day_var > 0)
    np.testing.assert_allclose(f[:, 0, 2] / f[:, 0, 0], f[0, 0, 2] / f[0, 0, 0])  # one standardised shape
    np.testing.assert_allclose(f[:, 0, 2] / np.sqrt(day_var), f[0, 0, 2] / np.sqrt(day_var[0]), rtol=1e-9)
    assert np.all(f[:, 1, 2] > f[:, 0, 2])
    later = close.copy()
    later[351:] *= 1.05  # a 5 % move on the day after origin 350
    changed = baseline_forecasts(later, train_end, origins, 2, QUANTILES, WINDOW, clock=clock, names=("har_rv",))
    np.testing.assert_array_equal(changed["har_rv"][origins <= 350], f[origins <= 350])
    assert np.all(changed["har_rv"][origins == 351][..., 2] > f[origins == 351][..., 2])


def test_baselines_follow_the_bars_clock() -> None:
    assert baseline_names(NS_PER_DAY, 5, 1.0) == ("climatology", "rolling_vol", "garch", "har_rv")
    assert baseline_names(HOUR_NS, 12, 23.0) == ("climatology", "rolling_vol", "garch", "seasonal_garch")
    assert baseline_names(HOUR_NS, 24, 23.0) == BASELINES
    table = pa.table({"fold": [1], **{f"{name}_h1_q{q:g}": [0.0] for name in ("garch", "model") for q in QUANTILES},
                      "actual_h1": [0.0]})
    assert list(table_arrays(table, ("model", *BASELINES), 1, QUANTILES)[0]) == ["model", "garch"]


def sorted_forecast(rng: np.random.Generator, w: int, scale: float) -> np.ndarray:
    return np.sort(rng.normal(0.0, scale, (w, HORIZON, len(QUANTILES))), axis=-1)  # [W, H, Q]


def test_scores_agree_with_the_trainers_metrics() -> None:
    rng = np.random.default_rng(1)
    y = rng.normal(0.0, 1.0, (300, HORIZON))
    fold = np.repeat([0, 1, 2], 100)
    pred = sorted_forecast(rng, 300, 1.0)
    scores = backtest_scores({"model": pred}, y, fold, QUANTILES)
    json.dumps(scores, allow_nan=False)
    for key, rows in (("all", slice(None)), ("1", slice(100, 200))):
        block = scores["all"] if key == "all" else scores["folds"][key]
        got = block["forecasters"]["model"]
        want: dict[str, Any] = forecast_metrics(pred[rows], y[rows], QUANTILES)
        assert block["origins"] == y[rows].shape[0]
        np.testing.assert_allclose(got["pinball_mean"], want["pinball_mean"], rtol=1e-12)
        np.testing.assert_allclose(got["pinball_by_quantile"], list(want["pinball"].values()), rtol=1e-12)
        np.testing.assert_allclose(got["q_risk"], list(want["q_risk"].values()), rtol=1e-12)
        np.testing.assert_allclose(got["interval"]["coverage"], want["coverage"], rtol=1e-12)
        np.testing.assert_allclose(np.mean(got["pinball"], axis=0), got["pinball_by_quantile"], rtol=1e-12)


def test_coverage_of_bounds_nothing_crosses() -> None:
    y = np.random.default_rng(2).normal(0.0, 1.0, (50, HORIZON))
    high, low = np.full((50, HORIZON, 3), 1e9), np.full((50, HORIZON, 3), -1e9)
    wide = np.concatenate([low[..., :1], np.zeros((50, HORIZON, 1)), high[..., :1]], axis=-1)
    scores = backtest_scores({"high": high, "low": low, "wide": wide}, y, np.zeros(50, dtype=int), QUANTILES)
    f = scores["all"]["forecasters"]
    assert f["high"]["coverage"] == [1.0, 1.0, 1.0] and f["low"]["coverage"] == [0.0, 0.0, 0.0]
    assert f["wide"]["interval"]["coverage"] == 1.0 and f["low"]["interval"]["coverage"] == 0.0
    assert f["wide"]["interval"]["nominal"] == pytest.approx(0.8)
    assert f["high"]["pit"]["observed"] == [1.0, 0.0, 0.0, 0.0]
    assert f["wide"]["pit"]["nominal"] == pytest.approx([0.1, 0.4, 0.4, 0.1])


def test_ratio_is_to_the_lowest_baseline_of_each_fold() -> None:
    rng = np.random.default_rng(3)
    y = rng.normal(0.0, 1.0, (200, HORIZON))
    fold = np.repeat([0, 1], 100)
    good, bad = sorted_forecast(rng, 200, 1.0), sorted_forecast(rng, 200, 3.0)
    garch = np.where((fold == 0)[:, None, None], good, bad)  # the best baseline in fold 0 only
    rolling = np.where((fold == 1)[:, None, None], good, bad)  # the best in fold 1 only
    fc = {"model": sorted_forecast(rng, 200, 1.5), "climatology": bad, "rolling_vol": rolling, "garch": garch}
    scores = backtest_scores(fc, y, fold, QUANTILES)
    for key, best in (("0", "garch"), ("1", "rolling_vol")):
        f = scores["folds"][key]["forecasters"]
        assert f["model"]["best_baseline"] == best
        assert f["model"]["ratio_to"]["best_baseline"] == pytest.approx(f["model"]["pinball_mean"]
                                                                        / f[best]["pinball_mean"])
        assert f["model"]["ratio_to"]["climatology"] == pytest.approx(f["model"]["pinball_mean"]
                                                                      / f["climatology"]["pinball_mean"])
    assert "ratio_to" not in scores["all"]["forecasters"]["garch"]


def test_each_series_names_its_best_baseline() -> None:
    rng = np.random.default_rng(8)
    y = rng.normal(0.0, 1.0, (400, HORIZON))
    fold, series = np.tile(np.repeat([0, 1], 100), 2), np.repeat(np.array(["ES", "NQ"], dtype=object), 200)
    good, bad = sorted_forecast(rng, 400, 1.0), sorted_forecast(rng, 400, 3.0)
    es = (series == "ES")[:, None, None]
    fc = {"model": sorted_forecast(rng, 400, 1.5), "garch": np.where(es, good, bad),
          "seasonal_garch": np.where(es, bad, good)}  # garch is the best on ES, seasonal_garch on NQ
    scores = backtest_scores(fc, y, fold, QUANTILES, series=series)
    json.dumps(scores, allow_nan=False)
    for block in (scores["all"], *scores["folds"].values()):
        assert sorted(block["series"]) == ["ES", "NQ"] and "series" not in block["series"]["ES"]
        for name, best in (("ES", "garch"), ("NQ", "seasonal_garch")):
            root = block["series"][name]
            assert root["best_baseline"] == best and root["forecasters"]["model"]["best_baseline"] == best
            assert root["forecasters"]["model"]["ratio_to"]["best_baseline"] == pytest.approx(
                root["forecasters"]["model"]["pinball_mean"] / root["forecasters"][best]["pinball_mean"])
    assert scores["all"]["series"]["ES"]["origins"] == 200
    lines = summary_lines(scores)
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in ("ES", "NQ")}
    assert rows["ES"][2] == "garch" and rows["NQ"][2] == "seasonal_garch"
    assert float(rows["ES"][4]) == pytest.approx(
        scores["all"]["series"]["ES"]["forecasters"]["model"]["ratio_to"]["best_baseline"], abs=5e-4)
    assert max(map(len, lines)) <= 110


def fold_scores(n_folds: int) -> dict[str, Any]:
    rng = np.random.default_rng(4)
    w = 40 * n_folds
    fc = {name: sorted_forecast(rng, w, s) for name, s in
          (("model", 1.0), ("model_uncalibrated", 1.2), ("climatology", 2.0), ("rolling_vol", 1.5), ("garch", 1.1))}
    return backtest_scores(fc, rng.normal(0.0, 1.0, (w, HORIZON)), np.repeat(np.arange(n_folds), 40), QUANTILES)


@pytest.mark.parametrize("n_folds", [3, 8, 12])
def test_summary_fits_one_screen(n_folds: int) -> None:
    lines = summary_lines(fold_scores(n_folds))
    assert len(lines) <= 25 and max(map(len, lines)) <= 110
    text = "\n".join(lines)
    assert "model_uncalibrated" in text and "P10-P90" in text and "P50" in text
    assert ("   2 " in text) == (n_folds <= 8)  # per-fold rows when they fit


def test_write_figure_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "out" / "backtest.png"
    write_figure(path, fold_scores(3))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["backtest.png"]  # no temporary file left beside it


@pytest.mark.slow
def test_a_fold_trains_as_the_trainer_command_on_a_file_of_its_bars(tmp_path: Path) -> None:
    """The fold's run in the backtest's process (its bars as read, before the cut) writes the checkpoint and
    report `python -m trainer` writes from a file of those bars."""
    import torch

    from trainer.__main__ import build_parser
    from trainer.config import config_from_args
    from trainer.data import ReadBars
    from trainer.run import train

    path = tmp_path / "bars.parquet"
    pq.write_table(generate(["ES", "NQ"], 900, seed=5), path)
    table = pq.read_table(path)
    cut = table.column("timestamp")[700]
    pq.write_table(table.filter(pc.less(table.column("timestamp"), cut)), tmp_path / "before.parquet")
    flags = [flag for flag in TINY_TRAIN_FLAGS if flag != "--no-report"]
    command = run(["-m", "trainer", "--parquet", str(tmp_path / "before.parquet"), "--out",
                   str(tmp_path / "command" / "ckpt.pt"), *flags])
    assert command.returncode == 0, command.stderr[-3000:]
    cfg = config_from_args(build_parser().parse_args(["--parquet", str(path), *flags]))
    bars = bars_before(read_contract_bars(path, ColumnMap(), cfg.feature_config()), cut.value)
    train(ReadBars(bars, None, "the fold's bars"), cfg, tmp_path / "fold" / "ckpt.pt", ColumnMap(), progress=False)
    want, got = (torch.load(tmp_path / run_dir / "ckpt.pt", weights_only=True) for run_dir in ("command", "fold"))
    assert got["data_source"] == "the fold's bars" and got["bars_digest"] == want["bars_digest"]
    assert got["metrics_history"][0]["val_loss"] == want["metrics_history"][0]["val_loss"]
    for name, weights in want["model_state"].items():
        assert torch.equal(got["model_state"][name], weights), name
    assert (tmp_path / "fold" / "ckpt.report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
