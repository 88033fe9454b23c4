"""Windows by anchor row t, the last encoder bar: encoder rows t-L+1..t, then H decoder steps and row t's
targets. Windows never cross a series boundary nor start in the warm-up."""

from __future__ import annotations

import numpy as np

from features.compute import FeatureFrame, future_timestamps, known_features
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL, TARGET


def anchor_rows(frame: FeatureFrame, encoder_length: int, require_targets: bool = True,
                row_range: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """All valid anchors, int64 [W]. `row_range`: per-series [lo, hi) bounds for the anchor and its targets
    (encoder rows may reach back before `lo`)."""
    horizon = frame.config.horizon
    out = []
    for i, (s, e) in enumerate(frame.series_bounds):
        first = s + frame.config.warmup_bars + encoder_length - 1
        last = e - 1 - (horizon if require_targets else 0)  # inclusive
        if row_range is not None:
            lo, hi = int(row_range[0][i]), int(row_range[1][i])
            first = max(first, lo)
            last = min(last, hi - 1 - (horizon if require_targets else 0))
        if last >= first:
            out.append(np.arange(first, last + 1, dtype=np.int64))
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def gather_windows(frame: FeatureFrame, anchors: np.ndarray, encoder_length: int) -> dict[str, np.ndarray]:
    """Model inputs (canonical names) and targets for the windows ending at `anchors`."""
    horizon = frame.config.horizon
    idx = anchors[:, None] + np.arange(-encoder_length + 1, 1)  # [B, L]
    fut = future_timestamps(frame.timestamp_ns[anchors], frame.bar_interval_ns, horizon)  # [B, H]
    return {
        STATIC_CATEGORICAL: frame.series_id[anchors][:, None].astype(np.int64),  # [B, 1]
        ENCODER_OBSERVED: frame.observed[idx],  # [B, L, n_observed]
        ENCODER_KNOWN: frame.known[idx],  # [B, L, n_known]
        DECODER_KNOWN: known_features(fut, frame.config.calendar_tz),  # [B, H, n_known]
        TARGET: frame.targets[anchors],  # [B, H]
    }

