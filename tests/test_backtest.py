"""`python -m backtest`: a real 2-fold walk-forward run of a tiny model on sample bars with volatility
clustering, its files, its embargo, its resume, and its forecasts against `serving.score`'s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from artifacts import REPO, make_bars, run, run_main

pytestmark = pytest.mark.slow

HORIZON = 3
TINY_CONFIG = ("--hidden-size", "8", "--attention-heads", "2", "--encoder-length", "20", "--horizon", str(HORIZON),
               "--volatility-window", "10", "--batch-size", "32", "--epochs", "1", "--max-steps-per-epoch", "5",
               "--max-val-windows", "200", "--threads", "1", "--device", "cpu")
FOLD_FILES = ["ckpt.last.pt", "ckpt.metrics.jsonl", "ckpt.pt", "ckpt.report.png", "export.log", "forecasts.parquet",
              "model.onnx", "model_uncalibrated.onnx"]


class Runs(NamedTuple):
    bars: Path
    out: Path  # the backtest's --out
    stopped: str  # stderr of the run stopped by SIGTERM as fold 2 began
    resumed: subprocess.CompletedProcess[str]  # the same command again, to the end


def interrupted_at_fold_2(command: list[str]) -> str:
    """Start `command`, SIGTERM it once it logs fold 2's start, and return its stderr (exit status 130)."""
    proc = subprocess.Popen([sys.executable, *command], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if "fold 2 of 2: training" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, "".join(seen)[-3000:] + rest[-3000:]
    return "".join(seen) + rest


@pytest.fixture(scope="module")
def backtest(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """bars.parquet (2 symbols x 2400 bars) and a 2-fold backtest of them, stopped as fold 2 began and resumed."""
    work = tmp_path_factory.mktemp("backtest")
    bars = make_bars(work / "bars.parquet", bars=2400)
    out = work / "bt"
    command = ["-m", "backtest", "--parquet", str(bars), "--folds", "2", "--test-span", "0.4", "--out", str(out),
               "--tracking", f"tensorboard:{work / 'tb'}", *TINY_CONFIG]
    stopped = interrupted_at_fold_2(command)
    r = run(command, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return Runs(bars, out, stopped, r)


def test_writes_forecasts_scores_figure_and_a_summary(backtest: Runs) -> None:
    out, summary = backtest.out, backtest.resumed.stdout
    table = pq.read_table(out / "forecasts.parquet")
    assert sorted(set(table.column("fold").to_pylist())) == [1, 2]
    assert set(table.column("symbol").to_pylist()) == {"ES", "NQ"}
    keys = list(zip(table.column("symbol").to_pylist(), table.column("origin").to_pylist(), strict=True))
    assert len(keys) == len(set(keys))  # a row per origin and symbol
    scores = json.loads((out / "scores.json").read_text())
    assert {"climatology", "rolling_vol", "garch", "seasonal_garch"} <= set(scores["baselines"])  # minute bars, H=3
    for name in ("model", "model_uncalibrated", *scores["baselines"]):
        for h in range(1, HORIZON + 1):
            low, high = (table.column(f"{name}_h{h}_q{q}").to_numpy() for q in ("0.1", "0.9"))
            assert np.all(np.isfinite(low)) and np.all(low <= high), name
    assert sorted(scores["folds"]) == ["1", "2"]
    for block in (*scores["folds"].values(), scores["all"]):
        ratio = block["forecasters"]["model"]["ratio_to"]
        assert ratio["best_baseline"] == pytest.approx(
            block["forecasters"]["model"]["pinball_mean"]
            / min(block["forecasters"][b]["pinball_mean"] for b in scores["baselines"]))
    assert (out / "backtest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "garch" in summary and "fold" in summary
    for k in (1, 2):  # each fold's run and models, and no other file
        assert sorted(p.name for p in (out / f"fold{k}").iterdir()) == FOLD_FILES


def test_each_folds_training_and_scores_are_tracked(backtest: Runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = backtest.out
    runs = out.parent / "tb"
    assert sorted(p.name for p in runs.iterdir()) == ["bt", "bt-fold1", "bt-fold2"]
    scores = json.loads((out / "scores.json").read_text())
    events = EventAccumulator(str(runs / "bt"), size_guidance={"scalars": 0})
    events.Reload()
    ratio = events.Scalars("model/ratio_to_best_baseline")
    assert [e.step for e in ratio] == [1, 2]
    assert [e.value for e in ratio] == pytest.approx(
        [scores["folds"][k]["forecasters"]["model"]["ratio_to"]["best_baseline"] for k in ("1", "2")])
    fold = EventAccumulator(str(runs / "bt-fold2"), size_guidance={"scalars": 0})
    fold.Reload()
    assert fold.Scalars("loss/val")  # the fold's training, epoch by epoch


def test_no_fold_trains_on_bars_its_targets_reach(backtest: Runs) -> None:
    """Embargo: each test origin lies at least the horizon's bars after its fold's last training bar, so no
    training window's target (which ends by that bar) reaches a test origin's targets."""
    bars_path, out = backtest.bars, backtest.out
    bars = pq.read_table(bars_path)
    times = {s: np.sort(np.asarray(bars.filter(pc.equal(bars.column("symbol"), s)).column("timestamp").cast("int64")))
             for s in ("ES", "NQ")}
    table = pq.read_table(out / "forecasts.parquet")
    for k in (1, 2):
        last_train = int(torch.load(out / f"fold{k}" / "ckpt.pt", weights_only=True)["data_span_ns"][1])
        fold = table.filter(pc.equal(table.column("fold"), k))
        for symbol, ts in times.items():
            origins = np.asarray(fold.filter(pc.equal(fold.column("symbol"), symbol)).column("origin").cast("int64"))
            bars_between = np.searchsorted(ts, origins.min()) - np.searchsorted(ts, last_train)
            assert bars_between >= HORIZON, (k, symbol, bars_between)
            assert int(ts[np.searchsorted(ts, last_train)]) == last_train  # the training bars are the file's


def test_model_forecasts_are_the_exported_models_as_serving_score_runs_it(backtest: Runs,
                                                                          tmp_path: Path) -> None:
    bars, out = backtest.bars, backtest.out
    fold = pq.read_table(out / "fold2" / "forecasts.parquet")
    origins = np.asarray(fold.column("origin").cast("int64"))
    scored = tmp_path / "scored.parquet"
    start, end = (np.datetime_as_string(np.datetime64(int(t), "ns")) for t in (origins.min(), origins.max() + 1000))
    r = run(["-m", "serving.score", "--model", str(out / "fold2" / "model.onnx"), "--parquet", str(bars),
             "--out", str(scored), "--start", start, "--end", end, "--threads", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    score = pq.read_table(scored)
    score = score.filter(pc.equal(score.column("h"), 1))
    want = {(s, int(t)): v for s, t, v in zip(score.column("symbol").to_pylist(),
                                              np.asarray(score.column("origin").cast("int64")),
                                              score.column("ret_q0.9").to_pylist(), strict=True)}
    got = zip(fold.column("symbol").to_pylist(), origins, fold.column("model_h1_q0.9").to_pylist(), strict=True)
    pairs = [(v, want[(s, int(t))]) for s, t, v in got]
    assert len(pairs) == fold.num_rows > 0
    np.testing.assert_allclose(*zip(*pairs, strict=True), rtol=1e-6)


def test_a_stopped_run_resumes_at_the_first_unfinished_fold(backtest: Runs) -> None:
    assert "interrupted: rerun the command to resume at the first unfinished fold" in backtest.stopped
    log = backtest.resumed.stderr
    assert "fold 1 of 2: done before, kept" in log
    assert "fold 2 of 2: training" in log and "fold 1 of 2: training" not in log
    assert not list(backtest.out.glob("**/*.tmp"))  # nothing half-written was left by the stop


def test_a_rerun_with_other_settings_is_refused(backtest: Runs) -> None:
    bars, out = backtest.bars, backtest.out
    r = run_main(["-m", "backtest", "--parquet", str(bars), "--folds", "3", "--test-span", "0.4", "--out", str(out),
                  *TINY_CONFIG])
    assert r.returncode == 2
    assert f"--out {out} holds a backtest with other folds" in r.stderr


def test_an_embargo_shorter_than_the_horizon_is_refused(tmp_path: Path) -> None:
    r = run_main(["-m", "backtest", "--parquet", str(tmp_path / "none.parquet"), "--embargo", "1", *TINY_CONFIG])
    assert r.returncode == 2 and "--embargo 1 is less than the horizon (3)" in r.stderr
