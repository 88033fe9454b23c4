"""Throughput of the features package on 1,000,000 bars (CPU only, no torch).

    python -m benchmarks.features_throughput [--bars 1000000] [--symbols 4] [--batch 256] [--repeats 3]
        [--calendar-tz America/Chicago] [--contracts]

Generates the bars once with features.synth (not timed), writes them as one parquet file,
then times each stage `--repeats` times and reports the median:

* read_bars      read the parquet file and validate every row rule
* build_frame    every feature array: observed, known, targets
* bars_digest    the digest of the bars a training run keeps, which its resume checks
* windows        anchor_rows over the whole frame + gather_windows of one random batch

With `--contracts` the bars are per-contract (features.synth's quarterly contracts, `--bars` session minutes
per root) and one more stage is timed after read_bars:
* continuous     the volume roll rule: one continuous series per root (features.rolls)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from features import FeatureConfig, build_frame, read_bars
from features.bars import ColumnMap, bars_digest
from features.contracts import ContractConfig
from features.rolls import continuous
from features.synth import KNOWN_SYMBOLS, generate, generate_contracts
from features.windows import anchor_rows, gather_windows


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bars", type=int, default=1_000_000, help="total bars over all symbols (default 1,000,000)")
    p.add_argument("--symbols", type=int, default=4, help="number of symbols (default 4)")
    p.add_argument("--encoder-length", type=int, default=120, help="encoder bars per window (default 120)")
    p.add_argument("--horizon", type=int, default=5, help="forecast steps (default 5)")
    p.add_argument("--batch", type=int, default=256, help="windows gathered per batch (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per stage; the median is reported")
    p.add_argument("--calendar-tz", default="UTC", help="time zone of the calendar features (default UTC)")
    p.add_argument("--contracts", action="store_true",
                   help="per-contract bars rolled into one series per root (the stitch is timed on its own)")
    args = p.parse_args(argv)
    if args.symbols < 1 or args.bars < args.symbols or args.repeats < 1 or args.batch < 1:
        p.error("need --symbols >= 1, --bars >= --symbols, --repeats >= 1, --batch >= 1")
    names = list(KNOWN_SYMBOLS)[: args.symbols] + [f"S{i}" for i in range(args.symbols - len(KNOWN_SYMBOLS))]
    per_symbol = args.bars // args.symbols
    n = per_symbol * args.symbols
    config = FeatureConfig(horizon=args.horizon, calendar_tz=args.calendar_tz,
                           contracts=ContractConfig() if args.contracts else None)
    cmap = ColumnMap(timestamp="ts_event") if args.contracts else None

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bars.parquet"
        t0 = time.perf_counter()
        pq.write_table(generate_contracts(names, per_symbol, seed=7) if args.contracts
                       else generate(names, per_symbol, seed=7), path)
        gen_s = time.perf_counter() - t0
        size_mb = path.stat().st_size / 2**20

        read_s, raw = median_seconds(lambda: read_bars(path, cmap), args.repeats)
        stitch_s, (bars, rolls) = median_seconds(lambda: continuous(raw, config), args.repeats)
        build_s, frame = median_seconds(lambda: build_frame(bars, config), args.repeats)
        digest_s, _ = median_seconds(lambda: bars_digest(bars, ()), args.repeats)
        rng = np.random.default_rng(0)

        def windows() -> dict[str, np.ndarray]:
            anchors = anchor_rows(frame, args.encoder_length)
            batch = rng.choice(anchors, size=min(args.batch, anchors.size), replace=False)
            return gather_windows(frame, np.sort(batch), args.encoder_length)

        win_s, batch = median_seconds(windows, args.repeats)

    n = len(bars)  # the series' bars (per-contract files: the continuous series')
    kind = f"; per-contract: {len(raw):,} rows, {len(rolls)} rolls" if args.contracts else ""
    print(f"features throughput: {n:,} bars ({args.symbols} symbols x {per_symbol:,}), parquet {size_mb:.1f} MiB, "
          f"median of {args.repeats}; generated in {gen_s:.1f} s (not timed){kind}")
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
          f"{platform.processor() or platform.system()}")
    anchors = anchor_rows(frame, args.encoder_length).size
    rows = [("read_bars (read + validate)", read_s, f"{len(raw) / read_s:,.0f} rows/s")]
    if args.contracts:
        rows.append((f"continuous (roll {config.contracts.roll if config.contracts else ''})", stitch_s,
                     f"{stitch_s / (read_s + build_s):.2f}x read + build"))
    rows += [
        (f"build_frame (H={args.horizon}, volatility window {config.volatility_window}, calendar "
         f"{config.calendar_tz})", build_s, f"{n / build_s:,.0f} bars/s"),
        ("read + build", read_s + build_s, f"{n / (read_s + build_s):,.0f} bars/s"),
        ("bars_digest (what a resume checks)", digest_s, f"{n / digest_s:,.0f} bars/s"),
        (f"anchor_rows ({anchors:,}) + gather_windows (B={args.batch}, L={args.encoder_length})", win_s,
         f"{args.batch / win_s:,.0f} windows/s")]
    width = max(len(r[0]) for r in rows)
    print(f"{'stage':<{width}} {'seconds':>8} {'rate':>20}")
    for name, secs, rate in rows:
        print(f"{name:<{width}} {secs:>8.3f} {rate:>20}")
    print("batch: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
