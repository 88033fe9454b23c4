"""Faults the trainer survives: SIGKILL mid-epoch, a disk that fills while a checkpoint is written."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.artifacts import REPO, TINY_TRAIN_FLAGS, make_bars, run_main
from trainer.checkpoint import load_checkpoint, save_atomic


@pytest.fixture(scope="module")
def bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bars(tmp_path_factory.mktemp("faults") / "bars.parquet", bars=1500)


def test_sigkill_mid_epoch_then_resume_finishes(tmp_path: Path, bars: Path) -> None:
    """Killed after its first epoch's metrics line (never early stopping, far from its last epoch): the last
    checkpoint is whole, and a resume from it finishes."""
    out = tmp_path / "ckpt.pt"
    flags = list(TINY_TRAIN_FLAGS)
    flags[flags.index("--epochs") + 1] = "100000"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--parquet", str(bars), "--out", str(out), *flags,
                             "--patience", "0"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = out.with_suffix(".metrics.jsonl")
        while not (metrics.exists() and "\n" in metrics.read_text()):  # pytest's timeout bounds the wait
            assert proc.poll() is None, f"the trainer exited {proc.returncode} before its first epoch ended"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # epoch 1 was saved before its metrics line
        proc.wait(timeout=30)
    finally:
        proc.kill()
    last = load_checkpoint(out.with_suffix(".last.pt"))  # never half-written
    assert 1 <= last["epoch"] < 100000
    # what a kill in the middle of a write leaves (the kill above rarely lands in one): save_atomic's temp names
    partial = [tmp_path / ".ckpt.pt.k1ll3d_x.tmp", tmp_path / ".ckpt.last.pt.abcdefgh.tmp",
               tmp_path / ".ckpt.report.png.r3p0rt_x.tmp", tmp_path / ".ckpt.test.json.t35t_xyz.tmp"]
    for p in partial:
        p.write_bytes(b"half a checkpoint")
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), "--resume",
                  str(out.with_suffix(".last.pt")), "--epochs", str(last["epoch"] + 1), "--no-progress", "--no-report"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_checkpoint(out.with_suffix(".last.pt"))["epoch"] == last["epoch"] + 1
    assert not list(tmp_path.glob(".*.tmp")), "partial writes of the killed run were not cleaned up"
    assert all(f"removed {p}, a partial write left by a killed run" in r.stderr for p in partial), r.stderr[-2000:]


WRITE_UNDER_FILE_SIZE_LIMIT = """
import resource, signal, sys, torch
from pathlib import Path
from trainer.checkpoint import save_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    save_atomic({"w": torch.zeros(1_000_000)}, Path(sys.argv[1]))
except OSError as exc:
    print("errno", exc.errno)
    sys.exit(3)
"""


def test_full_disk_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    save_atomic({"w": torch.arange(10.0)}, ckpt)
    before = ckpt.read_bytes()
    r = subprocess.run([sys.executable, "-c", WRITE_UNDER_FILE_SIZE_LIMIT, str(ckpt)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"errno {errno.EFBIG}" in r.stdout
    assert ckpt.read_bytes() == before
    assert torch.equal(torch.load(ckpt, weights_only=True)["w"], torch.arange(10.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_really_full_filesystem_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"this sandbox does not allow mounting tmpfs: {r.stderr.strip()}")
    try:
        ckpt = mnt / "ckpt.pt"
        save_atomic({"w": torch.arange(100.0)}, ckpt)
        before = ckpt.read_bytes()
        with pytest.raises(OSError) as info:
            save_atomic({"w": torch.zeros(1_000_000)}, ckpt)  # 4 MB into a 1 MiB filesystem
        assert info.value.errno == errno.ENOSPC
        assert ckpt.read_bytes() == before
        assert sorted(p.name for p in mnt.iterdir()) == ["ckpt.pt"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
