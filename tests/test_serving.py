"""End to end: the real `python -m serving` as a subprocess on 127.0.0.1, on a model made by the
real `python -m trainer` and `python -m export`, driven over gRPC.

Every server binds port 0, prints `listening on HOST:PORT`, and is killed in `finally`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from features.bars import Bars
from features.calendar import future_timestamps
from features.compute import build_frame
from features.config import FeatureConfig
from features.schema import MODEL_INPUTS, MODEL_OUTPUTS, QUANTILES
from features.windows import gather_windows
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.request_from_bars import series_from_bars
from tests.artifacts import REPO, run_main
from tests.live_server import SERVICE, LiveServer, Model, metric, request_for, serving, tiny_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-7  # ORT's float32 kernels may differ in the last bits between batch sizes


# ---- the model and servers (tests.live_server) --------------------------------------------------------
@pytest.fixture(scope="module")
def art(tiny_model: Model) -> Model:  # noqa: F811  (the shared fixture, under this module's name)
    return tiny_model


def serve(model: Path, log: Path, *flags: str) -> LiveServer:
    """A live server with its Prometheus endpoint on a free port too."""
    return LiveServer(model, log, "--metrics-port", "0", *flags)


@pytest.fixture(scope="module")
def server(art: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from serving(art.model, tmp_path_factory.mktemp("log") / "server.log", "--metrics-port", "0",
                       "--device", "cpu")


def quantiles_of(f: pb.Forecast) -> np.ndarray:
    return np.asarray(f.log_return).reshape(f.horizon, len(f.quantile_levels))


# ---- the contract ---------------------------------------------------------------------------------------
def test_predict_equals_direct_onnx_runtime_on_training_features(art: Model, server: LiveServer) -> None:
    """Features of the whole file (as training computed them) + a bare ORT run == the server's answer
    for a request carrying only the last bars_required bars up to that point."""
    meta = art.meta
    frame = build_frame(art.bars, meta.feature_config, symbols=list(meta.symbols))
    assert frame.bar_interval_ns == meta.bar_interval_ns
    session = ort.InferenceSession(str(art.model), providers=["CPUExecutionProvider"])
    slices = art.bars.series_slices()
    cases = [(sym, row) for sym in meta.symbols for row in (slices[sym].stop - slices[sym].start - 1, 500)]
    for symbol, row in cases:
        anchor = np.array([slices[symbol].start + row])
        windows = gather_windows(frame, anchor, meta.encoder_length)
        expected = dict(zip(MODEL_OUTPUTS, session.run(list(MODEL_OUTPUTS), {k: windows[k] for k in MODEL_INPUTS}),
                            strict=True))
        response = server.stub.Predict(request_for(art, symbol, end=row, explain=True), timeout=10)
        (f,) = response.forecasts
        assert f.symbol == symbol and f.model_version == meta.model_version == response.model_version
        np.testing.assert_allclose(quantiles_of(f), expected[QUANTILES][0], rtol=RTOL, atol=ATOL)
        close = art.bars.close[anchor[0]]
        assert f.last_close == close and f.last_timestamp_ns == art.bars.timestamp_ns[anchor[0]]
        np.testing.assert_allclose(np.asarray(f.price).reshape(quantiles_of(f).shape),
                                   close * np.exp(quantiles_of(f)), rtol=1e-12)
        assert list(f.timestamp_ns) == future_timestamps(np.array([f.last_timestamp_ns]), meta.bar_interval_ns,
                                                         meta.horizon)[0].tolist()
        assert list(f.quantile_levels) == list(meta.quantiles) and f.horizon == meta.horizon
        e = f.explanation
        np.testing.assert_allclose(np.asarray(e.attention).reshape(e.attention_rows, e.attention_cols),
                                   expected["attention"][0], rtol=RTOL, atol=ATOL)
        assert e.attention_rows == meta.horizon and e.attention_cols == meta.encoder_length + meta.horizon
        assert len(e.attention_timestamp_ns) == e.attention_cols
        assert e.attention_timestamp_ns[meta.encoder_length - 1] == f.last_timestamp_ns
        schema = meta.feature_schema
        for weights, name, variables in ((e.static_weights, "static_weights", schema.static),
                                         (e.encoder_weights, "encoder_weights", schema.observed + schema.known),
                                         (e.decoder_weights, "decoder_weights", schema.known)):
            assert list(weights.variables) == variables
            np.testing.assert_allclose(np.asarray(weights.weights).reshape(expected[name][0].shape),
                                       expected[name][0], rtol=RTOL, atol=ATOL)


def test_batched_and_concurrent_requests_equal_single_ones(art: Model, server: LiveServer, tmp_path: Path) -> None:
    symbols = list(art.meta.symbols)
    singles = {s: server.stub.Predict(request_for(art, s), timeout=10).forecasts[0] for s in symbols}
    both = pb.PredictRequest(series=[request_for(art, s).series[0] for s in reversed(symbols)])
    forecasts = server.stub.Predict(both, timeout=10).forecasts
    assert [f.symbol for f in forecasts] == list(reversed(symbols))
    for f in forecasts:
        np.testing.assert_allclose(quantiles_of(f), quantiles_of(singles[f.symbol]), rtol=RTOL, atol=ATOL)
        assert f.timestamp_ns == singles[f.symbol].timestamp_ns

    # concurrent calls get micro-batched together (same symbols in one batch included): same answers. A
    # fixed wait makes the batching certain: with the adaptive default, a fast server may answer each
    # call before the next client thread has sent its own
    requests = [request_for(art, symbols[i % 2], end=300 + 37 * i) for i in range(24)]
    alone = [quantiles_of(server.stub.Predict(r, timeout=10).forecasts[0]) for r in requests]
    fixed = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--batch-wait", "fixed",
                  "--max-delay-ms", "200")
    try:
        fixed.wait_serving()
        with ThreadPoolExecutor(24) as pool:
            together = list(pool.map(lambda r: quantiles_of(fixed.stub.Predict(r, timeout=10).forecasts[0]),
                                     requests))
        runs = metric(fixed.scrape(), "foxhunt_batch_calls_count")
    finally:
        fixed.kill()
    for a, t in zip(alone, together, strict=True):
        np.testing.assert_allclose(t, a, rtol=RTOL, atol=ATOL)
    assert runs < len(requests), "concurrent calls were never batched together"


BAD_INPUTS = [  # (case, change to a good request, what the message says, the field google.rpc.BadRequest names)
    ("empty request", lambda r: r.ClearField("series"), "empty request", "series"),
    ("too few bars", lambda r: _trim(r.series[0], 5), "the model needs at least", "series[0].timestamp_ns"),
    ("unequal columns", lambda r: r.series[0].high.pop(), "columns have unequal lengths", "series[0]"),
    ("NaN close", lambda r: _set(r.series[0].close, 7, float("nan")), "column 'close', row 7: close is NaN",
     "series[0].close"),
    ("zero open", lambda r: _set(r.series[0].open, 3, 0.0), "column 'open', row 3: open is not positive",
     "series[0].open"),
    ("negative low", lambda r: _set(r.series[0].low, 2, -1.0), "column 'low', row 2: low is not positive",
     "series[0].low"),
    ("high < low", lambda r: _set(r.series[0].high, 4, r.series[0].low[4] * 0.5), "row 4: high < low",
     "series[0].high"),
    ("close above high", lambda r: _set(r.series[0].close, 6, r.series[0].high[6] * 1.01), "above high",
     "series[0].high"),
    ("negative volume", lambda r: _set(r.series[0].volume, 1, -5.0), "volume is negative", "series[0].volume"),
    ("repeated timestamp", lambda r: _set(r.series[0].timestamp_ns, 9, r.series[0].timestamp_ns[8]),
     "column 'timestamp_ns', row 9: duplicate timestamp", "series[0].timestamp_ns"),
    ("decreasing timestamps", lambda r: _set(r.series[0].timestamp_ns, 9, r.series[0].timestamp_ns[8] - 1),
     "timestamps decrease", "series[0].timestamp_ns"),
    ("unknown symbol", lambda r: setattr(r.series[0], "symbol", "ZZ"), "unknown symbol 'ZZ'; the model knows",
     "series[0].symbol"),
    ("empty symbol", lambda r: setattr(r.series[0], "symbol", ""), "symbol is empty", "series[0].symbol"),
    ("duplicate symbol", lambda r: r.series.append(r.series[0]), "already appears in series[0]", "series[1].symbol"),
    ("repeated user column", lambda r: r.series[0].user_features.extend(
        [pb.Column(name="x", values=r.series[0].close), pb.Column(name="x", values=r.series[0].close)]),
     "user feature column 'x' is sent twice", "series[0].user_features"),
    ("packed block of the wrong size", lambda r: _pack(r.series[0], ["x"], b"\0" * 8),
     "user_features_raw has 8 bytes; 1 name(s) x", "series[0].user_features_raw"),
    ("packed and plain user features", lambda r: (r.series[0].user_features.add(name="y", values=r.series[0].close),
                                                  _pack(r.series[0], ["x"], b"")),
     "sends both user_features and user_feature_names", "series[0].user_features_raw"),
]


def _pack(series: pb.Series, names: list[str], raw: bytes) -> None:
    series.user_feature_names.extend(names)
    series.user_features_raw = raw


def _trim(series: pb.Series, n: int) -> None:
    for name in ("timestamp_ns", "open", "high", "low", "close", "volume"):
        col = getattr(series, name)
        del col[:-n]


def _set(col: object, i: int, value: float) -> None:
    col[i] = value  # type: ignore[index]


@pytest.mark.parametrize(("case", "mutate", "message", "field"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_invalid_argument_and_the_next_call_succeeds(
        art: Model, server: LiveServer, case: str, mutate: object, message: str, field: str) -> None:
    request = request_for(art, art.meta.symbols[0])
    mutate(request)  # type: ignore[operator]
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Predict(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert message in (info.value.details() or ""), info.value.details()
    # gRPC's richer error model: the field at fault, for a caller that drops the series and resends the rest
    status = rpc_status.from_call(info.value)  # the RpcError of a blocking call is its grpc.Call too
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert status.message == info.value.details()
    [detail] = status.details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad) and [v.field for v in bad.field_violations] == [field], bad
    assert message in bad.field_violations[0].description
    assert server.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts


def test_oversized_message_is_refused_and_the_server_stays_up(art: Model, server: LiveServer) -> None:
    request = request_for(art, art.meta.symbols[0])
    s = request.series[0]
    n = 5 * (1 << 20) // 48  # > 4 MiB of bars
    t0 = s.timestamp_ns[0]
    s.timestamp_ns[:] = (t0 - 60_000_000_000 * np.arange(n, 0, -1)).tolist()
    for name in ("open", "high", "low", "close", "volume"):
        getattr(s, name)[:] = [1.0] * n
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Predict(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts


def test_client_keepalive_pings_on_an_idle_connection_keep_it_open(art: Model, server: LiveServer) -> None:
    """A strategy calling once a bar keeps its connection alive with pings between calls; gRPC's default
    server policy takes such pings for abuse and closes the connection (GOAWAY too_many_pings)."""
    options = [("grpc.keepalive_time_ms", 1500), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    states: list[grpc.ChannelConnectivity] = []
    with grpc.insecure_channel(server.target, options=options) as channel:
        channel.subscribe(states.append, try_to_connect=True)
        stub = pb_grpc.ForecasterStub(channel)
        assert stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts
        time.sleep(6.5)  # four client pings, no calls
        assert stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts
        ready = states.index(grpc.ChannelConnectivity.READY)
        assert set(states[ready:]) == {grpc.ChannelConnectivity.READY}, states  # never dropped and reconnected
    assert "too_many_pings" not in server.log_text()


def test_connections_are_aged_out_without_failing_a_call(art: Model, tmp_path: Path) -> None:
    """--max-connection-age: the server tells an old connection to go away; its calls finish, and the client
    reconnects by itself (how an L4 balancer gets to spread long-lived clients over new replicas)."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--max-connection-age", "0.5")
    try:
        s.wait_serving()
        states: list[grpc.ChannelConnectivity] = []
        with grpc.insecure_channel(s.target) as channel:
            channel.subscribe(states.append, try_to_connect=True)
            stub = pb_grpc.ForecasterStub(channel)
            request = request_for(art, art.meta.symbols[0])
            deadline = time.monotonic() + 60
            while states.count(grpc.ChannelConnectivity.READY) < 2:  # until connected again after an age-out
                assert stub.Predict(request, timeout=10).forecasts  # never an error
                assert time.monotonic() < deadline, states
    finally:
        s.kill()


