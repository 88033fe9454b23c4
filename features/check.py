"""`python -m features.check PATH`: validate bars and print a summary, with each user feature's role and kind.
Per-contract futures bars (ESH5, ESM5, ...) are rolled into one continuous series per root first; the roll rule,
the roots and every roll are printed before the summary of those series. Exit 0 usable, 2 one line per problem."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from features import contracts
from features.bars import (
    REQUIRED_COLUMNS,
    BarDataError,
    Bars,
    ColumnMap,
    clash_with_bars,
    cleaned_table,
    file_schema,
    list_bar_files,
    numeric,
)
from features.calendar import infer_bar_interval_ns
from features.compute import check_static
from features.config import FeatureConfig
from features.contracts import ContractConfig, ContractFlags
from features.files import atomic_output, file_argument, reader_went_away
from features.rolls import Roll, contract_roots
from features.series import as_series, read_contract_bars, roll_listing, scan


def format_timestamp(ns: int) -> str:
    """`2024-01-05 19:59:00 UTC`; a time within a second keeps its fraction (`...:00.25 UTC`)."""
    seconds, fraction = divmod(int(ns), 1_000_000_000)
    text = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"{text}{f'.{fraction:09d}'.rstrip('0') if fraction else ''} UTC"


def format_duration(ns: int) -> str:
    """A duration as people write one: `30s`, `5min`, `59min59s`, `1h`, `17h30min`, `2d17h`."""
    s = ns / 1e9
    if s < 60:
        return f"{s:g}s"
    if s < 3600:
        m, sec = divmod(round(s), 60)
        return f"{m}min{sec}s" if sec else f"{m}min"
    if s < 86400:
        h, m = divmod(round(s / 60), 60)
        return f"{h}h{m}min" if m else f"{h}h"
    d, h = divmod(round(s / 3600), 24)
    return f"{d}d{h}h" if h else f"{d}d"


def spacing_warning(what: str, timestamp_ns: np.ndarray, interval_ns: int) -> str | None:
    """A warning when bars are mostly twice the model's bar interval apart or more, else None."""
    spacing = infer_bar_interval_ns(timestamp_ns, np.array([[0, timestamp_ns.size]]))
    if spacing < 2 * interval_ns:
        return None
    step = format_duration(interval_ns)
    return (f"{what} are mostly {format_duration(spacing)} apart, but the model's bar interval is {step}: its "
            f"forecast steps are {step} bars, and it was trained on such bars; resample the bars to {step}, or "
            "use a model trained on this interval")


SESSION_BREAK_NS = 3_600_000_000_000  # a gap longer than an hour is a session's end, not a quiet market's bars


def summarize(bars: Bars, config: FeatureConfig | None = None) -> str:
    """Human-readable summary: symbols, rows, date range, bar interval, session gaps, and the user features of
    `config` (by default the bars' user columns, observed reals)."""
    slices = bars.series_slices()
    interval = infer_bar_interval_ns(bars.timestamp_ns, bars.series_bounds())
    lines = [f"files: {len(bars.files)}", f"rows: {len(bars)}", f"symbols: {len(slices)}",
             f"bar interval (most common spacing): {format_duration(interval) if interval else 'n/a'}"]
    notes: list[str] = []
    for sym, sl in slices.items():
        ts = bars.timestamp_ns[sl]
        lines.append(f"  {sym}: {sl.stop - sl.start} rows, {format_timestamp(int(ts[0]))} .. "
                     f"{format_timestamp(int(ts[-1]))}, {_gaps(ts, interval)}")
        own = infer_bar_interval_ns(ts, np.array([[0, ts.size]]))
        if own and interval and own != interval:
            step = format_duration(interval)
            refused = " (the server would refuse these finer ones)" if 2 * own < interval else ""
            notes.append(f"{sym}'s bars are mostly {format_duration(own)} apart, the file's most common spacing is "
                         f"{step}: a model trained on all of them takes {step} bars{refused}; if they are bars of "
                         "another size, train them separately (a thin market's bars that skip intervals are fine)")
    lines += feature_lines(bars, config or FeatureConfig(user_columns=tuple(bars.user)))
    lines += [f"note: {note}" for note in (*notes, *bars.notes)]
    return "\n".join(lines)


