"""The gRPC server: build it, warm it up, reload on SIGHUP, drain on SIGTERM.

    build_server(config, model) -> ForecastServer   everything wired, nothing started
    serve(config) -> exit status                     load, start, run until SIGTERM/SIGINT

Order at start: read the TLS and token files (unusable ones stop here, exit 2), look whether
the ports are taken (one in use stops here), load and check the model (a bad model or an
unavailable --device cuda stops here too), bind and
start (health NOT_SERVING; Predict answers UNAVAILABLE), print `listening on HOST:PORT`,
warm up at every padded batch size, then health SERVING.

Access (serving.security): TLS with --tls-cert/--tls-key, client certificates required and
verified with --tls-client-ca; with --auth-token-file every RPC but the health service needs
`authorization: Bearer <token>`. Every service answers a request that does not parse with
INVALID_ARGUMENT (MessageGuard). Interceptors run in that order, after UnknownMethods (which
counts calls to methods no service has): the token is checked before a request's bytes are
decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from features.model_meta import ModelMeta
from serving import sighup
from serving.batcher import MicroBatcher
from serving.errors import ConfigError, ModelLoadError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.inference import run_batch
from serving.metrics import Metrics
from serving.model import LoadedModel, ModelHolder, WarmUpStopped, load_and_warm, load_model
from serving.native_log import native_stderr
from serving.reflection import enable_server_reflection
from serving.security import MessageGuard, ReloadableTls, TokenAuth, UnknownMethods, is_loopback, read_tokens
from serving.servicer import Batcher, ForecasterServicer, Limits, model_info

log = logging.getLogger("serving")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Forecaster"].full_name  # foxhunt.tft.v1.Forecaster
MiB = 1 << 20
INT32_MAX = 2**31 - 1  # gRPC's channel arguments are C ints
DRAIN_POLL_S = 0.005  # how often a SIGTERM drain looks whether the in-flight calls have finished
DRAIN_SETTLE_S = 0.1  # the least time a SIGTERM drain lets the calls on their way at the signal arrive
CLIENT_PING_MIN_MS = 1000  # the shortest keepalive interval accepted from clients
CONNECTION_AGE_GRACE_S = 30.0  # calls in flight on a connection past its --max-connection-age get the age and this


def bind_failure_reason(line: str) -> str:
    """Why gRPC could not add a port, from its log line ('' for any other line): the first bind error
    ('Address already in use'), or what it says instead ('address lookup failed for HOST:PORT: ...')."""
    head, _, text = line.partition("Failed to add port to server: ")
    if not head or not text:
        return ""
    if m := re.search(r"Error in bind for address '[^']*': (.*?)(?=Error in bind|\)|$)", text):
        return m.group(1).strip()
    return text.strip()


def bind_problem(host: str, port: int) -> OSError | None:
    """Why `port` on `host` cannot be bound, found before the model loads (which can take minutes on a large
    model and a GPU) rather than after it: the name does not resolve, or every address the system resolver
    gives for it refuses the port (another process holds it; an address this machine lacks). None when one of
    them takes it, as gRPC starts on whichever it can bind; a port taken later is left to the bind itself.
    (gRPC resolves `localhost` itself, to 127.0.0.1 and ::1: where the resolver gives 127.0.0.1 alone and
    another process holds it, this refuses a server that would have listened on ::1 only.)"""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return OSError(exc.errno, f"address lookup failed: {exc.strerror or exc}")
    failures: list[OSError] = []
    for family, kind, proto, _name, address in addresses:
        try:
            probe_bind(family, kind, proto, address, port)
        except OSError as exc:
            failures.append(exc)
        else:
            return None
    if host == "::" and all(f.errno == errno.EAFNOSUPPORT for f in failures):
        return None  # a kernel without IPv6: gRPC listens on 0.0.0.0 for the IPv6 wildcard
    return next((f for f in failures if f.errno == errno.EADDRINUSE), failures[0]) if failures else None


def probe_bind(family: int, kind: int, proto: int, address: tuple[Any, ...], port: int) -> int:
    """Bind a throwaway socket to `address` (from getaddrinfo) at `port` as gRPC binds a server's, and close it:
    SO_REUSEADDR (a server just gone leaves TIME_WAITs, which are no obstacle) and no SO_REUSEPORT (so it fails
    on a port anyone holds). The port bound: the one the system picked when `port` is 0. OSError if it fails."""
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((address[0], port, *address[2:]))
        return int(probe.getsockname()[1])


def bind_error(address: str, reason: str) -> str:
    return f"cannot bind {address}: {reason}{bind_advice(reason)}"


def metrics_bind_error(config: ServerConfig, exc: OSError, worker: int = 0) -> str:
    """Why the metrics endpoint cannot serve, naming the flag; `worker` i > 0 of a --workers set has port M + i."""
    fix = "pick a free port (0 picks one)" if exc.errno == errno.EADDRINUSE else \
        "give --metrics-host (default: --host) an address of this machine, or pick another port"
    port = config.metrics_port + worker if config.metrics_port else 0
    whose = f" gives worker {worker} port {port}" if worker else ""
    return (f"--metrics-port {config.metrics_port}{whose}: cannot serve metrics on "
            f"{host_port(config.metrics_bind, port)}: {exc.strerror or exc}; {fix}")


def bind_advice(reason: str) -> str:
    """What to do about a port that could not be bound, after its reason ('' when there is nothing to add)."""
    if "in use" in reason:
        return "; another process holds it: stop that one, or pass another --port (--port 0 picks a free one)"
    if "lookup failed" in reason or "assign requested address" in reason:
        return ("; give --host an address or name of this machine (0.0.0.0 or :: for every interface, "
                "127.0.0.1 for this machine alone)")
    return ""


@dataclass(frozen=True)
class ServerConfig:
    """Everything `python -m serving` takes; one comment per field."""

    model_path: Path  # the ONNX model (re-read on SIGHUP)
    host: str = "127.0.0.1"  # interface to bind; loopback unless told otherwise
    port: int = 50051  # 0 picks a free port (printed as `listening on HOST:PORT`)
    reuse_port: bool = False  # SO_REUSEPORT: share the port with sibling server processes (--workers)
    stop_on_stdin_eof: bool = False  # drain when stdin closes: a --workers worker's tie to its supervisor
    device: str = "auto"  # auto | cpu | cuda
    device_id: int = 0  # CUDA device ordinal
    threads: int = 1  # ONNX Runtime intra-op threads
    max_batch: int = 64  # windows per ONNX Runtime run
    max_delay_ms: float = 2.0  # longest a call waits for others to join its batch
    batch_wait: str = "adaptive"  # adaptive: close a batch when no other call is ready; fixed: wait the delay
    max_concurrent: int = 256  # Predict calls and stream requests in flight; beyond: RESOURCE_EXHAUSTED
    max_message_bytes: int = 4 * MiB  # request and response size limit (gRPC's own default is 4 MiB too)
    metrics_port: int | None = None  # Prometheus /metrics port; None: off, 0: pick a free one
    metrics_host: str | None = None  # interface the /metrics endpoint binds; None: the gRPC host's
    grace_s: float = 10.0  # SIGTERM: time in-flight calls get to finish
    drain_delay_s: float = 0.0  # SIGTERM: health NOT_SERVING this long before the drain, calls still served
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key: serve TLS only
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA: clients must present a certificate it signed (mutual TLS)
    auth_token_file: Path | None = None  # bearer tokens, one a line; every RPC but health needs one
    event_loop: str = "uvloop"  # uvloop | asyncio: the event loop the server runs on (see run_server)
    busy_poll_ms: float = 0.0  # keep the event loop polling this long after each call (inf: always; 0: off)
    max_connection_age_s: float = 1800.0  # close a connection (gracefully) after this long; 0: never

    @property
    def max_delay_s(self) -> float:
        return self.max_delay_ms / 1000.0

    @property
    def metrics_bind(self) -> str:
        """The interface /metrics binds: --metrics-host, else --host."""
        return self.host if self.metrics_host is None else self.metrics_host


def connection_age_options(age_s: float) -> list[tuple[str, int]]:
    """gRPC's connection age (gRFC A9): after about `age_s` (gRPC adds ±10% jitter) a connection is told to go
    away, its calls in flight get CONNECTION_AGE_GRACE_S to finish, and the client reconnects on its next
    call without an error. Behind an L4 balancer (a Kubernetes Service, SO_REUSEPORT across --workers) that
    is what spreads long-lived clients over new replicas, and it bounds what any one connection can hold.

    The grace is the age longer still: a PredictStream ends itself, gracefully, once it is about `age_s` old
    (ForecasterServicer.PredictStream), which a stream opened before the connection was told to go away
    reaches within that grace; so no stream is cut with requests in flight."""
    if not age_s:
        return []
    return [("grpc.max_connection_age_ms", math.ceil(age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", min(math.ceil((age_s + CONNECTION_AGE_GRACE_S) * 1000), INT32_MAX))]


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Access:
    """What --tls-* and --auth-token-file hold, read and checked."""

    credentials: grpc.ServerCredentials | None  # None: plaintext
    tokens: tuple[str, ...]  # empty: no token check
    tls: ReloadableTls | None = None  # what SIGHUP re-reads the TLS files with


def read_access(config: ServerConfig) -> Access:
    """Read the TLS and token files; ConfigError names the flag and what is wrong (never a token)."""
    tls = (ReloadableTls(config.tls_cert, config.tls_key, config.tls_client_ca)
           if config.tls_cert is not None and config.tls_key is not None else None)
    tokens = tuple(read_tokens(config.auth_token_file)) if config.auth_token_file is not None else ()
    return Access(tls.credentials if tls else None, tokens, tls)


class DrainingHealth(health.aio.HealthServicer):  # type: ignore[name-defined]  # grpc-stubs lacks health.aio
    """The standard health service, whose Watch streams end (UNAVAILABLE) once a drain has told them
    NOT_SERVING: a Watch never ends by itself, and gRPC's shutdown would wait the whole grace for it."""

    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext[Any, Any]) -> None:
        watch = asyncio.ensure_future(super().Watch(request, context))
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({watch, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # a caller that went away cancels this task: both go with it
            ended.cancel()
            if not watch.done():
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
        if not watch.cancelled():
            watch.result()  # its own end (an error) as it was
            return
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; watch another replica")

    def end_watches(self) -> None:
        self._ended.set()


class ForecastServer:
    """The gRPC server with its model holder, batcher, health, reflection and metrics."""

    def __init__(self, config: ServerConfig, model: LoadedModel, metrics: Metrics | None = None,
                 access: Access | None = None) -> None:
        self.config = config
        access = access or read_access(config)
        self.metrics = metrics or Metrics(tokens=bool(access.tokens))
        self.holder = ModelHolder(model)
        self.stopping = threading.Event()  # SIGTERM: a warm-up running in a thread ends between two runs
        self.delay_cut = asyncio.Event()  # a second SIGTERM or SIGINT: the rest of --drain-delay is skipped
        process = functools.partial(run_batch, steps=self.metrics.steps)  # features and run timed per batch
        self.batcher: Batcher = MicroBatcher(process, config.max_batch, config.max_delay_s, config.batch_wait,
                                             self.metrics, busy_poll_s=config.busy_poll_ms / 1000.0)
        limits = Limits(config.max_batch, config.max_message_bytes, config.max_concurrent)
        self.servicer = ForecasterServicer(self.holder, self.batcher, self.metrics, limits,
                                           stream_max_age_s=config.max_connection_age_s)
        self.health = DrainingHealth()
        self.credentials = access.credentials
        self.tls = access.tls
        self.auth = TokenAuth(access.tokens, count=self.metrics.count) if access.tokens else None
        interceptors = [i for i in (UnknownMethods(self.metrics.count), self.auth, MessageGuard(self.metrics.count))
                        if i is not None]
        self.grpc = aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", int(config.reuse_port)),  # unless asked, a port in use is an error, not a share
            ("grpc.keepalive_time_ms", 60_000),  # ping idle connections; a dead peer's calls end
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.max_pings_without_data", 0),  # ... however long a connection stays idle
            # Clients' keepalive pings are welcome every CLIENT_PING_MIN_MS or slower, calls in flight or not: by
            # gRPC's default a ping with no call in flight is abuse, and the third closes the connection
            # (GOAWAY too_many_pings), which a strategy calling once a bar with keepalive on would meet each time.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MIN_MS),
            # A stream whose client never reads its answer holds that answer's memory after its call ended (it no
            # longer counts against --max-concurrent): a bound per connection, far above --max-concurrent, since
            # a client may open a stream the moment it has an answer, before the server has released it, and a
            # stream refused for that fails as UNAVAILABLE where the call should get RESOURCE_EXHAUSTED.
            ("grpc.max_concurrent_streams", min(max(4 * config.max_concurrent, config.max_concurrent + 1024),
                                                INT32_MAX)),
            *connection_age_options(config.max_connection_age_s),
        ])
        pb_grpc.add_ForecasterServicer_to_server(self.servicer, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), self.grpc)
        self.port = 0
        self._reloading = False
        self._reload_again = False
        self.metrics.set_model(model)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING until warm_up); returns the bound port."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = host_port(self.config.host, self.config.port)
        failed = False
        # gRPC logs why a bind failed on its own stderr line, and raises only "Failed to bind": the reason goes
        # into the one error message, and that line is dropped (everything is echoed as it came otherwise)
        with native_stderr(echo=lambda line: not (failed and bind_failure_reason(line))) as native:
            try:
                if self.credentials is not None:
                    self.port = self.grpc.add_secure_port(address, self.credentials)
                else:
                    self.port = self.grpc.add_insecure_port(address)
            except RuntimeError as exc:
                failed, error = True, str(exc)
            else:
                failed, error = self.port == 0, ""
        if failed:
            reason = next((r for line in native if (r := bind_failure_reason(line))), "")
            why = reason or error or "no address could be added"
            raise OSError(bind_error(address, why))
        self.batcher.start()
        await self.grpc.start()
        return self.port

    async def warm_up(self) -> None:
        """Run the model at every padded batch size, then report SERVING."""
        model = self.holder.current
        with self.batcher.spin_paused():  # --busy-poll: the warm-up thread needs the interpreter lock
            seconds = await asyncio.get_running_loop().run_in_executor(None, model.warm_up, self.stopping)
        self.servicer.ready = True
        self.metrics.ready.set(1)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("warmed up at batch sizes %s in %.3f s; health SERVING", list(model.buckets), seconds)

    def reload_tls(self) -> None:
        """SIGHUP: re-read the TLS files for new connections (certificate renewal); unusable ones are refused."""
        if self.tls is not None:
            self.metrics.reloads.labels("tls", "ok" if self.tls.reload() else "refused").inc()

    def reload_tokens(self) -> None:
        """SIGHUP: re-read --auth-token-file (token rotation); an unusable file keeps the current tokens."""
        if self.auth is None or self.config.auth_token_file is None:
            return
        try:
            tokens = read_tokens(self.config.auth_token_file)
        except ConfigError as exc:
            self.metrics.reloads.labels("tokens", "refused").inc()
            log.error("token reload refused, the current tokens stay: %s", exc)
            return
        self.auth.set_tokens(tokens)
        self.metrics.reloads.labels("tokens", "ok").inc()
        log.info("token file re-read: %d token(s) accepted", len(tokens))

    async def reload(self) -> None:
        """SIGHUP: load, check and warm the model file, then swap it in; a bad file is refused."""
        if self._reloading:
            self._reload_again = True  # one more pass after the current one, to read the latest file
            return
        self._reloading = True
        try:
            while True:
                self._reload_again = False
                await self._reload_once()
                if not self._reload_again:
                    return
        finally:
            self._reloading = False

    async def _reload_once(self) -> None:
        c, old = self.config, self.holder.current
        log.info("SIGHUP: reloading %s", c.model_path)
        try:
            with self.batcher.spin_paused():  # --busy-poll: the loading thread needs the interpreter lock
                new = await asyncio.to_thread(load_and_warm, c.model_path, c.device, c.threads, c.max_batch,
                                              c.device_id, self.stopping)
        except WarmUpStopped:
            log.info("reload stopped by SIGTERM; the drain goes on with model %s", old.version)
            return
        except ModelLoadError as exc:
            self.metrics.reloads.labels("model", "refused").inc()
            log.error("reload refused, still serving model %s: %s", old.version, exc)
            return
        except Exception:  # an unexpected failure must not take the server down either
            self.metrics.reloads.labels("model", "refused").inc()
            log.exception("reload refused, still serving model %s", old.version)
            return
        if problem := message_limit_problem(new, c):
            self.metrics.reloads.labels("model", "refused").inc()
            log.error("reload refused, still serving model %s: %s", old.version, problem)
            return
        self.holder.swap(new)
        self.metrics.set_model(new)
        self.metrics.reloads.labels("model", "ok").inc()
        log.info("reloaded: serving model %s (sha256 %s, provider %s); was %s (sha256 %s)", new.version,
                 new.sha256[:12], new.provider, old.version, old.sha256[:12])
        if changed := contract_changes(old.meta, new.meta):  # what callers build requests from (GetModelInfo)
            log.warning("the reloaded model asks callers for something else: %s", "; ".join(changed))

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish within grace_s, stop the batcher.

        gRPC's own shutdown starts once the in-flight Predict calls have finished and the open PredictStreams
        (told to stop reading DRAIN_SETTLE_S after the signal) have ended, and DRAIN_SETTLE_S after
        the signal at the earliest (grace_s at the latest): until then gRPC keeps handing the calls it
        receives to the handler, which refuses them with UNAVAILABLE (retriable), the calls on their way at
        the signal included. Calls gRPC holds unhanded when it shuts down are cancelled instead (CANCELLED,
        grpc/grpc#41785); this leaves only calls that arrive in the last instant.
        """
        self.stopping.set()
        if self.config.drain_delay_s > 0 and self.servicer.ready:  # a balancer polling health sees NOT_SERVING
            # while calls still work (not for a server that never reported SERVING: nothing routes to it)
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            log.info("health NOT_SERVING; serving on for --drain-delay %g s, then draining", self.config.drain_delay_s)
            began = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.delay_cut.wait(), self.config.drain_delay_s)
            if self.delay_cut.is_set():
                log.info("a second stop signal: the rest of --drain-delay skipped after %.1f s, draining",
                         time.monotonic() - began)
        self.servicer.ready = False
        self.servicer.draining = True
        self.metrics.ready.set(0)
        await self.health.enter_graceful_shutdown()
        started = time.monotonic()
        settle = min(DRAIN_SETTLE_S, grace_s)
        while time.monotonic() - started < settle:
            await asyncio.sleep(DRAIN_POLL_S)
        # open PredictStreams stop reading: each answers the requests it has read, then ends UNAVAILABLE
        # (reconnect), rather than feeding the drain requests until the grace runs out and being cancelled
        self.servicer.end_streams()
        while time.monotonic() - started < grace_s and (self.servicer.admission.active or self.servicer.open_streams):
            await asyncio.sleep(DRAIN_POLL_S)
        self.health.end_watches()  # they never end by themselves, and would hold gRPC's shutdown for the grace
        await self.grpc.stop(max(0.0, grace_s - (time.monotonic() - started)))
        if self.auth is not None:  # the refusals held back for their minute's line, now that no call comes
            self.auth.refusals.flush()
        await self.batcher.close()
        log.info("drained in %.3f s", time.monotonic() - started)


def contract_changes(old: ModelMeta, new: ModelMeta) -> list[str]:
    """What a reload changed of what callers send and get (GetModelInfo's fields), as `name old -> new`."""
    def facts(m: ModelMeta) -> dict[str, Any]:
        return {"bars required": m.bars_required, "bar interval (ns)": m.bar_interval_ns, "horizon": m.horizon,
                "quantiles": list(m.quantiles), "symbols": list(m.symbols),
                "user feature columns": m.feature_schema.user_columns, "explain": m.explain,
                "bar columns": m.column_map, "calendar time zone": m.feature_config.calendar_tz}

    was, now = facts(old), facts(new)
    return [f"{k} {was[k]} -> {now[k]}" for k in was if was[k] != now[k]]


def build_server(config: ServerConfig, model: LoadedModel, access: Access | None = None) -> ForecastServer:
    """Everything wired, nothing bound. Without `access`, reads the TLS and token files (ConfigError)."""
    return ForecastServer(config, model, access=access)


def busy_poll_text(ms: float) -> str:
    """How the start-up log line names --busy-poll."""
    if not ms:
        return ""
    return ", busy poll" if ms == math.inf else f", busy poll for {ms:g} ms after each call"


def access_summary(config: ServerConfig) -> str:
    """One log line on who can reach the server; warns where secrets or data travel in clear text."""
    tls = ("mutual TLS (client certificates required)" if config.tls_client_ca else "TLS") \
        if config.tls_cert else "plaintext"
    auth = "bearer token on every RPC but health" if config.auth_token_file else "no authentication"
    if not is_loopback(config.host):
        if config.tls_cert is None and config.auth_token_file is not None:
            log.warning("--host %s without TLS: bearer tokens cross the network in clear text; add "
                        "--tls-cert/--tls-key", config.host)
        elif config.tls_cert is None:
            log.warning("--host %s without TLS or a token: anyone who can reach the port can call it", config.host)
    return f"{tls}, {auth}"


def _drain_at_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Block on stdin until EOF, then drain: a --workers supervisor holds the other end of the pipe, so
    its death (even by SIGKILL) ends its workers instead of leaving them serving on its port."""
    fd = sys.stdin.fileno()
    while os.read(fd, 4096):  # the raw descriptor: a daemon thread blocked in sys.stdin's buffered reader
        pass  # would hold its lock and abort the interpreter's shutdown
    log.warning("stdin closed: the --workers supervisor is gone; draining")
    with contextlib.suppress(RuntimeError):  # the loop already finished: the server is exiting anyway
        loop.call_soon_threadsafe(stop.set)


EVENT_LOOPS = ("uvloop", "asyncio")


def run_server(config: ServerConfig) -> int:
    """`serve(config)` on the configured event loop, to the end; its exit status.

    uvloop (libuv under the asyncio API) is the default: gRPC's asyncio stack hands every call
    through the event loop several times, and uvloop spends less interpreter time on each hand-over
    (BENCHMARKS.md measures what that buys). `asyncio` is the standard library's own loop.
    ConfigError when uvloop is asked for but not installed: no quiet change of loop.
    """
    if config.event_loop == "asyncio":
        return asyncio.run(serve(config))
    if config.event_loop != "uvloop":
        raise ConfigError(f"--event-loop {config.event_loop!r} is not one of {', '.join(EVENT_LOOPS)}")
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(f"--event-loop uvloop (the default) needs the uvloop package, which does not import here "
                          f"({exc}); install it (pip install uvloop, a dependency of this project) or pass "
                          "--event-loop asyncio") from None
    return uvloop.run(serve(config))


def one_series_request_bytes(meta: ModelMeta) -> int:
    """The size on the wire of the smallest useful Predict: one series of the longest symbol, the bars the
    model needs (timestamps of this era: 9-byte varints) and its user columns."""
    n = meta.bars_required
    columns = [pb.Column(name=name, values=[1.0] * n) for name in meta.feature_schema.user_columns]
    series = pb.Series(symbol=max(meta.symbols, key=len), timestamp_ns=[2**62] * n, open=[1.0] * n, high=[1.0] * n,
                       low=[1.0] * n, close=[1.0] * n, volume=[1.0] * n, user_features=columns)
    return pb.PredictRequest(series=[series]).ByteSize()


def message_limit_problem(model: LoadedModel, config: ServerConfig) -> str | None:
    """Why --max-message-bytes leaves this model unusable, if it does: a server that would report SERVING and
    then refuse every Predict (or fail every GetModelInfo) is refused at start, and such a model on SIGHUP."""
    limit = config.max_message_bytes
    request = one_series_request_bytes(model.meta)
    info = model_info(model, Limits(config.max_batch, limit, config.max_concurrent)).ByteSize()
    if max(request, info) <= limit:
        return None
    what = (f"a request of one series ({model.meta.bars_required} bars) takes {request} bytes, so every Predict "
            "would be refused" if request > limit else
            f"GetModelInfo's answer for this model takes {info} bytes, so every caller's first call would fail")
    return f"--max-message-bytes {limit}: {what}; give at least {max(request, info)} (the default is 4 MiB)"


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; 0 after a clean drain. ModelLoadError, ConfigError and OSError propagate."""
    sighup.hold()  # until the loop's handler: a SIGHUP now is recorded (python -m serving held it from its start)
    sighup.forget()  # the token and model files are read below: a reload asked for before then is served by that
    access = read_access(config)  # unusable TLS or token files stop the start before the model loads
    # a port in use or an address not this machine's is named now, not after the model's load (a --workers
    # worker's port is held for it by the supervisor, which has checked it)
    if not config.reuse_port and (problem := bind_problem(config.host, config.port)):
        raise OSError(bind_error(host_port(config.host, config.port), problem.strerror or str(problem)))
    if config.metrics_port is not None and (problem := bind_problem(config.metrics_bind, config.metrics_port)):
        raise OSError(metrics_bind_error(config, problem))
    model = await asyncio.to_thread(load_model, config.model_path, config.device, config.threads,
                                    config.max_batch, config.device_id)
    log.info("model %s (sha256 %s) from %s: provider %s, bars_required %d, horizon %d, quantiles %s, symbols %s",
             model.version, model.sha256[:12], model.path, model.provider, model.meta.bars_required,
             model.meta.horizon, list(model.meta.quantiles), ",".join(model.meta.symbols))
    if too_small := message_limit_problem(model, config):
        raise ConfigError(too_small)
    server = build_server(config, model, access)
    log.info("access: %s", access_summary(config))
    # a stop signal is taken from here on, before `listening on` is printed: one that a --workers supervisor
    # forwards the moment it reads that line is a drain, not the default action's death
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []  # which signal stopped it, for the log

    def on_stop(sig: signal.Signals) -> None:
        received.append(sig.name)
        if not stop.is_set():
            stop.set()
            return
        server.delay_cut.set()  # an operator who signals again wants the stop now, not after the delay
        log.info("%s while stopping", sig.name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig)
    mport = None
    if config.metrics_port is not None:  # before the gRPC port: "listening on" means the whole server is up
        try:
            mport = server.metrics.serve_http(config.metrics_bind, config.metrics_port)
        except OSError as exc:
            raise OSError(metrics_bind_error(config, exc)) from None
    try:
        port = await server.start()
    except BaseException:
        server.metrics.stop_http()  # for a caller that goes on (the command itself exits)
        raise
    print(f"listening on {host_port(config.host, port)}", flush=True)
    log.info("listening on %s, pid %d (max message %d bytes, max batch %d, max delay %g ms, %s wait, max concurrent "
             "%d, %d thread(s), grace %g s, drain delay %g s, connection age %s, %s event loop%s)",
             host_port(config.host, port), os.getpid(), config.max_message_bytes, config.max_batch,
             config.max_delay_ms, config.batch_wait, config.max_concurrent, config.threads, config.grace_s,
             config.drain_delay_s, f"{config.max_connection_age_s:g} s" if config.max_connection_age_s else "unlimited",
             config.event_loop, busy_poll_text(config.busy_poll_ms))
    if mport is not None:
        print(f"metrics on {host_port(config.metrics_bind, mport)}", flush=True)
        log.info("metrics on http://%s/metrics", host_port(config.metrics_bind, mport))

    reloads: set[asyncio.Task[None]] = set()

    def on_hup() -> None:
        if server.stopping.is_set():  # draining: a model load cannot be interrupted, and would hold the exit
            log.info("SIGHUP while draining: ignored")
            return
        server.reload_tls()
        server.reload_tokens()
        task = loop.create_task(server.reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    hup_while_starting = sighup.arrived()  # after the files were read, before the handler above
    if config.stop_on_stdin_eof:
        threading.Thread(target=_drain_at_stdin_eof, args=(loop, stop), name="supervisor-lifeline",
                         daemon=True).start()

    warm = loop.create_task(server.warm_up())
    if hup_while_starting:
        log.info("SIGHUP while starting, after the model file was read: reloading it once warm")
        warm.add_done_callback(lambda t: on_hup() if not t.cancelled() and t.exception() is None else None)
    stopping = loop.create_task(stop.wait())
    done, _ = await asyncio.wait({warm, stopping}, return_when=asyncio.FIRST_COMPLETED)
    failure = warm.exception() if warm in done else None
    if failure is not None:  # the model loaded but cannot run: stop, exit 2
        stopping.cancel()
        await server.stop(0)
        raise failure
    await stopping
    log.info("%s: draining (grace %g s)", received[0] if received else "stdin closed", config.grace_s)
    server.stopping.set()  # a warm-up or reload in its thread ends between two runs, not after all of them
    for task in (warm, *reloads):
        task.cancel()
    await server.stop(config.grace_s)
    return 0