def test_limits_at_grpcs_int32_bounds_start_and_beyond_them_are_refused(art: Model, tmp_path: Path) -> None:
    """gRPC takes --max-concurrent (times 4, as the streams per connection) and --max-message-bytes as C ints:
    the largest values a flag accepts start a serving server, and larger ones exit 2 naming the bound, not
    with an OverflowError traceback."""
    top = str(2**31 - 1)
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--max-concurrent", top,
              "--max-message-bytes", top)
    try:
        s.wait_serving()
        assert s.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts
    finally:
        s.kill()
    for flag, message in (("--max-concurrent", f"--max-concurrent must be in 1..{top}"),
                          ("--max-message-bytes", f"--max-message-bytes must be in 1024..{top}")):
        refused = subprocess.run([sys.executable, "-m", "serving", "--model", str(art.model), flag, str(2**31)],
                                 cwd=REPO, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr


def test_the_server_raises_its_open_file_limit(art: Model) -> None:
    """Each connection is a file: a server started under a soft limit of 256 (a shell's 1,024 alike) raises it
    to the hard limit, so a burst of idle connections does not lock new callers out."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise to")
    # the limit is set in the child's own interpreter: preexec_fn is unsafe in this threaded test process
    start = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard})); "
             f"sys.argv = ['serving', '--model', {str(art.model)!r}, '--port', '0', '--device', 'cpu']; "
             "runpy.run_module('serving', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", start], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on"):
            proc.wait(timeout=30)
            pytest.fail(f"no 'listening on' line (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")
        soft_now, _ = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        assert soft_now == (1 << 20 if hard == resource.RLIM_INFINITY else hard)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "open file limit raised from 256" in err


def test_health_reflection_and_model_info(art: Model, server: LiveServer) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    for name in ("", SERVICE):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    (answer,) = list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5))
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    (answer,) = list(reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]), timeout=5))
    assert answer.file_descriptor_response.file_descriptor_proto
    # the protocol's stable name too (clients try it first), listed and described like any service; and a
    # method is found in its service's file (grpcurl describe foxhunt.tft.v1.Forecaster.Predict)
    v1 = server.channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                      request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                      response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    asked = ["grpc.reflection.v1.ServerReflection", f"{SERVICE}.Predict", f"{SERVICE}.Nope"]
    listed, *found = v1(iter([reflection_pb2.ServerReflectionRequest(list_services=""),
                              *(reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in asked)]),
                        timeout=5)
    assert {s.name for s in listed.list_services_response.service} == names | {"grpc.reflection.v1.ServerReflection"}
    files = [descriptor_pb2.FileDescriptorProto.FromString(a.file_descriptor_response.file_descriptor_proto[0])
             for a in found[:2]]
    assert [(f.name, f.package) for f in files] == [("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"),
                                                    ("foxhunt/tft/v1/forecaster.proto", "foxhunt.tft.v1")]
    assert [m.name for m in files[0].service[0].method] == ["ServerReflectionInfo"]
    assert files[0].service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    descriptor_pool.DescriptorPool().Add(files[0])  # a whole file: a client can build its messages from it
    assert found[2].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]

    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    meta = art.meta
    assert info.bars_required == meta.bars_required == meta.feature_config.warmup_bars + meta.encoder_length
    assert (info.bar_interval_ns, info.encoder_length, info.horizon) == \
        (meta.bar_interval_ns, meta.encoder_length, meta.horizon)
    assert list(info.quantiles) == list(meta.quantiles) and list(info.symbols) == list(meta.symbols)
    roles = {pb.FEATURE_ROLE_STATIC: "static", pb.FEATURE_ROLE_OBSERVED: "observed", pb.FEATURE_ROLE_KNOWN: "known"}
    assert [(f.name, roles[f.role]) for f in info.features] == \
        [(f.name, f.role.value) for f in meta.feature_schema.features]
    assert info.model_version == meta.model_version and info.checkpoint_sha256 == meta.checkpoint_sha256
    assert info.model_sha256 == hashlib.sha256(art.model.read_bytes()).hexdigest()
    assert info.provider == "CPUExecutionProvider" and info.device_requested == "cpu" and not info.fallback_warning
    assert info.explain_available == meta.explain and info.max_batch == 64 and info.max_message_bytes == 4 << 20


def test_server_process_never_imports_torch(server: LiveServer) -> None:
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.torch_imported is False  # `"torch" in sys.modules`, asked of the server process itself
    maps = Path(f"/proc/{server.proc.pid}/maps")
    if maps.exists():  # and, from the outside, no torch library is mapped into it
        assert "libtorch" not in maps.read_text()


def test_metrics(art: Model, server: LiveServer) -> None:
    first = server.scrape()  # the usual answers' counters exist from the start (at zero until one happens)
    for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
        assert f'foxhunt_requests_total{{code="{code}",method="Predict"}}' in first, code
    assert 'foxhunt_reloads_total{file="model",result="refused"}' in first and "_created" not in first
    assert metric(first, "process_resident_memory_bytes") > 0 and metric(first, "process_open_fds") > 0
    assert 'foxhunt_build_info{version="' in first and "python_gc_collections_total" in first
    server.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10)
    with pytest.raises(grpc.RpcError):
        server.stub.Predict(pb.PredictRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as info:  # a client on another version, or a scanner: seen, as `other`
        server.channel.unary_unary(f"/{SERVICE}/Nope" + "x" * 200)(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    text = server.scrape()
    assert metric(text, "foxhunt_requests_total", method="other", code="UNIMPLEMENTED") >= 1
    assert metric(text, "foxhunt_requests_total", method="Predict", code="OK") >= 1
    assert metric(text, "foxhunt_requests_total", method="Predict", code="INVALID_ARGUMENT") >= 1
    assert metric(text, "foxhunt_request_latency_seconds_count", method="Predict") >= 2
    assert metric(text, "foxhunt_batch_windows_count") >= 1 and metric(text, "foxhunt_queue_seconds_count") >= 1
    assert metric(text, "foxhunt_inference_seconds_count") >= 1 and metric(text, "foxhunt_ready") == 1
    assert metric(text, "foxhunt_model_info", version=art.meta.model_version, provider="CPUExecutionProvider") == 1
    # a lone call's handler time (about a millisecond) and queue wait (microseconds) fall in buckets that tell
    assert 'foxhunt_queue_seconds_bucket{le="5e-05"}' in text and \
        'foxhunt_request_latency_seconds_bucket{le="5e-05",method="Predict"}' in text


def test_step_metrics_count_and_time_each_step_of_a_call(art: Model, server: LiveServer) -> None:
    """One good call adds one of each step (its own batch) and some time to each; a call refused while
    parsing adds to no step."""
    def steps(text: str) -> dict[str, tuple[float, float]]:
        return {s: (metric(text, "foxhunt_steps_total", step=s), metric(text, "foxhunt_step_seconds_total", step=s))
                for s in ("parse", "features", "run", "response")}

    before = steps(server.scrape())
    server.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10)
    with pytest.raises(grpc.RpcError):
        server.stub.Predict(pb.PredictRequest(), timeout=10)
    after = steps(server.scrape())
    for step in before:
        assert after[step][0] == before[step][0] + 1, (step, before, after)
        assert after[step][1] > before[step][1], (step, before, after)


def test_client_prints_a_forecast_table(art: Model, server: LiveServer, tmp_path: Path) -> None:
    symbol = art.meta.symbols[0]
    r = subprocess.run([sys.executable, "-m", "serving.client", "--target", server.target, "--parquet",
                        str(art.bars_path), "--symbol", symbol], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{symbol}  model {art.meta.model_version}")
    assert "ret q0.5" in lines[1] and "price q0.5" in lines[1] and len(lines) == 3 + art.meta.horizon
    assert lines[-1].startswith("ret: cumulative log return") and "nominal" in lines[-1]

    def client(parquet: Path, symbol: str, *flags: str) -> subprocess.CompletedProcess[str]:
        """The command's main in this process; the first call above and the one piped below are real processes."""
        return run_main(["-m", "serving.client", "--target", server.target, "--parquet", str(parquet), "--symbol",
                         symbol, *flags])

    r = client(art.bars_path, symbol, "--explain")  # a summary of the weights under the table
    assert r.returncode == 0, r.stderr
    tail = r.stdout.splitlines()[3 + art.meta.horizon:]
    assert [line.split(":")[0] for line in tail] == ["static variables", "encoder variables", "decoder variables",
                                                     "attention to past bars"], tail
    assert "log_return" in tail[1] and "(forecast steps: " in tail[3]
    times = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", tail[3])  # the most-attended bars: all past ones
    last = lines[0].split("last bar ")[1][:19]
    assert len(times) == 5 and all(t <= last for t in times), (times, last)
    r = client(art.bars_path, symbol, "--json", "--explain")  # the whole response, for a program to read
    assert r.returncode == 0, r.stderr
    forecast = json.loads(r.stdout)["forecasts"][0]
    q = len(art.meta.quantiles)
    assert forecast["symbol"] == symbol and forecast["model_version"] == art.meta.model_version
    assert forecast["horizon"] == art.meta.horizon and len(forecast["log_return"]) == art.meta.horizon * q
    assert len(forecast["price"]) == art.meta.horizon * q and "explanation" in forecast
    r = client(art.bars_path, "ZZ")
    assert r.returncode == 2 and "ZZ" in r.stderr
    for timeout in ("0", "inf", "1e10"):  # deadlines gRPC could not honour: refused before any call
        r = client(art.bars_path, symbol, "--timeout", timeout)
        assert r.returncode == 2 and ": give a deadline in seconds, above 0 and at most" in r.stderr, r.stderr
    # bars the model cannot use are the caller's to fix (exit 2), found before any Predict: too few of them, a
    # symbol the model does not know, a file that is not there
    table = pq.read_table(art.bars_path)
    rows = [i for i, s in enumerate(table.column("symbol").to_pylist()) if s == symbol]
    pq.write_table(table.take(rows[-(art.meta.bars_required - 1):]), tmp_path / "short.parquet")
    r = client(tmp_path / "short.parquet", symbol)
    assert r.returncode == 2 and f"has {art.meta.bars_required - 1} bars of {symbol}" in r.stderr, r.stderr
    renamed = table.set_column(table.schema.get_field_index("symbol"), "symbol", pa.array(["CL"] * table.num_rows))
    pq.write_table(renamed.take(rows), tmp_path / "cl.parquet")
    r = client(tmp_path / "cl.parquet", "CL")
    assert r.returncode == 2 and "the model does not know symbol 'CL'" in r.stderr, r.stderr
    r = client(tmp_path / "missing.parquet", symbol)
    assert r.returncode == 2 and "no such file or directory" in r.stderr and "Traceback" not in r.stderr
    # a file without a symbol column is one series: the error names the flag that names it
    pq.write_table(table.take(rows).drop_columns(["symbol"]), tmp_path / "one.parquet")
    r = client(tmp_path / "one.parquet", symbol)
    assert r.returncode == 2 and f"not in {tmp_path / 'one.parquet'} (it has SERIES)" in r.stderr, r.stderr
    assert f"give --default-symbol {symbol}" in r.stderr
    # bars further apart than the model's interval (every 5th bar) are served, with a warning that says so
    pq.write_table(table.take(rows[::5]), tmp_path / "five.parquet")
    r = client(tmp_path / "five.parquet", symbol)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3 + art.meta.horizon, r.stderr
    assert (f"warning: series[0] ({symbol}): the bars the model reads are mostly 5min apart, but the model's bar "
            "interval is 1min: its forecast steps are 1min bars") in r.stderr  # the server's Forecast.warnings
    assert "warning" not in client(art.bars_path, symbol).stderr
    # on the wire: each forecast carries its own warnings, whatever client asks; and the metric counts them
    before = metric(server.scrape(), "foxhunt_forecast_warnings_total")
    five = Bars(*(np.asarray(c)[::5] for c in (art.bars.timestamp_ns, art.bars.symbol, art.bars.open, art.bars.high,
                                                art.bars.low, art.bars.close, art.bars.volume)))
    both = pb.PredictRequest(series=[series_from_bars(five, symbol, art.meta.bars_required),
                                     request_for(art, art.meta.symbols[1]).series[0]])
    warned, fine = server.stub.Predict(both, timeout=10).forecasts
    assert [w.split(":")[0] for w in warned.warnings] == [f"series[0] ({symbol})"] and not fine.warnings
    assert metric(server.scrape(), "foxhunt_forecast_warnings_total") == before + 1
    # a bad bar of another symbol does not stop this one's forecast; one of its own is named by its file row
    other = next(i for i, s in enumerate(table.column("symbol").to_pylist()) if s != symbol)
    close = table.column("close").to_numpy().copy()
    close[other] = np.nan
    pq.write_table(table.set_column(table.schema.get_field_index("close"), "close", pa.array(close)),
                   tmp_path / "nan.parquet")
    r = client(tmp_path / "nan.parquet", symbol)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3 + art.meta.horizon, r.stderr
    r = client(tmp_path / "nan.parquet", table.column("symbol")[other].as_py())
    assert r.returncode == 2 and f"column 'close', row {other}: close is NaN or null" in r.stderr, r.stderr
    r = run_main(["-m", "serving.client", "--target", server.target, "--parquet", str(art.bars_path)])
    assert r.returncode == 2 and f"--symbol: the model knows {', '.join(art.meta.symbols)}; name the one" in r.stderr
    # a reader that goes away (`| head`): no traceback, the status a shell gives a process ended by SIGPIPE
    with subprocess.Popen([sys.executable, "-m", "serving.client", "--target", server.target, "--parquet",
                           str(art.bars_path), "--symbol", symbol], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as piped:
        assert piped.stdout is not None and piped.stderr is not None
        piped.stdout.close()  # before the client prints anything: it answers only after its calls
        err = piped.stderr.read()
    assert piped.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_failed_first_call_says_whether_a_server_answered() -> None:
    from serving.security import first_call_error

    class Failed(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

    refused = Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; Connection refused")
    assert first_call_error("GetModelInfo", refused, "10.0.0.5:50051").startswith(
        "cannot reach --target 10.0.0.5:50051: UNAVAILABLE: failed to connect to all addresses; Connection refused; "
        "is a server running there")
    answered = Failed(grpc.StatusCode.INVALID_ARGUMENT, "series[0] (ES): too few bars")
    assert first_call_error("Predict", answered, "10.0.0.5:50051") == \
        "Predict: INVALID_ARGUMENT: series[0] (ES): too few bars"


def test_client_usage_errors_are_argparses(capsys: pytest.CaptureFixture[str]) -> None:
    from serving.client import main

    with pytest.raises(SystemExit) as exc:
        main(["--symbol", "ES"])
    assert exc.value.code == 2
    assert "the following arguments are required: --parquet (or --info for the model alone)" in \
        capsys.readouterr().err


# targets gRPC refuses or cannot reach, whatever else runs on the machine
@pytest.mark.parametrize("target", ["127.0.0.1:1", "[::1]:0", "127.0.0.1:abc", "ipv4:127.0.0.1:5,127.0.0.1:70000",
                                    "dns://8.8.8.8/host"])
def test_a_target_no_server_answers_at_is_named_in_one_line_with_grpcs_reason(
        target: str, capsys: pytest.CaptureFixture[str]) -> None:
    from serving.client import main

    got = main(["--target", target, "--info", "--timeout", "5"])
    err = capsys.readouterr().err
    assert got == 1 and err.startswith(f"error: cannot reach --target {target}: ") and err.count("\n") == 1, err
    assert "is a server running there" in err and "Traceback" not in err


def test_a_models_recorded_layout_client_info_bar_columns_and_calendar_zone(art: Model, tmp_path: Path) -> None:
    """`--info` prints GetModelInfo; the client reads bars with the column names the model was trained from
    (GetModelInfo.bar_columns), as `export --bars` and `--resume` do, and mapping flags win over them; the
    server computes the calendar features in the model's time zone, as training did."""
    proto = onnx.load(str(art.model))
    trained = {"timestamp": "ts_event", "symbol": "raw_symbol", "open": "open", "high": "high", "low": "low",
               "close": "close", "volume": "volume", "default_symbol": "SERIES", "time_unit": "ns"}
    chicago = FeatureConfig.from_dict({**art.meta.feature_config.to_dict(), "calendar_tz": "America/Chicago"})
    for prop in proto.metadata_props:
        if prop.key == "foxhunt.column_map":
            prop.value = json.dumps(trained)
        if prop.key == "foxhunt.feature_config":
            prop.value = json.dumps(chicago.to_dict())
    onnx.save(proto, str(tmp_path / "mapped.onnx"))
    table = pq.read_table(art.bars_path)
    pq.write_table(table.rename_columns([{"timestamp": "ts_event", "symbol": "raw_symbol"}.get(n, n)
                                         for n in table.column_names]), tmp_path / "dbn.parquet")
    s = serve(tmp_path / "mapped.onnx", tmp_path / "server.log", "--device", "cpu")
    try:
        s.wait_serving()

        def client(*flags: str) -> subprocess.CompletedProcess[str]:
            return run_main(["-m", "serving.client", "--target", s.target, *flags])

        r = client("--info")
        assert r.returncode == 0, r.stderr
        facts = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.stdout.splitlines())
        assert facts["symbols"] == ", ".join(art.meta.symbols)
        assert facts["bars required"].startswith(f"{art.meta.bars_required} per series")
        assert "timestamp=ts_event" in facts["bar columns"] and "symbol=raw_symbol" in facts["bar columns"]
        assert facts["runs on"] == "CPUExecutionProvider (--device cpu)"
        assert facts["torch"] == "not imported by the server process"
        assert facts["calendar"] == "time of day and day of week in America/Chicago"
        r = client("--info", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["bar_columns"] == trained, r.stdout
        info = json.loads(r.stdout)  # every field, those at their defaults too (proto3 JSON leaves them out)
        assert info["torch_imported"] is False and info["user_feature_columns"] == [] and info["fallback_warning"] == ""
        r = client("--info", "--symbol", "ES")
        assert r.returncode == 2 and "--info prints the model's information alone" in r.stderr
        symbol = art.meta.symbols[0]
        r = client("--parquet", str(tmp_path / "dbn.parquet"), "--symbol", symbol)  # no mapping flags
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"{symbol}  model ")
        r = client("--parquet", str(art.bars_path), "--symbol", symbol)  # a file of another layout
        assert r.returncode == 2 and "required column 'ts_event' is missing" in r.stderr, r.stderr
        assert "note: the names not given as flags are the model's training run's (--time-col ts_event, " \
            "--symbol-col raw_symbol); pass the flags for this file's names" in r.stderr, r.stderr
        r = client("--parquet", str(art.bars_path), "--symbol", symbol, "--time-col", "timestamp", "--symbol-col",
                   "symbol")
        assert r.returncode == 0, r.stderr
        # the calendar in Chicago time: the server's answer is the model run on features computed so
        session = ort.InferenceSession(str(tmp_path / "mapped.onnx"), providers=["CPUExecutionProvider"])
        answer = quantiles_of(s.stub.Predict(request_for(art, symbol), timeout=10).forecasts[0])
        anchor = np.array([art.bars.series_slices()[symbol].stop - 1])
        runs = {}
        for cfg in (chicago, art.meta.feature_config):
            windows = gather_windows(build_frame(art.bars, cfg, symbols=list(art.meta.symbols)), anchor,
                                     art.meta.encoder_length)
            runs[cfg.calendar_tz] = session.run([QUANTILES], {k: windows[k] for k in MODEL_INPUTS})[0][0]
        np.testing.assert_allclose(answer, runs["America/Chicago"], rtol=RTOL, atol=ATOL)
        assert not np.allclose(answer, runs["UTC"], rtol=RTOL, atol=ATOL)  # the zone made a difference
    finally:
        s.kill()


# ---- overload, deadlines, signals, devices -----------------------------------------------------------
def test_callers_whose_deadlines_pass_get_deadline_exceeded_and_log_no_errors(art: Model, tmp_path: Path) -> None:
    """Calls with a 20 ms deadline from 16 threads: many expire, wherever that happens (in gRPC's core, queued,
    running). An answer or error status sent to a caller already gone would make gRPC log an ERROR with a
    traceback: the server sends nothing then. What holds at any speed: each call ends OK or
    DEADLINE_EXCEEDED, the server never logs an error, and, once no call is in flight, it counted no more
    deadlines than the callers saw and at least as many answers. The counting itself is checked with an
    injected deadline in test_serving_units.py."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu")
    try:
        s.wait_serving()
        request = request_for(art, art.meta.symbols[0])
        channels = [grpc.insecure_channel(s.target) for _ in range(4)]
        stubs = [pb_grpc.ForecasterStub(c) for c in channels]

        def call(i: int) -> str:
            try:
                stubs[i % 4].Predict(request, timeout=0.02)
                return "OK"
            except grpc.RpcError as exc:
                return str(exc.code().name)

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(call, range(400)))
        for c in channels:
            c.close()
        assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"}, codes[:20]
        deadline = time.monotonic() + 60
        while metric(text := s.scrape(), "foxhunt_inflight_requests"):  # handlers still ending
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.05)
        counted = {code: metric(text, "foxhunt_requests_total", method="Predict", code=code)
                   for code in ("OK", "DEADLINE_EXCEEDED", "INTERNAL")}
        assert counted["DEADLINE_EXCEEDED"] <= codes.count("DEADLINE_EXCEEDED") and \
            counted["OK"] >= codes.count("OK") and counted["INTERNAL"] == 0, (counted, codes.count("OK"))
        assert s.proc.poll() is None
        log = s.log_text()
        assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
    finally:
        s.kill()


def test_overload_is_resource_exhausted_and_queued_deadlines_are_not_run(art: Model, tmp_path: Path) -> None:
    """Two calls wait 3 s for company (a fixed wait) and fill --max-concurrent 2: every other call meanwhile is
    refused RESOURCE_EXHAUSTED, logged once. A call whose deadline passes while it waits for its batch is not
    run: the batch that closes after it holds only the call that came next."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--max-concurrent", "2",
              "--batch-wait", "fixed", "--max-delay-ms", "3000")
    try:
        s.wait_serving()
        request = request_for(art, art.meta.symbols[0])

        def call(timeout: float = 20) -> str:
            try:
                s.stub.Predict(request, timeout=timeout)
                return "OK"
            except grpc.RpcError as exc:
                assert exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "--max-concurrent 2" in (exc.details() or "")
                return exc.code().name

        def inflight(n: int) -> None:
            deadline = time.monotonic() + 60
            while metric(s.scrape(), "foxhunt_inflight_requests") != n:
                assert time.monotonic() < deadline, s.log_text()
                time.sleep(0.02)

        with ThreadPoolExecutor(40) as pool:
            held = [pool.submit(call) for _ in range(2)]
            inflight(2)
            refused = list(pool.map(lambda _: call(), range(38)))  # a burst: every call past the limit is told so
            assert [f.result() for f in held] == ["OK", "OK"]
        assert refused == ["RESOURCE_EXHAUSTED"] * 38
        overload = [ln for ln in s.log_text().splitlines() if "overloaded" in ln]  # seen, not flooded: one line
        assert len(overload) == 1 and "WARNING" in overload[0] and "overloaded: refusing calls RESOURCE_EXHAUSTED, " \
            "--max-concurrent 2 in flight (a count of them follows every 60 s while it lasts); raise " \
            "--max-concurrent" in overload[0], overload

        before = s.scrape()
        assert call(timeout=0.3) == "DEADLINE_EXCEEDED"  # it waits 3 s for its batch
        assert call() == "OK"  # joins that batch, and is alone in it
        after = s.scrape()
        for name in ("foxhunt_batch_windows_count", "foxhunt_batch_calls_sum"):
            assert metric(after, name) == metric(before, name) + 1, "a call whose deadline passed was run"
        assert s.proc.poll() is None
    finally:
        s.kill()


def test_sighup_reloads_a_good_model_and_refuses_broken_ones(art: Model, tmp_path: Path) -> None:
    served = tmp_path / "model.onnx"
    shutil.copy(art.model, served)
    s = serve(served, tmp_path / "server.log", "--device", "cpu")
    stop = threading.Event()
    errors: list[str] = []

    def hammer() -> None:  # calls during every reload: none may fail
        request = request_for(art, art.meta.symbols[0])
        while not stop.is_set():
            try:
                s.stub.Predict(request, timeout=10)
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")

    def replace(data: bytes) -> None:  # how an operator should update the file: write beside, then rename
        tmp = tmp_path / ".model.onnx.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, served)

    def reload_and_wait(result: str) -> str:
        before = metric(s.scrape(), "foxhunt_reloads_total", file="model", result=result)
        s.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while metric(s.scrape(), "foxhunt_reloads_total", file="model", result=result) == before:
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.05)
        return s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).model_version

    try:
        s.wait_serving()
        thread = threading.Thread(target=hammer, daemon=True)
        thread.start()
        original = art.model.read_bytes()
        replace(b"this is not an onnx model")
        assert reload_and_wait("refused") == art.meta.model_version
        proto = onnx.load_from_string(original)
        for p in proto.metadata_props:
            if p.key == "foxhunt.format":
                p.value = "something else"
        replace(proto.SerializeToString())
        assert reload_and_wait("refused") == art.meta.model_version
        assert "reload refused" in s.log_text() and "not a foxhunt-tft model" in s.log_text()

        proto = onnx.load_from_string(original)
        for p in proto.metadata_props:
            if p.key == "foxhunt.model_version":
                p.value = "v2-reloaded"
        replace(proto.SerializeToString())
        assert reload_and_wait("ok") == "v2-reloaded"
        response = s.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10)
        assert response.model_version == "v2-reloaded" == response.forecasts[0].model_version
        assert "asks callers for something else" not in s.log_text()  # the same contract: nothing to name

        renamed = [art.meta.symbols[0], "YM"]  # a model whose second symbol is another: served, the change named
        for p in proto.metadata_props:
            if p.key == "foxhunt.symbols":
                p.value = json.dumps(renamed)
            if p.key == "foxhunt.model_version":
                p.value = "v3-renamed"
        replace(proto.SerializeToString())
        assert reload_and_wait("ok") == "v3-renamed"
        assert f"asks callers for something else: symbols {list(art.meta.symbols)} -> {renamed}" in s.log_text()
        assert s.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).model_version == "v3-renamed"
        stop.set()
        thread.join(timeout=10)
        assert not errors, errors[:5]
        assert s.proc.poll() is None
    finally:
        stop.set()
        s.kill()


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (bit 0 of SigCgt), i.e. its start-up hold is in place."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"SigCgt:\s*([0-9a-f]+)", status).group(1), 16) & 1)  # type: ignore[union-attr]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_sighup_while_the_server_starts_neither_kills_it_nor_is_lost(art: Model, tmp_path: Path,
                                                                        workers: str) -> None:
    """SIGHUP's default action ends a process. One that comes while the model loads must not kill the server, and
    one that comes after the model file was read (the file then replaced) is honoured by a reload once warm;
    with --workers 2, sent to the supervisor while its second worker is starting, every worker ends up on it."""
    served = tmp_path / "model.onnx"
    shutil.copy(art.model, served)
    proto = onnx.load(str(served))
    for prop in proto.metadata_props:
        if prop.key == "foxhunt.model_version":
            prop.value = "v2-while-starting"
    (tmp_path / "v2.onnx").write_bytes(proto.SerializeToString())
    log = tmp_path / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "serving", "--model", str(served), "--port", "0", "--device",
                                 "cpu", "--workers", workers, "--metrics-port", "0"], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sighup(proc.pid):  # the event loop's handler, set before the model loads
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        read = f"model {art.meta.model_version} (sha256 "
        assert read not in log.read_text()  # caught before the model file is read
        proc.send_signal(signal.SIGHUP)  # before any file is read: the reload once warm reads the same file
        while log.read_text().count(read) < int(workers):  # every worker has read the file (the last still starting)
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        os.replace(tmp_path / "v2.onnx", served)
        proc.send_signal(signal.SIGHUP)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), log.read_text()
        target = line.split()[-1]
        endpoints = [proc.stdout.readline().removeprefix("metrics on ").strip() for _ in range(int(workers))]

        def version() -> str:
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                try:  # a fresh connection each time: the kernel spreads them over the workers
                    info = pb_grpc.ForecasterStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
                    return info.model_version
                except grpc.RpcError:
                    time.sleep(0.05)  # still warming up
                    return ""

        for endpoint in endpoints:  # every worker's own metrics say it serves the file as replaced ...
            while not metric(urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode(),
                             "foxhunt_model_info", version="v2-while-starting"):
                assert proc.poll() is None and time.monotonic() < deadline, (endpoint, log.read_text())
                time.sleep(0.02)
        assert [version() for _ in range(16)] == ["v2-while-starting"] * 16, log.read_text()  # ... and answers so
        assert "reloading it once warm" in log.read_text() or "SIGHUP: reloading" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_drains_in_flight_calls_and_exits_0(art: Model, tmp_path: Path) -> None:
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--batch-wait", "fixed",
                      "--max-delay-ms", "1000", "--grace", "10")
    try:
        s.wait_serving()
        request = request_for(art, art.meta.symbols[0])
        with ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(s.stub.Predict, request, timeout=20) for _ in range(4)]
            deadline = time.monotonic() + 60
            while metric(s.scrape(), "foxhunt_inflight_requests") < 4:  # the calls wait for their batch
                assert time.monotonic() < deadline, s.log_text()
                time.sleep(0.02)
            s.proc.send_signal(signal.SIGTERM)
            answers = [c.result() for c in calls]
        assert all(a.forecasts for a in answers)
        assert s.proc.wait(timeout=60) == 0, s.log_text()
        assert "drained" in s.log_text()
    finally:
        s.kill()


