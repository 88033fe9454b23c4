"""Contract names -> roots, roll rules, and the continuous series the features see (features.contracts/rolls)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from features import contracts, rolls, series
from features.bars import Bars, ColumnMap, read_bars
from features.calendar import NS_PER_DAY
from features.compute import build_frame, latest_windows
from features.config import FeatureConfig
from features.contracts import ContractConfig, parse_contract

GAP = 0.03  # the next contract trades 3% above the front
PER_DAY = 40  # one-minute bars per session
WEEKDAYS = [d for d in range(14) if d % 7 < 5]  # sessions from Monday 2025-03-03, ten in all
DAY0 = int(np.datetime64("2025-03-03T14:00", "ns").astype(np.int64))
CMAP = ColumnMap(timestamp="ts_event")


def underlying(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The bar times and a gap-free price path both contracts follow: int64 [n], float64 [n]."""
    ts = np.concatenate([DAY0 + d * NS_PER_DAY + np.arange(PER_DAY) * 60 * 10**9 for d in WEEKDAYS])
    return ts, 5000.0 * np.exp(np.cumsum(np.random.default_rng(seed).normal(0, 1e-3, ts.size)))


def contract_rows(name: str, ts: np.ndarray, price: np.ndarray, factor: float, sessions: range,
                  volume: dict[int, float]) -> dict[str, list]:
    """One contract's bars over `sessions` (indices of WEEKDAYS): the path times `factor`; volume per session."""
    rows: dict[str, list] = {k: [] for k in ("ts_event", "symbol", "open", "high", "low", "close", "volume")}
    for j in range(ts.size):
        day = j // PER_DAY
        if day in sessions:
            c, o = price[j] * factor, price[max(j - 1, 0)] * factor
            for k, v in zip(rows, (ts[j], name, o, max(o, c) * 1.0005, min(o, c) * 0.9995, c, volume[day]),
                            strict=True):
                rows[k].append(v)
    return rows


def write(path: Path, parts: list[dict[str, list]], extra: dict[str, list] | None = None) -> Path:
    cols = {k: [v for p in parts for v in p[k]] for k in parts[0]} | (extra or {})
    order = np.lexsort((np.array(cols["symbol"]), np.array(cols["ts_event"])))  # by time, as vendors deliver
    table = pa.table({k: [v[i] for i in order] for k, v in cols.items()})
    table = table.set_column(0, "ts_event", table.column("ts_event").cast(pa.timestamp("ns", tz="UTC")))
    pq.write_table(table, path)
    return path


def two_contracts(path: Path, gap: float = GAP, back_volume: float = 100.0) -> tuple[Path, np.ndarray, np.ndarray]:
    """ESH5 trades sessions 0-6, ESM5 sessions 3-9 at `gap` above; ESM5 outvolumes ESH5 from session 5, so the
    volume rule rolls at session 6's first bar."""
    ts, p = underlying()
    h = contract_rows("ESH5", ts, p, 1.0, range(0, 7), {d: 1000.0 if d < 5 else back_volume for d in range(10)})
    m = contract_rows("ESM5", ts, p, 1.0 + gap, range(3, 10), {d: 50.0 if d < 5 else 2000.0 for d in range(10)})
    return write(path, [h, m]), ts, p


def flags(*argv: str) -> contracts.ContractFlags:
    parser = argparse.ArgumentParser()
    contracts.add_arguments(parser)
    return contracts.ContractFlags.of(parser.parse_args(list(argv)))


def stitched(path: Path, *argv: str, horizon: int = 3) -> tuple[Bars, list[rolls.Roll], FeatureConfig]:
    config = FeatureConfig(horizon=horizon, volatility_window=5, contracts=series.scan(path, CMAP, flags(*argv)))
    bars, found = series.read_series(path, CMAP, config)
    return bars, found, config


def session_start(day: int) -> int:
    return DAY0 + WEEKDAYS[day] * NS_PER_DAY


