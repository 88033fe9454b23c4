"""Shared by the serving, reliability, fuzz and security tests: real models, built once per test run, and a
real `python -m serving` subprocess on 127.0.0.1:0.

Each model is made by the trainer's and the exporter's commands (tests.artifacts): `tiny_model` (bars only),
`covariates_model` (every kind of user input: observed, known, static, categorical) and `contracts_model` (trained
on per-contract futures bars). The fixtures are session-scoped and each model is built once a run for all of
pytest-xdist's workers; its files are shared, so tests read them and write elsewhere. Import a fixture into a
test module to use it. The build_* functions make the same models outside pytest (the benchmarks). A LiveServer
prints `listening on HOST:PORT`, logs to a file the tests read, and is killed in `finally`.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import grpc
import numpy as np
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from features.bars import Bars, read_bars
from features.model_meta import ModelMeta
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.request_from_bars import series_from_bars
from serving.wire import make_series
from tests.artifacts import REPO, TINY_TRAIN_FLAGS, make_bars, make_checkpoint, make_onnx, run_main, shared_dir
from tests.futures_bars import ES_LEGS, LIVE_PER_DAY, NQ_LEGS, contract_rows, write_training_bars

SERVICE = "foxhunt.tft.v1.Forecaster"


@dataclass
class Model:
    bars_path: Path
    model: Path
    meta: ModelMeta
    bars: Bars

    @property
    def ckpt(self) -> Path:
        """The trainer's checkpoint the model was exported from."""
        return self.model.parent / "ckpt.pt"


@dataclass
class CovariatesModel:
    """A model with every kind of user input (LIVE_FLAGS over the columns of `_add_user_columns`); `bars` holds
    its real and label columns."""

    model: Path
    meta: ModelMeta
    bars: Bars


@dataclass
class ContractsModel:
    """A model trained on ESH5, ESM5, NQH5 and NQM5 bars; `es` and `nq` are every contract's rows (ES's after the
    training sessions too: ESU5 is a contract the model never saw)."""

    model: Path
    meta: ModelMeta
    es: dict[str, np.ndarray]
    nq: dict[str, np.ndarray]


def _meta(model: Path) -> ModelMeta:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return ModelMeta.from_props(dict(session.get_modelmeta().custom_metadata_map))


def build_tiny_model(work: Path, reuse: bool = False) -> Model:
    """bars.parquet, a tiny trained checkpoint and its exported model.onnx in `work` (the commands, ~10 s; with
    `reuse`, those of an earlier build in `work` when it finished)."""
    model = work / "model.onnx"
    if not (reuse and model.exists()):
        make_onnx(make_checkpoint(work), model, ("--threads", "1"))
    return Model(work / "bars.parquet", model, _meta(model), read_bars(work / "bars.parquet"))


LIVE_FLAGS = ("--features", "regime", "--known-features", "event,session", "--static-features", "scale,exchange",
              "--categorical-features", "regime,session,exchange")


