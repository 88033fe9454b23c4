"""The worst request the limits allow, beside a stream of well-formed calls: how much longer a well-formed call
waits because of it.

    python -m benchmarks.worst_request [--work DIR] [--calls 200]

Builds (or reuses, in `--work`) the tests' tiny per-contract model (`tests.live_server.build_contracts_model`),
starts `python -m serving` on it (`--threads 1`, the default 4 MiB `--max-message-bytes`) and, on one channel:

1. alone: `--calls` well-formed Predict calls one after another (ES bars spanning a roll, with contracts);
2. beside: the same calls while another thread sends the worst request (`tests.worst_requests`: 4 MiB of valid
   bars over 1,200 contracts of ES) again and again on a channel of its own.

It prints each phase's median and largest latency, the worst request's own, and the largest wait of a
well-formed call beyond the median alone. Run it alone on the machine: a second busy process moves these.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from tests.futures_bars import LIVE_PER_DAY, as_bars, request_series, window_rows
from tests.live_server import LiveServer, build_contracts_model
from tests.worst_requests import crowded_contracts_request

MAX_MESSAGE = 4 << 20  # the server's default --max-message-bytes


def timed_calls(stub: pb_grpc.ForecasterStub, request: pb.PredictRequest, calls: int) -> list[float]:
    """Seconds each of `calls` Predict calls took, one after another."""
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        stub.Predict(request, timeout=30)
        out.append(time.perf_counter() - start)
    return out


def hammer(target: str, request: pb.PredictRequest, stop: threading.Event, took: list[float],
           codes: list[str]) -> None:
    """Send `request` again and again until `stop`; each call's seconds into `took`, its status into `codes`."""
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.ForecasterStub(channel)
        while not stop.is_set():
            start = time.perf_counter()
            try:
                stub.Predict(request, timeout=30)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
            took.append(time.perf_counter() - start)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, help="where the model is built, or reused (default: a temporary folder)")
    p.add_argument("--calls", type=int, default=200, help="well-formed calls per phase (default 200)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="worst_request_"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_contracts_model(work, reuse=True)
    good = pb.PredictRequest(series=[request_series(
        "ES", as_bars(model.es, window_rows(model.es, LIVE_PER_DAY, last_bar=9)), contracts=True)])
    worst = crowded_contracts_request("ES", MAX_MESSAGE)
    server = LiveServer(model.model, work / "server.log")
    try:
        server.wait_serving()
        timed_calls(server.stub, good, 20)  # warm
        alone = timed_calls(server.stub, good, args.calls)
        stop, took, codes = threading.Event(), list[float](), list[str]()
        thread = threading.Thread(target=hammer, args=(server.target, worst, stop, took, codes))
        thread.start()
        while not took:  # the worst request has been answered once: it is in the server's loop from here on
            time.sleep(0.01)
        beside = timed_calls(server.stub, good, args.calls)
        stop.set()
        thread.join()
        assert server.alive()
    finally:
        server.kill()
    median_alone = statistics.median(alone)
    print(f"worst request: {worst.ByteSize():,} bytes, {len(worst.series[0].timestamp_ns):,} bars over 1,200 "
          f"contracts; answered {sorted(set(codes))} {len(took)} times, median {ms(statistics.median(took))}, "
          f"largest {ms(max(took))}")
    print("| phase | well-formed calls | median | largest | largest wait beyond the median alone |")
    print("|---|---|---|---|---|")
    for name, times in (("alone", alone), ("beside the worst request", beside)):
        print(f"| {name} | {len(times)} | {ms(statistics.median(times))} | {ms(max(times))} | "
              f"{ms(max(times) - median_alone)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
