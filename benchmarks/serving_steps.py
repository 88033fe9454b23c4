"""The server's own steps for one Predict call, timed in-process: what each costs without gRPC or load.

    python -m benchmarks.serving_steps --model model.onnx --parquet bars.parquet [--packed] [--batch 8]
        [--repeats 5]

Builds requests as `benchmarks.serving_load` does (one series each, the latest `bars_required` bars),
then times with `timeit` (best of `--repeats`, hot loops):

* parse_request     protobuf columns -> checked numpy columns, trimmed (`serving.validation`)
* prepare, 1        features of one series (`serving.preprocess.prepare`: features.latest_windows)
* prepare, batch    features of `--batch` series at once, per series (what a micro-batch pays)
* run_batch, 1      features + ONNX Runtime run + output checks for a lone call (`serving.inference`)
* session.run, 1    the bare ONNX Runtime run of one window, for scale
* build_response    model outputs -> PredictResponse (`serving.postprocess`)

`--calendar-tz ZONE` adds the two prepare rows with the calendar features in that zone (the model's
metadata changed in memory for the timing; its weights are not retrained for it), beside the model's own.

To compare two builds, run it from each checkout in turn (`cd OTHER && python -m
benchmarks.serving_steps ...`), alternating: these are microseconds, and the machine's state moves
them between runs as much as small changes do.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnxruntime as ort

from benchmarks.serving_load import model_and_bars, request_pool
from serving.inference import run_batch
from serving.postprocess import build_response
from serving.preprocess import prepare
from serving.validation import parse_request


def best_us(fn: Callable[[], Any], number: int, repeats: int, per: int = 1) -> float:
    """Best of `repeats` timings of `number` calls, in microseconds per call (divided by `per`)."""
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number / per * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="ONNX model from `python -m export`")
    p.add_argument("--parquet", type=Path, required=True, help="bars with the model's symbols")
    p.add_argument("--packed", action="store_true",
                   help="send user feature columns as one packed block (user_features_raw), not a field each")
    p.add_argument("--batch", type=int, default=8, help="series in the batched prepare row (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="timings per step; the best is reported (default 5)")
    p.add_argument("--seconds", type=float, default=0.2, help="about how long each timing lasts (default 0.2)")
    p.add_argument("--calendar-tz", help="also time prepare with the calendar features in this zone")
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or args.seconds <= 0:
        p.error("need --batch >= 1, --repeats >= 1 and --seconds > 0")
    model, bars = model_and_bars(p, args.model, args.parquet, max(64, args.batch), warm=True)
    meta = model.meta
    pool = request_pool(bars, meta, max(16, args.batch), packed=args.packed)
    calls = [parse_request(r, meta) for r in pool[:args.batch]]
    batch = [s for c in calls for s in c]
    lone = calls[0]
    result = run_batch(model, [lone])[0]
    if isinstance(result, Exception):
        raise SystemExit(f"a lone call on {args.model} failed, so there is nothing to time: {result}")
    names = list(model.output_names)

    def time_it(fn: Callable[[], Any], per: int = 1) -> float:
        start = timeit.default_timer()
        fn()
        once = max(timeit.default_timer() - start, 1e-7)
        return best_us(fn, max(1, int(args.seconds / once)), args.repeats, per)

    rows = [
        ("parse_request", time_it(lambda: parse_request(pool[0], meta))),
        ("prepare, 1", time_it(lambda: prepare(lone, meta))),
        (f"prepare, batch of {args.batch} (per series)", time_it(lambda: prepare(batch, meta), args.batch)),
        ("run_batch, 1", time_it(lambda: run_batch(model, [lone]))),
        ("session.run, 1", time_it(lambda: model.session.run(names, result.prepared.inputs))),
        ("build_response", time_it(lambda: build_response(result.prepared, result.outputs, meta, model.version,
                                                          False))),
    ]
    if args.calendar_tz:
        zoned = dataclasses.replace(meta, feature_config=dataclasses.replace(meta.feature_config,
                                                                             calendar_tz=args.calendar_tz))
        rows[3:3] = [(f"prepare, 1, {args.calendar_tz}", time_it(lambda: prepare(lone, zoned))),
                     (f"prepare, batch of {args.batch} (per series), {args.calendar_tz}",
                      time_it(lambda: prepare(batch, zoned), args.batch))]
    print(f"model {meta.model_version}: encoder {meta.encoder_length}, bars_required {meta.bars_required}, "
          f"{len(meta.feature_config.user_columns)} user columns{' (packed)' if args.packed else ''}; "
          f"request {pool[0].ByteSize():,} bytes")
    print("| step | µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:,.1f} |")
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"onnxruntime {ort.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
