"""Reading and validating bars: one parquet file or a directory of them (hive partitions welcome).

Every broken rule becomes one ``Problem`` naming the file, column, first row (0-based), rule and fix;
readers raise ``BarDataError`` with all of them, and command-line tools print them and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from features.dbn import DBN_SUFFIXES, DbnFileError, is_dbn, read_dbn

PRICE_COLUMNS: tuple[str, ...] = ("open", "high", "low", "close")
REQUIRED_COLUMNS: tuple[str, ...] = ("timestamp", *PRICE_COLUMNS, "volume")
BAD_ROWS = ("refuse", "drop")  # --bad-rows
NS_PER_UNIT = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}  # arrow's timestamp units
UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}


@dataclass(frozen=True)
class ColumnMap:
    """Which parquet column holds each field of the bar contract."""

    timestamp: str = "timestamp"  # UTC; int64 nanoseconds or any arrow timestamp type
    symbol: str = "symbol"  # optional: if absent, the file is one series named `default_symbol`
    open: str = "open"
    high: str = "high"
    low: str = "low"
    close: str = "close"
    volume: str = "volume"
    default_symbol: str = "SERIES"  # symbol used when the symbol column is absent
    time_unit: str = "ns"  # unit of an integer timestamp column: s | ms | us | ns (arrow timestamps carry theirs)
    bad_rows: str = "refuse"  # rows that break a price rule (ROW_RULES): refuse the bars, or drop those rows

    def __post_init__(self) -> None:
        if self.time_unit not in NS_PER_UNIT:
            raise ValueError(f"time unit {self.time_unit!r}: expected one of {', '.join(NS_PER_UNIT)}")

    def source(self, field_name: str) -> str:
        return str(getattr(self, field_name))

    def to_dict(self) -> dict[str, str]:
        """Every field; bad_rows only when it drops (a refusing map reads as before)."""
        return {k: str(getattr(self, k)) for k in self.__dataclass_fields__
                if k != "bad_rows" or self.bad_rows != "refuse"}

    @staticmethod
    def from_dict(d: dict[str, str]) -> ColumnMap:
        return ColumnMap(**d)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, defaults: str = "") -> None:
        """The column-mapping flags of every command that reads bars; `defaults` names where unset names come from."""
        g = parser.add_argument_group(f"column mapping ({defaults or 'for parquet layouts other than the default'})")

        def default(name: str) -> str:
            return "the training run's" if defaults else name

        g.add_argument("--time-col", help=f"timestamp column (default {default('timestamp')}; e.g. ts_event)")
        g.add_argument("--symbol-col", help=f"symbol column (default {default('symbol')}); absent means one series")
        for name in ("open", "high", "low", "close", "volume"):
            g.add_argument(f"--{name}-col", help=f"{name} column (default {default(name)})")
        g.add_argument("--default-symbol",
                       help=f"symbol name when there is no symbol column (default {default('SERIES')})")
        g.add_argument("--time-unit", choices=tuple(NS_PER_UNIT),
                       help=f"unit of an integer timestamp column (default {default('ns')}; e.g. ms for "
                            "milliseconds since the Unix epoch); arrow timestamp columns carry their own")
        g.add_argument("--bad-rows", choices=BAD_ROWS,
                       help=f"rows that break a price rule (a vendor's bad print, a high below the close): refuse "
                            f"the bars and name them (default {default('refuse')}), or drop each such row and say "
                            "which")

    @staticmethod
    def given(args: argparse.Namespace) -> dict[str, str]:
        """The fields whose flags this command was given."""
        values = {f: getattr(args, ColumnMap.dest(f), None) for f in ColumnMap.__dataclass_fields__}
        return {f: v for f, v in values.items() if v is not None}

    @staticmethod
    def dest(field_name: str) -> str:
        """timestamp -> time_col, open -> open_col; the fields that name no column keep their names."""
        named = field_name in ("default_symbol", "time_unit", "bad_rows")
        return field_name if named else "time_col" if field_name == "timestamp" else f"{field_name}_col"

    @staticmethod
    def flag(field_name: str) -> str:
        """timestamp -> --time-col, open -> --open-col."""
        return "--" + ColumnMap.dest(field_name).replace("_", "-")

    def one_series_hint(self, path: str | Path, symbol: str) -> str:
        """When the bars at `path` have no symbol column, the --default-symbol hint that names them `symbol`."""
        if self.symbol in column_names(path):
            return ""
        return (f"; a file without a {self.symbol!r} column is one series, named by --default-symbol: give "
                f"--default-symbol {symbol}")

    @staticmethod
    def from_args(args: argparse.Namespace, stored: dict[str, str] | None = None) -> ColumnMap:
        """The flags given, over `stored` (a training run's names) or over the defaults."""
        return ColumnMap.from_dict({**(stored or {}), **ColumnMap.given(args)})

    @staticmethod
    def inherited(args: argparse.Namespace, stored: dict[str, str] | None, present: set[str]) -> str | None:
        """A note naming the columns taken from the training run's names (no flag) that `present` lacks."""
        default, given = ColumnMap(), ColumnMap.given(args)
        stored = stored or {}
        taken = [f"{ColumnMap.flag(f)} {stored[f]}" for f in (*REQUIRED_COLUMNS, "symbol")
                 if f in stored and f not in given and stored[f] != default.source(f) and stored[f] not in present]
        if not taken:
            return None
        return (f"note: the names not given as flags are the model's training run's ({', '.join(taken)}); "
                "pass the flags for this file's names")


def lacks_a_column(problems: list[Problem]) -> bool:
    return any(p.rule_id == "missing_column" for p in problems)


def column_names(path: str | Path) -> set[str]:
    """Every column name in the schemas of the bars file(s) at `path`."""
    names: set[str] = set()
    for file in list_bar_files(Path(path)):
        with contextlib.suppress(OSError, pa.ArrowException, DbnFileError):
            names |= set(file_schema(file).names)
    return names


def file_schema(file: Path) -> pa.Schema:
    """The schema of one bars file, parquet or DBN."""
    return _dbn_table(file).schema if is_dbn(file) else pq.read_schema(file)


def file_columns(file: Path, columns: Collection[str]) -> pa.Table:
    """Those of `columns` that one bars file (parquet or DBN) holds."""
    if is_dbn(file):
        table = _dbn_table(file)
        return table.select([c for c in columns if c in table.column_names])
    parquet = pq.ParquetFile(file)
    return parquet.read(columns=[c for c in columns if c in parquet.schema_arrow.names])


def _dbn_table(file: Path) -> pa.Table:
    """read_dbn, once per file while it stays as it is: a command reads a file's names, then its bars."""
    stat = file.stat()
    return _dbn_read(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _dbn_read(path: str, mtime_ns: int, size: int) -> pa.Table:
    return read_dbn(Path(path))


WHOLE_FILE = "-"  # a Problem's column when the problem is the whole file


@dataclass(frozen=True)
class Problem:
    """One broken rule, located well enough for a user to fix it."""

    file: str
    column: str
    row: int  # first offending row within `file`, 0-based; -1 when the problem is the whole column
    rule: str
    fix: str
    count: int = 1  # rows affected
    rule_id: str = ""  # e.g. "nan": serving.validation words a request's fix by it

    def __str__(self) -> str:
        if self.column == WHOLE_FILE:
            return f"{self.file}: {self.rule}. Fix: {self.fix}"
        where = f"row {self.row}" if self.row >= 0 else "all rows"
        more = f" ({self.count} rows affected)" if self.count > 1 else ""
        return f"{self.file}: column '{self.column}', {where}: {self.rule}{more}. Fix: {self.fix}"


class BarDataError(Exception):
    """Bars that break the data contract; `problems` lists every broken rule."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))

    def lines(self) -> list[str]:
        """One line per problem; a whole-column problem found alike in several files is one line that counts them."""
        seen: dict[tuple[str, str, str] | int, tuple[str, int]] = {}  # key -> (the first one's line, how many)
        for i, p in enumerate(self.problems):
            key = (p.column, p.rule, p.fix) if p.row < 0 else i  # whole-column problems alike share a key
            line, n = seen.get(key, (str(p), 0))
            seen[key] = (line, n + 1)
        return [line + (f" (the same in {n - 1} more file{'s' if n > 2 else ''})" if n > 1 else "")
                for line, n in seen.values()]

    def summary(self, source: str, most: int = 0, inline: bool = False) -> str:
        """"SOURCE: N problem(s) in the bars:", then each of lines() (the first `most` where there are more) on a
        line of its own, or after it separated by "; " (`inline`)."""
        lines = self.lines()
        more = (f" (the first {most} shown; `python -m features.check {source}` with the same column flags lists "
                "all)" if 0 < most < len(lines) else "")
        head, shown = f"{source}: {len(self.problems)} problem(s) in the bars{more}:", lines[:most or None]
        return f"{head} {'; '.join(shown)}" if inline else "\n  ".join([head, *shown])


class ColumnBlock(Mapping[str, np.ndarray]):
    """Named columns held as the rows of one `[columns, n]` array; `block_for` takes the block whole."""

    __slots__ = ("_index", "block", "names")

    def __init__(self, names: tuple[str, ...], block: np.ndarray) -> None:
        self.names = names
        self.block = block  # [columns, n]
        self._index = {name: i for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.block[self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def block_for(columns: Mapping[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray | None:
    """The `[len(names), n]` block itself when `columns` holds exactly `names` in this order as one; else None."""
    return columns.block if isinstance(columns, ColumnBlock) and columns.names == names else None


@dataclass
class Bars:
    """Validated bars, rows grouped by symbol in time order. Columns may be read-only views of arrow's buffers."""

    timestamp_ns: np.ndarray  # int64 [N]   UTC nanoseconds
    symbol: np.ndarray  # object [N]  symbol per row
    open: np.ndarray  # float64 [N]
    high: np.ndarray  # float64 [N]
    low: np.ndarray  # float64 [N]
    close: np.ndarray  # float64 [N]
    volume: np.ndarray  # float64 [N]
    user: Mapping[str, np.ndarray] = field(default_factory=dict)  # float64 [N] each (a dict or a ColumnBlock)
    labels: Mapping[str, np.ndarray] = field(default_factory=dict)  # str [N] each: categorical user columns
    files: list[str] = field(default_factory=list)  # source files, in reading order
    notes: list[str] = field(default_factory=list)  # how the files were read, where a reader should know
    contract: np.ndarray | None = None  # object [N]: each bar's contract, in a continuous series of a root
    log_offset: np.ndarray | None = None  # float64 [N]: added to log(close) so no return spans a roll
    dropped: list[DroppedRow] = field(default_factory=list)  # the rows `--bad-rows drop` left out of the files

    def __len__(self) -> int:
        return int(self.timestamp_ns.shape[0])

    @property
    def symbols(self) -> list[str]:
        return sorted({str(s) for s in np.unique(self.symbol)})

    def take(self, rows: np.ndarray) -> Bars:
        """The `rows` (a bool mask or indices) of every per-row column."""
        def rows_of(column: np.ndarray | None) -> np.ndarray | None:
            return None if column is None else np.asarray(column)[rows]

        user = ColumnBlock(self.user.names, self.user.block[:, rows]) if isinstance(self.user, ColumnBlock) \
            else {name: np.asarray(column)[rows] for name, column in self.user.items()}
        return replace(self, timestamp_ns=self.timestamp_ns[rows], symbol=self.symbol[rows], open=self.open[rows],
                       high=self.high[rows], low=self.low[rows], close=self.close[rows], volume=self.volume[rows],
                       user=user, labels={name: np.asarray(column)[rows] for name, column in self.labels.items()},
                       files=list(self.files), notes=list(self.notes), contract=rows_of(self.contract),
                       log_offset=rows_of(self.log_offset))

    def only(self, symbols: Sequence[str]) -> Bars:
        """The rows of `symbols` (each a series of these bars), in that order."""
        slices = self.series_slices()
        rows = [np.arange(slices[s].start, slices[s].stop) for s in symbols]
        return self.take(np.concatenate(rows) if rows else np.zeros(0, np.int64))

    def series_bounds(self) -> np.ndarray:
        """[start, end) rows of each series, in the order of series_slices: int64 [S, 2]."""
        return np.array([[sl.start, sl.stop] for sl in self.series_slices().values()], dtype=np.int64).reshape(-1, 2)

    def series_slices(self) -> dict[str, slice]:
        """Row range of each symbol (rows are grouped by symbol)."""
        if len(self) == 0:
            return {}
        change = np.flatnonzero(self.symbol[1:] != self.symbol[:-1]) + 1
        starts, ends = np.concatenate([[0], change]), np.concatenate([change, [len(self)]])
        return {str(self.symbol[s]): slice(int(s), int(e)) for s, e in zip(starts, ends, strict=True)}


BAR_SUFFIXES = (".parquet", ".parq", ".pq", *DBN_SUFFIXES)  # the files a bars directory's read takes


def list_bar_files(path: Path) -> list[Path]:
    """The bars file at `path`, or the parquet and DBN files in the directory, in reading order."""
    if path.is_file():
        return [path]
    if path.is_dir():  # hidden and temporary files (".x", "_x") are skipped, as pyarrow's datasets do
        return sorted((p for p in path.rglob("*") if p.name.lower().endswith(BAR_SUFFIXES)
                       and p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)),
                      key=lambda p: (_natural_key(p), p.as_posix()))
    return []


def clash_with_bars(out: Path, bars: Path) -> str | None:
    """Why writing `out` would replace the bars at `bars` or join them on the next read, else None."""
    try:
        target = out.parent.resolve() / out.name  # what a write replaces: a link itself, not what it points to
        exists = out.exists()
        same = (target == bars.parent.resolve() / bars.name or out.resolve() == bars.resolve()
                or (exists and bars.is_file() and os.path.samefile(out, bars)))
        if same:
            return f"{out} is the bars file {bars} itself, which writing it would replace"
        if not bars.is_dir():
            return None
        root = bars.resolve()
        if (target.is_relative_to(root) and target.name.lower().endswith(BAR_SUFFIXES)
                and not any(part.startswith((".", "_")) for part in target.relative_to(root).parts)):
            return f"{out} is inside the bars directory {bars}, whose next read would take it as bars"
        if exists and any(os.path.samefile(out, f) for f in list_bar_files(bars)):
            return f"{out} is one of the bars files in {bars} (by another path), which writing it would replace"
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of symbolic links
        return f"{out} or the bars path {bars} cannot be resolved ({exc})"
    return None


def _natural_key(path: Path) -> tuple[tuple[int, int | str], ...]:
    """Path order with numbers compared as numbers: part-2 before part-10."""
    return tuple((0, int(piece)) if piece.isdigit() else (1, piece)
                 for piece in re.split(r"(\d+)", path.as_posix()) if piece)


def timestamps_ns(col: pa.ChunkedArray, file: str, name: str, unit: str) -> tuple[np.ndarray | None, Problem | None]:
    """The column as int64 UTC nanoseconds (nulls as 0: the null mask names them), or its Problem."""
    t = col.type
    integers = pa.types.is_integer(t)
    if not (pa.types.is_timestamp(t) or integers):
        return None, Problem(file, name, -1, f"timestamp has type {t}, expected int64 nanoseconds or a timestamp type",
                             "write timestamps as int64 UTC nanoseconds or an arrow timestamp, or map another column "
                             "with --time-col")
    try:
        if integers and unit != "ns":  # integers in the unit given: an arrow timestamp of that unit
            col = col.cast(pa.int64()).cast(pa.timestamp(unit))
        if pa.types.is_timestamp(col.type) and col.type.unit != "ns":
            col = col.cast(pa.timestamp("ns", tz=col.type.tz))
        ns = pc.fill_null(col.cast(pa.int64()), 0)
    except pa.ArrowInvalid:  # a time int64 nanoseconds cannot hold: a 9999-12-31 or UINT64_MAX placeholder
        return None, _out_of_range_problem(col, file, name, unit if integers else "ns")
    out = np.asarray(ns.to_numpy(zero_copy_only=False), dtype=np.int64)
    if integers and out.size and 0 < (top := int(out.max())) < PLAUSIBLE_NS:  # read in the unit given
        return None, _unit_problem(file, name, top // NS_PER_UNIT[unit], unit)
    return out, None


def _out_of_range_problem(col: pa.ChunkedArray, file: str, name: str, read_as: str) -> Problem:
    """The rows of a timestamp or unsigned integer column beyond int64 nanoseconds."""
    top = np.iinfo(np.int64).max
    if pa.types.is_timestamp(col.type):
        unit = col.type.unit
        raw = pc.fill_null(col.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(np.abs(raw) > top // NS_PER_UNIT[unit])
    else:  # an unsigned integer column of nanoseconds: above int64's largest
        unit = "ns"
        raw = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(raw > np.uint64(top))
    row = int(bad[0]) if bad.size else -1
    try:
        shown = f" ({col[row]})" if bad.size else ""
    except (OverflowError, ValueError):
        shown = f" ({raw[row]} {unit})"
    fix = "replace placeholder times such as 9999-12-31 with the bars' real times, or drop those rows"
    if read_as != "ns" and bad.size == raw.size:  # every row: the unit, not placeholders
        fix = f"give --time-unit {_unit_of(int(raw.max()))} (read as {UNIT_NAMES[read_as]}, every time is past 2262)"
    return Problem(file, name, row, f"timestamp{shown} outside what int64 nanoseconds hold (1677 to 2262)", fix,
                   max(int(bad.size), 1))


F32_MAX = float(np.finfo(np.float32).max)  # features are float32: a user value beyond this would be infinite
PLAUSIBLE_NS = 10**17  # integer nanoseconds all before this (1973-03-03) are another unit


def _unit_of(top: int) -> str:
    """The --time-unit whose epoch values a latest timestamp of `top` looks like (each bound is the year 5138)."""
    return "s" if top < 10**11 else "ms" if top < 10**14 else "us" if top < 10**17 else "ns"


def _unit_problem(file: str, name: str, top: int, read_as: str = "ns") -> Problem:
    flag = _unit_of(top)
    unit, factor = UNIT_NAMES[flag], NS_PER_UNIT[flag]
    return Problem(file, name, -1, f"integer timestamps (the latest {top}) read as {UNIT_NAMES[read_as]} all "
                   f"fall before 1973-03-03: they look like {unit} since the Unix epoch",
                   f"give --time-unit {flag}, or write int64 UTC nanoseconds ({unit} x "
                   f"{factor:,}) or an arrow timestamp type with its unit")


def _first_bad(mask: np.ndarray) -> tuple[int, int]:
    idx = np.flatnonzero(mask)
    return (int(idx[0]), int(idx.size)) if idx.size else (-1, 0)


def read_bars(path: str | Path, columns: ColumnMap | None = None, user_columns: tuple[str, ...] = (),
              symbols: Collection[str] | None = None, check_user_values: bool = True,
              label_columns: tuple[str, ...] = ()) -> Bars:
    """Read and validate bars; raise BarDataError listing every problem. With `symbols`, only their rows are read;
    with `check_user_values` False, NaN or inf user values stay (the caller skips them: `unusable_user_rows`).
    `label_columns`: categorical user columns (strings, dictionary or integer columns), read as text."""
    cmap = columns or ColumnMap()
    root = Path(path)
    if problems := _mapping_problems(root, cmap, (*user_columns, *label_columns)):
        raise BarDataError(problems)
    files = list_bar_files(root)
    if not files:
        rule = "no .parquet, .parq, .pq, .dbn or .dbn.zst files found" if root.exists() else "no such file or directory"
        raise BarDataError([Problem(str(root), WHOLE_FILE, -1, rule, "pass a parquet or DBN file, or a directory of "
                                    "them")])
    parts: list[dict[str, np.ndarray]] = []
    file_of_part: list[str] = []
    naive: list[str] = []  # files whose arrow timestamps carry no time zone
    file_rows: dict[str, np.ndarray] = {}  # a file read in part: the file's row number of each row read
    for file in files:
        part, file_problems, kept, zoneless = _read_file(file, root, cmap, user_columns, symbols, label_columns)
        problems += file_problems
        if kept is not None:
            file_rows[str(file)] = kept
        if part is not None:
            parts.append(part)
            file_of_part.append(str(file))
            naive += [str(file)] if zoneless else []
    dropped = drop_bad_rows(parts, file_of_part, cmap, file_rows) if not problems and cmap.bad_rows == "drop" else []
    problems = problems or validate(parts, file_of_part, cmap, user_columns, check_user_values)
    if problems:
        raise BarDataError([_as_reported(p, file_rows) for p in problems])
    bars = _assemble(parts, file_of_part, user_columns, label_columns)
    bars.dropped = dropped
    if naive:
        bars.notes.append(_naive_note(cmap, naive))
    if dropped:
        bars.notes.append(dropped_note(dropped))
    return bars


def _read_file(file: Path, root: Path, cmap: ColumnMap, user_columns: tuple[str, ...],
               symbols: Collection[str] | None, label_columns: tuple[str, ...] = ()
               ) -> tuple[dict[str, np.ndarray] | None, list[Problem], np.ndarray | None, bool]:
    """One file's part (or None), its problems, its rows read when read in part, and whether its times lack a zone."""
    try:
        table = _read_table(file, root)
    except (pa.ArrowException, OSError, DbnFileError) as exc:
        return None, [Problem(str(file), WHOLE_FILE, -1, f"cannot be read as {'DBN' if is_dbn(file) else 'parquet'} "
                              f"({exc})",
                              "re-write the file, or move it out of the data directory")], None, False
    kept = None
    try:
        if symbols is not None:
            table, kept = _only_symbols(table, cmap, symbols, (*user_columns, *label_columns))
        part, problems = _columns_of(table, str(file), cmap, user_columns, label_columns)
    except pa.ArrowException as exc:
        return None, [Problem(str(file), WHOLE_FILE, -1, f"cannot be read as bars ({exc})",
                              "store the bar columns as numbers and the symbol as text")], None, False
    stamp = table.schema.field(cmap.timestamp).type if part is not None else None
    return part, problems, kept, bool(stamp is not None and pa.types.is_timestamp(stamp) and stamp.tz is None)


def _mapping_problems(root: Path, cmap: ColumnMap, user_columns: tuple[str, ...]) -> list[Problem]:
    """A column mapped to two fields (prices may share one), or a user feature that is the time or symbol."""
    fields: dict[str, list[str]] = {}
    for field_name in ("timestamp", "symbol", *PRICE_COLUMNS, "volume"):
        fields.setdefault(cmap.source(field_name), []).append(field_name)
    problems = [Problem(str(root), column, -1, f"column {column!r} is mapped to {' and '.join(f)}",
                        "map each of these fields to its own column (--time-col, --symbol-col, --volume-col ...)")
                for column, f in fields.items() if len(f) > 1 and not set(f) <= set(PRICE_COLUMNS)]
    roles = {cmap.timestamp: "timestamp (--time-col)", cmap.symbol: "symbol (--symbol-col)"}
    problems += [Problem(str(root), u, -1, f"user feature {u!r} is the bars' {roles[u]} column",
                         "user features are further numeric columns of the bars: leave it out of --features (the "
                         "time and symbol reach the model as their own features)") for u in user_columns if u in roles]
    return problems


def _read_table(file: Path, root: Path) -> pa.Table:
    """One parquet or DBN file, with its hive partitions (`key=value` directories) as columns it lacks."""
    # pre_buffer would hold a second copy of a parquet file
    table = _dbn_table(file) if is_dbn(file) else pq.ParquetFile(file, pre_buffer=False).read()
    dirs = file.relative_to(root).parts[:-1]  # () for a file read alone
    for key, value in (map(unquote, d.split("=", 1)) for d in dirs if "=" in d):
        if key not in table.column_names:
            table = table.append_column(key, pa.repeat(pa.scalar(value, pa.string()), table.num_rows))
    return table


def _naive_note(cmap: ColumnMap, naive: list[str]) -> str:
    where = naive[0] + (f" and {len(naive) - 1} more file(s)" if len(naive) > 1 else "")
    return (f"timestamp column '{cmap.timestamp}' has no time zone ({where}): read as UTC. If it holds exchange "
            "local times, store it with its zone (timestamp[ns, tz=America/Chicago]) or convert it to UTC; the "
            "server takes UTC, and --calendar-tz sets the calendar's zone")


def _only_symbols(table: pa.Table, cmap: ColumnMap, symbols: Collection[str],
                  user_columns: tuple[str, ...]) -> tuple[pa.Table, np.ndarray | None]:
    """The rows of `symbols` (the columns a read uses) and their row numbers in the file (None: every row)."""
    count = table.column_names.count(cmap.symbol)
    if count == 0:  # the file is one series, named by the default symbol
        return (table, None) if cmap.default_symbol in symbols else (table.slice(0, 0), np.zeros(0, np.int64))
    if count > 1:  # _missing_columns names the problem
        return table, None
    text = table.column(cmap.symbol).cast(pa.string())
    keep = pc.fill_null(pc.is_in(text, value_set=pa.array(sorted(symbols), pa.string())), False)
    kept = np.flatnonzero(np.asarray(keep.to_numpy(zero_copy_only=False), dtype=bool))
    if kept.size == table.num_rows:
        return table, None
    used = {cmap.source(f) for f in (*REQUIRED_COLUMNS, "symbol")} | set(user_columns)
    if used <= set(table.column_names):
        table = table.select([i for i, name in enumerate(table.column_names) if name in used])
    return table.take(pa.array(kept)), kept


def _as_reported(p: Problem, file_rows: dict[str, np.ndarray]) -> Problem:
    """`p` with its row numbered in its file (one read in part) and, for a row rule, the --bad-rows hint."""
    if (rows := file_rows.get(p.file)) is not None and 0 <= p.row < rows.size:
        p = replace(p, row=int(rows[p.row]))
    return replace(p, fix=p.fix + BAD_ROWS_HINT) if p.rule_id in ROW_RULES else p


def _columns_of(table: pa.Table, fname: str, cmap: ColumnMap, user_columns: tuple[str, ...],
                label_columns: tuple[str, ...] = ()) -> tuple[dict[str, np.ndarray] | None, list[Problem]]:
    """The file's bar and user columns as numpy arrays (a part), or the problems that stop reading them."""
    problems = _missing_columns(table, fname, cmap, user_columns) + _label_problems(table, fname, label_columns)
    if problems:
        return None, problems
    ts, p = timestamps_ns(table.column(cmap.timestamp), fname, cmap.timestamp, cmap.time_unit)
    if p is not None or ts is None:
        return None, [p] if p else []
    part = {"timestamp": ts,
            "timestamp_null": np.asarray(table.column(cmap.timestamp).is_null().to_numpy(zero_copy_only=False))}
    problems += _symbol_columns(table, fname, cmap, part)
    for fld in (*PRICE_COLUMNS, "volume"):
        col = table.column(cmap.source(fld))
        if not numeric(col.type):
            problems.append(Problem(fname, cmap.source(fld), -1, f"has type {col.type}, not numeric",
                                    "store prices and volume as numbers"))
            continue
        problems += _as_float64(col, fname, cmap.source(fld), part, fld)
    for uc in user_columns:
        problems += _as_float64(table.column(uc), fname, uc, part, f"user:{uc}")
    for lc in label_columns:
        part[f"label:{lc}"] = np.asarray(table.column(lc).cast(pa.string()).to_numpy(zero_copy_only=False),
                                         dtype=object)
    return (None if problems else part), problems


def labels_type(t: pa.DataType) -> bool:
    """Whether a column can hold categories: text, dictionary-encoded or integer."""
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t)
                or pa.types.is_integer(t))


def _label_problems(table: pa.Table, fname: str, label_columns: tuple[str, ...]) -> list[Problem]:
    """A categorical column that is missing, of floats, or with nulls."""
    problems = []
    for lc in label_columns:
        if lc not in table.column_names:
            problems.append(Problem(fname, lc, -1, f"categorical feature column '{lc}' is missing",
                                    "add the column or drop it from the feature lists"))
        elif not labels_type(ltype := table.schema.field(lc).type):
            fix = ("cast it to integers or text if its values are categories, or leave it out of "
                   "--categorical-features to use it as a real") if pa.types.is_floating(ltype) else \
                "store categories as text, a dictionary or integers"
            problems.append(Problem(fname, lc, -1, f"categorical feature column '{lc}' has type {ltype}", fix))
        elif (nulls := table.column(lc).null_count):
            row, _ = _first_bad(np.asarray(table.column(lc).is_null().to_numpy(zero_copy_only=False), dtype=bool))
            problems.append(Problem(fname, lc, row, f"categorical feature '{lc}' is null",
                                    "fill in a label for every bar (e.g. 'none')", nulls))
    return problems


def numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t))


