"""What a request may hold, checked on the decoded message before any array is built: the length and the
characters of every name and label, the columns per field, and each column's count of values (one per bar sent,
or one per future bar). Each breach is a RequestError naming the field, the limit and the value.

Names and labels are compared exactly as sent: no Unicode folding, so `ESM４` (a full-width digit) is not ESM4,
and a contract name's year is ASCII digits (`features.contracts`)."""

from __future__ import annotations

from collections.abc import Sequence

from features.text import bounded
from serving.errors import RequestError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb

MAX_TEXT_CHARS = 64  # a symbol, a contract name, a column name, a label
MAX_COLUMNS = 1024  # columns in one field of a series (user_features, categorical_features, static_features, ...)
TEXT_CHUNK = 4096  # names or labels checked at a time
TEXT_RULE = (f"at most {MAX_TEXT_CHARS} printable characters (no NUL, control or format characters), compared "
             "exactly as sent")


def check_series_fields(series: pb.Series, i: int, horizon: int) -> None:
    """Every name and label of series i within the text rule, every field within MAX_COLUMNS, and every column of
    every role with its count of values, the model's columns or not."""
    _check_texts([series.symbol], f"series[{i}]", "symbol", "symbol")
    label = f"series[{i}] ({series.symbol})"
    bars = len(series.timestamp_ns)
    per_bar, per_future = "one per bar sent (len(timestamp_ns))", "one per future bar (GetModelInfo.horizon)"
    for name, columns, count, unit, per in (
            ("user_features", series.user_features, bars, "value", per_bar),
            ("categorical_features", series.categorical_features, bars, "label", per_bar),
            ("future_features", series.future_features, horizon, "value", per_future),
            ("future_categorical_features", series.future_categorical_features, horizon, "label", per_future)):
        _check_column_count(label, i, name, len(columns))
        _check_texts([c.name for c in columns], label, f"series[{i}].{name}", f"{name} column name")
        for column in columns:
            if (k := len(column.values)) != count:
                raise RequestError(f"{label}: {name} column {bounded(column.name)} has {k} {unit}s; it needs "
                                   f"exactly {count} {unit}s, {per}", f"series[{i}].{name}")
            if isinstance(column, pb.Labels):
                _check_texts(column.values, label, f"series[{i}].{name}", f"{name} {bounded(column.name)} label")
    _check_column_count(label, i, "user_feature_names", len(series.user_feature_names))
    _check_texts(series.user_feature_names, label, f"series[{i}].user_feature_names", "user feature name")
    for name, mapping in (("static_features", series.static_features),
                          ("static_categorical_features", series.static_categorical_features)):
        _check_column_count(label, i, name, len(mapping))
        _check_texts(list(mapping), label, f"series[{i}].{name}", f"{name} column name")
    _check_texts(list(series.static_categorical_features.values()), label,
                 f"series[{i}].static_categorical_features", "static_categorical_features label")
    if series.contracts:
        if (k := len(series.contracts)) != bars:
            raise RequestError(f"{label}: contracts has {k} names, timestamp_ns has {bars} bars; send one contract "
                               "name per bar (or none: the bars are then one continuous series)",
                               f"series[{i}].contracts")
        _check_texts(series.contracts, label, f"series[{i}].contracts", "contract name")


def _check_column_count(label: str, i: int, name: str, k: int) -> None:
    if k > MAX_COLUMNS:
        raise RequestError(f"{label}: {name} holds {k} columns; the limit is {MAX_COLUMNS} per field "
                           "(GetModelInfo.max_columns): send the model's columns (GetModelInfo.features)",
                           f"series[{i}].{name}")


def _check_texts(values: Sequence[str], label: str, field: str, what: str) -> None:
    """Each of `values` within the text rule, TEXT_CHUNK at a time: a pass over their lengths and one over their
    characters, with at most a chunk of them as Python strings at once (a short one costs about 50 bytes)."""
    for start in range(0, len(values), TEXT_CHUNK):
        part = values[start:start + TEXT_CHUNK]
        if max(map(len, part)) > MAX_TEXT_CHARS:
            at, bad = next((start + k, v) for k, v in enumerate(part) if len(v) > MAX_TEXT_CHARS)
            raise RequestError(f"{label}: {_which(what, at, len(values))} {bad[:16]!r}... is {len(bad)} characters; "
                               f"the limit is {MAX_TEXT_CHARS} (GetModelInfo.max_text_chars): send names and labels "
                               f"of {TEXT_RULE}", field)
        if not "".join(part).isprintable():
            at, bad = next((start + k, v) for k, v in enumerate(part) if not v.isprintable())
            char = next(ch for ch in bad if not ch.isprintable())
            raise RequestError(f"{label}: {_which(what, at, len(values))} {bounded(bad, 16)} holds U+{ord(char):04X}, "
                               f"which is not printable: send names and labels of {TEXT_RULE}", field)


def _which(what: str, at: int, count: int) -> str:
    return f"{what} (value {at})" if count > 1 else what

