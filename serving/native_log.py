"""Capture what native code (ONNX Runtime's C++ logger) writes to file descriptor 2.

ONNX Runtime reports why a provider did not load (a missing libcublasLt, say) only on its
own log, not in the Python exception; export and the server read it from here to say why.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ORT_LINE = re.compile(r"\[[VIWEF]:onnxruntime:")
QUIET_LEVELS = ("WARNING", "ERROR")  # --log-level values that also quiet gRPC's core below its errors


@contextlib.contextmanager
def native_stderr(echo: bool | Callable[[str], bool] = False) -> Iterator[list[str]]:
    """Redirect fd 2 inside the block; the yielded list is filled with the captured lines
    (ANSI colours removed) when the block ends. `echo` writes the raw text back to stderr,
    so nothing logged meanwhile is lost; a function writes back the raw lines it keeps (asked
    when the block ends, so it can depend on what happened inside)."""
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
            text = tmp.read().decode("utf-8", errors="replace")
            if echo is True:
                sys.stderr.write(text)
            elif echo:
                sys.stderr.write("".join(line for line in text.splitlines(keepends=True) if echo(line)))
            lines.extend(line.strip() for line in strip_ansi(text).splitlines() if line.strip())


def is_onnxruntime_line(line: str) -> bool:
    """A line of ONNX Runtime's own logger (`... [E:onnxruntime:Default, file.cc:12 fn] ...`)."""
    return _ORT_LINE.search(strip_ansi(line)) is not None


def strip_ansi(text: str) -> str:
    """`text` without terminal colour codes (ONNX Runtime's logger and torch's exporter add them)."""
    return _ANSI.sub("", text)


def provider_failure_reason(lines: list[str]) -> str:
    """The useful part of ONNX Runtime's provider-loading log: the library and loader error first."""
    found = []
    for line in lines:
        if m := re.search(r"Failed to load library (\S+) with error: (.+)$", line):
            found.append(f"{os.path.basename(m.group(1))} failed to load: {m.group(2).strip()}")
    for line in lines:
        if m := re.search(r"(Failed to create \w+ExecutionProvider\..*?)(?: Please| $|$)", line):
            found.append(m.group(1).strip().rstrip("."))
        elif re.search(r"CUDA failure|cudaError|no CUDA-capable device|CUDNN failure", line):
            found.append(line.split("] ", 1)[-1])
    return "; ".join(dict.fromkeys(found))


def quiet_grpc_core(argv: Sequence[str]) -> None:
    """Match gRPC's own logger to the command's --log-level before grpc is imported.

    gRPC's C core logs on fd 2 in its own format (`I1201 12:00:00.000 ... ssl_transport_security.cc:2563]
    Handshake failed ...`: one line per failed TLS handshake, so a scanner's every connection), at INFO unless
    GRPC_VERBOSITY says otherwise, and reads that variable once, as grpc is imported. At --log-level WARNING
    or ERROR it is set to ERROR, so the core's INFO lines go as the server's own do; a GRPC_VERBOSITY already
    in the environment (the operator's) is left as it is, and so is the core once grpc is imported.
    """
    level = None
    for i, arg in enumerate(argv):  # the last --log-level wins, as in argparse
        if arg == "--log-level" and i + 1 < len(argv):
            level = argv[i + 1]
        elif arg.startswith("--log-level="):
            level = arg.partition("=")[2]
    if level in QUIET_LEVELS and "grpc" not in sys.modules:
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
