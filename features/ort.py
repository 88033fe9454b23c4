"""ONNX Runtime helpers for export and the server. A provider that does not load is logged on file
descriptor 2, not raised: `native_stderr` captures that log, `provider_failure_reason` reads it."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator

import onnxruntime as ort

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ORT_LINE = re.compile(r"\[[VIWEF]:onnxruntime:")


@functools.cache
def preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries from NVIDIA's pip wheels once; onnxruntime-gpu does not find them.
    A library still missing shows up as the provider's load failure."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
            ort.preload_dlls(cuda=True, cudnn=True)


@contextlib.contextmanager
def native_stderr() -> Iterator[list[str]]:
    """Capture file descriptor 2 in the block; the yielded list gets its non-blank lines when it ends."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = strip_ansi(tmp.read().decode("utf-8", errors="replace"))
            lines.extend(line.strip() for line in text.splitlines() if line.strip())


def is_onnxruntime_line(line: str) -> bool:
    """A line of ONNX Runtime's own logger (`... [E:onnxruntime:Default, file.cc:12 fn] ...`)."""
    return _ORT_LINE.search(line) is not None


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def provider_failure_reason(lines: list[str]) -> str:
    """The useful part of ONNX Runtime's provider-loading log: the library and loader error first."""
    found = [f"{os.path.basename(m.group(1))} failed to load: {m.group(2).strip()}" for line in lines
             if (m := re.search(r"Failed to load library (\S+) with error: (.+)$", line))]
    for line in lines:
        if m := re.search(r"(Failed to create \w+ExecutionProvider\..*?)(?: Please| $|$)", line):
            found.append(m.group(1).strip().rstrip("."))
        elif re.search(r"CUDA failure|cudaError|no CUDA-capable device|CUDNN failure", line):
            found.append(line.split("] ", 1)[-1])
    return "; ".join(dict.fromkeys(found))
