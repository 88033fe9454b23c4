"""`python -m serving --model model.onnx`: serve quantile forecasts over gRPC on ONNX Runtime.

Binds 127.0.0.1:50051 unless told otherwise (--port 0 picks a free port); prints `listening on HOST:PORT` (and
`metrics on HOST:PORT` with --metrics-port) on stdout once bound, and logs to stderr. Health (grpc.health.v1)
is NOT_SERVING until the model has run at every batch size it will see, then SERVING.

Signals: SIGHUP re-reads the model, TLS and token files (a bad one is refused, the current one keeps serving).
SIGTERM or SIGINT drains: new calls are refused, in-flight ones get --grace seconds, then the process exits 0.

Exit status: 0 after a clean drain; 2 for bad arguments, a model that fails its checks, unusable TLS or token
files, a port that cannot be bound, or --device cuda without a usable CUDA provider (one error line on stderr).
Details: docs/serving.md and docs/operations.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import resource
from pathlib import Path

from serving.batcher import WAIT_POLICIES
from serving.errors import ConfigError, ModelLoadError
from serving.logs import LOG_FORMATS, fatal
from serving.logs import configure as configure_logging
from serving.model import DEVICES
from serving.server import EVENT_LOOPS, FLAG_DESTS, INT32_MAX, MiB, ServerConfig, run_server
from serving.workers import run_workers

log = logging.getLogger("serving")

DEFAULTS = ServerConfig(model_path=Path("model.onnx"))
MAX_CONNECTION_AGE_S = INT32_MAX // 1000  # gRPC's connection age is an int32 of milliseconds
MIN_CONNECTION_AGE_S = 0.1  # below this a connection is told to go away before it has carried much
MAX_BATCH = 4096  # windows a run; the warm-up runs every padded size up to --max-batch (memory, start time)
MAX_DELAY_MS = 10_000.0  # a batch wait past seconds is a stalled call, not a batching choice
MAX_THREADS = 1024
MAX_GRACE_S = 3600.0
FD_LIMIT_CAP = 1 << 20  # Linux's default ceiling (fs.nr_open), for a hard limit of "unlimited"


def bare_host(text: str) -> str:
    """A host as the server binds it: an IPv6 address written as in a URL ([::1]) loses its brackets."""
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    p.add_argument("--model", type=Path, required=True, help="ONNX model written by `python -m export`")
    p.add_argument("--host", type=bare_host, default=d.host,
                   help=f"interface to bind (default {d.host}; an IPv6 address with or without brackets)")
    p.add_argument("--port", type=int, default=d.port, help=f"gRPC port (default {d.port}; 0 picks a free one)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes sharing the port, each with its own model session, batcher and "
                        "interpreter (default 1)")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT, sharing the port with other server processes (what --workers does)")
    p.add_argument("--stop-on-stdin-eof", action="store_true", help=argparse.SUPPRESS)  # a --workers worker
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # ... and which: its log lines say so
    p.add_argument("--device", choices=DEVICES, default=d.device,
                   help="cuda: CUDA provider or refuse to start; cpu; auto: CUDA if it works, else CPU with a "
                        f"warning (default {d.device})")
    p.add_argument("--device-id", type=int, default=d.device_id, help="CUDA device ordinal (default 0)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help=f"ONNX Runtime intra-op threads (default {d.threads})")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default=d.event_loop,
                   help="uvloop: libuv's event loop, less interpreter time per call; asyncio: the standard "
                        f"library's (default {d.event_loop})")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the server's log on stderr (default INFO; gRPC's own log: set GRPC_VERBOSITY)")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="text lines (default), or json: one object a line with time, level, logger, message "
                        "(and worker, exception); gRPC's and ONNX Runtime's own lines keep their format")
    _add_limit_flags(p)
    _add_access_flags(p.add_argument_group("access"))
    return p


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Batching, limits, metrics and the stop."""
    d = DEFAULTS
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"windows per ONNX Runtime run (default {d.max_batch})")
    p.add_argument("--max-delay-ms", type=float, default=d.max_delay_ms,
                   help=f"longest a call waits for others to join its batch (default {d.max_delay_ms:g})")
    p.add_argument("--batch-wait", choices=WAIT_POLICIES, default=d.batch_wait,
                   help="adaptive: a batch also closes when no other call is ready to join (a lone call on an "
                        "idle server never waits); fixed: always wait --max-delay-ms unless the batch fills "
                        "(default adaptive)")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent,
                   help=f"Predict calls and PredictStream requests in flight before RESOURCE_EXHAUSTED "
                        f"(default {d.max_concurrent})")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help=f"request and response size limit in bytes (default {d.max_message_bytes // MiB} MiB)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port; default off)")
    p.add_argument("--metrics-host", type=bare_host, default=None, metavar="HOST",
                   help="interface the metrics endpoint binds (default: --host's); e.g. 127.0.0.1 keeps it to "
                        "a scraper on this machine while gRPC listens on 0.0.0.0")
    p.add_argument("--grace", type=float, default=d.grace_s,
                   help=f"seconds in-flight calls get to finish on SIGTERM (default {d.grace_s:g})")
    p.add_argument("--drain-delay", type=float, default=d.drain_delay_s, metavar="S",
                   help="on SIGTERM, report health NOT_SERVING and keep serving for S seconds before the drain, so "
                        "that a load balancer polling health stops routing here first (default "
                        f"{d.drain_delay_s:g}: drain at once); a second SIGTERM or SIGINT skips the rest")
    p.add_argument("--max-connection-age", type=float, default=d.max_connection_age_s, metavar="S",
                   help="seconds after which a client connection is closed gracefully (the client reconnects "
                        "without an error), so that an L4 load balancer spreads long-lived clients over replicas "
                        f"(default {d.max_connection_age_s:g}; 0: never)")


