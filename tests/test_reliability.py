"""The server under load, under clients that vanish, with broken model files, and its health probe.

* Load: 64 concurrent clients (one grpc.aio channel each, closed loop) for a fixed 10 s on
  loopback, against the real server (--threads 1); every answer must equal the answer that
  request got alone, zero errors; p50/p99 and throughput are printed. Beside them 4 clients
  send requests that pass validation but fail inside a batch (a feature that overflows), and
  undecodable bytes: they must get a non-OK status and never disturb the 64. The server's
  RSS (VmRSS) is read after a 3 s warm-up at full load and again at the end: it may grow by
  at most 50 MiB. Why 50: after warm-up the server holds no per-request state, so RSS
  should stay flat but for allocator and gRPC buffer-pool noise of a few MiB; a leak of
  ~10 KiB per request — one forgotten response or feature frame — over the run's several
  thousand requests would cross it. (benchmarks/soak.py runs the same load for as long as
  you like and prints RSS over time.) Latency is reported, never asserted: the machine is
  shared.
* Disconnects: clients cancelling in-flight calls at random moments (queued, in the batch,
  done), closing their channel, and a client process SIGKILLed mid-call, while other calls
  run: those all succeed with their correct answers, and the server stays healthy.
* A corrupted or inconsistent ONNX file at start: exit 2 and one clear line, no traceback.
* `python -m serving.health_probe`: 0 when SERVING, 1 when NOT_SERVING, unreachable, or misused.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.__main__ import main as serve_main
from serving.errors import RequestError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from tests.artifacts import REPO, run_main
from tests.live_server import SERVICE, LiveServer, Model, metric, request_for, serving, tiny_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-7  # ORT's float32 kernels may differ in the last bits between batch sizes
CLIENTS = 64
POISON_CLIENTS = 4
WARM_S, LOAD_S = 3.0, 10.0
RSS_GROWTH_MIB = 50
PREDICT = f"/{SERVICE}/Predict"


def quantiles(answer: pb.PredictResponse) -> np.ndarray:
    return np.asarray([list(f.log_return) for f in answer.forecasts])


def pool_of(m: Model, size: int) -> list[pb.PredictRequest]:
    """`size` distinct one-series requests: both symbols, windows ending at different bars."""
    symbols = list(m.meta.symbols)
    return [request_for(m, symbols[i % len(symbols)], end=200 + 23 * i) for i in range(size)]


def overflowing_feature(m: Model) -> pb.PredictRequest:
    """Valid bars (finite, positive, ordered) whose high/low ratio overflows: refused inside the batch."""
    r = request_for(m, m.meta.symbols[0])
    s = r.series[0]
    i = len(s.close) - 3
    s.low[i], s.high[i] = 1e-300, 1e15  # open and close as they were: no jump in the closes; 1e315 overflows
    return r


@pytest.fixture(scope="module")
def server(tiny_model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    yield from serving(tiny_model.model, tmp_path_factory.mktemp("reliability") / "server.log")


# ---- load ----------------------------------------------------------------------------------------------
async def _load(target: str, pool: list[pb.PredictRequest], expected: list[np.ndarray], poison: list[bytes],
                server: LiveServer) -> dict[str, object]:
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    wrong: list[int] = []
    phase = {"measure": False, "stop": False}
    raw = [r.SerializeToString() for r in pool]

    async def client(k: int) -> None:
        async with aio.insecure_channel(target) as channel:
            predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            i = k
            while not phase["stop"]:
                j = i % len(raw)
                t0 = time.perf_counter()
                try:
                    answer = pb.PredictResponse.FromString(await predict(raw[j], timeout=30))
                except grpc.RpcError as exc:
                    errors[f"{exc.code().name}: {exc.details()}"] += 1
                    continue
                finally:
                    i += 7
                if phase["measure"]:
                    latencies.append(time.perf_counter() - t0)
                if not np.allclose(quantiles(answer), expected[j], rtol=RTOL, atol=ATOL):
                    wrong.append(j)

    async def bad_client(k: int) -> None:
        async with aio.insecure_channel(target) as channel:
            predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            i = k
            while not phase["stop"]:
                try:
                    await predict(poison[i % len(poison)], timeout=30)
                    errors["a poison request was answered OK"] += 1
                except grpc.RpcError as exc:
                    refused[exc.code().name] += 1
                i += 1
                await asyncio.sleep(0.005)

    tasks = [asyncio.create_task(client(k)) for k in range(CLIENTS)]
    tasks += [asyncio.create_task(bad_client(k)) for k in range(POISON_CLIENTS)]
    await asyncio.sleep(WARM_S)
    rss = [server.rss_kib()]
    phase["measure"] = True
    started = time.perf_counter()
    for _ in range(int(LOAD_S)):
        await asyncio.sleep(1.0)
        rss.append(server.rss_kib())
    seconds = time.perf_counter() - started
    phase["measure"] = False
    phase["stop"] = True
    await asyncio.gather(*tasks)
    return {"latencies": latencies, "errors": errors, "refused": refused, "wrong": wrong, "rss_kib": rss,
            "seconds": seconds}


def test_64_clients_for_10_s_zero_errors_exact_answers_bounded_memory(
        tiny_model: Model, server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    pool = pool_of(tiny_model, 96)
    with grpc.insecure_channel(server.target) as channel:  # each request's answer alone, one at a time
        stub = pb_grpc.ForecasterStub(channel)
        expected = [quantiles(stub.Predict(r, timeout=10)) for r in pool]
    poison = [overflowing_feature(tiny_model).SerializeToString(), b"\xff\x00garbage"]

    result = asyncio.run(_load(server.target, pool, expected, poison, server))
    latencies, rss = result["latencies"], result["rss_kib"]
    assert isinstance(latencies, list) and isinstance(rss, list) and latencies and rss
    assert not result["errors"], result["errors"]
    assert not result["wrong"], f"{len(result['wrong'])} answers differ from the same request alone"
    assert "INVALID_ARGUMENT" in result["refused"], result["refused"]  # type: ignore[operator]  # the overflow
    assert len(latencies) > CLIENTS, "the load did not run"
    growth_mib = (rss[-1] - rss[0]) / 1024
    ms = np.percentile(np.asarray(latencies) * 1e3, [50, 99])
    summary = {"clients": CLIENTS, "seconds": round(float(result["seconds"]), 1), "requests": len(latencies),
               "req_per_s": round(len(latencies) / float(result["seconds"])),  # type: ignore[arg-type]
               "p50_ms": round(float(ms[0]), 2), "p99_ms": round(float(ms[1]), 2), "errors": 0,
               "poison_refused": sum(result["refused"].values()),  # type: ignore[attr-defined]
               "rss_mib_after_warmup": round(rss[0] / 1024, 1), "rss_mib_end": round(rss[-1] / 1024, 1),
               "rss_mib_max": round(max(rss) / 1024, 1), "rss_growth_mib": round(growth_mib, 1)}
    with capsys.disabled():
        print(f"\nload: {json.dumps(summary)}")
    assert growth_mib < RSS_GROWTH_MIB, summary
    assert server.alive() and "Traceback" not in server.log_text()


# ---- clients that go away --------------------------------------------------------------------------------
KILLED_CLIENT = """
import asyncio, sys
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
async def main():
    channel = aio.insecure_channel(sys.argv[1])
    predict = channel.unary_unary("{method}", request_serializer=None, response_deserializer=None)
    data = sys.stdin.buffer.read()
    calls = [predict(data, timeout=30) for _ in range(16)]
    print("sent", flush=True)
    await asyncio.gather(*calls, return_exceptions=True)
