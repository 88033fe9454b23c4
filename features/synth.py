"""Sample 1-minute futures bars, deterministic per seed.

What is planted (tests/test_synth.py measures it):
* Sessions 14:30-21:00 UTC (390 one-minute bars) on weekdays, with an overnight gap at each open.
* Volatility clustering: GARCH(1,1) (alpha 0.08, beta 0.90) on a shock common to all symbols.
* U-shaped intraday volatility and volume: 0.6 + 1.6 * x^2, x from -1 at the open to +1 at the close.
* A weak, learnable signal: AR(1) log returns with coefficient 0.15 within a session.
* Correlated symbols: each shock is 0.8 common factor, 0.6 own noise.
* Consistent OHLC on the tick grid; volume a positive integer.

Covariates, each only when asked for (`Covariates`; without them the bars are exactly as above):
* A scheduled event (`--event 15:00`): a 0/1 column set on the event bar at those times of day, on every
  `--event-every` Nth session from the first. Volatility is x4 (`--event-jump`) on the event bar and decays back
  with an e-folding of 3 bars (x1.1 ten bars on), within the session.
* A static volatility scale (`--vol-scale`): one value per symbol, 0.5 to 2 geometrically spaced in the order
  the symbols are given, that multiplies the symbol's volatility (its overnight gaps included).
* A volatility regime (`--regime`): "calm" (volatility x0.7) and "volatile" (x1.4), common to all symbols,
  alternating every `--regime-sessions` sessions, starting calm.
* The symbol's exchange (`--exchange`): a static label ("CME", "NYMEX", "COMEX", else "OTHER") with no effect.
The random draws are the same with or without covariates: they scale the same shocks.

Per-contract futures bars (`--contracts`, `generate_contracts`), laid out as Databento's ohlcv-1m: columns
ts_event (bar start), rtype (33), publisher_id (1), instrument_id (one per contract, the same in every file),
open, high, low, close, volume and symbol (the raw contract name), rows in ts_event then instrument_id order:
* Each `--symbols` name is a root with quarterly contracts H, M, U, Z, named root + month code + 1-digit year
  (ESH4). A contract expires on the third Friday of its month at 13:30 UTC, so its last bars are the day before.
* One price path per root, drawn exactly as the plain bars of that symbol; a contract's prices are that path
  times (1 + `--roll-gap`) ** k, k counting the root's contracts in the file from 0, on the tick grid: each
  contract trades `--roll-gap` (default 0.01) above the one before it at the same minute.
* Overlapping trading: a contract trades from 10 sessions before the previous contract's expiry to its own. Of
  the root's volume it takes 2% for the first 5 of those sessions, then 10%, 30%, 60%, 80%, 90% in the 5
  sessions of the roll week, the front the rest: the next contract's volume first exceeds the front's in the
  third session before the front's expiry. Deferred bars whose volume rounds to 0 are left out.
* With `--expiration-col NAME`, a column holding each contract's expiration (timestamp, UTC).
"""

from __future__ import annotations

import argparse
import re
import sys
import zlib
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from features.calendar import NS_PER_DAY, NS_PER_SECOND
from features.contracts import MONTH_CODES
from features.files import atomic_output

