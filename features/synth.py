"""Sample 1-minute futures bars, deterministic per seed.

What is planted (tests/test_synth.py measures it):
* Sessions 14:30-21:00 UTC (390 one-minute bars) on weekdays, with an overnight gap at each open.
* Volatility clustering: GARCH(1,1) (alpha 0.08, beta 0.90) on a shock common to all symbols.
* U-shaped intraday volatility and volume: 0.6 + 1.6 * x^2, x from -1 at the open to +1 at the close.
* A weak, learnable signal: AR(1) log returns with coefficient 0.15 within a session.
* Correlated symbols: each shock is 0.8 common factor, 0.6 own noise.
* Consistent OHLC on the tick grid; volume a positive integer.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, date, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from features.compute import NS_PER_DAY, NS_PER_SECOND
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


def session_timestamps(n_bars: int, start: date) -> np.ndarray:
    """The first `n_bars` RTH minute timestamps (ns, UTC) from `start`'s date, weekdays only."""
    day0 = int(datetime(start.year, start.month, start.day, tzinfo=UTC).timestamp()) * NS_PER_SECOND
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


def generate(symbols: list[str], n_bars: int, seed: int, start: date | None = None,
             extra_features: int = 0) -> pa.Table:
    """Bars of every symbol on a shared session calendar. `extra_features` adds indicator columns f000, f001, ...:
    trailing means of log returns over 2..31 bars plus noise."""
    rng = np.random.default_rng(seed)
    extra_rng = np.random.default_rng(seed + 1_000_003)  # separate stream: bars do not depend on extras
    ts = session_timestamps(n_bars, start or date(2024, 1, 2))
    minute = ((ts - SESSION_OPEN_NS) % NS_PER_DAY) // (60 * NS_PER_SECOND)
    z_common = rng.standard_normal(n_bars)
    h = _garch_variance(z_common)
    extra_names = [f"f{k:03d}" for k in range(extra_features)]
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("timestamp", "symbol", "open", "high", "low",
                                                           "close", "volume", *extra_names)}
    for sym in symbols:
        bars = _symbol_bars(KNOWN_SYMBOLS.get(sym, (100.0, 0.01, 0.0005)), z_common, h, minute, rng)
        bars["timestamp"], bars["symbol"] = ts, np.full(n_bars, sym, dtype=object)
        close = bars["close"]
        for k, name in enumerate(extra_names):
            bars[name] = (_trailing_mean(np.diff(np.log(close), prepend=np.log(close[0])), 2 + k % 30) * 1e4
                          + extra_rng.standard_normal(n_bars))
        for name, values in bars.items():
            columns[name].append(values)
    return pa.table({
        "timestamp": pa.array(np.concatenate(columns["timestamp"]), type=pa.timestamp("ns", tz="UTC")),
        "symbol": pa.array(np.concatenate(columns["symbol"]).astype(str), type=pa.string()),
        **{k: pa.array(np.concatenate(columns[k])) for k in ("open", "high", "low", "close", "volume",
                                                               *extra_names)},
    })


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
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One symbol's open, high, low, close and volume; spec is (start price, tick size, base volatility)."""
    price0, tick, base_vol = spec
    n_bars = z_common.shape[0]
    shape, session_start = intraday_shape(minute), minute == 0
    z = COMMON_WEIGHT * z_common + np.sqrt(1 - COMMON_WEIGHT**2) * rng.standard_normal(n_bars)
    sigma = base_vol * shape * np.sqrt(h)  # [N]
    gaps = np.where(session_start, rng.standard_normal(n_bars) * base_vol * 8.0, 0.0)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m features.synth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="parquet file to write")
    p.add_argument("--symbols", default="ES,NQ", help="comma-separated symbols (default ES,NQ)")
    p.add_argument("--bars", type=int, default=20000, help="bars per symbol (default 20000)")
    p.add_argument("--seed", type=int, default=7, help="random seed: the same seed writes the same bars (default 7)")
    p.add_argument("--start", type=date.fromisoformat, default=date(2024, 1, 2),
                   help="first session date, YYYY-MM-DD (UTC; default 2024-01-02)")
    p.add_argument("--extra-features", type=int, default=0, metavar="N",
                   help="also write N numeric indicator columns f000..f{N-1} (e.g. 220 for the production preset)")
    args = p.parse_args(argv)
    symbols = [s.strip() for s in args.symbols.split(",") if s.strip()]
    if not symbols:
        p.error("--symbols: give at least one symbol, e.g. --symbols ES,NQ")
    if args.bars < 1:
        p.error("--bars must be at least 1")
    if args.extra_features < 0:
        p.error("--extra-features must be >= 0")
    if args.out.is_dir():
        p.error(f"--out {args.out} is a directory; give the parquet file's name, e.g. {args.out / 'bars.parquet'}")
    table = generate(symbols, args.bars, args.seed, args.start, args.extra_features)
    with atomic_output(args.out) as tmp:
        pq.write_table(table, tmp)
    print(f"wrote {table.num_rows} bars ({len(symbols)} symbols x {args.bars}) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
