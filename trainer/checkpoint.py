"""Checkpoints: one file, written atomically, of plain tensors, numbers, strings, lists and dicts,
loadable with `torch.load(..., weights_only=True)`: nothing in it runs code."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from features.bars import ColumnMap
from features.file_kind import hint
from features.files import atomic_output
from trainer.model_config import ModelConfig
from trainer.modeling import TemporalFusionTransformer

FORMAT = "foxhunt-tft-checkpoint/2"
REQUIRED_KEYS = ("format", "model_config", "train_config", "feature_config", "feature_schema", "normalization",
                 "symbols", "bar_interval_ns", "column_map", "model_state", "model_state_sha256")


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or used; the message says why and what to do."""


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    """Write to a temporary file beside `path`, fsync, rename over it: never half a file."""
    _write_atomic(path, lambda fh: torch.save(obj, fh))


def copy_atomic(src: Path, path: Path) -> None:
    """`src`'s bytes to `path`, as save_atomic writes (never half a file at `path`)."""
    def write(fh: BinaryIO) -> None:
        with open(src, "rb") as source:
            shutil.copyfileobj(source, fh, 1 << 20)

    _write_atomic(path, write)


def _write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    with atomic_output(path) as tmp:
        try:
            with open(tmp, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
        except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
            cause = exc if isinstance(exc, OSError) else exc.__context__
            code = cause.errno if isinstance(cause, OSError) and cause.errno else errno.EIO
            raise OSError(code, f"cannot write {path} ({os.strerror(code)}); the previous file, if any, is "
                                "intact. Free disk space or choose another --out") from None


def remove_stale_temp_files(path: Path) -> list[Path]:
    """Temp files a killed writer (SIGKILL, power loss) left beside `path`; the real file is untouched."""
    ours = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")  # save_atomic's mkstemp names, no other
    stale = [p for p in path.parent.iterdir() if ours.fullmatch(p.name) and p.is_file()] if path.parent.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load with weights_only=True and check the format; CheckpointError otherwise."""
    p = Path(path)
    if not p.is_file():  # a pipe would block torch.load
        raise CheckpointError(f"{p}: no such checkpoint file" if not p.exists() else
                              f"{p}: not a regular file; give the checkpoint file `python -m trainer` wrote")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's weights-only unpickler raises many types on other bytes
        if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):
            raise CheckpointError(f"{p}: refused — loading it would unpickle code, which a foxhunt checkpoint never "
                                  "needs. Only load checkpoints written by `python -m trainer`") from None
        raise CheckpointError(f"{p}: not a readable checkpoint (torch.load: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}){hint(p, 'a PyTorch checkpoint')}") \
            from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{p}: not a foxhunt-tft checkpoint (format {FORMAT!r} expected)")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{p}: checkpoint lacks {', '.join(missing)}")
    try:  # the bars' column names and time unit, which --resume and export read bars with
        ColumnMap.from_dict(dict(ckpt["column_map"]))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{p}: the checkpoint's column_map is not valid ({exc}): the file is damaged or was "
                              "not written by `python -m trainer`") from None
    if state_digest(ckpt["model_state"]) != ckpt["model_state_sha256"]:
        raise CheckpointError(f"{p}: the weights differ from the digest written with them: the file is corrupted "
                              "(a flipped bit, a bad copy); use another copy, or the run's other checkpoint")
    return ckpt


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes, so load refuses weights changed on disk."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's own bytes, not a copy
    return h.hexdigest()


def model_from_checkpoint(ckpt: dict[str, Any]) -> TemporalFusionTransformer:
    """Rebuild the model from its stored config and load its weights (eval mode, CPU)."""
    model = TemporalFusionTransformer(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model_state"])  # the digest load_checkpoint checked ties them to their config
    return model.eval()


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
