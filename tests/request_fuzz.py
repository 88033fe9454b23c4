"""Mutated Predict requests in every field of Series and PredictRequest, and a runner that sends them to a live
server and collects what a hardened server must show after them.

A Target is a model with valid requests of it (each answered OK). `mutants(target, ops)` is a hypothesis strategy:
a valid request with one or more mutations, each of one field: the symbol; timestamp_ns; open, high, low, close and
volume; user_features (Column names and values); user_feature_names with user_features_raw; future_features;
categorical_features; future_categorical_features (Labels names and values); static_features and
static_categorical_features (map keys and values); contracts; explain; request_id; the series list itself; and
strings that are no UTF-8 in any string field (patched into the serialised bytes: protobuf does not let a str
hold them). The values are the hostile ones: labels and names with NUL suffixes, full-width and Arabic-Indic digits
(ESM４, ESM٤), control characters, bidi overrides, empty strings; columns sent twice or of a model that does not use
them, with no values; value lists of 0, n - 1, n + 1, H - 1, H + 1 entries; NaN, inf and 3.4e38 in the reals;
unknown names; thousands of columns. Two shapes come alone, one series per request, since each costs the server
the most memory it can be made to spend: a list (categorical_features, future_categorical_features, contracts,
user_feature_names) of ~30,000 short strings and one of 3.9 million characters, and one label of 10^6 characters
among the labels of 200 bars.

`fuzz(server, target, examples)` sends `examples` mutants over a raw-bytes channel, one at a time: every operation
alone first (each gets its share), then mixes of two or three. Reproducible: hypothesis draws with
`derandomize=True`, no example database and no shrinking, and bulk values come from a numpy generator seeded by a
drawn integer. It returns a Report: answers by status code (and by operation), the slowest call, the server's RSS
after warm-up and at its peak (sampled after every call, and its high-water mark, reset after warm-up), the
INTERNAL and UNKNOWN answers with the operations behind them; and after the run the server's health, how many of
20 well-formed calls were OK, and the lines of its log that report an error or a traceback.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from features.model_meta import ModelMeta
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.validation import columns_read
from tests.futures_bars import LIVE_PER_DAY, as_bars, request_series, window_rows
from tests.live_server import (
    SERVICE,
    ContractsModel,
    CovariatesModel,
    LiveServer,
    Model,
    covariates_series,
    request_for,
)

MAX_MESSAGE = 8 << 20  # the server's --max-message-bytes: the largest mutants fit under it
TIMEOUT = 30.0  # deadline of a call: far over any honest answer, so that a hung call shows as DEADLINE_EXCEEDED
STUCK = 3  # calls in a row past their deadline end the run: the server no longer answers
WARM_UP = 20  # well-formed calls before the RSS baseline, and again after the run
NEVER = ("INTERNAL", "UNKNOWN")
GIANT_COUNT, GIANT_CHARS = 30_000, 3_900_000  # a list of short strings and one huge one: ~4 MB on the wire
LONG_BARS, LONG_CHARS = 200, 1_000_000  # one long label among the labels of 200 bars
MANY_BYTES = 3 << 20  # "very many columns" stay within this many bytes of values
LOG_PROBLEM = re.compile(r"\bERROR\b|\bCRITICAL\b|Traceback|^E\d{4} ")  # Python's levels; gRPC core's E lines
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

SPECIAL = (math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 3.4028235e38, 3.5e38, 1e39, 1.7976931348623157e308,
           5e-324, 1e-45, -0.0, 0.0, -1.0, 2.0**53, 2.0**53 + 2, 1e300)
HOSTILE = ("", "\x00", "\x00\x00", "calm\x00", "ESM5\x00", "ESM5\x00\x00\x00", "ESM４", "ESM٤", "ESU٥", "ＥＳＭ５",
           "\u202eESM5", "ESM5\u202e", "\u202d\u202e", "\u200bESM5", "\ufeffESM5", "ES\x1bM5", "\x1b[31m", "\x7f",
           "\r\n", "\t", "\x01\x02", " ", "ESM5 ", " ESM5", "esm5", "ESM05", "ESM2025", "ESZ9", "ESF", "NQM5", "CLZ5",
           "6EM5", "🦊", "\U0010ffff", "%s%n", "{0}", "'\"", "\\x00", "a" * 1000, "É" * 300)
BAD_UTF8 = (b"\xff\xfe\xfd", b"ES\xff", b"\xc3\x28\x41", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf\x41",
            b"\x80\x80\x80", b"ESM\xc3")


# ---- the models' valid requests -----------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class Target:
    """A model and valid requests of it, each of one series and answered OK."""

    name: str
    model: Path
    meta: ModelMeta
    bases: tuple[pb.PredictRequest, ...]
    long: pb.PredictRequest  # one series of LONG_BARS bars
    vocabulary: tuple[str, ...] = ()  # labels and contract names the model knows

    def __repr__(self) -> str:  # hypothesis shows a strategy's arguments: the requests would fill screens
        return f"Target({self.name!r})"


def _one(series: pb.Series) -> pb.PredictRequest:
    return pb.PredictRequest(series=[series])


def tiny_target(m: Model) -> Target:
    """The bars-only model: each symbol's latest bars, an earlier window, and 200 bars."""
    bases = [request_for(m, s, end=end) for s in m.meta.symbols for end in (None, 300)]
    return Target("tiny", m.model, m.meta, tuple(bases), request_for(m, m.meta.symbols[0], n=LONG_BARS))


