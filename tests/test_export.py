"""`python -m export`: a tiny trained checkpoint through the real command and its gates.

The tests' shared tiny checkpoint (tests.live_server) and one export of it serve the module. The exports run
`export.__main__.main` in-process (same code, no second torch import, a graph traced once a process) except where
the process is under test: a signal, a reader gone from stdout, the working directory, the exit status. Every
refusal is checked to leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from onnx import numpy_helper

from export.__main__ import build_parser, main, options_from_args
from export.errors import UsageError
from export.files import Staging, leftovers
from export.options import MAX_OPSET
from export.parity import TOLERANCE, Case, ParityReport, compare, make_cases
from export.placement import PlacementReport, evaluate, is_shape_computation, profile_placement
from export.runtime import CPU, probe
from export.triton import newer_versions
from export.windows import saved_windows, windows_from_bars
from features.config import FeatureConfig
from features.model_meta import ModelMeta
from features.ort import provider_failure_reason
from features.schema import MODEL_INPUTS, MODEL_OUTPUTS, QUANTILES, STATIC_CATEGORICAL, FeatureSchema
from tests.artifacts import REPO, TINY_TRAIN_FLAGS, exit_and_imports, make_onnx, run
from tests.live_server import Model, tiny_model  # noqa: F401  (the shared fixture)
from trainer.checkpoint import FORMAT, file_sha256, load_checkpoint, model_from_checkpoint, state_digest
from trainer.modeling import TemporalFusionTransformer

torch.set_num_threads(1)


# ---- shared artifacts ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tiny_model: Model) -> Path:  # noqa: F811
    """The shared tiny model's checkpoint, bars.parquet beside it (read only: other tests read them too)."""
    return tiny_model.ckpt


@pytest.fixture(scope="module")
def exported(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The command's main, all gates on, with a Triton repository: out/model.onnx and out/repo/tft/..."""
    out = tmp_path_factory.mktemp("export_out")
    return make_onnx(ckpt, out / "model.onnx", ("--triton-repo", str(out / "repo"), "--triton-name", "tft"))


@pytest.fixture(scope="module")
def torch_model(ckpt: Path) -> TemporalFusionTransformer:
    return model_from_checkpoint(load_checkpoint(ckpt))


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=[CPU])


def props(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def scaled_errors(model: TemporalFusionTransformer, sess: ort.InferenceSession, inputs: dict[str, np.ndarray]
                  ) -> dict[str, float]:
    """max |onnx - torch| per output; quantiles divided by the target scale (the gate's units)."""
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(names, inputs), strict=True))
    with torch.inference_mode():
        ref = model(*(torch.from_numpy(inputs[n]) for n in MODEL_INPUTS))._asdict()
    scale = model.target_scale.numpy()[None, :, None]
    errs = {}
    for name in names:
        assert got[name].shape == tuple(ref[name].shape), name
        diff = np.abs(got[name] - ref[name].numpy())
        errs[name] = float((diff / scale if name == QUANTILES else diff).max())
    return errs


def listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


# ---- the exported model ------------------------------------------------------------------------


def test_metadata_round_trip_equals_the_checkpoint(exported: Path, ckpt: Path) -> None:
    c = load_checkpoint(ckpt)
    meta = ModelMeta.from_props(props(exported))
    expected = ModelMeta(
        model_config=c["model_config"],
        feature_config=FeatureConfig.from_dict(c["feature_config"]),
        feature_schema=FeatureSchema.from_list(c["feature_schema"]),
        quantiles=tuple(c["model_config"]["quantiles"]),
        horizon=c["model_config"]["horizon"],
        encoder_length=c["model_config"]["encoder_length"],
        bar_interval_ns=c["bar_interval_ns"],
        symbols=tuple(c["symbols"]),
        checkpoint_sha256=file_sha256(ckpt),
        model_version=file_sha256(ckpt)[:12],
        explain=True,
        precision="fp32",
        column_map=c["column_map"],
        training={"first_bar_ns": c["data_span_ns"][0], "validation_from_ns": c["split_times_ns"][0],
                  "test_from_ns": None, "last_bar_ns": c["data_span_ns"][1]},  # no test split in this run
        input_stats={k: v for k, v in c["normalization"].items() if k != "target_scale"},
    )
    assert set(expected.input_stats) == {"observed", "known"}  # a model without static reals
    assert dataclasses.replace(meta, exporter={}, parity={}, placement={}, graph_sha256="") == expected
    # the graph's digest, derived independently: the model re-serialized by protobuf without its metadata
    bare = onnx.load(str(exported))
    del bare.metadata_props[:]
    assert meta.graph_sha256 == hashlib.sha256(bare.SerializeToString()).hexdigest()
    assert meta.exporter["opset"] == 18 and meta.exporter["torch"] == torch.__version__
    assert meta.exporter["onnxruntime"] == ort.__version__
    assert meta.parity["passed"] is True and meta.parity["tolerance"] == 1e-4
    assert {r["batch"] for r in meta.parity["rows"]} >= {1, 7, 64}
    assert any(r["case"] == "real windows" for r in meta.parity["rows"])
    n = c["validation_sample"][MODEL_INPUTS[0]].shape[0]
    assert meta.parity["real_windows"] == f"{n} from the checkpoint's validation sample"
    assert meta.placement["gate"] == "not run"  # never "passed" without --require-device