SESSION_OPEN_NS = (14 * 3600 + 30 * 60) * NS_PER_SECOND  # 14:30 UTC
SESSION_BARS = 390  # one-minute bars to 21:00 UTC
AR_COEF = 0.15
GARCH_ALPHA, GARCH_BETA = 0.08, 0.90
COMMON_WEIGHT = 0.8
KNOWN_SYMBOLS: dict[str, tuple[float, float, float]] = {
    # symbol: (start price, tick size, per-minute volatility at the session's quietest)
    "ES": (4500.0, 0.25, 0.0004),
    "NQ": (15500.0, 0.25, 0.0005),
    "CL": (75.0, 0.01, 0.0007),
    "GC": (2000.0, 0.1, 0.0003),
}
OTHER_SYMBOL = (100.0, 0.01, 0.0005)  # (start price, tick size, volatility) of a symbol not in KNOWN_SYMBOLS
EXCHANGES = {"ES": "CME", "NQ": "CME", "CL": "NYMEX", "GC": "COMEX"}  # others: "OTHER"
EVENT_JUMP = 4.0  # volatility multiplier on the event bar
EVENT_DECAY_BARS = 3.0  # e-folding of the jump, in bars
EVENT_TAIL_BARS = 30  # bars the jump lasts: past them it is below 1e-4
REGIME_VOL = {"calm": 0.7, "volatile": 1.4}  # volatility multiplier per regime label
VOL_SCALE_RANGE = (0.5, 2.0)  # the first and the last symbol's volatility scale
DEFAULT_START = date(2024, 1, 2)  # the first session: a Tuesday early in a quarter (contracts H4, M4, ...)
EXPIRY_NS = (13 * 3600 + 30 * 60) * NS_PER_SECOND  # 13:30 UTC on the expiry day
LEAD_SESSIONS = 10  # a contract trades from this many sessions before the previous contract's expiry
ROLL_SHARES = (0.1, 0.3, 0.6, 0.8, 0.9)  # the next contract's volume share 5, 4, 3, 2, 1 sessions before expiry
DEFERRED_SHARE = 0.02  # its share in the sessions before the roll week
ROLL_GAP = 0.01  # each contract's prices are (1 + ROLL_GAP) times the previous contract's
PRICES = ("open", "high", "low", "close")
CONTRACT_COLUMNS = ("ts_event", "rtype", "publisher_id", "instrument_id", *PRICES, "volume", "symbol")
RTYPE_OHLCV_1M = 33  # Databento's record type of 1-minute OHLCV bars
PUBLISHER_ID = 1  # Databento's CME Globex MDP 3.0 publisher


@dataclass(frozen=True)
class Covariates:
    """Optional planted inputs and their column names; the defaults plant none."""

    event_times: tuple[str, ...] = ()  # bar start times "HH:MM" (UTC) of the scheduled event; () no event
    event_every: int = 1  # the event falls on every Nth session, the first included
    event_column: str = "event"  # 0/1 int8 column: 1 on the event bar
    event_jump: float = EVENT_JUMP  # volatility multiplier on the event bar
    vol_scale_column: str | None = None  # float64 column: the symbol's volatility multiplier; None no column
    regime_column: str | None = None  # string column "calm"/"volatile"; None no regime
    regime_sessions: int = 5  # sessions per regime before it switches
    exchange_column: str | None = None  # string column: the symbol's exchange; None no column

    @property
    def columns(self) -> list[str]:
        """The columns these covariates add, in the order they are written."""
        names = [self.event_column if self.event_times else None, self.vol_scale_column, self.regime_column,
                 self.exchange_column]
        return [n for n in names if n is not None]


