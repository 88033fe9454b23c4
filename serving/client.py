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
from datetime import UTC, datetime
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import json_format

from features.bars import ColumnMap, column_names
from features.contracts import ContractFlags
from features.files import reader_went_away
from serving.errors import ConfigError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.request_from_bars import Refused, request_from_bars, trained_columns
from serving.security import (
    add_client_arguments,
    call_metadata,
    check_client_arguments,
    first_call_error,
    open_channel,
)
from serving.wire import ExplanationArrays, forecast_arrays


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
    lines = [title, *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows])]
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


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    check_client_arguments(p, args)
    if args.info:
        if args.parquet or args.symbol or args.explain or args.packed or args.origin or args.future \
                or ColumnMap.given(args) or args.contract_col or args.roots:
            p.error("--info prints the model's information alone: leave out --parquet, --symbol, --explain, "
                    "--packed, --origin, --future and the column and contract flags")
    elif not args.parquet:
        p.error("the following arguments are required: --parquet (or --info for the model alone)")
    elif not Path(args.parquet).exists():
        print(f"error: --parquet {args.parquet}: no such file or directory", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return reader_went_away()


def _parser() -> argparse.ArgumentParser:
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
    return p


def _run(args: argparse.Namespace) -> int:
    """GetModelInfo, then --info's print or a forecast's Predict; the exit status."""
    try:
        metadata = call_metadata(args)
        channel = open_channel(args.target, args)
    except ConfigError as exc:  # bad TLS or token files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = pb_grpc.ForecasterStub(channel)
        try:
            info: pb.ModelInfo = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"error: {first_call_error('GetModelInfo', exc, args.target)}", file=sys.stderr)
            return 1
        if args.info:  # every field: a false torch_imported, no user columns
            print(json_format.MessageToJson(info, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=True)
                  if args.json else format_model_info(info))
            return 0
        try:
            request = request_from_bars(args.parquet, info, args.symbol,
                                        columns=ColumnMap.from_args(args, trained_columns(info)), origin=args.origin,
                                        future=args.future, contracts=ContractFlags.of(args), packed=args.packed,
                                        explain=args.explain)
        except Refused as exc:
            print(f"error: {exc}{_column_note(exc, args, info)}", file=sys.stderr)
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


def _column_note(refused: Refused, args: argparse.Namespace, info: pb.ModelInfo) -> str:
    """For bars that lack a column: a line naming the columns taken from the training run's names, if any."""
    note = ColumnMap.inherited(args, trained_columns(info), column_names(args.parquet)) \
        if refused.lacks_a_column else None
    return f"\n{note}" if note else ""


if __name__ == "__main__":
    raise SystemExit(main())
