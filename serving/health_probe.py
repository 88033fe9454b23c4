"""`python -m serving.health_probe --target HOST:PORT`: exit 0 if the server is SERVING, else 1.

Asks grpc.health.v1.Health/Check once, within `--timeout` seconds. For Docker's HEALTHCHECK: 0 healthy, 1 for
every failure (NOT_SERVING, no answer, unreadable TLS files, bad arguments: Docker reserves 2). One line says
what it saw. The TLS and token flags are the client's, so one set of client flags works everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.errors import ConfigError
from serving.security import add_client_arguments, call_metadata, check_client_arguments, first_call_error, open_channel

HEALTHY, UNHEALTHY = 0, 1


class _Parser(argparse.ArgumentParser):
    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:  # errors: 2, which Docker reserves
        super().exit(UNHEALTHY if status else status, message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m serving.health_probe", description=__doc__, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="server HOST:PORT, or any target gRPC takes (default 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="service to ask about (default '': the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    add_client_arguments(p)
    return p


def probe(target: str, args: argparse.Namespace) -> tuple[int, str]:
    """(exit status, what was seen)."""
    try:
        metadata = call_metadata(args)
        channel = open_channel(target, args)
    except ConfigError as exc:
        return UNHEALTHY, f"error: {exc}"
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout,
                                metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # the health service answers that with no detail
                return UNHEALTHY, (f"{target}: NOT_FOUND: no health status for --service {args.service!r}; this "
                                   "server reports '' (the whole server) and foxhunt.tft.v1.Forecaster")
            return UNHEALTHY, first_call_error(target, exc, target)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    return (HEALTHY if answer.status == health_pb2.HealthCheckResponse.SERVING else UNHEALTHY), f"{target}: {status}"


def wait_serving(target: str, timeout: float, interval: float = 0.1) -> bool:
    """Poll a plaintext server's health service until it answers SERVING (True) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):  # not listening yet, or warming up
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return True
            time.sleep(interval)
    return False


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_client_arguments(p, args)
    code, line = probe(args.target, args)
    print(line, file=sys.stdout if code == HEALTHY else sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
