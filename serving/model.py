"""The ONNX model the server runs: load and check it, place it on a device, warm it up, run it.

`load_model` reads the file once (what is hashed is what is loaded), creates one ONNX
Runtime session, parses the metadata contract (`features.model_meta`) and checks the
graph's inputs and outputs against it; anything wrong is a `ModelLoadError`, so a bad file
never replaces a good one. `ModelHolder` swaps models atomically: a request takes one
snapshot of the current model and runs all its windows on it.

Devices. `cuda` runs on the CUDA execution provider with IO binding, or raises
`DeviceUnavailable` naming why (ONNX Runtime never refuses a provider it cannot load: it
logs the reason and runs on the CPU, so the session's providers are checked and the native
log is read for the reason). Export's placement gate proved, or did not, that every compute
node runs on CUDA (only shape computation may stay on the CPU); `cuda` refuses a model
without that proof. `cpu` runs on the CPU provider; `auto` tries `cuda` and falls back to
`cpu` with a warning that GetModelInfo and the log repeat.

Batch sizes. A run of n windows is padded (repeating its last window) to the smallest
bucket >= n of `batch_buckets(max_batch)`, so the set of shapes the model ever sees is
small, known in advance and warmed up before the server reports SERVING. Rows of a batch
are independent in the TFT, so padding changes no result.
"""

from __future__ import annotations

import hashlib
import logging
import re
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from features.file_kind import hint
from features.model_meta import PREFIX, ModelMeta, ModelMetaError, graph_digest, lookup_rows, stored_props
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    EXPLAIN_OUTPUTS,
    MODEL_INPUTS,
    QUANTILES,
    STATIC_CATEGORICAL,
)
from serving.cuda_libs import preload_cuda_libraries
from serving.errors import DeviceUnavailable, ModelLoadError
from serving.native_log import is_onnxruntime_line, native_stderr, provider_failure_reason, strip_ansi
from serving.preprocess import INPUT_DTYPES

log = logging.getLogger("serving")

