"""What a file given in the wrong place is, from its first bytes, for the error that refuses it.

`python -m serving --model ckpt.pt` or `python -m export model.onnx out.onnx` then says what the
file is and which command takes it. A guess, used only in messages.
"""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

# ModelProto starts with ir_version (field 1, varint), then one of these keys (fields 2..8)
_ONNX_SECOND_TAGS = frozenset({0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42})


def describe(path: str | Path) -> str | None:
    """'a PyTorch checkpoint', 'a parquet file' or 'an ONNX model'; None when unknown, unreadable or not a
    regular file (a FIFO would block the open)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as fh:
            head = fh.read(8)
        if head.startswith(b"PAR1"):
            return "a parquet file"
        if head.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(path) as z:
                return "a PyTorch checkpoint" if any(n.endswith("data.pkl") for n in z.namelist()) else None
    except (OSError, ValueError, zipfile.BadZipFile):
        return None
    if len(head) >= 3 and head[0] == 0x08 and head[1] < 0x80 and head[2] in _ONNX_SECOND_TAGS:
        return "an ONNX model"
    return None


def hint(path: str | Path, expected: str) -> str:
    """'; it is KIND: ...which command takes it' for a file of another kind than `expected`; '' otherwise."""
    kind = describe(path)
    if kind is None or kind == expected:
        return ""
    return "; " + {
        "a PyTorch checkpoint": f"it is a PyTorch checkpoint: export it first with `python -m export {path} "
                                "model.onnx`, then use model.onnx",
        "a parquet file": "it is a parquet file, bars for `python -m trainer --parquet` or `python -m export "
                          "--bars`",
        "an ONNX model": "it is an ONNX model (what `python -m export` writes, for `python -m serving --model`); "
                         "give the checkpoint `python -m trainer` wrote (ckpt.pt, or ckpt.last.pt to resume)",
    }[kind]


def replace_problem(path: str | Path, writes: str) -> str | None:
    """Why writing a file of kind `writes` at `path` would destroy a file of another or unknown kind; None when
    nothing, a directory or a file of that kind (an earlier run's output) is there."""
    path = Path(path)
    if not path.exists() or path.is_dir() or (kind := describe(path)) == writes:
        return None
    what = f"is {kind}" if kind else f"is not {writes}"
    return (f"{path} exists and {what}, which writing {writes} there would replace; choose another name, or remove "
            "the file first")
