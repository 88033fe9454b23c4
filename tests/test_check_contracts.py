"""`python -m features.check` on per-contract futures bars: the roll rule, the roots, every roll, and the summary
of each root's continuous series; one line for contract input no rule can take; plain files as before."""

from __future__ import annotations

import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from features.bars import read_bars
from features.check import summarize
from features.contracts import CONTRACT_PATTERN
from features.synth import generate
from tests.artifacts import run_main

DAY0 = np.datetime64("2025-01-06", "D")  # a Monday
MINUTE = 60 * 10**9
OPEN_NS = (14 * 60 + 30) * MINUTE  # each session's first bar, 14:30 UTC
HIGH_VOLUME, LOW_VOLUME = 1000.0, 100.0


@dataclass
class ContractBars:
    """Per-contract bars as a vendor delivers them, and what a roll rule should make of them."""

    table: pa.Table  # ts_event, symbol (the contract), open, high, low, close, volume; rows in time order
    front: pa.Table  # each root's continuous series, ratio back-adjusted: ts_event, symbol (the root), contract, ...
    rolls: list[str]  # Roll.line() of every roll, roots in order
    expirations: dict[str, str]  # contract -> "YYYY-MM-DD": the business day after its last


def day_ns(day: int) -> int:
    """The first bar of business day `day` (0 = DAY0), int64 ns."""
    return int(np.busday_offset(DAY0, day).astype("datetime64[ns]").astype(np.int64)) + OPEN_NS