def test_drain_delay_reports_not_serving_while_calls_still_work_and_a_health_watch_holds_no_drain(
        art: Model, tmp_path: Path) -> None:
    """--drain-delay: on SIGTERM health turns NOT_SERVING first (a balancer polling it stops routing here) while
    Predict still answers; then the drain (a second SIGTERM skips the rest of the delay), which an open health
    Watch (gRPC's client-side health checking) does not hold for the whole --grace."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--drain-delay", "120", "--grace", "60")
    try:
        s.wait_serving()
        health = health_pb2_grpc.HealthStub(s.channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=120)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        s.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert s.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts  # still served
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as ended:  # the drain ends the Watch itself, rather than wait for it
            next(watch)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (ended.value.details() or "")
        assert s.proc.wait(timeout=30) == 0, s.log_text()  # not the 60 s grace the Watch would have held
        log = s.log_text()
        assert "health NOT_SERVING; serving on for --drain-delay 120 s, then draining" in log
        assert float(re.findall(r"drained in ([\d.]+) s", log)[0]) < 30, log[-2000:]
    finally:
        s.kill()


def test_a_second_sigterm_skips_the_rest_of_the_drain_delay(art: Model, tmp_path: Path) -> None:
    """An operator who signals again wants the stop now: the second SIGTERM ends --drain-delay's wait and the
    drain runs (exit 0), rather than the process serving on for the whole delay."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--drain-delay", "120", "--grace", "60")
    try:
        s.wait_serving()
        health = health_pb2_grpc.HealthStub(s.channel)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status \
                != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.05)
        assert s.stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10).forecasts  # in the delay
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0, s.log_text()  # not the 120 s delay
        log = s.log_text()
        assert "SIGTERM while stopping" in log and "a second stop signal: the rest of --drain-delay skipped" in log
        assert "drained in" in log
    finally:
        s.kill()


