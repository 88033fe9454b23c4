"""Fuzzing the live server: thousands of malformed or extreme Predict requests, and random bytes.

One real `python -m serving` subprocess (tiny real model, --threads 1, --max-message-bytes
256 KiB so that oversized messages are cheap to make) takes, over one channel:

* mutated requests: a valid request with 1-4 mutations drawn by hypothesis (NaN, inf,
  huge, tiny, negative, zero values at any bar; duplicated, decreasing, extreme or shifted
  timestamps; truncated, unequal, emptied or extended columns; unknown, empty, huge or
  control-character symbols; repeated series; junk user-feature columns, plain or packed; scaled prices and
  volumes; shuffled bars; explain on or off);
* requests generated from scratch (any number of series, any lengths, any values);
* random bytes on the wire (a generic unary_unary with identity serialisers), and valid
  requests' bytes flipped, cut or spliced;
* empty and oversized messages, and valid requests with deadlines too short to meet.

Bytes that are no PredictRequest answer INVALID_ARGUMENT (or RESOURCE_EXHAUSTED, over the size limit). Every
answer must be a well-formed status other than INTERNAL or UNKNOWN, without a traceback, with a bounded message,
in time (well before a hang could hide); an OK answer must hold one finite, well-formed forecast per series. Each
example also checks the process is
still up. At the end a good request must get the same forecast (byte for byte) as before,
and the server's log must hold no traceback.

Bounded and reproducible: `derandomize=True` (hypothesis draws the same examples on every run),
no example database, fixed example counts (about 2,470 requests in all, 30-60 s).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from tests.live_server import SERVICE, LiveServer, Model, request_for, tiny_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

MAX_MESSAGE = 256 * 1024
TIMEOUT = 5.0  # deadline of every fuzz call: a hang ends DEADLINE_EXCEEDED, which only the deadline test allows
MAX_DETAILS = 2100  # bytes: the server cuts status messages at 2,000
REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
INT64_MIN, INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
COLUMNS = ("timestamp_ns", "open", "high", "low", "close", "volume")
PRICES = ("open", "high", "low", "close")

SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1.0, 1e308, -1e308, 1.7976931348623157e308,
                  5e-324, 2.2250738585072014e-308, 1e-300, 1e300, 3.4028235e38, 3.5e38, 1e-45, 1e-38, 1e-12, 1e12]
SPECIAL_INTS = [0, -1, 1, INT64_MIN, INT64_MAX, INT64_MAX - 1, 1 << 62, -(1 << 62), 1_700_000_000,
                1_700_000_000_000, 9_223_372_036_000_000_000]
EXAMPLES = {"mutated": 1300, "scratch": 300, "raw": 450, "corrupted": 250, "deadline": 60, "services": 100}
SETTINGS = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# ---- the server and the checks ---------------------------------------------------------------------
@dataclass
class Fuzz:
    server: LiveServer
    model: Model
    channel: grpc.Channel
    predict: Callable[..., bytes]  # bytes in, bytes out
    baseline: pb.PredictRequest
    baseline_answer: bytes
    sent: Counter[str] = field(default_factory=Counter)  # by strategy
    codes: Counter[str] = field(default_factory=Counter)  # by status code
    slowest: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)  # refusals by the start of their message


@pytest.fixture(scope="module")
def fuzz(tiny_model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:  # noqa: F811
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    server = LiveServer(tiny_model.model, log, "--max-message-bytes", str(MAX_MESSAGE))
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 << 20),
                                                            ("grpc.max_receive_message_length", 64 << 20)])
    try:
        server.wait_serving(channel)
        predict = channel.unary_unary(f"/{SERVICE}/Predict", request_serializer=None, response_deserializer=None)
        baseline = request_for(tiny_model, tiny_model.meta.symbols[0])
        answer = predict(baseline.SerializeToString(), timeout=TIMEOUT)
        yield Fuzz(server, tiny_model, channel, predict, baseline, answer)
    finally:
        channel.close()
        server.kill()


def send(fz: Fuzz, strategy: str, data: bytes, timeout: float = TIMEOUT,
         allowed: frozenset[grpc.StatusCode] = frozenset(REJECTED)) -> grpc.StatusCode:
    """Send `data` as a Predict request; check the answer is well formed and the server is up."""
    fz.sent[strategy] += 1
    started = time.monotonic()
    try:
        answer = fz.predict(data, timeout=timeout)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    elapsed = time.monotonic() - started
    fz.slowest = max(fz.slowest, elapsed)
    fz.codes[code.name] += 1
    fz.kinds[re.sub(r"\d+", "N", details.split(": ", 1)[-1])[:50]] += 1
    assert fz.server.alive(), f"the server died on a {strategy} request:\n{fz.server.log_text()[-3000:]}"
    assert "Traceback" not in details and 'File "' not in details, details
    assert len(details.encode()) <= MAX_DETAILS, f"{len(details)} characters of details"
    if code == grpc.StatusCode.OK:
        check_forecasts(fz, pb.PredictRequest.FromString(data), pb.PredictResponse.FromString(answer))
        return code
    assert details, f"{strategy}: {code.name} without a message"
    assert code not in NEVER and code in allowed, f"{strategy}: unexpected {code.name}: {details}"
    if not parses(data) and code == grpc.StatusCode.INVALID_ARGUMENT:
        assert "are not a foxhunt.tft.v1.PredictRequest" in details, details
    return code


def parses(data: bytes) -> bool:
    try:
        pb.PredictRequest.FromString(data)
    except DecodeError:
        return False
    return True


def check_forecasts(fz: Fuzz, request: pb.PredictRequest, response: pb.PredictResponse) -> None:
    """An OK answer: one finite forecast per series, in order, shaped horizon x quantiles."""
    meta = fz.model.meta
    h, q = meta.horizon, len(meta.quantiles)
    assert [f.symbol for f in response.forecasts] == [s.symbol for s in request.series]
    for f, s in zip(response.forecasts, request.series, strict=True):
        assert f.horizon == h and len(f.log_return) == h * q == len(f.price) and len(f.timestamp_ns) == h
        assert np.isfinite(f.log_return).all() and np.isfinite(f.price).all() and (np.asarray(f.price) > 0).all()
        assert f.last_timestamp_ns == s.timestamp_ns[-1] and f.last_close == s.close[-1]
        assert list(f.timestamp_ns) == [s.timestamp_ns[-1] + k * meta.bar_interval_ns for k in range(1, h + 1)]
        if request.explain:
            assert f.HasField("explanation") and np.isfinite(f.explanation.attention).all()


# ---- strategies ------------------------------------------------------------------------------------
floats = st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
ints = st.one_of(st.sampled_from(SPECIAL_INTS), st.integers(INT64_MIN, INT64_MAX))
symbols = st.one_of(
    st.sampled_from(["ES", "NQ", "", "ZZ", "es", "ES ", " ES", "E\x00S", "\x1f", "ES\x1f1", "NQ\n", "🦊",
                     "A" * 70_000, "\u202eSE"]),
    st.text(max_size=40),
)


def clip64(t: int) -> int:
    return max(INT64_MIN, min(INT64_MAX, t))


def _bar_count(s: pb.Series) -> int:
    return len(s.timestamp_ns)


OPS = ("value", "value", "value", "timestamp", "timestamp", "truncate", "cut_column", "clear_column", "extend",
       "symbol", "scale", "edge", "shift_time", "constant", "shuffle", "reverse", "user", "packed", "repeat_series",
       "explain")


@st.composite
def mutations(draw: st.DrawFn, base: pb.PredictRequest) -> pb.PredictRequest:
    r = pb.PredictRequest()
    r.CopyFrom(base)
    if draw(st.booleans()):
        other = pb.Series()
        other.CopyFrom(r.series[0])
        other.symbol = draw(st.sampled_from(["NQ", "ES", "ZZ"]))
        r.series.append(other)
    for _ in range(draw(st.integers(1, 4))):
        s = r.series[draw(st.integers(0, len(r.series) - 1))]
        n = _bar_count(s)
        op = draw(st.sampled_from(OPS))
        if op == "value":
            col = getattr(s, draw(st.sampled_from(COLUMNS[1:])))
            if len(col):
                col[draw(st.integers(0, len(col) - 1))] = draw(floats)
        elif op == "timestamp" and n:
            i = draw(st.integers(0, n - 1))
            kind = draw(st.sampled_from(["duplicate", "decrease", "any"]))
            if kind == "duplicate" and i:
                s.timestamp_ns[i] = s.timestamp_ns[i - 1]
            elif kind == "decrease" and i:
                s.timestamp_ns[i] = clip64(s.timestamp_ns[i - 1] - draw(st.integers(1, 10**12)))
            else:
                s.timestamp_ns[i] = draw(ints)
        elif op == "truncate":
            k = draw(st.integers(0, n))
            for col in COLUMNS:
                del getattr(s, col)[: n - k]
        elif op == "cut_column" and n:
            del getattr(s, draw(st.sampled_from(COLUMNS)))[draw(st.integers(0, n - 1)):]
        elif op == "clear_column":
            s.ClearField(draw(st.sampled_from(COLUMNS)))  # type: ignore[arg-type]
        elif op == "extend" and n:  # more (valid) older bars: extra history is allowed, only the last ones count
            k = draw(st.integers(1, 400))
            step = 60_000_000_000
            first = s.timestamp_ns[0]
            s.timestamp_ns[:] = [clip64(first - step * j) for j in range(k, 0, -1)] + list(s.timestamp_ns)
            for col in COLUMNS[1:]:
                values = list(getattr(s, col))
                getattr(s, col)[:] = values[:1] * k + values
        elif op == "symbol":
            s.symbol = draw(symbols)
        elif op == "scale":  # a valid series at extreme magnitudes
            factor = draw(st.sampled_from([1e-300, 1e-200, 1e-30, 1e30, 1e200, 1e300, 1e307]))
            for col in draw(st.sampled_from([PRICES, ("volume",), (*PRICES, "volume")])):
                getattr(s, col)[:] = [v * factor for v in getattr(s, col)]
        elif op == "edge" and n:  # valid bars at the very top of the double range: the forecast price may overflow
            top = max([*s.high, 1.0])
            factor = 1.7976931348623157e308 / top * draw(st.sampled_from([1.0, 0.9999, 0.5]))
            for col in PRICES:
                getattr(s, col)[:] = [min(v * factor, 1.7976931348623157e308) for v in getattr(s, col)]
            if all(len(getattr(s, c)) for c in ("open", "high", "close")):
                s.close[-1] = s.high[-1] = s.open[-1] = max(s.high[-1], s.open[-1], s.close[-1])
        elif op == "shift_time" and n:
            offset = draw(ints)
            s.timestamp_ns[:] = [clip64(t + offset) for t in s.timestamp_ns]
        elif op == "constant":
            col = draw(st.sampled_from(COLUMNS))
            value = draw(ints) if col == "timestamp_ns" else draw(floats)
            getattr(s, col)[:] = [value] * n
        elif op == "shuffle" and n:
            order = draw(st.permutations(range(n)))
            for col in COLUMNS:
                values = list(getattr(s, col))
                getattr(s, col)[:] = [values[j] for j in order if j < len(values)]
        elif op == "reverse":
            for col in COLUMNS:
                getattr(s, col)[:] = list(getattr(s, col))[::-1]
        elif op == "user":
            name = draw(st.one_of(st.sampled_from(["spread", "", "x" * 5000]), st.text(max_size=12)))
            values = draw(st.lists(floats, max_size=n + 3))
            s.user_features.append(pb.Column(name=name, values=values))
        elif op == "packed":  # a packed block: well-sized (one value throughout) or any bytes
            names = draw(st.lists(st.one_of(st.sampled_from(["spread", ""]), st.text(max_size=8)), max_size=4))
            s.user_feature_names.extend(names)
            if draw(st.booleans()):
                s.user_features_raw = np.full(len(names) * n, draw(floats), dtype="<f8").tobytes()
            else:
                s.user_features_raw = draw(st.binary(max_size=64))
        elif op == "repeat_series":
            copies = draw(st.integers(1, 40))
            for _ in range(copies):
                r.series.append(s)
        elif op == "explain":
            r.explain = not r.explain
    return r


@st.composite
def scratch(draw: st.DrawFn) -> pb.PredictRequest:
    """Requests built from nothing: any series count, symbols, lengths and values."""
    series = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(0, 45))
        lengths = {c: draw(st.sampled_from([n, n, n, max(0, n - 1), n + 1])) for c in COLUMNS}
        ts = draw(st.one_of(st.just(sorted(set(draw(st.lists(ints, min_size=lengths["timestamp_ns"],
                                                              max_size=lengths["timestamp_ns"]))))),
                            st.lists(ints, min_size=lengths["timestamp_ns"], max_size=lengths["timestamp_ns"])))
        cols = {c: draw(st.lists(floats, min_size=lengths[c], max_size=lengths[c])) for c in COLUMNS[1:]}
        series.append(pb.Series(symbol=draw(symbols), timestamp_ns=ts, **cols))
    return pb.PredictRequest(series=series, explain=draw(st.booleans()))


@st.composite
def corrupted(draw: st.DrawFn, data: bytes) -> bytes:
    """A valid request's bytes, flipped, cut, or with junk spliced in."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "splice", "byte"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del b[i:]
        elif op == "splice":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            b[i] = draw(st.integers(0, 255))
    return bytes(b)


