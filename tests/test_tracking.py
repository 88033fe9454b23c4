"""`--tracking`: a real `python -m trainer` run logged to TensorBoard and read back, the tracker API the backtest
reuses, and the refusals of a spec the run cannot take."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.artifacts import REPO, exit_and_imports, make_bars, run, run_main
from trainer.checkpoint import file_sha256
from trainer.tracking import TrackingError, open_tracker

FLAGS = ("--hidden-size", "8", "--attention-heads", "2", "--encoder-length", "20", "--horizon", "3",
         "--batch-size", "32", "--max-steps-per-epoch", "3", "--max-val-windows", "100", "--threads", "1",
         "--device", "cpu", "--no-progress")


@pytest.fixture(scope="module")
def bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bars(tmp_path_factory.mktemp("tracking") / "bars.parquet")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory, bars: Path) -> tuple[Path, Path]:
    """A 2-epoch run with --tracking tensorboard:DIR: its checkpoint and DIR."""
    work = tmp_path_factory.mktemp("tracked")
    out, tb = work / "run" / "ckpt.pt", work / "tb"
    r = run(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *FLAGS, "--epochs", "2",
             "--tracking", f"tensorboard:{tb}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return out, tb


def read_events(logdir: Path) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> tuple[list[int], list[float]]:
    got = events.Scalars(tag)
    return [e.step for e in got], [e.value for e in got]


def text(events: EventAccumulator, tag: str) -> str:
    """The latest text logged under `tag` (set_tag, log_params)."""
    return str(events.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode())


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.with_suffix(".metrics.jsonl").read_text().splitlines()]


def test_a_tracked_run_logs_each_epochs_figures_as_its_metrics_file_has_them(tracked: tuple[Path, Path]) -> None:
    out, tb = tracked
    events = read_events(tb / "ckpt")  # the run is named after --out's stem
    recs = records(out)
    for tag, value in (("loss/train", lambda r: r["train_loss"]), ("loss/val", lambda r: r["val_loss"]),
                       ("lr", lambda r: r["lr"]), ("val/coverage", lambda r: r["val"]["coverage"]),
                       ("val/pinball_mean", lambda r: r["val"]["pinball_mean"]),
                       ("val/q_risk/0.9", lambda r: r["val"]["q_risk"]["0.9"]),
                       ("baseline/pinball/0.1", lambda r: r["baseline"]["pinball"]["0.1"]),
                       ("memory/train_peak_mib", lambda r: r["peak_memory"]["train"]["bytes"] / 2**20)):
        steps, values = scalars(events, tag)
        assert steps == [1, 2], tag
        np.testing.assert_allclose(values, [value(r) for r in recs], rtol=1e-6, err_msg=tag)  # stored as float32


def test_a_tracked_run_logs_its_config_picture_and_best_checkpoints_sha256(tracked: tuple[Path, Path]) -> None:
    out, tb = tracked
    events = read_events(tb / "ckpt")
    assert text(events, "checkpoint_sha256") == file_sha256(out)
    assert text(events, "best_epoch") == str(min(records(out), key=lambda r: r["val_loss"])["epoch"])
    assert "| hidden_size | `8` |" in text(events, "params")
    (picture,) = events.Images("report")
    height, width, _ = matplotlib.image.imread(out.with_suffix(".report.png")).shape  # the report beside the checkpoint
    assert (picture.width, picture.height) == (width, height)


def test_a_resumed_run_continues_the_same_tracked_run(tmp_path: Path, bars: Path, tracked: tuple[Path, Path]) -> None:
    out, tb = (tmp_path / "run" / "ckpt.pt", tmp_path / "tb")
    shutil.copytree(tracked[0].parent, out.parent)
    shutil.copytree(tracked[1], tb)
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--resume", str(out.with_suffix(".last.pt")), *FLAGS,
                  "--epochs", "3", "--tracking", f"tensorboard:{tb}"])
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_events(tb / "ckpt")
    steps, values = scalars(events, "loss/val")
    assert steps == [1, 2, 3]
    np.testing.assert_allclose(values, [r["val_loss"] for r in records(out)], rtol=1e-6)
    assert text(events, "checkpoint_sha256") == file_sha256(out)


def test_the_tracker_api_logs_a_named_run_for_each_fold(tmp_path: Path) -> None:
    """What the backtest does per fold: a run "name/foldK" with its scores and picture."""
    png = tmp_path / "fold.png"
    matplotlib.image.imsave(png, np.zeros((6, 10, 3)))
    tracker = open_tracker(f"tensorboard:{tmp_path / 'tb'}", "bt/fold2")
    tracker.log_params({"folds": 3})
    tracker.log_metrics({"pinball_ratio/garch": 0.97}, step=2)
    tracker.log_image("scores", png)
    tracker.set_tag("checkpoint_sha256", "ab" * 32)
    tracker.close()
    events = read_events(tmp_path / "tb" / "bt" / "fold2")
    assert scalars(events, "pinball_ratio/garch") == ([2], [pytest.approx(0.97)])
    assert (events.Images("scores")[0].width, events.Images("scores")[0].height) == (10, 6)
    assert text(events, "checkpoint_sha256") == "ab" * 32
    with pytest.raises(TrackingError, match="give tensorboard:DIR"):
        open_tracker("wandb:project", "bt/fold2")


def test_an_mlflow_run_logs_the_same_figures_where_mlflow_is_installed(tmp_path: Path, bars: Path) -> None:
    mlflow = pytest.importorskip("mlflow", reason="MLflow is an optional extra: pip install 'foxhunt-tft[mlflow]'")
    out, uri = tmp_path / "ckpt.pt", f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = subprocess.run([sys.executable, "-m", "trainer", "--parquet", str(bars), "--out", str(out), *FLAGS,
                        "--epochs", "2", "--tracking", f"mlflow:{uri}", "--tracking-run", "tiny"],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=300)  # in tmp_path: MLflow keeps artifacts in ./mlruns
    assert r.returncode == 0, r.stderr[-3000:]
    client = mlflow.MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs(["0"], filter_string="attributes.run_name = 'tiny'")
    history = client.get_metric_history(found.info.run_id, "loss/val")
    assert [(m.step, m.value) for m in history] == [(r["epoch"], r["val_loss"]) for r in records(out)]
    assert found.data.tags["checkpoint_sha256"] == file_sha256(out)
    assert found.data.params["hidden_size"] == "8"
    assert [a.path for a in client.list_artifacts(found.info.run_id, "report")] == ["report/ckpt.report.png"]


@pytest.mark.parametrize(("spec", "line"), [
    ("mlflow:sqlite:///mlflow.db", "error: --tracking mlflow:sqlite:///mlflow.db needs MLflow: pip install "
                                   "'foxhunt-tft[mlflow]'"),
    ("wandb:project", "error: --tracking wandb:project: give tensorboard:DIR"),
    ("tensorboard", "error: --tracking tensorboard: give tensorboard:DIR"),
])
def test_a_spec_the_run_cannot_track_with_exits_2_before_training(tmp_path: Path, bars: Path, spec: str,
                                                                   line: str) -> None:
    if spec.startswith("mlflow") and importlib.util.find_spec("mlflow") is not None:
        pytest.skip("MLflow is installed here, so the run would start")
    out = tmp_path / "ckpt.pt"
    r, last = exit_and_imports("trainer", ["--parquet", str(bars), "--out", str(out), *FLAGS, "--tracking", spec],
                               ("torch",))
    assert last == "exit 2 torch=False", r.stderr[-2000:]  # said before torch's import, let alone training
    assert r.stderr.splitlines() == [r.stderr.splitlines()[0]] and r.stderr.startswith(line), r.stderr
    assert not list(tmp_path.iterdir())  # no checkpoint, nothing else


def test_a_run_without_tracking_imports_no_tracking_backend(tmp_path: Path, bars: Path) -> None:
    r, last = exit_and_imports("trainer", ["--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *FLAGS,
                                           "--epochs", "1", "--no-report"], ("tensorboard", "mlflow"))
    assert last == "exit 0 tensorboard=False mlflow=False", r.stderr[-2000:]
