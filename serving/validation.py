"""Request columns -> checked numpy columns, or a RequestError that names the field, the rule and the fix.
When a fast check finds a bad value, `features.bars.validate` names each broken rule, as for a file."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np

from features.bars import (
    NS_PER_UNIT,
    PLAUSIBLE_NS,
    PRICE_COLUMNS,
    UNIT_NAMES,
    ColumnBlock,
    ColumnMap,
    Problem,
    block_for,
    rules_hold,
    unusable_values,
    validate,
)
from features.calendar import COARSE_INTERVALS, NS_PER_DAY
from features.known import future_known
from features.model_meta import ModelMeta
from features.rolls import Front, contract_codes, front_rows
from features.schema import Kind, Role
from features.text import bounded, listed
from serving.contracts import foreign_contract, unknown_symbol
from serving.errors import MAX_PROBLEMS, RequestError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.limits import check_series_fields

BAR_COLUMNS: tuple[str, ...] = ("timestamp_ns", *PRICE_COLUMNS, "volume")  # the proto's field names
WIRE_COLUMNS = ColumnMap(timestamp="timestamp_ns")  # names problems after the proto's fields
INT64_MAX = np.iinfo(np.int64).max


@dataclass
class SeriesColumns:
    """One series of a request as numpy columns, in the order sent (oldest bar first)."""

    symbol: str
    timestamp_ns: np.ndarray  # int64 [n]
    open: np.ndarray  # float64 [n]
    high: np.ndarray  # float64 [n]
    low: np.ndarray  # float64 [n]
    close: np.ndarray  # float64 [n]
    volume: np.ndarray  # float64 [n]
    # float64 [n] each, as sent; a ColumnBlock (rows are the columns) when packed or after `tail`
    user: Mapping[str, np.ndarray] = field(default_factory=dict)
    labels: Mapping[str, np.ndarray] = field(default_factory=dict)  # time-varying categoricals: str objects [n] each
    future: Mapping[str, np.ndarray] = field(default_factory=dict)  # known reals' future bars: float64 [H] each
    future_labels: Mapping[str, np.ndarray] = field(default_factory=dict)  # known categoricals' future: str objects [H]
    static_reals: Mapping[str, float] = field(default_factory=dict)  # static real column -> its value
    static_labels: Mapping[str, str] = field(default_factory=dict)  # static categorical column -> its label
    contracts: np.ndarray | None = None  # object [n] of str: each bar's futures contract, when sent (Series.contracts)
    log_offset: np.ndarray | None = None  # float64 [n]: a rolled series' offsets added to log(close) (features.rolls)
    root: str = ""  # the model symbol it forecasts, once validated: the symbol, or a contract's root
    notes: tuple[str, ...] = ()  # what Forecast.warnings says of the series as sent (columns the model ignores)

    def __len__(self) -> int:
        return int(self.timestamp_ns.shape[0])

    def user_matrix(self, names: Sequence[str]) -> np.ndarray:
        """float64 [len(names), n]: the named user columns as rows; the block itself when it holds exactly these."""
        if (block := block_for(self.user, tuple(names))) is not None:
            return block
        return np.array([self.user[u] for u in names]) if names else np.empty((0, len(self)))

    def tail(self, n: int, user_columns: Sequence[str], label_columns: Sequence[str] = ()) -> SeriesColumns:
        """The last `n` bars, with only the model's user columns (as one block) and categorical columns."""
        user = ColumnBlock(tuple(user_columns), self.user_matrix(user_columns)) if user_columns else {}
        return dataclasses.replace(self, user=user, labels={c: self.labels[c] for c in label_columns}).take(
            slice(-n, None))

    def take(self, rows: np.ndarray | slice) -> SeriesColumns:
        """The bars at `rows` with every per-bar column."""
        user: Mapping[str, np.ndarray] = ColumnBlock(self.user.names, self.user.block[:, rows]) \
            if isinstance(self.user, ColumnBlock) else {k: v[rows] for k, v in self.user.items()}
        return dataclasses.replace(
            self, **{c: getattr(self, c)[rows] for c in BAR_COLUMNS}, user=user,
            labels={k: v[rows] for k, v in self.labels.items()},
            contracts=None if self.contracts is None else self.contracts[rows],
            log_offset=None if self.log_offset is None else self.log_offset[rows])


