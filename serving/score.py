"""`python -m serving.score --model model.onnx --parquet bars.parquet --out forecasts.parquet`: forecasts
for every bar of a history, offline, for backtests and evaluation.

Runs the ONNX model on the window ending at every bar with its warm-up and encoder bars (the bars read with
the training run's column names; the flags win). `--symbols`, `--start` and `--end` choose the origins.
One row per origin and horizon step: symbol, origin, h, time, close, ret_q<q>, price_q<q>, actual_ret,
actual_time, split (see docs/serving.md); a summary per split follows on stderr. Origins the server would
refuse are skipped with a warning, and so are, for a model with known features, the origins within H bars of
their series' end: the decoder reads the known values of the H bars after each origin from the file. Labels of
a categorical feature unseen in training are forecast with the unknown category and noted. A model trained on
per-contract futures bars reads them the same way: one continuous series per root by its roll rule, each roll
logged; `--symbols` may name a root or a contract (ESU5: its root, ES), and a `contract` column names each
origin's front contract. The file is written atomically. Exit status: 0 done, 1 the output could not be written,
2 bad arguments, bars or model, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from features.bars import (
    BarDataError,
    Bars,
    ColumnMap,
    clash_with_bars,
    column_names,
    lacks_a_column,
    unusable_user_rows,
    unusable_values,
)
from features.calendar import COARSE_INTERVALS, NS_PER_DAY
from features.categories import unseen_note
from features.check import format_duration, format_timestamp, spacing_warning
from features.compute import FeatureFrame, build_frame
from features.config import FeatureConfig
from features.file_kind import replace_problem
from features.files import atomic_output, file_argument, link_note
from features.known import future_times
from features.metrics import inside, pinball
from features.model_meta import ModelMeta
from features.schema import QUANTILES
from features.series import ContractError, as_series, read_contract_bars, roll_listing
from features.windows import flagged_in_windows, model_inputs, origins, origins_without_future, read_span
from serving.errors import ModelLoadError
from serving.model import DEVICES, LoadedModel, load_model
from serving.postprocess import price_quantiles
from serving.validation import daily_bars

log = logging.getLogger("serving.score")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ROWS_PER_GROUP = 1 << 16  # parquet rows written at once: whatever --batch is, row groups stay this large


class ScoreError(Exception):
    """What the user must fix, in one message (exit 2)."""


FIRST_NS_DATE, LAST_NS_DATE = datetime(1678, 1, 1, tzinfo=UTC), datetime(2262, 1, 1, tzinfo=UTC)  # int64 ns


def parse_time(text: str, flag: str) -> int:
    """An ISO 8601 date or time (UTC without an offset) as int64 nanoseconds since the Unix epoch."""
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ScoreError(f"{flag} {text!r}: give an ISO 8601 date or time, e.g. 2024-01-02 or 2024-01-02T14:30 "
                         "(UTC unless it ends in Z or an offset such as +01:00)") from None
    when = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    if not FIRST_NS_DATE <= when < LAST_NS_DATE:
        raise ScoreError(f"{flag} {text!r}: bar times are int64 nanoseconds, which hold 1678 to 2261; give a "
                         "time in that range")
    return (when - EPOCH) // timedelta(microseconds=1) * 1_000  # exact: whole microseconds


def refused_windows(frame: FeatureFrame, anchors: np.ndarray, bars_required: int,
                    interval_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows `serving.validation` refuses: finer bars (most gaps under half the bar interval) and daily
    bars to an intraday model. bool [W] each."""
    ts, n = frame.timestamp_ns, bars_required
    gaps = n - 1  # short[r] flags the gap before row r
    short = np.concatenate([[False], ts[1:] < ts[:-1] + interval_ns // 2])
    finer = 2 * flagged_in_windows(short, anchors, gaps) > gaps
    long = np.concatenate([[False], np.diff(ts) >= max(NS_PER_DAY, COARSE_INTERVALS * interval_ns)])
    daily = np.zeros(anchors.shape[0], dtype=bool)
    for w in np.flatnonzero(~finer & (2 * flagged_in_windows(long, anchors, gaps) > gaps)):
        a = int(anchors[w])
        daily[w] = daily_bars(ts[a - n + 1:a + 1], interval_ns)
    return finer, daily


def unseen_lines(frame: FeatureFrame, bars: Bars, anchors: np.ndarray, encoder_length: int) -> list[str]:
    """One line per categorical column whose windows read labels unseen in training, with how many windows did."""
    lines = []
    for name, unseen in frame.unseen.items():
        first, last = read_span(frame, anchors, encoder_length, name)  # [W] each
        edges = np.zeros(len(frame) + 1, dtype=np.int64)
        np.add.at(edges, first, 1)
        np.add.at(edges, last + 1, -1)
        mask = unseen & (np.cumsum(edges[:-1]) > 0)  # [N] unseen labels some window reads
        if not mask.any():
            continue
        count = np.zeros(len(frame) + 1, dtype=np.int64)  # count[r]: unseen rows read before row r
        np.cumsum(mask, out=count[1:])
        hit = int(np.sum(count[last + 1] > count[first]))
        note = unseen_note({name: mask}, {name: bars.labels[name]})[0]
        lines.append(f"{note} ({hit:,} of {anchors.size:,} windows)")
    return lines


def forecast_table(frame: FeatureFrame, anchors: np.ndarray, log_return: np.ndarray,
                   quantiles: Sequence[float], split: np.ndarray, contract: np.ndarray | None = None) -> pa.Table:
    """One row per anchor and horizon step. log_return: [W, H, Q]; split: [W] (split_of); contract: each bar's
    front contract (object [N]) of a contract model's continuous series, else None (no contract column)."""
    w, h = log_return.shape[:2]
    close = frame.close[anchors]  # [W]
    ret = log_return.astype(np.float64)
    price = price_quantiles(close, log_return)  # [W, H, Q]
    series = np.asarray(frame.symbols)[frame.series_id[anchors]]  # [W]
    future = future_times(frame.timestamp_ns[anchors], frame.config, frame.bar_interval_ns, series)  # [W, H]
    utc = pa.timestamp("ns", tz="UTC")
    columns: dict[str, pa.Array] = {
        "symbol": pa.array(series.repeat(h), type=pa.string()),
        **({} if contract is None else {"contract": pa.array(contract[anchors].repeat(h), type=pa.string())}),
        "origin": pa.array(frame.timestamp_ns[anchors].repeat(h), type=utc),
        "h": pa.array(np.tile(np.arange(1, h + 1, dtype=np.int16), w)),
        "time": pa.array(future.ravel(), type=utc),
        "close": pa.array(close.repeat(h)),
    }
    columns |= {f"ret_q{level:g}": pa.array(ret[:, :, j].ravel()) for j, level in enumerate(quantiles)}
    columns |= {f"price_q{level:g}": pa.array(price[:, :, j].ravel()) for j, level in enumerate(quantiles)}
    columns["actual_ret"] = pa.array(frame.targets[anchors].astype(np.float64).ravel())  # NaN past the file
    # the h-th next bar of the file, which actual_ret reaches; null past the series' end
    later = anchors[:, None] + np.arange(1, h + 1)  # [W, H] rows
    ends = frame.series_bounds[np.searchsorted(frame.series_bounds[:, 0], anchors, side="right") - 1, 1]  # [W]
    inside = later < ends[:, None]
    reached = frame.timestamp_ns[np.where(inside, later, anchors[:, None])]
    columns["actual_time"] = pa.array(reached.ravel(), type=utc, mask=~inside.ravel())
    rows = split.repeat(h)
    columns["split"] = pa.array(np.asarray(SPLITS, dtype=object)[rows], type=pa.string(), mask=rows < 0)
    return pa.table(columns)


SPLITS = ("before", "train", "validation", "test", "after")


def split_of(origin_ns: np.ndarray, training: dict[str, Any]) -> np.ndarray:
    """Which part of the model's training run each origin's time falls in: an index into SPLITS, -1 unknown."""
    val_from = training.get("validation_from_ns")
    if val_from is None:
        return np.full(origin_ns.shape, -1, dtype=np.int8)
    first, test_from, last = (training.get(k) for k in ("first_bar_ns", "test_from_ns", "last_bar_ns"))
    out = np.where(origin_ns >= val_from, 2, 1).astype(np.int8)
    if test_from is not None:
        out[origin_ns >= test_from] = 3
    if last is not None:
        out[origin_ns > last] = 4
    if first is not None:
        out[origin_ns < first] = 0
    return out


class Summary:
    """Windows per symbol and split, and per split the pinball loss and outer-band coverage where realised."""

    def __init__(self, quantiles: Sequence[float]) -> None:
        self.q = np.asarray(quantiles, dtype=np.float64)
        self.windows: dict[str, int] = {}
        self.origins = np.zeros(len(SPLITS) + 1, dtype=np.int64)  # per split; the last: unknown
        self.loss = np.zeros(len(SPLITS) + 1)
        self.inside = np.zeros(len(SPLITS) + 1, dtype=np.int64)
        self.scored = np.zeros(len(SPLITS) + 1, dtype=np.int64)

    def add(self, frame: FeatureFrame, anchors: np.ndarray, log_return: np.ndarray, split: np.ndarray) -> None:
        """log_return: [W, H, Q]; split: [W] (split_of; -1 counts in the last slot)."""
        for sid, count in zip(*np.unique(frame.series_id[anchors], return_counts=True), strict=True):
            name = frame.symbols[int(sid)]
            self.windows[name] = self.windows.get(name, 0) + int(count)
        np.add.at(self.origins, split, 1)
        actual = frame.targets[anchors].astype(np.float64)  # [W, H], NaN past the file
        seen = np.isfinite(actual)
        pred = log_return.astype(np.float64)
        loss = pinball(pred, np.where(seen, actual, 0.0), self.q).mean(axis=-1)  # [W, H]
        within = inside(pred, actual)  # [W, H]
        where = np.broadcast_to(split[:, None], seen.shape)[seen]  # [n]
        np.add.at(self.loss, where, loss[seen])
        np.add.at(self.inside, where, within[seen].astype(np.int64))
        np.add.at(self.scored, where, 1)

    def lines(self) -> list[str]:
        out = [f"windows: {sum(self.windows.values()):,} ({', '.join(f'{s} {n:,}' for s, n in self.windows.items())})"]
        nominal, band = self.q[-1] - self.q[0], f"[q{self.q[0]:g}, q{self.q[-1]:g}]"
        for i, name in enumerate((*SPLITS, "all")):
            slot = slice(None) if name == "all" else i
            n = int(np.sum(self.scored[slot]))
            if name != "all" and not self.origins[i]:
                continue
            label = "all origins" if name == "all" else f"{name} origins ({int(self.origins[i]):,})"
            if n:
                coverage = (f"realised return inside {band} {int(np.sum(self.inside[slot])) / n:.1%} of the time "
                            f"(nominal {nominal:.0%})" if self.q.size > 1 else "coverage n/a (one quantile: no "
                            "interval)")
                out.append(f"{label}: {n:,} forecasts with their future in the file: mean pinball loss of the log "
                           f"return {float(np.sum(self.loss[slot])) / n:.6g}; {coverage}")
            else:
                out.append(f"{label}: no forecast with its future in the file")
        return out

    def in_sample(self) -> int:
        """Origins in the train and validation splits."""
        return int(self.origins[1] + self.origins[2])


def score(model: LoadedModel, bars: Bars, out: Path, symbols: Sequence[str], start_ns: int | None,
          end_ns: int | None, batch: int) -> Summary:
    """Write the forecasts of every origin to `out` (atomically); returns the summary."""
    meta: ModelMeta = model.meta
    chosen = bars.only(symbols)
    try:
        frame = build_frame(chosen, meta.feature_config, list(meta.symbols), meta.bar_interval_ns)
    except ValueError as exc:  # a static feature that varies within a series
        raise ScoreError(str(exc)) from None
    anchors = origins(frame, meta.encoder_length, start_ns, end_ns)
    for symbol, count in origins_without_future(frame, meta.encoder_length, start_ns, end_ns).items():
        log.warning("skipped %s origin(s) of %s: within %d bars of its last bar, where the file holds no future "
                    "values of the known feature(s) %s that the model reads", f"{count:,}", symbol, meta.horizon,
                    ", ".join(meta.feature_config.known_columns))
    anchors = anchors[~_refused(frame, anchors, meta, unusable_user_rows(chosen), _unusable_known_rows(chosen, meta))]
    if anchors.size == 0:
        raise ScoreError(_no_origin(frame, meta, start_ns, end_ns))
    for line in unseen_lines(frame, chosen, anchors, meta.encoder_length):
        log.warning("note: %s", line)
    summary = Summary(meta.quantiles)
    with atomic_output(out) as tmp:
        log.info("scoring %s windows into %s", f"{anchors.size:,}", out)
        _write_forecasts(tmp, model, frame, anchors, batch, summary, chosen.contract)
    return summary


def _no_origin(frame: FeatureFrame, meta: ModelMeta, start_ns: int | None, end_ns: int | None) -> str:
    """Why no window is left to forecast."""
    ranged = start_ns is not None or end_ns is not None
    span = (f" (the bars run from {format_timestamp(int(frame.timestamp_ns.min()))} to "
            f"{format_timestamp(int(frame.timestamp_ns.max()))})" if ranged and frame.timestamp_ns.size else "")
    future = (f", and the {meta.horizon} bars after it, whose known features the model reads"
              if meta.feature_config.known_columns else "")
    return (f"no forecast origin{' inside --start/--end' if ranged else ''}{span}: each origin needs "
            f"{meta.bars_required} bars of its symbol up to it ({meta.feature_config.warmup_bars} "
            f"warm-up + {meta.encoder_length} encoder bars){future}"
            + (", which may lie before --start" if start_ns is not None else ""))


def _write_forecasts(tmp: str, model: LoadedModel, frame: FeatureFrame, anchors: np.ndarray, batch: int,
                     summary: Summary, contract: np.ndarray | None) -> None:
    """Run the model on the windows at `anchors`, `batch` at a time, into the parquet file `tmp`."""
    meta: ModelMeta = model.meta
    writer: pq.ParquetWriter | None = None
    pending: list[pa.Table] = []
    try:
        for i, chunk in enumerate(np.split(anchors, range(batch, anchors.size, batch))):
            q = model.run(model_inputs(frame, chunk, meta.encoder_length))[QUANTILES]  # [B, H, Q]
            split = split_of(frame.timestamp_ns[chunk], meta.training)  # [B]
            pending.append(forecast_table(frame, chunk, q, meta.quantiles, split, contract))
            summary.add(frame, chunk, q, split)
            if sum(t.num_rows for t in pending) >= ROWS_PER_GROUP or (i + 1) * batch >= anchors.size:
                table = pa.concat_tables(pending)
                writer = writer or pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table, row_group_size=table.num_rows)
                pending = []
    finally:
        if writer is not None:
            writer.close()


def _unusable_known_rows(bars: Bars, meta: ModelMeta) -> np.ndarray:
    """Rows where a known real user column holds a value the model cannot read: bool [N]."""
    bad = np.zeros(len(bars), dtype=bool)
    for name in meta.feature_config.known_user:
        if name in bars.user:  # a real column (categoricals are labels)
            bad |= unusable_values(bars.user[name])
    return bad


def _refused(frame: FeatureFrame, anchors: np.ndarray, meta: ModelMeta, unusable_rows: np.ndarray,
             unusable_known: np.ndarray) -> np.ndarray:
    """The windows the server would refuse, warned of per symbol: bool [W]. ScoreError when all are.
    unusable_rows, unusable_known: bool [N], rows with an unusable value of a user column, of a known one."""
    step = format_duration(meta.bar_interval_ns)
    finer, daily = refused_windows(frame, anchors, meta.bars_required, meta.bar_interval_ns)
    unusable = flagged_in_windows(unusable_rows, anchors, meta.bars_required) > 0
    if meta.feature_config.known_columns:  # the decoder reads the H bars after the anchor too
        unusable |= flagged_in_windows(unusable_known, anchors + meta.horizon, meta.horizon) > 0
    fix = f"resample them to {step}, or use a model trained on this interval"
    for refused, why in ((finer, f"bars are mostly closer than half the model's bar interval of {step} (finer bars, "
                                 f"or another time unit), which the server refuses; {fix}"),
                         (daily & ~finer, f"bars are daily bars (mostly a day or more apart, at one or two times of "
                                          f"day) and the model's are {step} bars, which the server refuses; {fix}"),
                         (unusable & ~finer & ~daily, "user feature values include NaN, infinite or past float32's "
                                                      "range, which the server refuses (an indicator's warm-up, say); "
                                                      "fill them in to forecast from them")):
        for sid, count in zip(*np.unique(frame.series_id[anchors[refused]], return_counts=True), strict=True):
            log.warning("skipped %s origin(s) of %s: their windows' %s", f"{count:,}", frame.symbols[int(sid)], why)
    refused = finer | daily | unusable
    if refused.any() and refused.all():
        raise ScoreError("no forecast origin left: every window's " + (
            f"bars are mostly closer than half the model's bar interval of {step}" if finer.all() else
            f"bars are daily bars, and the model's are {step} bars" if daily.all() else
            "user feature values include NaN, infinite or past float32's range" if unusable.all() else
            f"bars are finer than the model's {step} bars or daily bars, or its user feature values are not "
            "finite") + ", which the server refuses")
    return refused


def out_of_sample_hint(training: dict[str, Any], last_scored_ns: int) -> str:
    """The --start that keeps only origins the run neither trained nor chose on, or why later bars are needed."""
    test_from, last = training.get("test_from_ns"), training.get("last_bar_ns")
    cut = test_from if test_from is not None else None if last is None else last + 1
    if cut is None:
        return "the split column marks them"
    start = f"{np.datetime64(-(-cut // 1_000), 'us')}Z"
    if last_scored_ns < cut:
        edge = (f"before {format_timestamp(test_from)}, where the run's test split begins" if test_from is not None
                else f"by {format_timestamp(cut - 1)}, the run's last bar")
        return (f"these bars end {edge}: score bars that go on past it for forecasts the model has not seen "
                "(the run neither trained nor chose on those)")
    which = "test and after" if test_from is not None else "after"
    return f"--start {start} keeps only the {which} origins"


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m serving.score", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="ONNX model from `python -m export`")
    p.add_argument("--parquet", type=Path, required=True, help="bars: a parquet file or a directory of them")
    p.add_argument("--out", type=file_argument("forecasts.parquet"), required=True,
                   help="parquet file of forecasts to write")
    p.add_argument("--symbols", help="comma-separated symbols to forecast (default: the model's symbols in the file)")
    p.add_argument("--start", help="first forecast origin, ISO 8601 UTC (e.g. 2024-01-02)")
    p.add_argument("--end", help="origins before this time only, ISO 8601 UTC")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu (default); cuda: the CUDA provider or refuse; auto: CUDA, else the CPU with a warning")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1)),
                   help="ONNX Runtime intra-op threads (default: every CPU)")
    p.add_argument("--batch", type=int, default=64,
                   help="windows per ONNX Runtime run (default 64; on CUDA, 1024 or more)")
    ColumnMap.add_arguments(p, "a name not given is the model's training run's")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.batch < 1 or args.threads < 1:
        p.error("--batch and --threads must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupted)  # as Ctrl-C: atomic_output removes the partial file
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    stored: dict[str, str] | None = None  # the training run's column names
    try:
        start_ns, end_ns = _time_range(args)
        _check_out(args.out, args.parquet)
        model = load_model(args.model, args.device, args.threads, max_batch=args.batch)
        meta = model.meta
        stored = meta.column_map or None
        columns = ColumnMap.from_args(args, stored)
        asked = asked_symbols(args.symbols, meta)
        fc = meta.feature_config
        bars = read_contract_bars(args.parquet, columns, fc, symbols=asked or None,
                                  check_user_values=False)  # windows with unusable user values are skipped
        bars = rolled(bars, fc, args.parquet)
        wanted = _wanted_symbols(meta, bars, asked, args.parquet, columns)
        summary = score(model, bars, args.out, wanted, start_ns, end_ns, args.batch)
    except (ScoreError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BarDataError as exc:
        _print_bar_problems(exc, args, stored)
        return 2
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for line in summary.lines():
        log.info("%s", line)
    if inside := summary.in_sample():
        slices = bars.series_slices()
        last = max(int(bars.timestamp_ns[slices[s]].max()) for s in wanted)
        log.warning("%s origin(s) lie in the bars the model was trained or chosen on (split train or validation): "
                    "in-sample, not a backtest; %s", f"{inside:,}", out_of_sample_hint(meta.training, last))
    log.info("wrote %s", args.out)
    return 0


def asked_symbols(text: str | None, meta: ModelMeta) -> list[str]:
    """The --symbols names, each once; a contract model's contracts (ESU5) as their roots (ES)."""
    names = [s.strip() for s in (text or "").split(",") if s.strip()]
    if text is not None and not names:
        raise ScoreError(f"--symbols {text!r} names no symbol; give e.g. {','.join(meta.symbols)}")
    return list(dict.fromkeys(meta.root_of(n) or n for n in names))  # an unknown name stays, to be named


def rolled(bars: Bars, fc: FeatureConfig, path: Path) -> Bars:
    """`bars` as read, or for a contract model one continuous series per root by its roll rule (rolls logged)."""
    try:
        series, rolls = as_series(bars, fc)
    except ContractError as exc:  # contract names the model's mapping cannot take
        raise ScoreError(f"{path}: {exc} (serving.score rolls the bars by the model's own rule and mapping: "
                         "those flags are the training run's)") from None
    if fc.contracts is not None:
        log.info("contracts: %s; %d roll(s)", fc.contracts.describe(), len(rolls))
    for line in roll_listing(rolls):
        log.info("%s", line)
    return series


def _time_range(args: argparse.Namespace) -> tuple[int | None, int | None]:
    start_ns = parse_time(args.start, "--start") if args.start else None
    end_ns = parse_time(args.end, "--end") if args.end else None
    if start_ns is not None and end_ns is not None and end_ns <= start_ns:
        raise ScoreError(f"--end {args.end} is not after --start {args.start}")
    return start_ns, end_ns


def _check_out(out: Path, bars: Path) -> None:
    """ScoreError when writing `out` would destroy the bars or a file of another kind."""
    if out.suffix.lower() not in (".parquet", ".parq", ".pq"):
        raise ScoreError(f"--out {out}: name a .parquet file")
    if problem := clash_with_bars(out, bars):
        raise ScoreError(f"--out {problem}; name another file")
    if problem := replace_problem(out, "a parquet file"):
        raise ScoreError(f"--out {problem}")
    if note := link_note(out):
        log.info("%s", note)


def _wanted_symbols(meta: ModelMeta, bars: Bars, asked: list[str], path: Path, columns: ColumnMap) -> list[str]:
    """Those asked for, or the model's in the file; warns of the others and of too few or too sparse bars."""
    slices = bars.series_slices()
    present = set(slices)
    if asked:
        unknown = [s for s in asked if s not in meta.symbols]
        absent = [s for s in asked if s in meta.symbols and s not in present]
        if unknown or absent:
            raise ScoreError("; ".join(
                ([f"--symbols {', '.join(unknown)}: not the model's (it knows {', '.join(meta.symbols)}"
                  f"{' and their contracts' if meta.feature_config.contracts else ''})"]
                 if unknown else []) + ([f"--symbols {', '.join(absent)}: no bars of it in {path}"] if absent else [])))
    wanted = asked or [s for s in meta.symbols if s in present]
    if not wanted:
        hint = columns.one_series_hint(path, meta.symbols[0])
        raise ScoreError(f"{path} holds none of the model's symbols ({', '.join(meta.symbols)}); it holds "
                         f"{', '.join(sorted(present)) or 'no bars'}{hint}"
                         + (" (or another of the model's symbols)" if hint and len(meta.symbols) > 1 else ""))
    for s in [] if asked else sorted(present - set(meta.symbols)):
        log.warning("skipped %s: not one of the model's symbols (%s)", s, ", ".join(meta.symbols))
    after = meta.horizon if meta.feature_config.known_columns else 0  # bars after the origin: known features
    for s in wanted:
        if (rows := slices[s].stop - slices[s].start) < meta.bars_required + after:
            log.warning("skipped %s: %d bars, a forecast needs %d (%d warm-up + %d encoder%s)", s, rows,
                        meta.bars_required + after, meta.feature_config.warmup_bars, meta.encoder_length,
                        f" + {after} after it" if after else "")
        elif warning := spacing_warning(f"the {s} bars", bars.timestamp_ns[slices[s]], meta.bar_interval_ns):
            log.warning("%s", warning)
    return wanted


def _print_bar_problems(exc: BarDataError, args: argparse.Namespace, stored: dict[str, str] | None) -> None:
    print(f"error: {exc.summary(args.parquet, most=10)}", file=sys.stderr)
    if lacks_a_column(exc.problems) and (note := ColumnMap.inherited(args, stored, column_names(args.parquet))):
        print(note, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
