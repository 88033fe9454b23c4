"""`python -m serving.client --target HOST:PORT --parquet bars.parquet --symbol ES`: print a forecast.

Asks the server what the model needs (GetModelInfo), reads the bars with the column names the model was
trained from (the mapping flags given here win), sends the latest `bars_required` bars of the symbol (those up
to `--origin`) and prints a table: per horizon step, the nominal bar time and the quantiles of cumulative log
return and of price. A model with user features also gets each categorical's labels per bar, each static
feature's value once, and each known feature's values for the H bars after the origin: from `--future FILE`
when given, else from the bars file's H bars after the origin.

A futures model (GetModelInfo.roll_rule set) forecasts roots from per-contract bars (ESH5, ESM5, ...): `--symbol
ESU5` sends that contract's own bars (the server forecasts its root), `--symbol ES` the bars of every ES contract
with each bar's contract name, from the session before the latest `bars_required` bar times on, for the server to
roll by the model's rule. `--contract-col` and `--roots` read the names as the training run did.

Exit status: 0 done; 2 bad arguments, bars, or TLS/token files; 1 the server answered an error or could not be
reached (the status code and message are printed); 130 interrupted; 141 the reader of the output went away.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from google.protobuf import json_format

from features.bars import (
    BarDataError,
    Bars,
    ColumnMap,
    column_names,
    labels_type,
    lacks_a_column,
    numeric,
    read_bars,
    timestamps_ns,
    unusable_user_rows,
    unusable_values,
)
from features.calendar import sessions
from features.check import format_timestamp, series_bounds
from features.compute import check_static
from features.config import FeatureConfig
from features.contracts import ContractConfig, ContractFlags
from features.files import reader_went_away
from features.series import reading, scan
from serving.errors import ConfigError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.score import ScoreError, parse_time
from serving.security import (
    add_client_arguments,
    call_metadata,
    check_client_arguments,
    first_call_error,
    open_channel,
)
from serving.wire import ExplanationArrays, forecast_arrays, make_series


@dataclass(frozen=True)
class UserInputs:
    """What the served model asks of each series beyond the bars (GetModelInfo.features, source user)."""

    reals: tuple[str, ...] = ()  # real columns sent per bar: observed, then known (user_feature_columns)
    labels: tuple[str, ...] = ()  # categorical columns sent per bar: observed, then known
    static: tuple[str, ...] = ()  # columns sent once per series: reals and categoricals
    known: tuple[str, ...] = ()  # columns whose values for the H bars after the origin are sent too
    categorical: frozenset[str] = frozenset()

    @staticmethod
    def of(info: pb.ModelInfo) -> UserInputs:
        user = [f for f in info.features if f.source == "user"]
        categorical = frozenset(f.name for f in user if f.kind == "categorical")
        return UserInputs(reals=tuple(info.user_feature_columns),
                          labels=tuple(f.name for f in user if f.role != pb.FEATURE_ROLE_STATIC
                                       and f.name in categorical),
                          static=tuple(f.name for f in user if f.role == pb.FEATURE_ROLE_STATIC),
                          known=tuple(f.name for f in user if f.role == pb.FEATURE_ROLE_KNOWN),
                          categorical=categorical)

    @property
    def real_columns(self) -> tuple[str, ...]:
        """The real columns to read from the bars: those sent per bar, then the static reals."""
        return self.reals + tuple(c for c in self.static if c not in self.categorical)

    @property
    def label_columns(self) -> tuple[str, ...]:
        """The categorical columns to read from the bars: those sent per bar, then the static ones."""
        return self.labels + tuple(c for c in self.static if c in self.categorical)


@dataclass
class FutureValues:
    """The known columns' values for the H bars after the origin."""

    reals: dict[str, np.ndarray] = field(default_factory=dict)  # known real column -> float64 [H]
    labels: dict[str, np.ndarray] = field(default_factory=dict)  # known categorical column -> str [H]