DEVICES = ("auto", "cpu", "cuda")
CPU_EP = "CPUExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CUDA_OPTIONS = {"use_tf32": "0"}  # fp32 as export's parity check ran it (TF32 would need its own parity check)
ORT_TYPES: dict[type[np.generic], str] = {np.int64: "tensor(int64)", np.float32: "tensor(float)"}


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 3, 4, 6, 8, 12, 16, ... (steps of at most 1.5x) up to max_batch, which is one."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, k = {max_batch}, 1
    while k < max_batch:
        sizes.add(k)
        if k >= 2 and k * 3 // 2 < max_batch:
            sizes.add(k * 3 // 2)
        k *= 2
    return tuple(sorted(sizes))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch of {n} windows exceeds the largest bucket {buckets[-1]}")


@dataclass
class SessionPlacement:
    session: ort.InferenceSession
    device: str  # cpu | cuda: where it actually runs
    fallback_warning: str  # non-empty when --device auto fell back to the CPU


@dataclass
class LoadedModel:
    """One loaded, checked model. `run` is called from one thread at a time (the batcher's)."""

    path: str
    meta: ModelMeta
    session: ort.InferenceSession
    sha256: str
    device_requested: str
    device: str
    device_id: int
    fallback_warning: str
    output_names: tuple[str, ...]  # fetched on every run: quantiles, then explain outputs if present
    buckets: tuple[int, ...]
    loaded_at_ns: int = field(default_factory=time.time_ns)
    warmed: bool = False

    @property
    def version(self) -> str:
        return self.meta.model_version

    @property
    def providers(self) -> list[str]:
        return list(self.session.get_providers())

    @property
    def provider(self) -> str:
        return self.providers[0]

    @property
    def explain_available(self) -> bool:
        return all(name in self.output_names for name in EXPLAIN_OUTPUTS)

    # ---- running ------------------------------------------------------------------------
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """inputs: canonical name -> [n, ...]; outputs: name -> [n, ...]. Runs of at most the largest bucket."""
        n = int(inputs[STATIC_CATEGORICAL].shape[0])
        top = self.buckets[-1]
        if n > top:
            parts = [self.run({k: v[i:i + top] for k, v in inputs.items()}) for i in range(0, n, top)]
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        size = bucket_for(n, self.buckets)
        if size != n:  # pad by repeating the last window (a valid input; rows are independent)
            pad = np.full(size - n, n - 1)
            inputs = {k: np.concatenate([v, v[pad]]) for k, v in inputs.items()}
        if self.device == "cuda":
            outs = self._run_bound(inputs, "cuda")
        else:
            outs = self.session.run(list(self.output_names), inputs)
        return {name: np.asarray(o)[:n] for name, o in zip(self.output_names, outs, strict=True)}

    def _run_bound(self, inputs: dict[str, np.ndarray], device: str) -> list[np.ndarray]:
        """IO binding (the CUDA path): inputs copied to `device` once, outputs allocated there and copied
        back, in output_names order. Works on "cpu" too, which is how tests without a GPU run this code."""
        binding = self.session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, device, self.device_id))
        for name in self.output_names:
            binding.bind_output(name, device, self.device_id)
        self.session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())

    def _trial_run(self, size: int) -> np.ndarray:
        """The quantiles of a valid input of `size` windows (dummy_inputs), their shape checked; ModelLoadError
        when the run fails, saying what may help."""
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
        return q

    def warm_up(self, stop: threading.Event | None = None) -> float:
        """Run once at every bucket size (first runs allocate and tune); check the outputs. Returns seconds.
        WarmUpStopped once `stop` is set (SIGTERM): a thread cannot be cancelled, so it looks between runs, and
        a drain waits for one run at most."""
        start = time.perf_counter()
        for size in self.buckets:
            if stop is not None and stop.is_set():
                raise WarmUpStopped(f"warm-up of {self.path} stopped before batch size {size}")
            q = self._trial_run(size)
            if not np.isfinite(q).all():
                raise ModelLoadError(f"{self.path}: output {QUANTILES!r} is not finite on the warm-up input "
                                     f"(batch {size}); re-export the model")
        self.warmed = True
        return time.perf_counter() - start


def dummy_inputs(meta: ModelMeta, batch: int) -> dict[str, np.ndarray]:
    """A valid input of `batch` windows: symbol ids cycle through the vocabulary, features are zero."""
    schema, L, H = meta.feature_schema, meta.encoder_length, meta.horizon
    n_obs, n_known = len(schema.observed), len(schema.known)
    return {
        STATIC_CATEGORICAL: (np.arange(batch) % len(meta.symbols)).astype(np.int64)[:, None],  # [B, 1]
        ENCODER_OBSERVED: np.zeros((batch, L, n_obs), dtype=np.float32),
        ENCODER_KNOWN: np.zeros((batch, L, n_known), dtype=np.float32),
        DECODER_KNOWN: np.zeros((batch, H, n_known), dtype=np.float32),
    }


# ---- loading -------------------------------------------------------------------------------
def _session_options(threads: int) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads  # never "all cores": the host runs other work too
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep, not spin
    return so


def _no_gpu_reason() -> str:
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return "no NVIDIA GPU is visible to this process (no /dev/nvidia*; in a container, run it with --gpus)"
    return ""


