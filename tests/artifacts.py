"""Tiny real artifacts for tests: sample bars, a trained checkpoint, an exported model.

Each is made by the command a user runs (`python -m features.synth`, `python -m trainer`, `python -m export`),
its `main` called in the test's own process (`run_main`: the same code with its flags, less a process start and a
second torch import); `run` starts the real process, for the tests whose process is under test. `shared_dir`
builds an artifact once per test run for all of pytest-xdist's workers.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]

# A model small enough to train in seconds on one CPU thread.
TINY_TRAIN_FLAGS: tuple[str, ...] = (
    "--hidden-size", "8", "--attention-heads", "2", "--encoder-length", "20", "--horizon", "3",
    "--batch-size", "32", "--epochs", "1", "--max-steps-per-epoch", "5", "--max-val-windows", "200",
    "--threads", "1", "--device", "cpu", "--no-progress", "--no-report",
)


def shared_dir(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name` that `build` fills once per test run, for every pytest-xdist worker (the recipe
    pytest-xdist documents): the first worker to ask builds it under a file lock while the others wait, and a
    marker written last tells a finished build from a failed one, which the next worker to ask builds again."""
    base = factory.getbasetemp()
    root = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base  # the run's directory, above the workers'
    work, done = root / name, root / f"{name}.built"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            build(work)
            done.touch()
    return work


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `python -m ...` from the repository root; output captured as text."""
    return subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_main(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """`run(cmd)` for `cmd` = ["-m", MODULE, *args], as MODULE's `main(args)` in this process: its exit status, what
    it printed, and in its stderr what it logged at INFO and above (pytest's logging set-up stands in for the
    command's own, so the lines lack its time stamps). The command's SIGTERM handler is undone after it."""
    assert cmd[0] == "-m", cmd
    module = importlib.import_module(cmd[1])
    main = getattr(module, "main", None) or importlib.import_module(f"{cmd[1]}.__main__").main
    out, err = io.StringIO(), io.StringIO()
    root, handler = logging.getLogger(), logging.StreamHandler(err)
    level, sigterm = root.level, signal.getsignal(signal.SIGTERM)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(cmd[2:])
            except SystemExit as exc:  # argparse's refusals and --help
                code = int(exc.code or 0)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        signal.signal(signal.SIGTERM, sigterm)
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())


def run_score(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`python -m serving.score args`, as its main in this process (run_main)."""
    return run_main(["-m", "serving.score", *map(str, args)])


def exit_and_imports(module: str, args: list[str],
                     heavy: tuple[str, ...] = ("torch", "onnx")) -> tuple[subprocess.CompletedProcess[str], str]:
    """`python -m module args` in a process that, at its exit, prints its exit status and which of `heavy` it had
    imported: "exit 2 torch=False onnx=False"."""
    probe = ("import runpy, sys\n"
             f"sys.argv = [{module!r}, *sys.argv[1:]]\n"
             "try:\n"
             f"    runpy.run_module({module!r}, run_name='__main__')\n"
             "except SystemExit as exc:\n"
             f"    print('exit', exc.code, *(f'{{m}}={{m in sys.modules}}' for m in {heavy!r}))\n")
    r = run(["-c", probe, *args])
    return r, (r.stdout.splitlines() or [""])[-1]


def make_bars(out: Path, bars: int = 1500, symbols: str = "ES,NQ", seed: int = 7) -> Path:
    r = run_main(["-m", "features.synth", "--out", str(out), "--symbols", symbols, "--bars", str(bars),
                  "--seed", str(seed)])
    assert r.returncode == 0, r.stderr
    return out


def make_checkpoint(workdir: Path, extra: tuple[str, ...] = ()) -> Path:
    """bars.parquet + a tiny trained ckpt.pt in `workdir`."""
    bars = make_bars(workdir / "bars.parquet")
    ckpt = workdir / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(ckpt), *TINY_TRAIN_FLAGS, *extra])
    assert r.returncode == 0, r.stderr[-4000:]
    return ckpt


def make_onnx(ckpt: Path, out: Path, extra: tuple[str, ...] = ()) -> Path:
    """Export `ckpt` with `python -m export`'s main (all gates on)."""
    r = run_main(["-m", "export", str(ckpt), str(out), *extra])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out
