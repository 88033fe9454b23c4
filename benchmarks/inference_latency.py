"""Inference latency of the TFT: ONNX Runtime (CPU provider) against PyTorch eager (CPU), same model.

    python -m benchmarks.inference_latency [--batches 1 32 256] [--threads 1 2] [--min-seconds 3]
                                           [--min-iters 100] [--hidden-size 64] [--attention-heads 4]
                                           [--encoder-length 60] [--horizon 5] [--symbols 2]

The model: a realistic size (hidden 64, 4 heads, encoder 60, horizon 5, 2 symbols, the
builtin 5 observed + 4 known features), *random initial weights* (latency does not depend on
trained values) with normalisation statistics fitted on synthetic bars from features.synth,
whose windows are also the inputs. It is exported exactly as `python -m export` exports
(export.onnx_export.export_model: torch.export-based, opset 18, fp32, explain outputs on),
and the two runtimes are checked to agree before anything is timed.

Timing: per batch size, rounds of `--block` calls alternate between ONNX Runtime and eager
(so a neighbour's load hits both alike) until each side has at least `--min-iters` calls and
`--min-seconds` of wall time; after `--warmup` untimed calls each. Reported: median and p99
latency per call, and ONNX Runtime / eager ratios (below 1 = ONNX Runtime faster). Eager runs
under torch.inference_mode(); ONNX Runtime with all graph optimisations, sequential execution,
intra-op threads = PyTorch threads = each value of --threads.

Figures, with the command and the machine's load: BENCHMARKS.md.

With 2 threads on 2 busy cores, eager's p99 explodes (OpenMP threads spinning against the
neighbours); one thread per process is the better setting on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from export.onnx_export import export_model, input_names
from export.options import DEFAULT_OPSET
from features.compute import build_frame
from features.config import FeatureConfig
from features.schema import MODEL_INPUTS
from features.synth import KNOWN_SYMBOLS, generate
from features.windows import anchor_rows, gather_windows
from trainer.model_config import ModelConfig
from trainer.modeling import TemporalFusionTransformer


@dataclass(frozen=True)
class Stats:
    median_ms: float
    p99_ms: float
    n: int


def stats(seconds: list[float]) -> Stats:
    ms = np.asarray(seconds) * 1e3
    return Stats(float(np.median(ms)), float(np.percentile(ms, 99)), int(ms.size))


def realistic_windows(args: argparse.Namespace, n_windows: int) -> tuple[dict[str, np.ndarray], FeatureConfig]:
    """Windows of synthetic bars, computed exactly as training and serving compute them."""
    import tempfile
    from pathlib import Path

    import pyarrow.parquet as pq

    from features.bars import read_bars

    symbols = list(KNOWN_SYMBOLS)[: args.symbols] + [f"S{i}" for i in range(args.symbols - len(KNOWN_SYMBOLS))]
    config = FeatureConfig(horizon=args.horizon)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bars.parquet"
        pq.write_table(generate(symbols, max(2000, n_windows // len(symbols) + 200), seed=7), path)
        frame = build_frame(read_bars(path), config, symbols)
    anchors = anchor_rows(frame, args.encoder_length, require_targets=False)
    rng = np.random.default_rng(0)
    pick = np.sort(rng.choice(anchors, size=n_windows, replace=anchors.size < n_windows))
    windows = gather_windows(frame, pick, args.encoder_length)
    out = {name: np.ascontiguousarray(windows[name]) for name in MODEL_INPUTS}
    return out, config


def build_model(args: argparse.Namespace, windows: dict[str, np.ndarray]) -> TemporalFusionTransformer:
    n_obs, n_known = windows[MODEL_INPUTS[1]].shape[-1], windows[MODEL_INPUTS[2]].shape[-1]
    cfg = ModelConfig(n_observed=n_obs, n_known=n_known, static_cardinalities=(args.symbols,),
                      hidden_size=args.hidden_size, attention_heads=args.attention_heads,
                      encoder_length=args.encoder_length, horizon=args.horizon)
    torch.manual_seed(0)
    model = TemporalFusionTransformer(cfg).eval()
    obs = windows[MODEL_INPUTS[1]].reshape(-1, n_obs)
    known = windows[MODEL_INPUTS[2]].reshape(-1, n_known)
    model.set_normalization(obs.mean(0), obs.std(0) + 1e-6, known.mean(0), known.std(0) + 1e-6,
                            np.full(cfg.horizon, 1e-3, dtype=np.float32))
    return model


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def measure(ort_call: Callable[[], Any], torch_call: Callable[[], Any], args: argparse.Namespace
            ) -> tuple[Stats, Stats]:
    for _ in range(args.warmup):
        ort_call()
        torch_call()
    o: list[float] = []
    t: list[float] = []
    start = time.perf_counter()
    while len(o) < args.min_iters or len(t) < args.min_iters or time.perf_counter() - start < args.min_seconds:
        o += timed(ort_call, args.block)
        t += timed(torch_call, args.block)
        if len(o) >= args.max_iters:
            break
    return stats(o), stats(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256], help="batch sizes (default 1 32 256)")
    p.add_argument("--threads", type=int, nargs="+", default=[1],
                   help="CPU thread counts to measure, one table each (default 1)")
    p.add_argument("--min-seconds", type=float, default=3.0, help="minimum timed wall time per batch size")
    p.add_argument("--min-iters", type=int, default=100, help="minimum timed calls per runtime and batch size")
    p.add_argument("--max-iters", type=int, default=20000, help="stop a batch size after this many calls")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per runtime first")
    p.add_argument("--block", type=int, default=10, help="calls per alternation round")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--attention-heads", type=int, default=4)
    p.add_argument("--encoder-length", type=int, default=60)
    p.add_argument("--horizon", type=int, default=5)
    p.add_argument("--symbols", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.batches) < 1 or min(args.threads) < 1 or args.min_iters < 1 or args.block < 1 or args.symbols < 1:
        p.error("batch sizes, thread counts, --min-iters, --block and --symbols must be >= 1")

    torch.set_num_threads(max(args.threads))
    windows, _ = realistic_windows(args, max(2, *args.batches))  # export takes an example of 2 windows
    model = build_model(args, windows)
    t0 = time.perf_counter()
    names = input_names(model.cfg)
    example = {name: torch.from_numpy(windows[name][:2]) for name in names}
    onnx_bytes = export_model(model, example, DEFAULT_OPSET, explain=True).SerializeToString()
    export_s = time.perf_counter() - t0
    cfg = model.cfg
    n_params = sum(x.numel() for x in model.parameters())

    print(f"inference latency: TFT hidden {cfg.hidden_size}, {cfg.attention_heads} heads, encoder "
          f"{cfg.encoder_length}, horizon {cfg.horizon}, {cfg.n_quantiles} quantiles, {args.symbols} symbols, "
          f"{cfg.n_observed} observed + {cfg.n_known} known features, {n_params:,} parameters "
          "(random init, normalisation fitted on synthetic bars); ONNX opset "
          f"{DEFAULT_OPSET} fp32 with explain outputs, exported in {export_s:.1f} s")
    print(f"python {platform.python_version()}, torch {torch.__version__}, onnxruntime {ort.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    print(f"timing: median and p99 per call; >= {args.min_iters} calls and >= {args.min_seconds:g} s per cell, "
          f"ONNX Runtime and eager alternating in rounds of {args.block}")

    for threads in args.threads:
        torch.set_num_threads(threads)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
        print(f"\nthreads {threads} (torch.set_num_threads({threads}), ORT intra_op_num_threads={threads})")
        head = (f"{'batch':>5}  {'eager median':>12}  {'eager p99':>11}  {'ORT median':>11}  {'ORT p99':>11}  "
                f"{'ORT/eager median':>16}  {'ORT/eager p99':>13}  {'calls ORT/eager':>15}  {'max |diff|':>10}")
        print(head)
        print("-" * len(head))
        ratios: dict[int, float] = {}
        for batch in args.batches:
            feeds = {name: windows[name][:batch] for name in names}
            tensors = tuple(torch.from_numpy(feeds[name]) for name in names)
            with torch.inference_mode():
                expected = model(*tensors).quantiles.numpy()
            diff = float(np.abs(session.run(["quantiles"], feeds)[0] - expected).max())

            def run_ort(feeds: dict[str, np.ndarray] = feeds, session: ort.InferenceSession = session) -> Any:
                return session.run(None, feeds)

            def run_torch(tensors: tuple[torch.Tensor, ...] = tensors) -> Any:
                with torch.inference_mode():
                    return model(*tensors)

            o, t = measure(run_ort, run_torch, args)
            ratios[batch] = o.median_ms / t.median_ms
            cells = [f"{v:>8.3f} ms" for v in (t.median_ms, t.p99_ms, o.median_ms, o.p99_ms)]
            print(f"{batch:>5}  {cells[0]:>12}  {cells[1]:>11}  {cells[2]:>11}  {cells[3]:>11}  "
                  f"{o.median_ms / t.median_ms:>16.3f}  {o.p99_ms / t.p99_ms:>13.3f}  {f'{o.n}/{t.n}':>15}  "
                  f"{diff:>10.1e}", flush=True)
        if 1 in ratios:
            verdict = "met" if ratios[1] <= 0.5 else "NOT met"
            print(f"target (ONNX Runtime median <= 0.5 x eager at batch 1): {verdict} ({ratios[1]:.3f})")
    print(f"\nload average {os.getloadavg()[0]:.2f} at end (other processes share these CPUs; p99 is the figure "
          "their load disturbs most)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