def _cuda_session(model_bytes: bytes, path: str, device_id: int, threads: int, quiet_failure: bool = False
                  ) -> ort.InferenceSession:
    """A session whose main provider is CUDA (the CPU takes only what the CUDA provider hands it), or
    DeviceUnavailable naming why not. ONNX Runtime's log lines of the attempt are echoed to stderr,
    except with `quiet_failure` when it failed (--device auto: the fallback warning names the reason,
    once, rather than a screenful of red on every start and reload of a CPU host)."""
    if CUDA_EP not in ort.get_available_providers():
        raise DeviceUnavailable(f"CUDA requested but this onnxruntime build ({ort.__version__}) has no CUDA "
                                f"execution provider (available: {', '.join(ort.get_available_providers())}); "
                                "install onnxruntime-gpu")
    preload_cuda_libraries()
    # the CPU provider stays listed for the shape computation the CUDA provider hands over on purpose;
    # that every compute node runs on CUDA is what export's placement gate proved (checked in load_model)
    providers: list[str | tuple[str, dict[str, str]]] = [(CUDA_EP, {**CUDA_OPTIONS, "device_id": str(device_id)}),
                                                         CPU_EP]
    failed = False

    def echoed(line: str) -> bool:
        quiet = quiet_failure and failed  # ONNX Runtime's lines go, and the colour resets left between them
        return not (quiet and (is_onnxruntime_line(line) or not strip_ansi(line).strip()))

    with native_stderr(echo=echoed) as log_lines:
        session = _new_session(model_bytes, path, providers, _session_options(threads))
        failed = session.get_providers()[0] != CUDA_EP
    if failed:
        why = provider_failure_reason(log_lines) or _no_gpu_reason() or "ONNX Runtime logged no reason"
        raise DeviceUnavailable(f"CUDA requested but ONNX Runtime could not create the CUDA execution provider "
                                f"(the session fell back to {session.get_providers()}): {why}")
    return session


def _create_session(model_bytes: bytes, path: str, device: str, device_id: int, threads: int) -> SessionPlacement:
    if device == "cpu":
        return SessionPlacement(_new_session(model_bytes, path, [CPU_EP], _session_options(threads)), "cpu", "")
    if device == "cuda":
        return SessionPlacement(_cuda_session(model_bytes, path, device_id, threads), "cuda", "")
    try:  # auto
        return SessionPlacement(_cuda_session(model_bytes, path, device_id, threads, quiet_failure=True), "cuda", "")
    except DeviceUnavailable as exc:
        warning = f"--device auto fell back to the CPU: {exc}"
        log.warning("%s", warning)
        session = _new_session(model_bytes, path, [CPU_EP], _session_options(threads))
        return SessionPlacement(session, "cpu", warning)


def _check_placement(meta: ModelMeta, placement: SessionPlacement, device_requested: str, path: str) -> None:
    """On CUDA, the model should be one whose placement export proved (every compute node on CUDA):
    `--device cuda` refuses any other, `--device auto` runs it with a warning."""
    if placement.device != "cuda":
        return
    gate, required = meta.placement.get("gate"), meta.placement.get("required_device")
    if gate == "passed" and required == "cuda":
        return
    message = (f"{path}: export did not prove that every compute node runs on CUDA (placement gate "
               f"{gate!r}, required device {required!r}); re-export on a GPU machine with "
               "`python -m export ckpt.pt model.onnx --require-device cuda`")
    if device_requested == "cuda":
        raise ModelLoadError(message)
    log.warning("%s; some nodes may run on the CPU", message)


def _new_session(model_bytes: bytes, path: str, providers: Sequence[str | tuple[str, dict[str, str]]],
                 so: ort.SessionOptions) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(model_bytes, so, providers=providers)
    except Exception as exc:  # ORT raises its own exception types (InvalidProtobuf, InvalidGraph, Fail, ...)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: ONNX Runtime cannot load the model: {first}{hint(path, 'an ONNX model')}") \
            from None