def series_from_bars(bars: Bars, symbol: str, n: int, user_columns: tuple[str, ...] | list[str] = (),
                     packed: bool = False, *, last: int | None = None, inputs: UserInputs | None = None,
                     future: FutureValues | None = None, contracts: np.ndarray | None = None) -> pb.Series:
    """The `n` bars of `symbol` up to row `last` (default: its latest) as a request Series; `packed` sends the
    user columns as one float64 block (user_features_raw), far cheaper for wide models. `inputs` adds the
    labels per bar and the static values (at row `last`); `future` the known columns' future values;
    `contracts` (str [N], each row's contract) the contract name of each bar sent."""
    rows = bars.series_slices()[symbol]
    stop = rows.stop if last is None else last + 1
    sl = slice(max(rows.start, stop - n), stop)
    inputs = inputs or UserInputs()
    static = {c: str(bars.labels[c][stop - 1]) if c in inputs.categorical else float(bars.user[c][stop - 1])
              for c in inputs.static}
    future = future or FutureValues()
    return make_series(symbol, bars.timestamp_ns[sl], bars.open[sl], bars.high[sl], bars.low[sl], bars.close[sl],
                       bars.volume[sl], {u: bars.user[u][sl] for u in user_columns}, packed=packed,
                       labels={c: bars.labels[c][sl] for c in inputs.labels}, static=static,
                       future=future.reals, future_labels=future.labels,
                       contracts=None if contracts is None else contracts[sl])


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def format_forecast(f: pb.Forecast) -> str:
    """A fixed-width table: one row per horizon step."""
    a = forecast_arrays(f)
    levels = a.quantile_levels.tolist()
    head = ["h", "time (UTC)"] + [f"ret q{lv:g}" for lv in levels] + [f"price q{lv:g}" for lv in levels]
    rows = [[str(h + 1), _time(int(a.timestamp_ns[h]))] + [f"{x:+.6f}" for x in a.log_return[h]]
            + [f"{x:.4f}" for x in a.price[h]] for h in range(len(a.timestamp_ns))]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    title = f"{a.symbol}  model {a.model_version}  last bar {_time(a.last_timestamp_ns)} UTC  close {a.last_close:.4f}"
    lines = [title,
             "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("ret: cumulative log return from the last close; time: nominal, step h is the h-th next bar")
    if a.explanation is not None:
        lines += format_explanation(a.explanation)
    return "\n".join(lines)


def format_explanation(e: ExplanationArrays, top: int = 5) -> list[str]:
    """Each group's `top` variables by mean selection weight, and the past bars the attention weighs most,
    averaged over the horizon steps (the forecast steps' own share as one figure)."""
    lines = []
    for label, w in (("static", e.static), ("encoder", e.encoder), ("decoder", e.decoder)):
        mean = w.weights.mean(axis=0, dtype=np.float64)  # [variables]
        order = np.argsort(-mean, kind="stable")[:top]
        lines.append(f"{label} variables: " + ", ".join(f"{w.variables[i]} {mean[i]:.0%}" for i in order))
    attention = e.attention.mean(axis=0, dtype=np.float64)  # [encoder bars + horizon]
    past = e.attention.shape[1] - e.attention.shape[0]  # the encoder's bars; then one column per horizon step
    order = np.argsort(-attention[:past], kind="stable")[:top]
    lines.append("attention to past bars: "
                 + ", ".join(f"{_time(int(e.attention_timestamp_ns[i]))} {attention[i]:.0%}" for i in order)
                 + f" (forecast steps: {attention[past:].sum():.0%})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m serving.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="server HOST:PORT, or any target gRPC takes (default 127.0.0.1:50051)")
    p.add_argument("--parquet", help="bars: a parquet file or a directory of them (required unless --info)")
    p.add_argument("--symbol", help="symbol to forecast (one of the model's symbols; needed unless the model knows "
                                    "only one, or --info)")
    p.add_argument("--info", action="store_true",
                   help="print what the server's model needs and where it runs (GetModelInfo), and nothing else")
    p.add_argument("--explain", action="store_true",
                   help="also ask for attention and variable weights (a summary under the table; all with --json)")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call in seconds (default 10)")
    p.add_argument("--packed", action="store_true",
                   help="send the user feature columns as one packed float64 block (user_features_raw)")
    p.add_argument("--origin", help="forecast from the symbol's last bar at or before this time, ISO 8601 UTC "
                                    "(default: its latest bar)")
    p.add_argument("--future", help="parquet file of the known features' values for the bars after the origin: "
                                    "symbol, timestamp and the known columns (a model with known features needs "
                                    "them where the bars file ends at the origin)")
    ColumnMap.add_arguments(p, "a name not given is the served model's training run's, from GetModelInfo")
    g = p.add_argument_group("futures contracts (a model trained on per-contract bars; as its training run read them)")
    g.add_argument("--contract-col", metavar="NAME",
                   help="column of raw contract names, e.g. ESH5 (default: the symbol column)")
    g.add_argument("--roots", metavar="FILE|COLUMN",
                   help="contract -> root: a CSV file with a header row contract,root[,expiration], or a bars "
                        "column naming each bar's root (default: the month-code pattern, e.g. ESH5 -> ES)")
    add_client_arguments(p)
    args = p.parse_args(argv)
    check_client_arguments(p, args)
    if args.info:
        if args.parquet or args.symbol or args.explain or args.packed or args.origin or args.future \
                or ColumnMap.given(args) or args.contract_col or args.roots:
            p.error("--info prints the model's information alone: leave out --parquet, --symbol, --explain, "
                    "--packed, --origin, --future and the column and contract flags")
        return _interrupted_is_130(_info, args)
    if not args.parquet:
        p.error("the following arguments are required: --parquet (or --info for the model alone)")
    if not Path(args.parquet).exists():
        print(f"error: --parquet {args.parquet}: no such file or directory", file=sys.stderr)
        return 2
    return _interrupted_is_130(_forecast, args)


def _interrupted_is_130(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return command(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return reader_went_away()


def format_model_info(info: pb.ModelInfo) -> str:
    """What a caller needs to build a request, and which model answers it, one fact a line."""
    roles = {pb.FEATURE_ROLE_STATIC: "static", pb.FEATURE_ROLE_OBSERVED: "observed", pb.FEATURE_ROLE_KNOWN: "known"}
    by_role: dict[str, list[str]] = {}
    for f in info.features:
        by_role.setdefault(roles.get(f.role, "other"), []).append(f.name)
    labelled = [f for f in info.features if f.vocabulary]  # user categoricals: the labels seen in training
    facts = [
        ("model", f"{info.model_version} ({info.precision}), server {info.server_version}"),
        ("runs on", f"{info.provider} (--device {info.device_requested})"
         + (f"; FALLBACK: {info.fallback_warning}" if info.fallback_warning else "")),
        ("torch", "IMPORTED by the server process (it never should be)" if info.torch_imported
         else "not imported by the server process"),
        ("bars required", f"{info.bars_required} per series (encoder {info.encoder_length}), bar interval "
         f"{info.bar_interval_ns / 1e9:g} s"),
        ("forecast", f"{info.horizon} steps, quantiles {', '.join(f'{q:g}' for q in info.quantiles)}"),
        ("symbols", ", ".join(info.symbols)),
        *([("contracts", f"{info.roll_rule}; --symbol takes a root or any contract of one")] if info.roll_rule
          else []),
        ("user columns", ", ".join(info.user_feature_columns) or "(none)"),
        ("bar columns", ", ".join(f"{k}={v}" for k, v in sorted(info.bar_columns.items())) or "(not recorded)"),
        *((f"{role} features", ", ".join(names)) for role, names in by_role.items()),
        *([("labels", "; ".join(f"{f.name}: {', '.join(f.vocabulary)}" for f in labelled))] if labelled else []),
        ("calendar", f"time of day and day of week in {info.calendar_tz}"),
        ("limits", f"max batch {info.max_batch} windows, max message {info.max_message_bytes:,} bytes, "
         f"max concurrent {info.max_concurrent}"),
        ("explain", "available" if info.explain_available else "not in this model"),
        ("checksums", f"model {info.model_sha256[:12]}, checkpoint {info.checkpoint_sha256[:12]}"),
        ("calibration", _calibration(info)),
    ]
    width = max(len(label) for label, _ in facts) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in facts)


def _calibration(info: pb.ModelInfo) -> str:
    """The validation coverage before -> after the calibration folded into the model, or that there is none."""
    if not info.HasField("calibration"):
        return "none (the quantiles are the model's own)"
    c = info.calibration
    shares = [f"q{q:g} {b:.3f} -> {a:.3f}" for q, b, a in zip(info.quantiles, c.coverage_before, c.coverage_after,
                                                            strict=True)]
    nominal = info.quantiles[-1] - info.quantiles[0]
    return (f"{c.method} on {c.validation_windows} validation windows; coverage {', '.join(shares)}; "
            f"{nominal:.0%} interval {c.interval_coverage_before:.3f} -> {c.interval_coverage_after:.3f}")


def _connect(args: argparse.Namespace) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]] | None:
    """The channel and call metadata; None after printing why they cannot be made (bad TLS/token files)."""
    try:
        metadata = call_metadata(args)
        return open_channel(args.target, args), metadata
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _model_info(stub: pb_grpc.ForecasterStub, args: argparse.Namespace,
                metadata: tuple[tuple[str, str], ...]) -> pb.ModelInfo | None:
    """GetModelInfo, the first call; None after printing why it failed."""
    try:
        info: pb.ModelInfo = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout, metadata=metadata)
    except grpc.RpcError as exc:
        print(f"error: {first_call_error('GetModelInfo', exc, args.target)}", file=sys.stderr)
        return None
    return info