# ---- the tests ---------------------------------------------------------------------------------------
def test_mutated_requests(fuzz: Fuzz) -> None:
    bases = [request_for(fuzz.model, sym, end=end) for sym in fuzz.model.meta.symbols for end in (None, 200)]

    @settings(SETTINGS, max_examples=EXAMPLES["mutated"])
    @given(st.sampled_from(bases).flatmap(mutations))
    def one(request: pb.PredictRequest) -> None:
        data = request.SerializeToString()
        if len(data) <= MAX_MESSAGE:
            send(fuzz, "mutated", data)
        else:
            assert send(fuzz, "mutated", data) == grpc.StatusCode.RESOURCE_EXHAUSTED

    one()
    assert fuzz.sent["mutated"] >= EXAMPLES["mutated"] * 0.9
    assert fuzz.codes["OK"] > 0 and fuzz.codes["INVALID_ARGUMENT"] > 0  # both sides of the contract were reached


def test_requests_from_scratch(fuzz: Fuzz) -> None:
    @settings(SETTINGS, max_examples=EXAMPLES["scratch"])
    @given(scratch())
    def one(request: pb.PredictRequest) -> None:
        send(fuzz, "scratch", request.SerializeToString())

    one()
    assert fuzz.sent["scratch"] >= EXAMPLES["scratch"] * 0.9