def _add_user_columns(path: Path) -> None:
    """Over the bars file: an event flag every 30 bars and a session label by time of day (known), a scale and an
    exchange per symbol (static), a regime label every 100 bars (observed)."""
    t = pq.read_table(path)
    symbol = np.asarray(t.column("symbol").to_pylist())
    row = np.concatenate([np.arange(k) for k in np.unique(symbol, return_counts=True)[1]])
    t = t.append_column("event", pa.array((row % 30 == 0).astype(np.float64)))
    t = t.append_column("session", pa.array(np.where(row % 390 < 200, "open", "close")))
    t = t.append_column("scale", pa.array(np.where(symbol == "ES", 1.0, 2.5)))
    t = t.append_column("exchange", pa.array(np.where(symbol == "ES", "CME", "CBOT")))
    t = t.append_column("regime", pa.array(np.where(row // 100 % 2 == 0, "calm", "busy")))
    pq.write_table(t, path)


def build_covariates_model(work: Path, reuse: bool = False) -> CovariatesModel:
    """A tiny model trained and exported with every kind of user input by the commands (with a Triton
    repository beside it, `work`/triton; `reuse` as build_tiny_model)."""
    bars_path, model = work / "bars.parquet", work / "model.onnx"
    if not (reuse and model.exists()):
        make_bars(bars_path, bars=1200)
        _add_user_columns(bars_path)
        ckpt = work / "ckpt.pt"
        r = run_main(["-m", "trainer", "--parquet", str(bars_path), "--out", str(ckpt), *TINY_TRAIN_FLAGS,
                      *LIVE_FLAGS])
        assert r.returncode == 0, r.stderr[-4000:]
        make_onnx(ckpt, model, ("--threads", "1", "--triton-repo", str(work / "triton")))
    meta = _meta(model)
    fc = meta.feature_config
    return CovariatesModel(model, meta, read_bars(bars_path, None, fc.real_columns,
                                                  label_columns=fc.categorical_columns))


def build_contracts_model(work: Path, reuse: bool = False) -> ContractsModel:
    """A tiny model trained on ESH5, ESM5, NQH5 and NQM5 bars (Databento-like columns) and exported by the
    commands (`reuse` as build_tiny_model)."""
    es = contract_rows(ES_LEGS, LIVE_PER_DAY, seed=1, base=5000.0)
    nq = contract_rows(NQ_LEGS, LIVE_PER_DAY, seed=2, base=18000.0)
    model = work / "model.onnx"
    if not (reuse and model.exists()):
        write_training_bars(work / "bars.parquet", es, nq)
        ckpt = work / "ckpt.pt"
        r = run_main(["-m", "trainer", "--parquet", str(work / "bars.parquet"), "--time-col", "ts_event", "--out",
                      str(ckpt), *TINY_TRAIN_FLAGS])
        assert r.returncode == 0, r.stderr[-4000:]
        make_onnx(ckpt, model, ("--threads", "1"))
    return ContractsModel(model, _meta(model), es, nq)


T = TypeVar("T")
_BUILT: dict[tuple[str, Path], object] = {}  # each module that imports a fixture gets its own copy of it (pytest
# keys fixtures by where they are used), so each model is memoised here too, keyed by its name and the session's root


def _once(name: str, factory: pytest.TempPathFactory, build: Callable[[Path, bool], T]) -> T:
    """The model `build` makes, built once per test run for all workers (tests.artifacts.shared_dir) and read once
    per worker."""
    key = (name, factory.getbasetemp())
    if key not in _BUILT:
        _BUILT[key] = build(shared_dir(factory, name, lambda work: build(work, False)), True)
    return cast(T, _BUILT[key])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """bars.parquet, a tiny trained checkpoint and its exported model.onnx (the commands, ~10 s, once a run)."""
    return _once("live_model", tmp_path_factory, build_tiny_model)


@pytest.fixture(scope="session")
def covariates_model(tmp_path_factory: pytest.TempPathFactory) -> CovariatesModel:
    """The model with every kind of user input (the commands, once a run)."""
    return _once("covariates_model", tmp_path_factory, build_covariates_model)


@pytest.fixture(scope="session")
def contracts_model(tmp_path_factory: pytest.TempPathFactory) -> ContractsModel:
    """The model trained on per-contract futures bars (the commands, once a run)."""
    return _once("contracts_model", tmp_path_factory, build_contracts_model)


def covariates_series(meta: ModelMeta, bars: Bars, anchor: int, n: int | None = None,
                      **override: object) -> pb.Series:
    """The request of a covariates model for the window at row `anchor` of `bars` (its last `n`, default
    bars_required, bars), every value from the bars; `override` replaces one of make_series' arguments."""
    fc, h = meta.feature_config, meta.horizon
    n = n or meta.bars_required
    b = bars
    past, future = slice(anchor - n + 1, anchor + 1), slice(anchor + 1, anchor + 1 + h)
    known_labels = [c for c in fc.known_columns if c in fc.categorical_columns]
    args: dict[str, object] = {
        "user": {c: b.user[c][past] for c in fc.series_reals},
        "labels": {c: b.labels[c][past] for c in fc.series_categoricals},
        "future": {c: b.user[c][future] for c in fc.known_columns if c not in known_labels},
        "future_labels": {c: b.labels[c][future] for c in known_labels},
        "static": {c: b.labels[c][anchor] if c in fc.categorical_columns else float(b.user[c][anchor])
                   for c in fc.static_columns},
    } | override
    return make_series(str(b.symbol[anchor]), b.timestamp_ns[past], b.open[past], b.high[past], b.low[past],
                       b.close[past], b.volume[past], **args)  # type: ignore[arg-type]


def request_for(m: Model, symbol: str, end: int | None = None, n: int | None = None,
                explain: bool = False) -> pb.PredictRequest:
    """The `n` (default bars_required) bars of `symbol` ending at its row `end` (default: its last)."""
    bars = m.bars
    if end is not None:
        stop = bars.series_slices()[symbol].start + end + 1
        bars = Bars(bars.timestamp_ns[:stop], bars.symbol[:stop], bars.open[:stop], bars.high[:stop],
                    bars.low[:stop], bars.close[:stop], bars.volume[:stop])
    return pb.PredictRequest(series=[series_from_bars(bars, symbol, n or m.meta.bars_required)], explain=explain)


class LiveServer:
    """`python -m serving --port 0 --device cpu --threads 1 FLAGS` with stderr in `log` (`new_session`: the server
    leads a process group of its own, as a command started from a terminal does; `code`: the checkout whose
    `serving` package runs, this one by default)."""

    def __init__(self, model: Path, log: Path, *flags: str, host: str = "127.0.0.1", new_session: bool = False,
                 code: Path = REPO) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "serving", "--model", str(model), "--port", "0", "--device", "cpu", "--threads",
               "1", *flags]
        if host != "127.0.0.1":
            cmd += ["--host", host]
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=code, stdout=subprocess.PIPE, stderr=err, text=True,
                                         start_new_session=new_session)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()
        self.address = self.metrics = ""
        self.metrics_all: list[str] = []  # one endpoint per worker with --workers N
        workers = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 1
        want_metrics = workers if "--metrics-port" in flags else 0
        deadline = time.monotonic() + 60
        line = ""
        while not self.address or len(self.metrics_all) < want_metrics:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if m := re.fullmatch(r"listening on (\S+):(\d+)\n", line):
                self.address, self.port = m.group(1), int(m.group(2))
            if m := re.fullmatch(r"metrics on (\S+)\n", line):
                self.metrics = self.metrics or m.group(1)
                self.metrics_all.append(m.group(1))
        if not self.address:
            self.kill()
            raise AssertionError(f"server did not report its port ({line!r}):\n{self.log_text()}")
        self.target = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.target)  # for plaintext servers; TLS tests make their own
        self.stub = pb_grpc.ForecasterStub(self.channel)

    def _read(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.put(line)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_kib(self) -> int:
        """VmRSS of the server process, KiB (Linux /proc)."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        m = re.search(r"^VmRSS:\s+(\d+) kB$", text, re.M)
        assert m, text
        return int(m.group(1))

    def wait_serving(self, channel: grpc.Channel | None = None, timeout: float = 60) -> None:
        own = channel is None
        ch = channel or grpc.insecure_channel(self.target)
        try:
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert self.alive(), f"server exited {self.proc.returncode}:\n{self.log_text()}"
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
            raise AssertionError(f"not SERVING after {timeout} s:\n{self.log_text()}")
        finally:
            if own:
                ch.close()

    def scrape(self, endpoint: str = "") -> str:
        """The Prometheus text of `--metrics-port 0`'s endpoint (or of one worker's, `endpoint`)."""
        return urllib.request.urlopen(f"http://{endpoint or self.metrics}/metrics", timeout=5).read().decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if hasattr(self, "channel"):
            self.channel.close()


def serving(model: Path, log: Path, *flags: str) -> Iterator[LiveServer]:
    """A LiveServer that is SERVING for as long as the caller holds it, killed after (a server fixture's body:
    `yield from serving(...)`)."""
    s = LiveServer(model, log, *flags)
    try:
        s.wait_serving()
        yield s
    finally:
        s.kill()


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one sample in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    return 0.0
