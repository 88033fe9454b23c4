"""Experiment tracking: a run's parameters, per-step figures, pictures and tags, sent to TensorBoard or MLflow.

`tensorboard:DIR` writes event files under DIR/NAME; `mlflow:URI` logs a run named NAME at the MLflow tracking
URI (a server such as http://host:5000, or a database such as sqlite:///mlflow.db). Each backend is an optional
extra of the package, imported only when a run asks for it; torch-free until then.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("trainer")

BACKENDS = {"tensorboard": ("tensorboard", "TensorBoard"), "mlflow": ("mlflow", "MLflow")}  # scheme: (module, name)


class TrackingError(ValueError):
    """A tracking spec with an unknown scheme, or whose backend is not installed; the message is one line."""


def check_spec(spec: str) -> tuple[str, str]:
    """`scheme:target` -> (scheme, target); TrackingError for a bad spec or a backend not installed (not imported)."""
    scheme, _, target = spec.partition(":")
    if scheme not in BACKENDS or not target:
        raise TrackingError(f"--tracking {spec}: give tensorboard:DIR (event files under DIR/NAME) or mlflow:URI "
                            "(a run named NAME at that MLflow tracking URI)")
    module, name = BACKENDS[scheme]
    if importlib.util.find_spec(module) is None:
        raise TrackingError(f"--tracking {spec} needs {name}: pip install 'foxhunt-tft[{scheme}]'")
    return scheme, target


def open_tracker(spec: str, run_name: str) -> Tracker:
    """The tracker a spec names, its run called `run_name` ("/" nests: "name/fold1"). A TensorBoard run dir that
    exists is appended to, so a resumed run continues its curves."""
    scheme, target = check_spec(spec)
    return TensorBoardTracker(Path(target) / run_name) if scheme == "tensorboard" else MLflowTracker(target, run_name)


class TensorBoardTracker:
    """Event files in `logdir` by torch's SummaryWriter, flushed after each step so a killed run keeps them."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if any(logdir.glob("events.out.tfevents.*")):
            log.info("tracking: appending to the TensorBoard run %s (a resumed run continues its curves; another "
                     "run's would mix with them: give it another run name)", logdir)
        self.writer = SummaryWriter(log_dir=str(logdir))

    def log_params(self, params: Mapping[str, Any]) -> None:
        rows = "".join(f"| {k} | `{v}` |\n" for k, v in params.items())
        self.writer.add_text("params", "| name | value |\n|---|---|\n" + rows)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_image(self, name: str, png: Path) -> None:
        import matplotlib.image

        self.writer.add_image(name, matplotlib.image.imread(png), dataformats="HWC")  # [H, W, RGBA] in [0, 1]
        self.writer.flush()

    def set_tag(self, name: str, value: str) -> None:
        self.writer.add_text(name, value)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """A run named `run_name` in MLflow's active experiment at `uri`; ended (FINISHED) by close."""

    def __init__(self, uri: str, run_name: str) -> None:
        import mlflow

        self.mlflow = mlflow
        try:
            mlflow.set_tracking_uri(uri)
            self.run = mlflow.start_run(run_name=run_name)
        except mlflow.exceptions.MlflowException as exc:  # e.g. no server at the URI
            raise TrackingError(f"--tracking mlflow:{uri}: {str(exc).splitlines()[0]}") from None

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.mlflow.log_params({k: str(v) for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics(dict(metrics), step=step)

    def log_image(self, name: str, png: Path) -> None:
        self.mlflow.log_artifact(str(png), artifact_path=name)  # the picture at NAME/<its file name>

    def set_tag(self, name: str, value: str) -> None:
        self.mlflow.set_tag(name, value)

    def close(self) -> None:
        self.mlflow.end_run()


Tracker = TensorBoardTracker | MLflowTracker  # where a run's figures go; the trainer's steps are epochs


def forecast_scalars(prefix: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    """features.metrics.forecast_metrics as flat scalars: PREFIX/pinball_mean, PREFIX/pinball/Q, PREFIX/q_risk/Q
    (left out where undefined: every target 0) and PREFIX/coverage (of the outer interval)."""
    out = {f"{prefix}/pinball_mean": float(metrics["pinball_mean"]), f"{prefix}/coverage": float(metrics["coverage"])}
    out.update({f"{prefix}/pinball/{q}": float(v) for q, v in metrics["pinball"].items()})
    out.update({f"{prefix}/q_risk/{q}": float(v) for q, v in metrics["q_risk"].items() if v is not None})
    return out


def epoch_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The figures of one trainer epoch (a line of the metrics JSONL) that a tracker logs at step = epoch."""
    peak = record["peak_memory"]
    return {"loss/train": float(record["train_loss"]), "loss/val": float(record["val_loss"]), "lr": float(record["lr"]),
            **forecast_scalars("val", record["val"]), **forecast_scalars("baseline", record["baseline"]),
            "memory/train_peak_mib": peak["train"]["bytes"] / 2**20,
            "memory/val_peak_mib": peak["val"]["bytes"] / 2**20,
            "speed/windows_per_second": float(record["windows_per_second"])}
