"""Checked request columns -> model inputs, with the trainer's own feature code (`features.latest_windows`,
bit for bit): no training/serving skew."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from features.bars import block_for
from features.categories import unseen_note
from features.compute import encode_labels, latest_windows
from features.model_meta import ModelMeta
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL, STATIC_REAL
from features.text import listed
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
    # [B]: what each window's forecast adds to Forecast.warnings (labels unseen in training); () each for a
    # model without categorical user features
    notes: list[tuple[str, ...]]

    def rows(self, start: int, stop: int) -> Prepared:
        return Prepared(self.symbols[start:stop], {k: v[start:stop] for k, v in self.inputs.items()},
                        self.last_timestamp_ns[start:stop], self.last_close[start:stop],
                        self.future_timestamp_ns[start:stop], self.encoder_timestamp_ns[start:stop],
                        self.notes[start:stop])


def prepare(series: Sequence[SeriesColumns], meta: ModelMeta) -> Prepared:
    """Model inputs for the window ending at each validated series' last bar (its last bars_required bars)."""
    n = meta.bars_required
    config = meta.feature_config
    coded = [encode_series(s, meta) for s in series] if config.categorical_columns else None
    user: np.ndarray | list[np.ndarray]
    if len(series) == 1:  # a lone series: [1, n] views of its columns, no copies
        s = series[0]
        ts, o, h, lo, c, v = (getattr(s, name)[None, -n:] for name in BAR_COLUMNS)
    else:  # [B, n] each
        ts, o, h, lo, c, v = (np.stack([getattr(s, name)[-n:] for s in series]) for name in BAR_COLUMNS)
    if coded is None:
        user = _observed_reals(series, config.user_columns, n)
    else:  # reals, then categorical ids: [n_observed_user, B * n]
        user = [np.concatenate(rows) for rows in zip(*(x.observed for x in coded), strict=True)]
    known, future_known = _known_blocks(series, coded, meta) if config.known_columns else (None, None)
    with np.errstate(all="ignore"):  # overflowing features (inf, NaN) are the caller's: nonfinite_problem names them
        # future bar times within each series' trading hours, exactly as in training
        w = latest_windows(ts, o, h, lo, c, v, user, config, meta.encoder_length, meta.bar_interval_ns,
                           known=known, future_user=future_known, log_offset=_log_offsets(series, n),
                           roots=[s.root or s.symbol for s in series])
    index = meta.symbol_index
    static = np.array([[index[s.root or s.symbol]] for s in series], dtype=np.int64)  # [B, 1]
    if config.static_categoricals:
        static = np.concatenate([static, np.array([x.static for x in coded or ()], dtype=np.int64)], axis=1)
    inputs = {STATIC_CATEGORICAL: static, ENCODER_OBSERVED: w.encoder_observed, ENCODER_KNOWN: w.encoder_known,
              DECODER_KNOWN: w.decoder_known}
    if config.static_reals:  # [B, n_static_real], float64 -> float32 as in training
        inputs[STATIC_REAL] = np.array([[s.static_reals[u] for u in config.static_reals] for s in series],
                                       dtype=np.float64).astype(np.float32)
    return Prepared(
        symbols=[s.symbol for s in series],
        inputs=inputs,
        last_timestamp_ns=ts[:, -1],
        last_close=c[:, -1],
        future_timestamp_ns=w.future_timestamp_ns,
        encoder_timestamp_ns=ts[:, n - meta.encoder_length:],
        notes=[s.notes + (coded[b].notes if coded is not None else ()) for b, s in enumerate(series)],
    )


def _log_offsets(series: Sequence[SeriesColumns], n: int) -> np.ndarray | None:
    """float64 [B, n]: the roll offsets of the last n bars (0 for a series without rolls); None when no series has
    any (adding 0 to a log changes nothing, so a batch may mix both)."""
    if all(s.log_offset is None for s in series):
        return None
    return np.stack([np.zeros(n) if s.log_offset is None else s.log_offset[-n:] for s in series])


def _observed_reals(series: Sequence[SeriesColumns], names: tuple[str, ...], n: int
                    ) -> np.ndarray | list[np.ndarray]:
    """The observed real user columns of the last n bars: [n_user, B * n], or [n] columns of a lone series."""
    if len(series) == 1:  # views of the lone series' columns, no copies
        s = series[0]
        block = block_for(s.user, names)
        return block[:, -n:] if block is not None else [s.user[u][-n:] for u in names]
    return np.concatenate([s.user_matrix(names)[:, -n:] for s in series], axis=1) if names else []


