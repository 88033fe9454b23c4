"""The server's log on stderr: text lines, or one JSON object a line (`--log-format json`, `JsonFormatter`). A burst
of like warnings (refused calls) is one line, then a count a minute (`BurstLog`)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable

LOG_FORMATS = ("text", "json")
log = logging.getLogger("serving")
_json = False  # configure() set up JSON records: fatal() writes one too
Schedule = Callable[[float, Callable[[], None]], bool]  # (delay, fn): run fn later; False when it cannot


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        entry: dict[str, object] = {"time": stamp, "level": record.levelname, "logger": record.name,
                                    "message": record.getMessage()}
        if self.worker is not None:
            entry["worker"] = self.worker
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str = "text", worker: int | None = None) -> None:
    """The root logger on stderr at `level`, in `fmt`; a worker's lines say whose they are. As basicConfig,
    nothing changes where the root logger has handlers already."""
    global _json
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    whose = "" if worker is None else f"[worker {worker}] "  # N workers share one stderr
    handler.setFormatter(JsonFormatter(worker) if fmt == "json" else
                         logging.Formatter(f"%(asctime)s %(levelname)s %(name)s {whose}%(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    _json = fmt == "json"


def fatal(message: str, worker: int | None = None) -> None:
    """The line a failed start ends with: `error: MESSAGE` in text (`[worker N] error: ...` from a worker),
    an ERROR record in JSON."""
    if _json:
        log.error("%s", message)
        return
    whose = "" if worker is None else f"[worker {worker}] "
    print(f"{whose}error: {message}", file=sys.stderr, flush=True)


def later(delay: float, fn: Callable[[], None]) -> bool:
    """fn after `delay` seconds on the running event loop; without one, not at all (False)."""
    try:
        asyncio.get_running_loop().call_later(delay, fn)
    except RuntimeError:
        return False
    return True


class BurstLog:
    """A warning that comes in bursts, without flooding the log: the first after a quiet spell at once
    (`first(what)`), then `count(n, latest)` every `every_s` while they go on. Where `schedule` cannot run the
    count, each is a line of its own."""

    def __init__(self, first: Callable[[str], None], count: Callable[[int, str], None], every_s: float = 60.0,
                 schedule: Schedule | None = None) -> None:
        self.every_s = every_s
        self._first, self._count = first, count
        self._schedule = schedule or later
        self._counting = False  # a count's line is due
        self._uncounted = 0  # events since the last line
        self._latest = ""  # the latest of them

    def note(self, what: str) -> bool:
        """True when `what` was logged at once, False when it is held back for the count."""
        if not self._counting:
            self._first(what)
            self._counting = bool(self._schedule(self.every_s, self.flush))
            return True
        self._uncounted += 1
        self._latest = what
        return False

    def flush(self) -> None:
        """The count of the events since the last line, if any (every `every_s`, and when the server stops)."""
        if not self._uncounted:
            self._counting = False  # quiet: the next one gets a line at once
            return
        self._count(self._uncounted, self._latest)
        self._uncounted = 0
        self._counting = bool(self._schedule(self.every_s, self.flush))
