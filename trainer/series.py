"""The series a run trains on: per-contract bars rolled into one continuous series per root (features.rolls), or
plain series as read. Torch-free, so export and the backtest read bars as the trainer does."""

from __future__ import annotations

import argparse
from pathlib import Path

from features.bars import Bars, ColumnMap, read_bars
from features.compute import FeatureConfig
from features.contracts import ContractConfig
from features.rolls import Roll, continuous, reading, scan
from trainer.config import CONTRACT_FIELDS, TrainConfig

ROLLS_LISTED = 8  # rolls logged one line each; past this, a count and the first few


class ContractError(ValueError):
    """Contract input no roll rule can take (an unmappable name, a missing expiration); one line naming the fix."""


def contract_flags(cfg: TrainConfig) -> argparse.Namespace:
    """The run's contract fields as features.contracts' flags read them (None: not given)."""
    return argparse.Namespace(**{dest: getattr(cfg, name) for name, dest in CONTRACT_FIELDS.items()})


def scan_contracts(parquet: str | Path, columns: ColumnMap, cfg: TrainConfig) -> ContractConfig | None:
    """A fresh run's ContractConfig from its contract fields and the names in its bars; None for plain series.
    ContractError (one line) for contract input no rule can take."""
    flags = contract_flags(cfg)
    try:
        return scan(parquet, columns, flags)
    except ValueError as exc:
        raise ContractError(str(exc)) from None


def read_series(parquet: str | Path, columns: ColumnMap, fc: FeatureConfig) -> tuple[Bars, list[Roll]]:
    """The bars as `fc`'s model takes them (one series per root when it has contracts) and the rolls. The read's
    BarDataError passes through; ContractError (one line) for contract input the roll rule cannot take."""
    return as_series(read_contract_bars(parquet, columns, fc), fc)


def read_contract_bars(parquet: str | Path, columns: ColumnMap, fc: FeatureConfig) -> Bars:
    """The bars as read for `fc`: per contract when it has contracts (the contract column as the symbol, the root
    column among the labels)."""
    cmap, extra = reading(columns, fc.contracts)
    labels = tuple(dict.fromkeys((*fc.categorical_columns, *extra)))
    return read_bars(parquet, cmap, fc.real_columns, label_columns=labels)


def as_series(bars: Bars, fc: FeatureConfig) -> tuple[Bars, list[Roll]]:
    """features.rolls.continuous, its ValueError as ContractError."""
    try:
        return continuous(bars, fc)
    except ValueError as exc:
        raise ContractError(str(exc)) from None


def roll_lines(contracts: ContractConfig | None, rolls: list[Roll], roots: list[str]) -> list[str]:
    """What a user reads about the contracts of a run: the rule, the roots, each roll (a count and the first
    few when many). Nothing for plain series."""
    if contracts is None:
        return []
    lines = [f"contracts: {len(roots)} root(s) {', '.join(roots)}, {len(rolls)} roll(s); {contracts.describe()}"]
    shown = rolls if len(rolls) <= ROLLS_LISTED else rolls[:ROLLS_LISTED // 2]
    lines += [f"roll {r.line()}" for r in shown]
    if len(shown) < len(rolls):
        lines.append(f"... and {len(rolls) - len(shown)} more rolls (all in the checkpoint's rolls)")
    return lines