@dataclass
class Encoded:
    """One series' user variables of the model's roles, categoricals as ids (float64, exact), and its notes."""

    observed: list[np.ndarray]  # config.observed_user order: float64 [n] each
    known: list[np.ndarray]  # config.known_user order: float64 [n] each
    future: list[np.ndarray]  # config.known_user order: float64 [H] each
    static: list[int]  # config.static_categoricals order: ids
    notes: tuple[str, ...]  # labels unseen in training, as Forecast.warnings says them


def encode_series(s: SeriesColumns, meta: ModelMeta) -> Encoded:
    """The series' user variables with each label encoded in the model's vocabulary (unseen: the unknown id 0).
    Notes name the unseen labels among the values the model reads: the encoder bars, the future bars, statics."""
    config, n, L = meta.feature_config, meta.bars_required, meta.encoder_length
    per_bar = {name: np.concatenate([s.labels[name][-n:], s.future_labels.get(name, s.labels[name][:0])])
               for name in config.series_categoricals}  # [n], a known categorical's future bars' too: [n + H]
    labels = per_bar | {name: np.array([s.static_labels[name]]) for name in config.static_categoricals}
    ids, unseen = encode_labels(labels, config)
    read = {name: slice(n - L, None) if name in per_bar else slice(None) for name in labels}  # what the model reads

    def values(name: str) -> np.ndarray:
        return ids[name][:n].astype(np.float64) if name in per_bar else np.asarray(s.user[name][-n:], dtype=np.float64)

    return Encoded(observed=[values(u) for u in config.observed_user], known=[values(u) for u in config.known_user],
                   future=[ids[u][n:].astype(np.float64) if u in per_bar else s.future[u] for u in config.known_user],
                   static=[int(ids[name][0]) for name in config.static_categoricals],
                   notes=tuple(unseen_note({k: unseen[k][r] for k, r in read.items()},
                                           {k: labels[k][r] for k, r in read.items()})))


def _known_blocks(series: Sequence[SeriesColumns], coded: list[Encoded] | None, meta: ModelMeta
                  ) -> tuple[np.ndarray, np.ndarray]:
    """float64 [B, n, n_known_user] and [B, H, n_known_user]: the known user variables of the bars and of the
    future bars (config.known_user order; categoricals as ids)."""
    n, names = meta.bars_required, meta.feature_config.known_user
    if coded is None:  # known reals only
        known = np.stack([np.stack([s.user[u][-n:] for u in names], axis=-1) for s in series])
        return known, np.stack([np.stack([s.future[u] for u in names], axis=-1) for s in series])
    return (np.stack([np.stack(x.known, axis=-1) for x in coded]),
            np.stack([np.stack(x.future, axis=-1) for x in coded]))


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


FAR_SDS = 1e3  # standard deviations from the training mean: orders of magnitude outside the training range


def far_inputs(prepared: Prepared, b: int, meta: ModelMeta) -> list[str]:
    """The input variables of window b with a value FAR_SDS or more training standard deviations from their
    training mean (ModelMeta.input_stats), furthest first; [] for a model exported without the statistics."""
    schema, stats = meta.feature_schema, meta.input_stats
    blocks = (("observed", schema.observed, (ENCODER_OBSERVED,)),
              ("known", schema.known, (ENCODER_KNOWN, DECODER_KNOWN)), ("static", schema.static_reals, (STATIC_REAL,)))
    far: dict[str, float] = {}
    for key, names, inputs in blocks:
        if key not in stats or not names:
            continue
        mean, std = np.asarray(stats[key]["mean"]), np.asarray(stats[key]["std"])  # [V] each
        for name in inputs:
            x = prepared.inputs[name][b].reshape(-1, len(names)).astype(np.float64)  # [steps, V]
            sds = (np.abs(x - mean) / std).max(axis=0)  # [V]; the inputs are finite (nonfinite_problem)
            for v in np.flatnonzero(sds >= FAR_SDS):
                far[names[v]] = max(far.get(names[v], 0.0), float(sds[v]))
    return sorted(far, key=lambda n: -far[n])


def nonfinite_output_problem(prepared: Prepared, b: int, series: SeriesColumns, output: str, meta: ModelMeta
                             ) -> RequestError:
    """Why series b drives the model's `output` to NaN or inf: its inputs far outside the training range, if any."""
    far = far_inputs(prepared, b, meta)
    culprits = (f"input(s) {listed(far)} lie orders of magnitude (over {FAR_SDS:g} standard deviations) outside "
                "the training range; check those columns" if far else "their features are far outside the range "
                "the model was trained on; check the bars for extreme prices, volumes or user-feature values")
    return RequestError(f"series[{b}] ({series.symbol}): the model's output {output!r} is not finite for these "
                        f"bars: {culprits}", f"series[{b}]")
