"""What checking a model file's graph digest adds to loading it, against what loading already costs.

    python -m benchmarks.model_load --model model.onnx [--repeats 3]

Times, on the file's bytes in memory (best of `--repeats`):

* graph_digest     the check the server and `serving.score` run on every load (`features.model_meta`)
* file sha256      the file's own digest, which loading computed before (GetModelInfo.model_sha256)
* session          creating the ONNX Runtime session (CPU provider, one thread), for scale

A production-sized model (the production preset: 94 M parameters, about 360 MiB) is written by
`python -m trainer --config presets/production.toml ...` and `python -m export`; a model of that size
without training: `python -m benchmarks.model_load --synthetic-mib 360`, which writes one Gemm graph whose
weight holds that many MiB (the digest walks the file's top-level fields, so only the bytes count).
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from features.model_meta import graph_digest


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def synthetic_model(path: Path, mib: int) -> Path:
    """A graph y = x @ W with W of `mib` MiB of float32, with a metadata entry, as export writes one."""
    cols = 256
    rows = max(1, mib * 2**20 // (4 * cols))
    weight = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((rows, cols), np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", rows])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", cols])], [weight])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=8)
    onnx.helper.set_model_props(model, {"foxhunt.note": "synthetic"})
    onnx.save(model, str(path))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="an exported model (or --synthetic-mib)")
    p.add_argument("--synthetic-mib", type=int, help="write and time a synthetic model of this many MiB instead")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if (args.model is None) == (args.synthetic_mib is None):
        p.error("give --model or --synthetic-mib")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or synthetic_model(Path(tmp) / "synthetic.onnx", args.synthetic_mib)
        data = path.read_bytes()
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        rows = {
            "graph_digest": best_of(args.repeats, lambda: graph_digest(data)),
            "file sha256": best_of(args.repeats, lambda: hashlib.sha256(data).hexdigest()),
            "session": best_of(args.repeats, lambda: ort.InferenceSession(data, so,
                                                                          providers=["CPUExecutionProvider"])),
        }
    print(f"{path.name}: {len(data) / 2**20:.1f} MiB; {platform.processor() or platform.machine()}, "
          f"onnxruntime {ort.__version__}, best of {args.repeats}")
    print(f"{'step':<14} {'seconds':>8} {'x file sha256':>14}")
    for name, seconds in rows.items():
        print(f"{name:<14} {seconds:>8.3f} {seconds / rows['file sha256']:>14.2f}")


if __name__ == "__main__":
    main()
