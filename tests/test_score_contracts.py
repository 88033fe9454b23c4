"""`serving.score` and `serving.client` with a model trained on per-contract futures bars: each root's continuous
series by the model's roll rule, forecasts with no spike at a roll, each origin's front contract, and roots or
contracts in `--symbols` and `--symbol`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from features.bars import ColumnMap, read_bars
from features.compute import build_frame
from features.config import FeatureConfig
from features.contracts import ContractConfig
from features.model_meta import ModelMeta
from features.schema import QUANTILES
from features.windows import anchor_rows, model_inputs
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.model import load_model
from serving.request_from_bars import request_from_bars
from serving.wire import forecast_arrays
from tests.artifacts import TINY_TRAIN_FLAGS, run_main, run_score
from tests.live_server import serving
from tests.test_check_contracts import ContractBars, contract_bars, day_ns
from tests.test_score_covariates import H, iso, run_client, write_model

TRAIN = {"ES": ["ESH5", "ESM5"], "NQ": ["NQH5", "NQM5"]}
SCORE = {"ES": ["ESH5", "ESM5", "ESU5", "ESZ5"], "NQ": ["NQH5", "NQM5"]}  # ES rolls three times, into unseen ones
TS = ColumnMap(timestamp="ts_event")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ContractBars]:
    """A tiny model trained and exported on per-contract bars of two roots, and the bars to score."""
    root = tmp_path_factory.mktemp("contracts")
    pq.write_table(contract_bars(TRAIN, days_each=4, per_day=60, seed=1).table, root / "train.parquet")
    done = run_main(["-m", "trainer", "--parquet", str(root / "train.parquet"), "--time-col", "ts_event", "--out",
                     str(root / "ckpt.pt"), *TINY_TRAIN_FLAGS])
    assert done.returncode == 0, done.stderr[-4000:]
    done = run_main(["-m", "export", str(root / "ckpt.pt"), str(root / "model.onnx")])
    assert done.returncode == 0, done.stderr[-4000:]
    bars = contract_bars(SCORE, days_each=3, per_day=60, seed=2)
    pq.write_table(bars.table, root / "futures.parquet")
    return root / "model.onnx", root / "futures.parquet", bars


def one_symbol(table: pa.Table, path: Path) -> Path:
    """`table` (ts_event, symbol, OHLCV, ...) as plain bars: one series per symbol, no contract column."""
    pq.write_table(table.select(["ts_event", "symbol", "open", "high", "low", "close", "volume"]), path)
    return path


def direct(model: Path, bars_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The model's quantiles ([W, H, Q]) at every origin of the plain series at `bars_path`, and the origins [W]:
    the same model, its contract rule left out."""
    loaded = load_model(model, threads=1)
    meta: ModelMeta = loaded.meta
    fc = replace(meta.feature_config, contracts=None)
    frame = build_frame(read_bars(bars_path, TS), fc, list(meta.symbols), meta.bar_interval_ns)
    anchors = anchor_rows(frame, meta.encoder_length, require_targets=False)
    return loaded.run(model_inputs(frame, anchors, meta.encoder_length))[QUANTILES], frame.timestamp_ns[anchors]


def quantiles(table: pa.Table, horizon: int) -> np.ndarray:
    """The ret_q columns of a forecasts table as [W, H, Q]."""
    names = [n for n in table.column_names if n.startswith("ret_q")]
    return np.stack([table[n].to_numpy() for n in names], axis=-1).reshape(-1, horizon, len(names))


def front_rows(bars: ContractBars) -> pa.Table:
    """Each root's front contract's own bars (today's relabelling: the symbol is the root, prices unadjusted)."""
    keys = bars.front.select(["ts_event", "contract"]).append_column("root", bars.front["symbol"])
    own = bars.table.join(keys, ["ts_event", "symbol"], ["ts_event", "contract"], join_type="inner")
    own = own.set_column(own.schema.get_field_index("symbol"), "symbol", own["root"])
    return own.sort_by([("symbol", "ascending"), ("ts_event", "ascending")])


