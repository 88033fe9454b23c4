"""The backtest's fold training, baselines, scores and picture, on sample bars and hand-made series."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from artifacts import TINY_TRAIN_FLAGS, run

from backtest.baselines import BASELINES, baseline_forecasts
from backtest.folds import bars_before
from backtest.plots import write_figure
from backtest.scores import backtest_scores, summary_lines
from features.bars import ColumnMap
from features.metrics import forecast_metrics
from features.series import read_contract_bars
from features.synth import generate

TRAIN_END, HORIZON, WINDOW = 2000, 5, 60
ORIGINS = np.arange(TRAIN_END, 2800)
QUANTILES = (0.1, 0.5, 0.9)
CUT = 2400  # an origin: the bars after it are changed below


@pytest.fixture(scope="module")
def close() -> np.ndarray:
    return generate(["ES"], 3000, seed=3).column("close").to_numpy()


@pytest.fixture(scope="module")
def base(close: np.ndarray) -> dict[str, np.ndarray]:
    return baseline_forecasts(close, TRAIN_END, ORIGINS, HORIZON, QUANTILES, WINDOW, series="ES")


def forecasts(close: np.ndarray) -> dict[str, np.ndarray]:
    return baseline_forecasts(close, TRAIN_END, ORIGINS, HORIZON, QUANTILES, WINDOW, series="ES")


def test_baselines_ignore_the_bars_after_the_origin(close: np.ndarray, base: dict[str, np.ndarray]) -> None:
    later = close.copy()
    later[CUT + 1:] *= np.exp(np.cumsum(np.random.default_rng(0).normal(0.0, 0.003, close.size - CUT - 1)))
    changed = forecasts(later)
    upto = ORIGINS <= CUT
    for name in BASELINES:
        np.testing.assert_allclose(changed[name][upto], base[name][upto], rtol=1e-12, atol=0, err_msg=name)
    for name in ("rolling_vol", "garch"):  # the change reaches the origins after it
        assert not np.allclose(changed[name][~upto], base[name][~upto]), name


def test_baselines_read_the_bars_before_the_origin(close: np.ndarray, base: dict[str, np.ndarray]) -> None:
    jump = close.copy()
    jump[CUT - 10:] *= 1.01  # one 1 % return, 10 bars before the origin CUT, after the training bars
    changed = forecasts(jump)
    at = ORIGINS == CUT
    for name in ("rolling_vol", "garch"):
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