def test_interface_names_and_dynamic_batch(exported: Path) -> None:
    model = onnx.load(str(exported))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == list(MODEL_INPUTS)  # no static_real without static reals
    assert json.loads(props(exported)["foxhunt.parity"])["inputs"] == list(MODEL_INPUTS)
    assert [o.name for o in model.graph.output] == list(MODEL_OUTPUTS)
    for v in (*model.graph.input, *model.graph.output):
        first = v.type.tensor_type.shape.dim[0]
        assert first.dim_param and not first.HasField("dim_value"), f"{v.name}: batch axis is not dynamic"
    assert not any(n.metadata_props for n in model.graph.node)  # no stack traces with local paths


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_parity_at_any_batch_size(exported: Path, ckpt: Path, torch_model: TemporalFusionTransformer,
                                  batch: int) -> None:
    windows = saved_windows(load_checkpoint(ckpt))
    case = make_cases(windows, torch_model, batches=(batch,), seed=batch + 100)[1]  # a random batch
    errs = scaled_errors(torch_model, session(exported), case.inputs)
    assert max(errs.values()) < TOLERANCE["fp32"], errs


def test_parity_on_real_windows(exported: Path, ckpt: Path, torch_model: TemporalFusionTransformer) -> None:
    windows = saved_windows(load_checkpoint(ckpt))
    assert windows[MODEL_INPUTS[0]].shape[0] > 64
    errs = scaled_errors(torch_model, session(exported), windows)
    assert max(errs.values()) < TOLERANCE["fp32"], errs


# ---- Triton repository -------------------------------------------------------------------------


def parse_pbtxt(text: str) -> dict[str, list[Any]]:
    """Protobuf text format, enough for config.pbtxt: every field maps to a list of values."""
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+', re.sub(r"#[^\n]*", "", text))
    pos = 0

    def scalar(tok: str) -> Any:
        if tok.startswith('"'):
            return tok[1:-1]
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        return {"true": True, "false": False}.get(tok, tok)

    def value() -> Any:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return message("}")
        if tok == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return items
        return scalar(tok)

    def message(end: str | None) -> dict[str, list[Any]]:
        nonlocal pos
        fields: dict[str, list[Any]] = {}
        while pos < len(tokens) and tokens[pos] != end:
            name = tokens[pos]
            pos += 1
            if tokens[pos] == ":":
                pos += 1
            v = value()
            fields.setdefault(name, []).extend(v if isinstance(v, list) else [v])
        pos += 1
        return fields

    return message(None)


