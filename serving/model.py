"""The ONNX model the server runs: load and check it, place it on a device, warm it up, run it.

`load_model` reads the file once, checks its metadata and graph digest and creates one session; anything wrong is a
`ModelLoadError`, so a bad file never replaces a good one.

A run of n windows is padded (repeating its last window) to the smallest bucket >= n, so the few shapes the model sees
are warmed up before SERVING; rows are independent, so padding changes no result.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import re
import stat
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from features.file_kind import hint
from features.model_meta import PREFIX, ModelMeta, ModelMetaError, graph_digest, stored_props
from features.ort import is_onnxruntime_line, native_stderr, preload_cuda_libraries, provider_failure_reason
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    EXPLAIN_OUTPUTS,
    QUANTILES,
    STATIC_CATEGORICAL,
    STATIC_REAL,
    Role,
)
from serving.errors import DeviceUnavailable, ModelLoadError

log = logging.getLogger("serving")

DEVICES = ("auto", "cpu", "cuda")
CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CUDA_OPTIONS = {"use_tf32": "0"}  # fp32 as export's parity check ran it (TF32 would need its own parity check)
NO_GPU = "no NVIDIA GPU is visible to this process (no /dev/nvidia*; in a container, run it with --gpus)"


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 3, 4, 6, 8, 12, 16, ... (steps of at most 1.5x) up to max_batch, which is one."""
    sizes, k = {max_batch}, 1
    while k < max_batch:
        sizes.add(k)
        if k >= 2 and k * 3 // 2 < max_batch:
            sizes.add(k * 3 // 2)
        k *= 2
    return tuple(sorted(sizes))


@dataclass
class LoadedModel:
    """One loaded, checked model. `run` is called from one thread at a time (the batcher's)."""

    path: str
    meta: ModelMeta
    session: ort.InferenceSession
    sha256: str
    device_requested: str
    device: str  # cpu | cuda: where it actually runs
    device_id: int
    fallback_warning: str  # non-empty when --device auto fell back to the CPU
    output_names: tuple[str, ...]  # fetched on every run: quantiles, then explain outputs if present
    buckets: tuple[int, ...]
    loaded_at_ns: int = field(default_factory=time.time_ns)
    warmed: bool = False

    @property
    def version(self) -> str:
        return self.meta.model_version

    @property
    def provider(self) -> str:
        return str(self.session.get_providers()[0])

    @property
    def explain_available(self) -> bool:
        return all(name in self.output_names for name in EXPLAIN_OUTPUTS)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """inputs: canonical name -> [n, ...]; outputs: name -> [n, ...], in runs of at most the largest bucket."""
        n = int(inputs[STATIC_CATEGORICAL].shape[0])
        top = self.buckets[-1]
        if n > top:
            parts = [self.run({k: v[i:i + top] for k, v in inputs.items()}) for i in range(0, n, top)]
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        size = self.buckets[bisect.bisect_left(self.buckets, n)]  # the smallest bucket >= n
        if size != n:  # pad by repeating the last window (a valid input; rows are independent)
            pad = np.full(size - n, n - 1)
            inputs = {k: np.concatenate([v, v[pad]]) for k, v in inputs.items()}
        outs = self._run_bound(inputs, "cuda") if self.device == "cuda" else \
            self.session.run(list(self.output_names), inputs)
        return {name: np.asarray(o)[:n] for name, o in zip(self.output_names, outs, strict=True)}

    def _run_bound(self, inputs: dict[str, np.ndarray], device: str) -> list[np.ndarray]:
        """IO binding: inputs copied to `device` once, outputs allocated there and copied back. Works on "cpu"
        too, which is how tests without a GPU run it."""
        binding = self.session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, self.device_id))
        for name in self.output_names:
            binding.bind_output(name, device, self.device_id)
        self.session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())

    def warm_up(self, stop: threading.Event | None = None) -> float:
        """Run a dummy input once at every bucket size and check the outputs (ModelLoadError); returns seconds.
        WarmUpStopped between runs once `stop` is set (SIGTERM)."""
        start = time.perf_counter()
        for size in self.buckets:
            if stop is not None and stop.is_set():
                raise WarmUpStopped(f"warm-up of {self.path} stopped before batch size {size}")
            try:
                q = self.run(dummy_inputs(self.meta, size))[QUANTILES]
            except Exception as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                helps = ("lower --max-batch, or run fewer --workers on this device"
                         if re.search(r"alloc|out of memory", reason, re.IGNORECASE) else
                         "if its metadata was edited after export, re-export the model")
                raise ModelLoadError(f"{self.path}: the model fails on the warm-up input (batch {size}): {reason}; "
                                     f"{helps}") from None
            expected = (size, self.meta.horizon, len(self.meta.quantiles))
            if q.shape != expected:
                raise ModelLoadError(f"{self.path}: output {QUANTILES!r} has shape {q.shape} at batch {size}, "
                                     f"expected {expected}")
            if not np.isfinite(q).all():
                raise ModelLoadError(f"{self.path}: output {QUANTILES!r} is not finite on the warm-up input "
                                     f"(batch {size}); re-export the model")
        self.warmed = True
        return time.perf_counter() - start


