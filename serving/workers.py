"""`python -m serving --workers N`: N server processes sharing one port, each with its own interpreter.

One server process is bound by its interpreter lock: the event loop's per-call Python work
(proto to numpy, validation, the response) and the batch's feature code take turns on it,
so past about one core a busier machine adds nothing. With `--workers N` this process
starts N full servers (`--reuse-port`: SO_REUSEPORT on the same HOST:PORT, so the kernel
spreads new connections over them), one after the other so that a bad model or flag
stops the first with its one message. Each worker has its own ONNX Runtime session,
micro-batcher, health (SERVING once it has warmed up), and metrics port (--metrics-port M
gives workers M, M+1, ...; 0 lets each pick one).

This process prints `listening on HOST:PORT` once every worker listens, and one
`metrics on HOST:PORT` line per worker; it forwards SIGHUP (reload) and SIGTERM/SIGINT
(drain) to every worker, each in a process group of its own (a terminal's Ctrl-C, sent to
the foreground group, reaches a worker once, through this process), and exits 0 when all
drained cleanly. A worker that exits on its own stops the others; the status is that
worker's (an orchestrator restarts the set). Each worker's stdin is a pipe from this
process: if this process dies, even by SIGKILL, the pipe closes and the workers drain and
exit rather than keep the port.
"""

from __future__ import annotations

import errno
import logging
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from types import FrameType

from serving.logs import fatal
from serving.server import ServerConfig, bind_error, bind_problem, host_port, metrics_bind_error, probe_bind

log = logging.getLogger("serving")

START_TIMEOUT_S = 300.0  # a worker must print `listening on` within this (model load, session creation)


def server_args(config: ServerConfig, log_level: str, log_format: str = "text") -> list[str]:
    """The command line of one worker: every ServerConfig field as its flag (`--flag=value`, so that a
    value starting with '-' stays a value)."""
    values: list[tuple[str, object]] = [
        ("--model", config.model_path), ("--host", config.host), ("--port", config.port),
        ("--device", config.device), ("--device-id", config.device_id), ("--threads", config.threads),
        ("--max-batch", config.max_batch), ("--max-delay-ms", repr(config.max_delay_ms)),
        ("--batch-wait", config.batch_wait), ("--max-concurrent", config.max_concurrent),
        ("--max-message-bytes", config.max_message_bytes), ("--grace", repr(config.grace_s)),
        ("--drain-delay", repr(config.drain_delay_s)),
        ("--log-level", log_level), ("--log-format", log_format), ("--metrics-port", config.metrics_port),
        ("--metrics-host", config.metrics_host), ("--tls-cert", config.tls_cert),
        ("--tls-key", config.tls_key), ("--tls-client-ca", config.tls_client_ca),
        ("--auth-token-file", config.auth_token_file), ("--event-loop", config.event_loop),
        ("--max-connection-age", repr(config.max_connection_age_s)),
    ]
    args = [f"{flag}={value}" for flag, value in values if value is not None]
    args += [flag for flag, on in (("--reuse-port", config.reuse_port),
                                   ("--stop-on-stdin-eof", config.stop_on_stdin_eof)) if on]
    if config.busy_poll_ms:
        args.append(f"--busy-poll={config.busy_poll_ms!r}")  # inf: always
    return args


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Sockets bound with SO_REUSEPORT (not listening) to the addresses `host` resolves to, as gRPC binds
    them ("localhost": 127.0.0.1 and ::1 where the machine has IPv6): they pick the port when it is 0
    and hold it until the workers have bound. OSError when no address can be bound: one taken by any
    other socket, another `--workers` set's included (SO_REUSEPORT would let the two share the port,
    the kernel sending each set part of the connections)."""
    held: list[socket.socket] = []
    error: OSError | None = None
    for family, kind, proto, _name, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
        sock = None
        try:
            sock = socket.socket(family, kind, proto)  # (no IPv6 in this kernel: EAFNOSUPPORT)
            port = probe_bind(family, kind, proto, address, port)  # the first picks; the others take the same port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the TIME_WAITs of a server just gone
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((address[0], port, *address[2:]))
        except OSError as exc:
            if sock is not None:
                sock.close()
            error = exc
            continue
        held.append(sock)
    if not held and host == "::" and error is not None and error.errno == errno.EAFNOSUPPORT:
        return reserve_port("0.0.0.0", port)  # where gRPC listens for the IPv6 wildcard without IPv6
    if not held:
        raise error or OSError(f"{host} resolves to no address")
    return held


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)  # stdout lines; None at EOF
    stalled: bool = False  # it had not printed `listening on` by wait_listening's timeout

    def start_reader(self) -> None:
        """Drain the worker's stdout for good (a full pipe would block it); lines go to `lines`."""

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
            self.lines.put(None)

        threading.Thread(target=read, name=f"worker-{self.index}-stdout", daemon=True).start()

    def wait_listening(self, want_metrics: bool, timeout: float, stopping: threading.Event) -> tuple[str, str] | None:
        """(listening address, metrics address or "") once printed; None if the worker's output ended first (it
        exited), when `stopping` is set, or after `timeout` (then `stalled` is set)."""
        deadline = time.monotonic() + timeout
        listening = metrics = ""
        while not listening or (want_metrics and not metrics):
            if stopping.is_set():
                return None
            if time.monotonic() > deadline:
                self.stalled = True
                return None
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                return None
            if line.startswith("listening on "):
                listening = line.removeprefix("listening on ")
            elif line.startswith("metrics on "):
                metrics = line.removeprefix("metrics on ")
        return listening, metrics


