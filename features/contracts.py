"""Futures contract names -> roots, and how a run treats contracts (`ContractConfig`, saved with every model).

A name is read CME-style: root + month code + 1- or 2-digit year (ESH5, ESH25, CLZ24, 6EM5). A mapping file
(`--roots FILE`, CSV `contract,root[,expiration]`) or a bars column (`--roots COLUMN`) names roots that do not
follow that pattern.
"""

from __future__ import annotations

import argparse
import csv
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from features.calendar import sessions
from features.exchanges import PRODUCTS, last_trading_day, trading_days

MONTH_CODES = "FGHJKMNQUVXZ"  # January .. December
CONTRACT_PATTERN = "root + month code (FGHJKMNQUVXZ) + 1- or 2-digit year, e.g. ESH5, ESH25, CLZ24, 6EM5"
_NAME = re.compile(r"(?P<root>[A-Z0-9]{1,6}?)(?P<month>[FGHJKMNQUVXZ])(?P<year>[0-9]{1,2})")
ROLL_RULES = "volume, calendar:N (N sessions before expiry) or none"
ROOTS_FIX = ("map the names to roots with --roots FILE (a CSV with a header row: contract,root[,expiration]) or "
             "--roots COLUMN (a bars column holding each bar's root)")


def parse_contract(name: str) -> tuple[str, int, str] | None:
    """(root, month 1..12, year digits) of a CME-style contract name; None when the name is not one."""
    m = _NAME.fullmatch(name)
    if m is None or not any(ch.isalpha() for ch in m["root"]):
        return None
    return m["root"], MONTH_CODES.index(m["month"]) + 1, m["year"]


def contract_month(name: str, first_ns: int) -> int | None:
    """The contract's delivery month as year * 12 + month - 1, resolving a 1-digit year to the decade that puts it
    at or after the year before its first bar (`first_ns`); None when the name is not CME-style."""
    if (parsed := parse_contract(name)) is None:
        return None
    _, month, digits = parsed
    if len(digits) == 2:
        year = 2000 + int(digits)
    else:
        first_year = int(str(np.datetime64(int(first_ns), "ns").astype("datetime64[Y]"))) - 1
        year = first_year + (int(digits) - first_year) % 10
    return year * 12 + month - 1


@dataclass(frozen=True)
class ContractConfig:
    """How per-contract bars become one continuous series per root; saved in the feature config."""

    roll: str = "volume"  # "volume" | "calendar:N" | "none"
    adjust: str = "none"  # "none": the contracts' own prices | "ratio": ratio back-adjusted to the latest contract
    volume: str = "front"  # "front": the front's volume | "root": the sum over the root's contracts at that bar
    contract_column: str = ""  # column of raw contract names; "" = the symbol column
    root_column: str = ""  # bars column naming each bar's root; "" = the mapping, else the pattern
    roots: tuple[tuple[str, str], ...] = ()  # contract -> root, from a --roots file
    expirations: tuple[tuple[str, str], ...] = ()  # contract -> "YYYY-MM-DD"
    builtin: tuple[str, ...] = ()  # the contracts whose expiration is features.exchanges' (the rest: the user's)
    exchange_days: bool = False  # sessions are the exchange's trading days for roots it knows (else calendar days)

    def __post_init__(self) -> None:
        if roll_sessions(self.roll) is None and self.roll not in ("volume", "none"):
            raise ValueError(f"--roll {self.roll}: expected {ROLL_RULES}")

    @functools.cached_property
    def _root_map(self) -> dict[str, str]:
        return dict(self.roots)

    @functools.cached_property
    def _expiration_map(self) -> dict[str, str]:
        return dict(self.expirations)

    def root_of(self, contract: str) -> str | None:
        """The contract's root: from the mapping file, else the CME-style pattern; None when neither maps it."""
        if (mapped := self._root_map.get(contract)) is not None:
            return mapped
        return parsed[0] if (parsed := parse_contract(contract)) is not None else None

    def expiration(self, contract: str) -> np.datetime64 | None:
        return np.datetime64(day, "D") if (day := self._expiration_map.get(contract)) is not None else None

    def describe(self) -> str:
        """One line: the roll rule and how contract names map to roots."""
        names = "a --roots file" if self.roots else f"the bars' {self.root_column!r} column" if self.root_column \
            else CONTRACT_PATTERN
        return f"roll {self.roll}, adjust {self.adjust}, volume {self.volume}; contract names -> roots by {names}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "roots": dict(self.roots), "expirations": dict(self.expirations),
                "builtin": list(self.builtin)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ContractConfig:
        return ContractConfig(str(d["roll"]), str(d["adjust"]), str(d["volume"]), str(d["contract_column"]),
                              str(d["root_column"]), tuple(sorted(d["roots"].items())),
                              tuple(sorted(d["expirations"].items())), tuple(d.get("builtin", ())),
                              bool(d.get("exchange_days", False)))  # a model from before: calendar days

    def sessions(self, timestamp_ns: np.ndarray, root: str, tz: str) -> np.ndarray:
        """Each bar's session of `root` (days since 1970-01-01, int64): the exchange's trading day for a root
        features.exchanges knows (with exchange_days), else the calendar day in `tz`."""
        product = PRODUCTS.get(root) if self.exchange_days else None
        return sessions(timestamp_ns, tz) if product is None else trading_days(timestamp_ns, product.exchange)