def dummy_inputs(meta: ModelMeta, batch: int) -> dict[str, np.ndarray]:
    """A valid input of `batch` windows for each of the model's inputs (`feature_schema.model_inputs`): symbol
    ids cycle through the vocabulary; every other value is zero, which is also a valid id (the unknown slot) for
    the user categoricals."""
    schema, L, H = meta.feature_schema, meta.encoder_length, meta.horizon
    n_obs, n_known = len(schema.observed), len(schema.known)
    static = np.zeros((batch, len(schema.categorical(Role.STATIC))), dtype=np.int64)  # [B, n_static_cat]
    static[:, 0] = np.arange(batch) % len(meta.symbols)
    inputs: dict[str, np.ndarray] = {
        STATIC_CATEGORICAL: static,
        ENCODER_OBSERVED: np.zeros((batch, L, n_obs), dtype=np.float32),
        ENCODER_KNOWN: np.zeros((batch, L, n_known), dtype=np.float32),
        DECODER_KNOWN: np.zeros((batch, H, n_known), dtype=np.float32),
        STATIC_REAL: np.zeros((batch, len(schema.static_reals)), dtype=np.float32),
    }
    return {name: inputs[name] for name in schema.model_inputs}


def _cuda_session(model_bytes: bytes, path: str, device_id: int, threads: int, quiet_failure: bool = False
                  ) -> ort.InferenceSession:
    """A session whose main provider is CUDA, or DeviceUnavailable naming why not. With `quiet_failure`
    (--device auto) ONNX Runtime's log of a failed attempt is dropped: the fallback warning names the reason."""
    if CUDA_EP not in ort.get_available_providers():
        raise DeviceUnavailable(f"CUDA requested but this onnxruntime build ({ort.__version__}) has no CUDA "
                                f"execution provider (available: {', '.join(ort.get_available_providers())}); "
                                "install onnxruntime-gpu")
    preload_cuda_libraries()
    providers: list[str | tuple[str, dict[str, str]]] = [(CUDA_EP, {**CUDA_OPTIONS, "device_id": str(device_id)}),
                                                         CPU_EP]
    with native_stderr() as lines:
        session = _new_session(model_bytes, path, providers, threads)
    failed = session.get_providers()[0] != CUDA_EP
    for line in lines:  # what other threads wrote meanwhile is always written back
        if not (quiet_failure and failed and is_onnxruntime_line(line)):
            print(line, file=sys.stderr)
    if failed:
        no_gpu = not any(Path("/dev").glob("nvidia[0-9]*"))
        why = provider_failure_reason(lines) or (NO_GPU if no_gpu else "ONNX Runtime logged no reason")
        raise DeviceUnavailable(f"CUDA requested but ONNX Runtime could not create the CUDA execution provider "
                                f"(the session fell back to {session.get_providers()}): {why}")
    return session


def _create_session(model_bytes: bytes, path: str, device: str, device_id: int, threads: int
                    ) -> tuple[ort.InferenceSession, str]:
    """The session, and the warning when --device auto fell back to the CPU."""
    warning = ""
    if device != "cpu":
        try:
            return _cuda_session(model_bytes, path, device_id, threads, quiet_failure=device == "auto"), ""
        except DeviceUnavailable as exc:
            if device == "cuda":
                raise
            warning = f"--device auto fell back to the CPU: {exc}"
            log.warning("%s", warning)
    return _new_session(model_bytes, path, [CPU_EP], threads), warning


