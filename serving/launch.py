"""The installed `foxhunt-serve` command: `python -m serving` under its script name.

`python -m serving` holds SIGHUP and sets gRPC's log level before it imports the server (grpc reads
its level as it is imported; SIGHUP's default action would kill a process still importing). A script's
entry point runs only after its module is imported, so this module, which imports neither, does those
two steps and then imports and runs `serving.__main__.main`.
"""

from __future__ import annotations

import sys

from serving import native_log, sighup


def main() -> int:
    sighup.hold()
    native_log.quiet_grpc_core(sys.argv[1:])
    from serving.__main__ import main as serve

    return serve()