def columns_from_proto(series: pb.Series, index: int = 0) -> SeriesColumns:
    """request.series[index] as numpy columns (no value checks); a packed block stays a read-only view."""
    user = _packed_user_columns(series, index) if series.user_feature_names or series.user_features_raw else \
        _named(series, index, "user_features", "user feature")
    o, h, lo, c, v = (np.asarray(getattr(series, name), dtype=np.float64) for name in BAR_COLUMNS[1:])
    return SeriesColumns(
        series.symbol, np.asarray(series.timestamp_ns, dtype=np.int64), o, h, lo, c, v, user=user,
        labels=_named(series, index, "categorical_features"), future=_named(series, index, "future_features"),
        future_labels=_named(series, index, "future_categorical_features"), static_reals=dict(series.static_features),
        static_labels=dict(series.static_categorical_features),
        contracts=_texts(series.contracts) if series.contracts else None)


def _named(series: pb.Series, index: int, field_name: str, what: str = "") -> dict[str, np.ndarray]:
    """A repeated Column (float64) or Labels (object, `_texts`) field -> name -> array; a name twice is refused."""
    out: dict[str, np.ndarray] = {}
    for item in getattr(series, field_name):
        if item.name in out:
            raise RequestError(f"{_label(index, series.symbol)}: {what or field_name} column {bounded(item.name)} is "
                               "sent twice; send each column once", _field(index, field_name))
        out[item.name] = _texts(item.values) if isinstance(item, pb.Labels) else np.asarray(item.values, np.float64)
    return out


def _texts(values: Sequence[str]) -> np.ndarray:
    """object [n]: the strings as sent, never widened into a fixed-width array sized by the longest; each distinct
    one held once, since labels and contract names repeat and a short Python string costs about 50 bytes."""
    held: dict[str, str] = {}
    out = np.empty(len(values), dtype=object)
    out[:] = [held.setdefault(v, v) for v in values]
    return out


def _packed_user_columns(series: pb.Series, index: int) -> ColumnBlock:
    """user_feature_names + user_features_raw -> a float64 [names, bars] block, a read-only view of the bytes."""
    label = _label(index, series.symbol)
    names, raw = tuple(series.user_feature_names), series.user_features_raw
    if series.user_features:
        raise RequestError(f"{label}: sends both user_features and user_feature_names/user_features_raw; send the "
                           "user features in one form", _field(index, "user_features_raw"))
    if not names:
        raise RequestError(f"{label}: user_features_raw has {len(raw)} bytes but user_feature_names is empty; name "
                           "each row of the block", _field(index, "user_feature_names"))
    if len(set(names)) != len(names):
        twice = next(name for name, k in Counter(names).items() if k > 1)
        raise RequestError(f"{label}: user feature column {bounded(twice)} is named twice in user_feature_names; "
                           "send each column once", _field(index, "user_feature_names"))
    bars = len(series.timestamp_ns)
    need = 8 * len(names) * bars
    if len(raw) != need:
        raise RequestError(f"{label}: user_features_raw has {len(raw)} bytes; {len(names)} name(s) x {bars} bars "
                           f"(len(timestamp_ns)) need {need}: little-endian float64, one row per name, oldest "
                           "bar first", _field(index, "user_features_raw"))
    return ColumnBlock(names, np.frombuffer(raw, dtype="<f8").reshape(len(names), bars))  # [names, bars], no copy


def _field(i: int, name: str = "") -> str:
    return f"series[{i}].{name}" if name else f"series[{i}]"


