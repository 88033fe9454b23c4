"""Device, precision and memory accounting, decided once at start (no silent fallback)."""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
from collections.abc import Callable

import torch

log = logging.getLogger("trainer")

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(RuntimeError):
    """The requested device cannot be had; the run must not start."""


def no_cuda_reason() -> str:
    return ("this PyTorch build has no CUDA support" if torch.version.cuda is None
            else "no CUDA device is visible (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)")


def resolve_device(spec: str) -> torch.device:
    """`cuda` without CUDA is an error, never a CPU run; `auto` logs what it chose."""
    if spec == "cpu":
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {spec} requested but CUDA is not available: {no_cuda_reason()}. "
                              "Use --device cpu to train on the CPU, or --device auto to take CUDA when present")
        dev = torch.device(spec)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
        # always with an index: some CUDA APIs (set_per_process_memory_fraction) refuse a bare "cuda"
        return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    if not torch.cuda.is_available():  # auto: TrainConfig.validate allows no other spec
        log.warning("--device auto: CUDA is not available, training on the CPU")
        return torch.device("cpu")
    dev = torch.device("cuda", torch.cuda.current_device())
    log.info("--device auto: training on %s (%s)", dev, torch.cuda.get_device_name(dev))
    return dev


def resolve_precision(spec: str, device: torch.device) -> str:
    """fp32, bf16 or fp16 (AUTOCAST_DTYPES): "auto" is bf16 where the card has it, else fp16; fp32 on the CPU."""
    if device.type != "cuda":
        if spec not in ("auto", "fp32"):
            raise DeviceError(f"--precision {spec} needs CUDA; on the CPU training runs in fp32")
        return "fp32"
    if spec == "auto":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return spec


def autocast_factory(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A context-manager factory: autocast on CUDA with mixed precision, a no-op otherwise."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


class PeakMemory:
    """Peak memory of one phase: allocated device memory on CUDA, process peak RSS on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int | str]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # allocated is what the plan estimates; reserved (allocated + the caching allocator's free
            # blocks) is what the set_per_process_memory_fraction cap bounds
            return {"kind": "cuda_max_allocated", "bytes": int(torch.cuda.max_memory_allocated(self.device)),
                    "reserved_bytes": int(torch.cuda.max_memory_reserved(self.device))}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak: KiB, on macOS bytes
        return {"kind": "cpu_peak_rss", "bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
