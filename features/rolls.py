"""Per-contract bars -> one continuous series per root, by a roll rule; one implementation for training, checks,
scoring and serving.

At a roll the new front's first return is taken against the new contract's own previous close (its last bar
before the roll; the bar's own open when it has none), never against the old contract's: each row's
`log_offset` (0 in the latest contract) is added to log(close), which is ratio back-adjustment in log space.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from features.bars import Bars
from features.config import FeatureConfig
from features.contracts import CONTRACT_PATTERN, ROOTS_FIX, ContractConfig, contract_month, roll_sessions


@dataclass(frozen=True)
class Roll:
    """The front of `root` moves from `old` to `new` at `timestamp_ns` (the first bar of `new` as front)."""

    root: str
    old: str
    new: str
    timestamp_ns: int

    def line(self) -> str:
        when = str(np.datetime64(self.timestamp_ns, "ns"))[:16].replace("T", " ")
        return f"{self.root} {when} UTC: {self.old} -> {self.new}"

    def to_dict(self) -> dict[str, str | int]:
        return {"root": self.root, "old": self.old, "new": self.new, "timestamp_ns": self.timestamp_ns}


@dataclass(frozen=True)
class Front:
    """One root's continuous series as rows of its per-contract bars."""

    rows: np.ndarray  # int64 [M]  the chosen rows, in time order
    log_offset: np.ndarray  # float64 [M]  added to log(close); 0 in the latest contract
    volume: np.ndarray  # float64 [M]  the continuous bar's volume (the front's, or the root's sum)
    rolls: list[tuple[str, str, int]]  # (old, new, first timestamp of new)
    # the rolls' first bars of `new` whose step is taken against their own open: no earlier bar of `new` given
    against_open: list[int] = field(default_factory=list)


