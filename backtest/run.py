"""The walk-forward backtest: per fold, train, export, forecast at the fold's origins; then score them all.

Each fold trains in this process, on the bars as read before its cut, as `python -m trainer` trains. It lives
in OUT/foldK: the trainer's files (ckpt.pt, ...), the exported models (model.onnx calibrated,
model_uncalibrated.onnx) and its forecasts (forecasts.parquet, written last). A fold whose forecasts exist is
done: a killed run resumes at the next one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from backtest.baselines import BASELINES
from backtest.folds import BacktestError, Fold, bars_before, cut_rows, fold_origins, make_folds
from backtest.forecast import baselines_at, fold_table, model_forecasts, table_arrays
from backtest.plots import write_figure
from backtest.scores import backtest_scores, summary_lines
from features.bars import Bars, ColumnMap, bars_digest
from features.check import format_timestamp
from features.compute import build_frame
from features.config import FeatureConfig
from features.files import atomic_output
from features.series import ContractError, as_series, read_contract_bars, roll_lines, scan_contracts
from serving.model import LoadedModel, load_model
from trainer.config import TrainConfig
from trainer.data import ReadBars
from trainer.run import RUN_ERRORS, train

log = logging.getLogger("backtest")
MODELS = ("model", "model_uncalibrated")  # the calibrated export, and the same checkpoint without calibration
FORECASTERS = (*MODELS, *BASELINES)


@dataclass(frozen=True)
class BacktestPlan:
    parquet: Path
    out: Path
    folds: int
    test_span: float  # share of the distinct bar times the test spans cover
    embargo: int  # bars after each cut that are not origins (>= the horizon)
    vol_window: int  # bars of the rolling-volatility baseline
    config: TrainConfig  # every fold's training recipe (test_fraction 0: the folds are the test)
    columns: ColumnMap
    tracking: str | None = None  # --tracking of the trainer, e.g. tensorboard:runs
    threads: int = 1  # ONNX Runtime threads (the trainer's --threads)

    def record(self, digest: str) -> dict[str, Any]:
        """What a resumed run must share with the run that made OUT."""
        return {"parquet": str(self.parquet), "bars_digest": digest, "folds": self.folds,
                "test_span": self.test_span, "embargo": self.embargo, "vol_window": self.vol_window,
                "train_config": self.config.to_dict(), "columns": self.columns.to_dict()}


def run_backtest(plan: BacktestPlan) -> dict[str, Any]:
    """Every fold, then the forecasts, scores.json, backtest.png and the summary; returns the scores."""
    cfg = plan.config
    try:  # per-contract bars: the folds cut the continuous series' times; each fold's run rolls its own bars
        fc = replace(cfg.feature_config(), contracts=scan_contracts(plan.parquet, plan.columns, cfg.contract_flags))
        bars = read_contract_bars(plan.parquet, plan.columns, fc)
        series, rolls = as_series(bars, fc)
    except ContractError as exc:
        raise BacktestError(str(exc)) from None
    for line in roll_lines(fc.contracts, rolls, series.symbols):
        log.info("%s", line)
    folds = make_folds(series.timestamp_ns, plan.folds, plan.test_span)
    record = plan.record(bars_digest(bars, fc.real_columns, fc.categorical_columns))
    _claim(plan.out, record)
    tables = []
    for fold in folds:
        path = plan.out / f"fold{fold.index}" / "forecasts.parquet"
        if path.exists():
            log.info("fold %d of %d: done before, kept (%s)", fold.index, len(folds), path)
        else:
            _run_fold(plan, bars, fold, len(folds), fc)
        tables.append(pq.read_table(path))
    return _finish(plan, pa.concat_tables(tables), record)


def _claim(out: Path, record: dict[str, Any]) -> None:
    """Write OUT/backtest.json, or check that it holds these settings (a resume)."""
    path = out / "backtest.json"
    if path.exists():
        stored = json.loads(path.read_text())
        if changed := sorted(k for k in record if stored.get(k) != record[k]):
            raise BacktestError(f"--out {out} holds a backtest with other {', '.join(changed)}: rerun with its "
                                "settings to resume it, or give another --out")
        log.info("resuming the backtest in %s", out)
        return
    out.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=2) + "\n")


def _run_fold(plan: BacktestPlan, bars: Bars, fold: Fold, n_folds: int, fc: FeatureConfig) -> None:
    """Train, export and forecast one fold from `bars` as read for the run's `fc`; its forecasts are written last."""
    where = plan.out / f"fold{fold.index}"
    where.mkdir(parents=True, exist_ok=True)
    log.info("fold %d of %d: training on the bars before %s", fold.index, n_folds, np.datetime64(fold.cut_ns, "ns"))
    train_bars = ReadBars(bars_before(bars, fold.cut_ns), fc.contracts,
                          f"{plan.parquet}, its bars before {format_timestamp(fold.cut_ns)}")
    _train(plan, train_bars, where, fold.index)
    models = {name: _export(where, name, plan.threads, train_bars) for name in MODELS}
    meta = models["model"].meta
    try:  # the fold's model rolls the contracts as its run did
        series = as_series(bars, meta.feature_config)[0]
    except ContractError as exc:
        raise BacktestError(f"fold {fold.index}: {exc}") from None
    present = series.series_slices()
    frame = build_frame(series.only([s for s in meta.symbols if s in present]), meta.feature_config,
                        list(meta.symbols), meta.bar_interval_ns)
    anchors = fold_origins(frame, fold, meta.encoder_length, plan.embargo)
    if anchors.size == 0:
        raise BacktestError(f"fold {fold.index}: no test origin with its targets in the file; give more bars or "
                            "fewer --folds")
    forecasts = {name: model_forecasts(m, frame, anchors) for name, m in models.items()}
    forecasts.update(baselines_at(frame, anchors, cut_rows(frame, fold.cut_ns), meta.quantiles, plan.vol_window))
    with atomic_output(where / "forecasts.parquet") as tmp:
        pq.write_table(fold_table(fold.index, frame, anchors, forecasts, meta.quantiles), tmp)
    log.info("fold %d of %d: %d origins forecast", fold.index, n_folds, anchors.size)