def _missing_columns(table: pa.Table, fname: str, cmap: ColumnMap, user_columns: tuple[str, ...]) -> list[Problem]:
    """Columns the bars need that the file lacks, holds twice, or holds as another type (user features)."""
    names = table.column_names
    have = ", ".join(sorted(set(names)))
    used = {cmap.source(f) for f in (*REQUIRED_COLUMNS, "symbol")} | set(user_columns)
    twice = [Problem(fname, name, -1, f"column '{name}' appears {names.count(name)} times in the file",
                     "keep one column of that name (rename or drop the others)")
             for name in sorted(used) if names.count(name) > 1]
    if twice:
        return twice
    problems = [Problem(fname, cmap.source(fld), -1, f"required column '{cmap.source(fld)}' is missing (have: {have})",
                        f"add it, or map the column that holds {fld} with {ColumnMap.flag(fld)} NAME",
                        rule_id="missing_column")
                for fld in REQUIRED_COLUMNS if cmap.source(fld) not in names]
    if cmap.symbol not in names and cmap.symbol != ColumnMap.symbol:  # a name given, not the optional default
        problems.append(Problem(fname, cmap.symbol, -1, f"symbol column '{cmap.symbol}' is missing (have: {have})",
                                "map the column that holds the symbol with --symbol-col NAME, or give --symbol-col "
                                "symbol (the default, which may be absent) to read the file as one series"))
    for uc in user_columns:
        if uc not in names:
            problems.append(Problem(fname, uc, -1, f"user feature column '{uc}' is missing",
                                    "add the column or drop it from the feature list"))
        elif not numeric(utype := table.schema.field(uc).type):
            problems.append(Problem(fname, uc, -1, f"user feature column '{uc}' has type {utype}, not numeric",
                                    "choose a numeric column, or name it in --categorical-features too"))
    return problems


