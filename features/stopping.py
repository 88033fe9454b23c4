"""Stop signals (Ctrl-C, SIGTERM) where acting on them at once would do harm.

`stop_ends_the_import`: the commands import torch and onnx (seconds) only once their flags hold. A
KeyboardInterrupt raised inside an extension module's import is not safe to catch: onnx's bindings abort the
process (SIGABRT, a C++ traceback), and a library's own import code may swallow it. Nothing has been written at
that point, so the process ends at once with exit 130, as an interrupt later does.

`interrupts_deferred`: a stretch a signal must not cut, such as a temporary file made but not yet named to
whoever removes it, or a published export's report; the signals are recorded for the caller to act on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_ends_the_import(message: str) -> Iterator[None]:
    """Within the block, a stop signal writes `message` (a line) to stderr and exits 130 at once; the handlers
    before it are back afterwards. Off the main thread, where handlers cannot be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    line = (message.rstrip("\n") + "\n").encode()

    def stop(signum: int, frame: FrameType | None) -> None:
        os.write(2, line)
        os._exit(130)

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        _restore(previous)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """SIGINT and SIGTERM inside the block are recorded in the yielded list rather than acted on (in the
    main thread, where Python runs signal handlers; elsewhere the block changes nothing)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    previous = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in STOP_SIGNALS}
    try:
        yield got
    finally:
        _restore(previous)


def _restore(previous: dict[signal.Signals, Any]) -> None:
    for s, handler in previous.items():
        signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set from C, not restorable
