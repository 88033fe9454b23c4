"""Per-contract futures bars for the tests of a model trained on contracts: a root's contracts (legs), each traded
over some sessions with heavy volume in its front ones, so that the volume roll picks known fronts.

Shared by the contract serving tests and the shared contracts model of tests.live_server (which the request fuzz
also serves); it imports nothing of either, so both can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from features.bars import Bars
from features.calendar import NS_PER_DAY
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.wire import make_series

MINUTE = 60_000_000_000
MONDAY = int(np.datetime64("2025-03-03", "ns").astype(np.int64))
GAP = 0.03  # each contract 3% over the one before


@dataclass(frozen=True)
class Leg:
    """One contract's trading: sessions [first, last], heavy volume in sessions [heavy_from, heavy_to)."""

    name: str
    first: int
    last: int
    heavy_from: int
    heavy_to: int


ES_LEGS = (Leg("ESH5", 0, 11, 0, 10), Leg("ESM5", 8, 31, 10, 28), Leg("ESU5", 26, 31, 28, 32))
NQ_LEGS = (Leg("NQH5", 0, 11, 0, 10), Leg("NQM5", 8, 19, 10, 20))
ROLL_SESSION = 29  # ESU5 outvolumes ESM5 in session 28: the front from session 29's first bar
LIVE_PER_DAY = 60  # bars per session of the live model's bars
TRAIN_SESSIONS = 20  # sessions 0..19: ESH5 -> ESM5 and NQH5 -> NQM5; ESU5 trades from session 26


def session_start(s: int) -> int:
    """UTC ns of weekday session s's first bar (14:00 UTC), sessions counted from Monday 2025-03-03."""
    return MONDAY + (s // 5 * 7 + s % 5) * NS_PER_DAY + 14 * 3_600_000_000_000


def contract_rows(legs: tuple[Leg, ...], per_day: int, seed: int, base: float) -> dict[str, np.ndarray]:
    """Per-contract one-minute bars of one root, time order (contracts of one timestamp by name): one price path,
    contract k priced (1 + GAP)^k over it, volume heavy in each contract's front sessions."""
    rng = np.random.default_rng(seed)
    sessions = max(leg.last for leg in legs) + 1
    ts = np.concatenate([session_start(s) + MINUTE * np.arange(per_day) for s in range(sessions)])  # [S * per_day]
    path = base * np.exp(np.cumsum(rng.normal(0, 1e-3, ts.size)))
    rows: dict[str, list[object]] = {k: [] for k in ("ts_event", "symbol", "open", "high", "low", "close", "volume")}
    for j in range(ts.size):
        s = j // per_day
        for k, leg in enumerate(legs):
            if not leg.first <= s <= leg.last:
                continue
            c, o = path[j] * (1 + GAP) ** k, path[max(j - 1, 0)] * (1 + GAP) ** k
            heavy = leg.heavy_from <= s < leg.heavy_to
            for key, value in zip(rows, (ts[j], leg.name, o, max(o, c) * 1.0005, min(o, c) * 0.9995, c,
                                         rng.uniform(0.5, 1.5) * (2000 if heavy else 100)), strict=True):
                rows[key].append(value)
    return {k: np.array(v, dtype=object if k == "symbol" else None) for k, v in rows.items()}


def as_bars(rows: dict[str, np.ndarray], keep: np.ndarray | None = None) -> Bars:
    """The rows (those of `keep`, a mask or indices) as Bars with the contract names as symbols."""
    k = slice(None) if keep is None else keep
    o, h, lo, c, v = (rows[name][k].astype(np.float64) for name in ("open", "high", "low", "close", "volume"))
    return Bars(rows["ts_event"][k].astype(np.int64), rows["symbol"][k], o, h, lo, c, v)


def request_series(symbol: str, bars: Bars, contracts: bool) -> pb.Series:
    """The bars as one request series named `symbol`, with each bar's contract (the bars' symbol) or without."""
    return make_series(symbol, bars.timestamp_ns, bars.open, bars.high, bars.low, bars.close, bars.volume,
                       contracts=bars.symbol if contracts else None)


def window_rows(rows: dict[str, np.ndarray], per_day: int, last_bar: int) -> np.ndarray:
    """Rows of sessions ROLL_SESSION - 2 .. ROLL_SESSION, up to bar `last_bar` of the roll session: enough sessions
    before the roll for the volume rule to pick the fronts training picked."""
    ts = rows["ts_event"].astype(np.int64)
    return np.flatnonzero((ts >= session_start(ROLL_SESSION - 2))
                          & (ts <= session_start(ROLL_SESSION) + last_bar * MINUTE))


def write_training_bars(path: Path, es: dict[str, np.ndarray], nq: dict[str, np.ndarray]) -> None:
    """ES's and NQ's per-contract bars of the training sessions, Databento-like columns (ts_event, symbol)."""
    early = es["ts_event"].astype(np.int64) < session_start(TRAIN_SESSIONS)
    rows = {k: np.concatenate([es[k][early], nq[k]]) for k in es}
    pq.write_table(pa.table({
        "ts_event": pa.array(rows["ts_event"].astype(np.int64)).cast(pa.timestamp("ns", tz="UTC")),
        **{k: pa.array(rows[k].tolist()) for k in ("symbol", "open", "high", "low", "close", "volume")}}), path)
