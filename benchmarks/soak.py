"""Soak test of `python -m serving`: many clients for a long time; errors, wrong answers, latency and memory over time.

    python -m benchmarks.soak --model model.onnx --parquet bars.parquet [--duration 600] [--clients 64] \\
        [--poison-clients 2] [--interval 30] [--warmup 10] [--threads 1] [--device cpu] [--stream] [--json out.json]

1. Starts the real server (`python -m serving --port 0`, loopback) and waits for health SERVING
   (or drives `--target HOST:PORT --pid PID`, a server already running on this machine).
2. Builds a pool of one-series Predict requests from the parquet file and asks the server for
   each one's answer alone, one at a time: the reference every later answer is checked against.
3. Runs `--clients` closed-loop clients (one grpc.aio channel each, spread over `--client-procs`
   processes) for `--warmup` + `--duration` seconds. Every answer is compared with its
   reference (rtol 1e-5: batching may change float32 rounding); every error is counted by
   status code. `--poison-clients` more clients send requests that must be refused
   (a feature that overflows inside a batch, undecodable bytes), so the error paths soak too.
   With `--stream` every client keeps one PredictStream open instead (a request, its answer, the
   next): a refused request's error comes in its answer, and undecodable bytes end the poison
   client's stream, which it opens again. A good client's stream that the server ends (at
   `--max-connection-age`) is opened again and counted apart (`stream_ends`, by the status the
   client saw: a grpc.aio client that writes after the end sees INTERNAL, grpc/grpc#36066).
4. Every `--interval` seconds: throughput, p50/p99 of that interval, and the server's VmRSS,
   open file descriptors and threads (from /proc/PID). At the end: the totals; RSS after
   warm-up, after the clients left, and at most; its growth, and its slope (least squares,
   MiB/hour) over the run and over its second half (RSS first settles as allocator arenas and
   gRPC buffers fill; a leak keeps climbing in the second half; a short run's slope is noise).

Exit status 0 when there were no errors, no wrong answers, every poison request was refused
INVALID_ARGUMENT and RSS grew by less than `--max-rss-growth-mib` (default 50) after warm-up;
else 1. Loopback only: it measures the server, not a network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import platform
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
from grpc import aio

from benchmarks.serving_load import model_and_bars, request_pool, start_server, stop_server, wait_serving
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb

PREDICT = "/foxhunt.tft.v1.Forecaster/Predict"
RTOL, ATOL = 1e-5, 1e-7


@dataclass
class Sample:
    t_s: float  # seconds since the measured run began
    requests: int  # answered OK in the interval
    p50_ms: float
    p99_ms: float
    rss_mib: float
    fds: int
    threads: int


@dataclass
class Report:
    clients: int
    poison_clients: int
    seconds: float
    requests: int
    req_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    errors: dict[str, int]
    stream_ends: dict[str, int]  # --stream: the good clients' streams the server ended (each opened again)
    wrong_answers: int
    poison: dict[str, int]
    rss_mib_after_warmup: float
    rss_mib_end: float
    rss_mib_max: float
    rss_growth_mib: float
    rss_slope_mib_per_hour: float  # least squares over every sample after warm-up
    rss_slope_2nd_half_mib_per_hour: float  # over the second half only: past the allocator's settling
    fds_after_warmup: int
    fds_end: int
    samples: list[Sample] = field(default_factory=list)


# ---- the server's process -------------------------------------------------------------------------------
def proc_status(pid: int) -> tuple[float, int, int]:
    """(VmRSS MiB, open fds, threads) of a process on this machine."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = re.search(r"^VmRSS:\s+(\d+) kB$", text, re.M)
    threads = re.search(r"^Threads:\s+(\d+)$", text, re.M)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return (int(rss.group(1)) / 1024 if rss else float("nan")), fds, int(threads.group(1)) if threads else 0


# ---- clients (in worker processes) ------------------------------------------------------------------------
Answers = list[list[list[float]]]  # per request: per forecast, its log-return quantiles
Job = tuple[str, list[bytes], Answers, list[bytes], int, int, int, float, float, float, float, bool]
PREDICT_STREAM = "/foxhunt.tft.v1.Forecaster/PredictStream"


