"""Tiny real artifacts for tests: sample bars, a trained checkpoint, an exported model.

Each is made by the real command (`python -m features.synth`, `python -m trainer`,
`python -m export`) as a subprocess, so the tests exercise what users run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A model small enough to train in seconds on one CPU thread.
TINY_TRAIN_FLAGS: tuple[str, ...] = (
    "--hidden-size", "8", "--attention-heads", "2", "--encoder-length", "20", "--horizon", "3",
    "--batch-size", "32", "--epochs", "1", "--max-steps-per-epoch", "5", "--max-val-windows", "200",
    "--threads", "1", "--device", "cpu", "--no-progress", "--no-report",
)


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `python -m ...` from the repository root; output captured as text."""
    return subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_score(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`python -m serving.score args` from the repository root."""
    return run(["-m", "serving.score", *map(str, args)])


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
    r = run(["-m", "features.synth", "--out", str(out), "--symbols", symbols, "--bars", str(bars),
             "--seed", str(seed)])
    assert r.returncode == 0, r.stderr
    return out


def make_checkpoint(workdir: Path, extra: tuple[str, ...] = ()) -> Path:
    """bars.parquet + a tiny trained ckpt.pt in `workdir`."""
    bars = make_bars(workdir / "bars.parquet")
    ckpt = workdir / "ckpt.pt"
    r = run(["-m", "trainer", "--parquet", str(bars), "--out", str(ckpt), *TINY_TRAIN_FLAGS, *extra])
    assert r.returncode == 0, r.stderr[-4000:]
    return ckpt


def make_onnx(ckpt: Path, out: Path, extra: tuple[str, ...] = ()) -> Path:
    """Export `ckpt` with `python -m export` (all gates on)."""
    r = run(["-m", "export", str(ckpt), str(out), *extra])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out