def _check_placement(meta: ModelMeta, device: str, device_requested: str, path: str) -> None:
    """On CUDA, `--device cuda` refuses a model whose placement export did not prove; `auto` warns."""
    gate, required = meta.placement.get("gate"), meta.placement.get("required_device")
    if device != "cuda" or (gate == "passed" and required == "cuda"):
        return
    message = (f"{path}: export did not prove that every compute node runs on CUDA (placement gate "
               f"{gate!r}, required device {required!r}); re-export on a GPU machine with "
               "`python -m export ckpt.pt model.onnx --require-device cuda`")
    if device_requested == "cuda":
        raise ModelLoadError(message)
    log.warning("%s; some nodes may run on the CPU", message)


def _new_session(model_bytes: bytes, path: str, providers: Sequence[str | tuple[str, dict[str, str]]],
                 threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads  # never "all cores": the host runs other work too
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep, not spin
    try:
        return ort.InferenceSession(model_bytes, so, providers=providers)
    except Exception as exc:  # ORT raises its own exception types (InvalidProtobuf, InvalidGraph, Fail, ...)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: ONNX Runtime cannot load the model: {first}{hint(path, 'an ONNX model')}") \
            from None


def _read(path: str) -> bytes:
    try:
        if not stat.S_ISREG(Path(path).stat().st_mode):  # a directory, a FIFO, /dev/zero: never read those whole
            raise ModelLoadError(f"{path}: not a regular file; give the .onnx file written by `python -m export`")
        model_bytes = Path(path).read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read the model file: {exc.strerror or exc}") from None
    if not model_bytes:
        raise ModelLoadError(f"{path}: the model file is empty")
    return model_bytes


def _read_meta(model_bytes: bytes, path: str) -> ModelMeta:
    """The metadata, checked with the graph's digest before a session is built."""
    try:
        props = stored_props(model_bytes)
    except ModelMetaError as exc:  # our metadata, damaged
        raise ModelLoadError(f"{path}: {exc}") from None
    except ValueError:  # not a protobuf message
        props = {}
    if PREFIX + "format" not in props:  # not our model: ONNX Runtime's error says what the bytes are
        _new_session(model_bytes, path, [CPU_EP])
    try:
        meta = ModelMeta.from_props(props)
    except ModelMetaError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if (digest := graph_digest(model_bytes)) != meta.graph_sha256:
        raise ModelLoadError(f"{path}: the model's graph is not the one export checked (graph sha256 {digest[:12]}, "
                             f"export recorded {meta.graph_sha256[:12]}): the file was damaged or changed after "
                             "export; copy it again, or export it again from its checkpoint")
    return meta


def load_model(path: str | Path, device: str = "cpu", threads: int = 1, max_batch: int = 64,
               device_id: int = 0) -> LoadedModel:
    """Read, check and place a model; ModelLoadError (or DeviceUnavailable) says what is wrong."""
    p = str(path)
    model_bytes = _read(p)
    meta = _read_meta(model_bytes, p)
    session, fallback_warning = _create_session(model_bytes, p, device, device_id, threads)
    placed = "cuda" if session.get_providers()[0] == CUDA_EP else "cpu"
    _check_placement(meta, placed, device, p)
    return LoadedModel(path=p, meta=meta, session=session, sha256=hashlib.sha256(model_bytes).hexdigest(),
                       device_requested=device, device=placed, device_id=device_id, fallback_warning=fallback_warning,
                       output_names=(QUANTILES, *EXPLAIN_OUTPUTS) if meta.explain else (QUANTILES,),
                       buckets=batch_buckets(max_batch))


def load_and_warm(path: str | Path, device: str, threads: int, max_batch: int, device_id: int = 0,
                  stop: threading.Event | None = None) -> LoadedModel:
    """load_model + warm_up, as a SIGHUP reload does before the swap."""
    model = load_model(path, device, threads, max_batch, device_id)
    model.warm_up(stop)
    return model


class WarmUpStopped(Exception):
    """SIGTERM came during a warm-up."""
