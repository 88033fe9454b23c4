"""The gRPC server: build it, warm it up, reload on SIGHUP, drain on SIGTERM; `serve` does each in turn."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
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
from serving.batcher import MicroBatcher
from serving.errors import ConfigError, ModelLoadError
from serving.inference import run_batch
from serving.memory import return_large_buffers
from serving.metrics import Metrics
from serving.model import LoadedModel, WarmUpStopped, load_and_warm, load_model
from serving.reflection import enable_server_reflection
from serving.security import ReloadableTls, TokenAuth, UnknownMethods, is_loopback, one_line_decode_errors, read_tokens
from serving.servicer import SERVICE, Batcher, ForecasterServicer, Limits, add_to_server

log = logging.getLogger("serving")

MiB = 1 << 20
INT32_MAX = 2**31 - 1  # gRPC's channel arguments are C ints
DRAIN_POLL_S = 0.005  # how often a SIGTERM drain looks whether the in-flight calls have finished
DRAIN_SETTLE_S = 0.1  # the least time a SIGTERM drain lets the calls on their way at the signal arrive
CLIENT_PING_MIN_MS = 1000  # the shortest keepalive interval accepted from clients
CONNECTION_AGE_GRACE_S = 30.0  # calls in flight on a connection past its --max-connection-age get the age and this


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
    max_connection_age_s: float = 1800.0  # close a connection (gracefully) after this long; 0: never

    @property
    def metrics_bind(self) -> str:
        return self.host if self.metrics_host is None else self.metrics_host


# ServerConfig fields whose flag is named otherwise (--model, --grace, ...): every other field's flag is its name
FLAG_DESTS = {"model_path": "model", "grace_s": "grace", "drain_delay_s": "drain_delay",
              "max_connection_age_s": "max_connection_age"}


def connection_age_options(age_s: float) -> list[tuple[str, int]]:
    """gRPC's connection age (gRFC A9): a connection goes away after about `age_s`, its calls get
    CONNECTION_AGE_GRACE_S more, and the client reconnects: an L4 balancer then spreads clients over replicas."""
    if not age_s:
        return []
    return [("grpc.max_connection_age_ms", math.ceil(age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", min(math.ceil((age_s + CONNECTION_AGE_GRACE_S) * 1000), INT32_MAX))]


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_access(config: ServerConfig) -> tuple[ReloadableTls | None, list[str]]:
    """The TLS files (None: plaintext) and the tokens (none: no check), read; ConfigError names what is wrong."""
    tls = (ReloadableTls(config.tls_cert, config.tls_key, config.tls_client_ca)
           if config.tls_cert is not None and config.tls_key is not None else None)
    return tls, read_tokens(config.auth_token_file) if config.auth_token_file is not None else []


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


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.reuse_port)),  # unless asked, a port in use is an error, not a share
        ("grpc.keepalive_time_ms", 60_000),  # ping idle connections; a dead peer's calls end
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.max_pings_without_data", 0),  # ... however long a connection stays idle
        # clients' keepalive pings are welcome every CLIENT_PING_MIN_MS, calls in flight or not
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MIN_MS),
        # streams per connection: bounded (unread answers hold memory), far above --max-concurrent
        ("grpc.max_concurrent_streams", min(max(4 * config.max_concurrent, config.max_concurrent + 1024), INT32_MAX)),
        *connection_age_options(config.max_connection_age_s),
    ]


def bind_error(what: str, reason: str, flag: str = "--port") -> str:
    return (f"{what}: {reason.rstrip('.')}; is another process using the port? Pick another {flag} (0 picks a free "
            f"one), or give {flag.removesuffix('port')}host an address of this machine")


class ForecastServer:
    """The gRPC server with its servicer, batcher, health, reflection and metrics."""

    def __init__(self, config: ServerConfig, model: LoadedModel, tls: ReloadableTls | None, tokens: list[str]
                 ) -> None:
        self.config = config
        self.metrics = Metrics(tokens=bool(tokens))
        self.stopping = threading.Event()  # SIGTERM: a warm-up running in a thread ends between two runs
        self.delay_cut = asyncio.Event()  # a second SIGTERM or SIGINT: the rest of --drain-delay is skipped
        process = functools.partial(run_batch, steps=self.metrics.steps)  # features and run timed per batch
        self.batcher: Batcher = MicroBatcher(process, config.max_batch, config.max_delay_ms / 1000.0,
                                             wait=config.batch_wait, observer=self.metrics)
        limits = Limits(config.max_batch, config.max_message_bytes, config.max_concurrent)
        self.servicer = ForecasterServicer(model, self.batcher, self.metrics, limits,
                                           stream_max_age_s=config.max_connection_age_s)
        self.health = DrainingHealth()
        self.tls = tls
        token_file = config.auth_token_file
        self.auth = TokenAuth(tokens, self.metrics.count, token_file) if token_file is not None else None
        interceptors = [i for i in (UnknownMethods(self.metrics.count), self.auth) if i is not None]
        one_line_decode_errors()
        self.grpc = aio.server(interceptors=interceptors, options=grpc_options(config))
        add_to_server(self.servicer, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        enable_server_reflection((SERVICE.full_name, health.SERVICE_NAME), self.grpc)
        self._reloading = False
        self._reload_again = False
        self.metrics.set_model(model)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in ("", SERVICE.full_name):  # the whole server, and foxhunt.tft.v1.Forecaster
            await self.health.set(name, status)

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING until warm_up); the bound port, or OSError."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = host_port(self.config.host, self.config.port)
        try:
            port = (self.grpc.add_secure_port(address, self.tls.credentials) if self.tls is not None
                    else self.grpc.add_insecure_port(address))
        except RuntimeError as exc:
            raise OSError(bind_error(f"cannot listen on {address}", str(exc))) from None
        self.batcher.start()
        await self.grpc.start()
        return port

    async def warm_up(self) -> None:
        """Run the model at every padded batch size, then report SERVING."""
        model = self.servicer.model
        seconds = await asyncio.get_running_loop().run_in_executor(None, model.warm_up, self.stopping)
        self.servicer.ready = True
        self.metrics.ready.set(1)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("warmed up at batch sizes %s in %.3f s; health SERVING", list(model.buckets), seconds)

    def reload_files(self) -> None:
        """SIGHUP: re-read the TLS and token files (renewal, rotation); an unusable one is refused, the old stays."""
        for name, files in (("tls", self.tls), ("tokens", self.auth)):
            if files is not None:
                self.metrics.reloads.labels(name, "ok" if files.reload() else "refused").inc()

    async def reload(self) -> None:
        """SIGHUP: load, check and warm the model file, then swap it in; a bad file is refused. A SIGHUP during
        a reload gets one more pass after it, to read the latest file."""
        self._reload_again = True
        if self._reloading:
            return
        self._reloading = True
        try:
            while self._reload_again:
                self._reload_again = False
                await self._reload_once()
        finally:
            self._reloading = False

    async def _reload_once(self) -> None:
        c, old = self.config, self.servicer.model
        log.info("SIGHUP: reloading %s", c.model_path)
        try:
            new = await asyncio.to_thread(load_and_warm, c.model_path, c.device, c.threads, c.max_batch,
                                          c.device_id, self.stopping)
        except WarmUpStopped:
            log.info("reload stopped by SIGTERM; the drain goes on with model %s", old.version)
            return
        except Exception as exc:  # a bad file, or an unexpected failure: neither takes the server down
            self.metrics.reloads.labels("model", "refused").inc()
            log.error("reload refused, still serving model %s: %s", old.version, exc,
                      exc_info=not isinstance(exc, ModelLoadError))
            return
        self.servicer.model = new
        self.metrics.set_model(new)
        self.metrics.reloads.labels("model", "ok").inc()
        log.info("reloaded: serving model %s (sha256 %s, provider %s); was %s (sha256 %s)", new.version,
                 new.sha256[:12], new.provider, old.version, old.sha256[:12])
        if changed := contract_changes(old.meta, new.meta):  # what callers build requests from (GetModelInfo)
            log.warning("the reloaded model asks callers for something else: %s", "; ".join(changed))

    async def stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish within grace_s, stop the batcher.
        gRPC's shutdown starts once the calls in flight have finished: until then new calls get UNAVAILABLE
        (retriable) from the handler, where gRPC's shutdown would answer CANCELLED (grpc/grpc#41785)."""
        self.stopping.set()
        await self._drain_delay()
        self.servicer.ready = False
        self.servicer.draining = True
        self.metrics.ready.set(0)
        await self.health.enter_graceful_shutdown()
        started = time.monotonic()
        await asyncio.sleep(min(DRAIN_SETTLE_S, grace_s))  # the calls on their way at the signal arrive
        self.servicer.end_streams()  # each open PredictStream answers what it has read, then ends UNAVAILABLE
        while time.monotonic() - started < grace_s and (self.servicer.admission.active or self.servicer.stream_readers):
            await asyncio.sleep(DRAIN_POLL_S)
        self.health.end_watches()  # they never end by themselves, and would hold gRPC's shutdown for the grace
        await self.grpc.stop(max(0.0, grace_s - (time.monotonic() - started)))
        if self.auth is not None:  # the refusals held back for their minute's line
            self.auth.refusals.flush()
        await self.batcher.close()
        log.info("drained in %.3f s", time.monotonic() - started)

    async def _drain_delay(self) -> None:
        """Health NOT_SERVING for --drain-delay while calls are still served; a second stop signal cuts it short."""
        if not (self.config.drain_delay_s > 0 and self.servicer.ready):
            return
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("health NOT_SERVING; serving on for --drain-delay %g s, then draining", self.config.drain_delay_s)
        began = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.delay_cut.wait(), self.config.drain_delay_s)
        if self.delay_cut.is_set():
            log.info("a second stop signal: the rest of --drain-delay skipped after %.1f s, draining",
                     time.monotonic() - began)


