"""The sample-data generator's stated properties, measured from its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from features import read_bars
from features.synth import KNOWN_SYMBOLS, SESSION_BARS, generate

NS_PER_MINUTE = 60 * 10**9
NS_PER_DAY = 86_400 * 10**9
OPEN_MINUTE_OF_DAY = 14 * 60 + 30
N_BARS = 20_000  # per symbol: 51 sessions, enough for the statistics below


class Series:
    """One symbol's bars and its within-session one-minute log returns."""

    def __init__(self, table: pa.Table, symbol: str) -> None:
        rows = pc.equal(table.column("symbol"), symbol)
        t = table.filter(rows)
        self.ts = t.column("timestamp").cast(pa.int64()).to_numpy()
        self.open, self.high, self.low, self.close = (t.column(k).to_numpy() for k in ("open", "high", "low",
                                                                                         "close"))
        self.volume = t.column("volume").to_numpy()
        self.minute_of_day = (self.ts % NS_PER_DAY) // NS_PER_MINUTE
        self.minute = self.minute_of_day - OPEN_MINUTE_OF_DAY  # minute of the session, 0 .. 389
        ret = np.diff(np.log(self.close))  # return of bar i (i >= 1): close[i-1] -> close[i]
        self.ret = np.concatenate([[np.nan], ret])
        self.ret[self.minute == 0] = np.nan  # the session's first bar carries the overnight gap


