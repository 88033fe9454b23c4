"""The bars a model takes: read per contract when it has contracts, then rolled into one continuous series per
root (features.rolls), or plain series as read. Every command that reads bars for a model reads them here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from features.bars import Bars, ColumnMap, file_columns, file_schema, list_bar_files, read_bars, timestamps_ns
from features.config import FeatureConfig
from features.contracts import ContractConfig, ContractFlags, contract_config, expiration_day, with_builtin_expirations
from features.dbn import DbnFileError
from features.rolls import Roll, continuous

ROLLS_LISTED = 20  # rolls listed one line each; past this, a count of the rest


class ContractError(ValueError):
    """Contract input no roll rule can take (an unmappable name, a missing expiration); one line naming the fix."""


def read_series(path: str | Path, columns: ColumnMap, fc: FeatureConfig) -> tuple[Bars, list[Roll]]:
    """The bars as `fc`'s model takes them (one series per root when it has contracts) and the rolls. The read's
    BarDataError passes through; ContractError (one line) for contract input the roll rule cannot take."""
    return as_series(read_contract_bars(path, columns, fc), fc)


def read_contract_bars(path: str | Path, columns: ColumnMap, fc: FeatureConfig, symbols: list[str] | None = None,
                       check_user_values: bool = True) -> Bars:
    """The bars as read for `fc` (features.bars.read_bars): per contract when it has contracts (the contract
    column as the symbol, the root column among the labels, every contract: `symbols` filters plain series only)."""
    cmap, extra = reading(columns, fc.contracts)
    labels = tuple(dict.fromkeys((*fc.categorical_columns, *extra)))
    return read_bars(path, cmap, fc.real_columns, symbols=None if fc.contracts else symbols,
                     check_user_values=check_user_values, label_columns=labels)


def as_series(bars: Bars, fc: FeatureConfig) -> tuple[Bars, list[Roll]]:
    """features.rolls.continuous, its ValueError as ContractError."""
    try:
        return continuous(bars, fc)
    except ValueError as exc:
        raise ContractError(str(exc)) from None


def roll_listing(rolls: list[Roll], prefix: str = "  ") -> list[str]:
    """One line per roll, each after `prefix`, the first ROLLS_LISTED of them, then a count of the rest."""
    shown = rolls[:ROLLS_LISTED]
    more = [f"{prefix}... and {len(rolls) - len(shown)} more rolls"] if len(shown) < len(rolls) else []
    return [f"{prefix}{r.line()}" for r in shown] + more


def roll_lines(contracts: ContractConfig | None, rolls: list[Roll], roots: list[str]) -> list[str]:
    """What a user reads about the contracts of a run: the rule, the roots, the rolls. Nothing for plain series."""
    if contracts is None:
        return []
    return [f"contracts: {len(roots)} root(s) {', '.join(roots)}, {len(rolls)} roll(s); {contracts.describe()}",
            *roll_listing(rolls, prefix="roll ")]


def scan_contracts(path: str | Path, columns: ColumnMap, flags: ContractFlags) -> ContractConfig | None:
    """A fresh run's ContractConfig from its contract flags and the names in its bars; None for plain series.
    ContractError (one line) for contract input no rule can take."""
    try:
        return scan(path, columns, flags)
    except ValueError as exc:
        raise ContractError(str(exc)) from None


def reading(cmap: ColumnMap, cfg: ContractConfig | None) -> tuple[ColumnMap, tuple[str, ...]]:
    """The column map to read per-contract bars with (the contract column as the symbol) and the label columns
    the roll needs (the root column)."""
    if cfg is None:
        return cmap, ()
    cmap = replace(cmap, symbol=cfg.contract_column) if cfg.contract_column else cmap
    return cmap, (cfg.root_column,) if cfg.root_column else ()


def scan(path: str | Path, cmap: ColumnMap, flags: ContractFlags) -> ContractConfig | None:
    """A run's ContractConfig from its flags and the names (and any expirations and root column) in the bars at
    `path`; None for plain series. ValueError (one line) for contract input no rule can take."""
    column = flags.contract_col or cmap.symbol
    exp_col = flags.expiration_col or "expiration"
    root_col = flags.roots if flags.roots is not None and not Path(flags.roots).is_file() else None
    names: set[str] = set()
    days: dict[str, str] = {}
    roots: dict[str, str] = {}  # contract -> root, from a bars root column
    present: set[str] = set()
    first: dict[str, int] = {}  # contract -> its first bar
    for file in list_bar_files(Path(path)):
        try:
            table = file_columns(file, [c for c in dict.fromkeys((column, exp_col, root_col, cmap.timestamp))
                                        if c is not None])
            have = file_schema(file).names
            present |= set(have)
        except (OSError, pa.ArrowException, DbnFileError):
            continue  # read_bars names the file that cannot be read
        if column not in have:
            continue
        text = table.column(column).cast(pa.string())
        names |= {str(n) for n in text.unique().to_pylist() if n is not None}
        if cmap.timestamp in have:
            first |= _first_bars(text, table.column(cmap.timestamp), cmap, first)
        if exp_col in have:
            both = pa.table({"c": text, "e": table.column(exp_col).cast(pa.string())}).group_by("c").aggregate(
                [("e", "max")])
            days |= {c: expiration_day(e, f"column {exp_col!r} of {file}") for c, e in
                     zip(both.column("c").to_pylist(), both.column("e_max").to_pylist(), strict=True) if c and e}
        if root_col in have:
            pairs = pa.table({"c": text, "r": table.column(root_col).cast(pa.string())}).group_by(["c", "r"])
            roots |= {row["c"]: row["r"] for row in pairs.aggregate([]).to_pylist() if row["c"] and row["r"]}
    if flags.contract_col is not None and column not in present:
        raise ValueError(f"--contract-col {column}: the bars have no such column; name the column of raw contract "
                         "names (e.g. symbol or raw_symbol)")
    cfg = contract_config(flags, sorted(names), sorted(present))
    if cfg is not None and days:
        cfg = replace(cfg, expirations=tuple(sorted({**days, **dict(cfg.expirations)}.items())))
    if cfg is not None and cfg.root_column:  # kept with the model: a server maps the names the column mapped
        cfg = replace(cfg, roots=tuple(sorted(roots.items())))
    return None if cfg is None else with_builtin_expirations(cfg, first)


def _first_bars(names: pa.ChunkedArray, times: pa.ChunkedArray, cmap: ColumnMap, seen: dict[str, int]
                ) -> dict[str, int]:
    """Each contract's first bar time in the file, or `seen`'s if earlier; none for times read_bars would refuse."""
    ts, problem = timestamps_ns(times, "", cmap.timestamp, cmap.time_unit)
    if ts is None or problem is not None:
        return {}
    codes, inverse = np.unique(np.asarray(names.to_numpy(zero_copy_only=False), dtype=str), return_inverse=True)
    first = np.full(codes.size, np.iinfo(np.int64).max)
    np.minimum.at(first, inverse, ts)
    return {str(c): min(int(t), seen.get(str(c), int(t))) for c, t in zip(codes, first, strict=True)}
