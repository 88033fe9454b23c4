"""A futures model's request names: which of its roots a symbol or a per-bar contract name belongs to, and what
to say when it belongs to none. The roll itself is `features.rolls.front_rows`, as in training."""

from __future__ import annotations

from features.contracts import CONTRACT_PATTERN, ContractConfig
from features.model_meta import ModelMeta
from features.text import bounded


def naming(cfg: ContractConfig) -> str:
    """How the model maps a contract name to its root, as a request is told."""
    if cfg.root_column:
        return f"the model read roots from the training bars' {cfg.root_column!r} column: send the root as the symbol"
    if cfg.roots:
        return "contract names map to roots by the model's --roots file, else as " + CONTRACT_PATTERN
    return "contract names are read as " + CONTRACT_PATTERN


def unknown_symbol(name: str, meta: ModelMeta) -> str:
    """Why a request's symbol names none of the model's series, and the ones it knows."""
    known = ", ".join(meta.symbols)
    cfg = meta.contracts
    if cfg is None:
        return f"unknown symbol {bounded(name)}; the model knows {known}"
    root = cfg.root_of(name)
    whose = f" (a contract of root {root}, which the model was not trained on)" if root is not None else ""
    return (f"unknown symbol {bounded(name)}{whose}; the model knows the roots {known}: send one of them or a "
            f"contract of one ({naming(cfg)})")


def foreign_contract(names: list[str], root: str, cfg: ContractConfig) -> str | None:
    """What is wrong with the contract names of a series of `root` (each once): a name of another root, or of
    none; None when every name is one of root's contracts (any name, when roots come from a bars column)."""
    if cfg.root_column:
        return None
    for name in names:
        other = cfg.root_of(name)
        if other != root:
            whose = f"a contract of root {other}, not {root}" if other is not None else \
                f"which names no root ({naming(cfg)})"
            return f"contracts holds {bounded(name)}, {whose}; send only the bars of {root}'s contracts"
    return None
