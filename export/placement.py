"""Device placement: which execution provider ran each node, read from ONNX Runtime's profile.

The gate: every compute node runs on the required device's provider. Only shape computation may
stay on the CPU: an op in `SHAPE_OPS` whose outputs and inputs (but for Shape/Size, which read
only metadata) are integer or bool.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from export.runtime import CPU, DEVICES, make_session

SHAPE_OPS = frozenset({"Shape", "Size", "Gather", "GatherElements", "Unsqueeze", "Squeeze", "Concat", "Slice",
                       "Reshape", "Cast", "ConstantOfShape", "Range", "Expand", "Equal", "Greater", "Less",
                       "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Where", "Add", "Sub", "Mul", "Div", "Mod",
                       "Max", "Min", "Abs", "Neg", "ReduceProd", "Identity", "Tile", "Transpose", "Flatten", "Split"})
METADATA_OPS = frozenset({"Shape", "Size"})  # read only their input's shape, whatever its type
MEMCPY_OPS = frozenset({"MemcpyFromHost", "MemcpyToHost"})
_FLOAT_TYPES = frozenset({"float", "float16", "double", "bfloat16", "float8e4m3fn", "float8e5m2"})


@dataclass(frozen=True)
class NodePlacement:
    name: str
    op_type: str
    provider: str
    shape_only: bool  # integer/bool shape computation: allowed on the CPU

    @property
    def memcpy(self) -> bool:
        return self.op_type in MEMCPY_OPS


def _types(entries: Any) -> list[str]:
    """[{"float": [2, 8]}, ...] -> ["float", ...]."""
    return [str(k) for entry in entries or [] if isinstance(entry, dict) for k in entry]


def is_shape_computation(op_type: str, input_types: Sequence[str], output_types: Sequence[str]) -> bool:
    if op_type not in SHAPE_OPS or any(t in _FLOAT_TYPES for t in output_types):
        return False
    return op_type in METADATA_OPS or not any(t in _FLOAT_TYPES for t in input_types)


def nodes_from_profile(events: list[dict[str, Any]]) -> list[NodePlacement]:
    """One entry per node that ran, in order, from a profile's `*_kernel_time` events."""
    seen: dict[str, NodePlacement] = {}
    for e in events:
        name = str(e.get("name", ""))
        args = e.get("args") or {}
        if e.get("cat") != "Node" or not name.endswith("_kernel_time") or "provider" not in args:
            continue
        node = name[: -len("_kernel_time")]
        op = str(args.get("op_name", "?"))
        shape_only = is_shape_computation(op, _types(args.get("input_type_shape")),
                                          _types(args.get("output_type_shape")))
        seen.setdefault(node, NodePlacement(node, op, str(args["provider"]), shape_only))
    return list(seen.values())


def profile_placement(model: bytes, device: str, feeds: dict[str, np.ndarray], threads: int = 1
                      ) -> tuple[str, list[NodePlacement]]:
    """Run `model` once with profiling; the session's provider and every node's placement."""
    with tempfile.TemporaryDirectory(prefix="foxhunt-profile-") as tmp:
        session = make_session(model, device, threads, profile_prefix=os.path.join(tmp, "placement"))
        session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
        path = session.end_profiling()
        with open(path, encoding="utf-8") as fh:
            events = json.load(fh)
        provider = session.get_providers()[0]
    nodes = nodes_from_profile(events)
    if not nodes:  # else the gate would pass on nothing
        raise RuntimeError("the ONNX Runtime profile lists no node kernels; cannot tell where nodes ran")
    return provider, nodes


@dataclass
class PlacementReport:
    required: str | None  # the device --require-device asked for, or None
    provider: str  # the provider the analysed session ran on
    nodes: list[NodePlacement]
    gate: str = "not run"  # passed | failed | not run
    reason: str = ""
    misplaced: list[NodePlacement] = field(default_factory=list)

    @property
    def per_provider(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for n in self.nodes:
            row = out.setdefault(n.provider, {"nodes": 0, "compute": 0, "shape_only": 0, "memcpy": 0})
            row["nodes"] += 1
            row["memcpy" if n.memcpy else "shape_only" if n.shape_only else "compute"] += 1
        return out

    @property
    def cpu_compute(self) -> list[NodePlacement]:
        return [n for n in self.nodes if n.provider == CPU and not n.shape_only and not n.memcpy]

    def to_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "required_device": self.required, "provider": self.provider, "reason": self.reason,
                "nodes_per_provider": self.per_provider, "memcpy_nodes": sum(n.memcpy for n in self.nodes),
                "cpu_compute_nodes": [{"name": n.name, "op_type": n.op_type} for n in self.cpu_compute],
                "misplaced_nodes": [asdict(n) for n in self.misplaced]}

    def table(self) -> str:
        req = f"required: {self.required}" if self.required else "no --require-device"
        lines = [f"placement: nodes as ONNX Runtime ran them on a {self.provider} session ({req})",
                 f"{'provider':<26} {'nodes':>6} {'compute':>8} {'shape-only':>11} {'memcpy':>7}",
                 *(f"{provider:<26} {row['nodes']:>6} {row['compute']:>8} {row['shape_only']:>11} {row['memcpy']:>7}"
                   for provider, row in sorted(self.per_provider.items())),
                 f"Memcpy nodes: {sum(n.memcpy for n in self.nodes)}"]
        cpu = self.cpu_compute
        if cpu and self.gate == "failed":
            lines.append(f"CPU-placed compute nodes ({len(cpu)}):")
            lines.extend(f"  {n.name:<48} {n.op_type}" for n in cpu)
        elif cpu:
            ops = ", ".join(f"{k} {v}" for k, v in Counter(n.op_type for n in cpu).most_common())
            lines.append(f"CPU-placed compute nodes: {len(cpu)} ({ops})")
        verdict = "placement gate " + (self.gate if self.gate == "passed" else self.gate.upper())  # FAILED, NOT RUN
        lines.append(f"{verdict}: {self.reason}" if self.reason else verdict)
        return "\n".join(lines)


def evaluate(report: PlacementReport, device: str | None) -> PlacementReport:
    """Gate `report`: every node but shape computation and Memcpy on `device`'s provider; no device, no gate."""
    report.required = device
    if device is None:
        report.reason = ("no --require-device given; the table shows where nodes ran on this machine "
                         "(pass --require-device cuda on a GPU machine to prove placement)")
        return report
    want = DEVICES[device]
    report.misplaced = [n for n in report.nodes
                        if n.provider != want and not n.memcpy and not (n.shape_only and n.provider == CPU)]
    if report.misplaced:
        report.gate = "failed"
        names = ", ".join(f"{n.name} ({n.op_type}) on {n.provider}" for n in report.misplaced[:10])
        more = f" and {len(report.misplaced) - 10} more" if len(report.misplaced) > 10 else ""
        report.reason = (f"{len(report.misplaced)} compute node(s) not on {want}: {names}{more}. ONNX Runtime's "
                         f"{want} has no kernel for them in this configuration; change the op (or its dtype) in "
                         "the model, or use a newer onnxruntime")
    else:
        report.gate = "passed"
        report.reason = f"every compute node runs on {want}"
    return report