def _stop(workers: list[Worker], sig: int = signal.SIGTERM) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(sig)


def run_workers(config: ServerConfig, n: int, log_level: str, log_format: str = "text") -> int:
    """Start n workers on one port, forward signals, return the exit status (see the module docstring)."""
    problem = bind_problem(config.host, config.port)  # named as a single server names it: the lookup, the address
    if problem is None:
        try:
            placeholders = reserve_port(config.host, config.port)
        except OSError as exc:
            problem = exc
    if problem is not None:
        fatal(bind_error(host_port(config.host, config.port), str(problem.strerror or problem)))
        return 2
    port = int(placeholders[0].getsockname()[1])
    if config.metrics_port is not None:  # every worker's, before the first loads the model (each checks its own)
        for i in range(n if config.metrics_port else 1):
            if problem := bind_problem(config.metrics_bind, config.metrics_port + i if config.metrics_port else 0):
                for sock in placeholders:
                    sock.close()
                fatal(metrics_bind_error(config, problem, worker=i))
                return 2
    workers: list[Worker] = []
    listening: set[int] = set()  # workers past start-up
    hup_pending: set[int] = set()  # workers that were starting when a SIGHUP came: they get it once they listen
    stopping = threading.Event()
    told_to_stop: set[int] = set()  # workers a stop signal was forwarded to: one more would skip --drain-delay

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum != signal.SIGHUP:
            stopping.set()
            told_to_stop.update(w.index for w in workers)
        else:  # a worker may have read the model file before it changed: it reloads once it listens
            hup_pending.update(w.index for w in workers if w.index not in listening)
        _stop([w for w in workers if signum != signal.SIGHUP or w.index in listening], signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    metrics: list[str] = []
    try:
        for i in range(n):
            mport = config.metrics_port + i if config.metrics_port else config.metrics_port
            worker_config = ServerConfig(**(asdict(config) | {"port": port, "reuse_port": True,
                                                              "metrics_port": mport, "stop_on_stdin_eof": True}))
            cmd = [sys.executable, "-m", "serving", *server_args(worker_config, log_level, log_format),
                   f"--worker-index={i}"]
            # stdin is the worker's lifeline: when this process dies, however it dies, the pipe closes. Each
            # worker has its own process group, so that a terminal's Ctrl-C or hang-up (sent to the foreground
            # group) reaches it once, forwarded by this process, not twice (a second SIGINT would cut short
            # --drain-delay, a second SIGHUP reload the model again)
            w = Worker(i, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           process_group=0))
            workers.append(w)
            w.start_reader()
            started = w.wait_listening(config.metrics_port is not None, START_TIMEOUT_S, stopping)
            if started is None:  # it failed to start (and said why), took too long, or we were told to stop
                stalled = w.stalled and not stopping.is_set()
                if stalled:
                    log.error("worker %d (pid %d) did not start listening within %g s (loading the model); "
                              "stopping the workers", i, w.proc.pid, START_TIMEOUT_S)
                _stop([other for other in workers if other.index not in told_to_stop])  # each stopped once
                for other in workers:
                    other.proc.wait()
                if stalled:
                    return 1
                return 0 if stopping.is_set() else exit_status(w.proc.returncode) or 1
            listening.add(i)
            log.info("worker %d (pid %d) listening on %s", i, w.proc.pid, started[0])
            if i in hup_pending:  # its own start-up kept it (serving.sighup) until its loop takes over
                hup_pending.discard(i)
                _stop([w], signal.SIGHUP)
            if started[1]:
                metrics.append(started[1])
    finally:
        for sock in placeholders:
            sock.close()
    print(f"listening on {host_port(config.host, port)}", flush=True)
    for address in metrics:
        print(f"metrics on {address}", flush=True)
    status = _supervise(workers, stopping)
    for w in workers:
        if w.proc.stdin is not None:
            w.proc.stdin.close()
    return status


def _supervise(workers: list[Worker], stopping: threading.Event) -> int:
    """Wait for the workers; one that exits unbidden stops the rest and gives the status."""
    first_failure: int | None = None
    while any(w.proc.poll() is None for w in workers):
        for w in workers:
            code = w.proc.poll()
            if code is not None and not stopping.is_set() and first_failure is None:
                log.error("worker %d (pid %d) exited with status %d; stopping the other workers", w.index,
                          w.proc.pid, exit_status(code))
                first_failure = exit_status(code) or 1
                stopping.set()
                _stop(workers)
        time.sleep(0.1)
    if first_failure is not None:
        return first_failure
    codes = [exit_status(w.proc.returncode) for w in workers]
    return next((c for c in codes if c != 0), 0)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode
