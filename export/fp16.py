"""float32 ONNX graph -> half-precision weights and compute, float32 inputs and outputs.

onnxconverter-common is not a dependency, so this is a small converter of our own for the
op set the exporter emits (no subgraphs). Policy, decided per node:

* fp32 (kept): numerically sensitive ops (`KEEP_FP32_OPS`: softmax, softplus, cumulative
  sum, means), nodes that read a named float32 initializer in `keep_initializers` (the
  input normalisation: raw features such as log volume lose too many digits in half), and
  every node that produces a graph output (outputs are float32 anyway).
* fp16: everything else. LayerNormalization runs in half with `stash_type=1`, which the ONNX
  spec defines as float32 mean and variance.

Cast nodes are inserted wherever a tensor crosses between the two (a tensor going to half is
clipped to +-65504 first: a value beyond half's range saturates instead of becoming infinite,
and inf - inf = NaN, as a normalised input ten thousand standard deviations out would), float
initializers are stored in the precision of their readers (twice when both read one), and
constants beyond the fp16 range are clipped to +-65504 (infinities stay infinite).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
FP16_MAX = 65504.0
HALF_RANGE = ("fp16_range__min", "fp16_range__max")  # float32 scalars: the bounds of the Clip before a Cast to half

KEEP_FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "Softplus", "CumSum", "ReduceMean", "ReduceSum", "ReduceSumSquare",
    "ReduceLogSumExp", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Erf",
})
# ops that read any element type without computing on the values: never cast their inputs
_TYPE_AGNOSTIC = frozenset({"Shape", "Size", "Cast"})


class Fp16Error(ValueError):
    """A graph this converter does not handle (e.g. one with subgraphs)."""


def _to_half(arr: np.ndarray) -> np.ndarray:
    finite = np.isfinite(arr)
    clipped = np.where(finite, np.clip(arr, -FP16_MAX, FP16_MAX), arr)
    return clipped.astype(np.float16)


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
    """Return a converted copy of `model`; raises Fp16Error for graphs outside its scope."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise Fp16Error(f"node {node.name!r} ({node.op_type}) has a subgraph; --fp16 supports flat graphs only")
    _constants_to_initializers(g)

    # element type of every tensor in the float32 graph
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    elem: dict[str, int] = {}
    for vi in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output):
        elem[vi.name] = vi.type.tensor_type.elem_type
    inits = {t.name: t for t in g.initializer}
    for name, t in inits.items():
        elem[name] = t.data_type

    keep_inits = set(keep_initializers)
    missing = keep_inits - set(inits)
    if missing:
        raise Fp16Error(f"initializers {sorted(missing)} to keep in float32 are not in the graph")
    graph_outputs = {o.name for o in g.output}

    def runs_fp32(node: onnx.NodeProto) -> bool:
        return (node.op_type in KEEP_FP32_OPS or any(i in keep_inits for i in node.input)
                or any(o in graph_outputs for o in node.output))

    dtype: dict[str, int] = {i.name: i.type.tensor_type.elem_type for i in g.input}  # after conversion
    init_needs: dict[str, set[int]] = {}  # float initializer -> precisions its readers need
    new_nodes: list[onnx.NodeProto] = []
    casts: dict[tuple[str, int], str] = {}

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            out = f"{name}__to_{'fp16' if to == HALF else 'fp32'}"
            source = name
            if to == HALF:  # saturate at half's range rather than overflow to infinity
                source = f"{name}__in_fp16_range"
                new_nodes.append(helper.make_node("Clip", [name, HALF_RANGE[0], HALF_RANGE[1]], [source],
                                                  name=f"{source}__clip"))
            new_nodes.append(helper.make_node("Cast", [source], [out], to=to, name=f"{out}__cast"))
            casts[key] = out
            dtype[out] = to
        return casts[key]

    for node in g.node:  # ONNX graphs are topologically sorted
        want = FLOAT if runs_fp32(node) else HALF
        if node.op_type not in _TYPE_AGNOSTIC:
            for k, name in enumerate(node.input):
                if not name or elem.get(name) != FLOAT:
                    continue
                if name in inits:
                    init_needs.setdefault(name, set()).add(want)
                    if want == HALF:
                        node.input[k] = f"{name}__fp16"
                elif dtype.get(name, FLOAT) != want:
                    node.input[k] = cast(name, want)
        if node.op_type == "Cast":
            to = next(a for a in node.attribute if a.name == "to")
            if to.i == FLOAT and want == HALF:
                to.i = HALF
        elif node.op_type == "ConstantOfShape" and want == HALF:
            for a in node.attribute:
                if a.name == "value" and a.t.data_type == FLOAT:
                    a.t.CopyFrom(numpy_helper.from_array(_to_half(numpy_helper.to_array(a.t)), a.t.name))
        elif node.op_type == "LayerNormalization" and want == HALF:
            node.attribute.extend([] if any(a.name == "stash_type" for a in node.attribute)
                                  else [helper.make_attribute("stash_type", 1)])
            for a in node.attribute:
                if a.name == "stash_type" and a.i != 1:
                    a.i = 1
        for name in node.output:
            if elem.get(name) == FLOAT:
                is_cast = node.op_type == "Cast"
                dtype[name] = (next(a.i for a in node.attribute if a.name == "to") if is_cast else want)
            elif name in elem:
                dtype[name] = elem[name]
        new_nodes.append(node)

    # initializers in the precision(s) their readers need
    new_inits = []
    for name, t in inits.items():
        needs = init_needs.get(name, {FLOAT}) if t.data_type == FLOAT else {t.data_type}
        if t.data_type != FLOAT or FLOAT in needs:
            new_inits.append(t)
        if t.data_type == FLOAT and HALF in needs:
            new_inits.append(numpy_helper.from_array(_to_half(numpy_helper.to_array(t)), f"{name}__fp16"))

    if any(to == HALF for _, to in casts):
        new_inits += [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
                      for n, v in zip(HALF_RANGE, (-FP16_MAX, FP16_MAX), strict=True)]
    for o in g.output:
        if dtype.get(o.name, FLOAT) != FLOAT:  # pragma: no cover - producers of outputs run in fp32
            raise Fp16Error(f"output {o.name} would not be float32")
    del g.node[:]
    g.node.extend(new_nodes)
    del g.initializer[:]
    g.initializer.extend(new_inits)
    del g.value_info[:]  # stale types; shape inference rebuilds what it needs
    return m


def float_types(model: onnx.ModelProto) -> dict[str, int]:
    """How many initializers of each float type: a quick proof of what precision the weights are in."""
    counts: dict[str, int] = {}
    for t in model.graph.initializer:
        if t.data_type in (FLOAT, HALF):
            key = TensorProto.DataType.Name(t.data_type).lower()
            counts[key] = counts.get(key, 0) + 1
    return counts
