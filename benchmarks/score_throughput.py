"""Forecasts of a whole history: `serving.score` against one server-path call per bar, in one run.

    python -m benchmarks.score_throughput --model model.onnx --parquet bars.parquet [--threads 1]
        [--batch 64] [--sample 2000]

* score       `serving.score.score` over every origin of the file: the features of the whole file
              once (`build_frame`), windows gathered in batches of `--batch`, one ONNX Runtime run
              per batch, the parquet written. Windows per second, wall clock, all of it counted.
* per bar     what scoring a history through the server's own steps costs without gRPC: for each of
              `--sample` origins spread over the file, its last `bars_required` bars as request
              columns, `serving.preprocess.prepare` (features.latest_windows) and a run of one
              window. Windows per second.

Both on the same model, ONNX Runtime threads and machine, one after the other.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from features.bars import read_bars
from features.schema import QUANTILES
from serving.model import load_model
from serving.preprocess import prepare
from serving.score import score
from serving.validation import SeriesColumns


def per_bar(model_path: Path, parquet: Path, threads: int, sample: int) -> tuple[int, float]:
    """Windows and seconds of `sample` origins through prepare + a run of one."""
    model = load_model(model_path, "cpu", threads, max_batch=1)
    meta = model.meta
    bars = read_bars(parquet, None, tuple(meta.feature_config.user_columns))
    n = meta.bars_required
    calls = []
    for symbol, rows in bars.series_slices().items():
        if symbol not in meta.symbols or rows.stop - rows.start < n:
            continue
        ends = np.arange(rows.start + n, rows.stop + 1)
        for end in ends[np.linspace(0, ends.size - 1, max(1, sample // len(meta.symbols))).astype(np.int64)]:
            sl = slice(int(end) - n, int(end))
            calls.append(SeriesColumns(symbol, bars.timestamp_ns[sl], bars.open[sl], bars.high[sl], bars.low[sl],
                                       bars.close[sl], bars.volume[sl],
                                       {u: bars.user[u][sl] for u in meta.feature_config.user_columns}))
    for s in calls[:20]:  # warm
        model.run(prepare([s], meta).inputs)
    start = time.perf_counter()
    for s in calls:
        model.run(prepare([s], meta).inputs)[QUANTILES]
    return len(calls), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="ONNX model from `python -m export`")
    p.add_argument("--parquet", type=Path, required=True, help="bars with the model's symbols")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads, both paths (default 1)")
    p.add_argument("--batch", type=int, default=64, help="windows per run in the score path (default 64)")
    p.add_argument("--sample", type=int, default=2000, help="origins timed through the per-bar path (default 2000)")
    args = p.parse_args(argv)
    if min(args.threads, args.batch, args.sample) < 1:
        p.error("--threads, --batch and --sample must be at least 1")
    model = load_model(args.model, "cpu", args.threads, max_batch=args.batch)
    meta = model.meta
    bars = read_bars(args.parquet, None, tuple(meta.feature_config.user_columns))
    symbols = [s for s in meta.symbols if s in bars.series_slices()]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        summary = score(model, bars, Path(tmp) / "f.parquet", symbols, None, None, args.batch)
        seconds = time.perf_counter() - start
    windows = sum(summary.windows.values())
    sampled, bar_seconds = per_bar(args.model, args.parquet, args.threads, args.sample)
    rate, bar_rate = windows / seconds, sampled / bar_seconds
    print(f"model {meta.model_version}: encoder {meta.encoder_length}, horizon {meta.horizon}, "
          f"{len(meta.feature_schema.observed)} observed features; {len(bars):,} bars; ONNX Runtime threads "
          f"{args.threads}")
    print("| path | windows | seconds | windows/s |")
    print("|---|---|---|---|")
    print(f"| `serving.score` (batch {args.batch}, parquet written) | {windows:,} | {seconds:.2f} | {rate:,.0f} |")
    print(f"| per bar: prepare + run of one | {sampled:,} | {bar_seconds:.2f} | {bar_rate:,.0f} |")
    print(f"score / per bar: {rate / bar_rate:.1f}x")
    print(f"machine: {platform.machine()}, python {platform.python_version()}, onnxruntime {ort.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