ROLES = (("user_columns", "observed"), ("known_columns", "known"), ("static_columns", "static"))
MAX_LABELS = 8  # labels a categorical feature's line shows before it counts the rest


def feature_lines(bars: Bars, config: FeatureConfig) -> list[str]:
    """One line per user feature: its role, its kind and, for a categorical, its distinct labels."""
    lines = []
    for field, role in ROLES:
        for name in getattr(config, field):
            if name not in config.categorical_columns:
                lines.append(f"  {name}: {role} real")
                continue
            labels = np.unique(np.asarray(bars.labels[name]).astype(str))
            shown = ", ".join(labels[:MAX_LABELS]) + (", ..." if labels.size > MAX_LABELS else "")
            lines.append(f"  {name}: {role} categorical, {labels.size} distinct label(s): {shown}")
    return ["user features:", *lines] if lines else []


def static_problems(path: str, bars: Bars, config: FeatureConfig) -> list[str]:
    """One line per static feature whose value changes within a series (where it first does)."""
    problems, bounds = [], bars.series_bounds()
    for name in config.static_columns:
        categorical = (name,) if name in config.categorical_columns else ()
        one = FeatureConfig(static_columns=(name,), categorical_columns=categorical)
        try:
            check_static(bars, one, bounds)
        except ValueError as exc:
            problems.append(f"{path}: {exc}")
    return problems


def _gaps(ts: np.ndarray, interval: int) -> str:
    """The gaps over the bar interval among one series' times, and how many of them are session breaks."""
    if not interval:
        return "no bar interval to measure gaps against"
    gaps = np.diff(ts)
    missed = interval + interval // 2  # a bar left out, even of bars stamped a little off their grid
    n_gaps = int(np.sum(gaps > missed))
    if not n_gaps:
        return "no gaps over the bar interval"
    n_long = int(np.sum(gaps > max(missed, SESSION_BREAK_NS)))
    return (f"{n_gaps} gaps over the bar interval, {n_long} of them over an hour: session breaks "
            f"(largest {format_duration(int(gaps.max()))})")


MAX_LISTED = 8  # column names a note lists before it counts the rest


