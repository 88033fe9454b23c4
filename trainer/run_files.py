"""The files beside --out across runs: refusing the bars as --out, and whose best checkpoint is there
(the report and test scores must judge the run's own best model)."""

from __future__ import annotations

import logging
from dataclasses import astuple
from pathlib import Path
from typing import Any

from features.bars import clash_with_bars
from features.file_kind import replace_problem
from trainer.checkpoint import CheckpointError, copy_atomic, load_checkpoint, remove_stale_temp_files
from trainer.config import ConfigError
from trainer.paths import RunPaths, run_stem

log = logging.getLogger("trainer")


def prepare_out(out: Path, parquet: Path) -> RunPaths:
    """The run's files (a killed run's temp files removed); ConfigError for the bars, a directory or a foreign file."""
    paths = RunPaths.for_out(out)
    for written in astuple(paths):
        if problem := clash_with_bars(written, parquet):
            raise ConfigError(f"--out {out}: {problem}; give another --out")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; name the checkpoint file, e.g. --out {out / 'ckpt.pt'}")
    for ckpt in (paths.best, paths.last):
        if problem := replace_problem(ckpt, "a PyTorch checkpoint"):
            raise ConfigError(f"--out {out}: {problem}")
    for written in (paths.best, paths.last, paths.report, paths.test):  # the files written through temp files
        for stale in remove_stale_temp_files(written):
            log.warning("removed %s, a partial write left by a killed run", stale)
    return paths


def runs_best(path: Path, best_epoch: int, history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The checkpoint at `path` if this run saved it at its best epoch (its epochs this run's first), else None."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError:
        return None

    def trail(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return [(r.get("epoch"), r.get("step"), r.get("val_loss")) for r in records]

    kept = trail(list(ckpt["metrics_history"]))
    same_epoch = 0 < best_epoch == int(ckpt["epoch"]) == len(kept)
    return ckpt if same_epoch and kept == trail(history)[:len(kept)] else None


def adopt_best(paths: RunPaths, resumed: Path, best_epoch: int, best_val: float,
               history: list[dict[str, Any]]) -> None:
    """When --out's best is not the resumed run's, copy the run's best there from beside the resumed file; when
    none is found, remove the report and test scores beside --out."""
    if best_epoch == 0 or runs_best(paths.best, best_epoch, history) is not None:
        return
    candidates = [resumed]
    if resumed.name.endswith(".last.pt"):  # NAME.last.pt sits beside its best, NAME.pt, .pth, .ckpt or NAME
        stem = resumed.name.removesuffix(".last.pt")
        candidates = [*sorted(p for p in resumed.parent.iterdir() if run_stem(p) == stem and p != resumed), resumed]
    for src in candidates:
        if src.is_file() and src.resolve() != paths.best.resolve() and runs_best(src, best_epoch, history):
            copy_atomic(src, paths.best)
            log.info("resume: copied the run's best checkpoint (epoch %d) from %s to %s", best_epoch, src, paths.best)
            return
    state = "holds another run's checkpoint" if paths.best.exists() else "does not exist"
    log.warning("resume: %s %s, and the run's best checkpoint (epoch %d, validation loss %.5f) is not beside %s "
                "either; an epoch of this run that beats it will be written there. Until then there is no best "
                "checkpoint of this run to export, report or test (copy it to %s to use it)", paths.best, state,
                best_epoch, best_val, resumed, paths.best)
    remove_judgments(paths, "they judge a model that is not this run's best")


def remove_judgments(paths: RunPaths, why: str) -> None:
    """The report and test scores beside --out, which judge the model at paths.best."""
    if stale := [p for p in (paths.test, paths.report) if p.exists()]:
        for p in stale:
            p.unlink()
        log.warning("removed %s: %s", ", ".join(map(str, stale)), why)