def _check_signature(session: ort.InferenceSession, meta: ModelMeta, path: str) -> tuple[str, ...]:
    """Inputs and outputs against the metadata; returns the output names to fetch."""
    schema, L, H, Q = meta.feature_schema, meta.encoder_length, meta.horizon, len(meta.quantiles)
    expected_inputs = {
        STATIC_CATEGORICAL: (len(schema.static),),
        ENCODER_OBSERVED: (L, len(schema.observed)),
        ENCODER_KNOWN: (L, len(schema.known)),
        DECODER_KNOWN: (H, len(schema.known)),
    }
    inputs = {i.name: i for i in session.get_inputs()}
    if sorted(inputs) != sorted(MODEL_INPUTS):
        raise ModelLoadError(f"{path}: inputs are {sorted(inputs)}, expected {sorted(MODEL_INPUTS)}")
    for name, dims in expected_inputs.items():
        arg = inputs[name]
        if arg.type != ORT_TYPES[INPUT_DTYPES[name]]:
            raise ModelLoadError(f"{path}: input {name!r} is {arg.type}, expected {ORT_TYPES[INPUT_DTYPES[name]]}")
        shape = list(arg.shape)
        if len(shape) != 1 + len(dims) or (isinstance(shape[0], int) and shape[0] != -1):
            raise ModelLoadError(f"{path}: input {name!r} has shape {shape}, expected [batch, "
                                 f"{', '.join(map(str, dims))}] with a dynamic batch axis")
        if any(isinstance(s, int) and s != d for s, d in zip(shape[1:], dims, strict=True)):
            raise ModelLoadError(f"{path}: input {name!r} has shape {shape}, expected [batch, "
                                 f"{', '.join(map(str, dims))}] (from the model metadata)")
    outputs = {o.name for o in session.get_outputs()}
    if QUANTILES not in outputs:
        raise ModelLoadError(f"{path}: no output {QUANTILES!r} (outputs: {sorted(outputs)})")
    q_shape = next(list(o.shape) for o in session.get_outputs() if o.name == QUANTILES)
    if len(q_shape) != 3 or any(isinstance(s, int) and s != d for s, d in zip(q_shape[1:], (H, Q), strict=True)):
        raise ModelLoadError(f"{path}: output {QUANTILES!r} has shape {q_shape}, expected [batch, {H}, {Q}] "
                             "(horizon and quantiles from the model metadata)")
    present = [name for name in EXPLAIN_OUTPUTS if name in outputs]
    if meta.explain and len(present) != len(EXPLAIN_OUTPUTS):
        missing = sorted(set(EXPLAIN_OUTPUTS) - outputs)
        raise ModelLoadError(f"{path}: metadata says explain outputs are present but {missing} are missing")
    if present and len(present) != len(EXPLAIN_OUTPUTS):
        present = []  # a partial set cannot fill an explanation; serve the quantiles only
    return (QUANTILES, *present)


def _check_meta(meta: ModelMeta, path: str) -> None:
    """What the server relies on beyond `ModelMeta.check`: values it computes with or repeats to callers."""
    problems = []
    if meta.horizon * meta.bar_interval_ns >= 1 << 62:
        problems.append(f"horizon {meta.horizon} x bar_interval_ns {meta.bar_interval_ns} spans centuries")
    if not meta.model_version or len(meta.model_version) > 200 or not meta.model_version.isprintable():
        problems.append("model_version must be a printable string of 1..200 characters")
    if problems:
        raise ModelLoadError(f"{path}: model metadata is unusable: " + "; ".join(problems) + "; re-export the model")


def _check_before_session(model_bytes: bytes, path: str) -> ModelMeta | None:
    """A model of ours is refused for its metadata or a changed graph before ONNX Runtime builds a session of it
    (on CUDA, seconds of device work, and a damaged graph never reaches ONNX Runtime's parser). Bytes that do not
    hold our metadata are left to the session, whose error says what they are (None)."""
    try:
        props = stored_props(model_bytes)
    except ModelMetaError as exc:  # our metadata, damaged
        raise ModelLoadError(f"{path}: {exc}") from None
    except ValueError:  # not a protobuf message at all: ONNX Runtime's error names it
        return None
    if PREFIX + "format" not in props:
        return None
    try:
        meta = ModelMeta.from_props(props)
    except ModelMetaError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    _check_stored(meta, model_bytes, path)
    return meta


def _check_stored(meta: ModelMeta, model_bytes: bytes, path: str) -> None:
    """What the file's metadata and graph must hold together, wherever the metadata was read from."""
    _check_meta(meta, path)
    _check_graph(meta, model_bytes, path)
    _check_vocabulary(meta, model_bytes, path)