def roll_sessions(rule: str) -> int | None:
    """N of a `calendar:N` rule; None for other rules."""
    m = re.fullmatch(r"calendar:(\d+)", rule)
    return int(m[1]) if m else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The contract flags of every command that reads bars."""
    g = parser.add_argument_group("futures contracts (per-contract bars -> one continuous series per root)")
    g.add_argument("--contract-col", metavar="NAME",
                   help="column of raw contract names, e.g. ESH5 (default: the symbol column)")
    g.add_argument("--roots", metavar="FILE|COLUMN",
                   help="contract -> root: a CSV file with a header row contract,root[,expiration], or a bars "
                        "column naming each bar's root (default: " + CONTRACT_PATTERN + ")")
    g.add_argument("--roll", metavar="RULE",
                   help="how the front contract is chosen: volume (the default for contract names: the next "
                        "contract from the session after the first one its volume exceeds the front's), "
                        "calendar:N (N sessions before expiry) or none (the file is continuous already)")
    g.add_argument("--adjust", choices=("none", "ratio"),
                   help="the continuous series' prices: each contract's own (none, the default) or ratio "
                        "back-adjusted to the latest contract; returns are within a contract either way")
    g.add_argument("--volume", dest="volume_mode", choices=("front", "root"),
                   help="a continuous bar's volume: the front contract's (default) or the sum over the root's")
    g.add_argument("--expiration-col", metavar="NAME",
                   help="column of each contract's expiration, for --roll calendar:N (default expiration)")


@dataclass(frozen=True)
class ContractFlags:
    """The contract flags of a command (None: not given), by keyword; `of` reads them from parsed arguments."""

    contract_col: str | None = None
    roots: str | None = None  # a mapping file or a bars column
    roll: str | None = None
    adjust: str | None = None
    volume: str | None = None
    expiration_col: str | None = None

    @staticmethod
    def of(args: argparse.Namespace) -> ContractFlags:
        """The flags `add_arguments` defines, from any command's parsed arguments (absent ones: None)."""
        return ContractFlags(**{name: getattr(args, "volume_mode" if name == "volume" else name, None)
                                for name in ContractFlags.__dataclass_fields__})

    @property
    def given(self) -> bool:
        """Whether any flag that asks for contracts was given."""
        return any(v is not None for v in (self.contract_col, self.roots, self.roll, self.adjust, self.volume))


def read_mapping(path: Path) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """(contract -> root, contract -> expiration day) from a CSV mapping file; ValueError names a bad row."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"contract", "root"} <= set(rows[0]):
        raise ValueError(f"--roots {path}: expected a CSV with a header row contract,root[,expiration]")
    roots, days = {}, {}
    for i, row in enumerate(rows, start=2):
        contract, root = (row.get("contract") or "").strip(), (row.get("root") or "").strip()
        if not contract or not root:
            raise ValueError(f"--roots {path}: line {i} lacks a contract or a root")
        roots[contract] = root
        if (row.get("expiration") or "").strip():
            days[contract] = expiration_day(row["expiration"], f"--roots {path} line {i}")
    return tuple(sorted(roots.items())), tuple(sorted(days.items()))


def expiration_day(text: str, where: str) -> str:
    """An expiration (ISO date or timestamp text) as "YYYY-MM-DD"; ValueError names `where`."""
    try:
        return str(np.datetime64(text.strip().replace("Z", "").split("+")[0][:26], "D"))
    except ValueError:
        raise ValueError(f"{where}: expiration {text!r} is not a date; give YYYY-MM-DD") from None


def contract_config(flags: ContractFlags, names: Sequence[str], has_columns: Sequence[str] = ()
                    ) -> ContractConfig | None:
    """The run's ContractConfig from its flags and the bars' names (contract column values), or None for plain
    series: names that are not contract names and no contract flag, or `--roll none` without --contract-col.
    ValueError (one line) for a name no rule maps while contracts are asked for."""
    if (flags.roll == "none" and flags.contract_col is None) or not (names or flags.given):
        return None
    roots: tuple[tuple[str, str], ...] = ()
    days: tuple[tuple[str, str], ...] = ()
    root_column = ""
    if flags.roots is not None:
        if Path(flags.roots).is_file():
            roots, days = read_mapping(Path(flags.roots))
        elif flags.roots in has_columns:
            root_column = flags.roots
        else:
            raise ValueError(f"--roots {flags.roots}: no such file, and the bars have no such column; " + ROOTS_FIX)
    cfg = ContractConfig(flags.roll or "volume", flags.adjust or "none", flags.volume or "front",
                         flags.contract_col or "", root_column, roots, days, exchange_days=True)
    unmapped = [n for n in names if cfg.root_of(n) is None] if not root_column else []
    if unmapped and not flags.given and len(unmapped) == len(names):
        return None  # plain series, as the names are not contracts
    if unmapped:
        shown = ", ".join(repr(n) for n in unmapped[:3]) + (f" and {len(unmapped) - 3} more" if len(unmapped) > 3
                                                             else "")
        spreads = "; calendar spreads such as ESH5-ESM5 are not one contract's bars: drop their rows" \
            if any("-" in n for n in unmapped) else ""
        raise ValueError(f"contract name(s) {shown} name no root: contract names are read as {CONTRACT_PATTERN}; "
                         + ROOTS_FIX + (" (or --roll none: each name its own series)" if flags.roll is None else "")
                         + spreads)
    return cfg


def with_builtin_expirations(cfg: ContractConfig, first_ns: Mapping[str, int]) -> ContractConfig:
    """`cfg` with the exchange's last trading day (features.exchanges) as the expiration of each contract of
    `first_ns` (name -> first bar, which places a 1-digit year) the user gave none, of a root the table knows."""
    given = dict(cfg.expirations)
    added: dict[str, str] = {}
    for name, first in first_ns.items():
        root, month = cfg.root_of(name), contract_month(name, first)
        if name not in given and root is not None and month is not None and \
                (day := last_trading_day(root, month // 12, month % 12 + 1)) is not None:
            added[name] = day
    return replace(cfg, expirations=tuple(sorted({**given, **added}.items())), builtin=tuple(sorted(added)))
