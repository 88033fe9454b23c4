"""`make demo`: the whole path on built-in sample data, each stage by its real command.

per-contract futures bars -> check (the rolls) -> train on two quarters (bounded) -> export (all gates) ->
serve -> Predict for the next quarter's contract, unseen in training -> stop -> its forecasts, offline.
Everything lands in ./demo_out (or --out). Exits non-zero at the first stage that fails.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
START = "2025-03-12"  # ESH5 is the front; ESM5 takes over in the roll week before H5's expiry on 03-21
SESSIONS = 72  # to 2025-06-19: ESU5 trades from 06-06 and is the front from 06-18, before ESM5 expires on 06-20
UNSEEN = "2025-06-06"  # the first session of ESU5 and NQU5: training takes the bars before it

TRAIN_FLAGS = ["--hidden-size", "16", "--attention-heads", "4", "--encoder-length", "30", "--horizon", "5",
               "--batch-size", "64", "--epochs", "4", "--max-steps-per-epoch", "40", "--learning-rate", "3e-3",
               "--dropout", "0.05", "--max-val-windows", "2000", "--device", "auto", "--threads", "1"]
# The same path in seconds, for the test suite.
TINY_FLAGS = ["--hidden-size", "8", "--attention-heads", "2", "--encoder-length", "20", "--horizon", "3",
              "--batch-size", "32", "--epochs", "1", "--max-steps-per-epoch", "5", "--max-val-windows", "200",
              "--device", "cpu", "--threads", "1", "--no-progress"]


def step(title: str) -> None:
    print(f"\n==> {title}", flush=True)


def sh(args: list[str]) -> None:
    print("$ python " + " ".join(args), flush=True)
    r = subprocess.run([sys.executable, *args], cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"demo: `python {' '.join(args)}` failed with exit status {r.returncode}")


def start_server(model: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "serving", "--model", str(model), "--port", "0", "--device", "auto"]
    print("$ python " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise SystemExit(f"demo: the server exited with status {proc.returncode}")
            continue
        print(f"   [server] {line.rstrip()}", flush=True)
        m = re.search(r"listening on (\S+:\d+)", line)
        if m:  # from here the server's lines are echoed as they come, in order with the demo's own
            threading.Thread(target=echo, args=(proc.stdout,), daemon=True).start()
            wait_serving(m.group(1), deadline)
            print(f"   health: SERVING on {m.group(1)}", flush=True)
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("demo: the server did not report SERVING within 120 s")


def echo(lines: IO[str]) -> None:
    for line in lines:
        print(f"   [server] {line.rstrip()}", flush=True)


def wait_serving(target: str, deadline: float) -> None:
    """Poll the standard gRPC health service until the server has warmed up."""
    from serving.health_probe import wait_serving as health_wait

    if not health_wait(target, max(0.0, deadline - time.monotonic()), interval=0.2):
        raise SystemExit("demo: the server did not report SERVING within 120 s")


def training_bars(bars: Path, out: Path) -> None:
    """The bars before UNSEEN: contracts H5 and M5 of each root, never a U5 bar."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(bars)
    stamps = table.column("ts_event")
    kept = table.filter(pc.less(stamps, pa.scalar(np.datetime64(UNSEEN, "ns")).cast(stamps.type)))
    pq.write_table(kept, out)
    names = sorted(set(kept.column("symbol").to_pylist()))
    print(f"   {out.name}: {kept.num_rows} bars before {UNSEEN} of {', '.join(names)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "demo_out")
    p.add_argument("--tiny", action="store_true", help="a tiny model trained for a few steps (for tests)")
    args = p.parse_args(argv)
    out: Path = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    bars, train, ckpt, model = out / "bars.parquet", out / "train.parquet", out / "ckpt.pt", out / "model.onnx"
    t0 = time.monotonic()

    step("1/7 sample bars per contract, Databento ohlcv-1m columns (ES, NQ; quarterly contracts; 1% roll gap)")
    sh(["-m", "features.synth", "--out", str(bars), "--contracts", "--symbols", "ES,NQ", "--start", START,
        "--bars", str(SESSIONS * 390), "--seed", "7"])
    training_bars(bars, train)
    step("2/7 check the training bars: one series per root, and the rolls the volume rule chose")
    sh(["-m", "features.check", str(train), "--time-col", "ts_event"])
    step("3/7 train a small TFT on two quarters' contracts (bounded steps)")
    sh(["-m", "trainer", "--parquet", str(train), "--time-col", "ts_event", "--out", str(ckpt),
        *(TINY_FLAGS if args.tiny else TRAIN_FLAGS)])
    step("4/7 export to ONNX (checker, names, parity at batch 1/7/64 and on real windows, placement)")
    sh(["-m", "export", str(ckpt), str(model)])
    step("5/7 serve it over gRPC on 127.0.0.1")
    server, target = start_server(model)
    try:
        step("6/7 Predict with the client for ESU5, a contract the model never saw: its latest bars")
        sh(["-m", "serving.client", "--target", target, "--parquet", str(bars), "--symbol", "ESU5"])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        time.sleep(0.1)  # the echo thread prints the server's last lines
        print(f"server stopped (exit status {server.returncode})")
    step(f"7/7 forecasts for every bar from {UNSEEN} on, offline (serving.score: for backtests)")
    sh(["-m", "serving.score", "--model", str(model), "--parquet", str(bars), "--out", str(out / "forecasts.parquet"),
        "--start", UNSEEN, "--threads", "1"])
    print(f"\ndone in {time.monotonic() - t0:.0f} s. Files in {out}:")
    for f in sorted(out.iterdir()):
        print(f"  {f.name:24s} {f.stat().st_size / 1024:9.1f} KiB")
    print(f"report picture: {ckpt.with_suffix('.report.png')}")
    rel = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    print("\nnext, in two shells after `. .venv/bin/activate` (then try --explain or --json on the client):\n"
          f"  python -m serving --model {rel / 'model.onnx'} --port 50051\n"
          f"  python -m serving.client --target 127.0.0.1:50051 --parquet {rel / 'bars.parquet'} --symbol NQU5")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