def _symbol_columns(table: pa.Table, fname: str, cmap: ColumnMap, part: dict[str, np.ndarray]) -> list[Problem]:
    """Adds the symbol of each row to `part`; a null or empty symbol is a problem."""
    n = table.num_rows
    if cmap.symbol not in table.column_names:  # the file is one series, named by the default symbol
        part["symbol"] = np.full(n, cmap.default_symbol, dtype=object)
        part["symbol_absent"] = np.ones(n, dtype=bool)
        return [] if cmap.default_symbol else [Problem(fname, cmap.symbol, -1, "no such column, so the file is one "
                                                       "series, and its name (--default-symbol) is empty",
                                                       "name it: --default-symbol ES, say")]
    symbol = table.column(cmap.symbol)
    codes = pc.dictionary_encode(pc.fill_null(symbol.cast(pa.string()), "")).combine_chunks()
    distinct = np.array(codes.dictionary.to_pylist(), dtype=object)
    part["symbol"] = distinct[np.asarray(codes.indices.to_numpy(zero_copy_only=False), dtype=np.int64)]
    part["symbol_names"] = distinct
    part["symbol_absent"] = np.zeros(n, dtype=bool)
    null = np.asarray(symbol.is_null().to_numpy(zero_copy_only=False))
    problems: list[Problem] = []
    for mask, rule in ((null, "symbol is null"), ((part["symbol"] == "") & ~null, "symbol is empty")):
        row, count = _first_bad(mask)
        if count:
            problems.append(Problem(fname, cmap.symbol, row, rule, "fill in the symbol, or drop those rows", count))
    return problems