def contract_bars(contracts: dict[str, list[str]], days_each: int = 3, per_day: int = 30, gap: float = 0.03,
                  seed: int = 0) -> ContractBars:
    """1-minute bars of each root's contracts in turn: contract k is the busiest on business days
    [k * days_each, (k + 1) * days_each) and trades one quiet day either side; each is `gap` dearer than the one
    before it (a price gap at every roll). Volume rolls the front to contract k + 1 at the first bar of day
    (k + 1) * days_each + 1, the session after the first one its volume leads."""
    rng = np.random.default_rng(seed)
    parts, fronts, rolls, expirations = [], [], [], {}
    for root, names in contracts.items():
        n_days = days_each * len(names)
        ts = np.concatenate([day_ns(d) + np.arange(per_day) * MINUTE for d in range(n_days)])  # [T]
        day = np.repeat(np.arange(n_days), per_day)  # [T]
        close = 100.0 * np.exp(np.cumsum(rng.normal(0, 1e-3, ts.size)))  # [T] the contracts' common walk
        opened = np.concatenate([[close[0]], close[:-1]])
        for k, name in enumerate(names):
            rows = np.flatnonzero((day >= k * days_each - 1) & (day < (k + 1) * days_each + 1))
            busy = (day[rows] >= k * days_each) & (day[rows] < (k + 1) * days_each)
            parts.append(_bars(ts[rows], name, opened[rows], close[rows], (1 + gap) ** k,
                               np.where(busy, HIGH_VOLUME, LOW_VOLUME)))
            expirations[name] = str(np.busday_offset(DAY0, (k + 1) * days_each + 1))
        front = np.clip((day - 1) // days_each, 0, len(names) - 1)  # [T] the front contract's index
        quiet = (day == (front + 1) * days_each) & (front + 1 < len(names))  # its last session as front
        last = (1 + gap) ** (len(names) - 1)  # ratio back-adjusted: the latest contract's prices
        fronts.append(_bars(ts, root, opened, close, last, np.where(quiet, LOW_VOLUME, HIGH_VOLUME))
                      .append_column("contract", pa.array(np.asarray(names)[front])))
        rolls += [f"{root} {str(np.datetime64(day_ns((k + 1) * days_each + 1), 'ns'))[:16].replace('T', ' ')} UTC: "
                  f"{old} -> {new}" for k, (old, new) in enumerate(itertools.pairwise(names))]
    table = pa.concat_tables(parts)
    table = table.take(pa.array(np.lexsort((table["symbol"].to_numpy(zero_copy_only=False),
                                            table["ts_event"].cast(pa.int64()).to_numpy()))))
    return ContractBars(table, pa.concat_tables(fronts), rolls, expirations)


def _bars(ts: np.ndarray, symbol: str, opened: np.ndarray, close: np.ndarray, scale: float,
          volume: np.ndarray) -> pa.Table:
    o, c = opened * scale, close * scale
    return pa.table({"ts_event": pa.array(ts).cast(pa.timestamp("ns", tz="UTC")), "symbol": [symbol] * ts.size,
                     "open": o, "high": np.maximum(o, c) * 1.0005, "low": np.minimum(o, c) * 0.9995, "close": c,
                     "volume": volume})


def run_check(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_main(["-m", "features.check", *map(str, args)])


@pytest.fixture(scope="module")
def futures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ContractBars]:
    bars = contract_bars({"ES": ["ESH5", "ESM5", "ESU5"], "NQ": ["NQH5", "NQM5"]})
    path = tmp_path_factory.mktemp("contracts") / "futures.parquet"
    pq.write_table(bars.table, path)
    return path, bars


def test_check_prints_the_roll_rule_roots_and_rolls_then_each_roots_continuous_series(
        futures: tuple[Path, ContractBars]) -> None:
    path, bars = futures
    done = run_check(path, "--time-col", "ts_event")
    assert done.returncode == 0, done.stderr
    es, nq = 9 * 30, 6 * 30  # business days x bars a day of each root's continuous series
    head = [f"contracts: {bars.table.num_rows} bars of 5 contract(s) -> one continuous series per root "
            f"({es + nq} bars); roll volume, adjust none, volume front; contract names -> roots by "
            f"{CONTRACT_PATTERN}",
            "roots: ES (3 contracts), NQ (2 contracts)",
            "rolls: 3",
            *(f"  {line}" for line in bars.rolls),
            # CME's rule, the third Friday of the contract month: ESH5 and NQH5 stopped trading on 2025-03-21
            "expirations (from each exchange's last-trading-day rule, built in):",
            "  ES: ESH5 2025-03-21, ESM5 2025-06-20, ESU5 2025-09-19",
            "  NQ: NQH5 2025-03-21, NQM5 2025-06-20",
            "files: 1",
            f"rows: {es + nq}",
            "symbols: 2"]
    assert done.stdout.splitlines()[:len(head)] == head, done.stdout
    assert bars.rolls[0] == "ES 2025-01-10 14:30 UTC: ESH5 -> ESM5"  # day 4: the session after ESM5 led
    assert f"  ES: {es} rows, 2025-01-06 14:30:00 UTC .. 2025-01-16 14:59:00 UTC, 8 gaps" in done.stdout
    assert f"  NQ: {nq} rows, 2025-01-06 14:30:00 UTC .. 2025-01-13 14:59:00 UTC, 5 gaps" in done.stdout
    assert done.stdout.endswith("no problems found\n")

    other = run_check(path, "--time-col", "ts_event", "--adjust", "ratio", "--volume", "root")
    assert other.returncode == 0, other.stderr
    assert "roll volume, adjust ratio, volume root; contract names" in other.stdout


def test_a_plain_file_prints_the_summary_alone(futures: tuple[Path, ContractBars], tmp_path: Path) -> None:
    plain = tmp_path / "plain.parquet"
    pq.write_table(generate(["ES", "NQ"], 200, seed=1), plain)
    done = run_check(plain)
    assert done.returncode == 0, done.stderr
    assert done.stdout == summarize(read_bars(plain)) + "\nno problems found\n"
    # --roll none without --contract-col: every name its own series, as before
    path, _ = futures
    done = run_check(path, "--time-col", "ts_event", "--roll", "none")
    assert done.returncode == 0 and "contracts:" not in done.stdout and "symbols: 5" in done.stdout, done.stdout


def test_check_lists_the_first_rolls_and_counts_the_rest(tmp_path: Path) -> None:
    months = [f"CL{m}{y}" for y in (5, 6) for m in "FGHJKMNQUVXZ"][:23]  # 22 monthly rolls
    path = tmp_path / "cl.parquet"
    pq.write_table(contract_bars({"CL": months}, days_each=2, per_day=4).table, path)
    done = run_check(path, "--time-col", "ts_event")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1:3] == ["roots: CL (23 contracts)", "rolls: 22"]
    assert lines[3].endswith("CLF5 -> CLG5") and lines[22].endswith("CLQ6 -> CLU6")
    assert lines[23] == "  ... and 2 more rolls" and lines[26] == "files: 1"
    # NYMEX's rule: three business days before the 25th of the month before, the 24th when the 25th is a holiday
    assert lines[25].startswith("  CL: CLF5 2024-12-19, CLG5 2025-01-21, CLH5 2025-02-20,"), lines[25]


