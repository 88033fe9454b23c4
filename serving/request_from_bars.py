"""A served model's PredictRequest from a bars file: the latest bars it needs of one symbol, read as the model
reads bars (features.series), with the user columns its GetModelInfo names. `python -m serving.client` is this
over a channel; a strategy engine calls `request_from_bars` alike.

A futures model (GetModelInfo.roll_rule set) takes a root's bars per contract, each with its contract's name, for
the server to roll by the model's rule, or one contract's own bars. Refused's messages name the arguments as the
client's flags (`origin` is --origin, `future` --future).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from features.bars import (
    BarDataError,
    Bars,
    ColumnMap,
    labels_type,
    lacks_a_column,
    numeric,
    timestamps_ns,
    unusable_user_rows,
    unusable_values,
)
from features.calendar import sessions
from features.check import format_timestamp
from features.compute import check_static
from features.config import FeatureConfig
from features.contracts import ContractConfig, ContractFlags
from features.schema import Kind
from features.series import read_contract_bars, reading, scan
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.score import ScoreError, parse_time
from serving.wire import make_series


class Refused(ValueError):
    """Why the bars make no request for the model: one message for the user."""

    def __init__(self, message: str, lacks_a_column: bool = False) -> None:
        super().__init__(message)
        self.lacks_a_column = lacks_a_column  # the bars lack a column that the column names name


@dataclass
class FutureValues:
    """The known columns' values for the H bars after the origin."""

    reals: dict[str, np.ndarray] = field(default_factory=dict)  # known real column -> float64 [H]
    labels: dict[str, np.ndarray] = field(default_factory=dict)  # known categorical column -> str [H]


def trained_columns(info: pb.ModelInfo) -> dict[str, str]:
    """The training run's bar column names by ColumnMap field (GetModelInfo.bar_columns)."""
    return {k: v for k, v in info.bar_columns.items() if k in ColumnMap.__dataclass_fields__}


def feature_config(info: pb.ModelInfo, contracts: ContractConfig | None = None) -> FeatureConfig:
    """The served model's user columns by role and kind (GetModelInfo.features), in the model's order."""
    user = [f for f in info.features if f.source == "user"]
    role = {r: tuple(f.name for f in user if f.role == r)
            for r in (pb.FEATURE_ROLE_OBSERVED, pb.FEATURE_ROLE_KNOWN, pb.FEATURE_ROLE_STATIC)}
    return FeatureConfig(horizon=info.horizon, calendar_tz=info.calendar_tz or "UTC",
                         user_columns=role[pb.FEATURE_ROLE_OBSERVED], known_columns=role[pb.FEATURE_ROLE_KNOWN],
                         static_columns=role[pb.FEATURE_ROLE_STATIC], contracts=contracts,
                         categorical_columns=tuple(f.name for f in user if f.kind == Kind.CATEGORICAL.value))


def request_from_bars(path: str | Path, info: pb.ModelInfo, symbol: str | None = None, *,
                      columns: ColumnMap | None = None, origin: str | None = None, future: str | Path | None = None,
                      contracts: ContractFlags | None = None, packed: bool = False,
                      explain: bool = False) -> pb.PredictRequest:
    """The request for the bars of `symbol` (default: the model's only one) at `path` up to `origin` (ISO 8601,
    UTC; default: its latest bar): the latest bars_required of them with the user columns the model reads, and
    the known columns' values for the H bars after it, from the `future` parquet file (symbol, timestamp and
    those columns) when given, else from the bars. `columns`: the bars' column names (default: the training
    run's); `contracts`: how a futures model's bars name contracts and roots; `packed`: the real user columns as
    one block (user_features_raw). Refused says why there is none."""
    if explain and not info.explain_available:
        raise Refused("--explain: the server's model was exported without explain outputs (export --no-explain); "
                      "drop --explain, or serve a model exported with them")
    cmap = columns or ColumnMap.from_dict(trained_columns(info))
    cfg = _contracts(path, info, cmap, contracts or ContractFlags())
    symbol = _symbol(info, symbol, cfg)
    fc = feature_config(info, cfg)
    if future and not fc.known_columns:
        raise Refused("--future: the server's model has no known features, so it takes no future values; leave "
                      "--future out")
    bars = symbol_bars(path, info, symbol, cmap, fc)
    last = _origin_row(path, info, bars, symbol, origin)
    n = info.bars_required if bars.contract is None else _rows_to_send(path, info, bars, last, origin)
    _check_sent(path, fc, bars, slice(last + 1 - n, last + 1), symbol, origin)
    after = None
    if fc.known_columns:
        when = f"the {fc.horizon} bars after {format_timestamp(int(bars.timestamp_ns[last]))}"
        after = read_future(Path(future), cmap, symbol, int(bars.timestamp_ns[last]), fc, when) if future \
            else _future_in_bars(path, fc, bars, symbol, last, when)
    series = series_from_bars(bars, symbol, n, fc, packed=packed, last=last, future=after)
    return pb.PredictRequest(series=[series], explain=explain)


