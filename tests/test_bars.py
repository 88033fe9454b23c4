"""Reading and validating bars: every rule with a real malformed parquet file."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE_BARS, write_parquet

from features.bars import BarDataError, ColumnMap, Problem, read_bars
from features.calendar import infer_bar_interval_ns
from tests.artifacts import run_main

T0 = 1_704_119_400 * 10**9  # 2024-01-01 14:30:00 UTC, in ns
MINUTE = 60 * 10**9
N_PER_SYMBOL = 10


def good_columns(n: int = N_PER_SYMBOL, symbols: tuple[str, ...] = ("ES", "NQ")) -> dict[str, Any]:
    """Valid bars with the symbols interleaved row by row (file row 2*i is ES bar i, 2*i+1 is NQ bar i),
    so that a row within the file differs from a row within its symbol."""
    k = len(symbols)
    bar = np.repeat(np.arange(n), k)  # bar index of each file row
    open_ = 100.0 + bar + np.tile(np.arange(k) * 1000.0, n)
    return {
        "timestamp": (T0 + bar * MINUTE).astype(np.int64),
        "symbol": np.tile(np.array(symbols, dtype=object), n),
        "open": open_,
        "high": open_ + 2.0,
        "low": open_ - 2.0,
        "close": open_ + 1.0,
        "volume": np.full(n * k, 10.0),
        "imbalance": np.linspace(-1.0, 1.0, n * k),
        "note": np.array(["x"] * (n * k), dtype=object),
    }


def problems_of(path: Path, columns: ColumnMap | None = None, user: tuple[str, ...] = ()) -> list[Problem]:
    with pytest.raises(BarDataError) as info:
        read_bars(path, columns, user)
    assert info.value.problems, "BarDataError without problems"
    return info.value.problems


def only_problem(path: Path, columns: ColumnMap | None = None, user: tuple[str, ...] = ()) -> Problem:
    problems = problems_of(path, columns, user)
    assert len(problems) == 1, "\n".join(map(str, problems))
    return problems[0]


def test_good_file_reads_grouped_by_symbol_in_time_order(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "good.parquet", good_columns())
    bars = read_bars(path, user_columns=("imbalance",))
    assert len(bars) == 2 * N_PER_SYMBOL
    assert bars.symbols == ["ES", "NQ"]
    slices = bars.series_slices()
    assert slices == {"ES": slice(0, N_PER_SYMBOL), "NQ": slice(N_PER_SYMBOL, 2 * N_PER_SYMBOL)}
    np.testing.assert_array_equal(bars.timestamp_ns[slices["NQ"]], T0 + np.arange(N_PER_SYMBOL) * MINUTE)
    np.testing.assert_array_equal(bars.open[slices["NQ"]], 1100.0 + np.arange(N_PER_SYMBOL))
    np.testing.assert_allclose(bars.user["imbalance"][slices["ES"]], np.linspace(-1, 1, 20)[0::2])
    assert bars.files == [str(path)]


def test_every_layout_of_the_same_bars_reads_to_the_same_columns(tmp_path: Path) -> None:
    """Symbols interleaved, grouped in sorted order (read without a copy), grouped in another order, written in
    several row groups, split over two files: the same bars, column for column; a null user value in a later
    row group is still found by its row."""
    cols = good_columns(n=50, symbols=("NQ", "ES", "CL"))
    user = ("imbalance",)
    want = read_bars(write_parquet(tmp_path / "interleaved.parquet", cols), user_columns=user)

    def rows(order: np.ndarray) -> dict[str, Any]:
        return {k: np.asarray(v)[order] for k, v in cols.items()}

    by_sorted_symbol = np.argsort(cols["symbol"].astype(str), kind="stable")
    by_file_symbol = np.concatenate([np.flatnonzero(cols["symbol"] == s) for s in ("NQ", "ES", "CL")])
    layouts = {"sorted": write_parquet(tmp_path / "sorted.parquet", rows(by_sorted_symbol)),
               "other order": write_parquet(tmp_path / "other.parquet", rows(by_file_symbol))}
    pq.write_table(pa.table(rows(by_sorted_symbol)), tmp_path / "groups.parquet", row_group_size=7)
    layouts["row groups"] = tmp_path / "groups.parquet"
    (tmp_path / "split").mkdir()
    half = cols["timestamp"] < T0 + 25 * MINUTE
    write_parquet(tmp_path / "split" / "1.parquet", rows(np.flatnonzero(half)))
    write_parquet(tmp_path / "split" / "2.parquet", rows(np.flatnonzero(~half)))
    layouts["two files"] = tmp_path / "split"
    for name, path in layouts.items():
        got = read_bars(path, user_columns=user)
        assert got.symbols == ["CL", "ES", "NQ"] and list(got.symbol) == list(want.symbol), name
        for column in ("timestamp_ns", "open", "high", "low", "close", "volume"):
            np.testing.assert_array_equal(getattr(got, column), getattr(want, column), err_msg=f"{name}: {column}")
        np.testing.assert_array_equal(got.user["imbalance"], want.user["imbalance"], err_msg=name)
    twice = read_bars(layouts["sorted"], user_columns=("imbalance", "imbalance"))  # a feature list naming it twice
    assert list(twice.user) == ["imbalance"]
    spoiled = pa.table(rows(by_sorted_symbol))
    values = spoiled.column("imbalance").to_pylist()
    values[100] = None
    spoiled = spoiled.set_column(spoiled.column_names.index("imbalance"), "imbalance", pa.array(values))
    pq.write_table(spoiled, tmp_path / "null.parquet", row_group_size=7)
    problem = only_problem(tmp_path / "null.parquet", user=user)
    assert (problem.column, problem.row) == ("imbalance", 100) and "NaN" in problem.rule


# (column to spoil, file rows, value, column named by the problem, words of the rule)
VALUE_RULES = [
    pytest.param("open", [5, 9], np.nan, "open", "NaN", id="nan-open"),
    pytest.param("close", [12], np.nan, "close", "NaN", id="nan-close"),
    pytest.param("volume", [3], np.nan, "volume", "NaN", id="nan-volume"),
    pytest.param("low", [4, 6, 8], 0.0, "low", "not positive", id="zero-price"),
    pytest.param("close", [7], -5.0, "close", "not positive", id="negative-price"),
    pytest.param("high", [11, 13], np.inf, "high", "infinite", id="inf-high"),
    pytest.param("open", [2], -np.inf, "open", "infinite", id="minus-inf-open"),
    pytest.param("volume", [15, 16], -1.0, "volume", "negative", id="negative-volume"),
    pytest.param("volume", [1], np.inf, "volume", "infinite", id="inf-volume"),
]


@pytest.mark.parametrize(("column", "rows", "value", "named", "words"), VALUE_RULES)
def test_value_rule(tmp_path: Path, column: str, rows: list[int], value: float, named: str, words: str) -> None:
    cols = good_columns()
    cols[column][rows] = value
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row, p.count) == (str(path), named, rows[0], len(rows))
    assert words in p.rule


def test_high_below_low(tmp_path: Path) -> None:
    cols = good_columns()
    cols["high"][[6, 17]] = cols["low"][[6, 17]] - 1.0  # also below open and close: reported once, as high < low
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row, p.count) == (str(path), "high", 6, 2)
    assert "high < low" in p.rule


@pytest.mark.parametrize("which", ["open", "close"])
def test_open_or_close_above_high(tmp_path: Path, which: str) -> None:
    cols = good_columns()
    cols[which][[9, 10, 14]] = cols["high"][[9, 10, 14]] + 0.5
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row, p.count) == (str(path), "high", 9, 3)
    assert "above high" in p.rule


@pytest.mark.parametrize("which", ["open", "close"])
def test_open_or_close_below_low(tmp_path: Path, which: str) -> None:
    cols = good_columns()
    cols[which][[19]] = cols["low"][[19]] - 0.25
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row, p.count) == (str(path), "low", 19, 1)
    assert "below low" in p.rule


def test_unsorted_timestamps_per_symbol(tmp_path: Path) -> None:
    cols = good_columns()
    ts = cols["timestamp"]
    ts[[6, 8]] = ts[[8, 6]]  # ES bars 3 and 4 swapped: the decrease is seen at file row 8
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row, p.count) == (str(path), "timestamp", 8, 1)
    assert "decrease" in p.rule and "ES" in p.rule


def test_duplicate_timestamp(tmp_path: Path) -> None:
    cols = good_columns()
    cols["timestamp"][[11, 13]] = cols["timestamp"][9]  # NQ bars 5 and 6 repeat NQ bar 4's time
    path = write_parquet(tmp_path / "bad.parquet", cols)
    problems = problems_of(path)
    dup = [p for p in problems if "duplicate" in p.rule]
    assert len(dup) == 1, problems
    assert (dup[0].file, dup[0].column, dup[0].row, dup[0].count) == (str(path), "timestamp", 11, 2)
    assert "NQ" in dup[0].rule
    # and going back from bar 6 to bar 7's own time is fine, but bar 6 -> 7 is an increase: no other problem
    assert len(problems) == 1, problems


def test_same_timestamp_in_different_symbols_is_fine(tmp_path: Path) -> None:
    cols = good_columns()
    assert cols["timestamp"][0] == cols["timestamp"][1]  # ES and NQ bar 0 share a time
    read_bars(write_parquet(tmp_path / "good.parquet", cols))


def test_non_numeric_user_column(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bars.parquet", good_columns())
    p = only_problem(path, user=("note",))
    assert (p.file, p.column, p.row) == (str(path), "note", -1)
    assert "not numeric" in p.rule


def test_missing_user_column(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bars.parquet", good_columns())
    p = only_problem(path, user=("spread",))
    assert (p.file, p.column, p.row) == (str(path), "spread", -1)
    assert "missing" in p.rule


def test_nan_in_user_feature_column(tmp_path: Path) -> None:
    cols = good_columns()
    cols["imbalance"][[4, 5, 18]] = np.nan
    path = write_parquet(tmp_path / "bad.parquet", cols)
    read_bars(path)  # not chosen as a feature: not checked
    p = only_problem(path, user=("imbalance",))
    assert (p.file, p.column, p.row, p.count) == (str(path), "imbalance", 4, 3)
    assert "NaN" in p.rule


def test_non_numeric_price_column(tmp_path: Path) -> None:
    cols = good_columns()
    cols["close"] = [str(x) for x in cols["close"]]
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row) == (str(path), "close", -1)
    assert "not numeric" in p.rule


def test_timestamp_of_wrong_type(tmp_path: Path) -> None:
    cols = good_columns()
    cols["timestamp"] = [str(x) for x in cols["timestamp"]]
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row) == (str(path), "timestamp", -1)
    assert "--time-col" in p.fix


def test_null_timestamp(tmp_path: Path) -> None:
    cols = good_columns()
    ts: list[int | None] = [int(x) for x in cols["timestamp"]]
    ts[7] = None
    cols["timestamp"] = pa.array(ts, pa.int64())
    path = write_parquet(tmp_path / "bad.parquet", cols)
    problems = problems_of(path)
    null = [p for p in problems if "null" in p.rule]
    assert len(null) == 1 and len(problems) == 1, problems  # not also a "decrease" at the null's row
    assert (null[0].file, null[0].column, null[0].row, null[0].count) == (str(path), "timestamp", 7, 1)


@pytest.mark.parametrize(
    ("drop", "flag"),
    [("timestamp", "--time-col"), ("open", "--open-col"), ("high", "--high-col"), ("low", "--low-col"),
     ("close", "--close-col"), ("volume", "--volume-col")],
)
def test_missing_required_column(tmp_path: Path, drop: str, flag: str) -> None:
    cols = good_columns()
    del cols[drop]
    path = write_parquet(tmp_path / "bad.parquet", cols)
    p = only_problem(path)
    assert (p.file, p.column, p.row) == (str(path), drop, -1)
    assert f"'{drop}'" in p.rule and "missing" in p.rule
    assert flag in p.fix
    assert drop in str(p) and flag in str(p)


def test_missing_mapped_column_names_the_mapped_name(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "bars.parquet", good_columns())
    p = only_problem(path, ColumnMap(timestamp="ts_event"))
    assert (p.column, p.row) == ("ts_event", -1)
    assert "ts_event" in p.rule and "--time-col" in p.fix


def test_every_problem_of_a_file_is_reported(tmp_path: Path) -> None:
    cols = good_columns()
    cols["open"][3] = np.nan
    cols["volume"][5] = -2.0
    cols["timestamp"][[10, 12]] = cols["timestamp"][[12, 10]]
    path = write_parquet(tmp_path / "bad.parquet", cols)
    got = {(p.column, p.row) for p in problems_of(path)}
    assert got == {("open", 3), ("volume", 5), ("timestamp", 12)}


@pytest.mark.parametrize(("user", "role"), [("timestamp", "timestamp (--time-col)"), ("sym", "symbol (--symbol-col)")])
def test_a_user_feature_that_is_the_time_or_symbol_column_is_refused(tmp_path: Path, user: str, role: str) -> None:
    path = write_parquet(tmp_path / "x.parquet", {**series_columns(0, 5), "sym": ["ES"] * 5})
    p = only_problem(path, ColumnMap(symbol="sym"), (user,))
    assert p.rule == f"user feature {user!r} is the bars' {role} column" and "leave it out of --features" in p.fix


def test_a_column_missing_from_every_file_of_a_directory_is_one_line(tmp_path: Path) -> None:
    for day in range(3):  # daily files, each without the symbol column named
        write_parquet(tmp_path / "d" / f"day-{day}.parquet", series_columns(day * 5, day * 5 + 5, "ES"))
    with pytest.raises(BarDataError) as info:
        read_bars(tmp_path / "d", ColumnMap(symbol="raw_symbol"))
    assert len(info.value.problems) == 3  # each file's, for a program to read
    [line] = info.value.lines()
    assert line.startswith(f"{tmp_path / 'd' / 'day-0.parquet'}: column 'raw_symbol'")
    assert line.endswith("(the same in 2 more files)")


def test_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.parquet"
    good = write_parquet(tmp_path / "good.parquet", good_columns()).read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated: no footer
    p = only_problem(path)
    assert (p.file, p.column, p.row) == (str(path), "-", -1)
    assert "cannot be read as parquet" in p.rule
    assert str(p).startswith(f"{path}: cannot be read as parquet (")  # the file is the problem: no column, no row


def test_corrupt_file_in_directory_is_named(tmp_path: Path) -> None:
    write_parquet(tmp_path / "data" / "a.parquet", good_columns())
    bad = tmp_path / "data" / "b.parquet"
    bad.write_bytes(b"this is not parquet")
    p = only_problem(tmp_path / "data")
    assert (p.file, p.row) == (str(bad), -1)
    assert "cannot be read as parquet" in p.rule


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.parquet"
    p = only_problem(path)
    assert (p.file, p.row) == (str(path), -1)
    assert "no such file" in p.rule


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not bars")
    p = only_problem(tmp_path / "empty")
    assert (p.file, p.row) == (str(tmp_path / "empty"), -1)
    assert "no .parquet, .parq, .pq, .dbn or .dbn.zst files" in p.rule


# ---- directories and hive partitions ----------------------------------------------------


def series_columns(bar_from: int, bar_to: int, with_symbol: str | None = None) -> dict[str, Any]:
    bar = np.arange(bar_from, bar_to)
    open_ = 100.0 + bar
    cols: dict[str, Any] = {
        "timestamp": T0 + bar * MINUTE,
        "open": open_, "high": open_ + 1, "low": open_ - 1, "close": open_.copy(), "volume": np.ones(bar.size),
    }
    if with_symbol is not None:
        cols["symbol"] = [with_symbol] * bar.size
    return cols


def test_prices_in_another_unit_in_one_file_are_refused_naming_both_files(tmp_path: Path) -> None:
    """A vendor's 1e-9 fixed-point integers in most files and dollars in one: each file is consistent, but the
    log returns at the seams are off by a factor of 1e9 and training would learn from them unwarned."""
    def part(bar_from: int, bar_to: int, scale: float) -> dict[str, Any]:
        cols = series_columns(bar_from, bar_to, "ES")
        for name in ("open", "high", "low", "close"):
            cols[name] = cols[name] * scale
        return cols

    write_parquet(tmp_path / "d" / "part-1.parquet", part(0, 5, 1e9))
    write_parquet(tmp_path / "d" / "part-2.parquet", part(5, 10, 1.0))  # dollars
    write_parquet(tmp_path / "d" / "part-3.parquet", part(10, 15, 1e9))
    p = only_problem(tmp_path / "d")
    assert (p.file, p.column, p.row, p.count) == (str(tmp_path / "d" / "part-2.parquet"), "close", 0, 2)
    assert p.rule.startswith("close 105 is 1.01e-09 times the previous bar's close of ES, 1.04e+11 (that bar is in "
                             f"{tmp_path / 'd' / 'part-1.parquet'}): a change of price units, not a market move")
    assert "give every file's prices in one unit" in p.fix
    cols = series_columns(0, 10, "ES")  # a fiftyfold move is a market's (however rare), and within one file
    cols["close"][5:] *= 50
    cols["open"][5:] *= 50
    cols["high"][5:] *= 50
    cols["low"][5:] *= 50
    assert len(read_bars(write_parquet(tmp_path / "moves.parquet", cols))) == 10
    cols["close"][7] *= 200  # a close two hundredfold the one before (its high too, to keep the bar consistent)
    cols["high"][7] *= 200
    p = only_problem(write_parquet(tmp_path / "jump.parquet", cols))
    assert (p.row, p.count, p.rule_id) == (7, 1, "bad_print")  # up at row 7, down again at row 8: row 7 is bad
    assert p.rule.startswith("close 1070000 is 204 times the median close of the ES bars around it: a bad print")
    # two symbols read as one series (no symbol column): the jump may be that, and the fix says so too
    one = series_columns(0, 6)
    for name in ("open", "high", "low", "close"):
        one[name][1::2] *= 300
    p = next(q for q in problems_of(write_parquet(tmp_path / "one.parquet", one)) if q.column == "close")
    assert "map their column with --symbol-col NAME" in p.fix and p.count == 4  # rows 0, 1, 3, 5 stand out


def test_an_output_over_the_bars_by_any_path_is_named(tmp_path: Path) -> None:
    from features.bars import clash_with_bars

    store = write_parquet(tmp_path / "store" / "a.parquet", series_columns(0, 5, "ES"))
    (tmp_path / "bars").mkdir()
    (tmp_path / "bars" / "a.parquet").symlink_to(store)  # a directory of links to the files
    assert "is inside the bars directory" in str(clash_with_bars(tmp_path / "bars" / "a.parquet", tmp_path / "bars"))
    assert "is one of the bars files in" in str(clash_with_bars(store, tmp_path / "bars"))
    assert clash_with_bars(tmp_path / "store" / "b.parquet", tmp_path / "bars") is None
    (tmp_path / "link.parquet").symlink_to(store)  # the bars through a link, and the link itself
    assert "is the bars file" in str(clash_with_bars(store, tmp_path / "link.parquet"))
    assert "is the bars file" in str(clash_with_bars(tmp_path / "link.parquet", store))
    (tmp_path / "loop.parquet").symlink_to(tmp_path / "loop.parquet")
    assert "cannot be resolved" in str(clash_with_bars(tmp_path / "loop.parquet", store))


def test_hive_partitioned_directory(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "symbol=ES" / "2024-01.parquet", series_columns(0, 5))
    write_parquet(root / "symbol=ES" / "2024-02.parquet", series_columns(5, 12))
    write_parquet(root / "symbol=NQ" / "2024-01.parquet", series_columns(0, 7))
    (root / "_SUCCESS").write_text("")  # markers, hidden files and other files are ignored
    (root / "README.txt").write_text("bars by symbol")
    write_parquet(root / "symbol=ES" / ".2024-03.parquet.tmp.parquet", series_columns(0, 1))
    bars = read_bars(root)
    assert bars.symbols == ["ES", "NQ"]
    assert len(bars) == 19
    sl = bars.series_slices()
    np.testing.assert_array_equal(bars.timestamp_ns[sl["ES"]], T0 + np.arange(12) * MINUTE)
    np.testing.assert_array_equal(bars.timestamp_ns[sl["NQ"]], T0 + np.arange(7) * MINUTE)
    assert len(bars.files) == 3


def test_order_is_checked_across_files(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "symbol=ES" / "2024-01.parquet", series_columns(0, 5))
    second = write_parquet(root / "symbol=ES" / "2024-02.parquet", series_columns(3, 9))  # starts 2 bars back
    write_parquet(root / "symbol=NQ" / "2024-01.parquet", series_columns(0, 5))
    problems = problems_of(root)
    assert len(problems) == 1, problems
    p = problems[0]
    assert (p.file, p.column, p.row, p.count) == (str(second), "timestamp", 0, 2)  # bars 3 and 4 in both files
    # each file is in order: the files overlap, which the message says, naming the other file
    assert f"symbol ES's bars here start at or before its last bar in {root / 'symbol=ES' / '2024-01.parquet'}" \
        in p.rule and "path order is time order" in p.fix


def test_numbered_files_are_read_in_number_order(tmp_path: Path) -> None:
    """part-2 before part-10 (as people number files), not after it as plain text order puts it."""
    root = tmp_path / "bars"
    for k in (1, 2, 10):
        write_parquet(root / f"part-{k}.parquet", series_columns(10 * k, 10 * k + 5, "ES"))
    bars = read_bars(root)
    assert bars.files == [str(root / f"part-{k}.parquet") for k in (1, 2, 10)]
    assert (np.diff(bars.timestamp_ns) > 0).all()


def test_duplicate_across_files(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "a.parquet", series_columns(0, 5, "ES"))
    second = write_parquet(root / "b.parquet", series_columns(4, 9, "ES"))  # repeats bar 4
    p = only_problem(root)
    assert (p.file, p.column, p.row, p.count) == (str(second), "timestamp", 0, 1)
    assert f"at or before its last bar in {root / 'a.parquet'}" in p.rule and "drop the bars the files share" in p.fix


def test_files_out_of_time_order_that_share_no_bar_are_named_so(tmp_path: Path) -> None:
    """pyarrow's write_to_dataset names its files by uuid: in path order the later bars may come first. Nothing
    is shared to drop; the fix is the names."""
    root = tmp_path / "bars"
    write_parquet(root / "0a1f.parquet", series_columns(5, 9, "ES"))
    second = write_parquet(root / "9c2e.parquet", series_columns(0, 5, "ES"))
    p = only_problem(root)
    assert (p.file, p.row, p.count) == (str(second), 0, 5)
    assert p.rule.startswith(f"symbol ES's bars here all come before its bars in {root / '0a1f.parquet'}"), p.rule
    assert p.fix.startswith("name the files so that path order is time order") and "uuid" in p.fix, p.fix
    assert "drop the bars" not in p.fix


def test_a_value_problem_in_a_file_of_several_symbols_names_whose_rows(tmp_path: Path) -> None:
    """A futures download holds calendar spreads beside the outrights, and a spread's price may be negative: the
    problem says whose rows it found, as its row number alone would not."""
    es, spread = series_columns(0, 6, "ESH4"), series_columns(0, 6, "ESH4-ESM4")
    spread["open"] = spread["open"] - 200.0  # a spread trades around zero
    both = {k: np.concatenate([np.asarray(es[k]), np.asarray(spread[k])]) for k in es}
    problems = problems_of(write_parquet(tmp_path / "fut.parquet", both))
    assert problems and all(p.rule.endswith("; symbol ESH4-ESM4") for p in problems), problems
    assert "; symbol" not in only_problem(write_parquet(tmp_path / "one.parquet", spread)).rule  # one market alone


def test_duplicates_of_several_symbols_say_so(tmp_path: Path) -> None:
    es, nq = series_columns(0, 6, "ES"), series_columns(0, 6, "NQ")
    for cols in (es, nq):
        cols["timestamp"][3] = cols["timestamp"][2]
    both = {k: np.concatenate([np.asarray(es[k]), np.asarray(nq[k])]) for k in es}
    p = only_problem(write_parquet(tmp_path / "dup.parquet", both))
    assert p.rule.endswith("; symbol ES (and 1 other symbol)") and p.count == 2, p


def test_row_numbers_are_within_each_file(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "a.parquet", series_columns(0, 8, "ES"))
    cols = series_columns(8, 16, "ES")
    cols["close"][3] = np.nan
    second = write_parquet(root / "b.parquet", cols)
    p = only_problem(root)
    assert (p.file, p.column, p.row) == (str(second), "close", 3)


def test_file_missing_a_column_in_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "a.parquet", series_columns(0, 4, "ES"))
    cols = series_columns(4, 8, "ES")
    del cols["volume"]
    second = write_parquet(root / "b.parquet", cols)
    p = only_problem(root)
    assert (p.file, p.column, p.row) == (str(second), "volume", -1)
    assert "missing" in p.rule


# ---- column mapping and timestamp types ---------------------------------------------------


def test_column_mapping_without_symbol_column(tmp_path: Path) -> None:
    cols = series_columns(0, 6)
    renamed = {"ts_event": cols["timestamp"], "o": cols["open"], "h": cols["high"], "l": cols["low"],
               "c": cols["close"], "size": cols["volume"]}
    path = write_parquet(tmp_path / "dbn.parquet", renamed)
    problems = problems_of(path)  # the default names are not there
    assert {p.column for p in problems} == {"timestamp", "open", "high", "low", "close", "volume"}
    cmap = ColumnMap(timestamp="ts_event", open="o", high="h", low="l", close="c", volume="size",
                     default_symbol="CLF4")
    bars = read_bars(path, cmap)
    assert bars.symbols == ["CLF4"]
    assert bars.series_slices() == {"CLF4": slice(0, 6)}
    np.testing.assert_array_equal(bars.timestamp_ns, cols["timestamp"])
    np.testing.assert_array_equal(bars.high, cols["high"])


def test_a_symbol_column_named_but_absent_is_refused_and_one_missed_is_hinted(tmp_path: Path) -> None:
    cols = good_columns()
    cols["raw_symbol"] = cols.pop("symbol")  # Databento's name: not the default, and not mapped
    path = write_parquet(tmp_path / "dbn.parquet", cols)
    p = only_problem(path, ColumnMap(symbol="instrument"))  # a name given that the file does not have
    assert p.column == "instrument" and "symbol column 'instrument' is missing" in p.rule and "raw_symbol" in p.rule
    assert "--symbol-col NAME" in p.fix
    # not mapped: the file is read as one series, whose interleaved ES/NQ bars repeat each timestamp
    p = only_problem(path)
    assert p.rule.startswith("duplicate timestamp") and "symbol SERIES" in p.rule
    assert "has no 'symbol' column, so all its rows were read as one series, SERIES" in p.fix
    assert "--symbol-col NAME" in p.fix
    assert len(read_bars(path, ColumnMap(symbol="raw_symbol")).symbols) == 2
    # a symbol column that is there and out of order: no such hint
    cols["symbol"] = cols.pop("raw_symbol")
    cols["timestamp"] = cols["timestamp"][::-1].copy()
    p = problems_of(write_parquet(tmp_path / "sorted_wrong.parquet", cols))[0]
    assert "timestamps decrease" in p.rule and "--symbol-col" not in p.fix


def test_a_column_the_file_holds_twice_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    """Parquet allows two columns of one name (a careless join or export); which one to read is the user's
    call. A column the bars do not use may be doubled freely."""
    cols = series_columns(0, 6)
    names = [*cols, "close", "note", "note"]
    arrays = [pa.array(v) for v in cols.values()] + [pa.array(np.asarray(cols["close"]) * 2)] + \
        [pa.array(["x"] * 6)] * 2
    pq.write_table(pa.Table.from_arrays(arrays, names=names), tmp_path / "twice.parquet")
    p = only_problem(tmp_path / "twice.parquet")
    assert p.column == "close" and "column 'close' appears 2 times in the file" in p.rule and "keep one" in p.fix
    pq.write_table(pa.Table.from_arrays([pa.array(v) for v in cols.values()] + [pa.array(cols["timestamp"])],
                                        names=[*cols, "timestamp"]), tmp_path / "twice_ts.parquet")
    assert "column 'timestamp' appears 2 times" in only_problem(tmp_path / "twice_ts.parquet").rule
    pq.write_table(pa.Table.from_arrays([pa.array(v) for v in cols.values()] + [pa.array(["x"] * 6)] * 2,
                                        names=[*cols, "note", "note"]), tmp_path / "notes.parquet")
    assert len(read_bars(tmp_path / "notes.parquet")) == 6


def test_mapped_column_problem_names_the_source_column(tmp_path: Path) -> None:
    cols = series_columns(0, 6)
    cols["px_close"] = cols.pop("close")
    cols["px_close"][2] = -1.0
    path = write_parquet(tmp_path / "bars.parquet", cols)
    p = only_problem(path, ColumnMap(close="px_close"))
    assert (p.column, p.row) == ("px_close", 2)


def test_column_map_flags_round_trip() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ColumnMap.add_arguments(parser)
    cmap = ColumnMap.from_args(parser.parse_args(["--time-col", "ts_event", "--volume-col", "size", "--time-unit",
                                                  "ms"]))
    assert cmap == ColumnMap(timestamp="ts_event", volume="size", time_unit="ms")
    assert ColumnMap.from_dict(cmap.to_dict()) == cmap
    # over a training run's stored names (a resume, an export's --bars): what is given wins, even the default
    stored = ColumnMap(timestamp="ts_event", close="px_close").to_dict()
    assert ColumnMap.from_args(parser.parse_args(["--close-col", "close"]), stored) == ColumnMap(timestamp="ts_event")
    assert ColumnMap.from_args(parser.parse_args([]), stored) == ColumnMap.from_dict(stored)


@pytest.mark.parametrize(
    "arrow_type",
    [pa.int64(), pa.timestamp("ns"), pa.timestamp("us", tz="UTC"), pa.timestamp("ms", tz="UTC"),
     pa.timestamp("ms", tz="America/Chicago"), pa.timestamp("s", tz="UTC")],
    ids=str,
)
def test_timestamp_types_read_to_the_same_ns(tmp_path: Path, arrow_type: pa.DataType) -> None:
    cols = series_columns(0, 5)
    ns = cols["timestamp"]
    if pa.types.is_timestamp(arrow_type):
        per_unit = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}[arrow_type.unit]
        cols["timestamp"] = pa.array(ns // per_unit, pa.int64()).cast(arrow_type)
    else:
        cols["timestamp"] = pa.array(ns, arrow_type)
    bars = read_bars(write_parquet(tmp_path / "bars.parquet", cols))
    assert bars.timestamp_ns.dtype == np.int64
    np.testing.assert_array_equal(bars.timestamp_ns, ns)
    # a timestamp without a zone is read as UTC, and said so: exchange local times stored so would shift
    naive = pa.types.is_timestamp(arrow_type) and arrow_type.tz is None
    assert [n.split(":")[0] for n in bars.notes] == (["timestamp column 'timestamp' has no time zone (" +
                                                       str(tmp_path / "bars.parquet") + ")"] if naive else [])


# ---- the command line -----------------------------------------------------------------------


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return run_main(["-m", "features.check", *args])


def test_check_counts_session_breaks_among_the_gaps_over_the_interval(tmp_path: Path) -> None:
    from features.check import format_duration, summarize

    cols = series_columns(0, 6, "ES")
    cols["timestamp"] = T0 + np.array([0, 1, 2, 5, 6, 7]) * 86_400 * 10**9  # daily bars, a weekend gap
    text = summarize(read_bars(write_parquet(tmp_path / "daily.parquet", cols)))
    assert "bar interval (most common spacing): 1d" in text
    assert "1 gaps over the bar interval, 1 of them over an hour: session breaks (largest 3d)" in text
    cols["timestamp"] = T0 + np.arange(6) * 60 * 10**9  # six bars a minute apart: nothing to call a break
    text = summarize(read_bars(write_parquet(tmp_path / "minutes.parquet", cols)))
    assert "  ES: 6 rows, 2024-01-01 14:30:00 UTC .. 2024-01-01 14:35:00 UTC, no gaps over the bar interval" in text
    assert "session breaks" not in text
    text = summarize(read_bars(write_parquet(tmp_path / "one.parquet", series_columns(0, 1, "ES"))))
    assert "  ES: 1 rows, 2024-01-01 14:30:00 UTC .. 2024-01-01 14:30:00 UTC, no bar interval to measure gaps " \
        "against" in text
    assert [format_duration(s * 10**9) for s in (30, 60, 3599, 3600, 63_000, 86_400, 235_800)] == [
        "30s", "1min", "59min59s", "1h", "17h30min", "1d", "2d18h"]


def test_bars_stamped_a_little_off_their_grid_have_the_grids_interval(tmp_path: Path) -> None:
    """An aggregator's, a receive or a first trade's time puts each bar a little off its minute: their spacings
    are nearly all distinct, and the smallest of them (59.997 s) is not the bar interval that a model's future
    bar times step by, nor is every bar a gap over it."""
    from features.check import summarize

    rng = np.random.default_rng(3)
    minute = 60 * 10**9
    on_grid = np.concatenate([np.arange(390), 1440 + np.arange(390)]) * minute  # two sessions
    for jitter in (5 * 10**6, 20 * 10**9):  # within 5 ms; a first trade within 20 s of the bar's start
        cols = {"timestamp": np.concatenate([T0 + on_grid + rng.integers(0, jitter, on_grid.size)] * 2),
                "symbol": ["ES"] * on_grid.size + ["NQ"] * on_grid.size}
        cols |= {k: np.tile(v, 2) for k, v in series_columns(0, on_grid.size).items() if k != "timestamp"}
        text = summarize(read_bars(write_parquet(tmp_path / "jitter.parquet", cols)))
        assert "bar interval (most common spacing): 1min" in text, text
        assert "1 gaps over the bar interval, 1 of them over an hour" in text and "note:" not in text, text
    thin = np.cumsum(rng.choice([1, 1, 2, 3, 5], 500)) * minute  # a thin market's bars skip intervals
    for ts, interval in ((thin, minute), (thin + rng.integers(0, 3 * 10**9, thin.size), minute),
                         (np.arange(50) * 61 * 10**9, 61 * 10**9),  # on a grid: the spacing as it is
                         (np.arange(200) * 2 * 10**8 + rng.integers(0, 10**6, 200), 2 * 10**8),  # 200 ms bars
                         (np.arange(100) * 90 * 10**9 + rng.integers(0, 10**8, 100), 90 * 10**9)):
        assert infer_bar_interval_ns(ts, np.array([[0, ts.size]])) == interval
    # a thin contract on a grid: 12 bars a day at whole minutes of a session. Its nights (17-18 h, all distinct
    # minutes) are many, and would chain into one long run of spacings: a grid keeps its most common spacing
    days = [np.sort(rng.choice(np.arange(870, 1260), 12, replace=False)) + 1440 * d for d in range(250)]
    ts = np.concatenate(days) * minute
    gaps, counts = np.unique(np.diff(ts), return_counts=True)
    assert infer_bar_interval_ns(ts, np.array([[0, ts.size]])) == gaps[np.argmax(counts)] < 3600 * 10**9
    # first-trade stamps up to 20 s late, few bars or many; arrival stamps in whole milliseconds, whose spacings
    # recur by chance (60.002 s a few times is no grid): the bar size in (nearly) every draw
    for n, size, late, least in ((100, minute, 20 * 10**9, 95), (780, minute, 20 * 10**9, 100),
                                 (1000, minute, 31 * 10**6, 100), (1000, 10**9, 31 * 10**6, 100)):
        found = [infer_bar_interval_ns(ts, np.array([[0, n]])) for seed in range(100)
                 for ts in [np.arange(n) * size + np.random.default_rng(seed).integers(0, late // 10**6, n) * 10**6]]
        assert found.count(size) >= least, (n, size, late, found.count(size))


def test_check_cli_on_good_file(sample_bars: Path) -> None:
    res = run_check(str(sample_bars))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "symbols: 2" in out
    assert f"rows: {2 * SAMPLE_BARS}" in out
    assert "bar interval (most common spacing): 1min" in out
    # 3000 bars = 7 full sessions of 390 and 270 bars of an eighth (2024-01-02 .. 2024-01-11, no weekend)
    for sym in ("ES", "NQ"):
        assert (f"  {sym}: {SAMPLE_BARS} rows, 2024-01-02 14:30:00 UTC .. 2024-01-11 18:59:00 UTC, "
                "7 gaps over the bar interval, 7 of them over an hour: session breaks (largest 2d18h)") in out, out
    assert "no problems found" in out
    assert "Traceback" not in res.stderr
    # a reader that goes away (`| head`): no traceback, the status a shell gives a process ended by SIGPIPE
    with subprocess.Popen([sys.executable, "-m", "features.check", str(sample_bars)],
                          cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as piped:
        assert piped.stdout is not None and piped.stderr is not None
        piped.stdout.close()
        err = piped.stderr.read()
    assert piped.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_check_names_unchecked_feature_columns_and_symbols_of_another_bar_size(tmp_path: Path) -> None:
    """What the trainer would refuse or warn about later: a numeric column `--features` would name (checked only
    when named), and a symbol whose bars are of another size than the file's."""
    path = write_parquet(tmp_path / "bars.parquet", good_columns())
    res = run_check(str(path))
    assert res.returncode == 0 and ("note: columns not checked as features: imbalance; the trainer checks the ones its "
                                    "--features names") in res.stdout, res.stdout
    assert "add --features imbalance to check them here" in res.stdout
    assert "not checked" not in run_check(str(path), "--features", "imbalance").stdout
    es, nq, cl = series_columns(0, 60, "ES"), series_columns(0, 20, "NQ"), series_columns(0, 20, "CL")
    nq["timestamp"] = T0 + np.arange(20) * 5 * MINUTE
    cl["timestamp"] = T0 + np.arange(20) * MINUTE // 3
    res = run_check(str(write_parquet(tmp_path / "mixed.parquet", {k: np.concatenate([es[k], nq[k], cl[k]])
                                                                    for k in es})))
    assert res.returncode == 0, res.stderr
    assert ("note: NQ's bars are mostly 5min apart, the file's most common spacing is 1min: a model trained on all of "
            "them takes 1min bars; if they are bars of another size, train them separately") in res.stdout, res.stdout
    assert "note: CL's bars are mostly 20s apart" in res.stdout and "(the server would refuse these finer ones)" \
        in res.stdout


