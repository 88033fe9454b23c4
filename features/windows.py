"""Windows by anchor row t, the last encoder bar: encoder rows t-L+1..t, then H decoder steps and row t's
targets. Windows never cross a series boundary nor start in the warm-up."""

from __future__ import annotations

import numpy as np

from features.calendar import DayOffsets
from features.compute import FeatureFrame
from features.known import future_known
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    STATIC_CATEGORICAL,
    STATIC_REAL,
    TARGET,
)


def anchor_rows(frame: FeatureFrame, encoder_length: int, require_targets: bool = True,
                row_range: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """All valid anchors, int64 [W]. `row_range`: per-series [lo, hi) bounds for the anchor and its targets
    (encoder rows may reach back before `lo`)."""
    horizon = frame.config.horizon
    require_targets = require_targets or bool(frame.config.known_columns)  # the decoder reads H future rows
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
    idx = anchors[:, None] + np.arange(-encoder_length + 1, 1)  # [B, L]
    out = {
        STATIC_CATEGORICAL: static_categorical(frame, anchors),  # [B, n_static_cat]
        ENCODER_OBSERVED: frame.observed[idx],  # [B, L, n_observed]
        ENCODER_KNOWN: frame.known[idx],  # [B, L, n_known]
        DECODER_KNOWN: decoder_known(frame, anchors),  # [B, H, n_known]
        TARGET: frame.targets[anchors],  # [B, H]
    }
    if frame.static_real is not None:
        out[STATIC_REAL] = frame.static_real[anchors]  # [B, n_static_real]
    return out


def static_categorical(frame: FeatureFrame, anchors: np.ndarray) -> np.ndarray:
    """int64 [B, n_static_cat]: each window's symbol id, then its user static categoricals' ids."""
    symbol = frame.series_id[anchors][:, None].astype(np.int64)  # [B, 1]
    return symbol if frame.static_ids is None else np.concatenate([symbol, frame.static_ids[anchors]], axis=1)


def decoder_known(frame: FeatureFrame, anchors: np.ndarray, offsets: DayOffsets | None = None) -> np.ndarray:
    """float32 [B, H, n_known]: `future_known` of the windows ending at `anchors`, with the user known variables of
    the H rows after each anchor (anchor_rows keeps them inside the series)."""
    user = None
    if frame.config.known_columns:
        rows = anchors[:, None] + np.arange(1, frame.config.horizon + 1)  # [B, H]
        user = frame.user_known[rows]  # [B, H, n_known_user]
    roots = np.asarray(frame.symbols)[frame.series_id[anchors]]  # [B]  a contract model's symbols are its roots
    return future_known(frame.timestamp_ns[anchors], frame.config, frame.bar_interval_ns, roots, user, offsets)