def covariates_target(m: CovariatesModel) -> Target:
    """The model with every kind of user input: each symbol's last and an earlier window, user columns packed and
    plain, and 200 bars."""
    meta, bars = m.meta, m.bars
    bases = []
    for symbol in meta.symbols:
        stop = bars.series_slices()[symbol].stop
        for anchor in (stop - 1 - meta.horizon, stop - 1 - meta.horizon - 300):
            for packed in (True, False):
                bases.append(_one(covariates_series(meta, bars, anchor, packed=packed)))
    stop = bars.series_slices()[meta.symbols[0]].stop
    long = _one(covariates_series(meta, bars, stop - 1 - meta.horizon, n=LONG_BARS))
    vocabulary = tuple(label for _, labels in meta.feature_config.vocabularies for label in labels)
    return Target("covariates", m.model, meta, tuple(bases), long, vocabulary)


def contracts_target(m: ContractsModel) -> Target:
    """The futures model: bars spanning ESM5 -> ESU5 with each bar's contract, ESU5 (never trained on) by its own
    name, NQM5's bars as NQ with contracts, 50 bars of one contract with `contracts` given, and 200 bars."""
    need = m.meta.bars_required
    esu5 = np.flatnonzero(m.es["symbol"] == "ESU5")
    nqm5 = np.flatnonzero(m.nq["symbol"] == "NQM5")
    bases = (
        _one(request_series("ES", as_bars(m.es, window_rows(m.es, LIVE_PER_DAY, last_bar=9)), contracts=True)),
        _one(request_series("ESU5", as_bars(m.es, esu5[-2 * need:]), contracts=False)),
        _one(request_series("NQ", as_bars(m.nq, nqm5[-2 * need:]), contracts=True)),
        _one(request_series("ES", as_bars(m.es, esu5[-50:]), contracts=True)),
    )
    long = _one(request_series("ES", as_bars(m.es, esu5[-LONG_BARS:]), contracts=True))
    return Target("contracts", m.model, m.meta, bases, long, ("ESH5", "ESM5", "ESU5", "NQH5", "NQM5"))


# ---- mutations --------------------------------------------------------------------------------------------------
@dataclass
class Mutant:
    """A request and the operations that made it; `patches` replace ASCII markers in its bytes by bytes that are no
    UTF-8 (the same length: every length prefix stays right)."""

    ops: tuple[str, ...]
    request: pb.PredictRequest
    patches: list[tuple[bytes, bytes]] = field(default_factory=list)

    def data(self) -> bytes:
        data = self.request.SerializeToString()
        for marker, bad in self.patches:
            data = data.replace(marker, bad)
        return data


class _Ctx:
    """What one operation draws with and works on."""

    def __init__(self, draw: st.DrawFn, target: Target, mutant: Mutant) -> None:
        self.draw, self.target, self.mutant = draw, target, mutant
        self.request = mutant.request
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.h = target.meta.horizon

    def pick(self, options: Sequence[Any]) -> Any:
        return self.draw(st.sampled_from(options))

    def series(self) -> pb.Series:
        if not self.request.series:
            self.request.series.add(symbol=self.target.meta.symbols[0])
        return self.request.series[self.draw(st.integers(0, len(self.request.series) - 1))]

    def lengths(self, n: int) -> list[int]:
        """Wrong counts of a list of `n` values: none, one short or over, the horizon's off by one, double."""
        h = self.h
        return sorted({k for k in (0, 1, n - 1, n + 1, h - 1, h + 1, 2 * n + 1) if k >= 0 and k != n})

    def real(self) -> float:
        return float(self.pick(SPECIAL)) if self.draw(st.booleans()) else self.draw(st.floats())

    def reals(self, k: int) -> list[float]:
        """k finite values, one of them (or all) hostile."""
        return self._spoilt(self.rng.normal(0, 1, k).tolist(), self.real) if k else []

    def _spoilt(self, values: list[Any], hostile: Callable[[], Any]) -> list[Any]:
        """`values` with one of them, or all, replaced by one hostile value."""
        bad = hostile()
        if self.draw(st.booleans()):
            values[self.draw(st.integers(0, len(values) - 1))] = bad
            return values
        return [bad] * len(values)

    def label(self) -> str:
        kind = self.draw(st.integers(0, 3))
        if kind == 0 and self.target.vocabulary:
            return str(self.pick(self.target.vocabulary))
        if kind == 1:
            return self.draw(st.text(max_size=12))
        return str(self.pick(HOSTILE))

    def labels(self, k: int) -> list[str]:
        """k labels the model knows (or common words), one of them (or all) hostile."""
        known = self.target.vocabulary or ("calm", "open", "CME")
        values = [known[i] for i in self.rng.integers(0, len(known), k)]
        return self._spoilt(values, self.label) if k else []

    def name(self, known: Sequence[str]) -> str:
        """A column name: unknown, hostile, or a known one disguised (NUL suffix, other case, padded)."""
        if len(known) > 0 and self.draw(st.booleans()):
            base = str(self.pick(known))
            return str(self.pick((base + "\x00", base.upper(), " " + base, base + " ", base + "\u202e",
                                  base + "٤", base * 2, "")))
        return self.label()

    def not_utf8(self) -> str:
        """A marker for a string field; the sent bytes hold one of BAD_UTF8 in its place."""
        bad = self.pick(BAD_UTF8)
        k = len(self.mutant.patches)
        marker = "\x0e" + chr(0x10 + k % 16) + "\x0f" * (len(bad) - 2)
        self.mutant.patches.append((marker.encode(), bad))
        return marker