def series_from_bars(bars: Bars, symbol: str, n: int, fc: FeatureConfig | None = None, *, packed: bool = False,
                     last: int | None = None, future: FutureValues | None = None) -> pb.Series:
    """The `n` bars of `symbol` up to row `last` (default: its latest) as a request Series, each with its
    contract's name where `bars` has them (Bars.contract). `fc` names the user columns sent: the reals and labels
    per bar, the static values (at row `last`); `future` holds the known columns' values after it. `packed` sends
    the real columns as one float64 block (user_features_raw), far cheaper for wide models."""
    fc = fc or FeatureConfig()
    rows = bars.series_slices()[symbol]
    stop = rows.stop if last is None else last + 1
    sl = slice(max(rows.start, stop - n), stop)
    static = {c: str(bars.labels[c][stop - 1]) if c in fc.categorical_columns else float(bars.user[c][stop - 1])
              for c in fc.static_columns}
    future = future or FutureValues()
    return make_series(symbol, bars.timestamp_ns[sl], bars.open[sl], bars.high[sl], bars.low[sl], bars.close[sl],
                       bars.volume[sl], {u: bars.user[u][sl] for u in fc.series_reals}, packed=packed,
                       labels={c: bars.labels[c][sl] for c in fc.series_categoricals}, static=static,
                       future=future.reals, future_labels=future.labels,
                       contracts=None if bars.contract is None else bars.contract[sl])


def symbol_bars(path: str | Path, info: pb.ModelInfo, symbol: str, columns: ColumnMap, fc: FeatureConfig) -> Bars:
    """The bars of `symbol` alone, at least bars_required: every contract of a futures root as one series, each
    bar's contract in Bars.contract, else the symbol's own (a contract's by its name). User values are checked in
    the bars sent only (request_from_bars), so that an indicator's warm-up NaN in the first rows stops nothing."""
    cfg = fc.contracts if symbol in info.symbols else None  # a root: every contract, for the server to roll
    mapped, plain = reading(columns, fc.contracts)[0], replace(fc, contracts=None)  # a contract's name: the symbol
    try:
        bars = read_contract_bars(path, *((columns, fc) if cfg is not None else (mapped, plain)), symbols=[symbol],
                                  check_user_values=False)
    except BarDataError as exc:
        raise Refused("\n".join([f"{path}: {len(exc.problems)} problem(s) in the {symbol} bars:",
                                 *(f"  {line}" for line in exc.lines())]), lacks_a_column(exc.problems)) from None
    if cfg is not None:
        bars = root_bars(bars, symbol, cfg)
    if symbol not in bars.series_slices():
        try:  # which symbols the file has, for the message
            present = list(read_contract_bars(path, mapped, plain).series_slices())
        except BarDataError:
            present = []
        has = f" (it has {', '.join(present)}){mapped.one_series_hint(path, symbol)}" if present else ""
        raise Refused(f"symbol {symbol!r} not in {path}{has}")
    if len(bars) < info.bars_required:
        raise Refused(f"{path} has {len(bars)} bars of {symbol}; the model needs the latest {info.bars_required} "
                      "(GetModelInfo.bars_required): give more history")
    try:  # the request carries one value of each static column
        check_static(bars, fc, bars.series_bounds())
    except ValueError as exc:
        raise Refused(f"{path}: {exc}") from None
    return bars