def _train(plan: BacktestPlan, bars: ReadBars, where: Path, index: int) -> None:
    """The fold's run as `python -m trainer --no-progress` runs it, at where/ckpt.pt; tracked as the run OUT-foldK."""
    try:
        train(bars, plan.config, where / "ckpt.pt", plan.columns, progress=False, tracking=plan.tracking,
              tracking_run=f"{plan.out.name}-fold{index}")
    except RUN_ERRORS as exc:
        raise BacktestError(f"fold {index}: training failed: {exc}; fix that, then rerun this command to resume at "
                            f"fold {index}") from None


def _export(where: Path, name: str, threads: int, bars: ReadBars) -> LoadedModel:
    """The fold's checkpoint exported (quantiles; calibrated for "model" on `bars`), checks in export.log; loaded."""
    from export.errors import ExportError
    from export.options import ExportOptions
    from export.pipeline import run_export

    output = where / f"{name}.onnx"
    opts = ExportOptions(checkpoint=where / "ckpt.pt", output=output, explain=False, calibrate=name == "model",
                         threads=threads, run_bars=bars)
    with open(where / "export.log", "a") as report, contextlib.redirect_stdout(report):
        try:
            run_export(opts, log=lambda line: print(line, file=report, flush=True))
        except ExportError as exc:
            raise BacktestError(f"{where.name}: export of {output.name} failed: {exc} (see {where / 'export.log'})"
                                ) from None
    return load_model(output, "cpu", threads, max_batch=1024)


def _finish(plan: BacktestPlan, table: pa.Table, record: dict[str, Any]) -> dict[str, Any]:
    quantiles = plan.config.quantiles
    forecasts, actual, fold = table_arrays(table, FORECASTERS, plan.config.horizon, quantiles)
    series = table.column("symbol").to_numpy(zero_copy_only=False)  # object [W], for the per-series scores
    scores = backtest_scores(forecasts, actual, fold, quantiles, series)
    with atomic_output(plan.out / "forecasts.parquet") as tmp:
        pq.write_table(table, tmp)
    with atomic_output(plan.out / "scores.json") as tmp:
        Path(tmp).write_text(json.dumps(scores, indent=2) + "\n")
    write_figure(plan.out / "backtest.png", scores)
    if plan.tracking:
        _track(plan, scores, record)
    return scores


def _track(plan: BacktestPlan, scores: dict[str, Any], record: dict[str, Any]) -> None:
    """Each fold's mean pinball per forecaster, at step = fold, and the figure, in the run OUT's name."""
    from trainer.tracking import open_tracker

    tracker = open_tracker(str(plan.tracking), plan.out.name)
    try:
        tracker.log_params(record)
        for k, block in scores["folds"].items():
            tracker.log_metrics(_fold_metrics(block), step=int(k))
        tracker.log_image("backtest", plan.out / "backtest.png")
    finally:
        tracker.close()


def _fold_metrics(block: dict[str, Any]) -> dict[str, float]:
    """A fold's scalars: each forecaster's mean pinball and interval coverage, a model's ratio to the best baseline."""
    out = {}
    for name, s in block["forecasters"].items():
        out[f"{name}/pinball_mean"] = float(s["pinball_mean"])
        out[f"{name}/interval_coverage"] = float(s["interval"]["coverage"])
        if "ratio_to" in s:
            out[f"{name}/ratio_to_best_baseline"] = float(s["ratio_to"]["best_baseline"])
    return out


def print_summary(scores: dict[str, Any], out: Path) -> None:
    print("\n".join(summary_lines(scores)))
    print(f"wrote {out / 'forecasts.parquet'}, {out / 'scores.json'}, {out / 'backtest.png'}")