asyncio.run(main())
"""


def test_clients_that_disconnect_mid_call_do_not_disturb_others(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    # every batch waits 300 ms for company: calls are cancelled while queued, while their batch runs, or after
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--batch-wait", "fixed", "--max-delay-ms", "300")
    pool = pool_of(tiny_model, 16)
    rng = random.Random(7)
    try:
        s.wait_serving()
        with grpc.insecure_channel(s.target) as channel:  # all at once: one by one, each waits 300 ms alone
            stub = pb_grpc.ForecasterStub(channel)
            expected = [quantiles(f.result()) for f in [stub.Predict.future(r, timeout=10) for r in pool]]

        async def rounds() -> tuple[int, int]:
            ok = cancelled = 0
            async with aio.insecure_channel(s.target) as bystander_channel:
                stub = pb_grpc.ForecasterStub(bystander_channel)
                for delay in (0.0, *(rng.uniform(0.0, 0.45) for _ in range(4))):  # the first cancels at once
                    victims_channel = aio.insecure_channel(s.target)
                    victims = [pb_grpc.ForecasterStub(victims_channel).Predict(pool[i], timeout=30) for i in range(8)]
                    others = [asyncio.ensure_future(stub.Predict(pool[i], timeout=30)) for i in range(8, 16)]
                    await asyncio.sleep(delay)
                    for v in victims[:4]:
                        cancelled += bool(v.cancel())
                    await victims_channel.close()  # the rest: the whole connection goes away
                    for i, answer in enumerate(await asyncio.gather(*others)):
                        np.testing.assert_allclose(quantiles(answer), expected[8 + i], rtol=RTOL, atol=ATOL)
                        ok += 1
            return ok, cancelled

        ok, cancelled = asyncio.run(rounds())
        assert ok == 40 and cancelled >= 4  # the first round's four, still queued for their 300 ms batch

        # a client process killed (SIGKILL: no goodbye on the connection) with 16 calls in flight
        code = KILLED_CLIENT.replace("{method}", PREDICT)
        killed = subprocess.Popen([sys.executable, "-c", code, s.target], cwd=REPO, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=False)
        assert killed.stdin is not None and killed.stdout is not None
        killed.stdin.write(pool[0].SerializeToString())
        killed.stdin.close()
        with grpc.insecure_channel(s.target) as channel:
            stub = pb_grpc.ForecasterStub(channel)
            futures = [stub.Predict.future(pool[i], timeout=30) for i in range(8, 16)]
            assert killed.stdout.readline() == b"sent\n"
            time.sleep(0.1)
            killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=10)
            for i, f in enumerate(futures):
                np.testing.assert_allclose(quantiles(f.result()), expected[8 + i], rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(quantiles(stub.Predict(pool[3], timeout=10)), expected[3], rtol=RTOL,
                                       atol=ATOL)
        assert s.alive() and "Traceback" not in s.log_text()
    finally:
        s.kill()


# ---- one bad call in a batch ------------------------------------------------------------------------------
def test_a_call_failing_inside_a_batch_fails_alone(tiny_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """If feature computation or the run fails for the batch, each call is rerun alone: only the culprit fails."""
    import serving.inference as inference
    from serving.model import load_model
    from serving.validation import parse_request

    model = load_model(tiny_model.model, "cpu", threads=1)
    calls = [parse_request(r, model.meta) for r in pool_of(tiny_model, 3)]
    alone = [inference.run_batch(model, [c])[0] for c in calls]
    real_prepare = inference.prepare
    culprit = calls[1][0].close[-1]

    def prepare(series, meta):  # type: ignore[no-untyped-def]
        if any(s.close[-1] == culprit for s in series):
            raise ZeroDivisionError("a bug that only this call's bars reach")
        return real_prepare(series, meta)

    monkeypatch.setattr(inference, "prepare", prepare)
    results = inference.run_batch(model, calls)
    assert isinstance(results[1], ZeroDivisionError)
    for i in (0, 2):
        got, want = results[i], alone[i]
        assert isinstance(got, inference.Result) and isinstance(want, inference.Result)
        np.testing.assert_allclose(got.outputs["quantiles"], want.outputs["quantiles"], rtol=RTOL, atol=ATOL)


def test_a_call_with_nonfinite_features_fails_alone_in_its_batch(tiny_model: Model) -> None:  # noqa: F811
    """The batch is checked for NaN/inf as a whole; a hit is traced to its call, and only that call fails."""
    import serving.inference as inference
    from serving.model import load_model
    from serving.validation import parse_request

    model = load_model(tiny_model.model, "cpu", threads=1)
    good = [parse_request(r, model.meta) for r in pool_of(tiny_model, 2)]
    bad = parse_request(overflowing_feature(tiny_model), model.meta)
    results = inference.run_batch(model, [good[0], bad, good[1]])
    assert isinstance(results[1], RequestError) and "is not finite" in str(results[1])
    assert "log_range" in str(results[1])  # names the feature that overflowed
    for got, call in ((results[0], good[0]), (results[2], good[1])):
        want = inference.run_batch(model, [call])[0]
        assert isinstance(got, inference.Result) and isinstance(want, inference.Result)
        np.testing.assert_allclose(got.outputs["quantiles"], want.outputs["quantiles"], rtol=RTOL, atol=ATOL)


def test_a_response_over_the_size_limit_is_resource_exhausted(tiny_model: Model) -> None:  # noqa: F811
    from serving.model import load_model
    from serving.server import ServerConfig, build_server
    from serving.servicer import Limits

    async def main() -> None:
        config = ServerConfig(model_path=tiny_model.model, port=0, device="cpu")
        server = build_server(config, load_model(tiny_model.model, "cpu", threads=1))
        server.servicer.limits = Limits(max_batch=64, max_message_bytes=1000, max_concurrent=8)  # responses only
        port = await server.start()
        await server.warm_up()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ForecasterStub(channel)
                request = request_for(tiny_model, tiny_model.meta.symbols[0])
                request.explain = True
                with pytest.raises(aio.AioRpcError) as info:
                    await stub.Predict(request, timeout=10)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = info.value.details() or ""
                assert "--max-message-bytes); set explain=false" in details  # one series: no "send fewer"
                request.explain = False
                one = await stub.Predict(request, timeout=10)
                assert one.forecasts
                size = one.ByteSize()
                request.series.append(request.series[0])  # two series: room for one
                request.series[1].symbol = tiny_model.meta.symbols[1]
                server.servicer.limits = Limits(max_batch=64, max_message_bytes=size * 3 // 2, max_concurrent=8)
                with pytest.raises(aio.AioRpcError) as info:
                    await stub.Predict(request, timeout=10)
                assert (info.value.details() or "").endswith("; send at most 1 series per request")
                del request.series[1:]
                server.servicer.limits = Limits(max_batch=64, max_message_bytes=size // 2, max_concurrent=8)
                with pytest.raises(aio.AioRpcError) as info:
                    await stub.Predict(request, timeout=10)
                assert "the server's --max-message-bytes must be raised" in (info.value.details() or "")
        finally:
            await server.stop(1)

    asyncio.run(main())


@pytest.mark.parametrize(("key", "edit", "message"), [
    ("foxhunt.feature_config", lambda v: {**v, "user_columns": ["x"]},
     "model metadata is inconsistent: feature_schema's user columns [] are not those feature_config computes (['x'])"),
])
def test_metadata_edited_to_disagree_with_the_graph_is_refused_at_load(
        tiny_model: Model, tmp_path: Path, key: str, edit: Any, message: str) -> None:  # noqa: F811
    """Metadata is outside the graph's digest: a hand edit that no longer describes the graph is refused when
    the model loads (so a server never says SERVING and then fails every call), naming the fix."""
    from serving.errors import ModelLoadError
    from serving.model import load_and_warm

    proto = onnx.load(str(tiny_model.model))
    prop = next(p for p in proto.metadata_props if p.key == key)
    prop.value = json.dumps(edit(json.loads(prop.value)))
    edited = tmp_path / "edited.onnx"
    onnx.save(proto, str(edited))
    with pytest.raises(ModelLoadError) as info:
        load_and_warm(edited, "cpu", 1, 64)
    assert message in str(info.value) and "re-export the model" in str(info.value), str(info.value)


def test_nonfinite_model_output_is_refused(tiny_model: Model) -> None:  # noqa: F811
    from serving.inference import _nonfinite_output
    from serving.model import load_model
    from serving.preprocess import prepare
    from serving.validation import parse_request

    model = load_model(tiny_model.model, "cpu", threads=1)
    call = parse_request(request_for(tiny_model, tiny_model.meta.symbols[0]), model.meta)
    out = {"quantiles": np.array([[[0.1, np.nan, 0.3]]], dtype=np.float32)}
    prepared = prepare(call, model.meta)
    problem = _nonfinite_output(out, prepared, call, model.meta)
    assert isinstance(problem, RequestError) and "not finite" in str(problem)
    assert _nonfinite_output({"quantiles": np.zeros((1, 3, 3), np.float32)}, prepared, call, model.meta) is None


# ---- broken model files at start -----------------------------------------------------------------------------
def _with_meta(model: Path, out: Path, **changes: str | None) -> Path:
    proto = onnx.load(str(model))
    props = {p.key: p.value for p in proto.metadata_props}
    for key, value in changes.items():
        if value is None:
            props.pop(f"foxhunt.{key}", None)
        else:
            props[f"foxhunt.{key}"] = value
    del proto.metadata_props[:]
    for k, v in props.items():
        proto.metadata_props.add(key=k, value=v)
    onnx.save(proto, str(out))
    return out


def _damaged_symbol(model: Path, out: Path) -> Path:
    """The model with the top bit of one symbol's first byte flipped in its metadata (not covered by the graph
    digest): no longer UTF-8, so it cannot be served as another symbol."""
    data = bytearray(model.read_bytes())
    at = data.index(b'["ES"')
    data[at + 2] ^= 0x80
    out.write_bytes(bytes(data))
    return out


def _flipped(model: Path, out: Path) -> Path:
    """The model with one bit of one weight flipped, as a bad disk or copy leaves it: it parses and runs."""
    proto = onnx.load(str(model))
    weight = next(t for t in proto.graph.initializer if len(t.raw_data) >= 64)
    data = bytearray(weight.raw_data)
    data[len(data) // 2] ^= 0x10
    weight.raw_data = bytes(data)
    onnx.save(proto, str(out))
    return out


def test_a_model_whose_graph_changed_after_export_is_refused(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    import serving.model
    from features.model_meta import graph_digest
    from serving.model import ModelLoadError, load_model

    flipped = _flipped(tiny_model.model, tmp_path / "flipped.onnx")

    def no_session(*args: object) -> None:
        raise AssertionError("a session was built of a model that is refused")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(ModelLoadError) as refused:
        patch.setattr(serving.model, "_create_session", no_session)  # refused before ONNX Runtime sees the graph
        load_model(flipped, "cpu", threads=1)
    assert f"{flipped}: the model's graph is not the one export checked" in str(refused.value)
    assert "copy it again, or export it again" in str(refused.value)
    # the digest covers the graph, not the metadata: a metadata edit alone keeps it (the reload tests rely on it)
    relabelled = _with_meta(tiny_model.model, tmp_path / "relabelled.onnx", model_version="v2")
    assert load_model(relabelled, "cpu", threads=1).version == "v2"
    assert graph_digest(relabelled.read_bytes()) == graph_digest(tiny_model.model.read_bytes()) != \
        graph_digest(flipped.read_bytes())


def test_the_graph_digest_is_of_the_stored_bytes_without_the_metadata_and_its_benchmark_runs(
        tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    """graph_digest walks the file's top-level fields; derived independently here by protobuf re-serializing
    the model without its metadata, on a graph of another shape than export's (made by onnx.helper)."""
    import hashlib

    from benchmarks.model_load import synthetic_model
    from features.model_meta import graph_digest, stored_props

    for path in (tiny_model.model, synthetic_model(tmp_path / "synthetic.onnx", 1)):
        proto = onnx.load(str(path))
        assert proto.metadata_props
        assert stored_props(path.read_bytes()) == {p.key: p.value for p in proto.metadata_props}
        del proto.metadata_props[:]
        assert graph_digest(path.read_bytes()) == hashlib.sha256(proto.SerializeToString()).hexdigest(), path
    with pytest.raises(ValueError, match="truncated"):
        graph_digest(tiny_model.model.read_bytes()[:-10])
    done = subprocess.run([sys.executable, "-m", "benchmarks.model_load", "--synthetic-mib", "1", "--repeats", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^(graph_digest|file sha256|session) +([\d.]+)", done.stdout, re.M))
    assert set(rows) == {"graph_digest", "file sha256", "session"} and "1.0 MiB" in done.stdout, done.stdout


def test_a_corrupted_onnx_file_stops_the_start_with_a_message(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    """The real command, as an operator runs it: exit 2, one line, no traceback, never `listening`."""
    data = tiny_model.model.read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    r = subprocess.run([sys.executable, "-m", "serving", "--model", str(truncated), "--port", "0", "--device", "cpu"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "listening" not in r.stdout and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: {truncated}: ONNX Runtime cannot load the model: " + lines[0].split(": ", 3)[-1]]
    assert "INVALID_PROTOBUF" in lines[0] or "parsing failed" in lines[0].lower(), lines


def test_bad_model_files_are_refused_with_clear_messages(tiny_model: Model, tmp_path: Path,  # noqa: F811
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI entry point in process (fast), one case per way a model file can be wrong."""
    m = tiny_model.model
    rng = np.random.default_rng(0)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    ckpt_file = m.parent / "ckpt.pt"  # the trainer's checkpoint the model was exported from, given to the server
    horizon = json.loads(next(p.value for p in onnx.load(str(m)).metadata_props if p.key == "foxhunt.horizon"))
    cases = [
        (tmp_path / "missing.onnx", "cannot read the model file: No such file"),
        (tmp_path, "not a regular file"),
        (empty, "the model file is empty"),
        (junk, "ONNX Runtime cannot load the model"),
        (tiny_model.bars_path, "; it is a parquet file, bars for `python -m trainer --parquet`"),
        (ckpt_file, f"it is a PyTorch checkpoint: export it first with `python -m export {ckpt_file} model.onnx`"),
        (_with_meta(m, tmp_path / "nometa.onnx", format=None), "not a foxhunt-tft model"),
        (_with_meta(m, tmp_path / "json.onnx", quantiles="[0.1, 0.5"), "'foxhunt.quantiles' is not valid JSON"),
        (_with_meta(m, tmp_path / "lacks.onnx", symbols=None), "lacks 'foxhunt.symbols'"),
        (_with_meta(m, tmp_path / "order.onnx", quantiles="[0.9, 0.5, 0.1]"), "quantiles must be"),
        (_with_meta(m, tmp_path / "range.onnx", quantiles="[0.1, 0.5, 1.5]"), "levels in (0, 1)"),
        (_with_meta(m, tmp_path / "dup.onnx", symbols='["ES", "ES"]'), "symbols must be unique"),
        (_with_meta(m, tmp_path / "blank.onnx", symbols='["ES", ""]'), "symbols must be non-empty names"),
        (_with_meta(m, tmp_path / "horizon.onnx", horizon=str(horizon + 2)), "horizon"),
        (_with_meta(m, tmp_path / "types.onnx", encoder_length='"long"'), "inconsistent"),
        (_flipped(m, tmp_path / "flipped.onnx"), "the model's graph is not the one export checked"),
        (_with_meta(m, tmp_path / "nodigest.onnx", graph_sha256=""), "'foxhunt.graph_sha256' is not a sha256"),
        (_damaged_symbol(m, tmp_path / "damaged.onnx"), "is not UTF-8 text: the file was damaged after export"),
    ]
    for path, message in cases:
        assert serve_main(["--model", str(path), "--port", "0", "--device", "cpu"]) == 2, path
        err = capsys.readouterr().err
        first = next(line for line in err.splitlines() if line.startswith("error: "))
        assert message in first and str(path) in first, (message, err)
        assert "Traceback" not in err


# ---- the health probe ------------------------------------------------------------------------------------------
def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m serving.health_probe args`, as its main in this process (run_main)."""
    return run_main(["-m", "serving.health_probe", *args])


def test_health_probe_exit_status(tiny_model: Model, server: LiveServer) -> None:  # noqa: F811
    r = subprocess.run([sys.executable, "-m", "serving.health_probe", "--target", server.target], cwd=REPO,
                       capture_output=True, text=True, timeout=60)  # the process Docker's HEALTHCHECK runs
    assert r.returncode == 0 and r.stdout.strip() == f"{server.target}: SERVING", r.stderr
    assert _probe("--target", server.target, "--service", SERVICE).returncode == 0
    unknown = _probe("--target", server.target, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND: no health status for --service 'no.such.Service'; this server " \
        "reports '' (the whole server) and foxhunt.tft.v1.Forecaster" in unknown.stderr, unknown.stderr
    for target, code in (("127.0.0.1:1", "UNAVAILABLE"), ("ipv4:127.0.0.1", "UNKNOWN")):  # nothing there; no port
        r = _probe("--target", target, "--timeout", "2")
        assert r.returncode == 1 and f"cannot reach --target {target}: {code}: " in r.stderr, r.stderr
        assert "is a server running there" in r.stderr and "Traceback" not in r.stderr
    assert _probe("--no-such-flag").returncode == 1  # Docker reserves exit status 2
    assert _probe("--target", server.target, "--tls-cert", "c.pem").returncode == 1  # without --tls-key
    for bad, message in ((("--tls-server-name", "tft.internal"), "--tls-server-name is for a TLS connection"),
                         (("--timeout", "inf"), "--timeout inf: give a deadline in seconds"),
                         (("--timeout", "nan"), "--timeout nan: give a deadline in seconds"),
                         (("--timeout", "1e10"), "at most 1e+06")):  # a deadline gRPC would find passed at once
        refused = _probe("--target", server.target, *bad)
        assert refused.returncode == 1 and message in refused.stderr, (bad, refused.stderr[-1000:])

    # NOT_SERVING: a server started but not yet warmed up
    from serving.model import load_model
    from serving.server import ServerConfig, build_server

    async def main() -> tuple[int, bytes]:
        config = ServerConfig(model_path=tiny_model.model, port=0, device="cpu")
        srv = build_server(config, load_model(tiny_model.model, "cpu", threads=1))
        port = await srv.start()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "serving.health_probe", "--target", f"127.0.0.1:{port}", cwd=REPO,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await proc.communicate()
            return await proc.wait(), out
        finally:
            await srv.stop(0)

    code, out = asyncio.run(main())
    assert code == 1 and b"NOT_SERVING" in out, out


def _wait_until(holds: Callable[[], bool], s: LiveServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not holds():
        assert time.monotonic() < deadline and s.alive(), s.log_text()[-2000:]
        time.sleep(0.02)


def test_sigterm_finishes_every_call_in_flight_and_refuses_later_ones_retriably(tiny_model: Model,  # noqa: F811
                                                                                tmp_path: Path) -> None:
    """SIGTERM while 8 calls wait for their batch (--batch-wait fixed, 5 s): every one of them succeeds; a call
    that arrives during the drain is refused UNAVAILABLE (retriable), not CANCELLED (what gRPC answers to calls it
    holds when its own shutdown starts, which waits for the calls in flight); the process exits 0. Each step waits
    for what the server reports (its in-flight gauge, its health), never for a fixed time."""
    s = LiveServer(tiny_model.model, tmp_path / "server.log", "--batch-wait", "fixed", "--max-delay-ms", "5000",
                   "--grace", "60", "--metrics-port", "0")
    try:
        s.wait_serving()
        request = request_for(tiny_model, tiny_model.meta.symbols[0])
        with grpc.insecure_channel(s.target) as channel:
            stub = pb_grpc.ForecasterStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            in_flight = [stub.Predict.future(request, timeout=120) for _ in range(8)]
            _wait_until(lambda: metric(s.scrape(), "foxhunt_inflight_requests") == 8, s)
            s.proc.send_signal(signal.SIGTERM)
            _wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status
                        == health_pb2.HealthCheckResponse.NOT_SERVING, s)
            with pytest.raises(grpc.RpcError) as late:
                stub.Predict(request, timeout=60)
            assert late.value.code() == grpc.StatusCode.UNAVAILABLE, late.value.details()
            assert all(f.result().forecasts for f in in_flight)
        assert s.proc.wait(timeout=60) == 0, s.log_text()
        assert "Traceback" not in s.log_text()
    finally:
        s.kill()


def test_the_io_binding_path_equals_session_run(tiny_model: Model) -> None:  # noqa: F811
    """The CUDA path binds inputs and outputs to the device (IO binding); the same code bound to the CPU
    returns session.run's outputs, in output_names order, at every bucket size, so it runs in every test
    run, not only on a GPU."""
    from serving.model import dummy_inputs, load_model

    model = load_model(tiny_model.model, "cpu", threads=1)
    assert len(model.output_names) > 1  # the order of several outputs is what binding could get wrong
    rng = np.random.default_rng(0)
    for size in model.buckets:
        inputs = dummy_inputs(model.meta, size)
        for name, value in inputs.items():
            if value.dtype == np.float32:
                inputs[name] = rng.standard_normal(value.shape).astype(np.float32)
        bound = model._run_bound(inputs, "cpu")
        plain = model.session.run(list(model.output_names), inputs)
        assert len(bound) == len(plain)
        for name, b, p in zip(model.output_names, bound, plain, strict=True):
            assert b.shape == p.shape and b.dtype == p.dtype, name
            np.testing.assert_array_equal(b, p, err_msg=name)


@pytest.mark.parametrize("case", ["port", "metrics-port", "workers", "host"])
def test_a_port_that_cannot_be_bound_stops_the_start_with_one_line_naming_it(case: str, tiny_model: Model,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    """A port in use (gRPC's, the metrics', a --workers set's) or an address this machine lacks: exit 2 with one
    line naming the address and the fix, no traceback, and never `listening` (a supervisor waiting for that line
    would take the server for up). gRPC's own log line of the failure may come before it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        flags = {"port": ["--port", port, "--metrics-port", "0"],
                 "metrics-port": ["--port", "0", "--metrics-port", port],
                 "workers": ["--port", port, "--workers", "2"],
                 "host": ["--host", "192.0.2.1", "--port", "0"]}[case]  # TEST-NET-1: no machine's own address
        r = subprocess.run([sys.executable, "-m", "serving", "--model", str(tiny_model.model), "--device", "cpu",
                            *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "listening" not in r.stdout and "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and ("192.0.2.1" if case == "host" else port) in lines[0], r.stderr[-2000:]
    assert ("--metrics-port" in lines[0]) == (case == "metrics-port") and "Pick another" in lines[0], lines
