"""Checked request columns -> model inputs, with the trainer's own feature code (`features.latest_windows`,
bit for bit): no training/serving skew."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from features.bars import block_for
from features.compute import latest_windows
from features.model_meta import ModelMeta
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL
from serving.errors import RequestError
from serving.validation import BAR_COLUMNS, SeriesColumns


@dataclass
class Prepared:
    """Model inputs of windows (one per series) and what the response needs, row-aligned."""

    symbols: list[str]  # [B]
    inputs: dict[str, np.ndarray]  # canonical input name -> [B, ...]
    last_timestamp_ns: np.ndarray  # int64 [B]
    last_close: np.ndarray  # float64 [B]
    future_timestamp_ns: np.ndarray  # int64 [B, H]
    encoder_timestamp_ns: np.ndarray  # int64 [B, L]

    def rows(self, start: int, stop: int) -> Prepared:
        return Prepared(self.symbols[start:stop], {k: v[start:stop] for k, v in self.inputs.items()},
                        self.last_timestamp_ns[start:stop], self.last_close[start:stop],
                        self.future_timestamp_ns[start:stop], self.encoder_timestamp_ns[start:stop])


def prepare(series: Sequence[SeriesColumns], meta: ModelMeta) -> Prepared:
    """Model inputs for the window ending at each validated series' last bar (its last bars_required bars)."""
    n = meta.bars_required
    names = tuple(meta.feature_config.user_columns)
    user: np.ndarray | list[np.ndarray]
    if len(series) == 1:  # a lone series: [1, n] views of its columns, no copies
        s = series[0]
        ts, o, h, lo, c, v = (getattr(s, name)[None, -n:] for name in BAR_COLUMNS)
        block = block_for(s.user, names)
        user = block[:, -n:] if block is not None else [s.user[u][-n:] for u in names]
    else:  # [B, n] each; the user columns as one [columns, B * n] block, joined once
        ts, o, h, lo, c, v = (np.stack([getattr(s, name)[-n:] for s in series]) for name in BAR_COLUMNS)
        user = np.concatenate([s.user_matrix(names)[:, -n:] for s in series], axis=1) if names else []
    with np.errstate(all="ignore"):  # overflowing features (inf, NaN) are the caller's: nonfinite_problem names them
        # nominal future bar times from the model's bar interval, exactly as in training
        w = latest_windows(ts, o, h, lo, c, v, user, meta.feature_config, meta.encoder_length, meta.bar_interval_ns)
    index = meta.symbol_index
    static = np.array([[index[s.symbol]] for s in series], dtype=np.int64)  # [B, 1]
    return Prepared(
        symbols=[s.symbol for s in series],
        inputs={STATIC_CATEGORICAL: static, ENCODER_OBSERVED: w.encoder_observed, ENCODER_KNOWN: w.encoder_known,
                DECODER_KNOWN: w.decoder_known},
        last_timestamp_ns=ts[:, -1],
        last_close=c[:, -1],
        future_timestamp_ns=w.future_timestamp_ns,
        encoder_timestamp_ns=ts[:, n - meta.encoder_length:],
    )


def nonfinite_problem(prepared: Prepared, series: Sequence[SeriesColumns], meta: ModelMeta) -> RequestError | None:
    """Features the model would get as NaN or inf (e.g. a price jump overflowing a log): the caller's to fix."""
    for name, names in ((ENCODER_OBSERVED, meta.feature_schema.observed), (ENCODER_KNOWN, meta.feature_schema.known)):
        x = prepared.inputs[name]  # [B, L, V]
        if np.isfinite(x).all():
            continue
        b, t, v = (int(i[0]) for i in np.nonzero(~np.isfinite(x)))
        bar = len(series[b]) - meta.encoder_length + t
        return RequestError(f"series[{b}] ({series[b].symbol}): feature {names[v]!r} is not finite at bar {bar} "
                            "of the bars used (the last bars_required): a value beyond float32's range (about "
                            "3.4e38) or a price jump that overflows; check the bars around it", f"series[{b}]")
    return None
