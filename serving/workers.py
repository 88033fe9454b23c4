"""`python -m serving --workers N`: N server processes sharing one port (SO_REUSEPORT), started one after the other so
that a bad model or flag stops the first with its own message. This process prints `listening on` once all listen,
forwards SIGHUP, SIGTERM and SIGINT, and exits 0 when all drained; a worker that exits on its own stops the others. Each
worker's stdin is a pipe from here: if this process dies, the workers drain and exit.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

from serving.logs import fatal
from serving.server import FLAG_DESTS, ServerConfig, bind_error, host_port

log = logging.getLogger("serving")

START_TIMEOUT_S = 300.0  # a worker must print `listening on` within this (model load, session creation)


def server_args(config: ServerConfig, log_level: str, log_format: str = "text") -> list[str]:
    """A worker's command line: each field as `--flag=value` (a value starting with '-' stays a value)."""
    args = [f"--log-level={log_level}", f"--log-format={log_format}"]
    for f in dataclasses.fields(config):
        flag, value = "--" + "-".join(FLAG_DESTS.get(f.name, f.name).split("_")), getattr(config, f.name)
        if isinstance(value, bool):
            args += [flag] if value else []
        elif value is not None:
            args.append(f"{flag}={value}")
    return args


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT (not listening) that picks the port when `port` is 0 and holds it while
    the workers bind. OSError when anyone holds the port: a probe binds it first without SO_REUSEPORT."""
    family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a server just gone leaves TIME_WAITs
        probe.bind(address)
        port = probe.getsockname()[1]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((address[0], port, *address[2:]))  # after the probe, fails only in a race; the command then exits
    return sock


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


class Supervisor:
    """The worker processes, and the signals this process forwards to them."""

    def __init__(self, config: ServerConfig, log_level: str, log_format: str) -> None:
        self.config, self.log_level, self.log_format = config, log_level, log_format
        self.workers: list[Worker] = []
        self.listening: set[int] = set()  # workers past start-up
        self.hup_pending: set[int] = set()  # starting when a SIGHUP came: they get it once they listen
        self.stopping = threading.Event()
        self.told_to_stop: set[int] = set()  # forwarded a stop signal: one more would skip --drain-delay
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.forward)

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        if signum != signal.SIGHUP:
            self.stopping.set()
            self.told_to_stop.update(w.index for w in self.workers)
            _stop(self.workers, signum)
            return
        self.hup_pending.update(w.index for w in self.workers if w.index not in self.listening)
        _stop([w for w in self.workers if w.index in self.listening], signum)

    def start(self, n: int) -> list[str] | int:
        """Start the workers one after the other: their metrics addresses, or the exit status when one did not."""
        metrics: list[str] = []
        for i in range(n):
            w = self._spawn(i)
            started = w.wait_listening(self.config.metrics_port is not None, START_TIMEOUT_S, self.stopping)
            if started is None:
                return self._abort(w)
            self.listening.add(i)
            log.info("worker %d (pid %d) listening on %s", i, w.proc.pid, started[0])
            if i in self.hup_pending:  # it may have read the model file before it changed
                self.hup_pending.discard(i)
                _stop([w], signal.SIGHUP)
            if started[1]:
                metrics.append(started[1])
        return metrics

    def _spawn(self, i: int) -> Worker:
        c = self.config
        worker_config = dataclasses.replace(c, reuse_port=True, stop_on_stdin_eof=True,
                                            metrics_port=c.metrics_port + i if c.metrics_port else c.metrics_port)
        cmd = [sys.executable, "-m", "serving", *server_args(worker_config, self.log_level, self.log_format),
               f"--worker-index={i}"]
        # stdin is the worker's lifeline; its own process group: a terminal's Ctrl-C reaches it once, from here
        w = Worker(i, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       process_group=0))
        self.workers.append(w)
        w.start_reader()
        return w

    def _abort(self, w: Worker) -> int:
        stalled = w.stalled and not self.stopping.is_set()
        if stalled:
            log.error("worker %d (pid %d) did not start listening within %g s (loading the model); stopping the "
                      "workers", w.index, w.proc.pid, START_TIMEOUT_S)
        _stop([other for other in self.workers if other.index not in self.told_to_stop])  # each stopped once
        for other in self.workers:
            other.proc.wait()
        return 1 if stalled else 0 if self.stopping.is_set() else exit_status(w.proc.returncode) or 1

    def supervise(self) -> int:
        """Wait for the workers; one that exits unbidden stops the rest and gives the status."""
        first_failure: int | None = None
        while any(w.proc.poll() is None for w in self.workers):
            for w in self.workers:
                code = w.proc.poll()
                if code is not None and not self.stopping.is_set() and first_failure is None:
                    log.error("worker %d (pid %d) exited with status %d; stopping the other workers", w.index,
                              w.proc.pid, exit_status(code))
                    first_failure = exit_status(code) or 1
                    self.stopping.set()
                    _stop(self.workers)
            time.sleep(0.1)
        for w in self.workers:
            if w.proc.stdin is not None:
                w.proc.stdin.close()
        return first_failure or next((c for c in (exit_status(w.proc.returncode) for w in self.workers) if c != 0), 0)


def run_workers(config: ServerConfig, n: int, log_level: str, log_format: str = "text") -> int:
    """Start n workers on one port, forward signals, return the exit status."""
    try:
        placeholder = reserve_port(config.host, config.port)
    except OSError as exc:
        fatal(bind_error(f"cannot listen on {host_port(config.host, config.port)}", exc.strerror or str(exc)))
        return 2
    port = int(placeholder.getsockname()[1])
    supervisor = Supervisor(dataclasses.replace(config, port=port), log_level, log_format)
    with placeholder:
        started = supervisor.start(n)
    if isinstance(started, int):
        return started
    print(f"listening on {host_port(config.host, port)}", flush=True)
    for address in started:
        print(f"metrics on {address}", flush=True)
    return supervisor.supervise()


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode
