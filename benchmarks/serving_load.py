"""Load test of `python -m serving` against bare ONNX Runtime on the same model, in one run.

    python -m benchmarks.serving_load --model model.onnx --parquet bars.parquet \\
        [--concurrency 1,8,64] [--duration 10] [--device cpu] [--threads 1] [--channels 1]
        [--server-arg=--workers=2] [--server-cpus 0-3] [--packed] [--client sync] [--no-floor] [--idle 5]
        [--rate 10,100,300] [--stream]
        [--json out.json]

1. Starts the real server (`python -m serving --port 0 --device cpu|cuda`) on 127.0.0.1 and
   waits for health SERVING (or drives `--target HOST:PORT`, a server already running).
2. Builds a pool of Predict requests, one series each, from windows ending at different
   bars of the parquet file (each the latest `bars_required` bars up to that point); with
   `--packed`, user feature columns travel as one float64 block (`user_features_raw`).
3. Bare ONNX Runtime: the same model in this process on the provider the server reports
   (GetModelInfo), same thread count, `session.run` on one window at a time (features
   precomputed, not timed), for `--duration` seconds; also the same runs 1 ms apart (what a
   cold cache costs a run that, as at concurrency 1, follows a pause), and features + run,
   to show what feature computation costs. The targets compare against the first. On CUDA, one
   more row: the same runs through the server's own `LoadedModel.run` (IO binding, with its
   bucket padding and slicing), to show what that path costs against plain `session.run`.
4. For each concurrency level: that many closed-loop clients (each sends its next request as
   soon as the previous answer arrives), spread over `--client-procs` processes with
   `--channels` connections each, for `--duration` seconds (loopback only). The clients are
   grpc.aio coroutines, or with `--client sync` one thread each on grpc's blocking stub, which
   is what a strategy engine calling from its own loop uses. With the server's `--workers`,
   give several channels: the kernel spreads connections, not calls, over the workers.
   Reports throughput, p50/p90/p99 latency, errors by status code, and from the server's
   Prometheus metrics its mean ONNX Runtime batch size, mean time in the Predict handler and
   mean time per batch; when this script started the server, also the CPU time its processes
   spent per answered call (user + system, from the clock's start until the clients are
   done), the figure to compare server builds by on a shared, noisy machine. A second table
   gives the server's mean time per step (parse, features, run, response) at each level.
5. The gRPC floor: the same clients calling the server's health Check (an empty handler behind
   the same interceptors) at the lowest and the highest level. No Predict call can answer
   faster than this row at concurrency 1, nor can Predict's throughput at the top level exceed
   this row's: it is what the gRPC stacks of client and server cost on this machine
   (`--no-floor` skips it).
6. With `--rate HZ[,HZ...]` (a server this script started): paced levels, one client sending a
   call every 1/HZ seconds whatever the answers' latency (a strategy asking once a bar, or many
   times a second), reporting p50/p99 and the server's CPU time as a share of one core. Each has its peer:
   bare `session.run` with the same pause between runs, which cold caches slow as well; and the
   first rate's empty call (health Check) paced alike, unless `--no-floor`.
7. With `--idle S` (a server this script started): the server's CPU time over S seconds with no
   call, after the levels, as a share of one core.
8. With `--stream`, every concurrency level again with each client on one open PredictStream
   instead of a call per request (send a request, wait for its answer, send the next): what a
   strategy that keeps a stream open gets. An answer carrying an error counts as an error.

Targets (issue 6): p50 at concurrency 1 within 1 ms of bare ONNX Runtime; throughput at 64
at least 4x that at 1; zero errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from threading import Barrier
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import psutil
from grpc import aio

from features.bars import BarDataError, Bars, read_bars
from features.model_meta import ModelMeta
from features.ort import preload_cuda_libraries
from serving.errors import ModelLoadError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.health_probe import wait_serving as health_wait
from serving.metrics import STEPS
from serving.model import LoadedModel, load_and_warm, load_model
from serving.preprocess import prepare
from serving.request_from_bars import FutureValues, series_from_bars
from serving.validation import columns_from_proto

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120.0  # the longest a level waits for its client processes to connect and warm up
IDLE_SETTLE_S = 0.5  # --idle: the wait after the last level before the idle clock starts
IDLE_GAP_S = 0.001  # the diagnostic bare row: runs this far apart, about a concurrency-1 client's round trip
PREDICT = "/foxhunt.tft.v1.Forecaster/Predict"
PREDICT_STREAM = "/foxhunt.tft.v1.Forecaster/PredictStream"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # the floor rows' method; b"" is its request (the whole server)


@dataclass
class Level:
    name: str
    concurrency: int
    requests: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: dict[str, int] = field(default_factory=dict)
    mean_batch: float = 0.0
    handler_ms: float = 0.0  # the server's mean time in the Predict handler (its own histogram)
    batch_ms: float = 0.0  # the server's mean time per batch: features, ONNX Runtime run, checks
    server_cpu_ms: float = 0.0  # CPU time (user + system) of the server's processes per answered call
    step_us: dict[str, float] = field(default_factory=dict)  # the server's mean time per step (foxhunt_step_*)
    server_cpu_pct: float = 0.0  # the same CPU time over the level's seconds, as a share of one core
    rate: float = 0.0  # a paced level's calls per second (0: closed loop)

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def percentiles(latencies_s: list[float]) -> tuple[float, float, float]:
    if not latencies_s:
        return float("nan"), float("nan"), float("nan")
    ms = np.asarray(latencies_s) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return float(p50), float(p90), float(p99)


# ---- requests ------------------------------------------------------------------------------------
def request_pool(bars: Bars, meta: ModelMeta, size: int, seed: int = 0, packed: bool = False
                 ) -> list[pb.PredictRequest]:
    """`size` one-series requests ending at random bars of random symbols (user columns packed into one
    block with `packed`)."""
    rng = np.random.default_rng(seed)
    fc = meta.feature_config
    slices = {s: sl for s, sl in bars.series_slices().items() if s in meta.symbols}
    need = meta.bars_required
    after = meta.horizon if fc.known_columns else 0  # bars after the origin: the known columns' future values
    symbols = [s for s, sl in slices.items() if sl.stop - sl.start >= need + after]
    if not symbols:
        raise SystemExit(f"no symbol of the model ({', '.join(meta.symbols)}) has {need + after} bars in the "
                         "parquet file")
    pool = []
    for _ in range(size):
        sym = symbols[int(rng.integers(len(symbols)))]
        sl = slices[sym]
        end = int(rng.integers(sl.start + need, sl.stop + 1 - after))
        future = FutureValues({c: bars.user[c][end:end + after] for c in fc.known_columns if c in bars.user},
                              {c: bars.labels[c][end:end + after] for c in fc.known_columns if c in bars.labels})
        series = series_from_bars(bars, sym, need, fc, packed=packed, last=end - 1, future=future)
        pool.append(pb.PredictRequest(series=[series]))
    return pool


# ---- bare ONNX Runtime ---------------------------------------------------------------------------
def bare_ort(model: Path, threads: int, provider: str, pool: list[pb.PredictRequest], meta: ModelMeta,
             duration: float, with_features: bool, gap_s: float = 0.0, bound: bool = False) -> Level:
    """One window at a time in a closed loop; with `gap_s`, idle that long between runs (untimed), as a
    server at concurrency 1 is between requests: shows what a cold cache costs the same run. With
    `bound`, the runs go through the server's own `LoadedModel.run` on CUDA device 0 (IO binding: inputs
    copied to the card, outputs allocated there and copied back; plus its bucket padding and slicing),
    to show what that path costs against plain `session.run`."""
    run: Callable[[dict[str, np.ndarray]], object]
    if bound:
        run = load_and_warm(model, "cuda", threads, max_batch=1).run
    else:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers: list[Any] = ["CPUExecutionProvider"]
        if provider == "CUDAExecutionProvider":  # as the server runs it (fp32, no TF32), CPU for shape nodes only
            providers = [(provider, {"use_tf32": "0"}), "CPUExecutionProvider"]
            preload_cuda_libraries()
        session = ort.InferenceSession(str(model), so, providers=providers)
        if session.get_providers()[0] != provider:
            raise SystemExit(f"bare ONNX Runtime baseline wanted {provider} but got {session.get_providers()}")
        run = functools.partial(session.run, None)
    columns = [[columns_from_proto(s) for s in r.series] for r in pool]
    feeds = [{k: v for k, v in prepare(c, meta).inputs.items() if k in meta.feature_schema.model_inputs}
             for c in columns]
    for f in feeds[:20]:
        run(f)
    latencies: list[float] = []
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < duration:
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        feed = prepare(columns[i % len(columns)], meta).inputs if with_features else feeds[i % len(feeds)]
        run(feed)
        latencies.append(time.perf_counter() - t0)
        i += 1
    seconds = sum(latencies) if gap_s else time.perf_counter() - start  # req/s of the runs, not of the pauses
    p50, p90, p99 = percentiles(latencies)
    name = ("bare: server's LoadedModel.run" if bound else
            "bare ORT: features + run" if with_features else "bare ORT: session.run")
    if gap_s:
        name += f", {gap_s * 1e3:g} ms apart"
    if provider != "CPUExecutionProvider":
        name += " (CUDA)"
    return Level(name, 1, len(latencies), seconds, p50, p90, p99)


def model_and_bars(p: argparse.ArgumentParser, model: Path, parquet: Path, max_batch: int = 64,
                   warm: bool = False) -> tuple[LoadedModel, Bars]:
    """The model on the CPU, checked (and with `warm`, warmed up) as the server does it, and the bars with
    its user columns. A bad file of either ends the command with its message (exit 2), no traceback."""
    try:
        loaded = load_and_warm(model, "cpu", 1, max_batch) if warm else load_model(model, max_batch=max_batch)
        fc = loaded.meta.feature_config
        return loaded, read_bars(parquet, user_columns=fc.real_columns, label_columns=fc.categorical_columns)
    except (ModelLoadError, BarDataError) as exc:
        p.error(str(exc))


# ---- the server ------------------------------------------------------------------------------------
def cpu_list(text: str) -> set[int]:
    """`0-3,6` (taskset's list form) -> {0, 1, 2, 3, 6}; ValueError naming what is wrong, or which CPUs this
    process may not use."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{text!r}: give CPU numbers and ranges separated by commas, e.g. 0-3,6")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    if unusable := cpus - os.sched_getaffinity(0):
        raise ValueError(f"{text!r}: CPU(s) {', '.join(map(str, sorted(unusable)))} are not available here "
                         f"(this process may use {', '.join(map(str, sorted(os.sched_getaffinity(0))))})")
    return cpus


def start_server(model: Path, device: str, threads: int, extra: list[str], log: Path, code: Path = REPO,
                 cpus: set[int] | None = None) -> tuple[subprocess.Popen[str], str, list[str]]:
    """The server process, its gRPC address and its metrics endpoints (one per worker with --workers).
    `code`: the checkout whose `serving` package runs (`python -m` imports from its working directory).
    `cpus`: run the server (every thread, and its workers) on these CPUs only, as `taskset -c` would."""
    cmd = [sys.executable, "-m", "serving", "--model", str(model), "--port", "0", "--metrics-port", "0",
           "--device", device, "--threads", str(threads), *extra]
    pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)  # in the child, before exec
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=code, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=pin)
    target = ""
    metrics: list[str] = []
    assert proc.stdout is not None
    workers = 1  # --workers N prints one metrics endpoint per worker
    for i, arg in enumerate(extra):
        if arg.startswith("--workers="):
            workers = int(arg.split("=", 1)[1])
        elif arg == "--workers" and i + 1 < len(extra):
            workers = int(extra[i + 1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (target and len(metrics) >= workers):
        line = proc.stdout.readline()
        if not line:
            break
        if m := re.match(r"listening on (\S+)", line):
            target = m.group(1)
        if m := re.match(r"metrics on (\S+)", line):
            metrics.append(m.group(1))
    if not target:
        proc.kill()
        raise SystemExit(f"server did not start; see {log}:\n{log.read_text()[-3000:]}")
    return proc, target, metrics


def wait_serving(target: str, timeout: float = 60) -> None:
    if not health_wait(target, timeout):
        raise SystemExit(f"server at {target} not SERVING after {timeout} s")


def server_provider(target: str) -> str:
    with grpc.insecure_channel(target) as ch:
        info = pb_grpc.ForecasterStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return str(info.provider)


# what a level reads from the server's /metrics: name -> the (sum, count) series, histograms and step counters
SERVER_SERIES: dict[str, tuple[str, str]] = {
    "windows": ("foxhunt_batch_windows_sum", "foxhunt_batch_windows_count"),
    "batch_s": ("foxhunt_inference_seconds_sum", "foxhunt_inference_seconds_count"),
    "handler_s": ('foxhunt_request_latency_seconds_sum{method="Predict"}',
                  'foxhunt_request_latency_seconds_count{method="Predict"}'),
    "stream_handler_s": ('foxhunt_request_latency_seconds_sum{method="PredictStream"}',
                         'foxhunt_request_latency_seconds_count{method="PredictStream"}'),  # per request
} | {f"{step}_s": (f'foxhunt_step_seconds_total{{step="{step}"}}', f'foxhunt_steps_total{{step="{step}"}}')
     for step in STEPS}


def server_counters(metrics: list[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each SERVER_SERIES pair over the server's /metrics endpoints (one per worker)."""
    out = {k: (0.0, 0.0) for k in SERVER_SERIES}
    for endpoint in metrics:
        text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
        for key, pair in SERVER_SERIES.items():
            found = [re.search(rf"^{re.escape(series)} (\S+)$", text, re.M) for series in pair]
            if found[0] and found[1]:
                total, count = out[key]
                out[key] = (total + float(found[0].group(1)), count + float(found[1].group(1)))
    return out


def _mean(before: tuple[float, float], after: tuple[float, float]) -> float:
    return (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else 0.0


async def _drive(target: str, pool: list[bytes], concurrency: int, offset: int, ready: Barrier, duration: float,
                 timeout: float, channels: int, method: str = PREDICT, interval: float = 0.0
                 ) -> tuple[list[float], dict[str, int]]:
    """`concurrency` closed-loop clients over `channels` connections (round robin) for `duration` seconds from
    when every client process is connected and warm (`ready`, which the level waits on too). Separate
    connections matter with `--workers`: the kernel spreads connections, not calls, over the server's
    processes. With `interval`, each client is paced instead: a call starts every `interval` seconds (at once
    when the last answer came later).

    Requests are pre-serialised and responses left as bytes: the client's own CPU cost is kept
    to gRPC itself, since it shares the machine with the server.
    """
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    opened = [aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(max(1, min(channels, concurrency)))]  # a connection of its own each
    try:
        predicts = [ch.unary_unary(PREDICT if method == PREDICT_STREAM else method, request_serializer=None,
                                   response_deserializer=None) for ch in opened]  # bytes in, bytes out
        for predict in predicts:  # connect and warm
            for r in pool[:10]:
                await predict(r, timeout=timeout)
        ready.wait(timeout=READY_TIMEOUT_S)  # blocks the loop, which has nothing else to run yet
        stop_at = time.perf_counter() + duration
        if method == PREDICT_STREAM:
            await asyncio.gather(*(_stream_worker(opened[k % len(opened)], pool, offset + k, stop_at, duration,
                                                  latencies, errors) for k in range(concurrency)))
            return latencies, dict(errors)

        async def worker(k: int) -> None:
            i = offset + k
            predict = predicts[k % len(predicts)]
            next_at = time.perf_counter()
            while time.perf_counter() < stop_at:
                if interval:  # paced: the next tick, or at once when the last answer came after it
                    now = time.perf_counter()
                    await asyncio.sleep(max(0.0, next_at - now))
                    next_at = max(next_at, now) + interval
                    if time.perf_counter() >= stop_at:
                        break
                t0 = time.perf_counter()
                try:
                    await predict(pool[i % len(pool)], timeout=timeout)
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError as exc:
                    errors[exc.code().name] += 1
                i += 7919  # a prime stride: clients walk the pool in different orders

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    finally:
        for ch in opened:
            await ch.close(None)
    return latencies, dict(errors)


async def _stream_worker(channel: aio.Channel, pool: list[bytes], i: int, stop_at: float, duration: float,
                         latencies: list[float], errors: Counter[str]) -> None:
    """One closed-loop client on one open PredictStream: a request, its answer, the next request."""
    open_stream = channel.stream_stream(PREDICT_STREAM, request_serializer=None, response_deserializer=None)
    call = open_stream(timeout=duration + 60)  # type: ignore[call-arg]  # written to, not fed an iterator
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await call.write(pool[i % len(pool)])
            answer = await call.read()
            if not isinstance(answer, bytes):  # grpc.aio.EOF: the server ended the stream
                errors[(await call.code()).name] += 1
                return
            # the pool's requests carry no request_id, so an answer's first field is its response (tag 0x12) or
            # its error (0x1a): protobuf writes fields in number order, and the answer stays unparsed, as Predict's
            if answer[:1] == b"\x1a":
                errors[pb.PredictStreamResponse.FromString(answer).error.code_name] += 1
            else:
                latencies.append(time.perf_counter() - t0)
            i += 7919
        await call.done_writing()
    except grpc.RpcError as exc:
        errors[exc.code().name] += 1


def _drive_sync(target: str, pool: list[bytes], concurrency: int, offset: int, ready: Barrier, duration: float,
                timeout: float, channels: int, method: str = PREDICT, interval: float = 0.0
                ) -> tuple[list[float], dict[str, int]]:
    """As `_drive`, with grpc's blocking stub: one thread per client, each waiting on its own call."""
    latencies: list[float] = []  # list.append is atomic: the threads share it
    errors: Counter[str] = Counter()
    lock = threading.Lock()
    opened = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(max(1, min(channels, concurrency)))]
    try:
        calls = [ch.unary_unary(method, request_serializer=None, response_deserializer=None) for ch in opened]
        for call in calls:  # connect and warm
            for r in pool[:10]:
                call(r, timeout=timeout)
        ready.wait(timeout=READY_TIMEOUT_S)
        stop_at = time.perf_counter() + duration

        def worker(k: int) -> None:
            i = offset + k
            call = calls[k % len(calls)]
            next_at = time.perf_counter()
            while time.perf_counter() < stop_at:
                if interval:  # paced: the next tick, or at once when the last answer came after it
                    now = time.perf_counter()
                    time.sleep(max(0.0, next_at - now))
                    next_at = max(next_at, now) + interval
                    if time.perf_counter() >= stop_at:
                        break
                t0 = time.perf_counter()
                try:
                    call(pool[i % len(pool)], timeout=timeout)
                    latencies.append(time.perf_counter() - t0)
                except grpc.RpcError as exc:
                    with lock:
                        errors[exc.code().name] += 1
                i += 7919

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for ch in opened:
            ch.close()
    return latencies, dict(errors)


def _client_process(args: tuple[str, list[bytes], int, int, Barrier, float, float, int, str, str, float]
                    ) -> tuple[list[float], dict[str, int]]:
    target, pool, concurrency, offset, ready, duration, timeout, channels, method, client, interval = args
    drive = (target, pool, concurrency, offset, ready, duration, timeout, channels, method, interval)
    if client == "sync":
        return _drive_sync(*drive)
    return asyncio.run(_drive(*drive))


def server_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by the server process and its workers; 0 without a pid."""
    if pid is None:
        return 0.0
    root = psutil.Process(pid)
    total = 0.0
    for p in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def run_level(target: str, metrics: list[str], pool: list[pb.PredictRequest], concurrency: int, duration: float,
              timeout: float, procs: int, channels: int = 1, floor: bool = False, server_pid: int | None = None,
              client: str = "aio", rate: float = 0.0, stream: bool = False) -> Level:
    """One level: `concurrency` clients spread over up to `procs` client processes; with `floor`, calling
    the health Check instead of Predict; with `rate`, one client paced at that many calls a second. With
    the server's pid, also its CPU time per answered call: a figure that noise on a shared machine moves
    far less than throughput."""
    if rate:
        concurrency, procs = 1, 1
    raw = [b""] if floor else [r.SerializeToString() for r in pool]
    method = HEALTH_CHECK if floor else PREDICT_STREAM if stream else PREDICT
    procs = max(1, min(procs, concurrency))
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager, spawn.Pool(procs) as workers:
        ready = manager.Barrier(procs + 1)  # every client process connected and warm, and this one: the clock starts
        jobs = [(target, raw, n, 101 * i, ready, duration, timeout, channels, method, client,
                 1.0 / rate if rate else 0.0) for i, n in enumerate(shares)]
        running = workers.map_async(_client_process, jobs)
        try:
            ready.wait(timeout=READY_TIMEOUT_S)
        except threading.BrokenBarrierError:
            running.get()  # a client that failed to connect says why
            raise
        cpu_before = server_cpu_s(server_pid)  # after the clients' warm-up calls, as the clock starts
        before = server_counters(metrics)
        for lat, err in running.get():
            latencies.extend(lat)
            errors.update(err)
        cpu = server_cpu_s(server_pid) - cpu_before  # before this script's own scrape below
    after = server_counters(metrics)
    p50, p90, p99 = percentiles(latencies)
    name = ("gRPC floor: health Check, " if floor else "server, ") + (
        f"paced {rate:g}/s" if rate else f"conc. {concurrency}" if floor else f"concurrency {concurrency}")
    name += ", sync client" if client == "sync" else ""
    name += ", stream" if stream else ""
    handler = "stream_handler_s" if stream else "handler_s"
    return Level(name, concurrency, len(latencies), duration, p50, p90, p99,
                 dict(errors), _mean(before["windows"], after["windows"]),
                 1e3 * _mean(before[handler], after[handler]), 1e3 * _mean(before["batch_s"], after["batch_s"]),
                 1e3 * cpu / len(latencies) if latencies else 0.0,
                 {} if floor else {step: 1e6 * _mean(before[f"{step}_s"], after[f"{step}_s"]) for step in STEPS},
                 100 * cpu / duration, rate)


def table(levels: list[Level]) -> str:
    """Server rows add the server's own means: time in the Predict handler, per batch, and its CPU time
    per call (when this script started the server)."""
    w = max([36, *(len(lv.name) for lv in levels)])
    head = (f"| {'run':<{w}} | {'req/s':>8} | {'p50 ms':>7} | {'p90 ms':>7} | {'p99 ms':>7} | {'mean batch':>10} "
            f"| {'handler ms':>10} | {'batch ms':>8} | {'CPU ms/call':>11} | errors |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]

    def cell(v: float, fmt: str) -> str:
        return format(v, fmt) if v else "-"

    for lv in levels:
        err = sum(lv.errors.values())
        lines.append(f"| {lv.name:<{w}} | {lv.throughput:>8.0f} | {lv.p50_ms:>7.2f} | {lv.p90_ms:>7.2f} | "
                     f"{lv.p99_ms:>7.2f} | {cell(lv.mean_batch, '.1f'):>10} | {cell(lv.handler_ms, '.2f'):>10} | "
                     f"{cell(lv.batch_ms, '.2f'):>8} | {cell(lv.server_cpu_ms, '.3f'):>11} | {err if err else 0:>6} |")
    return "\n".join(lines)


def paced_pairs(levels: list[Level]) -> list[tuple[Level, Level | None, Level | None]]:
    """Each paced server level with its bare peer (session.run as far apart) and the empty call paced
    alike (the gRPC floor), when measured."""
    bare = {lv.rate: lv for lv in levels if lv.rate and lv.name.startswith("bare")}
    floor = {lv.rate: lv for lv in levels if lv.rate and lv.name.startswith("gRPC floor")}
    return [(lv, bare.get(lv.rate), floor.get(lv.rate)) for lv in levels if lv.rate and lv.name.startswith("server")]


def paced_table(levels: list[Level]) -> str:
    """The paced levels: the rate asked and reached, latency against bare session.run at the same spacing
    (cold caches slow both), and the server's CPU as a share of a core."""
    pairs = paced_pairs(levels)
    if not pairs:
        return ""
    lines = ["| paced client | req/s | p50 ms | p99 ms | bare session.run p50 ms, as far apart | p50 over it, ms "
             "| empty call p50 ms, paced alike | server CPU, % of a core | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lv, bare, floor in pairs:
        peer = f"{bare.p50_ms:.2f} | {lv.p50_ms - bare.p50_ms:+.3f}" if bare else "- | -"
        lines.append(f"| {lv.rate:g}/s | {lv.throughput:.0f} | {lv.p50_ms:.2f} | {lv.p99_ms:.2f} | {peer} | "
                     f"{f'{floor.p50_ms:.2f}' if floor else '-'} | {lv.server_cpu_pct:.1f} | "
                     f"{sum(lv.errors.values())} |")
    return "\n".join(lines)


def steps_table(levels: list[Level]) -> str:
    """The server's own mean time per step at each level, from its step counters: parse and response per
    call, features and run (ONNX Runtime alone) per batch. Against `benchmarks.serving_steps`' hot-loop
    timings, these show what the rest of the server (gRPC, the event loop) costs each step in cache."""
    rows = [lv for lv in levels if lv.step_us and any(lv.step_us.values())]
    if not rows:
        return ""
    w = max(len(lv.name) for lv in rows)
    head = f"| {'server steps, mean µs':<{w}} | " + " | ".join(f"{s:>8}" for s in STEPS) + " |"
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for lv in rows:
        lines.append(f"| {lv.name:<{w}} | " + " | ".join(f"{lv.step_us[s]:>8.1f}" for s in STEPS) + " |")
    return "\n".join(lines)


def stop_server(proc: subprocess.Popen[str] | subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited within 30 s."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="ONNX model from `python -m export`")
    p.add_argument("--parquet", type=Path, required=True, help="bars with the model's symbols")
    p.add_argument("--concurrency", default="1,8,64", help="comma-separated client concurrency levels")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level (default 10)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="device of the server this script starts (default cpu); the bare baseline always runs "
                        "on the provider the server reports")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads, server and bare")
    p.add_argument("--pool", type=int, default=512, help="distinct requests to cycle through (default 512)")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call in seconds")
    p.add_argument("--client-procs", type=int, default=2,
                   help="client processes sharing each level's concurrency (default 2; one Python client "
                        "process saturates long before the server)")
    p.add_argument("--channels", type=int, default=1,
                   help="connections per client process (default 1); with the server's --workers, use several: "
                        "the kernel spreads connections over the workers")
    p.add_argument("--client", choices=("aio", "sync"), default="aio",
                   help="grpc.aio clients (default), or grpc's blocking stub with one thread per client")
    p.add_argument("--target", help="drive a running server at HOST:PORT instead of starting one")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    p.add_argument("--server-cpus", help="run the server this script starts on these CPUs only (taskset's list "
                                         "form, e.g. 0 or 0-3); the clients and the bare rows stay unpinned")
    p.add_argument("--packed", action="store_true",
                   help="send user feature columns as one packed block (user_features_raw), not a field each")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the gRPC floor rows (health Check at the lowest and highest concurrency)")
    p.add_argument("--idle", type=float, default=0.0,
                   help="after the levels, the server's CPU over this many idle seconds, as a share of a core "
                        "(default 0: skip; only for a server this script starts)")
    p.add_argument("--rate", default="",
                   help="comma-separated paced levels after the others: one client calling this many times a "
                        "second, with the server's CPU as a share of a core (only for a server this script "
                        "starts)")
    p.add_argument("--stream", action="store_true",
                   help="also run every concurrency level on PredictStream, one open stream per client")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    try:
        levels_c = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: give whole numbers separated by commas, e.g. 1,8,64")
    if not levels_c or min(levels_c) < 1:
        p.error(f"--concurrency {args.concurrency!r}: every level must be at least 1")
    try:
        server_cpus = None if args.server_cpus is None else cpu_list(args.server_cpus)
    except ValueError as exc:
        p.error(f"--server-cpus {exc}")
    if server_cpus is not None and args.target:
        p.error("--server-cpus pins a server this script starts; a --target server is already running")
    if not args.idle >= 0 or (args.idle and args.target):
        p.error("--idle S needs S >= 0, and a server this script starts (not --target)")
    try:
        rates = [float(r) for r in args.rate.split(",") if r]
    except ValueError:
        p.error(f"--rate {args.rate!r}: give calls per second separated by commas, e.g. 10,100")
    if any(not 0 < r <= 100_000 for r in rates):
        p.error(f"--rate {args.rate!r}: each rate must be in (0, 100000] calls a second")
    if args.stream and args.client == "sync":
        p.error("--stream drives PredictStream with grpc.aio clients; leave out --client sync")
    if rates and args.target:
        p.error("--rate measures the CPU of a server this script starts; a --target server is not one")
    loaded, bars = model_and_bars(p, args.model, args.parquet)
    meta = loaded.meta
    del loaded  # the bare rows load their own sessions
    pool = request_pool(bars, meta, args.pool, packed=args.packed)
    print(f"model {meta.model_version}: encoder {meta.encoder_length}, horizon {meta.horizon}, "
          f"hidden {meta.model_config.get('hidden_size')}, bars_required {meta.bars_required}; "
          f"{len(pool)} requests of {pool[0].ByteSize():,} bytes{' (packed)' if args.packed else ''}; "
          f"{args.duration:g} s per level; ORT threads {args.threads}; {args.client} clients", flush=True)

    proc = None
    idle_core_share = 0.0
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serving_load.{os.getpid()}.log"
    results: list[Level] = []
    metrics: list[str] = []
    try:
        if args.target:
            target = args.target
        else:
            proc, target, metrics = start_server(args.model, args.device, args.threads, args.server_arg, log,
                                                 cpus=server_cpus)
        wait_serving(target)
        provider = server_provider(target)  # the baseline runs where the server runs
        print(f"server at {target} on {provider}", flush=True)
        results += [bare_ort(args.model, args.threads, provider, pool, meta, args.duration, False),
                    bare_ort(args.model, args.threads, provider, pool, meta, args.duration, False, IDLE_GAP_S),
                    bare_ort(args.model, args.threads, provider, pool, meta, args.duration, True)]
        for r in rates:  # the paced levels' peers: the same runs as far apart as their calls
            results.append(bare_ort(args.model, args.threads, provider, pool, meta, args.duration, False, 1.0 / r))
            results[-1].rate = r
        if provider == "CUDAExecutionProvider":  # what the server's IO binding costs against plain session.run
            results.append(bare_ort(args.model, args.threads, provider, pool, meta, args.duration, False,
                                    bound=True))
        for c in levels_c:
            results.append(run_level(target, metrics, pool, c, args.duration, args.timeout, args.client_procs,
                                     args.channels, server_pid=proc.pid if proc else None, client=args.client))
            print(f"  concurrency {c}: {results[-1].throughput:.0f} req/s", flush=True)
        for c in levels_c if args.stream else []:
            results.append(run_level(target, metrics, pool, c, args.duration, args.timeout, args.client_procs,
                                     args.channels, server_pid=proc.pid if proc else None, stream=True))
            print(f"  concurrency {c}, stream: {results[-1].throughput:.0f} req/s", flush=True)
        for c in sorted({min(levels_c), max(levels_c)}) if levels_c and not args.no_floor else []:
            results.append(run_level(target, metrics, pool, c, args.duration, args.timeout, args.client_procs,
                                     args.channels, floor=True, server_pid=proc.pid if proc else None,
                                     client=args.client))
            print(f"  gRPC floor, concurrency {c}: {results[-1].throughput:.0f} req/s", flush=True)
        for r in rates:  # rates need a server this script started
            results.append(run_level(target, metrics, pool, 1, args.duration, args.timeout, 1, args.channels,
                                     server_pid=proc.pid if proc else None, client=args.client, rate=r))
            print(f"  paced {r:g}/s: {results[-1].throughput:.0f} req/s, server "
                  f"{results[-1].server_cpu_pct:.1f}% of a core", flush=True)
        for r in rates[:1] if not args.no_floor else []:  # what an empty call costs after the same pause
            results.append(run_level(target, metrics, pool, 1, args.duration, args.timeout, 1, args.channels,
                                     floor=True, server_pid=proc.pid if proc else None, client=args.client, rate=r))
            print(f"  gRPC floor, paced {r:g}/s: p50 {results[-1].p50_ms:.2f} ms", flush=True)
        if args.idle and proc is not None:
            time.sleep(IDLE_SETTLE_S)  # the last level's calls and scrape are over
            before = server_cpu_s(proc.pid)
            time.sleep(args.idle)
            idle_core_share = (server_cpu_s(proc.pid) - before) / args.idle
    finally:
        stop_server(proc)

    print(table(results))
    for extra in (steps_table(results), paced_table(results)):
        if extra:
            print(extra)
    by_c = {lv.concurrency: lv for lv in results
            if lv.name.startswith("server") and not lv.rate and not lv.name.endswith(", stream")}
    by_stream = {lv.concurrency: lv for lv in results if lv.name.endswith(", stream")}
    bare = results[0]  # the peer of the targets: session.run in a hot loop
    summary: dict[str, Any] = {"errors": sum(sum(lv.errors.values()) for lv in results)}
    if 1 in by_c:
        summary["p50_overhead_ms_at_1"] = round(by_c[1].p50_ms - bare.p50_ms, 3)
    if 1 in by_c and 64 in by_c and by_c[1].throughput:
        summary["throughput_64_over_1"] = round(by_c[64].throughput / by_c[1].throughput, 2)
    if 1 in by_stream:
        summary["stream_p50_overhead_ms_at_1"] = round(by_stream[1].p50_ms - bare.p50_ms, 3)
    if 1 in by_stream and 64 in by_stream and by_stream[1].throughput:
        summary["stream_throughput_64_over_1"] = round(by_stream[64].throughput / by_stream[1].throughput, 2)
    floor = {lv.concurrency: lv for lv in results if lv.name.startswith("gRPC floor") and not lv.rate}
    if 1 in floor:
        summary["floor_p50_ms_at_1"] = round(floor[1].p50_ms, 3)
    if 1 in floor and 64 in floor and floor[1].throughput:
        summary["floor_64_over_1"] = round(floor[64].throughput / floor[1].throughput, 2)
    for lv, peer, empty in paced_pairs(results):
        summary[f"paced_{lv.rate:g}_p50_ms"] = round(lv.p50_ms, 3)
        if peer is not None:
            summary[f"paced_{lv.rate:g}_p50_over_bare_ms"] = round(lv.p50_ms - peer.p50_ms, 3)
        if empty is not None:
            summary[f"paced_{lv.rate:g}_floor_p50_ms"] = round(empty.p50_ms, 3)
        summary[f"paced_{lv.rate:g}_server_cpu_pct"] = round(lv.server_cpu_pct, 1)  # of one core
    if args.idle:
        summary["idle_server_cpu_pct"] = round(100 * idle_core_share, 1)  # of one core
    print("summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}, onnxruntime {ort.__version__}, grpcio {grpc.__version__}"
          + (f"; server on CPU(s) {args.server_cpus}" if server_cpus is not None else ""))
    if args.json:
        args.json.write_text(json.dumps({"levels": [asdict(lv) | {"throughput": lv.throughput} for lv in results],
                                         "summary": summary, "model_version": meta.model_version,
                                         "client": args.client,
                                         "server_cpus": sorted(server_cpus) if server_cpus is not None else None},
                                        indent=2))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