@pytest.mark.parametrize(("name", "parsed"), [("ESH5", ("ES", 3, "5")), ("ESH25", ("ES", 3, "25")),
                                              ("CLZ24", ("CL", 12, "24")), ("6EM5", ("6E", 6, "5"))])
def test_cme_names_give_root_month_and_year(name: str, parsed: tuple[str, int, str]) -> None:
    assert parse_contract(name) == parsed


@pytest.mark.parametrize("name", ["ES", "ES.c.0", "ES.v.0", "SERIES", "AAA", "ESH", "H5", "ESA5"])
def test_names_that_are_not_contracts_parse_to_none(name: str) -> None:
    assert parse_contract(name) is None


def test_a_planted_roll_gap_reaches_no_feature_or_target(tmp_path: Path) -> None:
    path, ts, p = two_contracts(tmp_path / "es.parquet")
    bars, found, config = stitched(path)
    assert bars.symbols == ["ES"] and [(r.old, r.new, r.timestamp_ns) for r in found] == [
        ("ESH5", "ESM5", session_start(6))]
    assert np.array_equal(bars.timestamp_ns, ts)  # one bar per minute: the front's
    frame = build_frame(bars, config)
    truth = build_frame(Bars(ts, np.full(ts.size, "ES", dtype=object), p, p, p, p, np.ones(ts.size)),
                        FeatureConfig(horizon=3, volatility_window=5))
    # returns, volatility and targets: those of the gap-free path, at the roll and everywhere
    for col in (0, 4):  # log_return, volatility
        np.testing.assert_allclose(frame.observed[:, col], truth.observed[:, col], atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(frame.targets, truth.targets, atol=1e-6, equal_nan=True)
    # the same bars relabelled as one symbol (no roll rule): the gap is one bar's return
    plain = Bars(bars.timestamp_ns, bars.symbol, bars.open, bars.high, bars.low, bars.close, bars.volume)
    today = build_frame(plain, FeatureConfig(horizon=3, volatility_window=5))
    roll = int(np.searchsorted(ts, session_start(6)))
    jump = today.observed[roll, 0] - truth.observed[roll, 0]
    assert jump == pytest.approx(np.log(1 + GAP), abs=1e-6)
    for k in (1, 2, 3):  # every target spanning the roll: from bar roll - k, the steps h >= k
        np.testing.assert_allclose(today.targets[roll - k, k - 1:] - truth.targets[roll - k, k - 1:],
                                   np.log(1 + GAP), atol=1e-6)


def test_the_volume_rule_never_rolls_back(tmp_path: Path) -> None:
    """ESH5 outvolumes ESM5 again after the roll (a thin last week's spike): the front stays ESM5."""
    ts, p = underlying()
    h = contract_rows("ESH5", ts, p, 1.0, range(0, 8), {d: 1000.0 if d < 5 else 10.0 if d == 5 else 9000.0
                                                        for d in range(10)})
    m = contract_rows("ESM5", ts, p, 1.0 + GAP, range(3, 10), {d: 50.0 if d < 5 else 2000.0 for d in range(10)})
    bars, found, _ = stitched(write(tmp_path / "back.parquet", [h, m]))
    assert [(r.old, r.new) for r in found] == [("ESH5", "ESM5")]
    assert bars.contract is not None
    assert set(bars.contract[bars.timestamp_ns >= session_start(6)]) == {"ESM5"}


def test_a_deferred_months_volume_spike_moves_the_front_nowhere(tmp_path: Path) -> None:
    """ESU5 (two months out) outvolumes the front ESH5 for one session, 2, before ESM5 does in session 4: the front
    stays ESH5 until the next contract, ESM5, outvolumes it, and moves to ESU5 only once ESU5 outvolumes ESM5."""
    ts, p = underlying()
    h = contract_rows("ESH5", ts, p, 1.0, range(0, 7), {d: 1000.0 if d < 5 else 10.0 for d in range(10)})
    m = contract_rows("ESM5", ts, p, 1.0 + GAP, range(0, 10), {d: 50.0 if d < 4 else 2000.0 for d in range(10)})
    u = contract_rows("ESU5", ts, p, (1.0 + GAP) ** 2, range(0, 10),
                      {d: 5000.0 if d in (2, 8) else 1.0 for d in range(10)})
    bars, found, _ = stitched(write(tmp_path / "spike.parquet", [h, m, u]))
    assert [(r.old, r.new, r.timestamp_ns) for r in found] == [("ESH5", "ESM5", session_start(5)),
                                                                ("ESM5", "ESU5", session_start(9))]
    assert bars.contract is not None and set(bars.contract[bars.timestamp_ns < session_start(5)]) == {"ESH5"}


def test_ratio_adjustment_moves_prices_not_features(tmp_path: Path) -> None:
    path, _, _ = two_contracts(tmp_path / "es.parquet")
    own, _, config = stitched(path)
    adjusted, _, adj_config = stitched(path, "--adjust", "ratio")
    assert adjusted.log_offset is None
    late = own.contract == "ESM5"
    assert np.array_equal(adjusted.close[late], own.close[late])  # the latest contract's own prices
    np.testing.assert_allclose(adjusted.close[~late] / own.close[~late], 1 + GAP, rtol=1e-12)
    np.testing.assert_allclose(build_frame(adjusted, adj_config).observed, build_frame(own, config).observed,
                               atol=1e-6)


def test_root_volume_sums_the_contracts_at_each_bar(tmp_path: Path) -> None:
    path, _, _ = two_contracts(tmp_path / "es.parquet")
    front, _, _ = stitched(path)
    summed, _, _ = stitched(path, "--volume", "root")
    both = (front.timestamp_ns >= session_start(3)) & (front.timestamp_ns < session_start(7))
    assert np.array_equal(summed.volume[both], np.where(front.timestamp_ns[both] < session_start(5), 1050.0, 2100.0))
    assert np.array_equal(summed.volume[~both], front.volume[~both])


def test_calendar_rule_rolls_n_sessions_before_expiry(tmp_path: Path) -> None:
    path, _, _ = two_contracts(tmp_path / "es.parquet")
    mapping = tmp_path / "roots.csv"
    mapping.write_text("contract,root,expiration\nESH5,ES,2025-03-14\nESM5,ES,2025-06-20\n")
    _, found, _ = stitched(path, "--roll", "calendar:2", "--roots", str(mapping))
    # Friday 2025-03-14 expiry: sessions with more than 2 weekdays left end on Tuesday 03-11; Wednesday rolls
    assert [(r.old, r.new, r.timestamp_ns) for r in found] == [("ESH5", "ESM5", session_start(7))]


def test_calendar_rule_reads_an_expiration_column(tmp_path: Path) -> None:
    ts, p = underlying()
    h = contract_rows("ESH5", ts, p, 1.0, range(0, 7), dict.fromkeys(range(10), 10.0))
    m = contract_rows("ESM5", ts, p, 1.0 + GAP, range(3, 10), dict.fromkeys(range(10), 10.0))
    expiry = ["2025-03-14" if s == "ESH5" else "2025-06-20" for s in h["symbol"] + m["symbol"]]
    path = write(tmp_path / "es.parquet", [h, m], {"expiration": expiry})
    _, found, _ = stitched(path, "--roll", "calendar:2")
    assert [r.timestamp_ns for r in found] == [session_start(7)]


def test_calendar_rule_without_expirations_names_the_fix(tmp_path: Path) -> None:
    """A root the exchanges' table lacks (here XY) needs its expirations from the user."""
    ts, p = underlying()
    h = contract_rows("XYH5", ts, p, 1.0, range(0, 7), dict.fromkeys(range(10), 1.0))
    m = contract_rows("XYM5", ts, p, 1.0, range(3, 10), dict.fromkeys(range(10), 1.0))
    with pytest.raises(ValueError, match=r"--roll calendar:2 needs each contract's expiration: XYH5, XYM5 .*"
                                         r"--expiration-col"):
        stitched(write(tmp_path / "xy.parquet", [h, m]), "--roll", "calendar:2")


def test_names_no_rule_maps_name_the_roots_option(tmp_path: Path) -> None:
    ts, p = underlying()
    odd = contract_rows("ES 06-25", ts, p, 1.0, range(0, 10), dict.fromkeys(range(10), 1.0))
    h = contract_rows("ESH5", ts, p, 1.0, range(0, 10), dict.fromkeys(range(10), 1.0))
    mixed = write(tmp_path / "mixed.parquet", [h, odd])
    with pytest.raises(ValueError, match=r"'ES 06-25' name no root.*--roots FILE"):
        stitched(mixed)
    mapping = tmp_path / "roots.csv"
    mapping.write_text("contract,root\nES 06-25,ES\n")
    with pytest.raises(ValueError, match=r"both claim"):  # mapped: now two ES contracts
        stitched(mixed, "--roots", str(mapping), "--roll", "none", "--contract-col", "symbol")


def test_plain_series_stay_as_they_are(tmp_path: Path) -> None:
    ts, p = underlying()
    rows = contract_rows("ES.c.0", ts, p, 1.0, range(10), dict.fromkeys(range(10), 1.0))
    path = write(tmp_path / "plain.parquet", [rows])
    assert series.scan(path, CMAP, flags()) is None
    two, _, _ = two_contracts(tmp_path / "es.parquet")
    assert series.scan(two, CMAP, flags("--roll", "none")) is None  # each contract its own series
    bars = read_bars(path, CMAP)
    assert rolls.continuous(bars, FeatureConfig()) == (bars, [])
    assert "contracts" not in FeatureConfig().to_dict()


def test_a_continuous_file_rolls_where_its_contract_changes(tmp_path: Path) -> None:
    """--roll none --contract-col: one contract per bar already; the roll bar's return is its own open to close."""
    ts, p = underlying()
    h = contract_rows("ESH5", ts, p, 1.0, range(0, 6), dict.fromkeys(range(10), 1.0))
    m = contract_rows("ESM5", ts, p, 1.0 + GAP, range(6, 10), dict.fromkeys(range(10), 1.0))
    path = write(tmp_path / "c0.parquet", [h, m], {"series": ["ES.c.0"] * (len(h["symbol"]) + len(m["symbol"]))})
    bars, found, config = stitched(path, "--roll", "none", "--contract-col", "symbol")
    assert [(r.old, r.new, r.timestamp_ns) for r in found] == [("ESH5", "ESM5", session_start(6))]
    roll = int(np.searchsorted(ts, session_start(6)))
    frame = build_frame(bars, config)
    assert frame.observed[roll, 0] == pytest.approx(np.log(p[roll] / p[roll - 1]), abs=1e-6)
    overlap = write(tmp_path / "both.parquet", [h, contract_rows("ESM5", ts, p, 1.0 + GAP, range(5, 10),
                                                                 dict.fromkeys(range(10), 1.0))])
    with pytest.raises(ValueError, match=r"root ES at 2025-03-10 14:00 UTC: ESH5 and ESM5 both claim the bar.*"
                                         r"--roll volume"):
        stitched(overlap, "--roll", "none", "--contract-col", "symbol")


def test_contract_config_travels_with_the_feature_config(tmp_path: Path) -> None:
    mapping = tmp_path / "roots.csv"
    mapping.write_text("contract,root,expiration\nESH5,ES,2025-03-14\n")
    cfg = contracts.contract_config(flags("--roll", "calendar:3", "--roots", str(mapping), "--volume", "root"),
                                    ["ESH5", "ESM5"])
    assert cfg == ContractConfig("calendar:3", "none", "root", "", "", (("ESH5", "ES"),),
                                 (("ESH5", "2025-03-14"),), exchange_days=True)
    config = FeatureConfig(contracts=cfg)
    assert FeatureConfig.from_dict(config.to_dict()) == config
    assert cfg.root_of("ESU5") == "ES" and cfg.root_of("NQZ25") == "NQ"  # unseen contracts, by the pattern


def test_a_servers_window_over_a_roll_is_the_training_window(tmp_path: Path) -> None:
    """latest_windows with the roll offsets gives, bit for bit, the features build_frame gives there."""
    path, _, _ = two_contracts(tmp_path / "es.parquet")
    bars, _, config = stitched(path)
    roll = int(np.searchsorted(bars.timestamp_ns, session_start(6)))
    n, length = 30, 20
    end = roll + 5
    rows = slice(end - n, end)
    frame = build_frame(bars, config)
    assert bars.log_offset is not None
    w = latest_windows(bars.timestamp_ns[None, rows], bars.open[None, rows], bars.high[None, rows],
                       bars.low[None, rows], bars.close[None, rows], bars.volume[None, rows], [], config, length,
                       60 * 10**9, log_offset=bars.log_offset[None, rows])
    np.testing.assert_array_equal(w.encoder_observed[0], frame.observed[end - length:end])


def test_a_mapped_name_without_month_code_needs_its_expiration(tmp_path: Path) -> None:
    """Vendors list every contract from the first day: only an expiration orders names like 'ES 0625'."""
    ts, p = underlying()
    near = contract_rows("ES 0325", ts, p, 1.0, range(0, 7), {d: 1000.0 if d < 5 else 100.0 for d in range(10)})
    far = contract_rows("ES 0625", ts, p, 1.0 + GAP, range(0, 10), {d: 50.0 if d < 5 else 2000.0 for d in range(10)})
    path = write(tmp_path / "es.parquet", [near, far])
    mapping = tmp_path / "roots.csv"
    mapping.write_text("contract,root\nES 0325,ES\nES 0625,ES\n")
    with pytest.raises(ValueError, match=r"contract 'ES 0\d25' has no month code .* give its expiration in the "
                                         r"--roots file"):
        stitched(path, "--roots", str(mapping))
    mapping.write_text("contract,root,expiration\nES 0325,ES,2025-03-21\nES 0625,ES,2025-06-20\n")
    _, found, _ = stitched(path, "--roots", str(mapping))
    assert [(r.old, r.new, r.timestamp_ns) for r in found] == [("ES 0325", "ES 0625", session_start(6))]


def test_a_root_column_is_kept_as_the_models_mapping(tmp_path: Path) -> None:
    ts, p = underlying()
    h = contract_rows("MESH5", ts, p, 1.0, range(0, 7), {d: 1000.0 if d < 5 else 100.0 for d in range(10)})
    m = contract_rows("MESM5", ts, p, 1.0 + GAP, range(3, 10), {d: 50.0 if d < 5 else 2000.0 for d in range(10)})
    path = write(tmp_path / "mes.parquet", [h, m], {"product": ["MICRO_ES"] * (len(h["symbol"]) + len(m["symbol"]))})
    bars, found, config = stitched(path, "--roots", "product")
    assert bars.symbols == ["MICRO_ES"] and [r.new for r in found] == ["MESM5"]
    assert config.contracts is not None and config.contracts.root_of("MESM5") == "MICRO_ES"


def test_calendar_spreads_are_named_as_such(tmp_path: Path) -> None:
    ts, p = underlying()
    rows = [contract_rows(n, ts, p, 1.0, range(10), dict.fromkeys(range(10), 1.0)) for n in ("ESH5", "ESH5-ESM5")]
    with pytest.raises(ValueError, match=r"'ESH5-ESM5' name no root.*calendar spreads .* drop their rows"):
        stitched(write(tmp_path / "spread.parquet", rows))