def root_bars(bars: Bars, root: str, cfg: ContractConfig) -> Bars:
    """The bars of `root`'s contracts (`bars` as read per contract: the symbol is the contract) as one series
    named `root`, in time order and, at one time, by contract name; each row's contract in Bars.contract."""
    names = bars.symbol.astype(str)  # [N]
    if cfg.root_column:
        roots = np.asarray(bars.labels[cfg.root_column]).astype(str)
    else:
        unique, inverse = np.unique(names, return_inverse=True)
        roots = np.array([cfg.root_of(str(u)) or "" for u in unique], dtype=str)[inverse.reshape(-1)]
    rows = np.flatnonzero(roots == root)
    rows = rows[np.lexsort((names[rows], bars.timestamp_ns[rows]))]  # [n]
    return replace(bars.take(rows), symbol=np.full(rows.size, root, dtype=object), contract=names[rows])


def _contracts(path: str | Path, info: pb.ModelInfo, columns: ColumnMap,
               flags: ContractFlags) -> ContractConfig | None:
    """How a futures model's bars name their contracts; None for a model without a roll rule, or bars whose names
    are no contract names (one continuous series each, sent as they are)."""
    if not info.roll_rule:
        if flags.contract_col or flags.roots:
            raise Refused("--contract-col/--roots: the server's model was not trained on futures contracts "
                          "(GetModelInfo.roll_rule is empty); leave them out")
        return None
    try:
        return scan(path, columns, flags)
    except ValueError as exc:
        raise Refused(f"{path}: {exc}") from None
    except (OSError, pa.ArrowException):  # the bars' read names the file it cannot read
        return None


def _symbol(info: pb.ModelInfo, symbol: str | None, contracts: ContractConfig | None) -> str:
    """The symbol to send: `symbol`, a futures model's root or a contract of one, or the model's only one."""
    if symbol is None:
        if len(info.symbols) != 1:
            raise Refused(f"--symbol: the model knows {', '.join(info.symbols)}; name the one to forecast")
        return str(info.symbols[0])
    futures = bool(info.roll_rule) and (contracts or ContractConfig()).root_of(symbol) in info.symbols
    if info.symbols and symbol not in info.symbols and not futures:
        contract = " or a contract of one" if info.roll_rule else ""
        raise Refused(f"the model does not know symbol {symbol!r} (it knows {', '.join(info.symbols)}{contract})")
    return symbol


def _origin_row(path: str | Path, info: pb.ModelInfo, bars: Bars, symbol: str, origin: str | None) -> int:
    """The row of the forecast's last bar: the latest, or the last at or before `origin`."""
    if origin is None:
        return len(bars) - 1
    try:
        origin_ns = parse_time(origin, "--origin")
    except ScoreError as exc:
        raise Refused(str(exc)) from None
    up_to = int(np.searchsorted(bars.timestamp_ns, origin_ns, side="right"))  # bars at or before it
    if up_to < info.bars_required:
        raise Refused(f"--origin {origin}: {path} has {up_to} bars of {symbol} up to it; the model needs the latest "
                      f"{info.bars_required} (GetModelInfo.bars_required): give a later --origin")
    return up_to - 1


def _rows_to_send(path: str | Path, info: pb.ModelInfo, bars: Bars, last: int, origin: str | None) -> int:
    """How many of a root's per-contract rows up to row `last` to send: those from the session before the one
    holding the latest `bars_required` bar times on, so that the server's roll rule (which reads the session
    before) chooses each session's front from whole sessions, as training did."""
    ts = bars.timestamp_ns[:last + 1]  # one series, in time order
    times = np.unique(ts)
    if times.size < info.bars_required:
        raise Refused(f"{path} has {times.size} bar times of {bars.symbol[0]}'s contracts"
                      f"{' up to --origin' if origin else ''}; the model needs the latest {info.bars_required} "
                      "(GetModelInfo.bars_required): give more history")
    session = sessions(ts, info.calendar_tz or "UTC")  # [last + 1], non-decreasing
    days = np.unique(session)
    start = int(np.searchsorted(days, session[np.searchsorted(ts, times[-info.bars_required])]))
    first = days[max(start - 1, 0)]  # the session before, with bars (a weekend or holiday has none)
    return int(last + 1 - np.searchsorted(session, first))