def test_forecasts_across_three_rolls_are_the_ratio_adjusted_series_ones_with_no_spike(
        trained: tuple[Path, Path, ContractBars], tmp_path: Path) -> None:
    model, futures, bars = trained
    out = tmp_path / "forecasts.parquet"
    done = run_score("--model", model, "--parquet", futures, "--out", out, "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert "contracts: roll volume, adjust none, volume front; contract names -> roots by root + month code" \
        in done.stderr and "; 4 roll(s)" in done.stderr, done.stderr
    assert all(f"  {line}\n" in done.stderr for line in bars.rolls) and len(bars.rolls) == 4
    scored = pq.read_table(out)
    assert scored.column_names[:3] == ["symbol", "contract", "origin"]
    h = int(pc.max(scored["h"]).as_py())
    got = quantiles(scored, h)  # [W, H, Q]
    origin = scored["origin"].cast(pa.int64()).to_numpy()[::h]  # [W]

    # the same forecasts as the model's from the bars rebuilt as one ratio-adjusted series per root
    adjusted, adjusted_origin = direct(model, one_symbol(bars.front, tmp_path / "adjusted.parquet"))
    np.testing.assert_array_equal(origin, adjusted_origin)
    np.testing.assert_allclose(got, adjusted, rtol=0, atol=1e-6)
    # while the front's own bars relabelled as one symbol put the gap into every window spanning a roll
    relabelled, _ = direct(model, one_symbol(front_rows(bars), tmp_path / "relabelled.parquet"))
    roll_ns = {int(bars.front["ts_event"].cast(pa.int64())[i].as_py()) for i in range(bars.front.num_rows)
               if i and bars.front["contract"][i] != bars.front["contract"][i - 1]
               and bars.front["symbol"][i] == bars.front["symbol"][i - 1]}
    at_roll = np.isin(origin, list(roll_ns))  # [W] the first bar of each new front
    assert at_roll.sum() == 4
    spike = np.abs(relabelled - adjusted)[at_roll].max(axis=(1, 2))  # [4] per roll
    assert spike.min() > 100 * np.abs(got - adjusted).max() and spike.min() > 1e-4, spike

    # each origin's front contract, and its own close (adjust none): what the forecast prices start from
    front = {(s, int(t)): (c, p) for s, t, c, p in zip(bars.front["symbol"].to_pylist(),
                                                       bars.front["ts_event"].cast(pa.int64()).to_numpy(),
                                                       bars.front["contract"].to_pylist(),
                                                       bars.front["close"].to_numpy(), strict=True)}
    own = {(c, int(t)): p for c, t, p in zip(bars.table["symbol"].to_pylist(),
                                             bars.table["ts_event"].cast(pa.int64()).to_numpy(),
                                             bars.table["close"].to_numpy(), strict=True)}
    symbol, contract = scored["symbol"].to_pylist()[::h], scored["contract"].to_pylist()[::h]
    assert contract == [front[(s, int(t))][0] for s, t in zip(symbol, origin, strict=True)]
    assert {"ESU5", "ESZ5"} <= set(contract)  # contracts the model never saw
    close = scored["close"].to_numpy()[::h]
    np.testing.assert_array_equal(close, [own[(c, int(t))] for c, t in zip(contract, origin, strict=True)])
    median = scored["price_q0.5"].to_numpy().reshape(-1, h)
    np.testing.assert_allclose(median, close[:, None] * np.exp(got[:, :, got.shape[2] // 2]), rtol=1e-12)


def test_symbols_name_a_root_or_any_contract_of_one(trained: tuple[Path, Path, ContractBars],
                                                    tmp_path: Path) -> None:
    model, futures, _ = trained
    done = run_score("--model", model, "--parquet", futures, "--out", tmp_path / "all.parquet", "--threads", "1")
    assert done.returncode == 0, done.stderr
    everything = pq.read_table(tmp_path / "all.parquet")
    es = everything.filter(pc.equal(everything["symbol"], "ES"))
    for name in ("ES", "ESZ5", "ESH6"):  # the root, a contract in the file, one that is not
        out = tmp_path / f"{name}.parquet"
        done = run_score("--model", model, "--parquet", futures, "--out", out, "--threads", "1", "--symbols", name)
        assert done.returncode == 0, done.stderr
        assert pq.read_table(out).to_pandas().equals(es.to_pandas())  # NaN actual_ret past the file alike
    done = run_score("--model", model, "--parquet", futures, "--out", tmp_path / "cl.parquet", "--symbols", "CLZ5,ES")
    assert done.returncode == 2 and not (tmp_path / "cl.parquet").exists()
    assert "error: --symbols CLZ5: not the model's (it knows ES, NQ and their contracts)" in done.stderr, done.stderr


def test_a_ratio_adjusted_model_prices_forecasts_from_the_adjusted_closes(
        trained: tuple[Path, Path, ContractBars], tmp_path: Path) -> None:
    """The model's adjust decides the price levels a user sees; a plain model's output has no contract column."""
    _, futures, bars = trained
    config = FeatureConfig(horizon=H, volatility_window=4, contracts=ContractConfig(adjust="ratio"))
    write_model(tmp_path / "ratio.onnx", config, interval_ns=60 * 10**9)
    out = tmp_path / "ratio.parquet"
    done = run_score("--model", tmp_path / "ratio.onnx", "--parquet", futures, "--out", out, "--time-col",
                     "ts_event", "--threads", "1")
    assert done.returncode == 0, done.stderr
    scored = pq.read_table(out)
    adjusted = {(s, int(t)): p for s, t, p in zip(bars.front["symbol"].to_pylist(),
                                                  bars.front["ts_event"].cast(pa.int64()).to_numpy(),
                                                  bars.front["close"].to_numpy(), strict=True)}
    origin = scored["origin"].cast(pa.int64()).to_numpy()
    np.testing.assert_allclose(scored["close"].to_numpy(),
                               [adjusted[(s, int(t))] for s, t in zip(scored["symbol"].to_pylist(), origin,
                                                                       strict=True)], rtol=1e-12)

    write_model(tmp_path / "plain.onnx", replace(config, contracts=None), interval_ns=60 * 10**9)
    plain = tmp_path / "plain.parquet"
    done = run_score("--model", tmp_path / "plain.onnx", "--parquet", one_symbol(bars.front, tmp_path / "bars.parquet"),
                     "--out", plain, "--time-col", "ts_event", "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(plain).column_names == [n for n in scored.column_names if n != "contract"]
    assert "contracts:" not in done.stderr


def test_the_client_sends_a_roots_contracts_for_the_server_to_roll_or_one_contracts_own_bars(
        trained: tuple[Path, Path, ContractBars], tmp_path: Path) -> None:
    model, futures, bars = trained
    out = tmp_path / "forecasts.parquet"
    assert run_score("--model", model, "--parquet", futures, "--out", out, "--threads", "1").returncode == 0
    scored = pq.read_table(out)
    origin = day_ns(10) + 10 * 60 * 10**9  # ESZ5 is ES's front from day 10 on: a window across the roll
    assert bars.rolls[2] == f"ES {iso(day_ns(10))[:16].replace('T', ' ')} UTC: ESU5 -> ESZ5"
    at = scored.filter(pc.and_(pc.equal(scored["symbol"], "ES"),
                               pc.equal(scored["origin"].cast(pa.int64()), origin)))
    assert at["contract"].to_pylist() == ["ESZ5"] * at.num_rows
    for server in serving(model, tmp_path / "server.log"):
        stub = pb_grpc.ForecasterStub(server.channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.roll_rule.startswith("roll volume")
        root = request_from_bars(futures, info, "ES", origin=iso(origin)).series[0]
        # every ES contract's bars from the session before the latest bars_required bar times (40: days 9 and 10)
        assert root.symbol == "ES" and root.timestamp_ns[0] == day_ns(8) and root.timestamp_ns[-1] == origin
        assert len(root.contracts) == len(root.timestamp_ns) == 4 * 60 + 11
        assert sorted(set(root.contracts)) == ["ESU5", "ESZ5"]
        got = forecast_arrays(stub.Predict(pb.PredictRequest(series=[root]), timeout=10).forecasts[0])
        assert got.symbol == "ES" and got.last_timestamp_ns == origin
        np.testing.assert_allclose(got.log_return, quantiles(at, at.num_rows)[0], rtol=0, atol=1e-6)
        assert got.last_close == at["close"][0].as_py()  # ESZ5's own close

        one = request_from_bars(futures, info, "ESZ5", origin=iso(origin)).series[0]
        own = bars.table.filter(pc.equal(bars.table["symbol"], "ESZ5"))["ts_event"].cast(pa.int64()).to_numpy()
        assert one.symbol == "ESZ5" and not one.contracts
        np.testing.assert_array_equal(one.timestamp_ns, own[own <= origin][-info.bars_required:])
        answer = stub.Predict(pb.PredictRequest(series=[one]), timeout=10).forecasts[0]
        assert answer.symbol == "ESZ5" and answer.last_timestamp_ns == origin

        done = run_client(server.target, "--parquet", futures, "--symbol", "CLZ5")
        assert done.returncode == 2
        assert done.stderr == "error: the model does not know symbol 'CLZ5' (it knows ES, NQ or a contract of one)\n"
        done = run_client(server.target, "--info")
        assert done.returncode == 0 and "\ncontracts          roll volume, adjust none, volume front; contract names " \
            "-> roots by root + month code" in done.stdout, done.stdout
        assert "; --symbol takes a root or any contract of one\n" in done.stdout
