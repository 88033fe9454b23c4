"""Shared by the serving, reliability, fuzz and security tests: one tiny real model per session and a
real `python -m serving` subprocess on 127.0.0.1:0.

The model is made by the real trainer and exporter (tests.artifacts) once per test session
(`tiny_model` is session-scoped; import it into a test module to use it). A LiveServer
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import onnxruntime as ort
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from features.bars import Bars, read_bars
from features.model_meta import ModelMeta
from serving.client import series_from_bars
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from tests.artifacts import REPO, make_checkpoint, make_onnx

SERVICE = "foxhunt.tft.v1.Forecaster"


@dataclass
class Model:
    bars_path: Path
    model: Path
    meta: ModelMeta
    bars: Bars


_BUILT: dict[Path, Model] = {}  # one model per session: each module that imports the fixture gets its own copy
# of it (pytest keys fixtures by where they are used), so the build is memoised here, keyed by the session's root


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """bars.parquet, a tiny trained checkpoint and its exported model.onnx (real commands, ~40 s, once)."""
    root = tmp_path_factory.getbasetemp()
    if root not in _BUILT:
        work = tmp_path_factory.mktemp("live_model")
        ckpt = make_checkpoint(work)
        model = make_onnx(ckpt, work / "model.onnx", ("--threads", "1"))
        session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        meta = ModelMeta.from_props(dict(session.get_modelmeta().custom_metadata_map))
        _BUILT[root] = Model(work / "bars.parquet", model, meta, read_bars(work / "bars.parquet"))
    return _BUILT[root]


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
    leads a process group of its own, as a command started from a terminal does)."""

    def __init__(self, model: Path, log: Path, *flags: str, host: str = "127.0.0.1", new_session: bool = False) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "serving", "--model", str(model), "--port", "0", "--device", "cpu", "--threads",
               "1", *flags]
        if host != "127.0.0.1":
            cmd += ["--host", host]
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
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