def _bars(s: pb.Series) -> int:
    return len(s.timestamp_ns)


def _symbol(c: _Ctx) -> None:
    s = c.series()
    roots = c.target.meta.symbols
    how = c.draw(st.integers(0, 3))
    if how == 0:
        s.symbol = c.pick(roots) + c.pick(("\x00", "M5", "M4\x00", "M４", "M٤", "U5", "Z9", "Z99", "H2025", "\u202e",
                                           " ", "m5", "X"))
    elif how == 1:
        s.symbol = c.pick(("", "ZZ", "es", "\x00", "\x1f", "\u202eSE", "ＥＳ", "🦊", "A" * 70_000, "E" * 49, "CLZ5"))
    elif how == 2:
        s.symbol = c.label()
    else:
        s.symbol = c.pick(roots) + c.not_utf8()


def _timestamps(c: _Ctx) -> None:
    s = c.series()
    n, ts = _bars(s), s.timestamp_ns
    interval = c.target.meta.bar_interval_ns
    how = c.pick(("duplicate", "decrease", "extreme", "shift", "length", "constant", "finer", "daily", "reverse"))
    if how in ("duplicate", "decrease", "extreme") and n > 1:
        i = c.draw(st.integers(1, n - 1))
        ts[i] = {"duplicate": ts[i - 1], "decrease": max(INT64_MIN, ts[i - 1] - interval),
                 "extreme": c.pick((INT64_MIN, INT64_MAX, 0, -1, 1, INT64_MAX - 1))}[how]
    elif how == "shift":
        offset = c.pick((INT64_MAX, INT64_MIN, -ts[-1] if n else 0, 1 << 62, -(1 << 62), 1, -1))
        ts[:] = [min(INT64_MAX, max(INT64_MIN, t + offset)) for t in ts]
    elif how == "length":
        k = c.pick(c.lengths(n))
        ts[:] = (list(ts) + [ts[-1] + interval * (j + 1) for j in range(k)])[:k] if n else list(range(k))
    elif how == "constant":
        ts[:] = [c.pick((0, INT64_MAX, ts[-1] if n else 0))] * n
    elif how in ("finer", "daily") and n:
        step = interval // 1000 if how == "finer" else 86_400_000_000_000
        ts[:] = [ts[-1] - step * (n - 1 - j) for j in range(n)]
    else:
        ts[:] = list(ts)[::-1]


def _prices(c: _Ctx) -> None:
    s = c.series()
    col = getattr(s, c.pick(("open", "high", "low", "close", "volume")))
    n = len(col)
    how = c.pick(("value", "length", "constant", "clear", "scale"))
    if how == "value" and n:
        col[c.draw(st.integers(0, n - 1))] = c.real()
    elif how == "length":
        k = c.pick(c.lengths(n))
        col[:] = (list(col) + [col[-1] if n else 1.0] * k)[:k]
    elif how == "constant":
        col[:] = [c.real()] * n
    elif how == "clear":
        del col[:]
    else:
        factor = c.pick((1e-300, 1e300, -1.0, 1e30, 0.0))
        col[:] = [v * factor for v in col]