def test_random_bytes_on_the_wire(fuzz: Fuzz) -> None:
    @settings(SETTINGS, max_examples=EXAMPLES["raw"])
    @given(st.binary(max_size=4096))
    def one(data: bytes) -> None:
        send(fuzz, "raw", data)

    one()
    assert fuzz.sent["raw"] >= EXAMPLES["raw"] * 0.9


def test_random_bytes_to_every_service(fuzz: Fuzz) -> None:
    """GetModelInfo, health, reflection and PredictStream (streams): a non-OK status with a message, or an
    answer (on PredictStream, a request that parses but breaks the contract gets its error in its answer)."""
    unary = {m: fuzz.channel.unary_unary(m, request_serializer=None, response_deserializer=None)
             for m in (f"/{SERVICE}/GetModelInfo", "/grpc.health.v1.Health/Check")}
    streams = {name: fuzz.channel.stream_stream(m, request_serializer=None, response_deserializer=None)
               for name, m in (("reflection", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
                               ("reflection v1", "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"),
                               ("stream", f"/{SERVICE}/PredictStream"))}

    @settings(SETTINGS, max_examples=EXAMPLES["services"])
    @given(st.sampled_from([*unary, *streams]), st.binary(max_size=512))
    def one(method: str, data: bytes) -> None:
        fuzz.sent["services"] += 1
        try:
            if method in streams:
                answers = list(streams[method](iter([data]), timeout=TIMEOUT))
                if method == "stream":  # one answer: the forecasts, or what to fix in the request
                    answer = pb.PredictStreamResponse.FromString(answers[0])
                    assert len(answers) == 1 and answer.HasField("response") != answer.HasField("error"), answers
                    assert not answer.HasField("error") or answer.error.code_name == "INVALID_ARGUMENT", answer
            else:
                unary[method](data, timeout=TIMEOUT)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            if code == "NOT_FOUND" and method.endswith("/Check"):  # the health protocol's answer for a name
                assert _health_service(data) not in ("", SERVICE), data  # that parses but is not a service
            else:
                details = exc.details() or ""
                assert details and "Traceback" not in details, (method, details)
        fuzz.codes[code] += 1
        assert fuzz.server.alive()

    one()


def _health_service(data: bytes) -> str | None:
    """The service a health check's bytes name, or None when they do not parse."""
    try:
        return str(health_pb2.HealthCheckRequest.FromString(data).service)
    except Exception:
        return None


def test_corrupted_valid_requests(fuzz: Fuzz) -> None:
    data = fuzz.baseline.SerializeToString()

    @settings(SETTINGS, max_examples=EXAMPLES["corrupted"])
    @given(corrupted(data))
    def one(junk: bytes) -> None:
        send(fuzz, "corrupted", junk)

    one()
    assert fuzz.sent["corrupted"] >= EXAMPLES["corrupted"] * 0.9


def test_deadlines_too_short_are_answered_in_time(fuzz: Fuzz) -> None:
    data = fuzz.baseline.SerializeToString()
    allowed = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})

    @settings(SETTINGS, max_examples=EXAMPLES["deadline"])
    @given(st.floats(0.0005, 0.05))
    def one(timeout: float) -> None:
        send(fuzz, "deadline", data, timeout=timeout, allowed=allowed)

    one()


