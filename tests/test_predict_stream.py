"""PredictStream end to end: the real `python -m serving` as a subprocess on 127.0.0.1, driven over one open
stream at a time, against the same server's unary Predict."""

from __future__ import annotations

import queue
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from tests.live_server import SERVICE, LiveServer, Model, metric, request_for, serving, tiny_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-7  # ORT's float32 kernels may differ in the last bits between batch sizes
PREDICT_STREAM = "/foxhunt.tft.v1.Forecaster/PredictStream"


@pytest.fixture(scope="module")
def art(tiny_model: Model) -> Model:  # noqa: F811  (the shared fixture, under this module's name)
    return tiny_model


@pytest.fixture(scope="module")
def server(art: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from serving(art.model, tmp_path_factory.mktemp("log") / "server.log", "--metrics-port", "0")


def with_id(request: pb.PredictRequest, request_id: str) -> pb.PredictRequest:
    out = pb.PredictRequest()
    out.CopyFrom(request)
    out.request_id = request_id
    return out


def assert_same_forecasts(got: pb.PredictResponse, want: pb.PredictResponse) -> None:
    assert got.model_version == want.model_version and len(got.forecasts) == len(want.forecasts)
    for g, w in zip(got.forecasts, want.forecasts, strict=True):
        assert (g.symbol, g.last_timestamp_ns, g.last_close) == (w.symbol, w.last_timestamp_ns, w.last_close)
        assert list(g.timestamp_ns) == list(w.timestamp_ns) and list(g.quantile_levels) == list(w.quantile_levels)
        np.testing.assert_allclose(g.log_return, w.log_return, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(g.price, w.price, rtol=RTOL, atol=ATOL)
        assert g.HasField("explanation") == w.HasField("explanation")
        if w.HasField("explanation"):
            np.testing.assert_allclose(g.explanation.attention, w.explanation.attention, rtol=RTOL, atol=1e-6)
            assert list(g.explanation.attention_timestamp_ns) == list(w.explanation.attention_timestamp_ns)


class OpenStream:
    """A PredictStream on grpc's blocking stub, written to one request at a time (as a strategy's loop does)."""

    def __init__(self, s: LiveServer, timeout: float = 30, stub: pb_grpc.ForecasterStub | None = None) -> None:
        self._requests: queue.Queue[pb.PredictRequest | None] = queue.Queue()
        self.answers = (stub or s.stub).PredictStream(iter(self._requests.get, None), timeout=timeout)

    def send(self, request: pb.PredictRequest) -> None:
        self._requests.put(request)

    def ask(self, request: pb.PredictRequest) -> pb.PredictStreamResponse:
        self.send(request)
        return next(self.answers)

    def close(self) -> None:
        self._requests.put(None)


def test_a_stream_answers_each_request_as_predict_does_in_request_order(art: Model, server: LiveServer) -> None:
    """Requests sent without waiting (they batch together) are answered in order, each with its request_id;
    a bad one gets its error in its answer and the stream goes on; explain works as on Predict."""
    meta = art.meta
    good = [request_for(art, sym, end=end) for sym in meta.symbols for end in (300, 301, 450, 500, 620)]
    good.append(request_for(art, meta.symbols[1], explain=True))
    bad = {3: (request_for(art, meta.symbols[0], n=3), "3 bars sent", "series[0].timestamp_ns"),
           9: (pb.PredictRequest(series=[pb.Series(symbol="NOPE")]), "'NOPE'", "series[0].symbol")}
    requests: list[pb.PredictRequest] = []
    for r in good:
        while len(requests) in bad:
            requests.append(bad[len(requests)][0])
        requests.append(r)
    requests = [with_id(r, f"req-{i}") for i, r in enumerate(requests)]
    before = server.scrape()

    answers = list(server.stub.PredictStream(iter(requests), timeout=60))  # all sent at once, then half-closed

    assert [a.request_id for a in answers] == [f"req-{i}" for i in range(len(requests))]
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        if i in bad:
            assert not answer.HasField("response") and answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert answer.error.code_name == "INVALID_ARGUMENT" and bad[i][1] in answer.error.message, answer.error
            assert list(answer.error.fields) == [bad[i][2]], answer.error  # as Predict's BadRequest names it
            continue
        assert not answer.HasField("error"), answer.error
        assert_same_forecasts(answer.response, server.stub.Predict(request, timeout=10))
    after = server.scrape()
    for code, n in (("OK", len(good)), ("INVALID_ARGUMENT", len(bad))):
        assert metric(after, "foxhunt_requests_total", method="PredictStream", code=code) - \
            metric(before, "foxhunt_requests_total", method="PredictStream", code=code) == n, code
    assert metric(after, "foxhunt_open_streams") == 0

    stream = OpenStream(server)  # one at a time on an open stream, as a strategy calling every bar does
    try:
        for i, r in enumerate(good[:3]):
            answer = stream.ask(with_id(r, str(i)))
            assert answer.request_id == str(i)
            assert_same_forecasts(answer.response, server.stub.Predict(r, timeout=10))
        assert metric(server.scrape(), "foxhunt_open_streams") == 1
    finally:
        stream.close()
    assert list(stream.answers) == []  # the client's half-close ends the stream with OK


def wait_metric(s: LiveServer, name: str, value: float) -> None:
    """Until the server's metric `name` reaches `value` (a minute at most)."""
    deadline = time.monotonic() + 60
    while metric(s.scrape(), name) < value:
        assert time.monotonic() < deadline and s.alive(), s.log_text()
        time.sleep(0.02)


def test_an_undecodable_message_ends_the_stream_and_the_server_stays_up(art: Model, server: LiveServer) -> None:
    """Bytes that are not a PredictRequest end the stream INVALID_ARGUMENT, after the answers before them, naming
    the message type; the server goes on serving."""
    request = request_for(art, art.meta.symbols[0]).SerializeToString()
    raw = server.channel.stream_stream(PREDICT_STREAM, request_serializer=None, response_deserializer=None)
    answers = raw(iter([request, b"\xff\xff\xff\xff"]), timeout=30)
    first = pb.PredictStreamResponse.FromString(next(answers))
    assert first.response.forecasts and not first.HasField("error")
    with pytest.raises(grpc.RpcError) as info:
        next(answers)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request's 4 bytes are not a foxhunt.tft.v1.PredictRequest" in (info.value.details() or "")
    unary = server.channel.unary_unary(PREDICT_STREAM.replace("PredictStream", "Predict"), request_serializer=None,
                                       response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        unary(b"\xff\xff\xff\xff", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request's 4 bytes are not a foxhunt.tft.v1.PredictRequest" in (info.value.details() or "")
    assert server.stub.Predict(pb.PredictRequest.FromString(request), timeout=10).forecasts
    assert server.alive()
    assert "Traceback" not in server.log_text()


def test_stream_requests_count_against_max_concurrent_and_the_stream_goes_on(art: Model, tmp_path: Path) -> None:
    s = LiveServer(art.model, tmp_path / "server.log", "--max-concurrent", "1", "--batch-wait", "fixed",
                   "--max-delay-ms", "3000", "--metrics-port", "0")
    try:
        s.wait_serving()
        request = request_for(art, art.meta.symbols[0])
        unary: list[pb.PredictResponse] = []
        held = threading.Thread(target=lambda: unary.append(s.stub.Predict(request, timeout=30)))
        held.start()
        wait_metric(s, "foxhunt_inflight_requests", 1)  # the unary call holds the one slot, waiting 3 s for its batch
        stream = OpenStream(s)
        try:
            refused = stream.ask(with_id(request, "a"))
            assert refused.request_id == "a" and refused.error.code_name == "RESOURCE_EXHAUSTED"
            assert "--max-concurrent 1" in refused.error.message, refused.error
            held.join(timeout=20)
            assert unary and unary[0].forecasts
            answered = stream.ask(with_id(request, "b"))  # the same stream, once the slot is free
            assert answered.request_id == "b" and answered.response.forecasts, answered.error
        finally:
            stream.close()
        assert s.alive()
    finally:
        s.kill()


def test_sigterm_answers_what_a_stream_has_read_then_ends_it_unavailable(art: Model, tmp_path: Path) -> None:
    """An open stream is not held until the grace runs out: its request in flight is answered, then the
    stream ends UNAVAILABLE (reconnect), and the server exits 0 well within its grace. A stream opened while
    the drain waits for it is refused UNAVAILABLE at once."""
    s = LiveServer(art.model, tmp_path / "server.log", "--batch-wait", "fixed", "--max-delay-ms", "3000",
                   "--grace", "60", "--metrics-port", "0")
    try:
        s.wait_serving()
        stream = OpenStream(s, timeout=90)
        stream.send(with_id(request_for(art, art.meta.symbols[0]), "in flight"))
        wait_metric(s, "foxhunt_inflight_requests", 1)  # read by the server, waiting 3 s for its batch
        s.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(s.channel)
        deadline = time.monotonic() + 60
        while health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status \
                != health_pb2.HealthCheckResponse.NOT_SERVING:  # the drain has begun, and waits for the request
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as late:  # a stream opened during the drain: refused at once
            next(s.stub.PredictStream(iter([request_for(art, art.meta.symbols[0])]), timeout=20))
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE, late.value
        # (a call opened after the last one in flight ended races gRPC's own shutdown, and may be CANCELLED)
        answer = next(stream.answers)
        assert answer.request_id == "in flight" and answer.response.forecasts, answer.error
        with pytest.raises(grpc.RpcError) as info:
            next(stream.answers)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (info.value.details() or "")
        assert s.proc.wait(timeout=60) == 0, s.log_text()
        log = s.log_text()
        assert float(re.findall(r"drained in ([\d.]+) s", log)[0]) < 60, "a stream held the server for its grace"
        assert "drained" in log and "Traceback" not in log and "ERROR" not in log, log[-3000:]
        stream.close()
    finally:
        s.kill()


def test_a_stream_as_old_as_max_connection_age_ends_itself_with_every_request_read_answered(
        art: Model, tmp_path: Path) -> None:
    """gRPC cuts a connection's streams after its age and grace, requests in flight and all; a PredictStream
    stops reading first (at 80-100% of --max-connection-age), answers what it read, then ends UNAVAILABLE."""
    s = LiveServer(art.model, tmp_path / "server.log", "--metrics-port", "0", "--max-connection-age", "1.5")
    try:
        s.wait_serving()
        request = request_for(art, art.meta.symbols[0])
        outstanding = threading.Semaphore(8)  # keep up to 8 requests in flight, never waiting for each answer
        stop = threading.Event()

        def requests() -> Iterator[pb.PredictRequest]:
            i = 0
            while not stop.is_set():
                if outstanding.acquire(timeout=0.1):
                    yield with_id(request, str(i))
                    i += 1

        started = time.monotonic()
        answers = s.stub.PredictStream(requests(), timeout=60)
        got = 0
        with pytest.raises(grpc.RpcError) as ended:
            for answer in answers:
                assert answer.request_id == str(got) and answer.response.forecasts, answer.error
                got += 1
                outstanding.release()
        stop.set()
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--max-connection-age (1.5 s) old" in (ended.value.details() or ""), ended.value.details()
        assert time.monotonic() - started > 1.0  # not before 80% of its age
        assert got > 0 and metric(s.scrape(), "foxhunt_requests_total", method="PredictStream", code="OK") == got
        log = s.log_text()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    finally:
        s.kill()


def test_a_caller_that_stops_reading_then_cancels_leaves_nothing_held_and_nothing_logged(
        art: Model, tmp_path: Path) -> None:
    """Answers wait on HTTP/2 flow control while the caller does not read; each holds its --max-concurrent
    slot (so unread answers stay bounded) until the cancel, which ends the stream quietly."""
    s = LiveServer(art.model, tmp_path / "server.log", "--metrics-port", "0")
    try:
        s.wait_serving()
        request = pb.PredictRequest(series=[request_for(art, sym).series[0] for sym in art.meta.symbols],
                                    explain=True)  # a few kB an answer: the caller's window fills
        # a small receive window that does not grow: the server's writes wait after a few answers
        channel = grpc.insecure_channel(s.target, options=[("grpc.http2.bdp_probe", 0),
                                                           ("grpc.http2.lookahead_bytes", 16384)])
        stream = OpenStream(s, timeout=60, stub=pb_grpc.ForecasterStub(channel))
        for _ in range(400):
            stream.send(request)
        wait_metric(s, "foxhunt_inflight_requests", 64)
        time.sleep(0.5)  # were the read-ahead unbounded, more would be in flight by now
        text = s.scrape()  # the stream's read-ahead (--max-batch), each answer holding its slot until sent
        assert metric(text, "foxhunt_inflight_requests") == 64
        assert metric(text, "foxhunt_requests_total", method="PredictStream", code="OK") < 200
        stream.answers.cancel()
        deadline = time.monotonic() + 60
        while (metric(text := s.scrape(), "foxhunt_open_streams") or metric(text, "foxhunt_inflight_requests")) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(text, "foxhunt_open_streams") == 0 and metric(text, "foxhunt_inflight_requests") == 0
        # the 64 requests whose answers were never sent count as what their caller got: the cancel
        codes = {c: metric(text, "foxhunt_requests_total", method="PredictStream", code=c)
                 for c in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "INTERNAL")}
        assert codes["CANCELLED"] == 64, codes
        assert s.stub.Predict(request, timeout=10).forecasts
        log = s.log_text()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
        stream.close()
        channel.close()
    finally:
        s.kill()


def test_a_request_id_too_long_to_echo_is_refused_in_its_answer(art: Model, server: LiveServer) -> None:
    request = request_for(art, art.meta.symbols[0])
    answers = list(server.stub.PredictStream(iter([with_id(request, "x" * 1025), with_id(request, "y" * 1024)]),
                                             timeout=30))
    assert answers[0].error.code_name == "INVALID_ARGUMENT" and answers[0].request_id == ""
    assert "request_id is 1025 characters; send at most 1024" in answers[0].error.message
    assert list(answers[0].error.fields) == ["request_id"]
    assert answers[1].request_id == "y" * 1024 and answers[1].response.forecasts