EXACT_INT = 2**53  # float64 holds every integer up to this, and not all beyond
PLACEHOLDERS = {2**63 - 1: "INT64_MAX", -(2**63): "INT64_MIN", 2**64 - 1: "UINT64_MAX"}
PLACEHOLDER_RULE = "most likely a feed's placeholder for a missing value (INT64_MAX or UINT64_MAX as a float)"
PLACEHOLDER_FIX = "drop or repair those rows; fixed-point prices are fine below 2^53 (9.0e15)"


def valid_price(x: np.ndarray) -> np.ndarray:
    """Where x holds a price: finite, positive and not a placeholder."""
    with np.errstate(invalid="ignore"):
        return (x > 0) & (x <= EXACT_INT)  # NaN fails both


def _as_float64(col: pa.ChunkedArray, fname: str, name: str, part: dict[str, np.ndarray], key: str) -> list[Problem]:
    """Adds the column to `part` as float64, or returns the Problem of integers too large for it (placeholders)."""
    if pa.types.is_integer(col.type):
        limit = pa.scalar(EXACT_INT, pa.uint64() if pa.types.is_unsigned_integer(col.type) else pa.int64())
        big = pc.greater(col, limit)
        if pa.types.is_signed_integer(col.type):
            big = pc.or_(big, pc.less(col, -EXACT_INT))
        row, count = _first_bad(np.asarray(pc.fill_null(big, False).to_numpy(zero_copy_only=False), dtype=bool))
        if count:
            value = col[row].as_py()
            known = f" ({PLACEHOLDERS[value]}: a feed's placeholder for a missing value)" if value in PLACEHOLDERS \
                else ""
            return [Problem(fname, name, row, f"{value} is beyond the integers a float64 holds exactly (±2^53){known}",
                            "set missing values to null and drop or repair those rows; write fixed-point prices as "
                            "floats (divided by their scale, e.g. 1e9)", count)]
    part[key] = np.asarray(col.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)
    return []