def _check_vocabulary(meta: ModelMeta, model_bytes: bytes, path: str) -> None:
    """The symbols the metadata names must be the rows of the graph's symbol embedding (export writes them so):
    an id past its end would fail on the CPU and read zeros on CUDA, and metadata is outside the graph's digest."""
    try:
        rows = lookup_rows(model_bytes, STATIC_CATEGORICAL)
    except ValueError:
        return  # not a protobuf message: ONNX Runtime's error names it
    if rows is not None and rows != len(meta.symbols):
        raise ModelLoadError(f"{path}: the metadata names {len(meta.symbols)} symbol(s), but the graph's symbol "
                             f"embedding has {rows} row(s): the metadata was edited after export; re-export the model")


def _check_graph(meta: ModelMeta, model_bytes: bytes, path: str) -> None:
    """The graph must be the one export checked: a bit flipped in a weight (disk, copy, transfer) still parses
    and runs, and would serve other forecasts under the same version and parity report."""
    if not meta.graph_sha256:
        log.warning("%s: exported before models recorded their graph's digest, so a change to it since the export "
                    "cannot be detected; export it again to have it checked", path)
        return
    try:
        digest = graph_digest(model_bytes)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if digest != meta.graph_sha256:
        raise ModelLoadError(f"{path}: the model's graph is not the one export checked (graph sha256 {digest[:12]}, "
                             f"export recorded {meta.graph_sha256[:12]}): the file was damaged or changed after "
                             "export; copy it again, or export it again from its checkpoint")


def load_model(path: str | Path, device: str = "cpu", threads: int = 1, max_batch: int = 64,
               device_id: int = 0) -> LoadedModel:
    """Read, check and place a model; ModelLoadError (or DeviceUnavailable) says what is wrong."""
    if device not in DEVICES:
        raise ModelLoadError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    p = str(path)
    try:
        if not stat.S_ISREG(Path(p).stat().st_mode):  # a directory, a FIFO, /dev/zero: never read those whole
            raise ModelLoadError(f"{p}: not a regular file; give the .onnx file written by `python -m export`")
        model_bytes = Path(p).read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot read the model file: {exc.strerror or exc}") from None
    if not model_bytes:
        raise ModelLoadError(f"{p}: the model file is empty")
    checked = _check_before_session(model_bytes, p)
    placement = _create_session(model_bytes, p, device, device_id, threads)
    session = placement.session
    if checked is not None:
        meta = checked
    else:  # not readable without a session (nor refused by ONNX Runtime): its metadata as the session reads it
        try:
            meta = ModelMeta.from_props(dict(session.get_modelmeta().custom_metadata_map))
        except (ModelMetaError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{p}: {exc}") from None
        _check_stored(meta, model_bytes, p)
    output_names = _check_signature(session, meta, p)
    _check_placement(meta, placement, device, p)
    return LoadedModel(
        path=p,
        meta=meta,
        session=session,
        sha256=hashlib.sha256(model_bytes).hexdigest(),
        device_requested=device,
        device=placement.device,
        device_id=device_id,
        fallback_warning=placement.fallback_warning,
        output_names=output_names,
        buckets=batch_buckets(max_batch),
    )


def load_and_warm(path: str | Path, device: str, threads: int, max_batch: int, device_id: int = 0,
                  stop: threading.Event | None = None) -> LoadedModel:
    """load_model + warm_up: what a SIGHUP reload does before it swaps the model in."""
    model = load_model(path, device, threads, max_batch, device_id)
    model.warm_up(stop)
    return model


class WarmUpStopped(Exception):
    """SIGTERM came while a model warmed up: the warm-up ends between two runs."""


class ModelHolder:
    """The model being served; `swap` replaces it in one assignment (requests hold their own snapshot)."""

    def __init__(self, model: LoadedModel) -> None:
        self._model = model
        self.generation = 1  # bumped on every swap

    @property
    def current(self) -> LoadedModel:
        return self._model

    def swap(self, model: LoadedModel) -> LoadedModel:
        old, self._model = self._model, model
        self.generation += 1
        return old
