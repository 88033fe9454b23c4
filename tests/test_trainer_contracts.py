"""The trainer on per-contract futures bars: roots as series, rolls in the log and the checkpoint, resume, the
refusals a user meets, and export's windows rebuilt from the same bars."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from tests.artifacts import TINY_TRAIN_FLAGS, run_main
from trainer.config import ConfigError, TrainConfig, config_from_args, resumed_config
from trainer.data import prepare

NS_PER_MINUTE = 60 * 10**9
SESSIONS = 10  # weekdays from Monday 2025-03-03
BARS_PER_SESSION = 60  # one-minute bars from 14:30 UTC
# root, first price, the session from which the M5 contract outvolumes the H5 (the front moves the session after)
ROOTS = (("ES", 5000.0, 5), ("NQ", 18000.0, 4))
GAP = 1.03  # each M5 price is its H5's times this: the roll gap
FLAGS = ("--time-col", "ts_event", *TINY_TRAIN_FLAGS)
EXPECTED_ROLLS = [("ES", "ESH5", "ESM5", "2025-03-11T14:30"), ("NQ", "NQH5", "NQM5", "2025-03-10T14:30")]


def contract_bars(path: Path, names: dict[str, str] | None = None, expirations: bool = False) -> Path:
    """Databento-like per-contract bars (ts_event, symbol): per root, H5 trades sessions 0-6 and M5 sessions 3-9,
    M5's volume passes H5's from the root's crossing session, and M5's prices are H5's times GAP. `names` renames
    contracts; `expirations` adds an expiration column."""
    days = np.busday_offset(np.datetime64("2025-03-03", "D"), np.arange(SESSIONS))
    ts = (days.astype("datetime64[ns]").astype(np.int64)[:, None] + (14 * 60 + 30) * NS_PER_MINUTE
          + np.arange(BARS_PER_SESSION)[None, :] * NS_PER_MINUTE).reshape(-1)  # [S * B]
    session = np.repeat(np.arange(SESSIONS), BARS_PER_SESSION)  # [S * B]
    parts = []
    for seed, (root, price, cross) in enumerate(ROOTS):
        close = price * np.exp(np.cumsum(np.random.default_rng(seed).normal(0, 1e-3, ts.size)))  # [S * B]
        for month, k, live, volume, expiry in (
                ("H5", 1.0, session < 7, np.where(session < cross, 1000.0, 100.0), "2025-03-21"),
                ("M5", GAP, session >= 3, np.where(session < cross, 50.0, 2000.0), "2025-06-20")):
            c = close * k
            o = np.concatenate([[c[0]], c[:-1]])
            parts.append({"ts_event": ts[live], "symbol": np.full(live.sum(), (names or {}).get(root + month,
                                                                                                 root + month)),
                          "open": o[live], "high": np.maximum(o, c)[live] * 1.0005,
                          "low": np.minimum(o, c)[live] * 0.9995, "close": c[live], "volume": volume[live],
                          "expiration": np.full(live.sum(), np.datetime64(expiry, "D"))})
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.lexsort((cols["symbol"], cols["ts_event"]))
    table = {k: v[order] for k, v in cols.items() if expirations or k != "expiration"}
    table["ts_event"] = pa.array(table["ts_event"]).cast(pa.timestamp("ns", tz="UTC"))
    pq.write_table(pa.table(table), path)
    return path


def train(parquet: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_main(["-m", "trainer", "--parquet", str(parquet), "--out", str(out), *FLAGS, *extra])


def rolls_of(ckpt: dict[str, object]) -> list[tuple[str, str, str, str]]:
    rolls = ckpt["rolls"]
    assert isinstance(rolls, list)
    return [(r["root"], r["old"], r["new"], str(np.datetime64(r["timestamp_ns"], "ns"))[:16]) for r in rolls]


@pytest.fixture(scope="module")
def contract_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    work = tmp_path_factory.mktemp("contracts")
    bars = contract_bars(work / "bars.parquet")
    r = train(bars, work / "ckpt.pt")
    assert r.returncode == 0, r.stderr[-3000:]
    return bars, work / "ckpt.pt", r


def test_contract_bars_train_one_series_per_root_and_store_the_rolls(
        contract_run: tuple[Path, Path, subprocess.CompletedProcess[str]]) -> None:
    _, ckpt_path, r = contract_run
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert ckpt["symbols"] == ["ES", "NQ"]  # the roots, not ESH5 .. NQM5
    assert ckpt["feature_config"]["contracts"]["roll"] == "volume"  # the default for contract names
    assert rolls_of(ckpt) == EXPECTED_ROLLS  # the session after the one whose volume crossed
    assert "roll ES 2025-03-11 14:30 UTC: ESH5 -> ESM5" in r.stderr
    assert "contracts: 2 root(s) ES, NQ, 2 roll(s); roll volume" in r.stderr
    assert "roll" not in ckpt["train_config"]  # no contract flag given: the names decided
    # the calendar's zone is CME's, whose roots these are (no --calendar-tz given)
    assert ckpt["train_config"]["calendar_tz"] == "exchange"
    assert ckpt["feature_config"]["calendar_tz"] == "America/Chicago"
    assert "calendar time zone America/Chicago: the exchange's of ES, NQ" in r.stderr


def test_a_contract_run_resumes(contract_run: tuple[Path, Path, subprocess.CompletedProcess[str]]) -> None:
    bars, ckpt_path, _ = contract_run
    r = train(bars, ckpt_path, "--resume", str(ckpt_path.with_suffix(".last.pt")), "--epochs", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from epoch 1" in r.stderr
    ckpt = torch.load(ckpt_path.with_suffix(".last.pt"), weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["symbols"] == ["ES", "NQ"] and rolls_of(ckpt) == EXPECTED_ROLLS


def test_export_rebuilds_windows_of_the_roots_from_contract_bars(
        contract_run: tuple[Path, Path, subprocess.CompletedProcess[str]]) -> None:
    from export.windows import windows_from_bars
    from features.schema import STATIC_CATEGORICAL
    from trainer.model_config import ModelConfig

    bars, ckpt_path, _ = contract_run
    ckpt = torch.load(ckpt_path, weights_only=True)
    windows = windows_from_bars(bars, ckpt, ModelConfig.from_dict(ckpt["model_config"]), limit=64)
    assert set(windows[STATIC_CATEGORICAL][:, 0].tolist()) == {0, 1}  # both roots' windows, none refused


def test_an_unmappable_contract_name_exits_2_naming_roots(tmp_path: Path) -> None:
    bars = contract_bars(tmp_path / "bars.parquet", names={"NQM5": "NQ-JUN"})
    r = train(bars, tmp_path / "ckpt.pt")
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "'NQ-JUN'" in errors[0] and "--roots FILE" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "ckpt.pt").exists()


def test_a_calendar_roll_without_expirations_exits_2_naming_the_column(tmp_path: Path) -> None:
    xy = {f"ES{m}5": f"XY{m}5" for m in "HM"}  # a root whose expirations no exchange table gives
    r = train(contract_bars(tmp_path / "bars.parquet", names=xy), tmp_path / "ckpt.pt", "--roll", "calendar:2")
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--expiration-col" in errors[0] and "XYH5" in errors[0], r.stderr[-2000:]


def test_a_calendar_roll_with_a_mapping_file_trains(tmp_path: Path) -> None:
    names = {f"{root}{m}5": f"{root}-25{'03' if m == 'H' else '06'}" for root, _, _ in ROOTS for m in "HM"}
    bars = contract_bars(tmp_path / "bars.parquet", names=names)  # names no pattern maps
    mapping = tmp_path / "roots.csv"
    mapping.write_text("contract,root,expiration\n" + "".join(
        f"{new},{old[:2]},{'2025-03-12' if old.endswith('H5') else '2025-06-20'}\n" for old, new in names.items()))
    r = train(bars, tmp_path / "ckpt.pt", "--roll", "calendar:2", "--roots", str(mapping))
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["symbols"] == ["ES", "NQ"] and ckpt["train_config"]["roll"] == "calendar:2"
    # 2025-03-10 is the first session with 2 or fewer weekdays left to the H contracts' expiry on 2025-03-12
    assert rolls_of(ckpt) == [("ES", "ES-2503", "ES-2506", "2025-03-10T14:30"),
                              ("NQ", "NQ-2503", "NQ-2506", "2025-03-10T14:30")]


@pytest.mark.parametrize("tz", ["UTC", "America/Chicago"])
def test_the_training_decoder_sees_a_calendar_roll_as_the_rows_after_the_origin(tz: str) -> None:
    """The trainer's decoder known inputs (computed per batch from the nominal future times) equal the feature
    rows t+1..t+H at origins whose decoder spans a calendar roll: the roll flag and the new front's sessions."""
    from features.bars import Bars
    from features.compute import build_frame
    from features.config import FeatureConfig
    from features.contracts import ContractConfig
    from features.rolls import continuous
    from trainer.data import WindowTensors

    days = np.busday_offset(np.datetime64("2025-03-05", "D"), np.arange(8))
    ts = (days.astype("datetime64[ns]").astype(np.int64)[:, None] + 60 * NS_PER_MINUTE * np.arange(24)).reshape(-1)
    close = 5000.0 * np.exp(np.cumsum(np.random.default_rng(0).normal(0, 1e-3, ts.size)))  # hourly, both contracts
    names = np.tile(np.array(["ESH5", "ESM5"], dtype=object), ts.size)
    c = np.repeat(close, 2) * np.where(names == "ESM5", GAP, 1.0)
    per_contract = Bars(np.repeat(ts, 2), names, c, c * 1.001, c * 0.999, c, np.full(c.size, 100.0))
    fc = FeatureConfig(horizon=3, volatility_window=5, calendar_tz=tz, contracts=ContractConfig(
        roll="calendar:2", expirations=(("ESH5", "2025-03-14"), ("ESM5", "2025-06-20"))))
    bars, rolls = continuous(per_contract, fc)
    frame = build_frame(bars, fc)
    first_new = int(np.flatnonzero(bars.contract == "ESM5")[0])
    anchors = np.arange(first_new - fc.horizon, first_new + 1)  # decoders across the roll, then from it
    got = WindowTensors(frame, encoder_length=4).future_known(torch.from_numpy(anchors))  # [B, H, n_known]
    want = np.stack([frame.known[t + 1:t + fc.horizon + 1] for t in anchors])
    np.testing.assert_array_equal(got.numpy(), want)
    assert len(rolls) == 1 and want[..., -1].any()  # the roll flag is inside these decoders