def _label(i: int, symbol: str) -> str:
    """How messages name series i: `series[0] (ES)`; a long or unprintable symbol is quoted and cut."""
    shown = symbol if symbol.isprintable() and len(symbol) <= 48 else bounded(symbol)
    return f"series[{i}] ({shown})"


def _check_identity(i: int, s: SeriesColumns, meta: ModelMeta, seen: dict[str, int]) -> None:
    """The model symbol the series forecasts into `s.root`: its symbol, or a futures model's root of it."""
    known = ", ".join(meta.symbols)
    if not s.symbol:
        raise RequestError(f"series[{i}]: symbol is empty; set it to one of the model's symbols: {known}",
                           _field(i, "symbol"))
    root = meta.root_of(s.symbol)
    if root is None:
        raise RequestError(f"series[{i}]: {unknown_symbol(s.symbol, meta)}", _field(i, "symbol"))
    if root in seen:
        whose = "" if root == s.symbol else f" (root {root})"
        raise RequestError(f"series[{i}]: symbol {bounded(s.symbol)}{whose} already appears in series[{seen[root]}]; "
                           f"send each {'root' if meta.contracts else 'symbol'} at most once per request",
                           _field(i, "symbol"))
    seen[root] = i
    s.root = root


def _check_shape(i: int, s: SeriesColumns, meta: ModelMeta) -> None:
    label = _label(i, s.symbol)
    if len(s) == 0 and all(getattr(s, c).shape[0] == 0 for c in BAR_COLUMNS):  # a symbol alone: no bars at all
        _refuse_too_few(i, label, 0, meta)
    need = meta.feature_config.series_reals
    block = block_for(s.user, need)  # a block of exactly the model's columns: no column-by-column steps
    missing = [] if block is not None else [u for u in need if u not in s.user]
    if missing:
        raise RequestError(f"{label}: user feature column(s) {', '.join(bounded(m) for m in missing)} missing; this "
                           f"model needs user_features {', '.join(need)} (see GetModelInfo.user_feature_columns)",
                           _field(i, "user_feature_names" if isinstance(s.user, ColumnBlock) else "user_features"))
    n = len(s)
    user_lengths = {block.shape[1]} if block is not None and need else {s.user[u].shape[0] for u in need}
    if {getattr(s, c).shape[0] for c in BAR_COLUMNS} | user_lengths != {n}:
        lengths = {c: int(getattr(s, c).shape[0]) for c in BAR_COLUMNS} | {u: int(s.user[u].shape[0]) for u in need}
        listed = ", ".join(f"{c} {k}" for c, k in lengths.items())
        raise RequestError(f"{label}: columns have unequal lengths ({listed}); send one value per bar in every column",
                           _field(i))
    if n < meta.bars_required:
        _refuse_too_few(i, label, n, meta)


def _refuse_too_few(i: int, label: str, n: int, meta: ModelMeta) -> NoReturn:
    required = meta.bars_required
    raise RequestError(
        f"{label}: {n} bar{'' if n == 1 else 's'} sent, the model needs at least {required} "
        f"({meta.feature_config.warmup_bars} warm-up bars for the rolling features + {meta.encoder_length} encoder "
        f"bars); send the most recent {required} bars, oldest first (GetModelInfo.bars_required)",
        _field(i, "timestamp_ns"))


def columns_read(meta: ModelMeta) -> dict[str, tuple[str, ...]]:
    """Each column field of a Series -> the columns of it the model reads."""
    user, observed, known, static = meta.feature_schema.user, Role.OBSERVED, Role.KNOWN, Role.STATIC
    real, cat = Kind.REAL, Kind.CATEGORICAL
    return {"user_features": user(observed, known, kind=real), "future_features": user(known, kind=real),
            "categorical_features": user(observed, known, kind=cat),
            "future_categorical_features": user(known, kind=cat),
            "static_features": user(static, kind=real), "static_categorical_features": user(static, kind=cat)}


