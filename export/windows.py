"""Real windows for the parity check: the validation sample saved in the checkpoint, or rebuilt from bars."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from export.errors import UsageError
from export.onnx_export import input_names
from features.bars import BarDataError, ColumnMap
from features.compute import build_frame
from features.config import FeatureConfig
from features.series import read_series
from features.windows import anchor_rows, as_fed, model_inputs
from trainer.model_config import ModelConfig

MAX_WINDOWS = 256


def saved_windows(ckpt: dict[str, Any]) -> dict[str, np.ndarray]:
    """The checkpoint's `validation_sample`: real validation windows written by the trainer."""
    sample = {name: tensor.numpy() for name, tensor in ckpt["validation_sample"].items()}
    return as_fed(sample, input_names(ModelConfig.from_dict(ckpt["model_config"])))


def windows_from_bars(path: Path, ckpt: dict[str, Any], cfg: ModelConfig, column_flags: dict[str, str] | None = None,
                      limit: int = MAX_WINDOWS, log: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """Up to `limit` windows spread evenly over the bars, built as training and serving build them. Columns:
    the run's names with `column_flags` over them; symbols the model does not know are skipped and logged.
    Categorical columns take the checkpoint's vocabularies."""
    try:
        feature_config = FeatureConfig.from_dict(ckpt["feature_config"])
        columns = ColumnMap.from_dict({**(ckpt.get("column_map") or {}), **(column_flags or {})})
        bars, _ = read_series(path, columns, feature_config)  # per-contract bars: one continuous series per root
        symbols = [str(s) for s in ckpt["symbols"]]
        slices = bars.series_slices()
        if unknown := [s for s in slices if s not in symbols]:
            known = [s for s in slices if s in symbols]
            if not known:
                raise UsageError(f"--bars {path} holds none of the model's symbols ({', '.join(symbols)}); it holds "
                                 f"{', '.join(unknown)}")
            if log is not None:
                log(f"--bars: skipped {', '.join(unknown)}: not the model's symbols ({', '.join(symbols)})")
            bars = bars.only(known)
        frame = build_frame(bars, feature_config, symbols, int(ckpt["bar_interval_ns"]))
    except BarDataError as exc:
        raise UsageError(f"--bars {exc.summary(str(path), most=5, inline=True)}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--bars {path}: cannot build the model's features: {exc}") from None
    anchors = anchor_rows(frame, cfg.encoder_length, require_targets=False)
    if anchors.size == 0:
        raise UsageError(f"--bars {path}: no complete window; each needs {feature_config.warmup_bars} warm-up bars "
                         f"plus {cfg.encoder_length} encoder bars of one symbol")
    pick = anchors[np.unique(np.linspace(0, anchors.size - 1, min(limit, anchors.size)).astype(np.int64))]
    return model_inputs(frame, pick, cfg.encoder_length)
