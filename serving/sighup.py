"""A SIGHUP that arrives while the server starts is remembered, not fatal.

Python's default action for SIGHUP ends the process, and the event loop's handler is installed
only once the model is loaded and the port bound. `hold()`, the first thing `python -m serving`
does, records a SIGHUP meanwhile: `serve()` forgets one that came before it read its files (the
start reads them anyway) and reloads once warm for one that came after.
"""

from __future__ import annotations

import signal
from types import FrameType

_arrived = False


def _record(_signum: int, _frame: FrameType | None) -> None:
    global _arrived
    _arrived = True


def hold() -> None:
    """From now until the event loop takes SIGHUP over, record it instead of dying of it."""
    signal.signal(signal.SIGHUP, _record)


def forget() -> None:
    """Files are about to be read: a SIGHUP recorded so far asks for nothing the start will not see."""
    global _arrived
    _arrived = False


def arrived() -> bool:
    """Whether a SIGHUP came since `forget()`."""
    return _arrived