def _check_covariates(i: int, s: SeriesColumns, meta: ModelMeta) -> None:
    """The known, static and categorical user values a model with such features needs: each column present (its
    count of values is checked on the wire, `serving.limits`), future and static reals usable."""
    read, horizon = columns_read(meta), meta.horizon
    per_future_bar = "one per future bar (GetModelInfo.horizon)"
    for field_name, given, per in (
            ("future_features", s.future, f"exactly {horizon} values, {per_future_bar}"),
            ("categorical_features", s.labels, f"exactly {len(s)} labels, one per bar sent (len(timestamp_ns))"),
            ("future_categorical_features", s.future_labels, f"exactly {horizon} labels, {per_future_bar}")):
        need = read[field_name]
        if missing := [c for c in need if c not in given]:
            raise RequestError(f"{_label(i, s.symbol)}: {field_name} column(s) {', '.join(map(repr, missing))} "
                               f"missing; this model needs {per}, for each of {', '.join(need)}",
                               _field(i, field_name))
    for field_name, statics in (("static_features", s.static_reals), ("static_categorical_features", s.static_labels)):
        need = read[field_name]
        if missing := [c for c in need if c not in statics]:
            raise RequestError(f"{_label(i, s.symbol)}: {field_name} lacks {', '.join(map(repr, missing))}; this "
                               f"model needs the series' value of each of {', '.join(need)} there",
                               _field(i, field_name))
    for name in read["future_features"]:
        _check_usable(i, s, "future_features", name, s.future[name])
    for name in read["static_features"]:
        _check_usable(i, s, "static_features", name, np.array([s.static_reals[name]]))


def _ignored(s: SeriesColumns, meta: ModelMeta) -> tuple[str, ...]:
    """One note per field that holds columns the model does not read: served all the same, those ignored."""
    notes = []
    sent = {"user_features": s.user, "future_features": s.future, "categorical_features": s.labels,
            "future_categorical_features": s.future_labels, "static_features": s.static_reals,
            "static_categorical_features": s.static_labels}
    for field_name, need in columns_read(meta).items():
        if unread := [name for name in sent[field_name] if name not in need]:
            where = "user_feature_names" if field_name == "user_features" and isinstance(s.user, ColumnBlock) \
                else field_name
            notes.append(f"{where} column(s) {listed(unread)} not read by this model, ignored "
                         "(GetModelInfo.features lists the columns it reads)")
    return tuple(notes)


def _check_usable(i: int, s: SeriesColumns, field_name: str, name: str, values: np.ndarray) -> None:
    """Finite values within float32's range, as for the user columns of the bars."""
    if (bad := np.flatnonzero(unusable_values(values))).size:
        where = f", value {int(bad[0])}" if values.shape[0] > 1 else ""
        raise RequestError(f"{_label(i, s.symbol)}: {field_name} column {name!r}{where}: {values[bad[0]]} is not a "
                           "finite number within float32's range; send finite values, as in the training data",
                           _field(i, field_name))


def _check_time_range(i: int, s: SeriesColumns, meta: ModelMeta) -> None:
    """The forecast's future bar times (last + h * bar_interval_ns, h <= horizon) must fit in int64."""
    latest = INT64_MAX - meta.horizon * meta.bar_interval_ns
    if s.timestamp_ns.max() > latest:  # one reduction on the good path; the row is found only when needed
        row = int(np.flatnonzero(s.timestamp_ns > latest)[0])
        raise RequestError(f"{_label(i, s.symbol)}: column 'timestamp_ns', row {row}: {int(s.timestamp_ns[row])} is "
                           f"past the last time this model can forecast from ({latest} ns, {meta.horizon} bars before "
                           "the int64 limit in the year 2262); send UTC nanoseconds since the Unix epoch",
                           _field(i, "timestamp_ns"))