def write_rows(table: pa.Table, path: Path, **columns: list[str]) -> Path:
    for name, values in columns.items():
        table = table.drop_columns([name]) if name in table.column_names else table
        table = table.append_column(name, pa.array(values))
    pq.write_table(table, path)
    return path


def one_problem(done: subprocess.CompletedProcess[str], path: Path) -> str:
    """The problem line of a check that found one, after asserting the header and the exit status."""
    assert done.returncode == 2 and done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert lines[0] == f"{path}: 1 problem(s) found" and len(lines) == 2, done.stderr
    assert lines[1].startswith(f"  {path}: ")
    return lines[1]


def test_contract_input_no_rule_can_take_is_one_line_naming_the_fix(futures: tuple[Path, ContractBars],
                                                                     tmp_path: Path) -> None:
    path, bars = futures
    names = bars.table["symbol"].to_pylist()
    names[5] = "ES_SPREAD"  # a name the pattern cannot map
    bad = write_rows(bars.table, tmp_path / "spread.parquet", symbol=names)
    line = one_problem(run_check(bad, "--time-col", "ts_event"), bad)
    assert "contract name(s) 'ES_SPREAD' name no root" in line and "--roots FILE" in line, line

    xy_names = [n.replace("ES", "XY") for n in bars.table["symbol"].to_pylist()]  # a root the table lacks
    xy = write_rows(bars.table, tmp_path / "xy.parquet", symbol=xy_names)
    line = one_problem(run_check(xy, "--time-col", "ts_event", "--roll", "calendar:2"), xy)
    assert "--roll calendar:2 needs each contract's expiration: XYH5" in line and "--expiration-col" in line, line

    line = one_problem(run_check(path, "--time-col", "ts_event", "--roll", "none", "--contract-col", "symbol"), path)
    assert "ES at 2025-01-08 14:30 UTC: ESH5 and ESM5 both claim the bar as front" in line, line
    assert "--roll volume" in line

    line = one_problem(run_check(path, "--time-col", "ts_event", "--contract-col", "raw_symbol"), path)
    assert "--contract-col raw_symbol: the bars have no such column" in line, line


def test_a_roots_file_maps_other_names_and_gives_the_expirations_a_calendar_roll_needs(
        futures: tuple[Path, ContractBars], tmp_path: Path) -> None:
    _, bars = futures
    renamed = {c: f"{c[:2]} {'HMU'.index(c[2]) * 3 + 3:02d}-25" for c in bars.expirations}  # ESM5 -> "ES 06-25"
    table = write_rows(bars.table, tmp_path / "renamed.parquet",
                       symbol=[renamed[s] for s in bars.table["symbol"].to_pylist()])
    roots = tmp_path / "roots.csv"
    roots.write_text("contract,root,expiration\n" + "".join(f"{renamed[c]},{c[:2]},{day}\n"
                                                             for c, day in bars.expirations.items()))
    done = run_check(table, "--time-col", "ts_event", "--roots", roots, "--roll", "calendar:1")
    assert done.returncode == 0, done.stderr
    assert "roll calendar:1, adjust none, volume front; contract names -> roots by a --roots file" in done.stdout
    assert "roots: ES (3 contracts), NQ (2 contracts)" in done.stdout
    # the front moves on the session 1 business day before the old contract's expiration
    for k, old, new in ((1, "ES 03-25", "ES 06-25"), (2, "ES 06-25", "ES 09-25"), (1, "NQ 03-25", "NQ 06-25")):
        when = str(np.datetime64(day_ns(3 * k), "ns"))[:16].replace("T", " ")
        assert f"  {old[:2]} {when} UTC: {old} -> {new}\n" in done.stdout, done.stdout

    # without the file, names that are no contract names are plain series; with a contract flag, a problem
    done = run_check(table, "--time-col", "ts_event")
    assert done.returncode == 0 and "contracts:" not in done.stdout and "symbols: 5" in done.stdout, done.stdout
    line = one_problem(run_check(table, "--time-col", "ts_event", "--roll", "volume"), table)
    assert "'ES 03-25', 'ES 06-25', 'ES 09-25' and 2 more name no root" in line and "--roots FILE" in line, line

