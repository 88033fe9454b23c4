"""A Triton Inference Server repository entry: DIR/<name>/config.pbtxt and DIR/<name>/1/model.onnx.

The config: onnxruntime backend, dynamic batching, GPU with TF32 off (as parity ran), version 1
alone, and a warm-up with all-zero inputs at batch 1 and the largest batch up to WARMUP_MAX_BATCH.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from export.onnx_export import TensorSig

VERSION = "1"
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "bool": "TYPE_BOOL"}
QUEUE_DELAY_US = 100  # how long Triton may hold a request to batch it with others
WARMUP_MAX_BATCH = 256  # Triton builds a warm-up batch request by request


def _dims(sig: TensorSig) -> str:
    return "[ " + ", ".join(str(d) for d in sig.dims[1:]) + " ]"  # check_interface made every other axis fixed


def _tensor(sig: TensorSig, indent: str) -> str:
    return (f"{indent}{{\n{indent}  name: \"{sig.name}\"\n{indent}  data_type: {TRITON_TYPES[sig.dtype]}\n"
            f"{indent}  dims: {_dims(sig)}\n{indent}}}")


def _warmup(name: str, batch: int, inputs: Sequence[TensorSig]) -> str:
    entries = "\n".join(
        f"    inputs {{\n      key: \"{s.name}\"\n      value: {{\n        data_type: {TRITON_TYPES[s.dtype]}\n"
        f"        dims: {_dims(s)}\n        zero_data: true\n      }}\n    }}" for s in inputs)
    return f"  {{\n    name: \"{name}\"\n    batch_size: {batch}\n{entries}\n  }}"


def config_pbtxt(name: str, inputs: Sequence[TensorSig], outputs: Sequence[TensorSig], max_batch_size: int,
                 comment: str = "") -> str:
    warm = [_warmup("zeros_batch_1", 1, inputs)]
    if (largest := min(max_batch_size, WARMUP_MAX_BATCH)) > 1:
        warm.append(_warmup(f"zeros_batch_{largest}", largest, inputs))
    parts = [
        *(f"# {line}" for line in comment.splitlines()),
        f"name: \"{name}\"",
        "platform: \"onnxruntime_onnx\"",
        f"max_batch_size: {max_batch_size}",
        f"version_policy: {{\n  specific: {{\n    versions: [ {VERSION} ]\n  }}\n}}",
        "input [\n" + ",\n".join(_tensor(s, "  ") for s in inputs) + "\n]",
        "output [\n" + ",\n".join(_tensor(s, "  ") for s in outputs) + "\n]",
        f"dynamic_batching {{\n  max_queue_delay_microseconds: {QUEUE_DELAY_US}\n}}",
        "instance_group [\n  {\n    count: 1\n    kind: KIND_GPU\n  }\n]",
        _cuda_options(),
        "model_warmup [\n" + ",\n".join(warm) + "\n]",
    ]
    return "\n".join(parts) + "\n"


def _cuda_options() -> str:
    """The CUDA provider options parity ran with, less the device (the instance group places it)."""
    from export.runtime import CUDA_OPTIONS  # here: the flags' checks import this module, not onnx

    params = "\n".join(f"        parameters {{\n          key: \"{k}\"\n          value: \"{v}\"\n        }}"
                       for k, v in CUDA_OPTIONS.items() if k != "device_id")
    return ("optimization {\n  execution_accelerators {\n    gpu_execution_accelerator [\n      {\n"
            f"        name: \"cuda\"\n{params}\n      }}\n    ]\n  }}\n}}")


def newer_versions(model_dir: Path) -> list[str]:
    """A Triton model's version directories above the one export writes."""
    return sorted((p.name for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()
                   and int(p.name) > int(VERSION)), key=int)


def repository_files(model: bytes, config: str) -> dict[str, bytes]:
    return {"config.pbtxt": config.encode("utf-8"), f"{VERSION}/model.onnx": model}