def test_a_sigterm_the_moment_the_server_says_it_listens_is_a_drain(art: Model) -> None:
    """A supervisor (--workers, an orchestrator) may signal a server as soon as it prints `listening on`: the
    server takes stop signals from before that line, so the signal drains it (exit 0), never kills it outright
    (-15), as it did in 3 of 5 tries before."""
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "serving", "--model", str(art.model), "--port", "0", "--device",
                                 "cpu", "--threads", "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("listening on ")
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and "SIGTERM: draining" in err, (proc.returncode, err[-2000:])
        finally:
            proc.kill()
            proc.wait()


def test_a_server_that_never_reported_serving_stops_without_its_drain_delay(art: Model) -> None:
    """No balancer routes to a server still warming up (or whose warm-up failed): its stop skips the delay."""
    from serving.model import load_model
    from serving.server import ServerConfig, build_server

    async def main() -> float:
        config = ServerConfig(model_path=art.model, port=0, device="cpu", drain_delay_s=60.0)
        server = build_server(config, load_model(art.model, "cpu", threads=1))
        await server.start()
        started = time.monotonic()
        await server.stop(1.0)
        return time.monotonic() - started

    assert asyncio.run(main()) < 30  # not the 60 s delay


def test_a_sigterm_during_the_warm_up_stops_it_between_two_runs(art: Model) -> None:
    import threading

    from serving.model import WarmUpStopped, load_model

    model = load_model(art.model, "cpu", threads=1, max_batch=64)
    stop = threading.Event()
    stop.set()
    with pytest.raises(WarmUpStopped, match="stopped before batch size 1"):
        model.warm_up(stop)
    assert not model.warmed
    assert model.warm_up(threading.Event()) > 0 and model.warmed