def other_numeric_columns(path: Path, cmap: ColumnMap) -> list[str]:
    """The files' numeric columns that are no bar field (read_bars read each file): what --features could name."""
    bar_fields = {cmap.source(f) for f in (*REQUIRED_COLUMNS, "symbol")}
    return list(dict.fromkeys(f.name for file in list_bar_files(path) for f in file_schema(file)
                              if f.name not in bar_fields and numeric(f.type)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m features.check", description=__doc__)
    p.add_argument("path", help="a parquet file or a directory of them")
    p.add_argument("--features", default="", help="comma-separated numeric columns to check as observed features")
    p.add_argument("--known-features", default="", help="comma-separated columns known for future bars")
    p.add_argument("--static-features", default="", help="comma-separated columns constant within a series")
    p.add_argument("--categorical-features", default="",
                   help="which of the columns above are categorical (text, dictionary or integer columns)")
    p.add_argument("--out", type=file_argument("clean.parquet"),
                   help="with --bad-rows drop: write the bars, every column, less the rows dropped, to this parquet "
                        "file")
    ColumnMap.add_arguments(p)
    contracts.add_arguments(p)
    args = p.parse_args(argv)
    if args.out is not None and args.bad_rows != "drop":
        p.error("--out writes the bars less the rows --bad-rows drop drops: add --bad-rows drop (bars that pass "
                "the checks need no cleaned copy)")
    if args.out is not None and (problem := clash_with_bars(args.out, Path(args.path))):
        p.error(f"--out: {problem}; give another file, e.g. clean.parquet beside the bars")
    try:
        status = check(args)
        sys.stdout.flush()  # a reader gone before the last line is caught here too
        return status
    except BrokenPipeError:
        return reader_went_away()


def names(text: str) -> tuple[str, ...]:
    """A comma-separated flag's names, as the trainer reads them: stripped, empty ones dropped."""
    return tuple(c.strip() for c in text.split(",") if c.strip())


def print_problems(path: str, lines: list[str]) -> int:
    print(f"{path}: {len(lines)} problem(s) found", *(f"  {line}" for line in lines), sep="\n", file=sys.stderr)
    return 2


def check(args: argparse.Namespace) -> int:
    """Print the summary of the bars `args` names, or their problems (exit status 2)."""
    try:
        config = FeatureConfig(user_columns=names(args.features), known_columns=names(args.known_features),
                               static_columns=names(args.static_features),
                               categorical_columns=names(args.categorical_features))
    except ValueError as exc:  # a name in two roles, or a categorical in none
        print(f"error: {exc}", file=sys.stderr)
        return 2
    columns = ColumnMap.from_args(args)
    try:
        config = replace(config, contracts=scan(args.path, columns, ContractFlags.of(args)))
        bars = read_contract_bars(args.path, columns, config)
        series, rolls = as_series(bars, config)
    except BarDataError as exc:
        return print_problems(args.path, exc.lines())
    except ValueError as exc:  # contract input that no rule, or the roll rule, can take
        return print_problems(args.path, [f"{args.path}: {exc}"])
    if problems := static_problems(args.path, series, config):
        return print_problems(args.path, problems)
    if config.contracts is not None:
        print("\n".join(contract_lines(bars, series, rolls, config.contracts)))
    print(summarize(series, config))
    named = (*config.user_columns, *config.known_columns, *config.static_columns)
    if not named and (others := other_numeric_columns(Path(args.path), columns)):
        shown = ", ".join(others[:MAX_LISTED]) + (f" ... ({len(others)} in all)" if len(others) > MAX_LISTED else "")
        how = f"add --features {','.join(others)}" if len(others) <= MAX_LISTED else "name those to use in --features"
        print(f"note: columns not checked as features: {shown}; the trainer checks the ones its --features names "
              f"(NaN, inf, beyond float32): {how} to check them here")
    if len(bars) == 0:
        print(f"{args.path}: no bars (the files hold no rows): nothing to train on", file=sys.stderr)
        return 2
    if args.out is not None:
        with atomic_output(args.out) as tmp:
            pq.write_table(cleaned_table(args.path, bars.dropped), tmp)
        print(f"wrote {args.out}: the bars less the {len(bars.dropped)} row(s) dropped")
    print("no problems found" if not bars.dropped else "no problems found in the rows kept")
    return 0


def contract_lines(bars: Bars, series: Bars, rolls: list[Roll], config: ContractConfig) -> list[str]:
    """The roll rule, each root's contracts, and the rolls of per-contract `bars` rolled into continuous `series`."""
    roots = contract_roots(bars, config)
    per_root = dict(sorted(Counter(roots.values()).items()))  # contracts of each root
    lines = [f"contracts: {len(bars)} bars of {sum(per_root.values())} contract(s) -> one continuous series per "
             f"root ({len(series)} bars); {config.describe()}",
             "roots: " + ", ".join(f"{root} ({n} contract{'s' if n != 1 else ''})" for root, n in per_root.items()),
             f"rolls: {len(rolls)}"]
    return lines + roll_listing(rolls) + expiry_lines(roots, config)


def expiry_lines(roots: dict[str, str], config: ContractConfig) -> list[str]:
    """Each contract's expiration, a line per root, and where each came from."""
    if not config.expirations:
        return []
    by_root: dict[str, list[str]] = {}
    for contract, root in sorted(roots.items(), key=lambda item: (item[1], str(config.expiration(item[0])))):
        if (day := config.expiration(contract)) is not None:  # * marks an expiration the user gave
            by_root.setdefault(root, []).append(f"{contract} {day}{'' if contract in config.builtin else '*'}")
    lacking = sorted(c for c in roots if config.expiration(c) is None)
    sources = (["from each exchange's last-trading-day rule, built in"] if config.builtin else []) + \
        (["* from the bars or the --roots file"] if len(config.builtin) < len(config.expirations) else [])
    return ([f"expirations ({'; '.join(sources)}):"]
            + [f"  {root}: {', '.join(days)}" for root, days in by_root.items()]
            + ([f"  none for {', '.join(lacking[:5])}" + (f" and {len(lacking) - 5} more" if len(lacking) > 5
                                                            else "")] if lacking else []))


if __name__ == "__main__":
    raise SystemExit(main())
