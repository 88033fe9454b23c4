"""Checked request columns -> model inputs, with the trainer's own feature code.

The bars become a `features.Bars`, then `build_frame` with the model's FeatureConfig and
symbol vocabulary, then `gather_windows` at each series' last bar — the same functions
training used — so there is no training/serving skew. The one serving-side choice is the
bar interval of the decoder's calendar features: the model's (from its metadata), as in
training, not one inferred from a request's few bars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from features.bars import Bars, ColumnBlock, block_for
from features.compute import build_frame, future_timestamps
from features.model_meta import ModelMeta
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, MODEL_INPUTS, STATIC_CATEGORICAL
from features.windows import gather_windows, last_anchor_per_series
from serving.errors import RequestError
from serving.validation import SeriesColumns

INPUT_DTYPES: dict[str, type[np.generic]] = {
    STATIC_CATEGORICAL: np.int64,
    ENCODER_OBSERVED: np.float32,
    ENCODER_KNOWN: np.float32,
    DECODER_KNOWN: np.float32,
}


@dataclass
class Prepared:
    """Model inputs of windows (one per series) and what the response needs, row-aligned."""

    symbols: list[str]  # [B]
    inputs: dict[str, np.ndarray]  # canonical input name -> [B, ...]
    last_timestamp_ns: np.ndarray  # int64 [B]
    last_close: np.ndarray  # float64 [B]
    future_timestamp_ns: np.ndarray  # int64 [B, H]
    encoder_timestamp_ns: np.ndarray  # int64 [B, L]

    def __len__(self) -> int:
        return len(self.symbols)

    def rows(self, start: int, stop: int) -> Prepared:
        return Prepared(self.symbols[start:stop], {k: v[start:stop] for k, v in self.inputs.items()},
                        self.last_timestamp_ns[start:stop], self.last_close[start:stop],
                        self.future_timestamp_ns[start:stop], self.encoder_timestamp_ns[start:stop])


def to_bars(series: Sequence[SeriesColumns], keys: Sequence[str], user_columns: Sequence[str]) -> Bars:
    """One Bars of all series, rows grouped by series in time order; `keys[i]` is series i's unique symbol key."""
    names = tuple(user_columns)
    if len(series) == 1:  # a lone series: its columns as they are, no copies
        s = series[0]
        lone: Mapping[str, np.ndarray] = s.user if block_for(s.user, names) is not None else {
            u: s.user[u] for u in names}
        return Bars(s.timestamp_ns, np.full(len(s), keys[0], dtype=object), s.open, s.high, s.low, s.close,
                    s.volume, lone)
    user: Mapping[str, np.ndarray] = {}
    if names:  # one [columns, bars] block per series, joined once: not one join per column
        user = ColumnBlock(names, np.concatenate([s.user_matrix(names) for s in series], axis=1))
    return Bars(
        timestamp_ns=np.concatenate([s.timestamp_ns for s in series]),
        symbol=np.repeat(np.array(keys, dtype=object), [len(s) for s in series]),
        open=np.concatenate([s.open for s in series]),
        high=np.concatenate([s.high for s in series]),
        low=np.concatenate([s.low for s in series]),
        close=np.concatenate([s.close for s in series]),
        volume=np.concatenate([s.volume for s in series]),
        user=user,
    )


def _keys_and_vocab(series: Sequence[SeriesColumns], symbols: Sequence[str]) -> tuple[list[str], list[str], np.ndarray]:
    """Unique grouping keys for the series, the vocabulary to pass build_frame, and key id -> symbol id.

    A batch may hold the same symbol several times (one per call). `Bars` groups rows by
    symbol, so each repeat gets an alias key appended to the vocabulary; its windows'
    static symbol id is mapped back to the real symbol's id. No feature value depends on
    the symbol's name or id, so this is exact.
    """
    vocab = list(symbols)
    to_symbol_id = list(range(len(vocab)))
    index = {s: i for i, s in enumerate(vocab)}
    seen: dict[str, int] = {}
    keys = []
    for s in series:
        k = seen.get(s.symbol, 0)
        seen[s.symbol] = k + 1
        key = s.symbol if k == 0 else f"{s.symbol}\x1f{k}"  # \x1f cannot appear in a request's symbol (unit sep.)
        if k:
            vocab.append(key)
            to_symbol_id.append(index[s.symbol])
        keys.append(key)
    return keys, vocab, np.asarray(to_symbol_id, dtype=np.int64)


def prepare(series: Sequence[SeriesColumns], meta: ModelMeta) -> Prepared:
    """Model inputs for the window ending at each series' last bar (series already validated)."""
    keys, vocab, to_symbol_id = _keys_and_vocab(series, meta.symbols)
    bars = to_bars(series, keys, meta.feature_config.user_columns)
    with np.errstate(all="ignore"):  # overflowing features (inf, NaN) are the caller's: nonfinite_problem names them
        # nominal future bar times from the model's bar interval, exactly as in training
        frame = build_frame(bars, meta.feature_config, symbols=vocab, bar_interval_ns=meta.bar_interval_ns,
                            targets=False)
    anchors = last_anchor_per_series(frame)  # [B]  in series order
    windows = gather_windows(frame, anchors, meta.encoder_length)
    inputs = {name: np.ascontiguousarray(windows[name], dtype=INPUT_DTYPES[name]) for name in MODEL_INPUTS}
    inputs[STATIC_CATEGORICAL] = to_symbol_id[inputs[STATIC_CATEGORICAL]]  # [B, 1] aliases -> symbol ids
    L = meta.encoder_length
    return Prepared(
        symbols=[s.symbol for s in series],
        inputs=inputs,
        last_timestamp_ns=frame.timestamp_ns[anchors],
        last_close=frame.close[anchors],
        future_timestamp_ns=future_timestamps(frame.timestamp_ns[anchors], meta.bar_interval_ns, meta.horizon),
        encoder_timestamp_ns=frame.timestamp_ns[anchors[:, None] + np.arange(-L + 1, 1)],
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
                            "of the bars used (the last bars_required); check the bars around it")
    return None
