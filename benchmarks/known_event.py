"""A scheduled event as a known-future input: the same model trained with and without it, on held-out bars.

    python -m benchmarks.known_event --out /tmp/ke [--bars 100000] [trainer flags ...]
    python -m benchmarks.known_event --out /tmp/ke_quick --quick

Bars: `features.synth` ES, NQ, CL, GC x `--bars` one-minute bars, seed 11, with a scheduled event at 15:00,
16:30, 18:00 and 19:30 UTC on every `--event-every`th session (4: no weekday pattern, so the calendar features
cannot tell the event days), after which volatility jumps x`--event-jump` and decays within ~10 bars. The 0/1
column `event` is set on the event bar.

Runs `python -m trainer` twice on those bars with the same flags and seed and `--test-fraction 0.2`, the second
time with `--known-features event`; exports each (`python -m export`); then runs each exported ONNX model on every
window whose origin lies in the test split (`features.windows.gather_windows`, as `serving.score` builds them)
and prints the mean pinball loss of the log-return quantiles over the windows whose horizon (the H bars after
the origin) holds an event bar, over all other windows, and the ratio with / without on each. Target: <= 0.90 on
the event windows. Also printed: the known model's mean decoder selection weight of `event` on the steps that are
event bars and on all other steps.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.parquet as pq

from features.bars import read_bars
from features.compute import build_frame
from features.metrics import pinball
from features.model_meta import ModelMeta, stored_props
from features.schema import DECODER_WEIGHTS, QUANTILES, STATIC_CATEGORICAL, TARGET
from features.synth import Covariates, generate
from features.windows import anchor_rows, gather_windows

SYMBOLS = ["ES", "NQ", "CL", "GC"]
EVENT_TIMES = ("15:00", "16:30", "18:00", "19:30")  # 90 bars apart: an encoder of 60 bars sees no earlier one
EVENT = "event"
QUICK = ["--epochs", "1", "--max-steps-per-epoch", "4", "--hidden-size", "8", "--attention-heads", "1",
         "--encoder-length", "20", "--batch-size", "32", "--warmup-steps", "0", "--max-val-windows", "256",
         "--device", "cpu", "--threads", "1"]


def write_bars(path: Path, bars: int, every: int, jump: float) -> None:
    events = Covariates(event_times=EVENT_TIMES, event_every=every, event_column=EVENT, event_jump=jump)
    pq.write_table(generate(SYMBOLS, bars, seed=11, covariates=events), path)


def run(command: list[str]) -> float:
    """Run a command, printed first; its wall seconds. Exits with its status when it fails."""
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    if code := subprocess.run(command, check=False).returncode:
        raise SystemExit(code)
    return time.perf_counter() - start


def train_and_export(bars: Path, out: Path, flags: list[str]) -> Path:
    """One model: `python -m trainer` then `python -m export`; the ONNX model's path."""
    out.mkdir(parents=True, exist_ok=True)
    ckpt, model = out / "ckpt.pt", out / "model.onnx"
    trained = run([sys.executable, "-m", "trainer", "--parquet", str(bars), "--out", str(ckpt), "--no-progress",
                   "--no-report", "--test-fraction", "0.2", *flags])
    exported = run([sys.executable, "-m", "export", str(ckpt), str(model)])
    print(f"  trained in {trained:.0f} s, exported in {exported:.0f} s", flush=True)
    return model