def _add_access_flags(a: argparse._ArgumentGroup) -> None:
    a.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS only (with --tls-key); SIGHUP "
                                                 "re-reads the TLS files for new connections (renewal)")
    a.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    a.add_argument("--tls-client-ca", type=Path,
                   help="PEM CA certificate(s): require client certificates signed by it (mutual TLS)")
    a.add_argument("--auth-token-file", type=Path,
                   help="bearer tokens, one a line (>= 16 characters): every RPC but health must send "
                        "`authorization: Bearer <token>`; SIGHUP re-reads the file")


def _problems(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """(holds, what to say when it does not) for each flag value a server could not serve with."""
    return [
        (0 <= args.port <= 65535, "--port must be in 0..65535"),
        (1 <= args.workers <= 64, "--workers must be in 1..64"),
        (args.metrics_port is None or 0 <= args.metrics_port <= 65535, "--metrics-port must be in 0..65535"),
        (not args.metrics_port or args.metrics_port + args.workers - 1 <= 65535,
         "--metrics-port M with --workers N needs M + N - 1 <= 65535 (workers take M, M+1, ...)"),
        (args.metrics_host is None or args.metrics_port is not None, "--metrics-host needs --metrics-port"),
        (not (args.port and args.metrics_port and args.metrics_port <= args.port < args.metrics_port + args.workers),
         f"--metrics-port {args.metrics_port} would take --port {args.port} (workers serve metrics on M, M+1, ...): "
         "give the metrics another port"),
        (1 <= args.threads <= MAX_THREADS, f"--threads must be in 1..{MAX_THREADS}"),
        (1 <= args.max_batch <= MAX_BATCH, f"--max-batch must be in 1..{MAX_BATCH} (the warm-up runs every padded "
                                           "batch size up to it)"),
        (0 <= args.max_delay_ms <= MAX_DELAY_MS, f"--max-delay-ms must be in 0..{MAX_DELAY_MS:g}"),
        (1 <= args.max_concurrent <= INT32_MAX, f"--max-concurrent must be in 1..{INT32_MAX}"),
        (1024 <= args.max_message_bytes <= INT32_MAX,
         f"--max-message-bytes must be in 1024..{INT32_MAX} (gRPC counts it in an int32)"),
        (0 <= args.grace <= MAX_GRACE_S, f"--grace must be in 0..{MAX_GRACE_S:g} seconds"),
        (0 <= args.drain_delay <= MAX_GRACE_S, f"--drain-delay must be in 0..{MAX_GRACE_S:g} seconds"),
        (args.device_id >= 0, "--device-id must be >= 0"),
        (args.max_connection_age == 0 or MIN_CONNECTION_AGE_S <= args.max_connection_age <= MAX_CONNECTION_AGE_S,
         f"--max-connection-age must be 0 (never) or {MIN_CONNECTION_AGE_S:g}..{MAX_CONNECTION_AGE_S} seconds"),
        ((args.tls_cert is None) == (args.tls_key is None), "--tls-cert and --tls-key go together"),
        (args.tls_client_ca is None or args.tls_cert is not None, "--tls-client-ca needs --tls-cert/--tls-key"),
    ]


def config_from_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> ServerConfig:
    for ok, message in _problems(args):
        if not ok:
            p.error(message)
    return ServerConfig(**{f.name: getattr(args, FLAG_DESTS.get(f.name, f.name))
                            for f in dataclasses.fields(ServerConfig)})


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard limit, as Go's runtime does: each client connection is
    a file, and at 1,024 a burst of idle connections would leave new callers and health checks hanging."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("open file limit stays at %d (raising it to %d failed: %s)", soft, target, exc)
            return
        log.info("open file limit raised from %d to %d", soft, target)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    configure_logging(args.log_level, args.log_format, args.worker_index)
    config = config_from_args(p, args)
    raise_open_file_limit()
    if args.workers > 1:
        return run_workers(config, args.workers, args.log_level, args.log_format)
    try:
        return run_server(config)
    except (ModelLoadError, ConfigError, OSError) as exc:
        fatal(str(exc), args.worker_index)  # a worker's says whose it is
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
