"""ONNX Runtime sessions for the checks, each checked for the provider it got, and the device probe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnxruntime as ort
from onnx import TensorProto, helper

from export.errors import CheckFailed
from features.ort import native_stderr, preload_cuda_libraries, provider_failure_reason

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
DEVICES = {"cpu": CPU, "cuda": CUDA}
# fp32 parity on CUDA runs without TF32 (10-bit mantissa), as the server does; recorded in the parity report
CUDA_OPTIONS = {"device_id": "0", "use_tf32": "0"}


def session_options(threads: int, profile_prefix: str | None = None, strict: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3  # errors only
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if strict:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def make_session(model: bytes, device: str, threads: int, profile_prefix: str | None = None) -> ort.InferenceSession:
    """A session whose main provider is `device`'s, or CheckFailed: never a silent CPU session."""
    providers: list[Any] = [CPU]
    if device == "cuda":  # CUDA with the CPU for shape nodes
        preload_cuda_libraries()
        providers = [(CUDA, dict(CUDA_OPTIONS)), CPU]
    with native_stderr() as log:
        session = ort.InferenceSession(model, session_options(threads, profile_prefix), providers=providers)
    got = session.get_providers()
    if not got or got[0] != DEVICES[device]:
        raise CheckFailed("device", f"asked ONNX Runtime for {DEVICES[device]} but the session runs on {got}: "
                          f"{provider_failure_reason(log) or 'no reason logged'}")
    return session


@dataclass(frozen=True)
class Probe:
    device: str
    available: bool
    reason: str = ""


def _probe_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def probe(device: str) -> Probe:
    """Try a one-node session on `device` alone, CPU fallback disabled; the native log says why not."""
    provider = DEVICES[device]
    if device == "cpu":
        return Probe(device, True)
    if provider not in ort.get_available_providers():
        return Probe(device, False, f"this onnxruntime build ({ort.__version__}) has no {provider}; install "
                     f"onnxruntime-gpu (available here: {', '.join(ort.get_available_providers())})")
    preload_cuda_libraries()
    with native_stderr() as log:
        try:
            session = ort.InferenceSession(_probe_model(), session_options(1, strict=True),
                                           providers=[(provider, dict(CUDA_OPTIONS))])
            if session.get_providers()[:1] == [provider]:
                return Probe(device, True)
            error = f"the session fell back to {session.get_providers()}"
        except Exception as exc:  # onnxruntime raises its own Fail/RuntimeException types
            error = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
    why = provider_failure_reason(log) or error
    return Probe(device, False, f"{provider} is listed by onnxruntime {ort.__version__} but does not load: {why}")
