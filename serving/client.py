"""`python -m serving.client --target HOST:PORT --parquet bars.parquet --symbol ES`: print a forecast.

Asks the server what the model needs (GetModelInfo), reads and validates the bars with
`features.read_bars`, sends the latest `bars_required` bars of the symbol and prints the
forecast as a table: per horizon step, the future bar time and the quantiles of cumulative
log return and of price. `--json` prints the response as JSON instead.

TLS and tokens: `--tls-ca ca.pem` (or `--tls` for the system's roots) connects with TLS,
`--tls-cert/--tls-key` adds a client certificate (for a server with --tls-client-ca), and
`--auth-token-file` sends the file's first token as `authorization: Bearer <token>`.

Times in the table are the forecast's nominal bar times (last bar + h bar intervals): step h is
the h-th next bar, so across a session close they stand for the next session's bars.
`--explain` adds each variable's mean selection weight and the bars the attention weighs most.

Exit status: 0 done, 2 bad arguments, bars (missing, unreadable, too few for the model, a symbol
the model does not know) or TLS/token files, 1 the server answered an error (its status code and
message are printed), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import json_format

from features.bars import BarDataError, Bars, ColumnMap, read_bars
from serving.errors import ConfigError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.security import add_client_arguments, call_metadata, check_client_arguments, open_channel


def series_from_bars(bars: Bars, symbol: str, n: int, user_columns: tuple[str, ...] | list[str] = (),
                     packed: bool = False) -> pb.Series:
    """The last `n` bars of `symbol` as a request Series (KeyError if the symbol is absent).

    `packed` sends the user columns as one little-endian float64 block (user_feature_names +
    user_features_raw) instead of one repeated field each: far cheaper for wide models.
    """
    rows = bars.series_slices()[symbol]
    sl = slice(max(rows.start, rows.stop - n), rows.stop)
    series = pb.Series(
        symbol=symbol,
        timestamp_ns=bars.timestamp_ns[sl].tolist(),
        open=bars.open[sl].tolist(),
        high=bars.high[sl].tolist(),
        low=bars.low[sl].tolist(),
        close=bars.close[sl].tolist(),
        volume=bars.volume[sl].tolist(),
    )
    if packed and user_columns:
        series.user_feature_names.extend(user_columns)
        block = np.stack([bars.user[u][sl] for u in user_columns]).astype("<f8")  # [columns, bars]
        series.user_features_raw = block.tobytes()
    else:
        series.user_features.extend(pb.Column(name=u, values=bars.user[u][sl].tolist()) for u in user_columns)
    return series


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def format_forecast(f: pb.Forecast) -> str:
    """A fixed-width table: one row per horizon step."""
    levels = list(f.quantile_levels)
    q = len(levels)
    ret = np.asarray(f.log_return).reshape(f.horizon, q)
    price = np.asarray(f.price).reshape(f.horizon, q)
    head = ["h", "time (UTC)"] + [f"ret q{lv:g}" for lv in levels] + [f"price q{lv:g}" for lv in levels]
    rows = [[str(h + 1), _time(int(f.timestamp_ns[h]))] + [f"{x:+.6f}" for x in ret[h]] + [f"{x:.4f}" for x in price[h]]
            for h in range(f.horizon)]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    title = f"{f.symbol}  model {f.model_version}  last bar {_time(f.last_timestamp_ns)} UTC  close {f.last_close:.4f}"
    lines = [title,
             "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("ret: cumulative log return from the last close; time: nominal, step h is the h-th next bar")
    if f.HasField("explanation"):
        lines += format_explanation(f.explanation)
    return "\n".join(lines)


def format_explanation(e: pb.Explanation, top: int = 5) -> list[str]:
    """Each group's variables by mean selection weight (the largest `top` of each), and the past bars the
    decoder's attention weighs most, averaged over the horizon steps (the columns after the encoder's bars are
    the forecast steps themselves: their share is given as one figure)."""
    lines = []
    for label, w in (("static", e.static_weights), ("encoder", e.encoder_weights), ("decoder", e.decoder_weights)):
        mean = np.asarray(w.weights).reshape(w.steps, len(w.variables)).mean(axis=0)
        order = np.argsort(-mean, kind="stable")[:top]
        lines.append(f"{label} variables: " + ", ".join(f"{w.variables[i]} {mean[i]:.0%}" for i in order))
    attention = np.asarray(e.attention).reshape(e.attention_rows, e.attention_cols).mean(axis=0)
    past = e.attention_cols - e.attention_rows  # the encoder's bars; then one column per horizon step
    order = np.argsort(-attention[:past], kind="stable")[:top]
    lines.append("attention to past bars: "
                 + ", ".join(f"{_time(int(e.attention_timestamp_ns[i]))} {attention[i]:.0%}" for i in order)
                 + f" (forecast steps: {attention[past:].sum():.0%})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m serving.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--parquet", required=True, help="bars: a parquet file or a directory of them")
    p.add_argument("--symbol", required=True, help="symbol to forecast (one of the model's symbols)")
    p.add_argument("--explain", action="store_true",
                   help="also ask for attention and variable weights (a summary under the table; all with --json)")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per call in seconds (default 10)")
    p.add_argument("--packed", action="store_true",
                   help="send the user feature columns as one packed float64 block (user_features_raw)")
    ColumnMap.add_arguments(p)
    add_client_arguments(p)
    args = p.parse_args(argv)
    check_client_arguments(p, args)  # --timeout too
    if not Path(args.parquet).exists():
        print(f"error: --parquet {args.parquet}: no such file or directory", file=sys.stderr)
        return 2
    try:
        return _forecast(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _forecast(args: argparse.Namespace) -> int:
    try:
        metadata = call_metadata(args)
        channel = open_channel(args.target, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    with channel:
        stub = pb_grpc.ForecasterStub(channel)
        try:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"error: GetModelInfo: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        try:
            bars = read_bars(args.parquet, ColumnMap.from_args(args), tuple(info.user_feature_columns))
        except BarDataError as exc:
            print(f"error: {args.parquet}: {len(exc.problems)} problem(s) in the bars:", file=sys.stderr)
            for problem in exc.problems:
                print(f"  {problem}", file=sys.stderr)
            return 2
        slices = bars.series_slices()
        if args.symbol not in slices:
            print(f"error: symbol {args.symbol!r} not in {args.parquet} (it has "
                  f"{', '.join(bars.symbols) or 'no bars'})", file=sys.stderr)
            return 2
        if info.symbols and args.symbol not in info.symbols:
            print(f"error: the model does not know symbol {args.symbol!r} (it knows {', '.join(info.symbols)})",
                  file=sys.stderr)
            return 2
        have = slices[args.symbol].stop - slices[args.symbol].start
        if have < info.bars_required:
            print(f"error: {args.parquet} has {have} bars of {args.symbol}; the model needs the latest "
                  f"{info.bars_required} (GetModelInfo.bars_required): give more history", file=sys.stderr)
            return 2
        request = pb.PredictRequest(
            series=[series_from_bars(bars, args.symbol, info.bars_required, list(info.user_feature_columns),
                                     packed=args.packed)],
            explain=args.explain,
        )
        try:
            response = stub.Predict(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"error: Predict: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json_format.MessageToJson(response, preserving_proto_field_name=True))
    else:
        for forecast in response.forecasts:
            print(format_forecast(forecast))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
