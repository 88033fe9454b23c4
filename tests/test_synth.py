"""The sample-data generator's stated properties, measured from its output."""

from __future__ import annotations

import hashlib
import subprocess
from datetime import UTC, date, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from features import read_bars
from features.bars import ColumnMap
from features.compute import build_frame, with_vocabularies
from features.config import FeatureConfig
from features.synth import (
    KNOWN_SYMBOLS,
    SESSION_BARS,
    Covariates,
    contract_name,
    expiry_date,
    generate,
    generate_contracts,
    main,
    session_timestamps,
)
from tests.artifacts import run_main

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
    return run_main(["-m", "features.synth", *args])


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
     (["--start", "2024-13-45"], "--start"), ([], "--out"), (["--out", "."], "is a directory"),
     (["--event", "9:30"], "sessions run 14:30-21:00 UTC"), (["--event", "15h"], "HH:MM"),
     (["--event", "15:00", "--event-every", "0"], "--event-every"), (["--event-jump", "0"], "--event-jump"),
     (["--regime", "close"], "a name of its own"), (["--roll-gap", "0.03"], "add --contracts"),
     (["--contracts", "--roll-gap", "-1"], "--roll-gap"), (["--contracts", "--event", "15:00"], "--contracts"),
     (["--contracts", "--expiration-col", "close"], "--expiration-col close")],
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


def digest(table: pa.Table) -> str:
    """sha256 of the column names, types and values."""
    h = hashlib.sha256()
    for name, col in zip(table.column_names, table.columns, strict=True):
        h.update(f"{name}:{col.type};".encode())
        if pa.types.is_string(col.type):
            h.update("\n".join(col.to_pylist()).encode())
        else:
            h.update((col.cast(pa.int64()) if pa.types.is_timestamp(col.type) else col).to_numpy().tobytes())
    return h.hexdigest()


def test_without_covariates_the_bars_are_as_before() -> None:
    # digests of the generator's output before covariates existed: the same seed still writes the same bars
    assert digest(generate(["ES", "CL"], 1500, seed=3)) == (
        "70f278fe1c55ae75a615c3a9535ee1fe4a37a54551b79babc29fe862541ab5c3")
    assert digest(generate(["ES", "ZZ"], 800, seed=5, extra_features=2, covariates=Covariates())) == (
        "5a79b1514d9d6981676bb6ab66956be987b0190c9d9c43285137e1cbf0a4fe6d")


EVENTS = Covariates(event_times=("15:00", "18:00"), event_every=3)  # minutes 30 and 210 of sessions 0, 3, 6, ...


@pytest.fixture(scope="module")
def with_event() -> pa.Table:
    return generate(["ES", "NQ"], N_BARS, seed=11, covariates=EVENTS)