def _check_sent(path: str | Path, fc: FeatureConfig, bars: Bars, sent: slice, symbol: str, origin: str | None) -> None:
    """Refused when a real user column is NaN, infinite or past float32's range in a bar sent."""
    if (bad := np.flatnonzero(unusable_user_rows(bars)[sent])).size:
        unusable = [u for u in fc.real_columns if unusable_values(bars.user[u][sent]).any()]
        raise Refused(f"{path}: user feature column(s) {', '.join(unusable)} NaN, infinite or past float32's range "
                      f"in {bad.size} of the latest {sent.stop - sent.start} {symbol} bars"
                      f"{' up to --origin' if origin else ''}, which a forecast sends (the first at "
                      f"{format_timestamp(int(bars.timestamp_ns[sent][bad[0]]))}); the model reads finite values in "
                      "every bar: fill them in")


def _future_in_bars(path: str | Path, fc: FeatureConfig, bars: Bars, symbol: str, last: int,
                    after: str) -> FutureValues:
    """The known columns' values for the H bars after row `last` (`after` says which), from the bars."""
    later = np.arange(last + 1, len(bars))  # a futures root's rows: each later time once, its first contract's
    ahead = later[np.unique(bars.timestamp_ns[later], return_index=True)[1]][:fc.horizon]
    if ahead.size < fc.horizon:
        raise _too_few(fc, after, f"{path} has {ahead.size} {symbol} bar(s) after it: give them with --future FILE "
                       f"(symbol, timestamp and {', '.join(fc.known_columns)} of the next {fc.horizon} bars)")
    reals = {c: bars.user[c][ahead] for c in fc.known_reals}
    if bad := [c for c, v in reals.items() if unusable_values(v).any()]:
        raise Refused(f"{path}: known feature column(s) {', '.join(bad)} NaN, infinite or past float32's range in "
                      f"{after}, which a forecast sends: fill them in")
    return FutureValues(reals, {c: bars.labels[c][ahead] for c in fc.known_categoricals})


def read_future(path: Path, columns: ColumnMap, symbol: str, after_ns: int, fc: FeatureConfig,
                after: str) -> FutureValues:
    """The first H rows of `symbol` after `after_ns` (`after` says which) in a parquet file of the known columns."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise Refused(f"--future {path}: cannot read it as a parquet file ({exc})") from None
    if missing := [c for c in (columns.timestamp, *fc.known_columns) if c not in table.column_names]:
        raise Refused(f"--future {path}: no column {', '.join(missing)}; it needs {columns.timestamp}, "
                      f"{columns.symbol} and the known features {', '.join(fc.known_columns)}")
    if columns.symbol in table.column_names:
        table = table.filter(pc.equal(table.column(columns.symbol).cast(pa.string()), symbol))
    ts, problem = timestamps_ns(table.column(columns.timestamp), f"--future {path}", columns.timestamp,
                                columns.time_unit)
    if problem is not None or ts is None:
        raise Refused(str(problem))
    order = np.argsort(ts, kind="stable")
    rows = order[ts[order] > after_ns][:fc.horizon]
    if rows.size < fc.horizon:
        raise _too_few(fc, after, f"--future {path} has {rows.size} {symbol} row(s) after it: give "
                       f"{', '.join(fc.known_columns)} of the next {fc.horizon} bars")
    future = FutureValues()
    for c in fc.known_columns:
        _future_column(path, c, table.column(c).take(pa.array(rows)), c in fc.categorical_columns, future, after)
    return future


def _too_few(fc: FeatureConfig, after: str, source: str) -> Refused:
    """The refusal of a forecast whose known features lack future values, naming the first known column."""
    return Refused(f"known feature {fc.known_columns[0]!r}: the model needs its values for {after} (the forecast's "
                   f"{fc.horizon} steps), and {source}")


def _future_column(path: Path, name: str, values: pa.ChunkedArray, categorical: bool, into: FutureValues,
                   after: str) -> None:
    """One known column's future values into `into`; Refused for nulls, the wrong type or unusable reals."""
    where = f"--future {path}: known feature {name!r}"
    if values.null_count:
        raise Refused(f"{where} is null in {values.null_count} of {after}: fill in every value")
    if categorical:
        if not labels_type(values.type):
            raise Refused(f"{where} has type {values.type}; give its labels as text or integers, as in training")
        into.labels[name] = np.asarray(values.cast(pa.string()).to_numpy(zero_copy_only=False), dtype=object)
        return
    if not numeric(values.type):
        raise Refused(f"{where} has type {values.type}; give numbers")
    into.reals[name] = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)
    if unusable_values(into.reals[name]).any():
        raise Refused(f"{where} is NaN, infinite or past float32's range in {after}: fill it in")
