"""How long a command takes to answer `--help` or refuse a bad flag: two builds side by side.

    python -m benchmarks.cli_startup [--a ../other-checkout] [--b .] [--repeats 5]

A user who mistypes a flag, or asks for `--help`, waits for whatever the command imports before it
reads its arguments. Each case runs `python -m ...` from each checkout (`--a`, `--b`: checkouts whose
packages run, e.g. a `git worktree` of the commit before a change, and this one), A and B alternating,
`--repeats` times, and reports the median wall time of each. The peers, run the same way in the same
rounds: the interpreter alone (`python -c pass`) and `python -c "import torch"`, what a command that
imports torch first pays before it can say anything.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (label, arguments after the interpreter, the exit status the case must end with)
CASES: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("trainer --help", ("-m", "trainer", "--help"), 0),
    ("trainer: a bad flag (--seed out of range)",
     ("-m", "trainer", "--parquet", "README.md", "--seed", "99999999999"), 2),
    ("export --help", ("-m", "export", "--help"), 0),
    ("export: no such checkpoint", ("-m", "export", "missing.pt", "model.onnx"), 2),
    ("serving --help", ("-m", "serving", "--help"), 0),
    ("serving.client --help", ("-m", "serving.client", "--help"), 0),
    ("serving.score --help", ("-m", "serving.score", "--help"), 0),
    ("features.check --help", ("-m", "features.check", "--help"), 0),
)
PEERS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("peer: python -c pass", ("-c", "pass"), 0),
    ("peer: python -c 'import torch'", ("-c", "import torch"), 0),
)


def time_once(checkout: Path, args: tuple[str, ...], status: int) -> float:
    """Wall seconds of one `python args` run in `checkout`; SystemExit if it ends otherwise than `status`."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=checkout, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != status:
        raise SystemExit(f"error: `python {' '.join(args)}` in {checkout} exited {proc.returncode}, not {status}:\n"
                         f"{proc.stderr[-2000:]}")
    return wall


def measure(builds: dict[str, Path], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per case and build: every round runs every case once per build, the builds alternating."""
    times: dict[str, dict[str, list[float]]] = {label: {name: [] for name in builds} for label, _, _ in CASES}
    times.update({label: {"peer": []} for label, _, _ in PEERS})
    for _ in range(repeats):
        for label, args, status in CASES:
            for name, checkout in builds.items():
                times[label][name].append(time_once(checkout, args, status))
        for label, args, status in PEERS:
            times[label]["peer"].append(time_once(REPO, args, status))
    return times


def table(times: dict[str, dict[str, list[float]]], builds: dict[str, Path]) -> list[str]:
    torch_s = statistics.median(times[PEERS[1][0]]["peer"])
    names = list(builds)
    head = " | ".join(f"{n} s" for n in names) + (" | B / A" if len(names) == 2 else "") + " | over `import torch`"
    lines = [f"| case | {head} |", "|---" * (len(names) + 2 + (len(names) == 2)) + "|"]
    for label, _, _ in CASES:
        medians = [statistics.median(times[label][n]) for n in names]
        cells = [f"{m:.2f}" for m in medians]
        if len(names) == 2:
            cells.append(f"{medians[1] / medians[0]:.2f}x")
        cells.append(f"{medians[-1] / torch_s:.2f}x")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    for label, _, _ in PEERS:
        m = statistics.median(times[label]["peer"])
        lines.append(f"| {label} | {' | '.join([f'{m:.2f}'] * len(names))}"
                     + (" | –" if len(names) == 2 else "") + f" | {m / torch_s:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cli_startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, help="another checkout to compare with (e.g. a git worktree of an older commit)")
    p.add_argument("--b", type=Path, default=REPO, help="the checkout measured (default: this one)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each case per build (default 5)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    builds = {"A": args.a, "B": args.b} if args.a is not None else {"B": args.b}
    for name, checkout in builds.items():
        if not (checkout / "trainer" / "__main__.py").is_file():
            p.error(f"--{name.lower()} {checkout}: not a checkout holding trainer/__main__.py")
    print(f"{args.repeats} run(s) of each case per build, medians; "
          + ", ".join(f"{n}: {c.resolve()}" for n, c in builds.items()), flush=True)
    print("\n".join(table(measure(builds, args.repeats), builds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
