"""`python -m backtest --parquet bars.parquet --folds 4 --out bt [trainer config flags]`: walk-forward
evaluation of the TFT against climatology, rolling volatility and GARCH(1,1)-t on the same origins.

Fold k trains a model on every bar before its cut (expanding window; the trainer's own validation split
inside for early stopping), exports it (calibrated, and without calibration) and forecasts every origin of
its test span through ONNX Runtime, from `--embargo` bars after the cut. The test spans share the last
`--test-span` of the bar times equally. Writes OUT/forecasts.parquet (a row per origin and symbol),
OUT/scores.json, OUT/backtest.png and prints a summary; a killed run resumes at its next unfinished fold.
Exit status: 0 done, 1 an output could not be written, 2 bad arguments or data, or a fold that failed, 130
interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path

from features.bars import BarDataError, ColumnMap
from trainer.config import ConfigError, add_config_flags, config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m backtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parquet", type=Path, required=True, help="bars: a parquet file or a directory of them")
    p.add_argument("--out", type=Path, default=Path("backtest"), help="directory of the folds and results "
                   "(default backtest); rerun the command with it to resume")
    p.add_argument("--folds", type=int, default=4, help="test spans, each with a model trained before it (default 4)")
    p.add_argument("--test-span", type=float, default=0.5,
                   help="share of the bar times the folds' test spans cover, at the end (default 0.5)")
    p.add_argument("--embargo", type=int, help="bars after each cut that are not origins (default and least: "
                   "the horizon)")
    p.add_argument("--vol-window", type=int, help="bars of the rolling-volatility baseline (default: the "
                   "encoder length, the bars the model's volatility scale reads)")
    p.add_argument("--tracking", help="log each fold's training and the scores: tensorboard:DIR or mlflow:URI")
    p.add_argument("--config", help="TOML file of the trainer's config fields (flags override it)")
    ColumnMap.add_arguments(p)
    add_config_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    p = build_parser()
    args = p.parse_args(argv)
    if args.folds < 1 or not 0.0 < args.test_span < 1.0:
        p.error("--folds must be at least 1, --test-span between 0 and 1")
    if args.cfg_test_fraction is not None:
        p.error("--test-fraction sets the trainer's own test split; a backtest's folds are its test: give "
                "--test-span, the share of the bar times they cover")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a KeyboardInterrupt, as Ctrl-C
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"interrupted: rerun the command to resume at the first unfinished fold in {args.out}",
              file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from backtest.folds import BacktestError
    from backtest.run import BacktestPlan, print_summary, run_backtest
    from trainer.tracking import TrackingError, check_spec

    try:
        if importlib.util.find_spec("arch") is None:
            raise BacktestError("python -m backtest needs the arch package for its GARCH baseline: "
                                "pip install 'foxhunt-tft[eval]'")
        if args.tracking:
            check_spec(args.tracking)
        cfg = replace(config_from_args(args), test_fraction=0.0)
        embargo = cfg.horizon if args.embargo is None else args.embargo
        if embargo < cfg.horizon:
            raise BacktestError(f"--embargo {embargo} is less than the horizon ({cfg.horizon}): a test target "
                                "would overlap training bars' targets; give at least the horizon")
        plan = BacktestPlan(args.parquet, args.out, args.folds, args.test_span, embargo,
                            args.vol_window or cfg.encoder_length, cfg, ColumnMap.from_args(args, None),
                            args.tracking, cfg.threads or 1)
        scores = run_backtest(plan)
    except (BacktestError, ConfigError, TrackingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BarDataError as exc:
        print(f"error: {exc.summary(args.parquet)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_summary(scores, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