def test_event_flag_on_the_scheduled_bars(with_event: pa.Table, es: Series) -> None:
    assert with_event.column_names == [*table_columns(), "event"]
    assert with_event.schema.field("event").type == pa.int8()
    flag = with_event.filter(pc.equal(with_event.column("symbol"), "ES")).column("event").to_numpy()
    session = np.unique(es.ts // NS_PER_DAY, return_inverse=True)[1]  # session number from 0
    planted = np.isin(es.minute, [30, 210]) & (session % 3 == 0)
    np.testing.assert_array_equal(flag, planted.astype(np.int8))
    assert flag.sum() == 2 * 17 + 1  # sessions 0, 3, ..., 51; the last (110 bars) reaches 15:00 only
    nq_flag = with_event.filter(pc.equal(with_event.column("symbol"), "NQ")).column("event").to_numpy()
    np.testing.assert_array_equal(nq_flag, flag)  # one calendar of events for all symbols


def test_volatility_jumps_after_the_event_and_only_then(with_event: pa.Table, es: Series) -> None:
    s = Series(with_event, "ES")
    day = np.unique(s.ts // NS_PER_DAY, return_inverse=True)[1]
    event_day = day % 3 == 0
    abs_ret = np.abs(s.ret)

    def ratio(minutes: np.ndarray) -> float:
        at = np.isin(s.minute, minutes)
        return float(np.nanmean(abs_ret[at & event_day]) / np.nanmean(abs_ret[at & ~event_day]))

    after = np.array([30, 31, 32, 210, 211, 212])  # the event bar and the next two: planted x4, x3.2, x2.5
    assert ratio(after) > 2.0, ratio(after)
    assert 0.75 < ratio(np.arange(100, 180)) < 1.33  # far from the events: the same volatility on both days
    first = int(np.flatnonzero(with_event.column("event").to_numpy())[0])
    plain = es.close[:first]  # the same shocks: nothing moves before the first event
    np.testing.assert_array_equal(s.close[:first], plain)
    assert not np.array_equal(s.close[first:], es.close[first:])


def test_vol_scale_multiplies_each_symbols_volatility() -> None:
    t = generate(["A", "B", "C"], 8000, seed=11, covariates=Covariates(vol_scale_column="vol_scale"))
    assert t.schema.field("vol_scale").type == pa.float64()
    scale, vol = [], []
    for sym in ("A", "B", "C"):
        column = t.filter(pc.equal(t.column("symbol"), sym)).column("vol_scale").to_numpy()
        assert np.unique(column).size == 1  # static: one value per symbol
        scale.append(column[0])
        vol.append(np.nanstd(Series(t, sym).ret))
    assert scale == [0.5, 1.0, 2.0]  # geometric 0.5 to 2 in the order given
    for k in (1, 2):
        assert 1.7 < vol[k] / vol[k - 1] < 2.3, vol  # the same base volatility otherwise


def test_regime_labels_alternate_and_change_volatility() -> None:
    t = generate(["ES", "NQ"], N_BARS, seed=11, covariates=Covariates(regime_column="regime", regime_sessions=3))
    s = Series(t, "ES")
    label = t.filter(pc.equal(t.column("symbol"), "ES")).column("regime").to_numpy(zero_copy_only=False)
    day = np.unique(s.ts // NS_PER_DAY, return_inverse=True)[1]
    per_session = [set(label[day == d]) for d in range(day.max() + 1)]
    assert all(len(x) == 1 for x in per_session)  # one regime per session
    assert [x.pop() for x in per_session[:7]] == ["calm"] * 3 + ["volatile"] * 3 + ["calm"]
    calm, volatile = (np.nanstd(s.ret[label == x]) for x in ("calm", "volatile"))
    assert 1.6 < volatile / calm < 2.5, (calm, volatile)  # planted x0.7 against x1.4


def test_cli_covariates_read_as_the_trainer_reads_them(tmp_path: Path) -> None:
    out = tmp_path / "bars.parquet"
    res = run_synth("--out", str(out), "--symbols", "ES,CL", "--bars", "1200", "--event", "15:00,19:30",
                    "--event-every", "2", "--vol-scale", "--regime", "--regime-sessions", "1", "--exchange", "venue")
    assert res.returncode == 0, res.stderr
    assert "covariates: event, vol_scale, regime, venue" in res.stderr
    config = FeatureConfig(known_columns=("event",), static_columns=("vol_scale", "venue"),
                           user_columns=("regime",), categorical_columns=("regime", "venue"))
    bars = read_bars(out, None, config.real_columns, label_columns=config.categorical_columns)
    assert sorted(bars.labels["venue"].tolist()[::1200]) == ["CME", "NYMEX"]
    assert set(bars.labels["regime"].tolist()) == {"calm", "volatile"}
    config = with_vocabularies(config, bars, int(bars.timestamp_ns.max()) + 1)
    assert config.vocabulary("regime") == ("calm", "volatile")
    frame = build_frame(bars, config)  # refuses a static column that varies within a series
    assert frame.static_real is not None and sorted(np.unique(frame.static_real).tolist()) == [0.5, 2.0]
    assert int(bars.user["event"].sum()) == 2 * 2 * 2  # sessions 0 and 2 of 4, two times, two symbols


def table_columns() -> list[str]:
    return ["timestamp", "symbol", "open", "high", "low", "close", "volume"]


CONTRACT_ARGS = ["--contracts", "--symbols", "ES,NQ", "--bars", str(20 * SESSION_BARS), "--start", "2024-02-26",
                 "--seed", "5", "--roll-gap", "0.03", "--expiration-col", "expiration"]  # 20 sessions to Mar 22
ROLL_WEEK = [date(2024, 3, d) for d in (8, 11, 12, 13, 14)]  # the 5 sessions before ESH4 expires on Mar 15


@pytest.fixture(scope="module")
def contract_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("contracts") / "bars.parquet"
    assert main(["--out", str(out), *CONTRACT_ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def contracts(contract_file: Path) -> pa.Table:
    return pq.read_table(contract_file)


def contract_rows(table: pa.Table, symbol: str) -> dict[str, np.ndarray]:
    t = table.filter(pc.equal(table.column("symbol"), symbol))
    out = {k: t.column(k).to_numpy() for k in ("open", "high", "low", "close", "volume")}
    return {**out, "ts": t.column("ts_event").cast(pa.int64()).to_numpy()}


def daily_volume(table: pa.Table, symbol: str) -> dict[date, int]:
    rows = contract_rows(table, symbol)
    days = (rows["ts"] // NS_PER_DAY).astype("datetime64[D]")
    return {d.item(): int(rows["volume"][days == d].sum()) for d in np.unique(days)}


def test_contract_names_and_expiries() -> None:
    assert [contract_name("ES", 2025, 3), contract_name("CL", 2024, 12)] == ["ESH5", "CLZ4"]
    assert [expiry_date(2024, 3), expiry_date(2025, 3), expiry_date(2025, 6)] == [
        date(2024, 3, 15), date(2025, 3, 21), date(2025, 6, 20)]


def test_contract_bars_are_databento_like(contracts: pa.Table, contract_file: Path) -> None:
    utc = pa.timestamp("ns", tz="UTC")
    assert contracts.schema == pa.schema(
        [("ts_event", utc), ("rtype", pa.uint8()), ("publisher_id", pa.uint16()), ("instrument_id", pa.uint32()),
         ("open", pa.float64()), ("high", pa.float64()), ("low", pa.float64()), ("close", pa.float64()),
         ("volume", pa.uint64()), ("symbol", pa.string()), ("expiration", utc)])
    assert set(contracts.column("rtype").to_pylist()) == {33}
    assert set(contracts.column("publisher_id").to_pylist()) == {1}
    ts, ids = contracts.column("ts_event").cast(pa.int64()).to_numpy(), contracts.column("instrument_id").to_numpy()
    np.testing.assert_array_equal(np.lexsort((ids, ts)), np.arange(ts.shape[0]))  # by time, then instrument
    pairs = set(zip(contracts.column("symbol").to_pylist(), ids.tolist(), strict=True))
    assert sorted(s for s, _ in pairs) == ["ESH4", "ESM4", "NQH4", "NQM4"]  # one id per contract
    assert len({i for _, i in pairs}) == 4
    later = generate_contracts(["NQ"], SESSION_BARS, seed=1, start=date(2024, 3, 11))  # NQH4 and NQM4 again
    assert set(zip(later.column("symbol").to_pylist(), later.column("instrument_id").to_pylist(),
                   strict=True)) <= pairs  # ids are the same in every file
    expiration = contracts.column("expiration").cast(pa.int64()).to_numpy()
    assert (ts < expiration).all()
    h4 = contracts.filter(pc.equal(contracts.column("symbol"), "ESH4")).column("expiration")
    assert pc.unique(h4).to_pylist() == [datetime(2024, 3, 15, 13, 30, tzinfo=UTC)]  # third Friday, 13:30 UTC
    assert read_bars(contract_file, ColumnMap(timestamp="ts_event")).symbols == ["ESH4", "ESM4", "NQH4", "NQM4"]


@pytest.mark.parametrize("root", ["ES", "NQ"])
def test_contracts_overlap_and_cover_every_minute(contracts: pa.Table, root: str) -> None:
    front, back = contract_rows(contracts, f"{root}H4"), contract_rows(contracts, f"{root}M4")
    assert back["ts"][0] < front["ts"][-1]
    both = np.intersect1d(front["ts"], back["ts"])  # minutes at which both contracts trade
    assert np.unique(both // NS_PER_DAY).size == 10  # from 10 sessions before the front's expiry
    minutes = session_timestamps(20 * SESSION_BARS, date(2024, 2, 26))
    np.testing.assert_array_equal(np.union1d(front["ts"], back["ts"]), minutes)
    for rows in (front, back):
        assert (rows["volume"] >= 1).all()
        assert (rows["high"] >= np.maximum(rows["open"], rows["close"])).all()
        assert (rows["low"] <= np.minimum(rows["open"], rows["close"])).all()
        np.testing.assert_allclose(rows["close"] / 0.25, np.round(rows["close"] / 0.25), atol=1e-6)  # tick grid


@pytest.mark.parametrize("root", ["ES", "NQ"])
def test_volume_crosses_over_in_the_roll_week(contracts: pa.Table, root: str) -> None:
    front, back = daily_volume(contracts, f"{root}H4"), daily_volume(contracts, f"{root}M4")
    share = [back[d] / (back[d] + front[d]) for d in ROLL_WEEK]  # the next contract's share of the root's volume
    np.testing.assert_allclose(share, [0.1, 0.3, 0.6, 0.8, 0.9], atol=1e-3)
    assert [back[d] > front[d] for d in ROLL_WEEK] == [False, False, True, True, True]  # crosses mid-week
    deferred = [back[d] / (back[d] + front[d]) for d in sorted(back) if d < ROLL_WEEK[0]]
    assert len(deferred) == 5
    np.testing.assert_allclose(deferred, 0.02, atol=1e-3)  # thin before the roll week
    assert max(front) == date(2024, 3, 14) and min(back) == date(2024, 3, 1)


@pytest.mark.parametrize("root", ["ES", "NQ"])
def test_consecutive_contracts_differ_by_the_roll_gap(contracts: pa.Table, root: str) -> None:
    front, back = contract_rows(contracts, f"{root}H4"), contract_rows(contracts, f"{root}M4")
    _, i, j = np.intersect1d(front["ts"], back["ts"], return_indices=True)
    tick = KNOWN_SYMBOLS[root][1]
    for k in ("open", "high", "low", "close"):
        assert np.abs(back[k][j] - 1.03 * front[k][i]).max() <= tick / 2 + 1e-9  # the planted 3%, to the tick
    plain = Series(generate(["ES", "NQ"], 20 * SESSION_BARS, seed=5, start=date(2024, 2, 26)), root)
    np.testing.assert_array_equal(front["close"], plain.close[np.isin(plain.ts, front["ts"])])  # today's path


def test_contracts_deterministic_per_seed(contract_file: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    again, other = tmp_path / "again.parquet", tmp_path / "other.parquet"
    assert main(["--out", str(again), *CONTRACT_ARGS]) == 0
    assert again.read_bytes() == contract_file.read_bytes()
    assert main(["--out", str(other), *CONTRACT_ARGS, "--seed", "6"]) == 0
    assert not pq.read_table(other).equals(pq.read_table(contract_file))
    assert f"bars of 4 contracts (ESH4, ESM4, NQH4, NQM4) for 2 roots x 7800 minutes to {again}" in (
        capsys.readouterr().err)
