"""`python -m export --calibrate`: conformal offsets fitted on the run's validation split, folded into the graph.

The tests' shared tiny model (tests.live_server), exported with --calibrate by the command's main; its ONNX
output is checked on the run's validation windows, rebuilt with the trainer's own code.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.__main__ import main
from export.calibrate import SCALE_INPUTS, conformal_rank, validation_data
from export.errors import UsageError
from export.options import ExportOptions
from export.pipeline import run_export
from features.bars import ColumnMap
from features.model_meta import ModelMeta
from features.schema import MODEL_INPUTS, QUANTILES
from serving.client import format_model_info
from serving.model import load_model
from serving.servicer import Limits, model_info
from tests.artifacts import make_bars, run_main
from tests.live_server import Model, tiny_model  # noqa: F401  (the shared fixture)
from trainer.checkpoint import load_checkpoint, model_from_checkpoint
from trainer.config import TrainConfig
from trainer.data import Normalization, prepare

torch.set_num_threads(1)
LIMITS = Limits(max_batch=64, max_message_bytes=1 << 20, max_concurrent=8)


@pytest.fixture(scope="module")
def ckpt(tiny_model: Model) -> Path:  # noqa: F811
    """The shared tiny model's checkpoint (read only: other tests read it too)."""
    return tiny_model.ckpt