def event_minute(text: str) -> int:
    """The minute of the session of a bar start time "HH:MM" (UTC); ValueError outside the session."""
    if (hh_mm := re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", text.strip())) is None:
        raise ValueError(f"event time {text!r}: give a time of day as HH:MM (UTC), e.g. 15:00")
    minute = int(hh_mm[1]) * 60 + int(hh_mm[2]) - SESSION_OPEN_NS // (60 * NS_PER_SECOND)
    if not 0 <= minute < SESSION_BARS:
        raise ValueError(f"event time {text!r}: sessions run 14:30-21:00 UTC; give a bar start from 14:30 to "
                         "20:59, e.g. 15:00")
    return minute


def session_timestamps(n_bars: int, start: date) -> np.ndarray:
    """The first `n_bars` RTH minute timestamps (ns, UTC) from `start`'s date, weekdays only."""
    day0 = int(np.datetime64(start, "D").astype(np.int64)) * NS_PER_DAY
    n_days_needed = n_bars // SESSION_BARS + 1
    days = day0 + np.arange(n_days_needed * 7 // 5 + 7, dtype=np.int64) * NS_PER_DAY
    weekday = (days // NS_PER_DAY + 3) % 7  # Monday = 0
    days = days[weekday < 5][:n_days_needed]
    minutes = np.arange(SESSION_BARS, dtype=np.int64) * 60 * NS_PER_SECOND
    return (days[:, None] + SESSION_OPEN_NS + minutes[None, :]).reshape(-1)[:n_bars]


def intraday_shape(minute_of_session: np.ndarray) -> np.ndarray:
    """U-shaped multiplier of volatility and volume over the session."""
    x = (minute_of_session - (SESSION_BARS - 1) / 2) / ((SESSION_BARS - 1) / 2)  # -1 .. 1
    return np.asarray(0.6 + 1.6 * x * x)


def vol_scales(symbols: list[str]) -> dict[str, float]:
    """Each symbol's volatility multiplier: VOL_SCALE_RANGE geometrically spaced in the order given."""
    lo, hi = np.log2(VOL_SCALE_RANGE)
    steps = np.linspace(lo, hi, len(symbols)) if len(symbols) > 1 else np.zeros(1)
    return {s: float(2.0 ** v) for s, v in zip(symbols, steps, strict=True)}


def generate(symbols: list[str], n_bars: int, seed: int, start: date | None = None,
             extra_features: int = 0, covariates: Covariates | None = None) -> pa.Table:
    """Bars of every symbol on a shared session calendar. `extra_features` adds indicator columns f000, f001, ...:
    trailing means of log returns over 2..31 bars plus noise. `covariates` adds its columns after those."""
    cov = covariates or Covariates()
    extra_names = [f"f{k:03d}" for k in range(extra_features)]
    taken = ["timestamp", "symbol", "open", "high", "low", "close", "volume", *extra_names]
    if len({*taken, *cov.columns}) < len(taken) + len(cov.columns):
        raise ValueError(f"covariate columns {cov.columns}: give each a name of its own, not one of the bars' "
                         "columns or another covariate's")
    rng = np.random.default_rng(seed)
    extra_rng = np.random.default_rng(seed + 1_000_003)  # separate stream: bars do not depend on extras
    ts = session_timestamps(n_bars, start or DEFAULT_START)
    minute = ((ts - SESSION_OPEN_NS) % NS_PER_DAY) // (60 * NS_PER_SECOND)
    session = np.unique(ts // NS_PER_DAY, return_inverse=True)[1].reshape(-1)  # [N] session number from 0
    z_common = rng.standard_normal(n_bars)
    h = _garch_variance(z_common)
    shared, boost = _shared_covariates(cov, minute, session)
    scales = vol_scales(symbols)
    parts: list[dict[str, np.ndarray]] = []
    for sym in symbols:
        price0, tick, base_vol = KNOWN_SYMBOLS.get(sym, OTHER_SYMBOL)
        if cov.vol_scale_column is not None:
            base_vol *= scales[sym]
        bars = _symbol_bars((price0, tick, base_vol), z_common, h, minute, rng, boost)
        bars = {"timestamp": ts, "symbol": np.full(n_bars, sym, dtype=object), **bars}
        close = bars["close"]
        for k, name in enumerate(extra_names):
            bars[name] = (_trailing_mean(np.diff(np.log(close), prepend=np.log(close[0])), 2 + k % 30) * 1e4
                          + extra_rng.standard_normal(n_bars))
        parts.append({**bars, **shared, **_static_covariates(cov, sym, scales[sym], n_bars)})
    return _to_table(parts, [*taken, *cov.columns])


def _shared_covariates(cov: Covariates, minute: np.ndarray,
                       session: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The columns common to all symbols (event flag, regime label) and their volatility multiplier [N]; None
    when there are none."""
    out: dict[str, np.ndarray] = {}
    boost = np.ones(minute.shape[0])
    if cov.event_times:
        event = (session % cov.event_every == 0) & np.isin(minute, [event_minute(t) for t in cov.event_times])
        out[cov.event_column] = event.astype(np.int8)
        boost *= _event_multiplier(event, minute, cov.event_jump)
    if cov.regime_column is not None:
        regime = (session // cov.regime_sessions) % 2  # [N] index into REGIME_VOL, calm first
        out[cov.regime_column] = np.array(list(REGIME_VOL), dtype=object)[regime]
        boost *= np.array(list(REGIME_VOL.values()))[regime]
    return out, boost if out else None


def _event_multiplier(event: np.ndarray, minute: np.ndarray, jump: float) -> np.ndarray:
    """Volatility multiplier [N]: 1 + (jump - 1) * exp(-k / EVENT_DECAY_BARS) per event k bars back, same session."""
    out = np.ones(event.shape[0])
    for k in range(min(EVENT_TAIL_BARS, event.shape[0])):
        back = np.zeros_like(event)
        back[k:] = event[:event.shape[0] - k] & (minute[k:] >= k)  # the event k bars back, same session
        out += (jump - 1.0) * np.exp(-k / EVENT_DECAY_BARS) * back
    return out


def _static_covariates(cov: Covariates, symbol: str, scale: float, n_bars: int) -> dict[str, np.ndarray]:
    """The symbol's constant columns: volatility scale and exchange, when asked for."""
    out: dict[str, np.ndarray] = {}
    if cov.vol_scale_column is not None:
        out[cov.vol_scale_column] = np.full(n_bars, scale)
    if cov.exchange_column is not None:
        out[cov.exchange_column] = np.full(n_bars, EXCHANGES.get(symbol, "OTHER"), dtype=object)
    return out


def _to_table(parts: list[dict[str, np.ndarray]], names: list[str]) -> pa.Table:
    """One table of the symbols' columns, symbol after symbol; text columns as strings."""
    def column(name: str) -> pa.Array:
        values = np.concatenate([p[name] for p in parts])
        if name == "timestamp":
            return pa.array(values, type=pa.timestamp("ns", tz="UTC"))
        return pa.array(values.astype(str), type=pa.string()) if values.dtype == object else pa.array(values)

    return pa.table({name: column(name) for name in names})


def _garch_variance(z_common: np.ndarray) -> np.ndarray:
    """GARCH(1,1) variance driven by the common shock, in units of each symbol's base volatility: [N]."""
    h = np.empty(z_common.shape[0])
    h_prev, eps_prev = 1.0, 0.0
    omega = 1.0 - GARCH_ALPHA - GARCH_BETA
    for t in range(z_common.shape[0]):
        h_prev = omega + GARCH_ALPHA * eps_prev * eps_prev + GARCH_BETA * h_prev
        h[t] = h_prev
        eps_prev = np.sqrt(h_prev) * z_common[t]
    return h


def _symbol_bars(spec: tuple[float, float, float], z_common: np.ndarray, h: np.ndarray, minute: np.ndarray,
                 rng: np.random.Generator, boost: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One symbol's open, high, low, close and volume; spec is (start price, tick size, base volatility);
    boost [N] multiplies the volatility of each bar (its gap included)."""
    price0, tick, base_vol = spec
    n_bars = z_common.shape[0]
    shape, session_start = intraday_shape(minute), minute == 0
    z = COMMON_WEIGHT * z_common + np.sqrt(1 - COMMON_WEIGHT**2) * rng.standard_normal(n_bars)
    sigma = base_vol * shape * np.sqrt(h)  # [N]
    gaps = np.where(session_start, rng.standard_normal(n_bars) * base_vol * 8.0, 0.0)
    if boost is not None:
        sigma, gaps = sigma * boost, gaps * boost
    r = _ar1(sigma * z, session_start)
    log_p = np.log(price0) + np.cumsum(r + gaps)
    close = np.round(np.exp(log_p) / tick) * tick
    open_ = np.round(np.exp(log_p - r) / tick) * tick  # open = close before this bar's return (after any gap)
    open_[~session_start] = close[np.flatnonzero(~session_start) - 1]
    ext_hi = np.abs(rng.standard_normal(n_bars)) * 0.5 * sigma
    ext_lo = np.abs(rng.standard_normal(n_bars)) * 0.5 * sigma
    high = np.maximum(np.ceil(np.maximum(open_, close) * np.exp(ext_hi) / tick) * tick, np.maximum(open_, close))
    low = np.minimum(np.floor(np.minimum(open_, close) * np.exp(-ext_lo) / tick) * tick, np.minimum(open_, close))
    volume = np.maximum(1, np.round(2000 * shape * np.exp(0.3 * np.abs(z) + 0.3 * rng.standard_normal(n_bars))
                                    * np.sqrt(h))).astype(np.int64)
    return {"open": open_, "high": high, "low": low, "close": close, "volume": volume}


def _trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean of x over the last `window` values (fewer at the start); uses values <= t only."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, x.shape[0] + 1)
    lo = np.maximum(0, idx - window)
    return np.asarray((c[idx] - c[lo]) / (idx - lo))


def _ar1(shocks: np.ndarray, reset: np.ndarray) -> np.ndarray:
    """r[t] = AR_COEF * r[t-1] + shocks[t], restarting at every session open."""
    r = np.empty_like(shocks)
    prev = 0.0
    for t in range(shocks.shape[0]):
        prev = shocks[t] + (0.0 if reset[t] else AR_COEF * prev)
        r[t] = prev
    return r


def contract_name(root: str, year: int, month: int) -> str:
    """The raw contract symbol: root + month code + the year's last digit, e.g. ESH5."""
    return f"{root}{MONTH_CODES[month - 1]}{year % 10}"


def expiry_date(year: int, month: int) -> date:
    """The third Friday of the month, when a quarterly equity index future expires."""
    first_friday = 1 + (4 - date(year, month, 1).weekday()) % 7
    return date(year, month, first_friday + 14)


def instrument_id(root: str, year: int, month: int) -> int:
    """A contract's instrument id: the same in every file, whatever the start or the other roots."""
    return zlib.crc32(f"{root} {year:04d}-{month:02d}".encode())


def quarterly_contracts(first: date, last: date) -> list[tuple[int, int]]:
    """(year, month) of the quarterly contracts trading between sessions `first` and `last`: the front at `first`,
    then each next one whose trading starts (LEAD_SESSIONS before the one before expires) by `last`."""
    year, month = first.year, (first.month - 1) // 3 * 3 + 3
    if expiry_date(year, month) <= first:
        year, month = (year + 1, 3) if month == 12 else (year, month + 3)
    out = [(year, month)]
    while np.busday_offset(expiry_date(*out[-1]), -LEAD_SESSIONS) <= np.datetime64(last):
        year, month = out[-1]
        out.append((year + 1, 3) if month == 12 else (year, month + 3))
    return out


def next_share(sessions_left: np.ndarray) -> np.ndarray:
    """The next contract's share of the root's volume [N], given the sessions left to the front's expiry [N]
    (1 on its last session): ROLL_SHARES in the roll week, DEFERRED_SHARE in the LEAD_SESSIONS before it."""
    roll = np.asarray(ROLL_SHARES)[np.clip(len(ROLL_SHARES) - sessions_left, 0, len(ROLL_SHARES) - 1)]
    share = np.where(sessions_left <= LEAD_SESSIONS, DEFERRED_SHARE, 0.0)
    return np.asarray(np.where((sessions_left >= 1) & (sessions_left <= len(ROLL_SHARES)), roll, share))


def contract_shares(days: np.ndarray, contracts: list[tuple[int, int]]) -> np.ndarray:
    """Each contract's share of the root's volume on each bar's day (datetime64[D] [N]): [C, N], 0 where it does
    not trade. A contract is the front from the previous one's expiry to its own; before that it is the next."""
    expiry = [np.datetime64(expiry_date(*c)) for c in contracts]
    shares = np.zeros((len(contracts), days.shape[0]))
    for k in range(len(contracts)):
        as_front = 1.0 - next_share(np.busday_count(days, expiry[k]))
        if k == 0:
            shares[k] = as_front
            continue
        as_next = next_share(np.busday_count(days, expiry[k - 1]))
        shares[k] = np.where(days >= expiry[k - 1], as_front, as_next)
    return np.where(days[None, :] < np.asarray(expiry)[:, None], shares, 0.0)


def generate_contracts(roots: list[str], n_bars: int, seed: int, start: date | None = None,
                       roll_gap: float = ROLL_GAP, expiration_column: str | None = None) -> pa.Table:
    """Per-contract bars of each root over its first `n_bars` session minutes, Databento ohlcv-1m columns; the
    roots' price paths are `generate(roots, n_bars, seed, start)`'s; `expiration_column` adds the expirations."""
    if expiration_column in CONTRACT_COLUMNS:
        raise ValueError(f"--expiration-col {expiration_column}: give a name of its own, not one of the bars' "
                         "columns, e.g. expiration")
    underlying = generate(roots, n_bars, seed, start)
    ts = underlying.column("timestamp").cast(pa.int64()).to_numpy()[:n_bars]  # [N] the same for every root
    days = (ts // NS_PER_DAY).astype("datetime64[D]")
    contracts = quarterly_contracts(days[0].item(), days[-1].item())
    shares = contract_shares(days, contracts)  # [C, N]
    parts = []
    for i, root in enumerate(roots):
        bars = {k: underlying.column(k).to_numpy()[i * n_bars:(i + 1) * n_bars] for k in (*PRICES, "volume")}
        parts += [_contract_part(root, c, ts, bars, (shares[k], (1.0 + roll_gap) ** k))
                  for k, c in enumerate(contracts)]
    columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((columns["instrument_id"], columns["ts_event"]))  # [M] by time, then instrument
    return _contract_table({k: v[order] for k, v in columns.items()}, expiration_column)


def _contract_part(root: str, contract: tuple[int, int], ts: np.ndarray, bars: dict[str, np.ndarray],
                   share_factor: tuple[np.ndarray, float]) -> dict[str, np.ndarray]:
    """One contract's rows: the root's prices [N] times its carry factor, on the tick grid, and its share [N] of
    the root's volume; bars whose volume rounds to 0 are left out, except in the front and the roll week."""
    share, factor = share_factor
    tick = KNOWN_SYMBOLS.get(root, OTHER_SYMBOL)[1]
    volume = np.round(bars["volume"] * share)
    volume = np.where(share > DEFERRED_SHARE, np.maximum(volume, 1), volume)
    rows = volume > 0
    out = {k: np.round(bars[k][rows] * factor / tick) * tick for k in PRICES}
    expiration = int(np.datetime64(expiry_date(*contract), "D").astype(np.int64)) * NS_PER_DAY + EXPIRY_NS
    n = int(rows.sum())
    return {"ts_event": ts[rows], "instrument_id": np.full(n, instrument_id(root, *contract), dtype=np.uint32),
            **out, "volume": volume[rows].astype(np.uint64),
            "symbol": np.full(n, contract_name(root, *contract), dtype=object),
            "expiration": np.full(n, expiration, dtype=np.int64)}


def _contract_table(columns: dict[str, np.ndarray], expiration_column: str | None) -> pa.Table:
    """The Databento-like table of the sorted rows."""
    n = columns["ts_event"].shape[0]
    utc = pa.timestamp("ns", tz="UTC")
    table = {"ts_event": pa.array(columns["ts_event"], type=utc),
             "rtype": pa.array(np.full(n, RTYPE_OHLCV_1M, dtype=np.uint8)),
             "publisher_id": pa.array(np.full(n, PUBLISHER_ID, dtype=np.uint16)),
             "instrument_id": pa.array(columns["instrument_id"]),
             **{k: pa.array(columns[k]) for k in PRICES}, "volume": pa.array(columns["volume"]),
             "symbol": pa.array(columns["symbol"].astype(str), type=pa.string())}
    if expiration_column is not None:
        table[expiration_column] = pa.array(columns["expiration"], type=utc)
    return pa.table(table)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m features.synth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="parquet file to write")
    p.add_argument("--symbols", default="ES,NQ", help="comma-separated symbols (default ES,NQ)")
    p.add_argument("--bars", type=int, default=20000, help="bars per symbol (default 20000)")
    p.add_argument("--seed", type=int, default=7, help="random seed: the same seed writes the same bars (default 7)")
    p.add_argument("--start", type=date.fromisoformat, default=DEFAULT_START,
                   help=f"first session date, YYYY-MM-DD (UTC; default {DEFAULT_START})")
    p.add_argument("--extra-features", type=int, default=0, metavar="N",
                   help="also write N numeric indicator columns f000..f{N-1} (e.g. 220 for the production preset)")
    c = p.add_argument_group("covariates (each adds a column; none by default)")
    c.add_argument("--event", default="", metavar="HH:MM[,HH:MM]",
                   help="plant a scheduled event at these bar start times (UTC), e.g. 15:00: a 0/1 column set on "
                        "the event bar, after which volatility jumps (--event-jump) and decays over ~10 bars")
    c.add_argument("--event-every", type=int, default=1, metavar="N",
                   help="the event falls on every Nth session from the first (default 1: every session; an N that "
                        "is not a multiple of 5 picks days that no weekday pattern predicts)")
    c.add_argument("--event-jump", type=float, default=EVENT_JUMP, metavar="X",
                   help=f"volatility multiplier on the event bar (default {EVENT_JUMP:g})")
    c.add_argument("--event-column", default="event", metavar="NAME", help="the event column's name (default event)")
    c.add_argument("--vol-scale", nargs="?", const="vol_scale", metavar="NAME",
                   help="a static real per symbol, 0.5 to 2 in --symbols order, that multiplies its volatility "
                        "(column NAME, default vol_scale)")
    c.add_argument("--regime", nargs="?", const="regime", metavar="NAME",
                   help="a label 'calm' (volatility x0.7) or 'volatile' (x1.4), alternating every "
                        "--regime-sessions sessions (column NAME, default regime)")
    c.add_argument("--regime-sessions", type=int, default=5, metavar="N", help="sessions per regime (default 5)")
    c.add_argument("--exchange", nargs="?", const="exchange", metavar="NAME",
                   help="a static label per symbol, its exchange, with no effect (column NAME, default exchange)")
    f = p.add_argument_group("futures contracts (per-contract bars, Databento ohlcv-1m columns)")
    f.add_argument("--contracts", action="store_true",
                   help="write each root's quarterly contracts (ESH4, ESM4, ...) with overlapping trading around "
                        "each roll, instead of one series per symbol: --symbols are the roots, --bars the minutes "
                        "per root")
    f.add_argument("--roll-gap", type=float, metavar="X",
                   help=f"each contract trades X above the previous one, relatively (default {ROLL_GAP:g})")
    f.add_argument("--expiration-col", metavar="NAME",
                   help="also write each contract's expiration (third Friday, 13:30 UTC) in column NAME")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    symbols = [s.strip() for s in args.symbols.split(",") if s.strip()]
    if not symbols:
        p.error("--symbols: give at least one symbol, e.g. --symbols ES,NQ")
    for flag, value, least in (("--bars", args.bars, 1), ("--extra-features", args.extra_features, 0)):
        if value < least:
            p.error(f"{flag} must be at least {least}")
    if not args.contracts and (args.roll_gap is not None or args.expiration_col is not None):
        p.error("--roll-gap and --expiration-col shape per-contract bars: add --contracts")
    if args.out.is_dir():
        p.error(f"--out {args.out} is a directory; give the parquet file's name, e.g. {args.out / 'bars.parquet'}")
    if args.contracts:
        return _write_contracts(p, args, symbols)
    for flag, value in (("--event-every", args.event_every), ("--regime-sessions", args.regime_sessions)):
        if value < 1:
            p.error(f"{flag} must be at least 1")
    if not args.event_jump > 0:
        p.error("--event-jump must be positive, e.g. 4")
    try:
        covariates = Covariates(
            event_times=tuple(t for t in args.event.split(",") if t.strip()), event_every=args.event_every,
            event_column=args.event_column, event_jump=args.event_jump, vol_scale_column=args.vol_scale,
            regime_column=args.regime, regime_sessions=args.regime_sessions, exchange_column=args.exchange)
        table = generate(symbols, args.bars, args.seed, args.start, args.extra_features, covariates)
    except ValueError as exc:
        p.error(f"--event: {exc}" if str(exc).startswith("event time") else str(exc))
    with atomic_output(args.out) as tmp:
        pq.write_table(table, tmp)
    added = f"; covariates: {', '.join(covariates.columns)}" if covariates.columns else ""
    print(f"wrote {table.num_rows} bars ({len(symbols)} symbols x {args.bars}){added} to {args.out}", file=sys.stderr)
    return 0


def _write_contracts(p: argparse.ArgumentParser, args: argparse.Namespace, roots: list[str]) -> int:
    """`--contracts`: the per-contract bars of the roots."""
    if args.extra_features or args.event or args.vol_scale or args.regime or args.exchange:
        p.error("--contracts writes bars without covariates or --extra-features; drop those flags or --contracts")
    gap = ROLL_GAP if args.roll_gap is None else args.roll_gap
    if not gap > -1:
        p.error(f"--roll-gap {gap:g}: give a relative gap above -1, e.g. 0.01 (1%)")
    try:
        table = generate_contracts(roots, args.bars, args.seed, args.start, gap, args.expiration_col)
    except ValueError as exc:
        p.error(str(exc))
    with atomic_output(args.out) as tmp:
        pq.write_table(table, tmp)
    first_seen = dict.fromkeys(table.column("symbol").to_pylist())  # each root's contracts in time order
    names = sorted(first_seen, key=lambda name: name[:-2])  # by root, stable
    print(f"wrote {table.num_rows} bars of {len(names)} contracts ({', '.join(names)}) for {len(roots)} "
          f"roots x {args.bars} minutes to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