def test_plain_series_keep_todays_checkpoint(tmp_path: Path) -> None:
    from features.bars import ColumnMap
    from trainer.loop import Trainer

    bars = contract_bars(tmp_path / "bars.parquet", names={"ESH5": "ES", "ESM5": "ES.X", "NQH5": "NQ",
                                                           "NQM5": "NQ.X"})
    cfg = TrainConfig.from_dict(dict(hidden_size=8, attention_heads=2, encoder_length=20, horizon=3, batch_size=32,
                                     epochs=1, max_steps_per_epoch=2, threads=1, device="cpu"))
    state = Trainer(bars, cfg, tmp_path / "ckpt.pt", ColumnMap(timestamp="ts_event"), progress=False).state()
    assert state["symbols"] == ["ES", "ES.X", "NQ", "NQ.X"]  # names that are not contracts: each its own series
    assert "rolls" not in state and "contracts" not in state["feature_config"]
    assert state["feature_config"]["calendar_tz"] == "UTC"  # series of no exchange the table knows
    assert not {"contract_col", "roots", "roll", "adjust", "volume", "expiration_col"} & set(state["train_config"])
    one = tmp_path / "one.parquet"  # one series without a symbol column
    pq.write_table(pq.read_table(bars).filter(pc.equal(pc.field("symbol"), "ES")).drop_columns(["symbol"]), one)
    data = prepare(one, cfg, ColumnMap(timestamp="ts_event"))
    assert data.frame.symbols == ["SERIES"] and data.frame.config.contracts is None and data.rolls == []


