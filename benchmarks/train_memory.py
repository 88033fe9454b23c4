"""Host memory of a training run at scale: two builds of the trainer on the same bars, side by side.

    python -m benchmarks.train_memory --a ../other-checkout [--b .] [--bars 1000000] \\
        [--symbols ES,NQ,CL,GC] [--extra-features 0] [--repeats 2]

A training run holds every bar's features in host memory (as pytorch-forecasting and NVIDIA's
TFT do), so what a run needs grows with the bars: years of one-minute bars of a few symbols
are tens of millions of rows. This writes one sample file (`features.synth`, this checkout's
generator), then runs `python -m trainer` on it from each checkout (`--a`, `--b`: checkouts
whose `trainer` package runs, e.g. a `git worktree` of the commit before a change, and this
one), A and B alternating, each in a child of its own so that its peak RSS (`ru_maxrss`, from
`os.wait4`) is its own. A run is one epoch of `--steps` optimizer steps, then validation on
every validation window and the test split, as a real run ends, on the CPU.

Reported per run: the child's peak RSS, its wall time, the trainer's own peaks (after the
training steps and after validation), and the validation loss, which must be equal for the two
builds when a change only moves memory. The summary gives each figure and the training windows/s
of every run, and B / A for each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEAKS = re.compile(r"peak memory train (\d+) MiB val (\d+) MiB")


def run_trainer(checkout: Path, parquet: Path, out: Path, steps: int, extra: list[str]) -> dict[str, float]:
    """One training run from `checkout`: the child's peak RSS and wall time, the trainer's logged peaks and
    validation loss."""
    cmd = [sys.executable, "-m", "trainer", "--parquet", str(parquet), "--out", str(out), "--device", "cpu",
           "--epochs", "1", "--max-steps-per-epoch", str(steps), "--warmup-steps", "0", "--no-report",
           "--no-progress", "--threads", "2", "--test-fraction", "0.1", *extra]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        log.seek(0)
        text = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"error: the trainer of {checkout} exited {proc.returncode}:\n{text[-3000:]}")
    peaks = PEAKS.search(text)
    if peaks is None:
        raise SystemExit(f"error: no peak memory in the log of {checkout}:\n{text[-3000:]}")
    record = json.loads(out.with_suffix(".metrics.jsonl").read_text().splitlines()[-1])
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": wall, "train_mib": float(peaks.group(1)),
            "val_mib": float(peaks.group(2)), "val_loss": float(record["val_loss"]),
            "windows_per_s": float(record["windows_per_second"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="checkout A (e.g. a git worktree of the commit before)")
    p.add_argument("--b", type=Path, default=REPO, help="checkout B (default: this one)")
    p.add_argument("--bars", type=int, default=1_000_000, help="bars per symbol (default 1,000,000)")
    p.add_argument("--symbols", default="ES,NQ,CL,GC", help="comma-separated symbols (default ES,NQ,CL,GC)")
    p.add_argument("--extra-features", type=int, default=0,
                   help="user columns f000.. written and trained on (default 0; 220 for the production preset's)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps in the epoch (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each build, alternating (default 2)")
    p.add_argument("--trainer-arg", action="append", default=[], help="another trainer flag (repeatable)")
    args = p.parse_args(argv)
    for name in ("a", "b"):
        if not (getattr(args, name) / "trainer" / "__main__.py").is_file():
            p.error(f"--{name} {getattr(args, name)}: not a checkout holding trainer/__main__.py")
    if args.bars < 1000 or args.steps < 1 or args.repeats < 1 or args.extra_features < 0:
        p.error("need --bars >= 1000, --steps >= 1, --repeats >= 1, --extra-features >= 0")
    symbols = args.symbols.split(",")
    if not all(symbols) or len(set(symbols)) < len(symbols):
        p.error(f"--symbols {args.symbols!r}: give distinct names separated by commas, e.g. ES,NQ")
    extra = list(args.trainer_arg)
    if args.extra_features:
        extra += ["--features", ",".join(f"f{i:03d}" for i in range(args.extra_features))]
    with tempfile.TemporaryDirectory() as tmp:
        parquet = Path(tmp) / "bars.parquet"
        made = subprocess.run([sys.executable, "-m", "features.synth", "--out", str(parquet), "--symbols",
                               args.symbols, "--bars", str(args.bars), "--extra-features", str(args.extra_features)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if made.returncode != 0:
            raise SystemExit(f"error: features.synth could not write the sample bars:\n{made.stderr[-3000:]}")
        rows = args.bars * len(symbols)
        print(f"{rows:,} bars ({args.symbols}, {args.bars:,} each), {args.extra_features} user columns, "
              f"parquet {parquet.stat().st_size / 2**20:,.1f} MiB; {args.steps} steps, then validation and test",
              flush=True)
        runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for i in range(args.repeats):
            for label in ("A", "B") if i % 2 == 0 else ("B", "A"):
                checkout = args.a if label == "A" else args.b
                r = run_trainer(checkout, parquet, Path(tmp) / label / "ckpt.pt", args.steps, extra)
                runs[label].append(r)
                print(f"  {label} run {i + 1}: peak RSS {r['peak_rss_mib']:,.0f} MiB (trainer: train "
                      f"{r['train_mib']:,.0f}, val {r['val_mib']:,.0f} MiB), {r['wall_s']:.1f} s, "
                      f"val loss {r['val_loss']!r}", flush=True)
    print("\n| | A | B | B / A |\n|---|---|---|---|")
    for key, name in (("peak_rss_mib", "peak RSS, MiB (whole child)"), ("train_mib", "trainer's peak after "
                      "training, MiB"), ("val_mib", "trainer's peak after validation, MiB"), ("wall_s", "wall, s"),
                      ("windows_per_s", "training windows/s")):
        a = [r[key] for r in runs["A"]]
        b = [r[key] for r in runs["B"]]
        fmt = "{:.1f}" if key == "wall_s" else "{:,.0f}"  # windows/s as whole windows
        print(f"| {name} | {' / '.join(fmt.format(x) for x in a)} | {' / '.join(fmt.format(x) for x in b)} | "
              f"{sum(b) / len(b) / (sum(a) / len(a)):.2f} |")
    losses = {label: sorted({r["val_loss"] for r in rs}) for label, rs in runs.items()}
    print(f"\nvalidation loss: A {losses['A']}, B {losses['B']}"
          + ("" if losses["A"] == losses["B"] else "  (differ: the builds do not compute the same run)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