def test_a_triton_repository_named_triton_in_the_working_directory_is_no_package(
        ckpt: Path, exported: Path, tmp_path: Path) -> None:
    """`python -m` puts the working directory first on sys.path: a Triton model repository named `triton` there
    (`--triton-repo triton`) was imported by torch as the Triton compiler, and training and export failed deep
    inside torch (module 'triton' has no attribute 'language'). Both run there as anywhere. The export's report
    reader goes away too (`python -m export ... | head -1`): the tables on stdout lose their reader before the
    first line; the export goes on and writes the model whole (exit 0), and stderr says where the report still is."""
    shutil.copytree(exported.parent / "repo", tmp_path / "triton")
    proc = subprocess.Popen([sys.executable, "-m", "export", str(ckpt), "model.onnx", "--triton-repo", "triton",
                             "--triton-name", "again"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first table
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0 and "Traceback" not in err, err[-3000:]
    assert "warning: the report could not be written to stdout (Broken pipe); carrying on (the model's metadata " \
        "keeps the parity and placement reports)" in err and "wrote model.onnx" in err, err[-2000:]
    assert "foxhunt.parity" in props(tmp_path / "model.onnx")
    assert (tmp_path / "triton/again/config.pbtxt").is_file()
    r = subprocess.run([sys.executable, "-m", "trainer", "--parquet", str(ckpt.parent / "bars.parquet"), "--out",
                        "ckpt.pt", *TINY_TRAIN_FLAGS], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "ckpt.pt").is_file()


def test_triton_repository_matches_the_model(exported: Path) -> None:
    repo = exported.parent / "repo"
    assert listing(repo) == ["tft", "tft/1", "tft/1/model.onnx", "tft/config.pbtxt"]
    assert (repo / "tft/1/model.onnx").read_bytes() == exported.read_bytes()
    cfg = parse_pbtxt((repo / "tft/config.pbtxt").read_text())
    assert cfg["name"] == ["tft"] and cfg["platform"] == ["onnxruntime_onnx"]
    max_batch = cfg["max_batch_size"][0]
    assert max_batch == 256
    assert "dynamic_batching" in cfg
    assert [g["kind"] for g in cfg["instance_group"]] == [["KIND_GPU"]]
    # the version written, whatever else the directory holds (an edited policy would not survive the next export)
    assert cfg["version_policy"] == [{"specific": [{"versions": [1]}]}]
    # the CUDA provider runs fp32 as the parity check and the server do: without TF32 (ONNX Runtime's default is on)
    cuda = cfg["optimization"][0]["execution_accelerators"][0]["gpu_execution_accelerator"]
    assert [(a["name"], {p["key"][0]: p["value"][0] for p in a["parameters"]}) for a in cuda] == \
        [(["cuda"], {"use_tf32": "0"})]

    model = onnx.load(str(exported))
    # the oldest IR its opset allows (8 for opset 18), not the exporter's 10: onnxruntime 1.17 and older, as
    # older Tritons bundle, refuse IR 10
    assert model.ir_version == 8 and [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    dtypes = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT64: "TYPE_INT64"}

    def sig(values: Any) -> list[tuple[str, str, list[int]]]:  # name, Triton type, dims without the batch
        return [(v.name, dtypes[v.type.tensor_type.elem_type],
                 [d.dim_value for d in v.type.tensor_type.shape.dim[1:]]) for v in values]

    def conf(entries: list[dict[str, list[Any]]]) -> list[tuple[str, str, list[int]]]:
        return [(e["name"][0], e["data_type"][0], e["dims"]) for e in entries]

    assert conf(cfg["input"]) == sig(model.graph.input)
    assert conf(cfg["output"]) == sig(model.graph.output)
    warm = cfg["model_warmup"]
    assert {w["batch_size"][0] for w in warm} == {1, max_batch}
    for w in warm:
        feeds = {i["key"][0]: i["value"][0] for i in w["inputs"]}
        assert [(k, v["data_type"][0], v["dims"]) for k, v in feeds.items()] == sig(model.graph.input)
        assert all(v["zero_data"] == [True] for v in feeds.values())


# ---- fp16 ----------------------------------------------------------------------------------------


def test_placement_analysis_runs_for_real_on_the_cpu(exported: Path, ckpt: Path,
                                                     torch_model: TemporalFusionTransformer) -> None:
    feeds = saved_windows(load_checkpoint(ckpt))
    provider, nodes = profile_placement(exported.read_bytes(), "cpu", feeds)
    assert provider == CPU and nodes
    assert {n.provider for n in nodes} == {CPU}
    ops = {n.op_type for n in nodes}
    assert "LSTM" in ops and "Shape" in ops
    assert all(n.shape_only for n in nodes if n.op_type == "Shape")
    assert not any(n.shape_only for n in nodes if n.op_type in ("LSTM", "MatMul", "Softmax"))

    on_cpu = evaluate(PlacementReport("cpu", provider, nodes), "cpu")
    assert on_cpu.gate == "passed" and not on_cpu.misplaced
    for_cuda = evaluate(PlacementReport("cuda", provider, nodes), "cuda")
    assert for_cuda.gate == "failed"
    assert {n.name for n in for_cuda.misplaced} == {n.name for n in for_cuda.cpu_compute}
    assert not any(n.shape_only for n in for_cuda.misplaced)
    table = for_cuda.table()
    assert "CPU-placed compute nodes" in table and "LSTM" in table


def test_shape_computation_classification() -> None:
    assert is_shape_computation("Shape", ["float"], ["int64"])
    assert is_shape_computation("Concat", ["int64", "int64"], ["int64"])
    assert not is_shape_computation("Reshape", ["float", "int64"], ["float"])  # moves data
    assert not is_shape_computation("Cast", ["float"], ["int64"])  # reads data
    assert not is_shape_computation("MatMul", ["int64", "int64"], ["int64"])


def test_reason_from_the_provider_log() -> None:
    log = [
        "[E:onnxruntime:Default, provider_bridge_ort.cc:2458 operator()] /src/provider_bridge_ort.cc:2043 "
        "onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : 1 : FAIL : Failed to load library "
        "/venv/onnxruntime/capi/libonnxruntime_providers_cuda.so with error: libcublasLt.so.13: cannot open "
        "shared object file: No such file or directory",
        "[W:onnxruntime:Default, onnxruntime_pybind_state.cc:1295 CreateExecutionProviderFactoryInstance] Failed "
        "to create CUDAExecutionProvider. Require cuDNN 9.* and CUDA 13.*. Please install all dependencies",
    ]
    assert provider_failure_reason(log) == (
        "libonnxruntime_providers_cuda.so failed to load: libcublasLt.so.13: cannot open shared object file: "
        "No such file or directory; Failed to create CUDAExecutionProvider. Require cuDNN 9.* and CUDA 13.*")


# ---- refusals: nothing is written ------------------------------------------------------------------


def _break_parity(model: onnx.ModelProto) -> None:
    """Shift the quantile head's bias: a valid graph that computes the wrong thing."""
    bias = next(t for t in model.graph.initializer if t.name.endswith("head.proj.bias"))
    bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + np.float32(0.5), bias.name))