def test_the_standard_asyncio_loop_serves_too_and_uvloop_is_never_swapped_quietly(
        art: Model, server: LiveServer, tmp_path: Path) -> None:
    """--event-loop asyncio gives the default (uvloop) server's answers and drains on SIGTERM; without the
    uvloop package the default refuses to start, naming the fix, rather than run on another loop."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--event-loop", "asyncio")
    try:
        s.wait_serving()
        request = request_for(art, art.meta.symbols[0])
        mine, default = s.stub.Predict(request, timeout=10), server.stub.Predict(request, timeout=10)
        np.testing.assert_array_equal(quantiles_of(mine.forecasts[0]), quantiles_of(default.forecasts[0]))
        assert "asyncio event loop" in s.log_text() and "uvloop event loop" in server.log_text()
        s.proc.send_signal(signal.SIGINT)  # Ctrl-C drains as SIGTERM does, and the log says which came
        assert s.proc.wait(timeout=15) == 0, s.log_text()
        assert "SIGINT: draining" in s.log_text()
    finally:
        s.kill()
    no_uvloop = "import sys; sys.modules['uvloop'] = None; from serving.__main__ import main; raise SystemExit(main())"
    r = subprocess.run([sys.executable, "-c", no_uvloop, "--model", str(art.model), "--port", "0", "--device", "cpu"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "listening" not in r.stdout, r.stderr[-2000:]
    assert "error: --event-loop uvloop (the default) needs the uvloop package" in r.stderr
    assert "--event-loop asyncio" in r.stderr
    assert "Traceback" not in r.stderr


def _wait_metric(s: LiveServer, endpoint: str, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + 60
    while metric(s.scrape(endpoint), name, **labels) < value:
        assert time.monotonic() < deadline and s.alive(), s.log_text()
        time.sleep(0.05)


def worker_pids(s: LiveServer) -> list[int]:
    """The workers' process ids, from the supervisor's `worker I (pid P) listening` log lines."""
    return [int(pid) for pid in re.findall(r"worker \d+ \(pid (\d+)\) listening", s.log_text())]


def _records(text: str) -> list[dict[str, Any]]:
    """The JSON records of a --log-format json log (native code's own lines, e.g. gRPC's, are left out)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_json_logs_are_one_record_a_line_whoever_writes_them(art: Model, tmp_path: Path) -> None:
    """--log-format json: the server's records (each worker's, with its index; the supervisor's) and a failed
    start's last word parse as JSON objects with time, level, logger and message."""
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--workers", "2", "--log-format", "json")
    try:
        s.wait_serving()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0, s.log_text()[-3000:]
    finally:
        s.kill()
    text = s.log_text()
    records = _records(text)
    stray = [ln for ln in text.splitlines() if ln and not ln.startswith("{") and not re.match(r"[IWE]\d{4} ", ln)]
    assert not stray, stray[:5]  # every line is a record, or gRPC's own (I1202 12:00:00.000000 ...)
    assert all(set(r) >= {"time", "level", "logger", "message"} and r["time"].endswith("Z") for r in records)
    listening = [r for r in records if r["message"].startswith("listening on")]
    assert sorted(r.get("worker") for r in listening) == [0, 1], listening
    assert any(r["message"].startswith("worker 1 (pid ") and "worker" not in r for r in records)  # the supervisor
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    r = subprocess.run([sys.executable, "-m", "serving", "--model", str(bad), "--port", "0", "--device", "cpu",
                        "--log-format", "json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "error:" not in r.stderr, r.stderr[-2000:]
    last = _records(r.stderr)[-1]
    assert last["level"] == "ERROR" and last["message"].startswith(f"{bad}: ") and "worker" not in last, last


def test_workers_share_one_port_reload_together_and_drain(art: Model, tmp_path: Path) -> None:
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--workers", "2")
    try:
        assert len(s.metrics_all) == 2 and len(set(s.metrics_all)) == 2  # one endpoint per worker
        for endpoint in s.metrics_all:
            _wait_metric(s, endpoint, "foxhunt_ready", 1)
        request = request_for(art, art.meta.symbols[0])
        answers = []
        for _ in range(16):  # separate connections: the kernel spreads them over the workers
            with grpc.insecure_channel(s.target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                answers.append(pb_grpc.ForecasterStub(ch).Predict(request, timeout=10))
        assert len({a.forecasts[0].SerializeToString() for a in answers}) == 1  # the same answer from each
        served = [metric(s.scrape(e), "foxhunt_requests_total", method="Predict", code="OK") for e in s.metrics_all]
        assert sum(served) == 16 and min(served) > 0, served  # both workers answered
        s.proc.send_signal(signal.SIGHUP)  # forwarded: each worker reloads the model file
        for endpoint in s.metrics_all:
            _wait_metric(s, endpoint, "foxhunt_reloads_total", 1, file="model", result="ok")
        # a second set on the same port is refused, not let in to share it (SO_REUSEPORT would allow that)
        port = s.target.rsplit(":", 1)[1]
        other = subprocess.run([sys.executable, "-m", "serving", "--model", str(art.model), "--port", port,
                                "--device", "cpu", "--workers", "2"], cwd=REPO, capture_output=True, text=True,
                               timeout=60)
        assert other.returncode == 2 and f"cannot listen on 127.0.0.1:{port}: Address already in use; is another " \
            "process using the port?" in other.stderr, other.stderr[-2000:]
        single = subprocess.run([sys.executable, "-m", "serving", "--model", str(art.model), "--port", port,
                                 "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert single.returncode == 2, single.stderr[-2000:]  # gRPC's own log line says why; then one line of ours
        assert "Address already in use" in single.stderr, single.stderr[-2000:]
        errors = [ln for ln in single.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: cannot listen on 127.0.0.1:{port}: "), errors
        pids = worker_pids(s)
        assert len(pids) == 2
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0, s.log_text()
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        log = s.log_text()  # the workers share one stderr: each line says whose it is
        assert all(log.count(f"[worker {i}] {what}") == 1 for i in (0, 1)
                   for what in ("reloaded: serving model", "SIGTERM: draining")), log[-3000:]
        assert log.count("drained") == 2
    finally:
        s.kill()


def test_a_terminals_signals_reach_each_worker_once(art: Model, tmp_path: Path) -> None:
    """Ctrl-C and a hang-up go to the terminal's whole foreground process group, the supervisor's: each worker
    gets them once, from the supervisor, so a hang-up reloads once and one Ctrl-C keeps --drain-delay (a second
    signal would skip it)."""
    s = LiveServer(art.model, tmp_path / "server.log", "--metrics-port", "0", "--workers", "2", "--drain-delay", "1",
                   new_session=True)
    try:
        for endpoint in s.metrics_all:
            _wait_metric(s, endpoint, "foxhunt_ready", 1)
        os.killpg(s.proc.pid, signal.SIGHUP)
        for endpoint in s.metrics_all:
            _wait_metric(s, endpoint, "foxhunt_reloads_total", 1, file="model", result="ok")
        time.sleep(2)  # time for a second reload, were there one
        assert [metric(s.scrape(e), "foxhunt_reloads_total", file="model", result="ok") for e in s.metrics_all] \
            == [1, 1], s.log_text()
        os.killpg(s.proc.pid, signal.SIGINT)
        assert s.proc.wait(timeout=30) == 0, s.log_text()
        log = s.log_text()
        assert all(log.count(f"[worker {i}] {what}") == 1 for i in (0, 1)
                   for what in ("SIGINT: draining", "health NOT_SERVING; serving on for --drain-delay 1 s")), log
        assert "while stopping" not in log and "second stop signal" not in log, log
    finally:
        s.kill()


def test_a_sigterm_while_a_worker_starts_reaches_each_worker_once(art: Model, tmp_path: Path) -> None:
    """The supervisor stops a set whose start a SIGTERM cut short: the workers it had forwarded the signal to are
    not signalled again (a second signal would skip the first worker's --drain-delay)."""
    log = tmp_path / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "serving", "--model", str(art.model), "--port", "0",
                                 "--device", "cpu", "--threads", "1", "--workers", "2", "--drain-delay", "1"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 60
        while "worker 0 (pid" not in log.read_text():  # worker 0 listens; worker 1 is only now being started
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        text = log.read_text()
        assert text.count("[worker 0] SIGTERM: draining") == 1, text
        assert "while stopping" not in text and "second stop signal" not in text, text
    finally:
        proc.kill()
        proc.wait()


def test_a_bracketed_ipv6_host_is_taken_as_the_address() -> None:
    from serving.__main__ import bare_host, build_parser

    assert build_parser().parse_args(["--model", "m.onnx", "--host", "[::1]"]).host == "::1"
    assert build_parser().parse_args(["--model", "m.onnx", "--metrics-host", "[::]"]).metrics_host == "::"
    assert bare_host("0.0.0.0") == "0.0.0.0" and bare_host("::1") == "::1"


def test_workers_reserve_the_port_a_single_server_just_left() -> None:
    """A server that drained closed its connections first, leaving its end in TIME_WAIT on the port for a
    minute: a --workers set started there at once reserves the port (as a single server binds it), not
    'address in use'; a port someone listens on is still refused."""
    from serving.workers import reserve_port

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds a single server
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's end closes first: it is the one left in TIME_WAIT
    time.sleep(0.05)
    client.close()
    listener.close()
    reserve_port("127.0.0.1", port).close()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", port)


def test_a_worker_that_does_not_start_in_time_is_named_and_the_set_exits_1(art: Model) -> None:
    """The supervisor waits START_TIMEOUT_S for each worker's `listening on` (here cut to 0.3 s, under any
    model's load): then it says so and exits 1, not 143 as if it had been sent SIGTERM itself."""
    code = ("import logging, sys; logging.basicConfig(level='INFO'); import serving.workers as w; "
            "from pathlib import Path; from serving.server import ServerConfig; w.START_TIMEOUT_S = 0.3; "
            f"sys.exit(w.run_workers(ServerConfig(model_path=Path({str(art.model)!r}), port=0, device='cpu', "
            "threads=1), 2, 'INFO'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr[-2000:]
    assert re.search(r"ERROR:serving:worker 0 \(pid \d+\) did not start listening within 0\.3 s \(loading "
                     r"the model\); stopping the workers", r.stderr), r.stderr[-2000:]


def test_a_dead_worker_or_supervisor_ends_the_set_and_a_bad_model_stops_the_first(art: Model, tmp_path: Path) -> None:
    s = serve(art.model, tmp_path / "server.log", "--device", "cpu", "--workers", "2")
    try:
        pids = worker_pids(s)
        os.kill(pids[1], signal.SIGKILL)
        assert s.proc.wait(timeout=30) == 128 + signal.SIGKILL, s.log_text()
        assert "worker 1" in s.log_text() and "stopping the other workers" in s.log_text()
    finally:
        s.kill()
    s = serve(art.model, tmp_path / "server2.log", "--device", "cpu", "--workers", "2")
    try:  # the supervisor killed outright: its workers see their stdin close, drain and exit
        pids = worker_pids(s)
        s.proc.kill()
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in pids):
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.1)
        assert s.log_text().count("supervisor is gone") == 2
    finally:
        s.kill()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    r = subprocess.run([sys.executable, "-m", "serving", "--model", str(bad), "--port", "0", "--device", "cpu",
                        "--workers", "3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("error:") == 1 and "listening" not in r.stdout  # the first worker's one message
    assert "[worker 0] error: " in r.stderr, r.stderr[-2000:]  # whose, as its log lines say


def test_device_auto_falls_back_loudly_and_cuda_refuses(art: Model, tmp_path: Path) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers() and any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("a GPU is visible: the fallback cannot be provoked here (scripts/gpu_check covers CUDA)")
    r = subprocess.run([sys.executable, "-m", "serving", "--model", str(art.model), "--port", "0", "--device",
                        "cuda"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "listening" not in r.stdout
    assert re.search(r"error: CUDA requested but .*(failed to load|no CUDA|GPU)", r.stderr), r.stderr[-2000:]
    if "CUDAExecutionProvider" in ort.get_available_providers():  # its attempt's own log is shown in full
        assert ":onnxruntime:" in r.stderr, r.stderr[-2000:]

    s = serve(art.model, tmp_path / "server.log", "--device", "auto")
    try:
        s.wait_serving()
        info = s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert info.provider == "CPUExecutionProvider" and info.device_requested == "auto"
        assert info.fallback_warning.startswith("--device auto fell back to the CPU")
        log = s.log_text()
        assert "WARNING" in log and log.count("fell back to the CPU") == 1
        assert ":onnxruntime:" not in log, log[-2000:]  # the warning names the reason: no screenful of red
        assert metric(s.scrape(), "foxhunt_model_info", fallback="yes") == 1
    finally:
        s.kill()


# ---- in process: readiness and a model without explain outputs ----------------------------------------
def _quantiles_only(model: Path, out: Path) -> Path:
    """The same model with its explain outputs dropped and its metadata saying so (and the new graph's digest,
    as export records it)."""
    from features.model_meta import graph_digest

    proto = onnx.load(str(model))
    keep = [o for o in proto.graph.output if o.name == QUANTILES]
    del proto.graph.output[:]
    proto.graph.output.extend(keep)
    digest = graph_digest(proto.SerializeToString())
    for p in proto.metadata_props:
        if p.key == "foxhunt.explain":
            p.value = "false"
        if p.key == "foxhunt.graph_sha256":
            p.value = digest
    onnx.save(proto, str(out))
    return out


def test_not_serving_until_warm_and_explain_needs_explain_outputs(art: Model, tmp_path: Path) -> None:
    from grpc import aio

    from serving.model import load_model
    from serving.server import ServerConfig, build_server

    path = _quantiles_only(art.model, tmp_path / "quantiles_only.onnx")

    async def main() -> None:
        config = ServerConfig(model_path=path, port=0, device="cpu")
        server = build_server(config, load_model(path, "cpu", threads=1))
        port = await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                stub = pb_grpc.ForecasterStub(channel)
                check = health_pb2.HealthCheckRequest(service=SERVICE)
                assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(aio.AioRpcError) as info:
                    await stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in (info.value.details() or "")
                await server.warm_up()
                assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
                info_ = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
                assert info_.explain_available is False
                with pytest.raises(aio.AioRpcError) as info:
                    await stub.Predict(request_for(art, art.meta.symbols[0], explain=True), timeout=10)
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "without explain outputs" in (info.value.details() or "")
                r = await asyncio.to_thread(  # the CLI client asks GetModelInfo first, and says which flag to drop
                    subprocess.run, [sys.executable, "-m", "serving.client", "--target", f"127.0.0.1:{port}",
                                     "--parquet", str(art.bars_path), "--symbol", art.meta.symbols[0], "--explain"],
                    cwd=REPO, capture_output=True, text=True, timeout=60)
                assert r.returncode == 2 and "exported without explain outputs" in r.stderr, r.stderr
                assert "drop --explain" in r.stderr
                (f,) = (await stub.Predict(request_for(art, art.meta.symbols[0]), timeout=10)).forecasts
                assert len(f.log_return) == art.meta.horizon * len(art.meta.quantiles)
                assert not f.HasField("explanation")
        finally:
            await server.stop(1)

    asyncio.run(main())


def test_serving_ab_compares_two_checkouts_served_at_once(art: Model, tmp_path: Path) -> None:
    """benchmarks/serving_ab: both builds' servers answer (a row of latencies per round and a summary), and
    a directory that is no checkout, or a missing model, is refused with a message before anything starts."""
    cmd = [sys.executable, "-m", "benchmarks.serving_ab", "--model", str(art.model), "--parquet", str(art.bars_path),
           "--duration", "1", "--rounds", "1", "--pool", "16"]
    done = subprocess.run([*cmd, "--a", str(REPO)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(r"^\| 1 \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) \|", done.stdout, re.M)
    assert row is not None, done.stdout
    assert int(row.group(1)) > 0 and float(row.group(2)) > 0 and float(row.group(3)) > 0
    assert re.search(r"^summary: B - A p50 over the rounds [+-][\d.]+ ms$", done.stdout, re.M), done.stdout
    refused = run_main([*cmd[1:], "--a", str(tmp_path)])
    assert refused.returncode == 2 and "holds no serving package" in refused.stderr
    refused = run_main([*cmd[1:4], str(tmp_path / "none.onnx"), *cmd[5:], "--a", str(REPO)])
    assert refused.returncode == 2 and "cannot read the model file" in refused.stderr
    assert "Traceback" not in refused.stderr


def assert_paced(row: dict[str, Any], bare: dict[str, Any], rate: float, summary: dict[str, Any]) -> None:
    """A paced level of serving_load (at most 1 s long): one client held to `rate` calls a second, far below the
    hundreds a closed-loop client makes, against bare session.run as far apart; the server's CPU share
    and p50 over its peer in the summary."""
    assert row["rate"] == rate and row["concurrency"] == 1 and not row["errors"], row
    assert 0 < row["requests"] <= rate + 1, row
    assert row["server_cpu_pct"] > 0 and row["p50_ms"] > 0, row
    assert bare["rate"] == rate and 0 < bare["requests"] <= rate + 1, bare
    assert summary[f"paced_{rate:g}_p50_ms"] == pytest.approx(row["p50_ms"], abs=1e-3)
    assert summary[f"paced_{rate:g}_p50_over_bare_ms"] == pytest.approx(row["p50_ms"] - bare["p50_ms"], abs=1e-3)
    assert summary[f"paced_{rate:g}_server_cpu_pct"] == pytest.approx(row["server_cpu_pct"], abs=0.1)


def test_serving_load_reports_every_row_against_bare_onnx_runtime(art: Model, tmp_path: Path) -> None:
    """benchmarks/serving_load, the issue's acceptance benchmark, end to end at small sizes: the bare rows,
    one row per concurrency level with the server's own metrics, the gRPC floor, and a summary whose
    overhead is the server's p50 less bare session.run's; a bad model file or level is refused by name."""
    cmd = [sys.executable, "-m", "benchmarks.serving_load", "--model", str(art.model), "--parquet",
           str(art.bars_path), "--duration", "0.5", "--pool", "16", "--client-procs", "1"]
    runs = {  # side by side: each level spends much of its time starting its client processes
        "aio": ["--concurrency", "1,4", "--stream", "--no-floor"],
        "paced": ["--concurrency", "1", "--rate", "30"],
        # grpc's blocking stub, one thread per client: what a strategy engine calling from its own loop sees (and
        # what the server costs while idle after it: next to nothing, as it sleeps between calls)
        "sync": ["--concurrency", "1,3", "--client", "sync", "--no-floor", "--idle", "1", "--rate", "20"],
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        started = {name: pool.submit(subprocess.run, [*cmd, *flags, "--json", str(tmp_path / f"{name}.json")],
                                     cwd=REPO, capture_output=True, text=True, timeout=180)
                   for name, flags in runs.items()}
    done = {name: f.result() for name, f in started.items()}
    for r in done.values():
        assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "aio.json").read_text())
    rows = {(r["name"], r["concurrency"]): r for r in report["levels"]}
    bare = rows[("bare ORT: session.run", 1)]
    assert bare["requests"] > 0 and not bare["errors"]
    for c in (1, 4):
        row = rows[(f"server, concurrency {c}", c)]
        assert row["requests"] > 0 and not row["errors"], row
        assert row["mean_batch"] >= 1 and row["handler_ms"] > 0 and row["batch_ms"] > 0 and row["server_cpu_ms"] > 0
        assert row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
        assert set(row["step_us"]) == {"parse", "features", "run", "response"} and all(
            us > 0 for us in row["step_us"].values()), row["step_us"]
    assert "| server steps, mean µs" in done["aio"].stdout
    summary = report["summary"]
    assert summary["errors"] == 0
    expected = rows[("server, concurrency 1", 1)]["p50_ms"] - bare["p50_ms"]
    assert summary["p50_overhead_ms_at_1"] == pytest.approx(expected, abs=1e-3)
    assert "| server, concurrency 4" in done["aio"].stdout and report["client"] == "aio"
    for c in (1, 4):  # --stream: each client on one open PredictStream, timed by the server per request
        row = rows[(f"server, concurrency {c}, stream", c)]
        assert row["requests"] > 0 and not row["errors"] and row["handler_ms"] > 0 and row["mean_batch"] >= 1, row
    expected = rows[("server, concurrency 1, stream", 1)]["p50_ms"] - bare["p50_ms"]
    assert summary["stream_p50_overhead_ms_at_1"] == pytest.approx(expected, abs=1e-3)
    assert not any(name.startswith("gRPC floor") for name, _ in rows)  # --no-floor
    report = json.loads((tmp_path / "paced.json").read_text())
    rows = {(r["name"], r["concurrency"]): r for r in report["levels"]}
    summary = report["summary"]
    assert summary["errors"] == 0
    assert_paced(rows[("server, paced 30/s", 1)], rows[("bare ORT: session.run, 33.3333 ms apart", 1)], 30, summary)
    empty = rows[("gRPC floor: health Check, paced 30/s", 1)]  # an empty call after the same pause
    assert empty["rate"] == 30 and 0 < empty["requests"] <= 31 and not empty["errors"], empty
    assert summary["paced_30_floor_p50_ms"] == pytest.approx(empty["p50_ms"], abs=1e-3)
    floor_1 = rows[("gRPC floor: health Check, conc. 1", 1)]  # the closed-loop floor is still its own row
    assert summary["floor_p50_ms_at_1"] == pytest.approx(floor_1["p50_ms"], abs=1e-3)
    report = json.loads((tmp_path / "sync.json").read_text())
    assert report["client"] == "sync" and report["summary"]["errors"] == 0
    assert 0 <= report["summary"]["idle_server_cpu_pct"] < 50, report["summary"]
    rows = {r["name"]: r for r in report["levels"]}
    for c in (1, 3):
        row = rows[f"server, concurrency {c}, sync client"]
        assert row["requests"] > 0 and not row["errors"] and row["mean_batch"] >= 1, row
    assert not any(name.startswith("gRPC floor") for name in rows)
    assert_paced(rows["server, paced 20/s, sync client"], rows["bare ORT: session.run, 50 ms apart"], 20,
                 report["summary"])
    assert "paced_20_floor_p50_ms" not in report["summary"]  # --no-floor
    for bad, message in ((["--model", str(tmp_path / "none.onnx")], "cannot read the model file"),
                         (["--concurrency", "1,x"], "give whole numbers separated by commas"),
                         (["--rate", "0"], "each rate must be in (0, 100000]"),
                         (["--stream", "--client", "sync"], "leave out --client sync"),
                         (["--rate", "10", "--target", "127.0.0.1:1"], "a server this script starts")):
        refused = run_main([*cmd[1:], *bad])
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr


def test_serving_load_pins_the_server_it_starts_to_the_cpus_given(art: Model, tmp_path: Path) -> None:
    from benchmarks.serving_load import cpu_list, start_server
    from serving.health_probe import wait_serving as health_wait

    assert cpu_list("0") == {0} and cpu_list(",".join(map(str, sorted(os.sched_getaffinity(0))))) == set(
        os.sched_getaffinity(0))
    for bad, message in (("0-x", "CPU numbers and ranges"), ("4096", "not available here"), ("", "CPU numbers")):
        with pytest.raises(ValueError, match=message):
            cpu_list(bad)
    proc, target, _ = start_server(art.model, "cpu", 1, [], tmp_path / "server.log", cpus={0})
    try:
        assert health_wait(target, 60)
        threads = list(Path(f"/proc/{proc.pid}/task").iterdir())
        assert len(threads) > 1  # gRPC's and the loop's threads, all of them on CPU 0
        assert all(os.sched_getaffinity(int(t.name)) == {0} for t in threads)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serving_steps_times_each_step_of_a_call(art: Model, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.serving_steps", "--model", str(art.model), "--parquet",
                           str(art.bars_path), "--seconds", "0.01", "--repeats", "1", "--batch", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d,.]+) \|$", done.stdout, re.M))
    assert set(rows) == {"parse_request", "prepare, 1", "prepare, batch of 4 (per series)", "run_batch, 1",
                         "session.run, 1", "build_response"}, done.stdout
    us = {k: float(v.replace(",", "")) for k, v in rows.items()}
    assert all(v > 0 for v in us.values())
    refused = run_main(["-m", "benchmarks.serving_steps", "--model", str(tmp_path / "no.onnx"), "--parquet",
                        str(art.bars_path)])
    assert refused.returncode == 2 and "cannot read the model file" in refused.stderr


def test_a_reload_that_changes_what_callers_send_is_named(art: Model) -> None:
    """A SIGHUP may swap in a model with another horizon or symbol set: accepted (it passed its checks), and
    the log names each change callers must follow (what GetModelInfo tells them)."""
    import dataclasses

    from serving.server import contract_changes

    m = art.meta
    assert contract_changes(m, m) == []
    other = dataclasses.replace(m, horizon=m.horizon + 2, symbols=(*m.symbols, "YM"), model_version="v9")
    assert contract_changes(m, other) == [f"horizon {m.horizon} -> {m.horizon + 2}",
                                          f"symbols {list(m.symbols)} -> {[*m.symbols, 'YM']}"]
