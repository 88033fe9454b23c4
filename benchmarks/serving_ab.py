"""Two builds of the server side by side: which answers a lone call faster, on the same machine at once.

    python -m benchmarks.serving_ab --model model.onnx --parquet bars.parquet --a ../other-checkout \\
        [--b .] [--duration 20] [--rounds 3] [--packed] [--server-arg=...]

A change worth tens of microseconds at concurrency 1 is invisible in `serving_load`'s runs on
a shared machine: from one run to the next the same build's p50 moves by hundreds. Here both
servers (`--a` and `--b`: checkouts whose `serving` package runs, e.g. a `git worktree` of the
commit before a change, and this one) run at once, and one client alternates single calls
between them (A B B A ...), so both see the same machine at every moment. Reported per round:
each build's p50 and mean latency and the difference B - A; a sign that holds over the rounds is
a real difference.

Both servers idle while the other answers, so their latencies are those of calls after a short
pause, not `serving_load`'s back-to-back figures.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
from grpc import aio

from benchmarks.serving_load import PREDICT, REPO, model_and_bars, request_pool, start_server, wait_serving

WARM_CALLS = 400


async def alternate(targets: tuple[str, str], pool: list[bytes], duration: float, timeout: float
                    ) -> tuple[list[float], list[float]]:
    """Latencies (seconds) of the calls to each target, alternating A B B A for `duration` seconds."""
    channels = [aio.insecure_channel(t) for t in targets]
    try:
        calls = [ch.unary_unary(PREDICT, request_serializer=None, response_deserializer=None) for ch in channels]
        for i in range(WARM_CALLS):
            await calls[i % 2](pool[i % len(pool)], timeout=timeout)
        out: tuple[list[float], list[float]] = ([], [])
        stop_at = time.perf_counter() + duration
        i = 0
        while time.perf_counter() < stop_at:
            k = (i + i // 2) % 2  # A B B A A B B A ...: neither build always goes first
            t0 = time.perf_counter()
            await calls[k](pool[i % len(pool)], timeout=timeout)
            out[k].append(time.perf_counter() - t0)
            i += 1
        return out
    finally:
        for ch in channels:
            await ch.close(None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="ONNX model from `python -m export`")
    p.add_argument("--parquet", type=Path, required=True, help="bars with the model's symbols")
    p.add_argument("--a", type=Path, required=True, help="checkout of build A (e.g. a git worktree)")
    p.add_argument("--b", type=Path, default=REPO, help="checkout of build B (default: this one)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per round (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each with fresh servers (default 3)")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of both servers")
    p.add_argument("--pool", type=int, default=512, help="distinct requests to cycle through (default 512)")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call in seconds")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for both servers (repeatable)")
    p.add_argument("--packed", action="store_true",
                   help="send user feature columns as one packed block (user_features_raw), not a field each")
    args = p.parse_args(argv)
    for code in (args.a, args.b):
        if not (code / "serving" / "__main__.py").is_file():
            p.error(f"{code} holds no serving package: give a checkout of this project (e.g. git worktree add)")
    loaded, bars = model_and_bars(p, args.model, args.parquet)
    meta = loaded.meta
    pool = [r.SerializeToString() for r in request_pool(bars, meta, args.pool, packed=args.packed)]
    print(f"A = {args.a.resolve()}\nB = {args.b.resolve()}\nmodel {meta.model_version}; {args.rounds} rounds of "
          f"{args.duration:g} s; server args {' '.join(args.server_arg) or 'none'}")
    print("| round | calls each | A p50 ms | B p50 ms | B - A p50 ms | A mean ms | B mean ms | B - A mean ms |")
    print("|---|---|---|---|---|---|---|---|")
    diffs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, args.rounds + 1):
            servers = [start_server(args.model, "cpu", args.threads, args.server_arg, Path(tmp) / f"{name}{r}.log",
                                    code) for name, code in (("a", args.a), ("b", args.b))]
            try:
                for _, target, _ in servers:
                    wait_serving(target)
                a, b = asyncio.run(alternate((servers[0][1], servers[1][1]), pool, args.duration, args.timeout))
            finally:
                for proc, _, _ in servers:
                    proc.terminate()
                    proc.wait(timeout=30)
            a_ms, b_ms = np.asarray(a) * 1e3, np.asarray(b) * 1e3
            d50 = float(np.median(b_ms) - np.median(a_ms))
            diffs.append(d50)
            print(f"| {r} | {min(len(a_ms), len(b_ms))} | {np.median(a_ms):.3f} | {np.median(b_ms):.3f} | {d50:+.3f} "
                  f"| {a_ms.mean():.3f} | {b_ms.mean():.3f} | {b_ms.mean() - a_ms.mean():+.3f} |", flush=True)
    print(f"summary: B - A p50 over the rounds {', '.join(f'{d:+.3f}' for d in diffs)} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