def test_broken_parity_writes_nothing(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "releases" / "v2" / "model.onnx"  # directories that do not exist yet: made when it is written
    code = main([str(ckpt), str(out), "--triton-repo", str(tmp_path / "repo")], _tamper=_break_parity)
    captured = capsys.readouterr()
    assert code == 1
    assert listing(tmp_path) == []  # no model, no temporary, no Triton directory
    assert "parity FAILED" in captured.out and "parity check failed" in captured.err
    assert re.search(r"^random batch 1 +1 +quantiles .* NO$", captured.out, re.M)
    # the in-process memo of the traced graph keeps the graph as torch exported it, not as tampered
    assert main([str(ckpt), str(out)]) == 0, capsys.readouterr().err
    assert "parity passed" in capsys.readouterr().out
    assert listing(tmp_path) == ["releases", "releases/v2", "releases/v2/model.onnx"]


def test_require_device_cuda_fails_here_naming_why(ckpt: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Where the CUDA provider does not load the gate cannot pass: refused at once (exit 2, as `--device cuda`
    is by the trainer and the server), naming why, before the checkpoint is loaded or the model exported."""
    cuda = probe("cuda")
    if cuda.available:
        pytest.skip("the CUDA provider loads on this machine; the GPU check covers it")
    out = tmp_path / "model.onnx"
    assert main([str(ckpt), str(out), "--require-device", "cuda", "--no-explain"]) == 2
    captured = capsys.readouterr()
    assert listing(tmp_path) == []
    assert f"error: --require-device cuda: {cuda.reason}. Export on a machine where onnxruntime-gpu loads CUDA, " \
        "or drop --require-device" in captured.err, captured.err
    assert re.search(r"does not load|has no CUDAExecutionProvider", cuda.reason)
    assert "exporting with torch.onnx.export" not in captured.err and "parity" not in captured.out
    assert captured.err.count(cuda.reason) == 1, captured.err  # said once


class NotAWeight:
    """Pickled into a checkpoint: loading it would need code, so weights_only refuses it."""


@pytest.mark.parametrize("kind", ["missing", "corrupt", "truncated", "pickled", "diverged", "flipped", "unit", "onnx",
                                  "parquet"])
def test_unusable_checkpoints_exit_2(kind: str, ckpt: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "in" / "ckpt.pt"
    bad.parent.mkdir()
    if kind == "corrupt":
        bad.write_bytes(b"this is not a checkpoint\n" * 100)
    elif kind == "truncated":
        bad.write_bytes(ckpt.read_bytes()[:5000])
    elif kind == "pickled":
        torch.save({"format": FORMAT, "model_config": NotAWeight()}, bad)
    elif kind == "onnx":  # export's output given as its input
        graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
                                       [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                       [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
        onnx.save(onnx.helper.make_model(graph), bad)
    elif kind == "parquet":  # the bars given as the checkpoint
        pq.write_table(pa.table({"close": [1.0, 2.0]}), bad)
    elif kind == "unit":  # the bars' time unit, as stored, is not one
        state = load_checkpoint(ckpt)
        state["column_map"]["time_unit"] = "fortnights"
        torch.save(state, bad)
    elif kind in ("diverged", "flipped"):
        state = load_checkpoint(ckpt)
        name = next(k for k, v in state["model_state"].items() if v.is_floating_point())
        weight = state["model_state"][name]
        if kind == "diverged":  # written so by a run whose weights went NaN: the digest agrees
            state["model_state"][name] = torch.full_like(weight, float("nan"))
            state["model_state_sha256"] = state_digest(state["model_state"])
        else:  # one weight changed on disk after it was written (what torch.load does not notice)
            weight.view(-1)[0] = -weight.view(-1)[0] + 0.5
        torch.save(state, bad)
    out = tmp_path / "out"
    out.mkdir()
    assert main([str(bad), str(out / "model.onnx")]) == 2
    err = capsys.readouterr().err
    assert listing(out) == []
    expected = {"missing": "no such checkpoint file", "corrupt": "not a readable checkpoint",
                "truncated": "not a readable checkpoint", "pickled": "refused",
                "diverged": "holds NaN or infinite values: the run that wrote it diverged",
                "flipped": "the weights differ from the digest written with them: the file is corrupted",
                "unit": "the checkpoint's column_map is not valid (time unit 'fortnights': expected one of s, ms, "
                        "us, ns)",
                "onnx": "it is an ONNX model (what `python -m export` writes, for `python -m serving --model`); give "
                        "the checkpoint `python -m trainer` wrote",
                "parquet": "it is a parquet file, bars for `python -m trainer --parquet`"}[kind]
    assert expected in err and "nothing was written" in err
    assert ("it is " in err) == (kind in ("onnx", "parquet"))  # a hint only where the file is another kind


@pytest.mark.parametrize(("flags", "message"), [
    (["--opset", "12"], "supported opsets are 18..23"),
    (["--threads", "0"], "--threads 0"),
    (["--triton-name", "x"], "only apply with --triton-repo"),
    (["--triton-repo", "REPO", "--triton-name", "bad/name"], "Triton model name"),
    (["--triton-repo", "REPO", "--triton-max-batch-size", "0"], "must be >= 1"),
    (["--bars", "NOPE/bars.parquet"], "--bars"),
])
def test_bad_arguments_exit_2(flags: list[str], message: str, ckpt: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    flags = [f.replace("REPO", str(tmp_path / "repo")).replace("NOPE", str(tmp_path / "nope")) for f in flags]
    assert main([str(ckpt), str(tmp_path / "model.onnx"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert listing(tmp_path) == []


def test_output_paths_are_checked(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ckpt), str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main([str(ckpt), str(tmp_path / "afile" / "model.onnx")]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    (tmp_path / "afile").unlink()
    assert main([str(ckpt), str(ckpt)]) == 2
    assert "is the checkpoint itself" in capsys.readouterr().err
    fifo = tmp_path / "fifo"  # never opened (that would block)
    os.mkfifo(fifo)
    assert main([str(ckpt), str(fifo)]) == 2
    assert f"{fifo} exists and is not an ONNX model" in capsys.readouterr().err
    assert main([str(fifo), str(tmp_path / "model.onnx")]) == 2  # as the checkpoint: it exists, it is no file
    assert f"{fifo}: not a regular file; give the checkpoint file `python -m trainer` wrote" in \
        capsys.readouterr().err
    fifo.unlink()
    inside = tmp_path / "repo" / "tft" / "1"
    inside.mkdir(parents=True)
    assert main([str(ckpt), str(inside / "model.onnx"), "--triton-repo", str(tmp_path / "repo"),
                 "--triton-name", "tft"]) == 2
    assert "is inside the Triton model directory" in capsys.readouterr().err
    assert listing(tmp_path / "repo") == ["tft", "tft/1"]
    bars = tmp_path / "data" / "bars.parquet"  # the --bars file, or a parquet name in the --bars directory
    bars.parent.mkdir()
    bars.write_bytes(b"PAR1 the user's bars")
    assert main([str(ckpt), str(bars), "--bars", str(bars)]) == 2
    assert f"{bars} is the bars file {bars} itself" in capsys.readouterr().err
    assert main([str(ckpt), str(bars.parent / "model.parquet"), "--bars", str(bars.parent)]) == 2
    assert "is inside the bars directory" in capsys.readouterr().err
    assert listing(bars.parent) == ["bars.parquet"] and bars.read_bytes() == b"PAR1 the user's bars"
    assert main([str(ckpt), str(bars)]) == 2  # a file of another kind is not replaced, bars or not
    assert f"{bars} exists and is a parquet file, which writing an ONNX model there would replace" \
        in capsys.readouterr().err
    last = tmp_path / "data" / "ckpt.last.pt"
    last.write_bytes(ckpt.read_bytes())
    assert main([str(ckpt), str(last)]) == 2 and "exists and is a PyTorch checkpoint" in capsys.readouterr().err
    assert last.read_bytes() == ckpt.read_bytes()
    # the checkpoint named by its run's directory
    assert main([str(ckpt.parent), str(tmp_path / "m.onnx")]) == 2
    assert f"{ckpt.parent} is a directory; give the checkpoint file in it, e.g. {ckpt.parent / 'ckpt.pt'}" \
        in capsys.readouterr().err
    # a file where the Triton model directory goes is not replaced
    notes = tmp_path / "triton" / "tft"
    notes.parent.mkdir()
    notes.write_text("my notes")
    assert main([str(ckpt), str(tmp_path / "m.onnx"), "--triton-repo", str(notes.parent), "--triton-name",
                 "tft"]) == 2
    assert f"--triton-repo: {notes} exists and is not a directory" in capsys.readouterr().err
    assert notes.read_text() == "my notes"


def test_an_output_that_is_a_link_becomes_a_file_and_what_it_named_is_kept(
        ckpt: Path, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A deployment link (served.onnx -> releases/v7.onnx) exported over: the release stays as it was, the new
    model takes the link's place, and the export says so; a link to nothing is replaced alike."""
    release = tmp_path / "releases" / "v7.onnx"
    release.parent.mkdir()
    shutil.copy(exported, release)
    served, dangling = tmp_path / "served.onnx", tmp_path / "next.onnx"
    served.symlink_to(release)
    dangling.symlink_to(tmp_path / "releases" / "v8.onnx")
    for link, target in ((served, release), (dangling, tmp_path / "releases" / "v8.onnx")):
        assert main([str(ckpt), str(link)]) == 0
        assert f"note: {link} is a link to {target}; it becomes a file of its own" in capsys.readouterr().err
        assert not link.is_symlink() and ModelMeta.from_props(props(link)).graph_sha256
    assert release.read_bytes() == exported.read_bytes() and not (tmp_path / "releases" / "v8.onnx").exists()


def test_a_full_disk_exits_1_naming_the_directory_and_the_fix(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every check passed, and then the write fails: the trainer's status for it (1), not a usage error."""
    import export.files

    real_write = export.files._write

    def full_in(where: Path) -> Callable[[Path, bytes, int], None]:
        def write(path: Path, data: bytes, mode: int) -> None:
            if path.is_relative_to(where):  # as a full disk fails: at write(), with no file name
                with open("/dev/full", "wb") as f:
                    f.write(data)
                    f.flush()
            real_write(path, data, mode)
        return write

    monkeypatch.setattr(export.files, "_write", full_in(tmp_path))
    assert main([str(ckpt), str(tmp_path / "model.onnx")]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot write {tmp_path / 'model.onnx'}: No space left on device; free space on the file system " \
        f"of {tmp_path}, or write elsewhere" in err and "nothing was written" in err, err
    assert listing(tmp_path) == []
    # the Triton repository on another (full) file system: named, not the model file's directory; the directories
    # made for both outputs (the repository's inside the model file's) are removed again
    out, repo = tmp_path / "new", tmp_path / "new" / "other_disk" / "repo"
    monkeypatch.setattr(export.files, "_write", full_in(tmp_path / "new" / "other_disk"))
    assert main([str(ckpt), str(out / "model.onnx"), "--triton-repo", str(repo)]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot write {repo / 'model'}: No space left on device; free space on the file system of " \
        f"{repo}" in err, err
    assert listing(tmp_path) == []


def test_real_command_exit_status_and_help_text(tmp_path: Path) -> None:
    r = run(["-m", "export", str(tmp_path / "nope.pt"), str(tmp_path / "model.onnx")])
    assert r.returncode == 2 and "no such checkpoint file" in r.stderr
    assert listing(tmp_path) == []
    text = build_parser().format_help()
    assert "exit status" in text and "--require-device" in text and "nothing was written" in text
    # --help and bad flags are answered before torch and onnx are imported (seconds); the opsets it offers, onnx has
    for args, code in ((["--help"], 0), ([str(tmp_path / "nope.pt"), "m.onnx"], 2),
                       (["c.pt", "m.onnx", "--opset", "9"], 2)):
        r, last = exit_and_imports("export", args)
        assert last == f"exit {code} torch=False onnx=False", (args, r.stdout[-300:], r.stderr[-2000:])
    # the paths are checked first, as before the checkpoint was looked for ahead of the imports
    r, last = exit_and_imports("export", [str(tmp_path / "nope.pt"), "m.onnx", "--triton-repo", "README.md"])
    assert last.startswith("exit 2") and "--triton-repo README.md is a file, not a directory" in r.stderr, r.stderr
    assert onnx.defs.onnx_opset_version() >= MAX_OPSET


# ---- pieces ---------------------------------------------------------------------------------------


def test_windows_rebuilt_from_bars(ckpt: Path, torch_model: TemporalFusionTransformer, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    c = load_checkpoint(ckpt)
    rebuilt = windows_from_bars(ckpt.parent / "bars.parquet", c, torch_model.cfg)
    saved = saved_windows(c)
    for name in MODEL_INPUTS:
        assert rebuilt[name].shape[1:] == saved[name].shape[1:] and rebuilt[name].dtype == saved[name].dtype
    assert 1 < rebuilt[MODEL_INPUTS[0]].shape[0] <= 256
    assert all(np.isfinite(rebuilt[name]).all() for name in MODEL_INPUTS)
    # the same bars under another time column's name: mapped as the trainer's flag maps it
    import pyarrow.parquet as pq

    table = pq.read_table(ckpt.parent / "bars.parquet")
    pq.write_table(table.rename_columns(["ts_event" if n == "timestamp" else n for n in table.column_names]),
                   tmp_path / "renamed.parquet")
    renamed = windows_from_bars(tmp_path / "renamed.parquet", c, torch_model.cfg, {"timestamp": "ts_event"})
    for name in MODEL_INPUTS:
        np.testing.assert_array_equal(renamed[name], rebuilt[name])
    # a symbol the model does not know is skipped, and said so; the model's own give the same windows
    other = table.filter(pc.equal(table["symbol"], c["symbols"][0]))
    cl = pa.array(["CL"] * other.num_rows, type=table.schema.field("symbol").type)
    other = other.set_column(other.column_names.index("symbol"), "symbol", cl)
    pq.write_table(pa.concat_tables([table, other]), tmp_path / "more.parquet")
    said: list[str] = []
    more = windows_from_bars(tmp_path / "more.parquet", c, torch_model.cfg, log=said.append)
    assert said == [f"--bars: skipped CL: not the model's symbols ({', '.join(c['symbols'])})"]
    for name in MODEL_INPUTS:
        np.testing.assert_array_equal(more[name], rebuilt[name])
    pq.write_table(other, tmp_path / "cl.parquet")
    with pytest.raises(UsageError, match="holds none of the model's symbols"):
        windows_from_bars(tmp_path / "cl.parquet", c, torch_model.cfg)
    with pytest.raises(UsageError, match=r"cannot be read as parquet"):
        windows_from_bars(ckpt, c, torch_model.cfg)
    # the whole export on them: the note, and the metadata says which windows parity was proved on
    out = tmp_path / "model.onnx"
    assert main([str(ckpt), str(out), "--bars", str(tmp_path / "more.parquet")]) == 0
    assert said[0] in capsys.readouterr().err
    parity = json.loads(props(out)["foxhunt.parity"])
    assert parity["passed"] and parity["real_windows"] == \
        f"{more[MODEL_INPUTS[0]].shape[0]} rebuilt from {tmp_path / 'more.parquet'}"
    assert "--time-col" in build_parser().format_help()
    with pytest.raises(UsageError, match=r"--time-col, --open-col: column mapping applies to --bars only"):
        options_from_args(build_parser().parse_args([str(ckpt), str(tmp_path / "m.onnx"), "--time-col", "ts_event",
                                                     "--open-col", "o"]))


def test_an_interrupt_wrapped_by_the_exporter_is_an_interrupt_not_a_failed_check(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.onnx.export can wrap the KeyboardInterrupt of Ctrl-C (or of SIGTERM) in its own error; that is
    the user stopping the export (exit 130), not a model that cannot be exported (exit 1)."""
    def wrapped(*args: object, **kwargs: object) -> None:
        try:
            raise KeyboardInterrupt("signal 15")
        except KeyboardInterrupt as exc:
            raise RuntimeError("Failed to export the model with torch.export") from exc

    import export.pipeline

    monkeypatch.setattr(torch.onnx, "export", wrapped)
    monkeypatch.setattr(export.pipeline, "_EXPORTS", type(export.pipeline._EXPORTS)())  # no graph traced before
    assert main([str(ckpt), str(tmp_path / "model.onnx")]) == 130
    err = capsys.readouterr().err
    assert "interrupted; nothing was written" in err and "export refused" not in err
    assert listing(tmp_path) == []


def test_sigterm_interrupts_the_export_as_ctrl_c_does(ckpt: Path, tmp_path: Path) -> None:
    """The real command, held inside the export (its graph capture blocks) until SIGTERM arrives: exit 130, one
    line, nothing written."""
    out = tmp_path / "model.onnx"
    held = ("import runpy, sys, time\n"
            "import export.pipeline as p\n"
            "def hold(*args):\n"
            "    print('held', file=sys.stderr, flush=True)\n"
            "    time.sleep(600)\n"
            "p.export_model = hold\n"
            "sys.argv = ['export', *sys.argv[1:]]\n"
            "runpy.run_module('export', run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", held, str(ckpt), str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the export has begun and waits
            if line.startswith("held"):
                break
        proc.send_signal(signal.SIGTERM)
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, err[-2000:]
    finally:
        proc.kill()
    assert "interrupted; nothing was written" in err and "Traceback" not in err
    assert listing(tmp_path) == []


def test_what_a_killed_export_left_is_cleared_or_named(ckpt: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL can leave staged copies beside the outputs, and a model directory's backup mid-swap; Triton would
    take either for a model. The next export removes the staged copies and names a backup (the only copy of
    the old model, if the kill came between the two renames)."""
    repo = tmp_path / "repo"
    (repo / ".tft.k1ll3d_x.tmp" / "1").mkdir(parents=True)
    (repo / ".tft.k1ll3d_x.tmp" / "config.pbtxt").write_text("partial")
    (repo / ".tft.old-0badc0de" / "1").mkdir(parents=True)
    (tmp_path / ".model.onnx.k1ll3d_x.tmp").write_bytes(b"partial")
    others = [repo / ".tft.v2.k3j9x0ab.tmp", repo / ".tft.my notes.tmp"]  # model tft.v2's staging; a user's
    for other in others:
        other.mkdir()
    assert main([str(ckpt), str(tmp_path / "model.onnx"), "--triton-repo", str(repo), "--triton-name", "tft"]) == 0
    err = capsys.readouterr().err
    assert "removed" in err and ".tft.k1ll3d_x.tmp" in err and ".model.onnx.k1ll3d_x.tmp" in err
    assert ".tft.old-0badc0de is a copy of" in err
    assert listing(repo) == [".tft.my notes.tmp", ".tft.old-0badc0de", ".tft.old-0badc0de/1", ".tft.v2.k3j9x0ab.tmp",
                             "tft", "tft/1", "tft/1/model.onnx", "tft/config.pbtxt"]
    assert not (tmp_path / ".model.onnx.k1ll3d_x.tmp").exists()


def test_an_interrupt_once_the_files_are_published_exits_0(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C after the files are renamed into place meets a complete export, which is what main says (exit 0),
    not "nothing was written"."""
    import export.pipeline

    real = export.pipeline.write_outputs

    def published_then_interrupted(*args: Any, **kwargs: Any) -> Path | None:
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(export.pipeline, "write_outputs", published_then_interrupted)
    out = tmp_path / "model.onnx"
    assert main([str(ckpt), str(out)]) == 0
    assert out.exists() and f"interrupted after {out} was published: it is complete" in capsys.readouterr().err


def test_staging_is_all_or_nothing(tmp_path: Path) -> None:
    target, repo = tmp_path / "model.onnx", tmp_path / "repo" / "tft"
    with Staging() as s:  # discarded: nothing appears, not even the repository directory
        s.file(target, b"new")
        s.directory(repo, {"config.pbtxt": b"c", "1/model.onnx": b"new"})
    assert listing(tmp_path) == []

    with Staging() as s:
        s.file(target, b"old")
        s.directory(repo, {"config.pbtxt": b"old", "1/model.onnx": b"old"})
        s.commit()
    assert target.read_bytes() == b"old" and (repo / "1/model.onnx").read_bytes() == b"old"

    blocker = tmp_path / "blocked.onnx"
    blocker.mkdir()  # os.replace onto a directory fails: the model directory must roll back
    with pytest.raises(OSError), Staging() as s:
        s.file(blocker, b"new")
        s.directory(repo, {"config.pbtxt": b"new", "1/model.onnx": b"new"})
        s.commit()
    assert (repo / "config.pbtxt").read_bytes() == b"old"
    assert listing(tmp_path) == sorted(["blocked.onnx", "model.onnx", "repo", "repo/tft", "repo/tft/1",
                                        "repo/tft/1/model.onnx", "repo/tft/config.pbtxt"])
    shutil.rmtree(blocker)


def test_ctrl_c_while_publishing_puts_everything_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C between the model directory's swap and the model file's: the old directory is back, the new
    files are gone, and nothing is reported published."""
    import export.files as files

    target, repo = tmp_path / "model.onnx", tmp_path / "repo" / "tft"
    with Staging() as s:
        s.file(target, b"old")
        s.directory(repo, {"config.pbtxt": b"old", "1/model.onnx": b"old"})
        s.commit()
    real_replace = os.replace

    def interrupted(src: Any, dst: Any) -> None:
        raise KeyboardInterrupt

    published: list[Path] = []
    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt), Staging() as s:
        s.file(target, b"new")
        s.directory(repo, {"config.pbtxt": b"new", "1/model.onnx": b"new"})
        s.commit(published)
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert published == []
    assert target.read_bytes() == b"old" and (repo / "1/model.onnx").read_bytes() == b"old"
    assert listing(tmp_path) == ["model.onnx", "repo", "repo/tft", "repo/tft/1", "repo/tft/1/model.onnx",
                                 "repo/tft/config.pbtxt"]


def test_a_new_export_into_a_triton_model_directory_keeps_what_else_it_holds(tmp_path: Path) -> None:
    """Re-exporting replaces the config and version 1, and leaves the operator's other versions and files."""
    repo = tmp_path / "repo" / "tft"
    with Staging() as s:
        s.directory(repo, {"config.pbtxt": b"old", "1/model.onnx": b"old"})
        s.commit()
    (repo / "2").mkdir()
    (repo / "2" / "model.onnx").write_bytes(b"v2")
    (repo / "labels.txt").write_text("ES\nNQ\n")
    with Staging() as s:
        s.directory(repo, {"config.pbtxt": b"new", "1/model.onnx": b"new"}, keep_others=True)
        s.commit()
    assert listing(repo) == ["1", "1/model.onnx", "2", "2/model.onnx", "config.pbtxt", "labels.txt"]
    assert [(repo / p).read_bytes() for p in ("config.pbtxt", "1/model.onnx", "2/model.onnx", "labels.txt")] == \
        [b"new", b"new", b"v2", b"ES\nNQ\n"]
    assert listing(tmp_path / "repo") == ["tft", *(f"tft/{p}" for p in listing(repo))]  # no backup left behind
    assert newer_versions(repo) == ["2"]  # what export notes: kept, and not served (the config's version_policy)



def test_a_triton_model_directory_that_is_a_link_becomes_a_directory_and_leaves_no_backup(tmp_path: Path) -> None:
    """A model directory symlinked elsewhere: the export's directory takes its place with what the link showed,
    the directory it named is left as it was, and no `.tft.old-*` backup stays behind for Triton to load."""
    store = tmp_path / "store" / "tft"
    (store / "2").mkdir(parents=True)
    (store / "2" / "model.onnx").write_bytes(b"v2")
    (store / "config.pbtxt").write_bytes(b"old")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "tft").symlink_to(store)
    with Staging() as s:
        s.directory(repo / "tft", {"config.pbtxt": b"new", "1/model.onnx": b"new"}, keep_others=True)
        s.commit()
    assert not (repo / "tft").is_symlink() and listing(repo) == ["tft", "tft/1", "tft/1/model.onnx", "tft/2",
                                                                  "tft/2/model.onnx", "tft/config.pbtxt"]
    assert (repo / "tft" / "config.pbtxt").read_bytes() == b"new" and leftovers(repo / "tft") == ([], [])
    assert listing(store) == ["2", "2/model.onnx", "config.pbtxt"] and (store / "config.pbtxt").read_bytes() == b"old"

# ---- on a GPU machine ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_require_device_cuda_passes_where_cuda_loads(precision: str, ckpt: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cuda = probe("cuda")
    if not cuda.available:
        pytest.skip(f"needs the ONNX Runtime CUDA provider: {cuda.reason}")
    out = tmp_path / "model.onnx"
    flags = ["--fp16"] if precision == "fp16" else []
    assert main([str(ckpt), str(out), "--require-device", "cuda", *flags]) == 0, capsys.readouterr().err
    meta = ModelMeta.from_props(props(out))
    assert meta.placement["gate"] == "passed" and meta.placement["cpu_compute_nodes"] == []
    assert meta.parity["provider"] == "CUDAExecutionProvider" and meta.parity["passed"]


def test_the_triton_warm_up_batch_is_bounded_whatever_the_max_batch_size() -> None:
    """Triton assembles a warm-up batch from that many single requests: 2**31 - 1 of them would never load."""
    from export.onnx_export import TensorSig
    from export.triton import WARMUP_MAX_BATCH, config_pbtxt

    sigs = [TensorSig("x", "float32", ("batch", 3))]
    for max_batch, largest in ((2**31 - 1, WARMUP_MAX_BATCH), (64, 64), (1, None)):
        cfg = parse_pbtxt(config_pbtxt("m", sigs, sigs, max_batch))
        assert cfg["max_batch_size"] == [max_batch]
        assert [w["batch_size"][0] for w in cfg["model_warmup"]] == [1] + ([largest] if largest else [])


def test_a_tensor_going_to_half_saturates_instead_of_overflowing() -> None:
    """fp16 holds +-65504: a float32 value beyond it (a normalised input far out) is clipped on its way into half
    compute, so x - x is 0 where an unclipped cast gives inf - inf = NaN."""
    from onnx import TensorProto, helper

    from export.fp16 import convert_to_fp16

    graph = helper.make_graph(
        [helper.make_node("Sub", ["x", "x"], ["d"]), helper.make_node("Mul", ["d", "one"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    half = convert_to_fp16(model)
    onnx.checker.check_model(half, full_check=True)
    assert [n.op_type for n in half.graph.node] == ["Clip", "Cast", "Sub", "Cast", "Mul"]  # Sub runs in half
    session = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": np.array([1e6, -1e9, 3.0], dtype=np.float32)})[0]
    assert np.array_equal(got, [0.0, 0.0, 0.0]), got


# ---- the parity gate's arithmetic: |onnx - torch| / target_scale[h] <= tolerance ---------------------------
def test_parity_gate_is_in_units_of_each_horizons_target_scale() -> None:
    scale = np.array([0.01, 0.02, 0.04])  # target std of each horizon step
    tol = TOLERANCE["fp32"]  # 1e-4 target stds
    case = Case("c", {STATIC_CATEGORICAL: np.zeros((2, 1), np.int64)})
    torch_out = np.zeros((2, 3, 3), np.float32)  # [B, H, Q]
    within = torch_out + (0.5 * tol * scale)[None, :, None].astype(np.float32)  # half a tolerance everywhere
    beyond = torch_out.copy()
    beyond[0, 0, 1] = 2 * tol * scale[0]  # 2e-6 in return units: tiny in absolute terms, 2 tolerances scaled
    [ok] = compare(case, [QUANTILES], [torch_out], [within], scale, tol)
    [bad] = compare(case, [QUANTILES], [torch_out], [beyond], scale, tol)
    assert ok.passed and ok.scaled == pytest.approx(0.5 * tol, rel=1e-3)
    assert not bad.passed and bad.scaled == pytest.approx(2 * tol, rel=1e-3)
    assert bad.max_abs == pytest.approx(2e-6, rel=1e-3)


def test_a_parity_report_with_no_rows_has_not_passed() -> None:
    assert not ParityReport("fp32", "CPUExecutionProvider", TOLERANCE["fp32"]).passed


@pytest.mark.parametrize(("command", "argv", "message"), [
    ("export", ["ckpt.pt", "OUT/"], "argument output: 'OUT/' ends with '/', a directory: give the file's name, "
                                    "e.g. OUT/model.onnx"),
    ("trainer", ["--parquet", "bars.parquet", "--out", "OUT/"], "e.g. OUT/ckpt.pt"),
    ("trainer", ["--parquet", "bars.parquet", "--out", "OUT/m.ONNX"], "names an ONNX model, which `python -m export` "
                                                                      "makes"),
    ("serving.score", ["--model", "m.onnx", "--parquet", "bars.parquet", "--out", "OUT/"],
     "e.g. OUT/forecasts.parquet"),
])
def test_an_output_named_as_a_directory_or_another_commands_file_is_refused(
        command: str, argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out runs/new/` would otherwise be written as a file named `runs/new` (and its `.last.pt` beside it)."""
    import importlib

    argv = [a.replace("OUT", str(tmp_path / "new")) for a in argv]
    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"{command}.__main__" if "." not in command else command).main(argv)
    assert info.value.code == 2 and message.replace("OUT", str(tmp_path / "new")) in capsys.readouterr().err
    assert listing(tmp_path) == []
