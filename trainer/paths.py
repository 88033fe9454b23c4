"""Where a run's files go: beside the checkpoint named by --out. Free of torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt")  # dropped from --out to name the files beside it


@dataclass(frozen=True)
class RunPaths:
    best: Path  # best validation loss: what export takes
    last: Path  # end of the latest epoch: what --resume takes
    metrics: Path  # one JSON object per epoch
    report: Path  # loss curves, fan chart, importances, attention
    test: Path  # the best model on the test split (with --test-fraction)

    @staticmethod
    def for_out(out: Path) -> RunPaths:
        stem = out.with_name(run_stem(out))
        return RunPaths(out, Path(f"{stem}.last.pt"), Path(f"{stem}.metrics.jsonl"), Path(f"{stem}.report.png"),
                        Path(f"{stem}.test.json"))


def run_stem(out: Path) -> str:
    """ckpt.pt -> ckpt (ckpt.last.pt, ...); only a checkpoint's suffix is dropped, so lr0.001 keeps its own."""
    return out.stem if out.suffix in CHECKPOINT_SUFFIXES else out.name
