"""float32 ONNX graph -> half-precision weights and compute, float32 inputs and outputs (flat graphs).

fp32 stays for sensitive ops (`KEEP_FP32_OPS`), nodes reading a `keep_initializers` tensor (the
input normalisation) or a slice or reshape of one, nodes producing a graph output, and ops that only
move values (`MOVE_OPS`) whose float inputs are all float32: the graph's inputs reach their first
computing node undigested, raw features with all their digits and categorical ids (exact integers in
float32, which half holds only up to 2048) exact to their Cast to int64. The rest runs in half,
LayerNormalization with float32 statistics. Casts go where a tensor crosses; going to half it is
clipped to +-65504 first, so it saturates rather than becoming inf. Initializers are stored in their
readers' precision.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
FP16_MAX = 65504.0
HALF_RANGE = ("fp16_range__min", "fp16_range__max")  # float32 scalars: the bounds of the Clip before a Cast to half

KEEP_FP32_OPS = frozenset({"Softmax", "LogSoftmax", "Softplus", "CumSum", "ReduceMean", "ReduceSum", "ReduceSumSquare",
                           "ReduceLogSumExp", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Erf"})
# ops that read any element type without computing on the values: never cast their inputs
_TYPE_AGNOSTIC = frozenset({"Shape", "Size", "Cast"})
# ops whose output values are some of their float inputs' values: they keep float32 when all those inputs are
MOVE_OPS = frozenset({"Slice", "Gather", "GatherElements", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Concat",
                      "Split", "Expand", "Tile", "Flatten", "Identity", "Where"})


def _to_half(arr: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(arr), np.clip(arr, -FP16_MAX, FP16_MAX), arr).astype(np.float16)


def _constants_to_initializers(graph: onnx.GraphProto) -> None:
    """Float Constant nodes become initializers, so one rule covers all stored float values."""
    keep = []
    for node in graph.node:
        value = next((a for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and value is not None and value.t.data_type == FLOAT:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value.t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def convert_to_fp16(model: onnx.ModelProto, keep_initializers: Iterable[str] = ()) -> onnx.ModelProto:
    """A converted copy of `model`, a graph without subgraphs (the TFT's has none)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    _constants_to_initializers(g)
    converter = _Converter(m, set(keep_initializers))
    for node in g.node:  # ONNX graphs are topologically sorted
        converter.convert(node)
    new_inits = converter.initializers()
    del g.node[:]
    g.node.extend(converter.nodes)
    del g.initializer[:]
    g.initializer.extend(new_inits)
    del g.value_info[:]  # stale types; shape inference rebuilds what it needs
    return m


class _Converter:
    """Converts one node at a time, in graph order, inserting the casts it needs."""

    def __init__(self, m: onnx.ModelProto, keep_inits: set[str]) -> None:
        g = m.graph
        self.inits = {t.name: t for t in g.initializer}
        self.kept = set(keep_inits)  # the kept initializers, and slices or reshapes of them
        self.graph_outputs = {o.name for o in g.output}
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        self.elem: dict[str, int] = {  # element type of every tensor in the float32 graph
            vi.name: vi.type.tensor_type.elem_type
            for vi in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
        self.elem.update({name: t.data_type for name, t in self.inits.items()})
        self.dtype: dict[str, int] = {i.name: i.type.tensor_type.elem_type for i in g.input}  # after conversion
        self.init_needs: dict[str, set[int]] = {}  # float initializer -> precisions its readers need
        self.nodes: list[onnx.NodeProto] = []
        self.casts: dict[tuple[str, int], str] = {}

    def runs_fp32(self, node: onnx.NodeProto) -> bool:
        return (node.op_type in KEEP_FP32_OPS or any(i in self.kept for i in node.input)
                or any(o in self.graph_outputs for o in node.output) or self._moves_fp32(node))

    def _moves_fp32(self, node: onnx.NodeProto) -> bool:
        """A MOVE_OPS node whose float inputs are all float32 tensors (graph inputs, kept or fp32 results)."""
        floats = [i for i in node.input if i and self.elem.get(i) == FLOAT]
        return (node.op_type in MOVE_OPS and bool(floats)
                and all(i in self.kept if i in self.inits else self.dtype.get(i) == FLOAT for i in floats))

    def cast(self, name: str, to: int) -> str:
        """The name of `name` cast to `to`, adding the Cast (and Clip, going to half) once."""
        key = (name, to)
        if key not in self.casts:
            out = f"{name}__to_{'fp16' if to == HALF else 'fp32'}"
            source = name
            if to == HALF:
                source = f"{name}__in_fp16_range"
                self.nodes.append(helper.make_node("Clip", [name, HALF_RANGE[0], HALF_RANGE[1]], [source],
                                                   name=f"{source}__clip"))
            self.nodes.append(helper.make_node("Cast", [source], [out], to=to, name=f"{out}__cast"))
            self.casts[key] = out
            self.dtype[out] = to
        return self.casts[key]

    def convert(self, node: onnx.NodeProto) -> None:
        want = FLOAT if self.runs_fp32(node) else HALF
        floats = [i for i in node.input if i and self.elem.get(i) == FLOAT]
        if node.op_type in MOVE_OPS and floats and all(i in self.kept for i in floats):
            self.kept.update(node.output)  # e.g. the normalisation's mean[:n_real]
        if node.op_type not in _TYPE_AGNOSTIC:
            self._convert_inputs(node, want)
        if want == HALF:
            _to_half_attributes(node)
        for name in node.output:
            if self.elem.get(name) == FLOAT:
                is_cast = node.op_type == "Cast"
                self.dtype[name] = next(a.i for a in node.attribute if a.name == "to") if is_cast else want
            elif name in self.elem:
                self.dtype[name] = self.elem[name]
        self.nodes.append(node)

    def _convert_inputs(self, node: onnx.NodeProto, want: int) -> None:
        for k, name in enumerate(node.input):
            if not name or self.elem.get(name) != FLOAT:
                continue
            if name in self.inits:
                self.init_needs.setdefault(name, set()).add(want)
                if want == HALF:
                    node.input[k] = f"{name}__fp16"
            elif self.dtype.get(name, FLOAT) != want:
                node.input[k] = self.cast(name, want)

    def initializers(self) -> list[onnx.TensorProto]:
        """Float initializers in their readers' precision(s), and the Clip bounds if used."""
        out = []
        for name, t in self.inits.items():
            needs = self.init_needs.get(name, {FLOAT}) if t.data_type == FLOAT else {t.data_type}
            if t.data_type != FLOAT or FLOAT in needs:
                out.append(t)
            if t.data_type == FLOAT and HALF in needs:
                out.append(numpy_helper.from_array(_to_half(numpy_helper.to_array(t)), f"{name}__fp16"))
        if any(to == HALF for _, to in self.casts):
            out += [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
                    for n, v in zip(HALF_RANGE, (-FP16_MAX, FP16_MAX), strict=True)]
        return out


def _to_half_attributes(node: onnx.NodeProto) -> None:
    """A Cast to float casts to half, ConstantOfShape makes half, LayerNormalization keeps float32 statistics."""
    if node.op_type == "Cast":
        to = next(a for a in node.attribute if a.name == "to")
        if to.i == FLOAT:
            to.i = HALF
    elif node.op_type == "ConstantOfShape":
        for a in node.attribute:
            if a.name == "value" and a.t.data_type == FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(_to_half(numpy_helper.to_array(a.t)), a.t.name))
    elif node.op_type == "LayerNormalization":
        stash = next((a for a in node.attribute if a.name == "stash_type"), None)
        if stash is None:
            node.attribute.append(helper.make_attribute("stash_type", 1))
        else:
            stash.i = 1