def contract_codes(contract: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The distinct names of `contract` (object or str [n]) in order of first appearance, and each row's index into
    them (int64 [n]): one pass over a dict, no sort of the rows' strings."""
    rows = contract.tolist()
    index = {name: k for k, name in enumerate(dict.fromkeys(rows))}
    return list(index), np.fromiter(map(index.__getitem__, rows), np.int64, len(rows))


def front_rows(timestamp_ns: np.ndarray, code: np.ndarray, names: list[str], open_: np.ndarray, close: np.ndarray,
               volume: np.ndarray, cfg: ContractConfig, tz: str, root: str) -> Front:
    """The continuous series of one root's rows (any contracts, any order; [n] each, each row's contract an index
    into `names`, as `contract_codes` gives) by `cfg`'s roll rule; ValueError (one line) for input it cannot take."""
    order = np.lexsort((code, timestamp_ns))
    ts, code = timestamp_ns[order], code[order]
    if cfg.roll == "none":
        chosen = _continuous_as_given(ts, code, names, root)
    else:
        contracts = _ordered_contracts(ts, code, names, cfg, root)
        place = {name: k for k, name in enumerate(contracts)}
        col = np.array([place.get(n, -1) for n in names], dtype=np.int64)[code]
        days, s_of = np.unique(cfg.sessions(ts, root, tz), return_inverse=True)
        front = _volume_fronts(s_of, col, np.asarray(volume, np.float64)[order], len(days), len(contracts)) \
            if cfg.roll == "volume" else _calendar_fronts(days, contracts, cfg, root)
        chosen = np.flatnonzero(col == front[s_of])
    rows = order[chosen]
    vol = np.asarray(volume, np.float64)
    if cfg.volume == "root":
        at = np.unique(ts, return_inverse=True)[1]
        chosen_vol = np.bincount(at, weights=vol[order])[at[chosen]]  # the root's volume at each chosen bar
    else:
        chosen_vol = vol[rows]
    log_offset, rolls, against_open = _offsets(ts, code, names, chosen, np.asarray(open_, np.float64)[order],
                                               np.asarray(close, np.float64)[order])
    return Front(rows, log_offset, chosen_vol, rolls, against_open)


def _ordered_contracts(ts: np.ndarray, code: np.ndarray, names: list[str], cfg: ContractConfig, root: str) -> list[str]:
    """The root's contracts (those with rows) in expiry order: by expiration when known, else by contract month."""
    present, first_row = np.unique(code, return_index=True)
    first = {names[int(c)]: int(ts[i]) for c, i in zip(present, first_row, strict=True)}

    def key(name: str) -> tuple[int, int, str]:
        exp = cfg.expiration(name)
        if exp is not None:  # months since 1970-01, then the day
            return int(exp.astype("datetime64[M]").astype(np.int64)), int(exp.astype(np.int64)), name
        month = contract_month(name, first[name])
        if month is None:  # a name mapped by --roots without a month code: only an expiration places it
            raise ValueError(f"root {root}: contract {name!r} has no month code (root + FGHJKMNQUVXZ + year) and no "
                             "expiration, so its place among the root's contracts is unknown; give its expiration "
                             "in the --roots file (contract,root,expiration) or an expiration column")
        return month - 1970 * 12, 0, name

    ordered = sorted(first, key=key)
    keys = [key(n)[:2] for n in ordered]
    for a, b, ka, kb in zip(ordered, ordered[1:], keys, keys[1:], strict=False):
        if ka == kb:
            raise ValueError(f"root {root}: {a} and {b} are one contract month under two names; give each "
                             "contract one name")
    return ordered


def _volume_fronts(s_of: np.ndarray, col: np.ndarray, volume: np.ndarray, n_sessions: int,
                   n_contracts: int) -> np.ndarray:
    """The front contract of each session, int64 [S]: the next contract in expiry order takes over from the session
    after the first one it outvolumes the front (one step at a time: a deferred month's one-session spike moves
    nothing); never back. A front that has stopped trading gives way to the next contract that trades."""
    vol = np.zeros((n_sessions, n_contracts))  # [S, C]
    np.add.at(vol, (s_of, col), volume)
    traded = np.zeros((n_sessions, n_contracts), dtype=bool)
    traded[s_of, col] = True
    last = np.where(traded.any(axis=0), n_sessions - 1 - np.argmax(traded[::-1], axis=0), -1)  # [C]
    front = np.empty(n_sessions, dtype=np.int64)
    f = int(np.argmax(vol[0]))
    for s in range(n_sessions):
        if s > 0:
            if f + 1 < n_contracts and vol[s - 1, f + 1] > vol[s - 1, f]:
                f += 1
            elif last[f] < s:  # the front has stopped trading: the next contract that trades this session
                nxt = np.flatnonzero(traded[s, f + 1:])
                f = f + 1 + int(nxt[0]) if nxt.size else f
        front[s] = f
    return front


def _calendar_fronts(days: np.ndarray, contracts: list[str], cfg: ContractConfig, root: str) -> np.ndarray:
    """The front of each session `days` [S] as an index into `contracts` (-1 where it is none of them, or past the
    last known expiration's roll), int64 [S]: `rule_fronts`, the rule the known contract features follow."""
    if missing := [c for c in contracts if cfg.expiration(c) is None]:
        raise ValueError(f"--roll {cfg.roll} needs each contract's expiration: {', '.join(missing[:3])} of root "
                         f"{root} {'has' if len(missing) == 1 else 'have'} none; give the bars an expiration column "
                         "(--expiration-col NAME) or the --roots file an expiration column when training (a model "
                         "knows the expirations its training run read), or use --roll volume")
    names, _ = known_expiries(cfg, root)
    front = rule_fronts(days.astype("datetime64[D]"), cfg, root)  # [S] into names
    place = np.array([contracts.index(n) if n in contracts else -1 for n in names] + [-1], dtype=np.int64)
    return place[front]  # front -1 takes the appended -1


def _continuous_as_given(ts: np.ndarray, code: np.ndarray, names: list[str], root: str) -> np.ndarray:
    """Every row, for a file continuous already; ValueError when two contracts claim one bar."""
    if (same := np.flatnonzero(ts[1:] == ts[:-1])).size:
        i = int(same[0])
        when = str(np.datetime64(int(ts[i]), "ns"))[:16].replace("T", " ")
        raise ValueError(f"root {root} at {when} UTC: {names[code[i]]} and {names[code[i + 1]]} both claim the bar "
                         "as front, and --roll none takes the file as continuous already; choose the front with "
                         "--roll volume or --roll calendar:N")
    return np.arange(ts.size)


def _offsets(ts: np.ndarray, code: np.ndarray, names: list[str], chosen: np.ndarray, open_: np.ndarray,
             close: np.ndarray) -> tuple[np.ndarray, list[tuple[str, str, int]], list[int]]:
    """log offsets of the chosen rows (float64 [M]), the rolls, and the places in `chosen` of the rolls whose new
    contract has no earlier row (its step is against the roll bar's open), of time-sorted rows of all contracts."""
    picked = code[chosen]
    at = np.flatnonzero(picked[1:] != picked[:-1]) + 1  # [R] first chosen row of each new front
    steps = np.zeros(chosen.size)
    rolls, against_open = [], []
    for k in at:
        new_row, old_row = int(chosen[k]), int(chosen[k - 1])
        before = np.flatnonzero((code[:new_row] == picked[k]) & (ts[:new_row] < ts[new_row]))
        ref = close[before[-1]] if before.size else open_[new_row]  # the new contract's own previous price
        if not before.size:
            against_open.append(int(k))
        steps[k] = np.log(ref) - np.log(close[old_row])
        rolls.append((names[picked[k - 1]], names[picked[k]], int(ts[new_row])))
    # a row's offset: the sum of the steps of every later roll (the latest contract's rows: 0)
    offset = np.cumsum(steps[::-1])[::-1]
    return np.concatenate([offset[1:], [0.0]]) if offset.size else offset, rolls, against_open


def continuous(bars: Bars, config: FeatureConfig) -> tuple[Bars, list[Roll]]:
    """One continuous series per root (roots sorted) of per-contract `bars`, and the rolls; `bars` itself and no
    rolls when the model takes its series as they are (`config.contracts` None)."""
    cfg = config.contracts
    if cfg is None:
        return bars, []
    names, code, first_rows = _contract_codes(bars)
    root_of = _roots(bars, cfg, names, first_rows)  # [C]
    parts, offsets, volumes, roots = [np.zeros(0, np.int64)], [np.zeros(0)], [np.zeros(0)], [np.zeros(0, object)]
    rolls: list[Roll] = []
    for r in sorted(set(root_of)):
        mine = np.flatnonzero(np.array(root_of) == r)  # the root's contracts, ascending
        rows = np.flatnonzero(np.isin(code, mine))
        local = np.searchsorted(mine, code[rows])  # [n] index into the root's names
        f = front_rows(bars.timestamp_ns[rows].astype(np.int64), local, [names[c] for c in mine], bars.open[rows],
                   bars.close[rows], bars.volume[rows], cfg, config.calendar_tz, r)
        parts.append(rows[f.rows])
        offsets.append(f.log_offset)
        volumes.append(f.volume)
        roots.append(np.full(f.rows.size, r, dtype=object))
        rolls += [Roll(r, old, new, t) for old, new, t in f.rolls]
    take, log_offset = np.concatenate(parts), np.concatenate(offsets)
    out = replace(bars.take(take), symbol=np.concatenate(roots), volume=np.concatenate(volumes),
                  contract=np.array(names, dtype=object)[code[take]], log_offset=log_offset)
    return (_ratio_adjusted(out, log_offset) if cfg.adjust == "ratio" else out), rolls


def _contract_codes(bars: Bars) -> tuple[list[str], np.ndarray, list[int]]:
    """The contract names, each row's index into them (int64 [N]) and each name's first row. Bars as read come
    grouped by contract, which takes no string sort."""
    slices = bars.series_slices()
    counts = [sl.stop - sl.start for sl in slices.values()]
    if sum(counts) == len(bars):
        return list(slices), np.repeat(np.arange(len(slices)), counts), [sl.start for sl in slices.values()]
    unique, first, code = np.unique(bars.symbol.astype(str), return_index=True, return_inverse=True)
    return [str(u) for u in unique], code.reshape(-1), [int(i) for i in first]


def contract_roots(bars: Bars, cfg: ContractConfig) -> dict[str, str]:
    """Each contract of per-contract `bars` (the symbol is the contract) -> its root: the root column's label at its
    first bar when the model reads roots from a column, else the mapping file's or the name's (ContractConfig.root_of).
    ValueError (one line) names contracts that map to no root."""
    names, _, first_rows = _contract_codes(bars)
    return dict(zip(names, _roots(bars, cfg, names, first_rows), strict=True))


def _roots(bars: Bars, cfg: ContractConfig, names: list[str], first_rows: list[int]) -> list[str]:
    """Each contract's root (its first row's, for a root column); ValueError names a contract that maps to none."""
    if cfg.root_column:
        return [str(bars.labels[cfg.root_column][i]) for i in first_rows]
    mapped = [cfg.root_of(n) for n in names]
    if (bad := [n for n, m in zip(names, mapped, strict=True) if m is None]):
        raise ValueError(f"contract name(s) {', '.join(repr(b) for b in bad[:3])} name no root: contract names "
                         f"are read as {CONTRACT_PATTERN}; {ROOTS_FIX}")
    return [str(m) for m in mapped]


def _ratio_adjusted(bars: Bars, log_offset: np.ndarray) -> Bars:
    """Prices times each row's ratio, exp(log_offset) (the latest contract's unchanged); no offset left to add."""
    k = np.exp(log_offset)
    return replace(bars, open=bars.open * k, high=bars.high * k, low=bars.low * k, close=bars.close * k,
                   log_offset=None)


def known_expiries(cfg: ContractConfig, root: str) -> tuple[list[str], np.ndarray]:
    """`root`'s contracts with a known expiration (from a `--roots` file or an expiration column) and those
    expirations, in expiry order: names [C], datetime64[D] [C]."""
    pairs = sorted((day, contract) for contract, day in cfg.expirations if cfg.root_of(contract) == root)
    return [c for _, c in pairs], np.array([d for d, _ in pairs], dtype="datetime64[D]")


def rule_fronts(day: np.ndarray, cfg: ContractConfig, root: str) -> np.ndarray:
    """The `calendar:N` front of each day (datetime64[D] [m]) as an index into `known_expiries`, int64 [m]: the
    first contract with more than N weekday sessions from the day's session to its expiration; -1 where none has.
    A weekend day belongs to the weekday session after it."""
    _, expiry = known_expiries(cfg, root)
    if not expiry.size:
        return np.full(day.shape, -1, dtype=np.int64)
    session = np.busday_offset(day, 0, roll="forward")  # the weekday session of each day
    left = np.busday_count(session[:, None], expiry[None, :])  # [m, C]  weekday sessions to each expiration
    ok = left > (roll_sessions(cfg.roll) or 0)
    return np.where(ok.any(axis=1), np.argmax(ok, axis=1), -1)


def contract_known(timestamp_ns: np.ndarray, roots: np.ndarray, cfg: ContractConfig, tz: str) -> np.ndarray:
    """The known contract features of a `calendar:N` model at any bar times, float32 [..., 2]: weekday sessions from
    the bar's session to its front's expiration, and 1.0 in the first session of a new front. Both come from the
    rule and the known expirations alone, so future bars get them exactly as past ones. `timestamp_ns` int64
    [...]; `roots` str, broadcastable to it. A weekend day belongs to the weekday session after it (as in
    np.busday_count). ValueError (one line) past the last known expiration's roll."""
    ts = np.asarray(timestamp_ns, dtype=np.int64)
    flat_root, flat_ts = np.broadcast_to(np.asarray(roots).astype(str), ts.shape).reshape(-1), ts.reshape(-1)
    out = np.zeros((ts.size, 2), dtype=np.float32)  # [n, 2]
    n = roll_sessions(cfg.roll) or 0
    for r in np.unique(flat_root).tolist():
        rows = np.flatnonzero(flat_root == r)
        used, place = np.unique(cfg.sessions(flat_ts[rows], r, tz), return_inverse=True)  # [d] distinct sessions
        day = used.astype("datetime64[D]")  # [d]
        _, expiry = known_expiries(cfg, r)
        front = rule_fronts(day, cfg, r)
        if (none := np.flatnonzero(front < 0)).size:
            last = f"its last known expiration is {expiry[-1]}" if expiry.size else "none of its contracts has one"
            raise ValueError(f"root {r}: on {day[none[0]]} no contract with a known expiration has more than {n} "
                             f"sessions left (--roll {cfg.roll}; {last}); give the coming contracts' expirations in "
                             "the --roots file (contract,root,expiration) and retrain")
        before = rule_fronts(np.busday_offset(np.busday_offset(day, 0, roll="forward"), -1), cfg, r)
        out[rows, 0] = np.busday_count(day, expiry[front])[place]
        out[rows, 1] = (front != before)[place]
    return out.reshape(*ts.shape, 2)
