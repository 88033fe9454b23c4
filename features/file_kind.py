"""What a file given in the wrong place is, from its first bytes, for the error that refuses it.

Each stage takes one kind of file (bars, a checkpoint, an ONNX model) and the others are easy to
pass by mistake: `python -m serving --model ckpt.pt`, `python -m export model.onnx out.onnx`. The
refusal then says what the file is and which command takes it. A guess, used only in messages.
"""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

# ModelProto's fields in serialised order start with ir_version (field 1, varint), then a
# length-delimited or varint field: producer_name, producer_version, domain, model_version, doc_string,
# graph, opset_import.
_ONNX_SECOND_TAGS = frozenset({0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42})


def describe(path: str | Path) -> str | None:
    """'a PyTorch checkpoint', 'a parquet file', 'an ONNX model' or 'an empty file'; None when unknown or
    unreadable; 'a directory' or 'not a regular file (...)' for those, which are never opened (a FIFO would
    block the open)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if not stat.S_ISREG(mode):
        return "not a regular file (a device, pipe or socket)"
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError:
        return None
    if not head:
        return "an empty file"
    if head.startswith(b"PAR1"):
        return "a parquet file"
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as z:
                if any(name.endswith("data.pkl") for name in z.namelist()):
                    return "a PyTorch checkpoint"
        except (zipfile.BadZipFile, OSError):
            return None
        return "a zip archive"
    if len(head) >= 3 and head[0] == 0x08 and head[1] < 0x80 and head[2] in _ONNX_SECOND_TAGS:
        return "an ONNX model"
    return None


def hint(path: str | Path, expected: str) -> str:
    """'; it is KIND: ...which command takes it' for a file that is not the `expected` kind (one of describe's
    answers); '' when it is that kind, or unknown."""
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
    }.get(kind, f"it is {kind}")


def replace_problem(path: str | Path, writes: str) -> str | None:
    """Why writing a file of kind `writes` (one of describe's answers) at `path` would destroy something else:
    a file of another kind, or of unknown kind (notes, a device). None when nothing, a directory or a file of
    that kind (an earlier run's output) is there."""
    path = Path(path)
    if not path.exists() or path.is_dir():  # nothing, a link to nothing (the write replaces the link), a directory
        return None
    kind = describe(path)
    if kind == writes:
        return None
    what = f"is {kind}" if kind else f"is not {writes}"
    if kind and kind.startswith("not "):
        return f"{path} {what}; give the name of a file to write {writes} to"
    return (f"{path} exists and {what}, which writing {writes} there would replace; choose another name, or remove "
            "the file first")