def contract_changes(old: ModelMeta, new: ModelMeta) -> list[str]:
    """What a reload changed of what callers send and get (GetModelInfo's fields), as `name old -> new`."""
    def facts(m: ModelMeta) -> dict[str, Any]:
        return {"bars required": m.bars_required, "bar interval (ns)": m.bar_interval_ns, "horizon": m.horizon,
                "quantiles": list(m.quantiles), "symbols": list(m.symbols),
                "user feature columns": m.feature_schema.user_columns, "explain": m.explain,
                "bar columns": m.column_map, "calendar time zone": m.feature_config.calendar_tz}

    was, now = facts(old), facts(new)
    return [f"{k} {was[k]} -> {now[k]}" for k in was if was[k] != now[k]]


def build_server(config: ServerConfig, model: LoadedModel) -> ForecastServer:
    """Everything wired, nothing bound; reads the TLS and token files (ConfigError)."""
    return ForecastServer(config, model, *read_access(config))


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


EVENT_LOOPS = ("uvloop", "asyncio")


def run_server(config: ServerConfig) -> int:
    """`serve(config)` on the configured event loop (uvloop spends less interpreter time per call)."""
    return_large_buffers()
    if config.event_loop == "asyncio":
        return asyncio.run(serve(config))
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(f"--event-loop uvloop (the default) needs the uvloop package, which does not import here "
                          f"({exc}); install it, or pass --event-loop asyncio") from None
    return uvloop.run(serve(config))