def test_contract_settings_are_config_keys_and_a_resume_keeps_them(tmp_path: Path) -> None:
    from trainer.__main__ import build_parser

    toml = tmp_path / "cfg.toml"
    toml.write_text('roll = "calendar:3"\nadjust = "ratio"\n')
    args = build_parser().parse_args(["--parquet", "b.parquet", "--config", str(toml), "--volume", "root"])
    cfg = config_from_args(args)
    assert (cfg.roll, cfg.adjust, cfg.volume, cfg.contract_col) == ("calendar:3", "ratio", "root", None)
    toml.write_text('roll = "weekly"\n')
    with pytest.raises(ConfigError, match=r"roll \(--config .*cfg.toml\) must be volume, calendar:N .* got 'weekly'"):
        config_from_args(build_parser().parse_args(["--parquet", "b.parquet", "--config", str(toml)]))
    with pytest.raises(ConfigError, match="--roll 'calendar:2'"):
        resumed_config(TrainConfig(), TrainConfig(roll="calendar:2"), {"roll"}, lambda k: f"--{k}")


def test_a_backtest_fold_trains_on_the_runs_contracts_with_their_expirations(tmp_path: Path) -> None:
    """A fold's bars in memory (those before its cut, as read per contract) train with the run's contracts,
    expirations included, and roll as the file's bars do."""
    from dataclasses import replace

    from backtest.folds import bars_before
    from features.bars import ColumnMap
    from features.series import read_contract_bars, scan_contracts
    from trainer.data import ReadBars

    path, columns = contract_bars(tmp_path / "bars.parquet", expirations=True), ColumnMap(timestamp="ts_event")
    cfg = TrainConfig.from_dict(dict(encoder_length=20, horizon=3, volatility_window=10, val_fraction=0.2))
    contracts = scan_contracts(path, columns, cfg.contract_flags)
    read = read_contract_bars(path, columns, replace(cfg.feature_config(), contracts=contracts))
    cut = int(np.unique(read.timestamp_ns)[-2 * BARS_PER_SESSION])  # the last two sessions: the fold's test
    fold = prepare(ReadBars(bars_before(read, cut), contracts, "the bars before the cut"), cfg)
    whole = prepare(path, cfg, columns)
    assert contracts is not None and fold.frame.config.contracts == whole.frame.config.contracts == contracts
    assert dict(contracts.expirations) == {"ESH5": "2025-03-21", "ESM5": "2025-06-20", "NQH5": "2025-03-21",
                                           "NQM5": "2025-06-20"}
    assert [r.line() for r in fold.rolls] == [r.line() for r in whole.rolls] != []
    np.testing.assert_array_equal(fold.frame.timestamp_ns, whole.frame.timestamp_ns[whole.frame.timestamp_ns < cut])


