"""What the server command does before it imports the server, and the installed `foxhunt-serve` script.

Two steps must come before grpc and the server's modules are imported (the better part of a second):
holding SIGHUP (its default action would kill a process still importing) and setting gRPC's log level
(grpc reads it as it is imported). `python -m serving` calls `prepare` at the top of its module; a
script's entry point runs only after its module is imported, so `foxhunt-serve` enters here, in a
module that imports neither, and imports `serving.__main__` after `prepare`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from serving import native_log, sighup


def prepare(argv: Sequence[str]) -> None:
    """Hold SIGHUP until the server handles it, and match gRPC's log level to --log-level in `argv`."""
    sighup.hold()
    native_log.quiet_grpc_core(argv)


def main() -> int:
    prepare(sys.argv[1:])
    from serving.__main__ import main as serve

    return serve()
