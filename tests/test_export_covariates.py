"""Export of a model with user known, static and categorical features: the ONNX inputs grow `static_real`, the
gates cover every input, the metadata carries the vocabularies and the Triton config lists every input.

A tiny model trained by the real trainer on real parquet bars (one known real, one known categorical of integers,
one static real, one static categorical, one observed categorical) is exported once, calibrated, with parity
windows rebuilt from the bars, by the pipeline in-process; the module shares it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from export.__main__ import main
from export.fp16 import convert_to_fp16
from export.options import ExportOptions
from export.parity import make_cases
from export.pipeline import ExportResult, run_export
from export.runtime import probe
from export.windows import windows_from_bars
from features.model_meta import ModelMeta
from features.schema import MODEL_INPUTS, QUANTILES, STATIC_CATEGORICAL, STATIC_REAL
from tests.artifacts import TINY_TRAIN_FLAGS, run_main
from trainer.checkpoint import file_sha256, load_checkpoint, model_from_checkpoint

torch.set_num_threads(1)
MINUTE = 60 * 10**9
FEATURE_FLAGS = ("--features", "regime", "--known-features", "event,session", "--static-features", "exchange,tick",
                 "--categorical-features", "regime,session,exchange")


def write_bars(path: Path, n: int = 400) -> Path:
    """Two symbols of one-minute bars with the five user columns."""
    rng = np.random.default_rng(3)
    tables = []
    for symbol, exchange, tick in (("ES", "CME", 0.25), ("FDAX", "EUREX", 1.0)):
        close = 100.0 * np.exp(np.cumsum(rng.normal(0.0, 1e-3, n)))
        minute = np.arange(n)
        tables.append(pa.table({
            "timestamp": np.int64(1_700_000_000) * 10**9 + minute * MINUTE, "symbol": [symbol] * n,
            "open": close, "high": close * 1.001, "low": close * 0.999, "close": close, "volume": rng.uniform(1, 9, n),
            "event": (minute % 30 == 0).astype(np.float64),  # a scheduled release: known in advance
            "session": minute // 60 % 3,  # integer categories, known in advance
            "regime": np.where(rng.random(n) < 0.7, "calm", "storm"),  # observed categories
            "exchange": [exchange] * n, "tick": np.full(n, tick),  # static per symbol
        }))
    pq.write_table(pa.concat_tables(tables), path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("covariates")
    bars, out = write_bars(work / "bars.parquet"), work / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *TINY_TRAIN_FLAGS, *FEATURE_FLAGS])
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def exported(ckpt: Path) -> ExportResult:
    """The pipeline with --calibrate, --bars and a Triton repository."""
    out = ckpt.parent / "out"
    return run_export(ExportOptions(ckpt, out / "model.onnx", triton_repo=out / "repo", triton_name="tft",
                                    bars=ckpt.parent / "bars.parquet", calibrate=True), log=lambda _: None)


def props(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_the_inputs_are_the_four_and_static_real(exported: ExportResult) -> None:
    graph = onnx.load(str(exported.output)).graph
    got = [(i.name, i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
           for i in graph.input]
    cfg = exported.meta.model_config
    assert got == [
        (STATIC_CATEGORICAL, TensorProto.INT64, ["batch", 2]),  # the symbol, the exchange
        ("encoder_observed", TensorProto.FLOAT, ["batch", 20, 5 + 1]),  # built-in, regime
        ("encoder_known", TensorProto.FLOAT, ["batch", 20, 4 + 2]),  # calendar, event, session
        ("decoder_known", TensorProto.FLOAT, ["batch", 3, 4 + 2]),
        (STATIC_REAL, TensorProto.FLOAT, ["batch", 1]),  # tick
    ]
    assert cfg["observed_cardinalities"] == [3] and cfg["known_cardinalities"] == [4] and cfg["n_static_real"] == 1


def test_calibrated_gates_pass_on_every_input(exported: ExportResult) -> None:
    assert exported.parity.passed and exported.parity.inputs == [*MODEL_INPUTS, STATIC_REAL]
    assert {r.case for r in exported.parity.rows} == {"real windows", "random batch 1", "random batch 7",
                                                      "random batch 64"}
    assert exported.placement.gate == "not run" and exported.placement.nodes  # no --require-device here
    assert exported.meta.parity["inputs"] == [*MODEL_INPUTS, STATIC_REAL]
    assert exported.meta.calibration is not None and exported.meta.calibration["validation_windows"] > 0


def test_metadata_lists_the_vocabularies_and_round_trips(exported: ExportResult, ckpt: Path) -> None:
    meta = ModelMeta.from_props(props(exported.output))  # checks feature_schema == feature_config.schema()
    assert meta == exported.meta
    assert dict(meta.feature_config.vocabularies) == {"regime": ("calm", "storm"), "session": ("0", "1", "2"),
                                                      "exchange": ("CME", "EUREX")}
    assert meta.feature_schema.model_inputs == (*MODEL_INPUTS, STATIC_REAL)
    assert meta.feature_config.to_dict() == load_checkpoint(ckpt)["feature_config"]


def test_triton_config_lists_static_real(exported: ExportResult) -> None:
    assert exported.triton_dir is not None
    config = (exported.triton_dir / "config.pbtxt").read_text()
    inputs = config.split("input [")[1].split("output [")[0]
    assert re.findall(r'name: "(\w+)"\s+data_type: (\w+)\s+dims: \[ ([\d, ]+) \]', inputs) == [
        (STATIC_CATEGORICAL, "TYPE_INT64", "2"), ("encoder_observed", "TYPE_FP32", "20, 6"),
        ("encoder_known", "TYPE_FP32", "20, 6"), ("decoder_known", "TYPE_FP32", "3, 6"),
        (STATIC_REAL, "TYPE_FP32", "1")]
    assert config.count(f'key: "{STATIC_REAL}"') == 2  # in both warm-up requests


def test_parity_windows_from_bars_and_random_cases_hold_valid_ids(ckpt: Path) -> None:
    c = load_checkpoint(ckpt)
    model = model_from_checkpoint(c)
    cfg = model.cfg
    windows = windows_from_bars(ckpt.parent / "bars.parquet", c, cfg)  # labels encoded with the run's vocabularies
    assert set(np.unique(windows[STATIC_REAL])) == {0.25, 1.0}  # tick of each symbol
    assert set(np.unique(windows[STATIC_CATEGORICAL][:, 1])) == {1, 2}  # CME, EUREX
    assert set(np.unique(windows["encoder_observed"][..., -1])) == {1, 2}  # calm, storm
    for case in make_cases(windows, model, batches=(64,))[1:]:
        ids = {name: case.inputs[name][..., -1] for name in ("encoder_observed", "encoder_known", "decoder_known")}
        for name, card in (("encoder_observed", 3), ("encoder_known", 4), ("decoder_known", 4)):
            assert set(np.unique(ids[name])) == set(range(card)), name  # every id drawn, as exact integers
        statics = case.inputs[STATIC_CATEGORICAL]
        assert statics.dtype == np.int64 and ((statics >= 0) & (statics < np.array(cfg.static_cardinalities))).all()
        assert case.inputs[STATIC_REAL].dtype == np.float32 and np.unique(case.inputs[STATIC_REAL]).size > 2


@pytest.mark.gpu
def test_placement_gate_passes_on_cuda_with_every_input(ckpt: Path, tmp_path: Path) -> None:
    cuda = probe("cuda")
    if not cuda.available:
        pytest.skip(f"needs the ONNX Runtime CUDA provider: {cuda.reason}")
    result = run_export(ExportOptions(ckpt, tmp_path / "model.onnx", require_device="cuda"), log=lambda _: None)
    assert result.placement.gate == "passed" and result.placement.to_dict()["cpu_compute_nodes"] == []
    assert result.parity.provider == "CUDAExecutionProvider" and result.parity.inputs[-1] == STATIC_REAL


def _id_graph() -> tuple[onnx.ModelProto, list[str]]:
    """The model's pattern: raw x [N, 3] (two reals near 1000, one category id) normalised by kept buffers; the
    reals' columns and the raw id column concatenated; the id sliced, cast to int64 and looked up."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([1000.0, 1000.0, 0.0], np.float32), "mean"),
             numpy_helper.from_array(np.array([0.5, 0.5, 1.0], np.float32), "std"),
             numpy_helper.from_array(rng.normal(size=(3000, 2)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.normal(size=(2, 2)).astype(np.float32), "w"),
             *(numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
               (("c0", 0), ("c1", 1), ("c2", 2), ("c3", 3)))]
    nodes = [helper.make_node("Sub", ["x", "mean"], ["d"]), helper.make_node("Div", ["d", "std"], ["z"]),
             helper.make_node("Slice", ["z", "c0", "c2", "c1"], ["zr"]),
             helper.make_node("Slice", ["x", "c2", "c3", "c1"], ["idf"]),
             helper.make_node("Concat", ["zr", "idf"], ["c"], axis=1),
             helper.make_node("Slice", ["c", "c2", "c3", "c1"], ["cid"]),
             helper.make_node("Cast", ["cid"], ["ids"], to=TensorProto.INT64),
             helper.make_node("Squeeze", ["ids", "c1"], ["ids1"]), helper.make_node("Gather", ["emb", "ids1"], ["e"]),
             helper.make_node("Slice", ["c", "c0", "c2", "c1"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["rw"]),
             helper.make_node("Add", ["e", "rw"], ["y"])]
    graph = helper.make_graph(nodes, "ids", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), ["mean", "std"]


def test_fp16_keeps_category_ids_and_raw_reals_exact() -> None:
    """Half holds integers exactly only up to 2048 and 1000.3 as 1000.5: the id and the raw reals reach their
    Cast and their normalisation in float32."""
    model, keep = _id_graph()

    def run(m: onnx.ModelProto, x: np.ndarray) -> Any:
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    half = convert_to_fp16(model, keep)
    x = np.array([[1000.3, 999.8, 2049.0], [1000.1, 1000.2, 2051.0]], np.float32)
    x_rounded = x.astype(np.float16).astype(np.float32)  # what a half cast of the inputs would give
    np.testing.assert_allclose(run(half, x), run(model, x), atol=1e-2)
    assert np.abs(run(model, x_rounded) - run(model, x)).max() > 0.1  # so the check above can fail


def test_fp16_quantiles_only_export_passes_parity_on_every_input(ckpt: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "half.onnx"
    last = tmp_path / "ckpt.last.pt"  # the run's latest epoch, two after its best: exported as asked, and said
    state = load_checkpoint(ckpt)
    best = int(state["best_epoch"])
    state["epoch"] = best + 2
    torch.save(state, last)
    assert main([str(last), str(out), "--fp16", "--no-explain"]) == 0
    printed = capsys.readouterr()
    assert "parity passed" in printed.out
    assert (f"note: {last} holds epoch {best + 2}; the run's best validation loss was at epoch {best}, in its best "
            "checkpoint") in printed.err
    meta = ModelMeta.from_props(props(out))
    assert meta.model_version == file_sha256(last)[:12] + "-fp16-noexplain"  # told apart
    assert json.loads(props(out)["foxhunt.parity"])["inputs"][-1] == STATIC_REAL
    assert meta.exporter["fp16_kept_fp32_initializers"][-3:-1] == ["static_mean", "static_std"]
    # ONNX Runtime's CPU provider runs most fp16 nodes in fp32: the check is of the weights' rounding, and says so
    assert "--fp16 parity ran on ONNX Runtime's CPU provider" in printed.err and "--require-device cuda" in printed.err
    model = onnx.load(str(out))
    weights = [t.data_type for t in model.graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)]
    assert weights.count(TensorProto.FLOAT16) > 10 * weights.count(TensorProto.FLOAT)
    assert [o.name for o in model.graph.output] == [QUANTILES]
    io = (*model.graph.input, *model.graph.output)
    assert {v.name: v.type.tensor_type.elem_type for v in io} == {
        STATIC_CATEGORICAL: TensorProto.INT64, "encoder_observed": TensorProto.FLOAT,
        "encoder_known": TensorProto.FLOAT, "decoder_known": TensorProto.FLOAT, STATIC_REAL: TensorProto.FLOAT,
        QUANTILES: TensorProto.FLOAT}
    # the normalisation stays float32; LayerNorm accumulates in float32 (stash_type 1)
    fp32 = {t.name.rsplit(".", 1)[-1] for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    assert {"observed_mean", "observed_std", "known_mean", "known_std", "static_mean", "static_std",
            "calibration_offsets"} <= fp32
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert norms and all(any(a.name == "stash_type" and a.i == 1 for a in n.attribute) for n in norms)
    # the saturating Clips before each Cast to half read float32: ONNX Runtime's CUDA provider has not
    # registered Clip for float16 in every release, and a half Clip that it refuses would fail the placement gate
    typed = onnx.shape_inference.infer_shapes(model).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in (*typed.value_info, *typed.input)}
    elem |= {t.name: t.data_type for t in model.graph.initializer}
    clips = [n for n in model.graph.node if n.op_type == "Clip"]
    assert clips and {elem[x] for n in clips for x in n.input} == {TensorProto.FLOAT}
    assert (meta.precision, meta.explain) == ("fp16", False)
    assert meta.parity["passed"] and meta.parity["tolerance"] == 1e-2
    assert 1e-6 < meta.parity["max_scaled_error"] < 1e-2  # within tolerance, and visibly not fp32