class Signals:
    """The signals of `python -m serving --help` (a SIGHUP while warming up waits for it); a worker's stdin EOF too."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.server: ForecastServer | None = None  # set by `serving`
        self.warm = False
        self.hup_pending = False
        self.stop = asyncio.Event()
        self.why = "stdin closed"  # the first stop signal's name, for the log
        self.reloads: set[asyncio.Task[None]] = set()
        loop.add_signal_handler(signal.SIGHUP, self.on_hup)

    def serving(self, server: ForecastServer) -> None:
        """From here (before `listening on` is printed) a stop signal drains."""
        self.server = server
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.on_stop, sig)
        if server.config.stop_on_stdin_eof:
            threading.Thread(target=_drain_at_stdin_eof, args=(self.loop, self.stop), name="supervisor-lifeline",
                             daemon=True).start()

    def on_stop(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            self.why = sig.name
            self.stop.set()
        elif self.server is not None:
            self.server.delay_cut.set()  # an operator who signals again wants the stop now, not after the delay
            log.info("%s while stopping", sig.name)

    def on_hup(self) -> None:
        server = self.server
        if server is None or not self.warm:
            log.info("SIGHUP while starting: reloading once warm")
            self.hup_pending = True
        elif server.stopping.is_set():  # a model load cannot be interrupted, and would hold the exit
            log.info("SIGHUP while draining: ignored")
        else:
            server.reload_files()
            task = self.loop.create_task(server.reload())
            self.reloads.add(task)
            task.add_done_callback(self.reloads.discard)

    def warmed_up(self) -> None:
        self.warm = True
        if self.hup_pending:
            self.on_hup()


def _drain_at_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Block on stdin until EOF, then drain: a --workers supervisor holds the other end of the pipe, so its
    death (even by SIGKILL) ends its workers instead of leaving them serving on its port."""
    fd = sys.stdin.fileno()
    while os.read(fd, 4096):  # the raw descriptor: a daemon thread blocked in sys.stdin's buffered reader
        pass  # would hold its lock and abort the interpreter's shutdown
    log.warning("stdin closed: the --workers supervisor is gone; draining")
    with contextlib.suppress(RuntimeError):  # the loop already finished: the server is exiting anyway
        loop.call_soon_threadsafe(stop.set)


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT; 0 after a clean drain. ModelLoadError, ConfigError and OSError propagate."""
    signals = Signals(asyncio.get_running_loop())
    tls, tokens = read_access(config)  # unusable TLS or token files stop the start before the model loads
    model = await asyncio.to_thread(load_model, config.model_path, config.device, config.threads,
                                    config.max_batch, config.device_id)
    log.info("model %s (sha256 %s) from %s: provider %s, bars_required %d, horizon %d, quantiles %s, symbols %s",
             model.version, model.sha256[:12], model.path, model.provider, model.meta.bars_required,
             model.meta.horizon, list(model.meta.quantiles), ",".join(model.meta.symbols))
    server = ForecastServer(config, model, tls, tokens)
    log.info("access: %s", access_summary(config))
    signals.serving(server)
    await _listen(server, config)
    await _warm_up_until_stopped(server, signals)
    log.info("%s: draining (grace %g s)", signals.why, config.grace_s)
    await server.stop(config.grace_s)
    return 0


async def _listen(server: ForecastServer, config: ServerConfig) -> None:
    """Serve /metrics, then bind and start gRPC, and print where: `listening on` means the whole server is up."""
    mport = None
    if config.metrics_port is not None:
        try:
            mport = server.metrics.serve_http(config.metrics_bind, config.metrics_port)
        except OSError as exc:
            address = host_port(config.metrics_bind, config.metrics_port)
            raise OSError(bind_error(f"--metrics-port {config.metrics_port}: cannot serve metrics on {address}",
                                     exc.strerror or str(exc), "--metrics-port")) from None
    try:
        port = await server.start()
    except BaseException:
        server.metrics.stop_http()  # for a caller that goes on (the command itself exits)
        raise
    print(f"listening on {host_port(config.host, port)}", flush=True)
    log.info("listening on %s, pid %d (max message %d bytes, max batch %d, max delay %g ms, %s wait, max concurrent "
             "%d, %d thread(s), grace %g s, drain delay %g s, connection age %s, %s event loop)",
             host_port(config.host, port), os.getpid(), config.max_message_bytes, config.max_batch,
             config.max_delay_ms, config.batch_wait, config.max_concurrent, config.threads, config.grace_s,
             config.drain_delay_s, f"{config.max_connection_age_s:g} s" if config.max_connection_age_s else "unlimited",
             config.event_loop)
    if mport is not None:
        print(f"metrics on {host_port(config.metrics_bind, mport)}", flush=True)
        log.info("metrics on http://%s/metrics", host_port(config.metrics_bind, mport))


async def _warm_up_until_stopped(server: ForecastServer, signals: Signals) -> None:
    """Warm up, then serve until a stop signal; a warm-up that fails stops the server and raises."""
    loop = asyncio.get_running_loop()
    warm = loop.create_task(server.warm_up())
    stopping = loop.create_task(signals.stop.wait())
    done, _ = await asyncio.wait({warm, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if warm in done and (failure := warm.exception()) is not None:
        stopping.cancel()
        await server.stop(0)
        raise failure
    if warm in done:
        signals.warmed_up()
    await stopping
    server.stopping.set()  # a warm-up or reload in its thread ends between two runs, not after all of them
    for task in (warm, *signals.reloads):
        task.cancel()
