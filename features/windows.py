"""Windows by anchor row t, the last encoder bar: encoder rows t-L+1..t, then H decoder steps and row t's
targets. Windows never cross a series boundary nor start in the warm-up."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from features.calendar import DayOffsets
from features.compute import FeatureFrame
from features.known import future_known
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL, STATIC_REAL, TARGET


def anchor_rows(frame: FeatureFrame, encoder_length: int, require_targets: bool = True,
                row_range: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """All valid anchors, int64 [W]. `row_range`: per-series [lo, hi) bounds for the anchor and its targets
    (encoder rows may reach back before `lo`)."""
    # rows after the anchor it reads: its targets, and a decoder's known values
    ahead = frame.config.horizon if require_targets or frame.config.known_columns else 0
    out = [np.empty(0, dtype=np.int64)]
    for i, (s, e) in enumerate(frame.series_bounds):
        first, last = s + frame.config.warmup_bars + encoder_length - 1, e - 1 - ahead  # last inclusive
        if row_range is not None:
            first, last = max(first, int(row_range[0][i])), min(last, int(row_range[1][i]) - 1 - ahead)
        if last >= first:
            out.append(np.arange(first, last + 1, dtype=np.int64))
    return np.concatenate(out)


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


def _in_range(ts: np.ndarray, start_ns: int | None, end_ns: int | None) -> np.ndarray:
    """Which of the times `ts` lie in [start_ns, end_ns): bool, ts's shape."""
    lo = np.iinfo(np.int64).min if start_ns is None else start_ns
    hi = np.iinfo(np.int64).max if end_ns is None else end_ns
    return (ts >= lo) & (ts < hi)


def origins(frame: FeatureFrame, encoder_length: int, start_ns: int | None, end_ns: int | None) -> np.ndarray:
    """Every anchor (window end) with its warm-up and encoder bars, in [start_ns, end_ns): int64 [W]. A model
    with known features also needs the H bars after it, whose known values its decoder reads."""
    anchors = anchor_rows(frame, encoder_length, require_targets=False)
    return anchors[_in_range(frame.timestamp_ns[anchors], start_ns, end_ns)]


def origins_without_future(frame: FeatureFrame, encoder_length: int, start_ns: int | None,
                           end_ns: int | None) -> dict[str, int]:
    """Per symbol, the origins in range that a model with known features cannot forecast: those within H bars
    of their series' end, where the file holds no future known values. Empty for a model without them."""
    if not frame.config.known_columns:
        return {}
    h, out = frame.config.horizon, {}
    for s, e in frame.series_bounds:
        first = max(s + frame.config.warmup_bars + encoder_length - 1, e - h)
        if n := int(_in_range(frame.timestamp_ns[first:e], start_ns, end_ns).sum()):
            out[frame.symbols[int(frame.series_id[s])]] = n
    return out


def flagged_in_windows(flag: np.ndarray, anchors: np.ndarray, rows: int) -> np.ndarray:
    """How many of the `rows` rows ending at each anchor are flagged (flag: bool [N]). int64 [W]."""
    count = np.zeros(flag.shape[0] + 1, dtype=np.int64)
    np.cumsum(flag, out=count[1:])
    return np.asarray(count[anchors + 1] - count[anchors - rows + 1])


def model_inputs(frame: FeatureFrame, anchors: np.ndarray, encoder_length: int) -> dict[str, np.ndarray]:
    """The windows ending at `anchors` as the model takes them, its own inputs (schema.model_inputs)."""
    return as_fed(gather_windows(frame, anchors, encoder_length), frame.schema.model_inputs)


def as_fed(windows: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The inputs `names` of `windows` as the model takes them, C-contiguous: ids int64, the rest float32 with
    warm-up NaN as zero, as in training."""
    return {name: np.ascontiguousarray(windows[name], dtype=np.int64) if name == STATIC_CATEGORICAL else
            np.ascontiguousarray(np.nan_to_num(np.asarray(windows[name], dtype=np.float32), nan=0.0)) for name in names}


def read_span(frame: FeatureFrame, anchors: np.ndarray, encoder_length: int,
              name: str) -> tuple[np.ndarray, np.ndarray]:
    """The first and last row whose value of user column `name` each window reads: int64 [W] each. A static
    column is read at the anchor; the others over the encoder bars, and a known one over the H bars after them."""
    fc = frame.config
    if name in fc.static_columns:
        return anchors, anchors
    return anchors - encoder_length + 1, anchors + (fc.horizon if name in fc.known_columns else 0)