def _assemble(parts: list[dict[str, np.ndarray]], files: list[str], user_columns: tuple[str, ...],
              label_columns: tuple[str, ...] = ()) -> Bars:
    """The parts' rows as one Bars, grouped by symbol; consumes the parts' columns one at a time to hold rows once."""
    symbol = _joined(parts, "symbol")
    by_symbol = np.argsort(symbol.astype(str), kind="stable")
    order = None if np.array_equal(by_symbol, np.arange(by_symbol.size)) else by_symbol
    symbol = symbol if order is None else symbol[order]

    def take(key: str) -> np.ndarray:
        if order is None:
            return _joined(parts, key)
        column = _joined(parts, key)[order]
        pa.default_memory_pool().release_unused()
        return column

    return Bars(timestamp_ns=take("timestamp"), symbol=symbol, open=take("open"), high=take("high"), low=take("low"),
                close=take("close"), volume=take("volume"),
                user={uc: take(f"user:{uc}") for uc in dict.fromkeys(user_columns)},  # a name given twice is one column
                labels={lc: take(f"label:{lc}") for lc in dict.fromkeys(label_columns)}, files=list(files))


def _joined(parts: list[dict[str, np.ndarray]], key: str) -> np.ndarray:
    arrays = [p.pop(key) for p in parts]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def validate(parts: list[dict[str, np.ndarray]], files: list[str], cmap: ColumnMap,
             user_columns: tuple[str, ...] = (), check_user_values: bool = True) -> list[Problem]:
    """Check every row rule per file (value rules) and per symbol across files (order and price-scale rules)."""
    problems: list[Problem] = []
    for part, fname in zip(parts, files, strict=True):
        for rule_id, mask, column, rule, fix in _value_checks(part, cmap, user_columns if check_user_values else ()):
            row, count = _first_bad(mask)
            if count:
                problems.append(Problem(fname, column, row, rule + _whose(part, mask), fix, count, rule_id))
    rows = _Rows.of(parts)
    problems.extend(_order_problems(parts, files, cmap, rows))
    problems.extend(_scale_problems(parts, files, cmap, rows))
    return problems