def _check_known_front(i: int, s: SeriesColumns, meta: ModelMeta) -> None:
    """A calendar-rolled model's forecast bars need a front among the contracts whose expirations it knows."""
    try:
        future_known(s.timestamp_ns[-1:], meta.feature_config, meta.bar_interval_ns, np.array([s.root or s.symbol]))
    except ValueError as exc:
        raise RequestError(f"{_label(i, s.symbol)}: {exc}", _field(i, "timestamp_ns")) from None


def daily_bars(ts: np.ndarray, interval_ns: int) -> bool:
    """Whether one window's (increasing) timestamps are daily bars sent to an intraday model: most gaps at
    least a day and COARSE_INTERVALS intervals, most bars at one or two times of day (daylight saving)."""
    far, gaps = max(NS_PER_DAY, COARSE_INTERVALS * interval_ns), ts.shape[0] - 1
    if int(ts[-1]) - int(ts[0]) < (gaps // 2 + 1) * far:  # too short a span for most gaps to be that long
        return False
    if 2 * int(np.count_nonzero(np.diff(ts) >= far)) <= gaps:  # a difference that overflows is < 0
        return False
    _, at = np.unique(ts % NS_PER_DAY, return_counts=True)
    return 2 * int(np.sort(at)[-2:].sum()) > ts.shape[0]


def _check_spacing(i: int, s: SeriesColumns, meta: ModelMeta) -> None:
    """Most gaps between the bars the model reads must be at least half its bar interval (closer bars are
    timestamps in another unit or finer bars); wider gaps are served, short of daily bars (`daily_bars`)."""
    interval = meta.bar_interval_ns
    ts = s.timestamp_ns[-meta.bars_required:]  # strictly increasing; + half cannot overflow (_check_time_range)
    too_close = 2 * int(np.count_nonzero(ts[1:] < ts[:-1] + interval // 2)) > ts.shape[0] - 1
    if not too_close and not daily_bars(ts, interval):
        return
    typical = int(np.median(np.diff(ts)))
    if not too_close:  # daily bars
        fix = "; send bars of the model's size: forecast steps would be read as the model's bars"
    elif int(ts[-1]) < PLAUSIBLE_NS:  # times before 1973 spaced as the model's bars in another unit: named with it
        unit = next((f"; these look like {UNIT_NAMES[u]}: multiply them by {NS_PER_UNIT[u]:,}"
                     for u in ("s", "ms", "us") if interval <= 2 * typical * NS_PER_UNIT[u] <= 4 * interval), "")
        fix = f"{unit}; send timestamp_ns in UTC nanoseconds since the Unix epoch (seconds x 1e9), and bars of the " \
              "model's size"
    else:  # times of this era: bars of a finer size
        fix = f"; send bars of the model's size (resample these to {_span(interval)} bars)"
    raise RequestError(f"{_label(i, s.symbol)}: bars are {_span(typical)} apart (the median gap of the last "
                       f"{ts.shape[0]} bars), but this model's bars are {_span(interval)} apart "
                       f"(GetModelInfo.bar_interval_ns = {interval}){fix}", _field(i, "timestamp_ns"))


def _span(ns: int) -> str:
    """A duration as people read it: 60 s, 1.5 ms, 60 ns."""
    for unit, size in (("d", NS_PER_DAY), ("h", 3_600_000_000_000), ("min", 60_000_000_000), ("s", 1_000_000_000),
                       ("ms", 1_000_000), ("µs", 1_000)):
        if abs(ns) >= size:
            return f"{ns / size:g} {unit}"
    return f"{ns} ns"


def _looks_valid(s: SeriesColumns, user_columns: Sequence[str], starts: np.ndarray | None = None) -> bool:
    """features.bars.rules_hold for the series' bars and the user columns the model reads."""
    user = s.user_matrix(user_columns) if user_columns else None
    return rules_hold(s.timestamp_ns, s.open, s.high, s.low, s.close, s.volume, user, starts)


def _value_problems(i: int, s: SeriesColumns, user_columns: tuple[str, ...], label: str = "") -> list[Problem]:
    n = len(s)
    part = {"timestamp": s.timestamp_ns, "timestamp_null": np.zeros(n, dtype=bool),
            "symbol": np.full(n, s.symbol, dtype=object), "symbol_absent": np.zeros(n, dtype=bool),
            "open": s.open, "high": s.high, "low": s.low,
            "close": s.close, "volume": s.volume} | {f"user:{u}": s.user[u] for u in user_columns}
    return [_for_the_wire(p) for p in validate([part], [label or _label(i, s.symbol)], WIRE_COLUMNS, user_columns)]


# rule id -> (the rule, None for the file's wording; the fix) where a file's wording does not fit a request
SEND_BARS_IN_ORDER = "send the bars oldest first, one per timestamp"
SEND_USABLE_USER_VALUES = "send a finite value within float32's range for every bar, as in the training data"
REQUEST_WORDING: dict[str, tuple[str | None, str]] = {
    "nan": ("{column} is NaN", "send a finite {column} for every bar"),
    "not_positive": (None, "send positive prices (back-adjusted continuous contracts must be shifted to positive "
                           "prices)"),
    "placeholder": (None, "send the bar's real {column}"),
    "price_units": (None, "send every bar's prices in one unit, the one the model was trained on"),
    "bad_print": (None, "send the bar's real prices, or leave the bar out"),
    "user_not_finite": (None, SEND_USABLE_USER_VALUES),
    "user_beyond_float32": (None, SEND_USABLE_USER_VALUES),
    "timestamps_decrease": ("timestamps decrease (rule: strictly increasing)", SEND_BARS_IN_ORDER),
    "duplicate_timestamp": ("duplicate timestamp (rule: strictly increasing)", SEND_BARS_IN_ORDER),
}


def _for_the_wire(p: Problem) -> Problem:
    """A problem as a request is told it (REQUEST_WORDING), else as a file is."""
    if (wording := REQUEST_WORDING.get(p.rule_id)) is None:
        return p
    rule, fix = wording
    return dataclasses.replace(p, rule=p.rule if rule is None else rule.format(column=p.column),
                               fix=fix.format(column=p.column))


def _check_values(i: int, s: SeriesColumns, user_columns: tuple[str, ...], label: str = "") -> None:
    """Series i's bars by `features.bars.rules_hold`; when a rule fails, a RequestError listing the first
    MAX_PROBLEMS broken rules `validate` names (`label`: the series' name in them, else `series[i] (symbol)`)."""
    if _looks_valid(s, user_columns) or not (problems := _value_problems(i, s, user_columns, label)):
        return
    more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
    user_field = "user_features_raw" if isinstance(s.user, ColumnBlock) else "user_features"
    raise RequestError("; ".join(str(p) for p in problems[:MAX_PROBLEMS]) + more, violations=[
        (_field(i, p.column if p.column in BAR_COLUMNS else user_field), str(p)) for p in problems[:MAX_PROBLEMS]])


def _validated(i: int, s: SeriesColumns, meta: ModelMeta) -> SeriesColumns:
    """Series i (its identity already checked) as the model reads it; or the RequestError that says what to fix."""
    config = meta.feature_config
    _check_shape(i, s, meta)
    if config.has_user_inputs:
        _check_covariates(i, s, meta)
    s.notes = _ignored(s, meta)
    if s.contracts is not None:
        s = _front_series(i, s, meta)
    _check_time_range(i, s, meta)
    if config.contract_known:
        _check_known_front(i, s, meta)
    _check_values(i, s, config.series_reals)
    _check_spacing(i, s, meta)
    return s


def _front_series(i: int, s: SeriesColumns, meta: ModelMeta) -> SeriesColumns:
    """The continuous series of a series' per-contract bars, by the model's roll rule (`features.rolls`): its
    front contract's bars, their roll offsets and the roll rule's volume."""
    label, cfg = _label(i, s.symbol), meta.contracts
    assert s.contracts is not None
    if cfg is None:
        raise RequestError(f"{label}: contracts sent, but this model was not trained on futures contracts "
                           "(GetModelInfo.roll_rule is empty); send one series' bars without contracts",
                           _field(i, "contracts"))
    names, code = contract_codes(s.contracts)
    if problem := foreign_contract(names, s.root, cfg):
        raise RequestError(f"{label}: {problem}", _field(i, "contracts"))
    _check_each_contract(i, s, names, code, meta)
    try:
        front = front_rows(s.timestamp_ns, code, names, s.open, s.close, s.volume, cfg,
                           meta.feature_config.calendar_tz, s.root)
    except ValueError as exc:
        raise RequestError(f"{label}: {exc}", _field(i, "contracts")) from None
    rolled = s.take(front.rows)
    rolled.volume, rolled.log_offset = front.volume, front.log_offset
    rolled.notes = (*rolled.notes, *_rolls_against_open(front, names, code, len(rolled) - meta.bars_required))
    if len(rolled) < meta.bars_required:
        raise RequestError(f"{label}: the roll rule keeps {len(rolled)} of the {len(s)} bars sent (the front "
                           f"contract's), the model needs at least {meta.bars_required}; send more of the front "
                           "contract's bars (GetModelInfo.bars_required, roll_rule)", _field(i, "timestamp_ns"))
    return rolled


def _rolls_against_open(front: Front, names: list[str], code: np.ndarray, first_read: int) -> list[str]:
    """Forecast.warnings for the rolls in the bars the model reads (from the rolled series' `first_read`) whose
    new contract's previous bar was not sent: training takes the roll's step from that bar's close, this
    request from the roll bar's open, so the forecast differs from the one the same bars give in training."""
    notes = []
    for k in front.against_open:
        if k > first_read:
            row = int(front.rows[k])
            new, old = names[int(code[row])], names[int(code[int(front.rows[k - 1])])]
            notes.append(f"roll {old} -> {new}: no bar of {new} before its first bar as front was sent, so the roll's "
                         f"return is taken against that bar's open; send {new}'s previous bar (its contract name "
                         "with it) to forecast as training does")
    return notes


def _check_each_contract(i: int, s: SeriesColumns, names: list[str], code: np.ndarray, meta: ModelMeta) -> None:
    """Each contract's bars keep the bar contract, timestamps increasing: checked at once on the bars grouped by
    contract (in the order sent), then contract by contract only to name the one at fault."""
    user_columns = meta.feature_config.series_reals
    order = np.argsort(code, kind="stable")
    grouped, sorted_code = s.take(order), code[order]
    if _looks_valid(grouped, user_columns, starts=np.flatnonzero(sorted_code[1:] != sorted_code[:-1]) + 1):
        return
    bounds = np.searchsorted(sorted_code, np.arange(len(names) + 1))
    for k, name in enumerate(names):
        own = grouped.take(slice(bounds[k], bounds[k + 1]))
        _check_values(i, own, user_columns, f"{_label(i, s.symbol)}, contract {bounded(name)}")


def parse_request(request: pb.PredictRequest, meta: ModelMeta) -> list[SeriesColumns]:
    """The request's series as checked numpy columns, trimmed to the bars the model reads. Series by series, each
    within the limits (`serving.limits`) before its arrays are built: the work stops at the first bad one, at the
    latest one past the model's symbols (each at most once)."""
    if not request.series:
        raise RequestError(f"empty request: PredictRequest.series is empty; send at least one series with its most "
                           f"recent {meta.bars_required} bars", "series")
    config, seen = meta.feature_config, dict[str, int]()
    out = []
    for i, wire in enumerate(request.series):
        check_series_fields(wire, i, meta.horizon)
        s = columns_from_proto(wire, i)
        _check_identity(i, s, meta, seen)
        s = _validated(i, s, meta)
        out.append(s.tail(meta.bars_required, config.series_reals, config.series_categoricals))
    return out