@pytest.fixture(scope="module")
def calibrated(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The command with --calibrate (the bars: the checkpoint's data source)."""
    out = tmp_path_factory.mktemp("calibrated") / "calibrated.onnx"
    r = run_main(["-m", "export", str(ckpt), str(out), "--calibrate"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "calibration (cqr) on" in r.stderr and "interval" in r.stderr  # the before/after table
    return out


@pytest.fixture(scope="module")
def validation(ckpt: Path) -> dict[str, np.ndarray]:
    """The run's validation windows and their targets [W, H], rebuilt by trainer.data.prepare."""
    c = load_checkpoint(ckpt)
    data = prepare(c["data_source"], TrainConfig.from_dict(c["train_config"]), ColumnMap.from_dict(c["column_map"]),
                   list(c["symbols"]), Normalization.from_dict(c["normalization"]))
    batch = data.tensors.batch(torch.from_numpy(data.val_anchors))
    return {**{name: batch[name].numpy() for name in MODEL_INPUTS}, "target": data.frame.targets[data.val_anchors]}


def forecast(model: Path, windows: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    out: np.ndarray = session.run([QUANTILES], {name: windows[name] for name in MODEL_INPUTS})[0]
    return out  # [W, H, Q]


def meta_of(model: Path) -> ModelMeta:
    return ModelMeta.from_props({p.key: p.value for p in onnx.load(str(model)).metadata_props})


def test_metadata_holds_offsets_and_coverage(calibrated: Path, validation: dict[str, np.ndarray]) -> None:
    meta = meta_of(calibrated)
    cal: dict[str, Any] = meta.calibration or {}
    assert np.asarray(cal["offsets"]).shape == (meta.horizon, len(meta.quantiles))
    assert cal["method"] == "cqr" and cal["validation_windows"] == validation["target"].shape[0]
    keys = {*(f"{q:g}" for q in meta.quantiles), "interval"}
    assert set(cal["coverage_before"]) == set(cal["coverage_after"]) == keys
    assert meta.model_version.endswith("-calibrated")


def test_calibrated_model_covers_nominal_without_crossing(calibrated: Path, validation: dict[str, np.ndarray]
                                                          ) -> None:
    meta = meta_of(calibrated)
    pred = forecast(calibrated, validation)  # [W, H, Q]
    target = validation["target"]  # [W, H]
    assert np.all(np.diff(pred, axis=-1) >= 0), "calibrated quantiles cross"
    below = (target[..., None] <= pred).mean(axis=(0, 1))  # [Q]
    # the conformal rank leaves each level within 1/n of nominal; the rest allows the graph's float rounding
    moved = ~np.isclose(meta.quantiles, 0.5)  # the median keeps the model's forecast
    np.testing.assert_allclose(below[moved], np.asarray(meta.quantiles)[moved], atol=0.02)
    after = (meta.calibration or {})["coverage_after"]
    np.testing.assert_allclose(below, [after[f"{q:g}"] for q in meta.quantiles], atol=2 / target.shape[0])


def test_offsets_are_added_to_the_uncalibrated_model(ckpt: Path, calibrated: Path,
                                                     validation: dict[str, np.ndarray], tmp_path: Path) -> None:
    """Uncalibrated, then calibrated in one process (the Python API): the trace cache keeps them apart."""
    opts = ExportOptions(checkpoint=ckpt, output=tmp_path / "plain.onnx")
    plain = run_export(opts, log=lambda _: None)
    again = run_export(dataclasses.replace(opts, output=tmp_path / "again.onnx", calibrate=True),
                       log=lambda _: None)
    assert plain.meta.calibration is None and again.meta.calibration is not None
    assert not model_info(load_model(plain.output), LIMITS).HasField("calibration")
    offsets = np.asarray(again.meta.calibration["offsets"], dtype=np.float32)  # [H, Q]
    net = model_from_checkpoint(load_checkpoint(ckpt))
    scale = net.forecast_scale(*(torch.from_numpy(validation[name]) for name in SCALE_INPUTS)
                               ).detach().numpy()  # [W, H, 1]
    shifted = forecast(plain.output, validation) + offsets * scale  # [W, H, Q]: offsets in units of the scale
    uncrossed = np.all(np.diff(shifted, axis=-1) >= 0, axis=(1, 2))  # [W]
    assert uncrossed.mean() > 0.5
    scale = float(np.abs(shifted).max())
    np.testing.assert_allclose(forecast(calibrated, validation)[uncrossed], shifted[uncrossed], rtol=0,
                               atol=1e-5 * scale)
    np.testing.assert_array_equal(forecast(again.output, validation), forecast(calibrated, validation))


def test_the_median_moves_only_when_asked(ckpt: Path, calibrated: Path, validation: dict[str, np.ndarray],
                                          tmp_path: Path) -> None:
    median = list(meta_of(calibrated).quantiles).index(0.5)
    assert not np.asarray((meta_of(calibrated).calibration or {})["offsets"])[:, median].any()
    out = tmp_path / "median.onnx"
    r = run_main(["-m", "export", str(ckpt), str(out), "--calibrate", "--calibrate-median"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert np.asarray((meta_of(out).calibration or {})["offsets"])[:, median].all()
    below = (validation["target"] <= forecast(out, validation)[..., median]).mean()
    assert below == pytest.approx(0.5, abs=0.02)
    alone = run_main(["-m", "export", str(ckpt), str(tmp_path / "alone.onnx"), "--calibrate-median"])
    assert alone.returncode == 2 and "add --calibrate" in alone.stderr


def test_other_bars_are_refused(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = make_bars(tmp_path / "other.parquet", seed=8)
    out = tmp_path / "model.onnx"
    assert main([str(ckpt), str(out), "--calibrate", "--bars", str(other)]) == 2
    err = capsys.readouterr().err
    refusals = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(refusals) == 1 and "not the bars the checkpoint's run trained on" in refusals[0], err
    assert not out.exists()


def test_missing_run_bars_name_the_flag(ckpt: Path, tmp_path: Path) -> None:
    c = {**load_checkpoint(ckpt), "data_source": str(tmp_path / "gone.parquet")}
    with pytest.raises(UsageError, match="pass --bars"):
        validation_data(c, None, {})


def test_model_info_reports_the_calibration(calibrated: Path) -> None:
    loaded = load_model(calibrated)
    info = model_info(loaded, LIMITS)
    cal: dict[str, Any] = loaded.meta.calibration or {}
    assert info.HasField("calibration") and info.calibration.validation_windows == cal["validation_windows"]
    np.testing.assert_allclose(info.calibration.offsets, np.ravel(cal["offsets"]))
    levels = [f"{q:g}" for q in loaded.meta.quantiles]
    assert list(info.calibration.coverage_after) == [cal["coverage_after"][q] for q in levels]
    assert info.calibration.interval_coverage_before == cal["coverage_before"]["interval"]
    assert re.search(r"^calibration\s+cqr on \d+ validation windows", format_model_info(info), re.M)


def test_conformal_rank() -> None:
    assert [conformal_rank(199, q) for q in (0.1, 0.5, 0.9)] == [20, 100, 180]
    assert conformal_rank(5, 0.99) == 5 and conformal_rank(5, 0.01) == 1  # clipped to the residuals there are