def with_bad_rows(path: Path) -> tuple[int, int]:
    """Over the contract bars at `path`: a vendor's bad print (0.0002, every price) at the deferred ESM5's first
    bar, and a settlement-only row of the deferred NQM5 whose close lies above its high; their file rows."""
    t = pq.read_table(path)
    cols = {name: t.column(name).to_numpy().copy() for name in ("open", "high", "low", "close")}
    symbol = t.column("symbol").to_numpy()
    spike, above = int(np.flatnonzero(symbol == "ESM5")[0]), int(np.flatnonzero(symbol == "NQM5")[5])
    for name in cols:
        cols[name][spike] = 0.0002
    cols["close"][above] = cols["high"][above] * 1.01
    for name, values in cols.items():
        t = t.set_column(t.column_names.index(name), name, pa.array(values))
    pq.write_table(t, path)
    return spike, above


def test_a_bad_print_in_a_deferred_contract_is_refused_by_name_or_dropped_alone(tmp_path: Path) -> None:
    from features.bars import ColumnMap, read_bars
    from trainer.checkpoint import load_checkpoint

    path = contract_bars(tmp_path / "bars.parquet")
    clean = read_bars(path, ColumnMap(timestamp="ts_event"))
    spike, above = with_bad_rows(path)
    refused = train(path, tmp_path / "refused.pt")
    assert refused.returncode == 2 and not (tmp_path / "refused.pt").exists()
    assert f"row {spike}: close 0.0002 is " in refused.stderr and "a bad print" in refused.stderr
    assert f"row {above}: open or close above high" in refused.stderr
    assert "pass --bad-rows drop" in refused.stderr, refused.stderr[-3000:]

    r = train(path, tmp_path / "ckpt.pt", "--bad-rows", "drop")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--bad-rows drop: dropped 2 row(s) that break a price rule (above_high 1, bad_print 1)" in r.stderr
    dropped = load_checkpoint(tmp_path / "ckpt.pt")["dropped_rows"]
    assert [(d["row"], d["symbol"], d["rule"]) for d in dropped] == [(above, "NQM5", "above_high"),
                                                                     (spike, "ESM5", "bad_print")]
    # every other row stays, those of the same contracts too
    kept = read_bars(path, ColumnMap(timestamp="ts_event", bad_rows="drop"))
    gone = np.isin(np.arange(len(clean)), [np.flatnonzero((clean.symbol == d["symbol"])
                                                          & (clean.timestamp_ns == d["timestamp_ns"]))[0]
                                           for d in dropped])
    assert np.array_equal(kept.timestamp_ns, clean.timestamp_ns[~gone]) and np.array_equal(kept.symbol,
                                                                                            clean.symbol[~gone])
    assert np.array_equal(kept.close, clean.close[~gone])