def rules_hold(timestamp_ns: np.ndarray, open_: np.ndarray, high: np.ndarray, low: np.ndarray, close: np.ndarray,
               volume: np.ndarray, user: np.ndarray | None = None, starts: np.ndarray | None = None) -> bool:
    """Whether one series' rows, in the order sent, keep every rule of `validate`, in a few whole-array passes (a
    server checks each request so, and asks `validate` what is wrong only when one fails): low <= min(open,
    close), max(open, close) <= high, low > 0 and high <= 2^53 cover the price rules, and NaN fails a comparison.
    `user` float64 [U, n]: the user columns read; `starts` (int [k]): rows that begin another contract's bars,
    where the rules between a bar and the one before do not apply."""
    o, h, lo, c, v, ts = open_, high, low, close, volume, timestamp_ns
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ok = bool((lo > 0).all() and (h <= EXACT_INT).all() and (np.minimum(o, c) >= lo).all()
                  and (np.maximum(o, c) <= h).all() and (v >= 0).all() and (v <= EXACT_INT).all())
        pairs = np.ones(max(ts.shape[0] - 1, 0), dtype=bool)  # [n - 1]: bar j + 1 against bar j
        if starts is not None:
            pairs[starts - 1] = False
        if ok:  # prices positive and finite: no close a hundredfold off the one before (a change of units)
            ratio = c[1:] / c[:-1]
            ok = bool((((ratio < MAX_BAR_PRICE_RATIO) & (ratio > 1 / MAX_BAR_PRICE_RATIO)) | ~pairs).all())
        ok = ok and bool(((ts[1:] > ts[:-1]) | ~pairs).all())  # compared, not differenced: a difference can overflow
        return ok and (user is None or bool((np.abs(user) <= F32_MAX).all()))  # finite, within float32's range


@dataclass(frozen=True)
class _Rows:
    """Every row of the parts in reading order, and the stable order that groups them by symbol."""

    symbol: np.ndarray  # str [N]
    file_idx: np.ndarray  # int [N]
    row_in_file: np.ndarray  # int [N]
    by_symbol: np.ndarray  # int [N], a permutation

    @staticmethod
    def of(parts: list[dict[str, np.ndarray]]) -> _Rows:
        sym = np.concatenate([p["symbol"] for p in parts]).astype(str)
        return _Rows(sym, np.concatenate([np.full(len(p["timestamp"]), i) for i, p in enumerate(parts)]),
                     np.concatenate([np.arange(len(p["timestamp"])) for p in parts]), np.argsort(sym, kind="stable"))

    def grouped(self, keep: np.ndarray) -> np.ndarray:
        """The rows where `keep` holds, grouped by symbol."""
        return self.by_symbol[keep[self.by_symbol]]


MAX_BAR_PRICE_RATIO = 100.0  # a close this factor off the previous one of its symbol is a change of units


def _scale_problems(parts: list[dict[str, np.ndarray]], files: list[str], cmap: ColumnMap,
                    rows: _Rows) -> list[Problem]:
    """Closes MAX_BAR_PRICE_RATIO or more off their neighbours': a lone bad print (_lone_prints), or a jump from the
    previous bar of the symbol that lasts (a change of price units). One problem per symbol of each."""
    close = np.concatenate([p["close"] for p in parts])
    timed = ~np.concatenate([p["timestamp_null"] for p in parts])
    absent = np.concatenate([p["symbol_absent"] for p in parts])
    order = rows.grouped(timed & valid_price(close))  # bad prices have their own problems
    c, s = close[order], rows.symbol[order]
    jumps, lone = _bad_prints(c, s)
    lasting = jumps[~np.isin(jumps, lone) & ~np.isin(jumps + 1, lone)]
    out: list[Problem] = []
    for k, n in _first_per_symbol(s, lone):
        bad, median = order[k], float(np.median(np.concatenate(_sides(c, s, k))))  # of the bars on either side
        out.append(Problem(files[rows.file_idx[bad]], cmap.close, int(rows.row_in_file[bad]),
                           f"close {close[bad]:.10g} is {c[k] / median:.3g} times the median close "
                           f"of the {s[k]} bars around it: a bad print (rule: a close within "
                           f"{MAX_BAR_PRICE_RATIO:g}x of its neighbours')",
                           "drop or repair the row" + (_one_series_note(cmap) if absent[bad] else ""), n, "bad_print"))
    for k, n in _first_per_symbol(s[1:], lasting):
        before, bad = order[k], order[k + 1]
        earlier = files[rows.file_idx[before]]
        where = "" if rows.file_idx[before] == rows.file_idx[bad] else f" (that bar is in {earlier})"
        fix = ("give every file's prices in one unit (e.g. 1e-9 fixed-point integers in one file and dollars in "
               "another: convert one of them)") + (_one_series_note(cmap) if absent[bad] else "")
        out.append(Problem(files[rows.file_idx[bad]], cmap.close, int(rows.row_in_file[bad]),
                           f"close {close[bad]:.10g} is {close[bad] / close[before]:.3g} times the previous bar's "
                           f"close of {s[k]}, {close[before]:.10g}{where}: a change of price units, not a market "
                           f"move (rule: a close within {MAX_BAR_PRICE_RATIO:g}x of the previous one)", fix, n,
                           "price_units"))
    return out


def _first_per_symbol(symbol: np.ndarray, at: np.ndarray) -> list[tuple[int, int]]:
    """The first of the positions `at` (ascending) of each symbol, and how many it has, in order of position."""
    _, first, count = np.unique(symbol[at], return_index=True, return_counts=True)
    return sorted((int(at[i]), int(n)) for i, n in zip(first, count, strict=True))