def score(model_path: Path, bars: Path, threads: int) -> dict[str, np.ndarray]:
    """The model's test-split windows: row of each anchor [W], mean pinball per window [W], whether its horizon
    holds an event bar [W], and where the event bars fall [W, H] with the decoder weight of `event` [W, H] (NaN
    when the model does not read it)."""
    meta = ModelMeta.from_props(stored_props(model_path.read_bytes()))
    config = meta.feature_config
    data = read_bars(bars, None, tuple(dict.fromkeys((*config.real_columns, EVENT))),
                     label_columns=config.categorical_columns)  # the model's columns and the event flag
    frame = build_frame(data, config, list(meta.symbols), meta.bar_interval_ns)
    anchors = anchor_rows(frame, meta.encoder_length, require_targets=True)
    anchors = anchors[frame.timestamp_ns[anchors] >= int(meta.training["test_from_ns"])]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    flag = np.asarray(data.user[EVENT]) > 0  # [N]
    steps = anchors[:, None] + np.arange(1, meta.horizon + 1)  # [W, H] the horizon's rows
    loss, weight = np.empty(anchors.size), np.full(steps.shape, np.nan)
    column = meta.feature_schema.known.index(EVENT) if EVENT in meta.feature_schema.known else None
    for chunk in np.array_split(np.arange(anchors.size), max(1, anchors.size // 4096)):
        windows = gather_windows(frame, anchors[chunk], meta.encoder_length)
        q, w = run_windows(session, windows)
        loss[chunk] = pinball(q.astype(np.float64), windows[TARGET].astype(np.float64),
                              np.asarray(meta.quantiles)).mean(axis=(1, 2))
        if w is not None and column is not None:
            weight[chunk] = w[..., column]
    return {"anchor": anchors, "loss": loss, "event": flag[steps].any(axis=1), "event_step": flag[steps],
            "weight": weight}


def run_windows(session: ort.InferenceSession,
                windows: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """Quantiles [B, H, Q] and decoder selection weights [B, H, n_known] (None without them) of `windows`, the
    inputs as `serving.score` gives them (float32, warm-up NaN as zero)."""
    feed = {i.name: windows[i.name].astype(np.int64) if i.name == STATIC_CATEGORICAL else
            np.nan_to_num(np.asarray(windows[i.name], dtype=np.float32), nan=0.0) for i in session.get_inputs()}
    wanted = [QUANTILES, *[o.name for o in session.get_outputs() if o.name == DECODER_WEIGHTS]]
    got = session.run(wanted, feed)
    return got[0], got[1] if len(got) > 1 else None


def report(plain: dict[str, np.ndarray], known: dict[str, np.ndarray], about: str) -> list[str]:
    """The comparison as BENCHMARKS.md prints it; `about` describes the run."""
    if not np.array_equal(plain["anchor"], known["anchor"]):
        raise SystemExit("error: the two models' test windows differ; give both the same bars and split")
    if not known["event"].any():
        raise SystemExit("error: no test window's horizon holds an event: give more --bars")
    lines = [about, "", "| test windows | count | without `event` | with `event` known | with / without |",
             "|---|---|---|---|---|"]
    ratios = {}
    for label, rows in (("horizon holds an event", known["event"]), ("all others", ~known["event"]),
                        ("all", np.ones_like(known["event"]))):
        a, b = float(plain["loss"][rows].mean()), float(known["loss"][rows].mean())
        ratios[label] = b / a
        lines.append(f"| {label} | {int(rows.sum()):,} | {a:.4e} | {b:.4e} | **{b / a:.3f}** |")
    event_steps = known["event_step"]
    lines.append(f"decoder selection weight of `event` (with): {np.nanmean(known['weight'][event_steps]):.3f} on "
                 f"event bars, {np.nanmean(known['weight'][~event_steps]):.3f} on other steps")
    met = "met" if ratios["horizon holds an event"] <= 0.9 else "NOT met"
    lines.append(f"target with / without <= 0.90 on event windows: {met}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder of the bars, checkpoints and models")
    p.add_argument("--bars", type=int, default=100_000, help="bars per symbol (default 100,000)")
    p.add_argument("--event-every", type=int, default=4, help="the event falls on every Nth session (default 4)")
    p.add_argument("--event-jump", type=float, default=6.0, help="volatility multiplier on the event bar (default 6)")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads when scoring (default 2)")
    p.add_argument("--quick", action="store_true", help="a toy run: 4,000 bars per symbol, a tiny model, 4 steps")
    args, flags = p.parse_known_args(argv)
    print("$ python -m benchmarks.known_event " + " ".join(sys.argv[1:] if argv is None else argv), flush=True)
    flags = [*QUICK, *flags] if args.quick else flags
    bars_per_symbol = 4_000 if args.quick else args.bars
    args.out.mkdir(parents=True, exist_ok=True)
    bars = args.out / f"bars_{bars_per_symbol}_{args.event_every}_{args.event_jump:g}.parquet"
    if not bars.exists():
        write_bars(bars, bars_per_symbol, args.event_every, args.event_jump)
    plain = train_and_export(bars, args.out / "without", flags)
    known = train_and_export(bars, args.out / "with", [*flags, "--known-features", EVENT])
    about = (f"bars: {len(SYMBOLS)} symbols x {bars_per_symbol:,} one-minute bars, seed 11; `event` at "
             f"{', '.join(EVENT_TIMES)} UTC on every {args.event_every}th session, volatility x{args.event_jump:g}; "
             f"trainer flags: {' '.join(flags) or 'none'} (and --test-fraction 0.2)")
    print("\n".join(report(score(plain, bars, args.threads), score(known, bars, args.threads), about)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
