"""Out-of-sample quality of the default model against the desk's baselines, through `python -m backtest`.

    python -m benchmarks.backtest_quality --data synth --out /tmp/bq_synth [trainer flags ...]
    python -m benchmarks.backtest_quality --data nasdaq --out /tmp/bq_nasdaq --horizon 5 [...]

* synth   `features.synth` bars with planted volatility clustering: 4 symbols (ES, NQ, CL, GC) x `--bars`
          one-minute bars (default 50,000), seed 11.
* nasdaq  the NASDAQ Composite's daily bars 1999-2018 that ship inside the `arch` package
          (`arch.data.nasdaq`), one series.

Runs the backtest (`--folds`, default 4, over the last half of the bar times) with the trainer flags given,
then prints per fold: the model's mean pinball over each baseline's and over the best one's, the 80% interval's
coverage before and after calibration, and the P50's coverage; and the same over all folds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from features.synth import generate


def synth_bars(path: Path, bars: int) -> None:
    pq.write_table(generate(["ES", "NQ", "CL", "GC"], bars, seed=11), path)


def nasdaq_bars(path: Path) -> None:
    from arch.data import nasdaq

    frame = nasdaq.load()
    pq.write_table(pa.table({
        "timestamp": pa.array(frame.index.values.astype("datetime64[ns]"), type=pa.timestamp("ns", tz="UTC")),
        "symbol": pa.array(["NASDAQ"] * len(frame)),
        **{name.lower(): pa.array(frame[name].to_numpy(np.float64)) for name in ("Open", "High", "Low", "Close",
                                                                                  "Volume")},
    }), path)


def table(scores: dict[str, Any]) -> list[str]:
    """A row per fold and one for all: ratios to each baseline and to the best, coverage before/after."""
    baselines = scores["baselines"]
    head = (f"{'fold':>4} {'origins':>8} " + " ".join(f"{'/' + b:>12}" for b in baselines)
            + f" {'/best':>7} {'best':>12} {'80% raw':>8} {'80% cal':>8} {'P50 cal':>8} {'/best raw':>9}")
    lines = [head]
    for key, block in [*scores["folds"].items(), ("all", scores["all"])]:
        model, raw = block["forecasters"]["model"], block["forecasters"]["model_uncalibrated"]
        p50 = scores["quantiles"].index(0.5) if 0.5 in scores["quantiles"] else None
        lines.append(f"{key:>4} {block['origins']:>8} "
                     + " ".join(f"{model['ratio_to'][b]:>12.3f}" for b in baselines)
                     + f" {model['ratio_to']['best_baseline']:>7.3f} {model['best_baseline']:>12}"
                     + f" {raw['interval']['coverage']:>8.1%} {model['interval']['coverage']:>8.1%}"
                     + f" {model['coverage'][p50] if p50 is not None else float('nan'):>8.1%}"
                     + f" {raw['ratio_to']['best_baseline']:>9.3f}")
    mean = scores["all"].get("fold_mean_ratio_to_best_baseline", {})
    lines.append("mean over folds of model / best baseline: "
                 + ", ".join(f"{name} {value:.3f}" for name, value in mean.items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=("synth", "nasdaq"), required=True)
    p.add_argument("--out", type=Path, required=True, help="the backtest's --out (rerun to resume)")
    p.add_argument("--bars", type=int, default=50_000, help="synth: bars per symbol (default 50,000)")
    p.add_argument("--folds", type=int, default=4)
    args, trainer_flags = p.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bars = args.out / "bars.parquet"
    if not bars.exists():
        synth_bars(bars, args.bars) if args.data == "synth" else nasdaq_bars(bars)
    command = [sys.executable, "-m", "backtest", "--parquet", str(bars), "--out", str(args.out / "bt"),
               "--folds", str(args.folds), *trainer_flags]
    print("$ " + " ".join(command), flush=True)
    if code := subprocess.run(command, check=False).returncode:
        return code
    scores = json.loads((args.out / "bt" / "scores.json").read_text())
    print("\n".join(table(scores)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