def corr(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    return float(np.corrcoef(a[ok], b[ok])[0, 1])


def lag_corr(x: np.ndarray, lag: int) -> float:
    return corr(x[lag:], x[:-lag])  # pairs across a session break contain a NaN and drop out


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return generate(["ES", "NQ"], N_BARS, seed=11)


@pytest.fixture(scope="module")
def es(table: pa.Table) -> Series:
    return Series(table, "ES")


@pytest.fixture(scope="module")
def nq(table: pa.Table) -> Series:
    return Series(table, "NQ")


def test_seed_determinism() -> None:
    a = generate(["ES", "CL"], 1500, seed=3)
    b = generate(["ES", "CL"], 1500, seed=3)
    c = generate(["ES", "CL"], 1500, seed=4)
    assert a.equals(b)
    assert not a.column("close").equals(c.column("close"))
    assert a.column("timestamp").equals(c.column("timestamp"))  # same calendar, other prices
    assert a.num_rows == 3000 and a.column_names == ["timestamp", "symbol", "open", "high", "low", "close",
                                                     "volume"]
    assert a.schema.field("timestamp").type == pa.timestamp("ns", tz="UTC")


def test_ohlc_consistent_positive_on_the_tick_grid(table: pa.Table) -> None:
    for sym in ("ES", "NQ"):
        s = Series(table, sym)
        assert s.ts.size == N_BARS
        assert (s.low <= np.minimum(s.open, s.close)).all() and (s.high >= np.maximum(s.open, s.close)).all()
        assert (s.low > 0).all()
        assert (s.high > s.low).mean() > 0.95  # bars have a range
        tick = KNOWN_SYMBOLS[sym][1]
        for col in (s.open, s.high, s.low, s.close):
            np.testing.assert_allclose(col / tick, np.round(col / tick), atol=1e-6)
        assert s.volume.dtype == np.int64 and (s.volume >= 1).all()


def test_sessions_only_on_weekdays_14_30_to_21_00_utc(es: Series, nq: Series) -> None:
    np.testing.assert_array_equal(es.ts, nq.ts)  # one shared calendar
    assert (np.diff(es.ts) > 0).all()
    weekday = (es.ts // NS_PER_DAY + 3) % 7  # Monday = 0
    assert (weekday < 5).all()
    assert es.minute_of_day.min() == 14 * 60 + 30
    assert es.minute_of_day.max() == 20 * 60 + 59  # the last bar starts at 20:59 and ends at 21:00
    assert set(np.unique(weekday).tolist()) == {0, 1, 2, 3, 4}
    per_day = np.unique(es.ts // NS_PER_DAY, return_counts=True)[1]
    assert (per_day[:-1] == SESSION_BARS).all()  # every full session has all its bars
    gaps = np.diff(es.ts)
    assert set(np.unique(gaps).tolist()) == {NS_PER_MINUTE, (24 * 60 - 389) * NS_PER_MINUTE,
                                             (3 * 24 * 60 - 389) * NS_PER_MINUTE}  # minute, overnight, weekend


def test_first_bar_of_a_session_gaps_from_the_last_close(es: Series) -> None:
    starts = np.flatnonzero(es.minute == 0)[1:]
    assert (es.open[starts] != es.close[starts - 1]).mean() > 0.9
    inside = np.flatnonzero(es.minute != 0)[1:]
    np.testing.assert_array_equal(es.open[inside], es.close[inside - 1])  # no gap within a session


def seasonal_scale(s: Series, x: np.ndarray) -> np.ndarray:
    """Mean of |x| per minute of the session, mapped back to each bar."""
    ok = np.isfinite(x)
    scale = np.array([np.mean(np.abs(x[ok & (s.minute == m)])) for m in range(1, SESSION_BARS)])
    return np.concatenate([[np.nan], scale])[s.minute]


@pytest.mark.parametrize("sym", ["ES", "NQ"])
def test_volatility_clustering(table: pa.Table, sym: str) -> None:
    s = Series(table, sym)
    assert lag_corr(np.abs(s.ret), 1) > 0.15
    # with the intraday shape divided out, |returns| stay autocorrelated, and for long after the AR(1)
    # part has died out (0.15 ** 30 ~ 0): variance clustering, not the U-shape or momentum
    z = np.abs(s.ret) / seasonal_scale(s, s.ret)
    assert lag_corr(z, 1) > 0.08
    assert lag_corr(z, 30) > 0.04


@pytest.mark.parametrize("sym", ["ES", "NQ"])
def test_planted_momentum(table: pa.Table, sym: str) -> None:
    s = Series(table, sym)
    rho = lag_corr(s.ret, 1)
    assert 0.08 < rho < 0.25, rho  # planted AR(1) 0.15; tick rounding pulls it down only slightly
    assert abs(lag_corr(s.ret, 5)) < 0.05  # and nothing much left five bars on (0.15 ** 5 ~ 0.0001)


@pytest.mark.parametrize("sym", ["ES", "NQ"])
def test_u_shaped_volatility_and_volume(table: pa.Table, sym: str) -> None:
    s = Series(table, sym)
    edges = (s.minute < 30) | (s.minute >= SESSION_BARS - 30)
    midday = (s.minute >= 165) & (s.minute < 225)
    abs_ret = np.abs(s.ret)
    for part in (s.minute < 30, s.minute >= SESSION_BARS - 30):
        assert np.nanmean(abs_ret[part]) > 2.0 * np.nanmean(abs_ret[midday])
        assert s.volume[part].mean() > 2.0 * s.volume[midday].mean()
    assert np.nanmean(abs_ret[edges]) > 2.0 * np.nanmean(abs_ret[midday])


def test_symbols_are_correlated(es: Series, nq: Series) -> None:
    rho = corr(es.ret, nq.ret)
    assert 0.45 < rho < 0.8, rho  # 0.8 common factor -> 0.64


def run_synth(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "features.synth", *args], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])


def test_cli_writes_readable_bars(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "bars.parquet"
    res = run_synth("--out", str(out), "--symbols", "ES,NQ", "--bars", "2000", "--seed", "7")
    assert res.returncode == 0, res.stderr
    bars = read_bars(out)
    assert bars.symbols == ["ES", "NQ"] and len(bars) == 4000
    assert [p.name for p in out.parent.iterdir()] == ["bars.parquet"]  # no temporary file left behind
    again = tmp_path / "again.parquet"
    assert run_synth("--out", str(again), "--symbols", "ES,NQ", "--bars", "2000", "--seed", "7").returncode == 0
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--bars", "0"], "--bars"), (["--bars", "x"], "--bars"), (["--symbols", " , "], "--symbols"),
     (["--start", "2024-13-45"], "--start"), ([], "--out"), (["--out", "."], "is a directory")],
)
def test_cli_bad_arguments(tmp_path: Path, args: list[str], words: str) -> None:
    out = [] if "--out" in args or words == "--out" else ["--out", str(tmp_path / "x.parquet")]
    res = run_synth(*out, *args)
    assert res.returncode == 2
    assert words in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.parquet").exists()


def test_extra_feature_columns_leave_the_bars_unchanged() -> None:
    plain = generate(["ES"], 800, seed=3)
    wide = generate(["ES"], 800, seed=3, extra_features=4)
    assert wide.column_names == [*plain.column_names, "f000", "f001", "f002", "f003"]
    for name in plain.column_names:
        assert wide.column(name).equals(plain.column(name)), name
    f1 = wide.column("f001").to_numpy()  # trailing mean over 3 bars, scaled, plus unit noise
    assert np.isfinite(f1).all() and 0.5 < f1.std() < 50
