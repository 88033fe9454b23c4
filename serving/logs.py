"""The server's log on stderr: text lines, or one JSON object a line (`--log-format json`) with `time` (UTC,
ISO 8601), `level`, `logger`, `message`, `worker` and `exception`. Native code's own lines keep their format.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")
log = logging.getLogger("serving")
_json = False  # configure() set up JSON records: fatal() writes one too


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
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