def test_check_writes_the_bars_less_the_rows_dropped(tmp_path: Path) -> None:
    path = contract_bars(tmp_path / "bars.parquet", expirations=True)
    spike, above = with_bad_rows(path)
    out = tmp_path / "clean.parquet"
    r = run_main(["-m", "features.check", str(path), "--time-col", "ts_event", "--bad-rows", "drop", "--out",
                  str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"wrote {out}: the bars less the 2 row(s) dropped" in r.stdout
    before, after = pq.read_table(path), pq.read_table(out)
    assert after.schema == before.schema  # every column, as it was
    keep = ~np.isin(np.arange(before.num_rows), [spike, above])
    assert after.equals(before.filter(pa.array(keep)))
    again = run_main(["-m", "features.check", str(out), "--time-col", "ts_event"])
    assert again.returncode == 0 and "no problems found" in again.stdout, again.stderr[-3000:]
    # --out without drop, or over the bars themselves: refused before any work
    for flags, says in ((["--out", str(out)], "add --bad-rows drop"),
                        (["--bad-rows", "drop", "--out", str(path)], "is the bars file")):
        r = run_main(["-m", "features.check", str(path), "--time-col", "ts_event", *flags])
        assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]


def test_daily_contract_bars_keep_the_calendar_in_utc(tmp_path: Path) -> None:
    """A daily bar's time stamps its session's date (00:00 UTC): in Chicago it would fall on the evening before,
    moving every bar's day of the week, so the exchange's zone is for intraday bars alone."""
    from features.bars import ColumnMap

    days = np.busday_offset(np.datetime64("2025-01-02", "D"), np.arange(120)).astype("datetime64[ns]")
    rows = []
    for k, name in enumerate(("ESH5", "ESM5")):
        close = 5000.0 * (1.01 ** k) * np.exp(np.cumsum(np.random.default_rng(k).normal(0, 1e-2, days.size)))
        rows.append(pa.table({"timestamp": pa.array(days).cast(pa.timestamp("ns", tz="UTC")),
                              "symbol": [name] * days.size, "open": close, "high": close * 1.01,
                              "low": close * 0.99, "close": close,
                              "volume": np.where(np.arange(days.size) < 50, 1000.0 - 900.0 * k, 100.0 + 900.0 * k)}))
    pq.write_table(pa.concat_tables(rows), tmp_path / "daily.parquet")
    cfg = TrainConfig.from_dict(dict(encoder_length=10, horizon=2, volatility_window=5))
    assert cfg.calendar_tz == "exchange"
    data = prepare(tmp_path / "daily.parquet", cfg, ColumnMap())
    assert data.frame.symbols == ["ES"] and data.frame.config.calendar_tz == "UTC"