def _bad_prints(c: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of closes c grouped by symbol s in time order: the positions k where c[k + 1] is MAX_BAR_PRICE_RATIO or
    more off c[k] of the same symbol, and the positions on either side of such a jump that are bad prints (_lone)."""
    with np.errstate(over="ignore"):
        ratio = c[1:] / c[:-1]
    jumps = np.flatnonzero((s[1:] == s[:-1]) & ((ratio >= MAX_BAR_PRICE_RATIO) | (ratio <= 1 / MAX_BAR_PRICE_RATIO)))
    suspects = np.unique(np.concatenate([jumps, jumps + 1]))
    return jumps, suspects[_lone(c, s, suspects)]


def _sides(c: np.ndarray, s: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The closes of the symbol's PRINT_NEIGHBOURS bars before position k, and after it."""
    before, after = slice(max(k - PRINT_NEIGHBOURS, 0), k), slice(k + 1, k + 1 + PRINT_NEIGHBOURS)
    return c[before][s[before] == s[k]], c[after][s[after] == s[k]]


def _lone(c: np.ndarray, s: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Whether the close at each position of `at` is MAX_BAR_PRICE_RATIO or more off the median of the bars before
    it and off that of the bars after it (where it has any): a bad print, or a few, among good ones; a change of
    price units, however short, leaves one side's median at its own. bool [len(at)]."""
    def off(x: float, side: np.ndarray) -> bool:
        ratio = x / np.median(side)
        return bool(ratio >= MAX_BAR_PRICE_RATIO or ratio <= 1 / MAX_BAR_PRICE_RATIO)

    return np.array([any(side.size for side in sides) and all(off(c[k], side) for side in sides if side.size)
                     for k in at for sides in [_sides(c, s, k)]], dtype=bool)


Check = tuple[str, np.ndarray, str, str, str]  # rule id, bool mask of the rows that break it, column, rule, fix


def _value_checks(part: dict[str, np.ndarray], cmap: ColumnMap, user_columns: tuple[str, ...]) -> list[Check]:
    """Each rule of a row's own values (no NaN, positive prices, low <= open, close <= high, volume >= 0) and the
    rows of `part` that break it."""
    out: list[Check] = [("timestamp_null", part["timestamp_null"], cmap.timestamp, "timestamp is null",
                         "drop rows without a timestamp")]
    for fld in (*PRICE_COLUMNS, "volume"):
        v, name = part[fld], cmap.source(fld)
        out += [("nan", np.isnan(v), name, f"{fld} is NaN or null", f"drop or repair rows with missing {fld}"),
                ("infinite", np.isinf(v), name, f"{fld} is infinite", f"repair the {fld}"),
                ("placeholder", np.isfinite(v) & (v > EXACT_INT), name, f"{fld} is beyond 2^53, {PLACEHOLDER_RULE}",
                 PLACEHOLDER_FIX)]
        if fld != "volume":
            out.append(("not_positive", np.isfinite(v) & (v <= 0), name, f"{fld} is not positive (prices must be > 0)",
                        "drop or repair the row; back-adjusted continuous contracts must be shifted to positive "
                        "prices"))
    o, h, lo, c = part["open"], part["high"], part["low"], part["close"]
    # range rules only on valid prices: a bad row is reported once
    priced = np.all([valid_price(x) for x in (o, h, lo, c)], axis=0)
    ranged = priced & (h >= lo)
    out += [("high_below_low", priced & (h < lo), cmap.high, "high < low (rule: low <= high)",
             "swap or repair high and low"),
            ("above_high", ranged & ((o > h) | (c > h)), cmap.high, "open or close above high (rule: open, close <= "
             "high)", "high must be the bar's maximum: set high = max(open, high, close)"),
            ("below_low", ranged & ((o < lo) | (c < lo)), cmap.low, "open or close below low (rule: low <= open, "
             "close)", "low must be the bar's minimum: set low = min(open, low, close)"),
            ("negative_volume", part["volume"] < 0, cmap.volume, "volume is negative (rule: volume >= 0)",
             "repair the volume")]
    for uc in user_columns:
        x = part[f"user:{uc}"]
        out += [("user_not_finite", ~np.isfinite(x), uc, f"user feature '{uc}' is NaN or infinite",
                 "fill or drop those rows, or drop the column from the feature list"),
                ("user_beyond_float32", np.isfinite(x) & (np.abs(x) > F32_MAX), uc, f"user feature '{uc}' is beyond "
                 f"float32's range (|x| > {F32_MAX:.3g}; the model computes in float32)",
                 "rescale the column, or fill or drop those rows")]
    return out


# the rules a row breaks alone, or as an isolated print among its symbol's bars: --bad-rows drop drops such rows
ROW_RULES = ("timestamp_null", "nan", "infinite", "placeholder", "not_positive", "high_below_low", "above_high",
             "below_low", "negative_volume", "bad_print")
BAD_ROWS_HINT = "; or pass --bad-rows drop to drop each row that breaks a price rule (and list them)"
PRINT_NEIGHBOURS = 5  # bars on each side of a close whose median it is judged against: a bad print stands alone
DROPPED_SHOWN = 5  # dropped rows a note names


@dataclass(frozen=True)
class DroppedRow:
    """A row of a file that `--bad-rows drop` left out, and the rule it breaks."""

    file: str
    row: int  # 0-based within the file
    symbol: str
    timestamp_ns: int | None  # None: the row has none
    rule: str  # one of ROW_RULES

    def line(self) -> str:
        when = "no timestamp" if self.timestamp_ns is None else \
            str(np.datetime64(self.timestamp_ns, "ns"))[:19].replace("T", " ") + " UTC"
        return f"{self.file} row {self.row} ({self.symbol}, {when}): {self.rule}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def drop_bad_rows(parts: list[dict[str, np.ndarray]], files: list[str], cmap: ColumnMap,
                  file_rows: dict[str, np.ndarray]) -> list[DroppedRow]:
    """Remove from `parts` each row that breaks a rule of its own bar values (_value_checks), then each bad print
    (_lone; a change of price units stays the price-scale rule's to refuse).
    `file_rows` then holds each file's row number of each row kept. Returns the rows dropped."""
    origin = [file_rows.get(f, np.arange(len(p["timestamp"]))) for p, f in zip(parts, files, strict=True)]
    dropped: list[DroppedRow] = []

    def keep(i: int, rule: np.ndarray) -> None:
        part, bad = parts[i], rule != ""
        if not bad.any():  # no copy of a clean file's columns
            return
        dropped.extend(DroppedRow(files[i], int(origin[i][j]), str(part["symbol"][j]),
                                  None if part["timestamp_null"][j] else int(part["timestamp"][j]), str(rule[j]))
                       for j in np.flatnonzero(bad))
        for key, column in part.items():
            part[key] = column if key == "symbol_names" else column[~bad]
        origin[i] = origin[i][~bad]

    for i, part in enumerate(parts):
        rule = np.full(len(part["timestamp"]), "", dtype=object)
        for rule_id, mask, *_ in reversed(_value_checks(part, cmap, ())):  # the first rule broken names the row
            rule[mask] = rule_id
        keep(i, rule)
    for i, lone in enumerate(_lone_prints(parts)):
        keep(i, np.where(lone, "bad_print", ""))
    file_rows.update(zip(files, origin, strict=True))
    return dropped


def _lone_prints(parts: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """Per part, bool: the closes that are bad prints (_lone) among their symbol's bars in time order."""
    rows = _Rows.of(parts)
    close = np.concatenate([p["close"] for p in parts])
    order = np.lexsort((np.concatenate([p["timestamp"] for p in parts]), rows.symbol))  # by symbol, then time
    lone = np.zeros(close.size, dtype=bool)
    lone[order[_bad_prints(close[order], rows.symbol[order])[1]]] = True
    return np.split(lone, np.cumsum([len(p["close"]) for p in parts])[:-1])


def dropped_note(dropped: list[DroppedRow]) -> str:
    """What `--bad-rows drop` dropped: a count per rule, then the first rows."""
    rules, counts = np.unique([d.rule for d in dropped], return_counts=True)
    shown = "; ".join(d.line() for d in dropped[:DROPPED_SHOWN])
    more = f"; and {len(dropped) - DROPPED_SHOWN} more" if len(dropped) > DROPPED_SHOWN else ""
    return (f"--bad-rows drop: dropped {len(dropped)} row(s) that break a price rule ("
            + ", ".join(f"{r} {n}" for r, n in zip(rules, counts, strict=True)) + f"): {shown}{more}")


def cleaned_table(path: str | Path, dropped: list[DroppedRow]) -> pa.Table:
    """The bars at `path`, every column, less the `dropped` rows: what `features.check --bad-rows drop --out` writes."""
    root = Path(path)
    tables = []
    for file in list_bar_files(root):
        table = _read_table(file, root)
        rows = [d.row for d in dropped if d.file == str(file)]
        tables.append(table.filter(~np.isin(np.arange(table.num_rows), rows)) if rows else table)
    return pa.concat_tables(tables, promote_options="default")


def unusable_values(x: np.ndarray) -> np.ndarray:
    """Where user values are NaN, infinite or past float32's range: bool, x's shape."""
    with np.errstate(invalid="ignore"):
        return ~(np.abs(x) <= F32_MAX)  # NaN compares false


def unusable_user_rows(bars: Bars) -> np.ndarray:
    """Rows where any user column holds an unusable value: bool [N]."""
    return functools.reduce(np.logical_or, map(unusable_values, bars.user.values()), np.zeros(len(bars), dtype=bool))


def _one_series_note(cmap: ColumnMap) -> str:
    return (f" (the file has no '{cmap.symbol}' column, so all its rows were read as one series, "
            f"{cmap.default_symbol}: if it holds several symbols, map their column with --symbol-col NAME)")


def _whose(part: dict[str, np.ndarray], mask: np.ndarray) -> str:
    """In a file of several symbols, whose rows a problem's are: '; symbol ESH4', '; symbols A, B and 2 others'."""
    if part.get("symbol_names", np.empty(0)).size < 2:
        return ""
    names = [str(x) for x in dict.fromkeys(part["symbol"][mask])]
    if len(names) == 1:
        return f"; symbol {names[0]}"
    more = f" and {len(names) - 2} other{'s' if len(names) > 3 else ''}" if len(names) > 2 else ""
    return f"; symbols {names[0]}, {names[1]}{more}" if more else f"; symbols {names[0]} and {names[1]}"


def _order_problems(parts: list[dict[str, np.ndarray]], files: list[str], cmap: ColumnMap,
                    rows: _Rows) -> list[Problem]:
    """Timestamps strictly increase within each symbol, across files in reading order: one problem per
    overlapping pair of files, else the first decrease and the first duplicate."""
    ts = np.concatenate([p["timestamp"] for p in parts])
    order = rows.grouped(~np.concatenate([p["timestamp_null"] for p in parts]))
    ts_o, sym_o, file_o = ts[order], rows.symbol[order], rows.file_idx[order]
    prev, cur = ts_o[:-1], ts_o[1:]  # compared, not subtracted: a difference can overflow int64
    back = (sym_o[1:] == sym_o[:-1]) & (cur <= prev)
    across = back & (file_o[1:] != file_o[:-1])
    out = _overlap_problems(np.flatnonzero(across), order, ts_o, sym_o, file_o, files, cmap, rows)
    absent = np.concatenate([p["symbol_absent"] for p in parts])
    within = back & ~across
    for rule_id, mask, rule, fix in (
        ("timestamps_decrease", within & (cur < prev),
         "timestamps decrease within a symbol (rule: sorted by time per symbol)",
         "sort the rows by symbol and timestamp"),
        ("duplicate_timestamp", within & (cur == prev),
         "duplicate timestamp within a symbol (rule: one bar per timestamp)", "drop or merge duplicate bars"),
    ):
        idx = np.flatnonzero(mask)
        if not idx.size:
            continue
        bad = order[idx[0] + 1]
        fix += _one_series_note(cmap) if absent[bad] else ""
        others = len(np.unique(sym_o[idx + 1])) - 1
        more = f" (and {others} other symbol{'s' if others > 1 else ''})" if others else ""
        out.append(Problem(files[rows.file_idx[bad]], cmap.timestamp, int(rows.row_in_file[bad]),
                           f"{rule}; symbol {sym_o[idx[0] + 1]}{more}", fix, int(idx.size), rule_id))
    return out


def _overlap_problems(across: np.ndarray, order: np.ndarray, ts_o: np.ndarray, sym_o: np.ndarray,
                      file_o: np.ndarray, files: list[str], cmap: ColumnMap, rows: _Rows) -> list[Problem]:
    """One problem per place `across` where a file's bars of a symbol start at or before its last bar in an
    earlier file. The `_o` arrays are in `order`; a symbol's rows of one file are one run of them."""
    change = np.flatnonzero((sym_o[1:] != sym_o[:-1]) | (file_o[1:] != file_o[:-1])) + 1
    starts, ends = np.concatenate([[0], change]), np.concatenate([change, [ts_o.size]])
    run_of = np.repeat(np.arange(starts.size), ends - starts)
    rename = ("name the files so that path order is time order (numbers compare as numbers: part-2 before part-10; "
              "files named by a uuid, as pyarrow's write_to_dataset names them, are in no order)")
    out: list[Problem] = []
    for i in across:
        earlier, bad, symbol = files[rows.file_idx[order[i]]], order[i + 1], sym_o[i + 1]
        a, b = ts_o[starts[run_of[i]]:ends[run_of[i]]], ts_o[starts[run_of[i + 1]]:ends[run_of[i + 1]]]
        if b.max() < a.min():  # no bar shared: out of order alone
            rule, fix = f"symbol {symbol}'s bars here all come before its bars in {earlier}", rename
        else:
            rule = f"symbol {symbol}'s bars here start at or before its last bar in {earlier}"
            fix = f"drop the bars the files share, or {rename}"
        out.append(Problem(files[rows.file_idx[bad]], cmap.timestamp, int(rows.row_in_file[bad]),
                           f"{rule} (rule: the files, in path order, hold ever later bars of a symbol)", fix,
                           int(np.count_nonzero(b <= a.max()))))
    return out


def bars_digest(bars: Bars, user_columns: Sequence[str], label_columns: Sequence[str] = ()) -> str:
    """A digest of each symbol's rows, times, prices, volumes and the given user columns (reals, then the labels of
    categorical ones), as read."""
    h = hashlib.blake2b(digest_size=16)
    for symbol, rows in bars.series_slices().items():
        h.update(f"{symbol}\0{rows.start}\0{rows.stop}\0".encode())
    for column in (bars.timestamp_ns, bars.open, bars.high, bars.low, bars.close, bars.volume,
                   *(bars.user[name] for name in user_columns)):
        h.update(np.ascontiguousarray(column).tobytes())
    for name in label_columns:
        h.update("\0".join(np.asarray(bars.labels[name], dtype=str).tolist()).encode() + b"\1")
    return h.hexdigest()
