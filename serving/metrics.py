"""Prometheus metrics of the server, in their own registry, served on --metrics-port. Counters of the usual
answers and of reloads exist at zero from the start, so that `increase()` sees their first event."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics import Counter, Gauge, Histogram, Info, disable_created_metrics
from prometheus_client.registry import Collector, CollectorRegistry

from features import package_version
from serving.model import LoadedModel

FORECASTER = "/foxhunt.tft.v1.Forecaster/"
FORECASTER_METHODS = ("Predict", "PredictStream", "GetModelInfo")
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
                   0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # a lone call takes about 1 ms
RELOADED_FILES = ("model", "tls", "tokens")  # what a SIGHUP re-reads (tls and tokens when the server uses them)
USUAL_CODES = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED",
               "INTERNAL")
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
STEPS = ("parse", "features", "run", "response")


class StepTimes(Collector):
    """Seconds spent in each serving step, summed, and how many times each ran: plain additions on the
    request path (the steps are microseconds long), turned into counters only when scraped."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STEPS, 0.0)
        self.counts = dict.fromkeys(STEPS, 0)

    def add(self, step: str, seconds: float) -> None:
        self.seconds[step] += seconds
        self.counts[step] += 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds = CounterMetricFamily("foxhunt_step_seconds", "Time in each serving step, summed: parse and "
                                      "response per call, features and run (ONNX Runtime alone) per batch",
                                      labels=["step"])
        counts = CounterMetricFamily("foxhunt_steps", "Times each serving step ran", labels=["step"])
        for step in STEPS:
            seconds.add_metric([step], self.seconds[step])
            counts.add_metric([step], self.counts[step])
        yield from (seconds, counts)


class Metrics:
    """All metrics of one server; also the batcher's observer."""

    def __init__(self, tokens: bool = False) -> None:
        # tokens: calls need a token (--auth-token-file), so UNAUTHENTICATED is a usual code too
        disable_created_metrics()  # no `_created` series beside every counter and histogram
        r = self.registry = CollectorRegistry()
        self._httpd: WSGIServer | None = None  # the /metrics endpoint, once serve_http started it
        counter, gauge = functools.partial(Counter, registry=r), functools.partial(Gauge, registry=r)
        seconds = functools.partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        sizes = functools.partial(Histogram, buckets=BATCH_BUCKETS, registry=r)
        self.requests = counter("foxhunt_requests", "RPCs answered, by method and gRPC status code", ["method", "code"])
        self.latency = seconds("foxhunt_request_latency_seconds", "Time in the RPC handler", ["method"])
        self.queue = seconds("foxhunt_queue_seconds", "Time a call's windows waited for their batch")
        self.inference = seconds("foxhunt_inference_seconds",
                                 "Wall time per batch: features, ONNX Runtime run, output checks")
        self.batch_windows = sizes("foxhunt_batch_windows", "Windows per ONNX Runtime run (before padding)")
        self.batch_calls = sizes("foxhunt_batch_calls", "Calls sharing one ONNX Runtime run")
        self.expired = counter("foxhunt_queue_expired", "Calls whose deadline passed while queued (not run)")
        self.warned = counter("foxhunt_forecast_warnings", "Forecasts answered with a warning (Forecast.warnings)")
        self.inflight = gauge("foxhunt_inflight_requests", "Predict calls and PredictStream requests being served")
        self.open_streams = gauge("foxhunt_open_streams", "PredictStreams open now")
        self.ready = gauge("foxhunt_ready", "1 when the model is warmed up and serving")
        self.model = Info("foxhunt_model", "The model being served and where it runs", registry=r)
        self.reloads = counter("foxhunt_reloads", "SIGHUP reloads by file (model, tls, tokens) and result",
                               ["file", "result"])
        Info("foxhunt_build", "The server's package version", registry=r).info({"version": package_version()})
        codes = (*USUAL_CODES, "UNAUTHENTICATED") if tokens else USUAL_CODES
        for method, code in itertools.product(("Predict", "PredictStream"), codes):  # at zero from the start
            self.requests.labels(method, code)
        for file, result in itertools.product(RELOADED_FILES, ("ok", "refused")):
            self.reloads.labels(file, result)
        for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):  # the default registry's, here too
            r.register(collector)
        self.steps = StepTimes()
        r.register(self.steps)

    def count(self, method: str, code: grpc.StatusCode) -> None:
        """An answer given by an interceptor, by full method name; unknown names count as `other`."""
        name = method[len(FORECASTER):] if method.startswith(FORECASTER) else ""
        self.requests.labels(name if name in FORECASTER_METHODS else "other", code.name).inc()

    def on_batch(self, windows: int, calls: int, inference_s: float) -> None:
        self.batch_windows.observe(windows)
        self.batch_calls.observe(calls)
        self.inference.observe(inference_s)

    def on_queue_time(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def on_expired(self) -> None:
        self.expired.inc()

    def set_model(self, model: LoadedModel) -> None:
        self.model.info({"version": model.version, "checkpoint_sha256": model.meta.checkpoint_sha256,
                         "model_sha256": model.sha256, "provider": model.provider,
                         "device_requested": model.device_requested,
                         "fallback": "yes" if model.fallback_warning else "no"})

    def serve_http(self, host: str, port: int) -> int:
        """Start the /metrics endpoint (daemon thread); returns the bound port (port 0 picks one)."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._httpd = httpd
        return int(httpd.server_port)

    def stop_http(self) -> None:
        """Stop the /metrics endpoint, if serve_http started one (its port is free again)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