def _columns(c: _Ctx, items: Any, real: bool, need: tuple[str, ...], length: int) -> None:
    """One mutation of a repeated Column (`real`) or Labels field whose columns need `length` values each."""
    values: Callable[[int], list[Any]] = c.reals if real else c.labels
    names = [x.name for x in items]
    how = c.pick(("drop", "twice", "length", "values", "unknown", "unused_empty", "many", "rename", "clear", "name",
                  "not_utf8", "cross"))
    i = c.draw(st.integers(0, len(items) - 1)) if len(items) else -1
    if how == "drop" and i >= 0:
        del items[i]
    elif how == "twice":
        if i >= 0:
            items.add().CopyFrom(items[i])
        else:
            name = c.name(need)
            items.add(name=name, values=values(length))
            items.add(name=name, values=values(length))
    elif how == "length" and i >= 0:
        items[i].values[:] = values(c.pick(c.lengths(length)))
    elif how == "values" and i >= 0:
        items[i].values[:] = values(len(items[i].values) or length)
    elif how == "unknown":
        items.add(name=c.name(need), values=values(c.pick([length, *c.lengths(length)])))
    elif how == "unused_empty":
        items.add(name=c.pick(("unused", "ESM5", "", "regime\x00", "x" * 200)))
    elif how == "many":
        k = c.pick((100, 1000, 5000, 20_000))
        k = max(1, min(k, MANY_BYTES // (8 * max(length, 1))))
        per = values(length) if c.draw(st.booleans()) else []
        own = _take(items) if c.draw(st.booleans()) else []  # the model's own columns after them
        for j in range(k):
            items.add(name=f"c{j}", values=per)
        items.extend(own)
    elif how == "rename" and i >= 0:
        items[i].name = c.name([items[i].name])
    elif how == "clear":
        del items[:]
    elif how == "name":
        items.add(name=c.name(need), values=values(length))
    elif how == "not_utf8" and i >= 0:
        if real or c.draw(st.booleans()):
            items[i].name = items[i].name + c.not_utf8()
        elif len(items[i].values):
            items[i].values[c.draw(st.integers(0, len(items[i].values) - 1))] = c.not_utf8()
    elif how == "cross" and names:  # a column of another field's kind, by the same name
        items.add(name=c.pick(names), values=values(length))


def _take(items: Any) -> list[Any]:
    """The messages of a repeated field, as copies, and the field emptied."""
    out = []
    for x in items:
        copy = type(x)()
        copy.CopyFrom(x)
        out.append(copy)
    del items[:]
    return out


def _user_features(c: _Ctx) -> None:
    s = c.series()
    _columns(c, s.user_features, True, columns_read(c.target.meta)["user_features"], _bars(s))


def _packed(c: _Ctx) -> None:
    s = c.series()
    n = _bars(s)
    names = list(s.user_feature_names)
    raw = s.user_features_raw
    block = np.frombuffer(raw[:len(raw) // 8 * 8], dtype="<f8").copy()
    fits = bool(names) and block.size == len(names) * n
    block = block.reshape(len(names), n) if fits else np.zeros((len(names), n))
    how = c.pick(("convert", "twice", "size", "names_only", "raw_only", "value", "unknown", "drop", "many", "rename",
                  "not_utf8", "reorder"))
    if how == "convert":  # plain columns packed, or packed ones plain (both forms at once, some of the time)
        if s.user_features:
            s.user_feature_names[:] = [x.name for x in s.user_features]
            s.user_features_raw = np.array([list(x.values) for x in s.user_features], dtype="<f8").tobytes()
            if c.draw(st.booleans()):
                del s.user_features[:]
        else:
            s.user_features.extend(pb.Column(name=name, values=row.tolist()) for name, row in zip(names, block,
                                                                                                   strict=True))
            if c.draw(st.booleans()):
                s.ClearField("user_feature_names")
                s.ClearField("user_features_raw")
        return
    if how == "twice" and names:
        names.append(c.pick(names))
        block = np.vstack([block, block[-1:]])
    elif how == "size":
        raw = block.tobytes()
        s.user_feature_names[:] = names
        s.user_features_raw = c.pick((raw[:-1], raw[:-8], raw + b"\x00", raw + bytes(8), b"", raw * 2)) if raw else \
            c.pick((b"\x00", bytes(8 * n)))
        return
    elif how == "names_only":
        s.user_feature_names[:] = names or [c.name(())]
        s.user_features_raw = b""
        return
    elif how == "raw_only":
        s.ClearField("user_feature_names")
        s.user_features_raw = block.tobytes() or bytes(8 * n)
        return
    elif how == "value" and block.size:
        block[c.draw(st.integers(0, block.shape[0] - 1)), c.draw(st.integers(0, n - 1))] = c.real()
    elif how == "unknown":
        names.append(c.name(columns_read(c.target.meta)["user_features"]))
        block = np.vstack([block, np.full((1, n), c.real())])
    elif how == "drop" and names:
        names, block = names[1:], block[1:]
    elif how == "many":
        k = max(1, min(c.pick((100, 1000, 5000)), MANY_BYTES // (8 * max(n, 1))))
        names += [f"u{j}" for j in range(k)]
        block = np.vstack([block, np.zeros((k, n))])
    elif how == "rename" and names:
        names[0] = c.name(names)
    elif how == "not_utf8" and names:
        names[-1] = names[-1] + c.not_utf8()
    elif how == "reorder" and names:
        order = c.rng.permutation(len(names))
        names, block = [names[j] for j in order], block[order]
    s.user_feature_names[:] = names
    s.user_features_raw = block.astype("<f8").tobytes()


def _future_features(c: _Ctx) -> None:
    _columns(c, c.series().future_features, True, columns_read(c.target.meta)["future_features"], c.h)


def _categorical_features(c: _Ctx) -> None:
    s = c.series()
    _columns(c, s.categorical_features, False, columns_read(c.target.meta)["categorical_features"], _bars(s))


def _future_categorical_features(c: _Ctx) -> None:
    _columns(c, c.series().future_categorical_features, False,
             columns_read(c.target.meta)["future_categorical_features"], c.h)


def _static_map(c: _Ctx, items: Any, need: tuple[str, ...], value: Callable[[], Any], labels: bool) -> None:
    """One mutation of a static map (name -> value)."""
    keys = list(items)
    how = c.pick(("drop", "unknown", "key", "value", "many", "clear", "not_utf8_key", "not_utf8_value"))
    if how == "drop" and keys:
        del items[c.pick(keys)]
    elif how == "unknown":
        items[c.name(need)] = value()
    elif how == "key" and keys:
        key = c.pick(keys)
        items[c.name([key])] = items[key]
        if c.draw(st.booleans()):
            del items[key]
    elif how == "value":
        items[c.pick(keys) if len(keys) > 0 and c.draw(st.booleans()) else c.pick(need or ("scale",))] = value()
    elif how == "many":
        for j in range(c.pick((100, 1000, 20_000))):
            items[f"k{j}"] = value()
    elif how == "clear":
        items.clear()
    elif how == "not_utf8_key":
        items[(c.pick(keys) if keys else "k") + c.not_utf8()] = value()
    elif how == "not_utf8_value" and labels:
        items[c.pick(keys) if keys else "k"] = c.not_utf8()


def _static_features(c: _Ctx) -> None:
    _static_map(c, c.series().static_features, columns_read(c.target.meta)["static_features"], c.real, False)


def _static_categorical_features(c: _Ctx) -> None:
    def value() -> str:
        return c.pick((c.label(), "", "x" * 100_000, "CME\x00"))
    _static_map(c, c.series().static_categorical_features, columns_read(c.target.meta)["static_categorical_features"],
                value, True)


def _contracts(c: _Ctx) -> None:
    s = c.series()
    n = _bars(s)
    roots = c.target.meta.symbols
    names = list(s.contracts) or [c.pick(roots) + c.pick(("M5", "U5", "Z9"))] * n
    n = len(names)
    how = c.pick(("add", "length", "value", "all", "foreign", "distinct", "shuffle", "clear", "not_utf8", "unused"))
    if how == "length":
        k = c.pick(c.lengths(n))
        names = (names + names[-1:] * k)[:k] if names else ["ESM5"] * k
    elif how == "value" and n:
        names[c.draw(st.integers(0, n - 1))] = c.label()
    elif how == "all":
        names = [c.label()] * n
    elif how == "foreign" and n:
        other = [r for r in roots if not s.symbol.startswith(r)] or ["CL"]
        names[c.draw(st.integers(0, n - 1))] = c.pick(other) + c.pick(("M5", "U5"))
    elif how == "distinct":  # a contract of its own per bar
        month = "FGHJKMNQUVXZ"
        root = names[0][:2] if names and names[0] else "ES"
        names = [f"{root}{month[j % 12]}{j // 12 % 100}" for j in range(n)]
    elif how == "shuffle":
        c.rng.shuffle(names)
    elif how == "clear":
        names = []
    elif how == "not_utf8" and n:
        names[c.draw(st.integers(0, n - 1))] = c.not_utf8()
    elif how == "unused":  # the bars' contracts given, and a categorical column the model does not use, empty
        s.categorical_features.add(name=c.pick(("unused", "regime", "ESM5", "")))
    s.contracts[:] = names


def _explain(c: _Ctx) -> None:
    c.request.explain = not c.request.explain


def _request_id(c: _Ctx) -> None:
    how = c.draw(st.integers(0, 2))
    if how == 0:
        c.request.request_id = c.pick(("", "x" * 1024, "x" * 1025, "é" * 1024, "é" * 1025, "🦊" * 1025, "x" * 100_000,
                                       "\x00", "id\x00", "\u202eid", "\r\n", "\x1b[2J"))
    elif how == 1:
        c.request.request_id = c.label()
    else:
        c.request.request_id = "id" + c.not_utf8()


def _series_list(c: _Ctx) -> None:
    r = c.request
    how = c.pick(("none", "twice", "other", "renamed", "empty", "symbol_only", "many"))
    if how == "none":
        del r.series[:]
    elif how == "twice" and r.series:
        r.series.add().CopyFrom(r.series[0])
    elif how == "other":
        base = c.pick(c.target.bases)
        r.series.add().CopyFrom(base.series[0])
    elif how == "renamed" and r.series:  # the same root by another name (a contract of it)
        r.series.add().CopyFrom(r.series[0])
        r.series[-1].symbol = r.series[0].symbol[:2] + c.pick(("U5", "Z5", "M5"))
    elif how == "empty":
        r.series.add()
    elif how == "symbol_only":
        r.series.add(symbol=c.pick(c.target.meta.symbols))
    else:
        for _ in range(c.pick((10, 100, 1000))):
            r.series.add(symbol=c.pick((*c.target.meta.symbols, "", "ZZ")))


def _not_utf8(c: _Ctx) -> None:
    """Bytes that are no UTF-8 in one of the string fields."""
    s = c.series()
    where = c.pick(("symbol", "request_id", "label", "label_name", "future_label", "static_key", "static_label",
                    "static_label_key", "contract", "packed_name", "column_name", "future_column_name"))
    bad = c.not_utf8()
    if where == "symbol":
        s.symbol = bad
    elif where == "request_id":
        c.request.request_id = bad
    elif where in ("label", "label_name"):
        col = s.categorical_features[0] if s.categorical_features else s.categorical_features.add(name="regime")
        if where == "label_name":
            col.name = bad
        else:
            col.values[:] = [*list(col.values)[:-1], bad]
    elif where == "future_label":
        s.future_categorical_features.add(name="session", values=[bad] * c.h)
    elif where == "static_key":
        s.static_features[bad] = 1.0
    elif where == "static_label":
        s.static_categorical_features["exchange"] = bad
    elif where == "static_label_key":
        s.static_categorical_features[bad] = "CME"
    elif where == "contract":
        s.contracts[:] = [*list(s.contracts)[:-1], bad] if s.contracts else [bad] * _bars(s)
    elif where == "packed_name":
        s.user_feature_names.append(bad)
    elif where == "column_name":
        s.user_features.add(name=bad, values=[1.0] * _bars(s))
    else:
        s.future_features.add(name=bad, values=[1.0] * c.h)


def _prepend(s: pb.Series, k: int, interval: int) -> None:
    """k more valid bars before the series' first (copies of it, one interval apart), in every per-bar column."""
    n = _bars(s)
    first = s.timestamp_ns[0]
    s.timestamp_ns[:] = [first - interval * j for j in range(k, 0, -1)] + list(s.timestamp_ns)
    for name in ("open", "high", "low", "close", "volume"):
        col = getattr(s, name)
        col[:] = [col[0]] * k + list(col)
    for column in s.user_features:
        column.values[:] = [column.values[0]] * k + list(column.values)
    for labels in s.categorical_features:
        labels.values[:] = [labels.values[0]] * k + list(labels.values)
    if s.contracts:
        s.contracts[:] = [s.contracts[0]] * k + list(s.contracts)
    if s.user_feature_names:
        block = np.frombuffer(s.user_features_raw, dtype="<f8").reshape(len(s.user_feature_names), n)
        s.user_features_raw = np.hstack([np.repeat(block[:, :1], k, axis=1), block]).astype("<f8").tobytes()


def _huge_list_into(c: _Ctx, s: pb.Series, build: Callable[[list[str]], list[str]]) -> None:
    """A string list of the series replaced by `build(its values)`: a categorical column (the model's or not), the
    known categoricals' future labels, contracts or packed user feature names."""
    need = columns_read(c.target.meta)
    where = c.pick(("categorical_features", "future_categorical_features", "contracts", "user_feature_names"))
    if where in ("contracts", "user_feature_names"):
        getattr(s, where)[:] = build(list(getattr(s, where)))
        if where == "user_feature_names":
            s.user_features_raw = b""
        return
    name = c.pick((*need[where], "unused")) if need[where] else "unused"
    kept = _take(getattr(s, where))
    getattr(s, where).extend(x for x in kept if x.name != name)
    old = next((list(x.values) for x in kept if x.name == name), [])
    getattr(s, where).add(name=name, values=build(old))


def _repeat(unit: str, chars: int) -> str:
    return (unit * (chars // len(unit) + 1))[:chars]


def _giant_list(c: _Ctx) -> None:
    """~30,000 short strings and one of 3.9 million characters in one list, as many as the bars (more bars sent)
    or not."""
    r = c.request
    del r.series[1:]
    s = c.series()
    count = c.pick((GIANT_COUNT - 1, GIANT_COUNT, GIANT_COUNT + 1))
    values = [c.pick(("a", "ESU5", "", "x\x00", "calm"))] * count
    values.insert(c.pick((0, count // 2, count)), _repeat(c.pick(("Z", "ESU5", "\x00", "ab")), GIANT_CHARS))
    if c.draw(st.booleans()):
        _prepend(s, len(values) - _bars(s), c.target.meta.bar_interval_ns)
    _huge_list_into(c, s, lambda _: values)


def _long_label(c: _Ctx) -> None:
    """One label of 10^6 characters among 200 bars' labels (or in a single string field)."""
    r = c.request
    r.CopyFrom(c.target.long)
    s = r.series[0]
    n = _bars(s)
    long = _repeat(c.pick(("L", "ESU5", "\x00", "٤")), LONG_CHARS)
    at = c.draw(st.integers(0, n - 1))
    fill = str(c.pick(c.target.vocabulary or ("calm",)))

    def build(old: list[str]) -> list[str]:
        values = old if len(old) == n else [fill] * n
        values[at] = long
        return values

    where = c.pick(("list", "list", "list", "future", "static_label", "symbol", "request_id", "column_name"))
    if where == "list":
        _huge_list_into(c, s, build)
    elif where == "future":
        s.future_categorical_features.add(name="session", values=["open"] * (c.h - 1) + [long])
    elif where == "static_label":
        s.static_categorical_features[c.pick(("exchange", "unused"))] = long
    elif where == "symbol":
        s.symbol = long
    elif where == "request_id":
        r.request_id = long
    else:
        s.categorical_features.add(name=long, values=["calm"] * n)


OPS: dict[str, Callable[[_Ctx], None]] = {
    "symbol": _symbol, "timestamp_ns": _timestamps, "prices": _prices, "user_features": _user_features,
    "user_features_raw": _packed, "future_features": _future_features, "categorical_features": _categorical_features,
    "future_categorical_features": _future_categorical_features, "static_features": _static_features,
    "static_categorical_features": _static_categorical_features, "contracts": _contracts, "explain": _explain,
    "request_id": _request_id, "series": _series_list, "not_utf8": _not_utf8, "giant_list": _giant_list,
    "long_label": _long_label,
}
ALONE = ("giant_list", "long_label")  # the memory-heaviest shapes: never combined, one series


def shapes(target: Target) -> list[Mutant]:
    """The hostile requests every run sends, whatever hypothesis draws: a list of ~30,000 short strings and one
    of 3.9 million characters (categorical_features and contracts, as many as the bars); one label of 10^6
    characters on 200 bars (categorical_features and contracts); valid bars of one contract with `contracts` and
    a categorical column the model does not use, without values; contract names and labels that look like the
    model's (NUL suffixed, full-width or Arabic-Indic digits, bidi overrides, control characters, empty)."""
    interval = target.meta.bar_interval_ns
    contract = next((b for b in target.bases if len(b.series[0].contracts) and
                     len(set(b.series[0].contracts)) == 1), target.bases[0])
    root = target.meta.symbols[0]
    categorical = (*target.meta.feature_config.series_categoricals, "unused")[0]
    out: list[Mutant] = []

    def add(name: str, base: pb.PredictRequest, edit: Callable[[pb.Series], object]) -> None:
        request = pb.PredictRequest()
        request.CopyFrom(base)
        edit(request.series[0])
        out.append(Mutant((name,), request))

    def set_labels(s: pb.Series, values: list[str]) -> None:
        kept = [x for x in _take(s.categorical_features) if x.name != categorical]
        s.categorical_features.extend(kept)
        s.categorical_features.add(name=categorical, values=values)

    def contracts_of(s: pb.Series) -> list[str]:
        return list(s.contracts) or [root + "U5"] * _bars(s)

    def giant(s: pb.Series, into: str) -> None:
        values = ["a" if into == "labels" else contracts_of(s)[0]] * GIANT_COUNT
        values.insert(GIANT_COUNT // 2, "Z" * GIANT_CHARS)
        _prepend(s, len(values) - _bars(s), interval)
        if into == "labels":
            set_labels(s, values)
        else:
            s.contracts[:] = values

    def long(s: pb.Series, into: str) -> None:
        values = [str((*target.vocabulary, "calm")[0]) if into == "labels" else c for c in contracts_of(s)]
        values[-1] = "L" * LONG_CHARS
        if into == "labels":
            set_labels(s, values)
        else:
            s.contracts[:] = values

    def last_contract(name: str) -> Callable[[pb.Series], object]:
        return lambda s: s.contracts.__setitem__(slice(None), [*contracts_of(s)[:-1], name])

    def last_label(name: str) -> Callable[[pb.Series], object]:
        def edit(s: pb.Series) -> None:
            old = next((list(x.values) for x in s.categorical_features if x.name == categorical), ["calm"] * _bars(s))
            set_labels(s, [*old[:-1], name])
        return edit

    add("shape:giant_labels", target.bases[0], lambda s: giant(s, "labels"))
    add("shape:giant_contracts", contract, lambda s: giant(s, "contracts"))
    add("shape:long_label", target.long, lambda s: long(s, "labels"))
    add("shape:long_contract", target.long, lambda s: long(s, "contracts"))
    add("shape:unused_empty", contract, lambda s: (s.contracts.__setitem__(slice(None), contracts_of(s)),
                                                   s.categorical_features.add(name="unused")))
    for i, name in enumerate(("ESU5\x00", "ESU５", "ESU٥", "ESM٤", "\u202eESU5", "ESU5\u202d", "ES\x1bU5", "")):
        add(f"shape:contract_{i}", contract, last_contract(name))
        add(f"shape:label_{i}", target.bases[0], last_label(name))
    return out


@st.composite
def mutants(draw: st.DrawFn, target: Target, ops: tuple[str, ...]) -> Mutant:
    """A valid request of `target` with one operation of `ops` (a single one given), or two or three."""
    base = draw(st.sampled_from(target.bases))
    mutant = Mutant((), pb.PredictRequest())
    mutant.request.CopyFrom(base)
    chosen = ops if len(ops) == 1 else tuple(draw(st.lists(st.sampled_from(ops), min_size=2, max_size=3)))
    for op in chosen:
        OPS[op](_Ctx(draw, target, mutant))
    mutant.ops = chosen
    return mutant


# ---- the runner -----------------------------------------------------------------------------------------------
@dataclass
class Answer:
    code: str
    ops: tuple[str, ...]
    details: str
    seconds: float


@dataclass
class Report:
    """What a fuzz run saw; `failures()` lists each way it falls short of a hardened server."""

    model: str
    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    by_op: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    kinds: Counter[str] = field(default_factory=Counter)  # answers by the start of their message
    never: list[Answer] = field(default_factory=list)  # INTERNAL and UNKNOWN answers, the first few per operation
    slowest: Answer | None = None
    rss_warm_kib: int = 0
    rss_peak_kib: int = 0  # the largest of the RSS after each call and the high-water mark since warm-up
    rss_sampled_kib: int = 0  # the largest RSS after a call
    rss_end_kib: int = 0  # after the run and the well-formed calls: what the server keeps of the peak
    hwm_reset: bool = False  # whether the high-water mark was reset after warm-up (else only the samples count)
    growth: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)  # KiB the peak rose by, and the call's
    # operations, for each call that raised it by more than a MiB
    ended: str = ""  # why the run stopped early: the server died or stopped answering
    health: str = ""
    after_ok: int = 0  # of WARM_UP well-formed calls after the run
    log_problems: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.rss_peak_kib / self.rss_warm_kib if self.rss_warm_kib else math.inf

    def failures(self) -> list[str]:
        out = [f"{self.codes[code]} {code} answer(s)" for code in NEVER if self.codes[code]]
        out += [f"the run ended early: {self.ended}"] if self.ended else []
        out += [f"health {self.health or 'unknown'} after the run"] if self.health != "SERVING" else []
        out += [f"{self.after_ok} of {WARM_UP} well-formed calls OK after the run"] if self.after_ok != WARM_UP else []
        out += [f"{len(self.log_problems)} error line(s) in the log, e.g. {self.log_problems[0][:300]!r}"] \
            if self.log_problems else []
        out += [f"peak RSS {self.rss_peak_kib} KiB is {self.ratio:.2f}x the {self.rss_warm_kib} KiB after warm-up"] \
            if self.ratio > 1.5 else []
        return out

    def describe(self) -> str:
        """The counts, the slowest call, the INTERNAL and UNKNOWN answers with their operations, the messages."""
        lines = [f"{self.model}: {self.sent} requests; {dict(self.codes.most_common())}; RSS {self.rss_warm_kib} KiB "
                 f"after warm-up, peak {self.rss_peak_kib} KiB ({self.ratio:.2f}x; after a call at most "
                 f"{self.rss_sampled_kib} KiB, at the end {self.rss_end_kib} KiB; high-water mark reset: "
                 f"{self.hwm_reset})"]
        lines += [f"  peak +{kib} KiB after {'+'.join(ops)}" for kib, ops in sorted(self.growth, reverse=True)[:8]]
        if self.slowest:
            lines.append(f"  slowest {self.slowest.seconds:.3f} s: {'+'.join(self.slowest.ops)} "
                         f"{self.slowest.code} {self.slowest.details[:120]!r}")
        for op, codes in sorted(self.by_op.items()):
            lines.append(f"  {op:28s} {dict(codes.most_common())}")
        lines += self.never_lines()
        lines += [f"  {count:5d}  {kind}" for kind, count in self.kinds.most_common(40)]
        lines += [f"  log: {line[:300]}" for line in self.log_problems[:10]]
        return "\n".join(lines)


    def never_lines(self, limit: int = 12) -> list[str]:
        """The INTERNAL and UNKNOWN answers by code and message, each with the mutations that drew it."""
        groups: dict[tuple[str, str], list[Answer]] = defaultdict(list)
        for a in self.never:
            groups[(a.code, _kind(a.details))].append(a)
        lines = []
        for (code, _), answers in sorted(groups.items(), key=lambda g: -len(g[1]))[:limit]:
            ops = sorted({"+".join(a.ops) for a in answers})
            lines.append(f"  {code} {answers[0].details[:160]!r} after {', '.join(ops[:6])}"
                         f"{f' (and {len(ops) - 6} more)' if len(ops) > 6 else ''}")
        return lines


class _Stop(Exception):
    """Ends a run: the server died or stopped answering."""


def _kind(details: str) -> str:
    text = re.sub(r"^series\[\d+\]( \([^)]*\))?(, contract '[^']*')?: ", "", details)
    text = re.sub(r"'[^']*'", "'_'", text)
    return re.sub(r"\d+", "N", text)[:70]


def _status(path: Path, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB$", path.read_text(), re.M)
    return int(m.group(1)) if m else 0


def fuzz(server: LiveServer, target: Target, examples: int, timeout: float = TIMEOUT) -> Report:
    """Send `examples` mutants of `target` to `server` (SERVING, started with --max-message-bytes MAX_MESSAGE),
    then check its health, WARM_UP well-formed calls and its log. First the fixed shapes, then every operation
    alone about half its share of `examples` (ALONE ones a third of that), the rest mixes."""
    report = Report(target.name)
    proc = Path(f"/proc/{server.proc.pid}")
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 << 20),
                                                            ("grpc.max_receive_message_length", 64 << 20)])
    predict = channel.unary_unary(f"/{SERVICE}/Predict", request_serializer=None, response_deserializer=None)
    good = [b.SerializeToString() for b in (*target.bases, target.long)]
    try:
        for j in range(WARM_UP):
            predict(good[j % len(good)], timeout=timeout)  # a base the server refuses is the harness's error: raises
        report.rss_warm_kib = report.rss_peak_kib = report.rss_sampled_kib = server.rss_kib()
        try:
            (proc / "clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
            report.hwm_reset = True
        except OSError:
            pass
        stuck = [0]

        def send(mutant: Mutant) -> None:
            data = mutant.data()
            started = time.monotonic()
            try:
                predict(data, timeout=timeout)
                code, details = "OK", ""
            except grpc.RpcError as exc:
                code, details = exc.code().name, exc.details() or ""
            answer = Answer(code, mutant.ops, details, time.monotonic() - started)
            report.sent += 1
            report.codes[code] += 1
            report.kinds[f"{code}: {_kind(details)}"] += 1
            for op in set(mutant.ops):
                report.by_op[op][code] += 1
            if report.slowest is None or answer.seconds > report.slowest.seconds:
                report.slowest = answer
            if code in NEVER and sum(a.ops == mutant.ops for a in report.never) < 3:
                report.never.append(answer)
            if not server.alive():
                raise _Stop(f"the server exited {server.proc.returncode} after {'+'.join(mutant.ops)}")
            status = proc / "status"
            rss = _status(status, "VmRSS")
            peak = max(report.rss_peak_kib, rss, _status(status, "VmHWM") if report.hwm_reset else 0)
            if peak - report.rss_peak_kib > 1024:
                report.growth.append((peak - report.rss_peak_kib, mutant.ops))
            report.rss_peak_kib, report.rss_sampled_kib = peak, max(report.rss_sampled_kib, rss)
            stuck[0] = stuck[0] + 1 if code == "DEADLINE_EXCEEDED" else 0
            if stuck[0] >= STUCK:
                raise _Stop(f"{STUCK} calls in a row past their {timeout} s deadline")

        fixed = shapes(target)
        alone = [op for op in OPS if op not in ALONE]
        share = max(1, examples // (2 * len(OPS)))
        plan: list[tuple[tuple[str, ...], int]] = [((op,), share if op not in ALONE else max(3, share // 3))
                                                   for op in OPS]
        plan.append((tuple(alone), max(0, examples - len(fixed) - sum(k for _, k in plan))))
        try:
            for mutant in fixed:
                send(mutant)
            for ops, count in plan:
                if count:
                    run_mutants(target, ops, count, send)
        except _Stop as stop:
            report.ended = str(stop)
        if server.alive():
            try:
                report.health = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                                              timeout=timeout).status)
            except grpc.RpcError as exc:
                report.health = exc.code().name
            for j in range(WARM_UP):
                try:
                    predict(good[j % len(good)], timeout=timeout)
                    report.after_ok += 1
                except grpc.RpcError:
                    pass
            report.rss_end_kib = server.rss_kib()
    finally:
        channel.close()
    report.log_problems = [line for line in server.log_text().splitlines() if LOG_PROBLEM.search(line)]
    return report


def run_mutants(target: Target, ops: tuple[str, ...], count: int, send: Callable[[Mutant], None]) -> None:
    """`count` mutants drawn by hypothesis, each sent as it is drawn (no shrinking: every answer is recorded)."""
    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(mutants(target, ops))
    def each(mutant: Mutant) -> None:
        send(mutant)

    each()