class StreamEnded(Exception):
    """The server ended a PredictStream instead of answering: its status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Stream:
    """One open PredictStream, asked one request at a time; opened again when the server ends it."""

    def __init__(self, channel: aio.Channel) -> None:
        self._open = channel.stream_stream(PREDICT_STREAM, request_serializer=None, response_deserializer=None)
        self._call = self._open()  # type: ignore[call-arg]  # written to, not fed an iterator
        self.reopened = 0

    async def ask(self, request: bytes) -> pb.PredictStreamResponse:
        """The answer, or StreamEnded with the server's status (the stream is open again for the next ask)."""
        raw: object = None
        try:
            await self._call.write(request)
            raw = await self._call.read()
        except grpc.RpcError:  # a write after the server ended the call fails on its own (grpc/grpc#36066) ...
            pass
        if isinstance(raw, bytes):
            return pb.PredictStreamResponse.FromString(raw)
        ended = StreamEnded(await self._call.code(), await self._call.details() or "")  # ... the call's status
        self._call = self._open()  # type: ignore[call-arg]
        self.reopened += 1
        raise ended


async def _drive(target: str, pool: list[bytes], expected: Answers, poison: list[bytes], clients: int,
                 poison_clients: int, offset: int, start_at: float, warmup: float, duration: float,
                 interval: float, stream: bool = False) -> dict[str, Any]:
    """Closed-loop clients from start_at (time.time()): warm up, then measure `duration` seconds."""
    latencies: dict[int, list[float]] = defaultdict(list)  # interval index -> seconds
    errors: Counter[str] = Counter()
    poison_codes: Counter[str] = Counter()
    stream_ends: Counter[str] = Counter()
    wrong = 0
    reference = [np.asarray(e) for e in expected]
    await asyncio.sleep(max(0.0, start_at - time.time()))
    measure_from = time.perf_counter() + warmup
    stop_at = measure_from + duration

    async def client(k: int) -> None:
        nonlocal wrong
        async with aio.insecure_channel(target) as channel:
            predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            open_stream = Stream(channel) if stream else None
            i = offset + k
            while (now := time.perf_counter()) < stop_at:
                j = i % len(pool)
                i += 7919  # a prime stride: clients walk the pool in different orders
                try:
                    if open_stream is None:
                        answer = pb.PredictResponse.FromString(await predict(pool[j], timeout=30))
                    else:
                        streamed = await open_stream.ask(pool[j])
                        if streamed.HasField("error"):
                            errors[streamed.error.code_name] += 1
                            continue
                        answer = streamed.response
                except grpc.RpcError as exc:
                    errors[exc.code().name] += 1
                    continue
                except StreamEnded as ended:  # opened again; counted apart from the requests' errors
                    stream_ends[f"{ended.code.name}: {ended.details[:60]}"] += 1
                    continue
                done = time.perf_counter()
                if now >= measure_from:
                    latencies[int((now - measure_from) // interval)].append(done - now)
                got = np.asarray([list(f.log_return) for f in answer.forecasts])
                if not np.allclose(got, reference[j], rtol=RTOL, atol=ATOL):
                    wrong += 1

    async def bad_client(k: int) -> None:
        async with aio.insecure_channel(target) as channel:
            predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            open_stream = Stream(channel) if stream else None
            i = k
            while time.perf_counter() < stop_at:
                try:
                    if open_stream is None:
                        await predict(poison[i % len(poison)], timeout=30)
                        poison_codes["OK"] += 1
                    else:
                        streamed = await open_stream.ask(poison[i % len(poison)])
                        poison_codes[streamed.error.code_name if streamed.HasField("error") else "OK"] += 1
                except grpc.RpcError as exc:
                    poison_codes[exc.code().name] += 1
                except StreamEnded as ended:
                    poison_codes[ended.code.name] += 1
                i += 1
                await asyncio.sleep(0.01)

    await asyncio.gather(*(client(k) for k in range(clients)), *(bad_client(k) for k in range(poison_clients)))
    return {"latencies": dict(latencies), "errors": dict(errors), "poison": dict(poison_codes), "wrong": wrong,
            "stream_ends": dict(stream_ends)}


def _client_process(job: Job) -> dict[str, Any]:
    return asyncio.run(_drive(*job))


def overflowing_feature(request: pb.PredictRequest) -> pb.PredictRequest:
    """Valid bars whose high/low ratio overflows a feature: refused inside a batch, after validation."""
    r = pb.PredictRequest()
    r.CopyFrom(request)
    s = r.series[0]
    i = len(s.close) - 3
    s.low[i], s.high[i] = 1e-300, 1e300
    s.open[i] = s.close[i] = 1.0
    return r


def reference_answers(target: str, pool: list[pb.PredictRequest]) -> Answers:
    out = []
    with grpc.insecure_channel(target) as channel:
        predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        for r in pool:
            answer = pb.PredictResponse.FromString(predict(r.SerializeToString(), timeout=30))
            out.append([list(f.log_return) for f in answer.forecasts])
    return out


# ---- the run -------------------------------------------------------------------------------------------------
def soak(target: str, pid: int, pool: list[pb.PredictRequest], args: argparse.Namespace) -> Report:
    expected = reference_answers(target, pool)
    raw = [r.SerializeToString() for r in pool]
    poison = [overflowing_feature(pool[0]).SerializeToString(), b"\xff\x00 not a message"]
    procs = max(1, min(args.client_procs, args.clients))
    shares = [args.clients // procs + (1 if i < args.clients % procs else 0) for i in range(procs)]
    bad = [args.poison_clients // procs + (1 if i < args.poison_clients % procs else 0) for i in range(procs)]
    start_at = time.time() + 3.0  # every process started before the clock starts
    jobs: list[Job] = [(target, raw, expected, poison, n, b, 101 * i, start_at, args.warmup, args.duration,
                        args.interval, args.stream) for i, (n, b) in enumerate(zip(shares, bad, strict=True))]

    samples: list[tuple[float, float, int, int]] = []  # (t since measuring began, rss MiB, fds, threads)
    done = threading.Event()
    measure_from = start_at + args.warmup

    def sampler() -> None:
        next_at = measure_from
        while not done.is_set():
            if time.time() >= next_at:
                samples.append((time.time() - measure_from, *proc_status(pid)))
                next_at += args.interval
            done.wait(0.05)

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    with multiprocessing.get_context("spawn").Pool(procs) as workers:
        results = workers.map(_client_process, jobs)
    done.set()
    watcher.join()
    if samples and time.time() - measure_from - samples[-1][0] > 0.5:  # the last, shorter interval: closed too
        samples.append((time.time() - measure_from, *proc_status(pid)))
    end = proc_status(pid)  # the clients are gone: what the server keeps
    if len(samples) < 2:
        raise SystemExit("the run ended before two samples were taken; raise --duration or lower --interval")

    per_interval: dict[int, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    poison_codes: Counter[str] = Counter()
    stream_ends: Counter[str] = Counter()
    wrong = 0
    for r in results:
        for k, lat in r["latencies"].items():
            per_interval[int(k)].extend(lat)
        errors.update(r["errors"])
        poison_codes.update(r["poison"])
        stream_ends.update(r["stream_ends"])
        wrong += r["wrong"]
    every = np.asarray([x for lat in per_interval.values() for x in lat]) * 1e3
    rows = []
    for k, (t, rss, fds, threads) in enumerate(samples[1:]):  # sample k + 1 closes interval k
        lat = np.asarray(per_interval.get(k, [])) * 1e3
        p50, p99 = (np.percentile(lat, [50, 99]) if lat.size else (float("nan"), float("nan")))
        rows.append(Sample(round(t, 1), int(lat.size), round(float(p50), 2), round(float(p99), 2), round(rss, 1),
                           fds, threads))
    t_all = np.asarray([s[0] for s in samples])
    rss_all = np.asarray([s[1] for s in samples])
    half = len(samples) // 2

    def slope(t: np.ndarray, rss: np.ndarray) -> float:  # MiB/hour
        return round(float(np.polyfit(t, rss, 1)[0]) * 3600, 2) if len(t) > 2 else float("nan")

    p50, p99, pmax = np.percentile(every, [50, 99, 100]) if every.size else (float("nan"),) * 3
    return Report(
        clients=args.clients, poison_clients=args.poison_clients, seconds=args.duration, requests=int(every.size),
        req_per_s=round(every.size / args.duration, 1), p50_ms=round(float(p50), 2), p99_ms=round(float(p99), 2),
        max_ms=round(float(pmax), 2), errors=dict(errors), stream_ends=dict(stream_ends), wrong_answers=wrong,
        poison=dict(poison_codes),
        rss_mib_after_warmup=round(float(rss_all[0]), 1), rss_mib_end=round(end[0], 1),
        rss_mib_max=round(float(max(rss_all.max(), end[0])), 1), rss_growth_mib=round(end[0] - float(rss_all[0]), 1),
        rss_slope_mib_per_hour=slope(t_all, rss_all),
        rss_slope_2nd_half_mib_per_hour=slope(t_all[half:], rss_all[half:]),
        fds_after_warmup=samples[0][2], fds_end=end[1],
        samples=rows,
    )


def table(report: Report) -> str:
    lines = ["|   t s | requests |  p50 ms |  p99 ms | RSS MiB | fds | threads |",
             "|------:|---------:|--------:|--------:|--------:|----:|--------:|"]
    lines += [f"| {s.t_s:>5.0f} | {s.requests:>8} | {s.p50_ms:>7.2f} | {s.p99_ms:>7.2f} | {s.rss_mib:>7.1f} | "
              f"{s.fds:>3} | {s.threads:>7} |" for s in report.samples]
    return "\n".join(lines)


def nan_to_null(value: Any) -> Any:
    """`value` with every NaN (a figure a short run has no data for) as None: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: nan_to_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nan_to_null(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="ONNX model from `python -m export`")
    p.add_argument("--parquet", type=Path, required=True, help="bars with the model's symbols")
    p.add_argument("--duration", type=float, default=600.0, help="measured seconds (default 600)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of full load before measuring (default 10)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds per report row (default 30)")
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients with correct requests (default 64)")
    p.add_argument("--poison-clients", type=int, default=2, help="clients sending requests to be refused (default 2)")
    p.add_argument("--client-procs", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--pool", type=int, default=256, help="distinct requests (default 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="server device (default cpu)")
    p.add_argument("--threads", type=int, default=1, help="server ONNX Runtime threads (default 1)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    p.add_argument("--target", help="drive a running server at HOST:PORT instead of starting one (needs --pid)")
    p.add_argument("--pid", type=int, help="process id of the --target server, for its memory")
    p.add_argument("--max-rss-growth-mib", type=float, default=50.0, help="pass bound on RSS growth (default 50)")
    p.add_argument("--stream", action="store_true", help="every client on one open PredictStream, not a call each")
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.target and not args.pid:
        p.error("--target needs --pid (the server's memory is read from /proc/PID)")
    if min(args.duration, args.interval, args.clients) <= 0 or args.warmup < 0:
        p.error("--duration, --interval and --clients must be > 0, --warmup >= 0")

    loaded, bars = model_and_bars(p, args.model, args.parquet)
    meta = loaded.meta
    del loaded
    pool = request_pool(bars, meta, args.pool)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak.{os.getpid()}.log"
    proc = None
    try:
        if args.target:
            target, pid = args.target, args.pid
        else:
            proc, target, _ = start_server(args.model, args.device, args.threads, args.server_arg, log)
            pid = proc.pid
        wait_serving(target)
        print(f"soak: server {target} (pid {pid}), {args.clients} clients + {args.poison_clients} poison"
              f"{' on PredictStream' if args.stream else ''}, {args.warmup:g} s warm-up + {args.duration:g} s, "
              f"model {meta.model_version}", flush=True)
        report = soak(target, pid, pool, args)
    finally:
        stop_server(proc)

    print(table(report))
    summary = {k: v for k, v in asdict(report).items() if k != "samples"}
    print("summary: " + json.dumps(nan_to_null(summary)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}, onnxruntime {ort.__version__}, grpcio {grpc.__version__}")
    if args.json:
        args.json.write_text(json.dumps(nan_to_null(asdict(report)), indent=2))
    ok = (not report.errors and report.wrong_answers == 0 and set(report.poison) <= {"INVALID_ARGUMENT"}
          and report.rss_growth_mib < args.max_rss_growth_mib)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