def test_empty_and_oversized_messages(fuzz: Fuzz) -> None:
    assert send(fuzz, "sized", b"") == grpc.StatusCode.INVALID_ARGUMENT  # the empty message: no series
    for size in (MAX_MESSAGE + 1, 2 * MAX_MESSAGE, 8 * MAX_MESSAGE):
        assert send(fuzz, "sized", b"\x00" * size) == grpc.StatusCode.RESOURCE_EXHAUSTED
    big = pb.PredictRequest()
    big.CopyFrom(fuzz.baseline)
    s = big.series[0]
    n = MAX_MESSAGE // 48 + 100  # just over the limit as a real request
    s.timestamp_ns[:] = [s.timestamp_ns[-1] - 60_000_000_000 * j for j in range(n, 0, -1)]
    for col in COLUMNS[1:]:
        getattr(s, col)[:] = [getattr(s, col)[-1]] * n
    assert send(fuzz, "sized", big.SerializeToString()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # just under it: thousands of bars, all validated, only the last bars_required used
    n = (MAX_MESSAGE - 4096) // 50  # a bar: a 9-byte varint timestamp and 5 doubles
    s.timestamp_ns[:] = [s.timestamp_ns[-1] - 60_000_000_000 * j for j in range(n, 0, -1)]
    for col in COLUMNS[1:]:
        getattr(s, col)[:] = [getattr(s, col)[-1]] * n
    assert send(fuzz, "sized", big.SerializeToString()) == grpc.StatusCode.OK
    # many series, one symbol: refused at the second
    many = pb.PredictRequest(series=[fuzz.baseline.series[0]] * 120)
    assert send(fuzz, "sized", many.SerializeToString()) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_server_is_up_and_answers_as_before(fuzz: Fuzz) -> None:
    assert fuzz.server.alive()
    assert fuzz.predict(fuzz.baseline.SerializeToString(), timeout=TIMEOUT) == fuzz.baseline_answer
    log = fuzz.server.log_text()
    assert "Traceback" not in log, log[-4000:]
    total = sum(fuzz.sent.values())
    print(f"\nfuzz: {total} requests {dict(fuzz.sent)}; answers {dict(fuzz.codes)}; slowest {fuzz.slowest:.3f} s")
    for kind, count in fuzz.kinds.most_common():
        print(f"  {count:5d}  {kind}")
    if set(EXAMPLES) <= set(fuzz.sent):  # the whole module ran
        assert total >= 2000, dict(fuzz.sent)
