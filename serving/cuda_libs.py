"""Load the CUDA and cuDNN libraries that onnxruntime-gpu's CUDA provider needs, once per process.

onnxruntime-gpu links against libcublasLt, libcudart, libcufft, libcurand, libnvrtc and cuDNN
but does not find them in NVIDIA's pip wheels (`nvidia-*`, the ones a CUDA PyTorch or
`onnxruntime-gpu[cuda,cudnn]` installs) on its own. `onnxruntime.preload_dlls` loads them from
those wheels, or from the system's library path (a CUDA container image), before the first CUDA
session. What it prints goes to the debug log: a library that is still missing shows up as
the CUDA provider's own load failure, which export and the server report with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging

import onnxruntime as ort

log = logging.getLogger(__name__)


@functools.cache
def preload_cuda_libraries() -> str:
    """Preload once; returns what ONNX Runtime printed (empty when nothing was said or it has no preload)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None or "CUDAExecutionProvider" not in ort.get_available_providers():
        return ""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            preload(cuda=True, cudnn=True)
        except Exception as exc:  # a broken install must surface as the provider's load failure, not here
            print(f"onnxruntime.preload_dlls failed: {exc}")
    text = printed.getvalue().strip()
    if text:
        log.debug("onnxruntime.preload_dlls: %s", text)
    return text
