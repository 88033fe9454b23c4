"""PyTorch TFT -> ONNX with the torch.export-based exporter (a symbolic batch axis), and the structural checks."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import onnx
import torch
from torch import Tensor, nn

from export.errors import CheckFailed
from features.ort import strip_ansi
from features.schema import (
    ATTENTION,
    DECODER_KNOWN,
    DECODER_WEIGHTS,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    ENCODER_WEIGHTS,
    MODEL_INPUTS,
    MODEL_OUTPUTS,
    QUANTILES,
    STATIC_CATEGORICAL,
    STATIC_REAL,
    STATIC_WEIGHTS,
)
from trainer.model_config import ModelConfig
from trainer.modeling import TFTOutput

BATCH = "batch"  # the name of the dynamic batch axis of every input and output


class QuantilesOnly(nn.Module):
    """The TFT or its CalibratedModel without its interpretability outputs (`--no-explain`): one output, the
    quantiles."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, static_categorical: Tensor, encoder_observed: Tensor, encoder_known: Tensor,
                decoder_known: Tensor, static_real: Tensor | None = None) -> Tensor:
        out: TFTOutput = self.model(static_categorical, encoder_observed, encoder_known, decoder_known, static_real)
        return out.quantiles  # [B, H, Q]


def input_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The model's inputs in order, as its feature schema's `model_inputs`: MODEL_INPUTS, then STATIC_REAL when it
    has static reals."""
    return (*MODEL_INPUTS, STATIC_REAL) if cfg.n_static_real else MODEL_INPUTS


def output_names(explain: bool) -> tuple[str, ...]:
    return MODEL_OUTPUTS if explain else (QUANTILES,)


def expected_shapes(cfg: ModelConfig, explain: bool) -> dict[str, tuple[int, ...]]:
    """Every input and output's shape without the batch axis."""
    L, H = cfg.encoder_length, cfg.horizon
    shapes = {STATIC_CATEGORICAL: (cfg.n_static,), ENCODER_OBSERVED: (L, cfg.n_observed),
              ENCODER_KNOWN: (L, cfg.n_known), DECODER_KNOWN: (H, cfg.n_known), STATIC_REAL: (cfg.n_static_real,),
              QUANTILES: (H, cfg.n_quantiles), ATTENTION: (H, L + H), STATIC_WEIGHTS: (cfg.n_static_vars,),
              ENCODER_WEIGHTS: (L, cfg.n_encoder_vars), DECODER_WEIGHTS: (H, cfg.n_known)}
    return {name: shapes[name] for name in (*input_names(cfg), *output_names(explain))}


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's warnings and notices about torch internals; real failures raise."""
    with warnings.catch_warnings(action="ignore"):
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes, outermost first (at most 8)."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain and len(chain) < 8:
        chain.append(nxt)
    return chain


def _describe(exc: BaseException) -> str:
    """The exception and its root cause: torch.onnx wraps the torch.export error that says what failed."""
    chain = _chain(exc)

    def first_line(e: BaseException) -> str:
        lines = [ln.strip() for ln in strip_ansi(str(e)).splitlines() if ln.strip()]
        return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")

    return first_line(exc) + (f" (caused by {first_line(chain[-1])})" if len(chain) > 1 else "")


def export_model(model: nn.Module, example: dict[str, Tensor], opset: int, explain: bool) -> onnx.ModelProto:
    """Export with named inputs/outputs, a dynamic batch axis and the weights inside. `example`: the model's
    inputs (input_names) in order, each with at least 2 rows: torch.export specialises a dimension of size 0 or 1."""
    module: nn.Module = model if explain else QuantilesOnly(model)
    module.eval()
    names = list(example)  # the forward's leading parameters; a model without static reals leaves static_real out
    batch = torch.export.Dim(BATCH, min=1)
    try:
        with _quiet_exporter(), torch.no_grad():
            program = torch.onnx.export(
                module, tuple(example.values()), None, input_names=names, output_names=list(output_names(explain)),
                opset_version=opset, dynamo=True, external_data=False,
                dynamic_shapes={name: {0: batch} for name in names}, optimize=True,
                verify=False,  # the parity check follows, with real windows and several batch sizes
                report=False, verbose=False)
    except Exception as exc:  # torch raises many unrelated types here; all mean "cannot export"
        if any(isinstance(e, KeyboardInterrupt) for e in _chain(exc)):  # Ctrl-C or SIGTERM, wrapped by torch
            raise KeyboardInterrupt from None
        raise CheckFailed("torch.onnx.export", f"{_describe(exc)}. The model could not be exported with a dynamic "
                          "batch axis; a data-dependent shape or value in forward() is the usual cause") from exc
    assert program is not None  # the dynamo path always returns a program
    return _cleaned(program.model_proto)


def _cleaned(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Drop per-node debug records (local paths) and intermediate shapes (the LSTM states' are written 4-D)."""
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    del proto.graph.value_info[:]
    return proto


def run_checker(proto: onnx.ModelProto) -> None:
    """onnx.checker with full_check; CheckFailed on any error."""
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise CheckFailed("onnx.checker", f"{str(exc).strip().splitlines()[0]}. The exporter produced an invalid "
                          "graph; try another --opset") from None


@dataclass(frozen=True)
class TensorSig:
    name: str
    dtype: str  # numpy's name: float32 | int64 | ...
    dims: tuple[int | str, ...]  # str for a symbolic dimension


def signature(values: list[onnx.ValueInfoProto]) -> list[TensorSig]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = tuple(d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else "?")
                     for d in t.shape.dim)
        out.append(TensorSig(v.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, dims))
    return out


def check_interface(proto: onnx.ModelProto, cfg: ModelConfig, explain: bool, opset: int) -> None:
    """Opset, names in canonical order, dtypes, one shared symbolic batch axis and the other axes."""
    want_shapes = expected_shapes(cfg, explain)
    problems = []
    got_opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if got_opset != opset:
        problems.append(f"the graph is opset {got_opset}, --opset asked for {opset}")
    inputs, outputs = signature(list(proto.graph.input)), signature(list(proto.graph.output))
    if [i.name for i in inputs] != list(input_names(cfg)):
        problems.append(f"inputs are {[i.name for i in inputs]}, expected {list(input_names(cfg))}")
    if [o.name for o in outputs] != list(output_names(explain)):
        problems.append(f"outputs are {[o.name for o in outputs]}, expected {list(output_names(explain))}")
    batch_names = set()
    for sig in (*inputs, *outputs):
        if sig.name not in want_shapes:
            continue
        want_dtype = "int64" if sig.name == STATIC_CATEGORICAL else "float32"
        if sig.dtype != want_dtype:
            problems.append(f"{sig.name} is {sig.dtype}, expected {want_dtype}")
        if not sig.dims or not isinstance(sig.dims[0], str) or sig.dims[0] == "?":
            problems.append(f"{sig.name} has no dynamic batch axis (first dimension is {sig.dims[:1]})")
        else:
            batch_names.add(sig.dims[0])
        if tuple(sig.dims[1:]) != want_shapes[sig.name]:
            problems.append(f"{sig.name} has shape [batch, {', '.join(map(str, sig.dims[1:]))}], expected "
                            f"[batch, {', '.join(map(str, want_shapes[sig.name]))}]")
    if len(batch_names) > 1:
        problems.append(f"inputs and outputs do not share one batch axis: {sorted(batch_names)}")
    if problems:
        raise CheckFailed("input/output names and dynamic axes", "; ".join(problems))