def _info(args: argparse.Namespace) -> int:
    connected = _connect(args)
    if connected is None:
        return 2
    channel, metadata = connected
    with channel:
        info = _model_info(pb_grpc.ForecasterStub(channel), args, metadata)
    if info is None:
        return 1
    print(json_format.MessageToJson(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
          if args.json else format_model_info(info))  # every field: a false torch_imported, no user columns
    return 0


class Refused(Exception):
    """What the client will not send, and why (exit 2)."""


def _forecast(args: argparse.Namespace) -> int:
    connected = _connect(args)
    if connected is None:
        return 2
    channel, metadata = connected
    with channel:
        stub = pb_grpc.ForecasterStub(channel)
        info = _model_info(stub, args, metadata)
        if info is None:
            return 1
        try:
            request = build_request(args, info)
        except Refused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            response = stub.Predict(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"error: Predict: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    for warning in (w for f in response.forecasts for w in f.warnings):  # e.g. bars further apart than the model's
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json_format.MessageToJson(response, preserving_proto_field_name=True))
    else:
        for forecast in response.forecasts:
            print(format_forecast(forecast))
    return 0


def build_request(args: argparse.Namespace, info: pb.ModelInfo) -> pb.PredictRequest:
    """The request for the symbol's bars up to the origin; Refused says why there is none."""
    if args.explain and not info.explain_available:
        raise Refused("--explain: the server's model was exported without explain outputs (export --no-explain); "
                      "drop --explain, or serve a model exported with them")
    contracts = _contracts(args, info)
    symbol = _symbol(args, info, contracts)
    inputs = UserInputs.of(info)
    if args.future and not inputs.known:
        raise Refused("--future: the server's model has no known features, so it takes no future values; leave "
                      "--future out")
    bars, names = _symbol_bars(args, info, symbol, inputs, contracts)
    last = _origin_row(args, info, bars, symbol)
    n = info.bars_required if names is None else _rows_to_send(args, info, bars, last)
    sent = slice(last + 1 - n, last + 1)
    if (bad := np.flatnonzero(unusable_user_rows(bars)[sent])).size:
        unusable = [u for u in inputs.real_columns if unusable_values(bars.user[u][sent]).any()]
        raise Refused(f"{args.parquet}: user feature column(s) {', '.join(unusable)} NaN, infinite or past float32's "
                      f"range in {bad.size} of the latest {n} {symbol} bars"
                      f"{' up to --origin' if args.origin else ''}, which a forecast sends (the first at "
                      f"{format_timestamp(int(bars.timestamp_ns[sent][bad[0]]))}); the model reads finite values in "
                      "every bar: fill them in")
    future = _future_values(args, info, inputs, bars, symbol, last) if inputs.known else None
    series = series_from_bars(bars, symbol, n, list(info.user_feature_columns), packed=args.packed, last=last,
                              inputs=inputs, future=future, contracts=names)
    return pb.PredictRequest(series=[series], explain=args.explain)


def _origin_row(args: argparse.Namespace, info: pb.ModelInfo, bars: Bars, symbol: str) -> int:
    """The row of the forecast's last bar: the symbol's latest, or its last at or before --origin."""
    rows = bars.series_slices()[symbol]
    if args.origin is None:
        return rows.stop - 1
    try:
        origin_ns = parse_time(args.origin, "--origin")
    except ScoreError as exc:
        raise Refused(str(exc)) from None
    up_to = int(np.searchsorted(bars.timestamp_ns[rows], origin_ns, side="right"))  # bars at or before it
    if up_to < info.bars_required:
        raise Refused(f"--origin {args.origin}: {args.parquet} has {up_to} bars of {symbol} up to it; the model needs "
                      f"the latest {info.bars_required} (GetModelInfo.bars_required): give a later --origin")
    return rows.start + up_to - 1


def _future_values(args: argparse.Namespace, info: pb.ModelInfo, inputs: UserInputs, bars: Bars, symbol: str,
                   last: int) -> FutureValues:
    """The known columns' values for the H bars after row `last`: from --future when given, else the bars."""
    h, rows = info.horizon, bars.series_slices()[symbol]
    after = f"the {h} bars after {format_timestamp(int(bars.timestamp_ns[last]))}"
    if args.future:
        return read_future(Path(args.future), _columns(args, info), symbol, int(bars.timestamp_ns[last]), inputs, h,
                           after)
    later = np.arange(last + 1, rows.stop)  # a futures root's rows: each later time once, its first contract's
    ahead = later[np.unique(bars.timestamp_ns[later], return_index=True)[1]][:h]
    if (have := ahead.size) < h:
        raise _too_few(inputs, after, h, f"{args.parquet} has {have} {symbol} bar(s) after it: give them with "
                       f"--future FILE (symbol, timestamp and {', '.join(inputs.known)} of the next {h} bars)")
    reals = {c: bars.user[c][ahead] for c in inputs.known if c not in inputs.categorical}
    if bad := [c for c, v in reals.items() if unusable_values(v).any()]:
        raise Refused(f"{args.parquet}: known feature column(s) {', '.join(bad)} NaN, infinite or past float32's "
                      f"range in {after}, which a forecast sends: fill them in")
    return FutureValues(reals, {c: bars.labels[c][ahead] for c in inputs.known if c in inputs.categorical})


def read_future(path: Path, columns: ColumnMap, symbol: str, after_ns: int, inputs: UserInputs, horizon: int,
                after: str) -> FutureValues:
    """The first `horizon` rows of `symbol` after `after_ns` in the --future file: each known column's values."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise Refused(f"--future {path}: cannot read it as a parquet file ({exc})") from None
    if missing := [c for c in (columns.timestamp, *inputs.known) if c not in table.column_names]:
        raise Refused(f"--future {path}: no column {', '.join(missing)}; it needs {columns.timestamp}, "
                      f"{columns.symbol} and the known features {', '.join(inputs.known)}")
    if columns.symbol in table.column_names:
        table = table.filter(pc.equal(table.column(columns.symbol).cast(pa.string()), symbol))
    ts, problem = timestamps_ns(table.column(columns.timestamp), f"--future {path}", columns.timestamp,
                                columns.time_unit)
    if problem is not None or ts is None:
        raise Refused(str(problem))
    order = np.argsort(ts, kind="stable")
    rows = order[ts[order] > after_ns][:horizon]
    if rows.size < horizon:
        raise _too_few(inputs, after, horizon, f"--future {path} has {rows.size} {symbol} row(s) after it: give "
                       f"{', '.join(inputs.known)} of the next {horizon} bars")
    future = FutureValues()
    for c in inputs.known:
        values = table.column(c).take(pa.array(rows))
        _future_column(path, c, values, c in inputs.categorical, future, after)
    return future


def _too_few(inputs: UserInputs, after: str, horizon: int, source: str) -> Refused:
    """The refusal of a forecast whose known features lack future values, naming the first known column."""
    return Refused(f"known feature {inputs.known[0]!r}: the model needs its values for {after} (the forecast's "
                   f"{horizon} steps), and {source}")


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


def _symbol(args: argparse.Namespace, info: pb.ModelInfo, contracts: ContractConfig | None) -> str:
    """The symbol to send: --symbol, a futures model's root or a contract of one, or the model's only one."""
    if args.symbol is None:
        if len(info.symbols) != 1:
            raise Refused(f"--symbol: the model knows {', '.join(info.symbols)}; name the one to forecast")
        return str(info.symbols[0])
    futures = bool(info.roll_rule) and (contracts or ContractConfig()).root_of(args.symbol) in info.symbols
    if info.symbols and args.symbol not in info.symbols and not futures:
        contract = " or a contract of one" if info.roll_rule else ""
        raise Refused(f"the model does not know symbol {args.symbol!r} (it knows {', '.join(info.symbols)}"
                      f"{contract})")
    return str(args.symbol)


def _contracts(args: argparse.Namespace, info: pb.ModelInfo) -> ContractConfig | None:
    """How a futures model's bars file names its contracts (--contract-col, --roots); None for a model without a
    roll rule, or bars whose names are no contract names (one continuous series each, sent as they are)."""
    contract_col, roots = getattr(args, "contract_col", None), getattr(args, "roots", None)  # any parser's args
    if not info.roll_rule:
        if contract_col or roots:
            raise Refused("--contract-col/--roots: the server's model was not trained on futures contracts "
                          "(GetModelInfo.roll_rule is empty); leave them out")
        return None
    try:
        return scan(args.parquet, _columns(args, info), ContractFlags(contract_col=contract_col, roots=roots))
    except ValueError as exc:
        raise Refused(f"{args.parquet}: {exc}") from None
    except (OSError, pa.ArrowException):  # read_bars names the file it cannot read
        return None


def root_bars(bars: Bars, root: str, cfg: ContractConfig) -> tuple[Bars, np.ndarray]:
    """The bars of `root`'s contracts (`bars` as read: the symbol is the contract) as one series named `root`,
    in time order and, at one time, by contract name; and each row's contract, str [n]."""
    names = bars.symbol.astype(str)  # [N]
    if cfg.root_column:
        roots = np.asarray(bars.labels[cfg.root_column]).astype(str)
    else:
        unique, inverse = np.unique(names, return_inverse=True)
        roots = np.array([cfg.root_of(str(u)) or "" for u in unique], dtype=str)[inverse.reshape(-1)]
    rows = np.flatnonzero(roots == root)
    rows = rows[np.lexsort((names[rows], bars.timestamp_ns[rows]))]  # [n]
    return replace(bars.take(rows), symbol=np.full(rows.size, root, dtype=object)), names[rows]


def _rows_to_send(args: argparse.Namespace, info: pb.ModelInfo, bars: Bars, last: int) -> int:
    """How many of a root's per-contract rows up to row `last` to send: those from the session before the one
    holding the latest `bars_required` bar times on, so that the server's roll rule (which reads the session
    before) chooses each session's front from whole sessions, as training did."""
    ts = bars.timestamp_ns[:last + 1]  # one series, in time order
    times = np.unique(ts)
    if times.size < info.bars_required:
        raise Refused(f"{args.parquet} has {times.size} bar times of {bars.symbol[0]}'s contracts"
                      f"{' up to --origin' if args.origin else ''}; the model needs the latest {info.bars_required} "
                      "(GetModelInfo.bars_required): give more history")
    session = sessions(ts, info.calendar_tz or "UTC")  # [last + 1], non-decreasing
    days = np.unique(session)
    start = int(np.searchsorted(days, session[np.searchsorted(ts, times[-info.bars_required])]))
    first = days[max(start - 1, 0)]  # the session before, with bars (a weekend or holiday has none)
    return int(last + 1 - np.searchsorted(session, first))


def _columns(args: argparse.Namespace, info: pb.ModelInfo) -> ColumnMap:
    """The bar column names: the flags', else the training run's (GetModelInfo.bar_columns)."""
    trained = {k: v for k, v in info.bar_columns.items() if k in ColumnMap.__dataclass_fields__}
    return ColumnMap.from_args(args, trained)


def _symbol_bars(args: argparse.Namespace, info: pb.ModelInfo, symbol: str, inputs: UserInputs,
                 contracts: ContractConfig | None) -> tuple[Bars, np.ndarray | None]:
    """The symbol's bars only, at least bars_required, and for a futures root each row's contract (else None);
    user columns are checked only in the bars sent (build_request), so that an indicator's warm-up NaN in the
    first rows does not stop a forecast."""
    trained = {k: v for k, v in info.bar_columns.items() if k in ColumnMap.__dataclass_fields__}
    columns, root_column = reading(_columns(args, info), contracts)
    user = inputs.real_columns
    root = contracts is not None and symbol in info.symbols  # every contract of a root, for the server to roll
    try:
        bars = read_bars(args.parquet, columns, user, symbols=None if root else [symbol], check_user_values=False,
                         label_columns=tuple(dict.fromkeys((*inputs.label_columns, *root_column))))
    except BarDataError as exc:
        lines = [f"{args.parquet}: {len(exc.problems)} problem(s) in the {symbol} bars:",
                 *(f"  {line}" for line in exc.lines())]
        if lacks_a_column(exc.problems) and (note := ColumnMap.inherited(args, trained, column_names(args.parquet))):
            lines.append(note)
        raise Refused("\n".join(lines)) from None
    names = None
    if root and contracts is not None:
        bars, names = root_bars(bars, symbol, contracts)
    rows = bars.series_slices().get(symbol)
    if rows is None:
        try:  # which symbols the file has, for the message
            present = list(read_bars(args.parquet, columns, user).series_slices())
        except BarDataError:
            present = []
        has = f" (it has {', '.join(present)}){columns.one_series_hint(args.parquet, symbol)}" if present else ""
        raise Refused(f"symbol {symbol!r} not in {args.parquet}{has}")
    if rows.stop - rows.start < info.bars_required:
        raise Refused(f"{args.parquet} has {rows.stop - rows.start} bars of {symbol}; the model needs the latest "
                      f"{info.bars_required} (GetModelInfo.bars_required): give more history")
    _check_static(args, bars, inputs)
    return bars, names


def _check_static(args: argparse.Namespace, bars: Bars, inputs: UserInputs) -> None:
    """Refused when a static feature changes within the symbol's bars: the request carries one value."""
    config = FeatureConfig(static_columns=inputs.static,
                           categorical_columns=tuple(c for c in inputs.static if c in inputs.categorical))
    try:
        check_static(bars, config, series_bounds(bars))
    except ValueError as exc:
        raise Refused(f"{args.parquet}: {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