def test_check_cli_on_bad_file(tmp_path: Path) -> None:
    cols = good_columns()
    cols["open"][3] = np.nan
    cols["low"][[6, 7]] = 0.0
    cols["volume"][9] = -3.0
    path = write_parquet(tmp_path / "bad.parquet", cols)
    res = run_check(str(path))
    assert res.returncode == 2
    assert res.stdout == ""
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[0] == f"{path}: 3 problem(s) found"
    assert len(lines) == 4, res.stderr
    for col, row in (("'open'", "row 3:"), ("'low'", "row 6:"), ("'volume'", "row 9:")):
        matching = [line for line in lines[1:] if col in line]
        assert len(matching) == 1, res.stderr
        assert str(path) in matching[0] and row in matching[0] and "Fix:" in matching[0], matching[0]
    assert "(2 rows affected)" in next(line for line in lines if "'low'" in line)
    empty = write_parquet(tmp_path / "empty.parquet", {k: v[:0] for k, v in good_columns().items()})
    res = run_check(str(empty))
    assert res.returncode == 2 and "rows: 0" in res.stdout and "no bars (the files hold no rows)" in res.stderr


def test_check_cli_on_missing_path_and_mapping(tmp_path: Path) -> None:
    res = run_check(str(tmp_path / "nope.parquet"))
    assert res.returncode == 2 and "no such file" in res.stderr and "Traceback" not in res.stderr
    cols = series_columns(0, 4)
    cols["ts_event"] = cols.pop("timestamp")
    path = write_parquet(tmp_path / "dbn.parquet", cols)
    res = run_check(str(path))
    assert res.returncode == 2 and "--time-col" in res.stderr and "Traceback" not in res.stderr
    res = run_check(str(path), "--time-col", "ts_event", "--default-symbol", "ESH4")
    assert res.returncode == 0, res.stderr
    assert "ESH4: 4 rows" in res.stdout
    cols["ts_event"] = pa.array(np.asarray(cols["ts_event"]) // 10**6, pa.int64())  # milliseconds, as many vendors
    path = write_parquet(tmp_path / "ms.parquet", cols)
    res = run_check(str(path), "--time-col", "ts_event")
    assert res.returncode == 2 and "give --time-unit ms" in res.stderr, res.stderr
    res = run_check(str(path), "--time-col", "ts_event", "--time-unit", "ms")
    assert res.returncode == 0, res.stderr
    assert "note:" not in res.stdout  # integers are UTC by the contract
    cols["ts_event"] = cols["ts_event"].cast(pa.timestamp("ms"))  # an arrow timestamp without a zone
    res = run_check(str(write_parquet(tmp_path / "naive.parquet", cols)), "--time-col", "ts_event")
    assert res.returncode == 0 and "note: timestamp column 'ts_event' has no time zone" in res.stdout, res.stdout
    assert "read as UTC" in res.stdout and "--calendar-tz" in res.stdout


def test_order_rule_holds_at_extreme_timestamps(tmp_path: Path) -> None:
    """A decrease whose difference overflows int64 is still a decrease."""
    big = 2**62 + 5  # big - (-big) and -big - big overflow int64
    path = write_parquet(tmp_path / "x.parquet", {
        "timestamp": pa.array([big, -big, -big + 1], type=pa.int64()), "symbol": ["ES"] * 3,
        "open": [1.0] * 3, "high": [1.0] * 3, "low": [1.0] * 3, "close": [1.0] * 3, "volume": [1.0] * 3})
    with pytest.raises(BarDataError) as info:
        read_bars(path)
    assert any("decrease" in p.rule and p.row == 1 for p in info.value.problems)


@pytest.mark.parametrize(("per_unit", "unit"), [(10**9, "seconds"), (10**6, "milliseconds"), (10**3, "microseconds")])
def test_integer_timestamps_in_another_unit_are_refused_by_name(tmp_path: Path, per_unit: int, unit: str) -> None:
    """int64 timestamps are nanoseconds; epoch seconds, milliseconds or microseconds would put the bars in
    1970 and every calendar feature and bar interval off by that factor: refused, with the factor."""
    cols = series_columns(0, 5, "ES")
    in_unit = np.asarray(cols["timestamp"]) // per_unit
    cols["timestamp"] = pa.array(in_unit, pa.int64())
    with pytest.raises(BarDataError) as info:
        read_bars(write_parquet(tmp_path / "x.parquet", cols))
    [problem] = info.value.problems
    assert problem.column == "timestamp" and f"look like {unit} since the Unix epoch" in problem.rule
    flag = {10**9: "s", 10**6: "ms", 10**3: "us"}[per_unit]
    assert f"give --time-unit {flag}," in problem.fix and f"{unit} x {per_unit:,}" in problem.fix
    # with its unit said, by --time-unit or by the column's arrow type: read as such
    bars = read_bars(tmp_path / "x.parquet", ColumnMap(time_unit=flag))
    np.testing.assert_array_equal(bars.timestamp_ns, in_unit * per_unit)
    assert bars.timestamp_ns[0] == T0
    cols["timestamp"] = pa.array(in_unit, pa.int64()).cast(pa.timestamp(flag))
    assert read_bars(write_parquet(tmp_path / "y.parquet", cols)).timestamp_ns[0] == T0
    assert read_bars(tmp_path / "y.parquet", ColumnMap(time_unit=flag)).timestamp_ns[0] == T0  # arrow's unit wins
    if flag != "us":  # a unit too small for the values: 1970 again, refused with the unit they look like
        smaller = {"s": "ms", "ms": "us"}[flag]
        p = only_problem(tmp_path / "x.parquet", ColumnMap(time_unit=smaller))
        assert f"read as {({'ms': 'milliseconds', 'us': 'microseconds'})[smaller]} all fall before 1973" in p.rule
        assert f"give --time-unit {flag}," in p.fix
    if flag != "s":  # a unit too large for the values: past 2262 for every row, refused with the unit they look like
        larger = {"ms": "s", "us": "ms"}[flag]
        p = only_problem(tmp_path / "x.parquet", ColumnMap(time_unit=larger))
        assert "outside what int64 nanoseconds hold" in p.rule and p.count == 5
        assert p.fix == f"give --time-unit {flag} (read as {({'s': 'seconds', 'ms': 'milliseconds'})[larger]}, every " \
            "time is past 2262)"


def test_a_time_unit_whose_values_overflow_nanoseconds_is_a_problem_by_row(tmp_path: Path) -> None:
    cols = series_columns(0, 5, "ES")
    ms = np.asarray(cols["timestamp"]) // 10**6
    ms[3] = 2**62  # fine as an integer; past int64 once in nanoseconds
    cols["timestamp"] = pa.array(ms, pa.int64())
    p = only_problem(write_parquet(tmp_path / "x.parquet", cols), ColumnMap(time_unit="ms"))
    assert p.row == 3 and p.column == "timestamp" and "placeholder" in p.fix  # one row: not the unit
    # nanoseconds read as seconds (a --time-unit s, or a model trained on seconds): every row, so the unit
    cols = series_columns(0, 5, "ES")
    p = only_problem(write_parquet(tmp_path / "ns.parquet", cols), ColumnMap(time_unit="s"))
    assert "outside what int64 nanoseconds hold" in p.rule and p.count == 5
    assert p.fix.startswith("give --time-unit ns (read as seconds")
    with pytest.raises(ValueError, match="time unit 'minutes': expected one of s, ms, us, ns"):
        ColumnMap(time_unit="minutes")


def test_a_null_symbol_is_refused_with_its_row(tmp_path: Path) -> None:
    cols = series_columns(0, 6, "ES")
    cols["symbol"][2] = None
    cols["symbol"][4] = None
    with pytest.raises(BarDataError) as info:
        read_bars(write_parquet(tmp_path / "x.parquet", cols))
    [problem] = info.value.problems
    assert (problem.column, problem.row, problem.rule, problem.count) == ("symbol", 2, "symbol is null", 2)


def test_an_empty_symbol_is_refused_with_its_row_and_so_is_an_empty_default_symbol(tmp_path: Path) -> None:
    """A model's symbols are the names a request sends: a series named '' would train and export, then never
    serve. Empty names in the column, and an empty --default-symbol for a file without one, are refused."""
    cols = series_columns(0, 8, "ES")
    cols["symbol"][3] = ""
    cols["symbol"][5] = None
    cols["symbol"][6] = ""
    with pytest.raises(BarDataError) as info:
        read_bars(write_parquet(tmp_path / "x.parquet", cols))
    assert [(p.row, p.rule, p.count) for p in info.value.problems] == [
        (5, "symbol is null", 1), (3, "symbol is empty", 2)], info.value.problems
    one = {k: v for k, v in series_columns(0, 6).items() if k != "symbol"}
    p = only_problem(write_parquet(tmp_path / "one.parquet", one), ColumnMap(default_symbol=""))
    assert (p.column, p.row) == ("symbol", -1) and "--default-symbol" in p.rule and "--default-symbol" in p.fix
    assert read_bars(tmp_path / "one.parquet", ColumnMap(default_symbol="ES")).symbols == ["ES"]


def test_integers_too_large_for_float64_are_refused_by_row_not_crashed_on(tmp_path: Path) -> None:
    """A feed's INT64_MAX placeholder for a missing price (fixed-point prices, as Databento's UNDEF_PRICE), or
    any integer float64 cannot hold exactly, is a problem with its row, in prices, volume and user columns."""
    cols = good_columns()
    scaled = (cols["close"] * 10**9).astype(np.int64)  # fixed-point prices in 1e-9 units read fine ...
    scaled[3] = 2**63 - 1  # ... except the placeholder
    cols["close"] = scaled
    cols["imbalance"] = pa.array(np.arange(2 * N_PER_SYMBOL) + 2**60, pa.uint64())
    problems = problems_of(write_parquet(tmp_path / "big.parquet", cols), user=("imbalance",))
    by_column = {p.column: p for p in problems}
    assert set(by_column) == {"close", "imbalance"}, problems
    assert (by_column["close"].row, by_column["close"].count) == (3, 1)
    assert "9223372036854775807 is beyond the integers a float64 holds exactly" in by_column["close"].rule
    assert "INT64_MAX" in by_column["close"].rule and "set missing values to null" in by_column["close"].fix
    assert (by_column["imbalance"].row, by_column["imbalance"].count) == (0, 2 * N_PER_SYMBOL)
    volume = pa.array([10] * (2 * N_PER_SYMBOL - 1) + [2**64 - 1], pa.uint64())  # beyond int64 too
    p = only_problem(write_parquet(tmp_path / "u64.parquet", good_columns() | {"volume": volume}))
    assert (p.column, p.row) == ("volume", 2 * N_PER_SYMBOL - 1) and "UINT64_MAX" in p.rule


def test_a_placeholder_that_went_through_a_float_is_refused_once_by_row(tmp_path: Path) -> None:
    """INT64_MAX read into a float column (9.2e18) is a placeholder too, in prices and volume alike: one problem
    per column at its row, not also a range breach or a change of price units."""
    cols = good_columns()
    close = np.asarray(cols["close"], dtype=np.float64).copy()
    close[3] = float(2**63 - 1)
    volume = np.asarray(cols["volume"], dtype=np.float64).copy()
    volume[5] = float(2**64 - 1)
    problems = problems_of(write_parquet(tmp_path / "f.parquet", cols | {"close": close, "volume": volume}))
    assert [(p.column, p.row, p.count) for p in problems] == [("close", 3, 1), ("volume", 5, 1)], problems
    assert all("beyond 2^53" in p.rule and "placeholder" in p.rule for p in problems)
    scaled = {name: np.asarray(cols[name], dtype=np.float64) * 1e9 for name in ("open", "high", "low", "close")}
    assert len(read_bars(write_parquet(tmp_path / "fp.parquet", cols | scaled))) == len(close)  # 1e-9 units read


def test_reading_some_symbols_checks_only_theirs_and_names_file_rows(tmp_path: Path) -> None:
    """A client forecasting ES is not stopped by a bad NQ bar; an ES problem still names its row in the file
    (interleaved here: file row 2*i is ES bar i), for value, order and placeholder rules alike."""
    cols = good_columns()
    cols["close"] = cols["close"].copy()
    cols["close"][7] = np.nan  # NQ bar 3
    path = write_parquet(tmp_path / "mixed.parquet", cols)
    bars = read_bars(path, symbols=["ES"], user_columns=("imbalance",))
    assert bars.symbols == ["ES"] and len(bars) == N_PER_SYMBOL
    np.testing.assert_array_equal(bars.close, good_columns()["close"][0::2])
    with pytest.raises(BarDataError) as info:
        read_bars(path, symbols=["NQ"])
    assert [(p.column, p.row) for p in info.value.problems] == [("close", 7)]
    cols = good_columns()
    cols["timestamp"] = cols["timestamp"].copy()
    cols["timestamp"][10] = cols["timestamp"][8]  # ES bar 5 repeats bar 4's time
    cols["volume"] = cols["volume"].copy()
    cols["volume"][12] = float(2**63)  # ES bar 6: a placeholder
    with pytest.raises(BarDataError) as info:
        read_bars(write_parquet(tmp_path / "dup.parquet", cols), symbols=["ES"])
    assert sorted((p.column, p.row) for p in info.value.problems) == [("timestamp", 10), ("volume", 12)]
    assert len(read_bars(write_parquet(tmp_path / "dup.parquet", cols), symbols=["NQ"])) == N_PER_SYMBOL
    # a directory of files, one of them with a dictionary symbol and a string_view column nothing reads
    root = tmp_path / "parts"
    write_parquet(root / "part-1.parquet", {k: v[:8] for k, v in good_columns().items()})
    later = {k: v[8:] for k, v in good_columns().items()}
    later["close"] = later["close"].copy()
    later["close"][5] = -1.0  # file row 5: NQ bar 6
    table = pa.table({k: v for k, v in later.items() if k not in ("symbol", "note")})
    table = table.append_column("symbol", pa.array(later["symbol"], pa.string()).dictionary_encode())
    table = table.append_column("note", pa.array(later["note"], pa.string()).cast(pa.string_view()))
    pq.write_table(table, root / "part-2.parquet")
    assert len(read_bars(root, symbols=["ES"])) == N_PER_SYMBOL
    with pytest.raises(BarDataError) as info:
        read_bars(root, symbols=["NQ"])
    assert [(Path(p.file).name, p.column, p.row) for p in info.value.problems] == [("part-2.parquet", "close", 5)]
    one = {k: v[0::2] for k, v in good_columns().items() if k != "symbol"}  # no symbol column: one series
    path = write_parquet(tmp_path / "one.parquet", one)
    assert len(read_bars(path, symbols=["SERIES"])) == N_PER_SYMBOL and len(read_bars(path, symbols=["ES"])) == 0


def test_parq_and_pq_files_in_a_directory_are_read(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "part-1.parq", series_columns(0, 5, "ES"))
    write_parquet(root / "part-2.pq", series_columns(5, 9, "ES"))
    write_parquet(root / "part-3.parquet", series_columns(9, 12, "ES"))
    bars = read_bars(root)
    assert len(bars) == 12 and bars.files == [str(root / n) for n in ("part-1.parq", "part-2.pq", "part-3.parquet")]


def test_each_overlapping_pair_of_files_is_named_and_a_null_hides_no_decrease(tmp_path: Path) -> None:
    root = tmp_path / "bars"
    write_parquet(root / "part-1.parquet", {**series_columns(0, 10, "NQ")})
    write_parquet(root / "part-2.parquet", {**series_columns(0, 10, "ES")})
    third = write_parquet(root / "part-3.parquet", {**series_columns(8, 12, "ES")})
    fourth = write_parquet(root / "part-4.parquet", {**series_columns(5, 12, "NQ")})
    problems = problems_of(root)
    assert [(p.file, p.count) for p in problems] == [(str(third), 2), (str(fourth), 5)], problems
    assert "part-2.parquet" in problems[0].rule and "part-1.parquet" in problems[1].rule
    cols = series_columns(0, 6, "ES")
    ts: list[int | None] = [int(x) for x in cols["timestamp"]]
    ts[2], ts[3] = None, ts[0]  # bar 3 goes back behind a null
    problems = problems_of(write_parquet(tmp_path / "null.parquet", cols | {"timestamp": pa.array(ts, pa.int64())}))
    assert sorted(p.rule.split(" (")[0].split(";")[0] for p in problems) == [
        "timestamp is null", "timestamps decrease within a symbol"], problems


def test_times_in_messages_keep_a_fraction_of_a_second_when_there_is_one() -> None:
    """Sub-second bars: two times a message names must not print alike when they differ."""
    from features.check import format_timestamp

    assert format_timestamp(1_704_484_740_000_000_000) == "2024-01-05 19:59:00 UTC"
    assert format_timestamp(1_704_484_740_250_000_000) == "2024-01-05 19:59:00.25 UTC"
    assert format_timestamp(1_704_484_740_000_000_001) == "2024-01-05 19:59:00.000000001 UTC"
    assert format_timestamp(-1_500_000_000) == "1969-12-31 23:59:58.5 UTC"


def test_a_timestamp_nanoseconds_cannot_hold_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    """A 9999-12-31 placeholder in a timestamp[us] column (int64 nanoseconds end in 2262)."""
    cols = good_columns()
    us = np.asarray(cols["timestamp"]) // 1000
    us[5] = 253_402_214_400_000_000  # 9999-12-31 in microseconds
    cols["timestamp"] = pa.array(us, pa.timestamp("us"))
    p = only_problem(write_parquet(tmp_path / "far.parquet", cols))
    assert (p.column, p.row) == ("timestamp", 5) and "9999-12-31" in p.rule and "1677 to 2262" in p.rule, p
    # beyond what a date shows (the year 33658), and a UINT64_MAX placeholder in unsigned nanoseconds
    ms = np.asarray(good_columns()["timestamp"]) // 10**6
    ms[4] = 10**15
    cols["timestamp"] = pa.array(ms, pa.timestamp("ms"))
    p = only_problem(write_parquet(tmp_path / "farther.parquet", cols))
    assert (p.row, p.count) == (4, 1) and "(1000000000000000 ms) outside what int64 nanoseconds hold" in p.rule, p
    ns = np.asarray(good_columns()["timestamp"]).astype(np.uint64)
    ns[6] = np.iinfo(np.uint64).max
    cols["timestamp"] = pa.array(ns, pa.uint64())
    p = only_problem(write_parquet(tmp_path / "unsigned.parquet", cols))
    assert p.row == 6 and f"({np.iinfo(np.uint64).max}) outside" in p.rule, p


def test_a_user_feature_beyond_float32_is_refused_by_row(tmp_path: Path) -> None:
    """The model computes in float32: 1e39 is finite in the file and infinite in the model."""
    cols = good_columns()
    cols["imbalance"] = np.asarray(cols["imbalance"]).copy()
    cols["imbalance"][9] = 1e39
    p = only_problem(write_parquet(tmp_path / "huge.parquet", cols), user=("imbalance",))
    assert (p.column, p.row) == ("imbalance", 9) and "beyond float32's range" in p.rule, p


def test_one_column_mapped_to_two_fields_is_refused_but_prices_may_share_one(tmp_path: Path) -> None:
    """--volume-col close reads the price as volume: refused, naming the column and both fields. Close-only
    data may map open, high, low and close to one column (a bar with no range)."""
    path = write_parquet(tmp_path / "bars.parquet", good_columns())
    problems = problems_of(path, ColumnMap(volume="close"))
    assert [(p.column, p.rule) for p in problems] == [("close", "column 'close' is mapped to close and volume")]
    bars = read_bars(path, ColumnMap(open="close", high="close", low="close"))
    assert np.array_equal(bars.open, bars.close) and np.array_equal(bars.high, bars.low)


def test_an_int64_min_placeholder_in_a_user_column_is_refused_by_row(tmp_path: Path) -> None:
    cols = good_columns()
    values = np.arange(2 * N_PER_SYMBOL, dtype=np.int64)
    values[4] = -(2**63)  # a feed's "no value" for a signed integer column
    cols["imbalance"] = pa.array(values, pa.int64())
    problems = problems_of(write_parquet(tmp_path / "min.parquet", cols), user=("imbalance",))
    assert [(p.column, p.row, p.count) for p in problems] == [("imbalance", 4, 1)], problems
    assert "INT64_MIN" in problems[0].rule


def test_the_names_taken_from_a_training_run_are_named_for_a_missing_column_error(tmp_path: Path) -> None:
    """A model trained on ts_event/raw_symbol (and --time-unit ms) reads a file of the default layout: the note
    names the bar columns it took from the run that the file lacks (in the flags' order), not the ones this
    command gave, the run's default names, names the file has, or settings that are no column."""
    from features.bars import column_names

    parser = argparse.ArgumentParser()
    ColumnMap.add_arguments(parser, "the training run's")
    run = {**ColumnMap().to_dict(), "symbol": "raw_symbol", "timestamp": "ts_event", "time_unit": "ms",
           "default_symbol": "ES"}
    present = column_names(write_parquet(tmp_path / "bars.parquet", series_columns(0, 6, "ES")))
    assert {"timestamp", "symbol", "close"} <= present and column_names(tmp_path / "none") == set()
    assert ColumnMap.inherited(parser.parse_args([]), run, present) == (
        "note: the names not given as flags are the model's training run's (--time-col ts_event, --symbol-col "
        "raw_symbol); pass the flags for this file's names")
    assert ColumnMap.inherited(parser.parse_args(["--time-col", "timestamp"]), run, present) == (
        "note: the names not given as flags are the model's training run's (--symbol-col raw_symbol); pass the "
        "flags for this file's names")
    assert ColumnMap.inherited(parser.parse_args([]), run, present | {"ts_event", "raw_symbol"}) is None
    assert ColumnMap.inherited(parser.parse_args([]), ColumnMap().to_dict(), set()) is None
    assert ColumnMap.inherited(parser.parse_args([]), None, set()) is None
