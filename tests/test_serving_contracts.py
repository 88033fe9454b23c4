"""Serving a model trained on futures contracts: a request names a root or any contract of one (ESU5 -> ES, never
seen in training), its bars may span a roll with each bar's contract given, and the server rolls them as training
does (`features.rolls`); GetModelInfo names the contract pattern and the roll rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from features.bars import Bars
from features.compute import build_frame
from features.config import FeatureConfig
from features.contracts import CONTRACT_PATTERN, ContractConfig
from features.model_meta import ModelMeta
from features.rolls import continuous
from features.windows import gather_windows
from serving.errors import RequestError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.model import load_model
from serving.preprocess import prepare
from serving.servicer import Limits, model_info
from serving.validation import parse_request
from serving.wire import forecast_arrays, make_series
from tests.futures_bars import (
    ES_LEGS,
    LIVE_PER_DAY,
    MINUTE,
    ROLL_SESSION,
    as_bars,
    contract_rows,
    request_series,
    session_start,
    window_rows,
)
from tests.live_server import ContractsModel, LiveServer, contracts_model, serving  # noqa: F401  (fixture)


def adjusted(bars: Bars, fc: FeatureConfig) -> Bars:
    """The bars' continuous series with ratio back-adjusted prices (features.rolls.continuous, --adjust ratio)."""
    assert fc.contracts is not None
    out, _ = continuous(bars, dataclasses.replace(fc, contracts=dataclasses.replace(fc.contracts, adjust="ratio")))
    return out


# ---- the request path without a model ------------------------------------------------------------------------
FC = FeatureConfig(horizon=3, volatility_window=5, contracts=ContractConfig())
META = ModelMeta(
    model_config={}, feature_config=FC, feature_schema=FC.schema(), quantiles=(0.1, 0.5, 0.9), horizon=3,
    encoder_length=4, bar_interval_ns=MINUTE, symbols=("ES", "NQ"), checkpoint_sha256="0" * 64,
    model_version="unit", explain=False, precision="fp32",
)
PER_DAY = 6
ES = contract_rows(ES_LEGS, PER_DAY, seed=1, base=5000.0)
SPAN = as_bars(ES, window_rows(ES, PER_DAY, last_bar=3))  # both contracts' bars around the roll


def test_bars_spanning_a_roll_are_served_as_training_windows() -> None:
    """The window of a request whose bars span ESM5 -> ESU5 (each bar's contract given) is bit for bit the
    window training builds at that bar from the same per-contract bars (continuous + build_frame)."""
    served = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", SPAN, contracts=True)]), META),
                     META)
    rolled, rolls = continuous(SPAN, FC)
    assert [(r.old, r.new) for r in rolls] == [("ESM5", "ESU5")] and rolled.contract is not None
    assert set(rolled.contract[-META.bars_required:]) == {"ESM5", "ESU5"}  # the window spans the roll
    frame = build_frame(rolled, FC, symbols=list(META.symbols), bar_interval_ns=MINUTE, targets=False)
    trained = gather_windows(frame, np.array([len(rolled) - 1]), META.encoder_length)
    for name, value in served.inputs.items():
        np.testing.assert_array_equal(value, trained[name], err_msg=name)
    last = SPAN.close[SPAN.symbol == "ESU5"][-1]
    assert served.last_close.tolist() == [last]  # the front's own close, not adjusted
    assert served.symbols == ["ES"]


def test_a_roll_request_equals_a_request_of_the_ratio_adjusted_series() -> None:
    with_contracts = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", SPAN, True)]), META), META)
    flat = adjusted(SPAN, FC)
    plain = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", flat, False)]), META), META)
    for name, value in plain.inputs.items():
        np.testing.assert_allclose(with_contracts.inputs[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # the front's bars as one series with their own prices (no roll offsets): the 3% gap enters a return
    naive = dataclasses.replace(continuous(SPAN, FC)[0], log_offset=None)
    gap = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", naive, False)]), META), META)
    assert not np.allclose(gap.inputs["encoder_observed"], plain.inputs["encoder_observed"], rtol=1e-3)


def test_a_roll_without_the_new_contracts_previous_bar_is_served_with_a_warning() -> None:
    """An expiring contract's last session, then the next one's bars from the following session (as a vendor's
    file of expired contracts has them): the roll's return is taken against the roll bar's open, and the
    forecast says so and how to send the previous bar."""
    roll = session_start(ROLL_SESSION)
    keep = ((ES["symbol"] == "ESM5") & (ES["ts_event"] < roll)) | ((ES["symbol"] == "ESU5") & (ES["ts_event"] >= roll))
    cut = as_bars(ES, np.intersect1d(window_rows(ES, PER_DAY, last_bar=3), np.flatnonzero(keep)))
    served = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", cut, True)]), META), META)
    assert len(served.notes[0]) == 1
    assert "roll ESM5 -> ESU5" in served.notes[0][0] and "send ESU5's previous bar" in served.notes[0][0]
    whole = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", SPAN, True)]), META), META)
    assert whole.notes == [()]  # ESU5's earlier bars were sent


def test_a_contract_never_trained_on_is_served_as_its_root() -> None:
    """ESU5's own bars, named ESU5 (no contracts column), are the ES series: the same model inputs as for ES."""
    own = as_bars(ES, np.flatnonzero(ES["symbol"] == "ESU5")[-20:])
    by_contract = prepare(parse_request(pb.PredictRequest(series=[request_series("ESU5", own, False)]), META), META)
    by_root = prepare(parse_request(pb.PredictRequest(series=[request_series("ES", own, False)]), META), META)
    for name, value in by_root.inputs.items():
        np.testing.assert_array_equal(by_contract.inputs[name], value, err_msg=name)
    assert by_contract.inputs["static_categorical"].tolist() == [[0]]  # ES's id
    assert by_contract.symbols == ["ESU5"]  # the forecast carries the name sent


def _refusal(*series: pb.Series, meta: ModelMeta = META) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(pb.PredictRequest(series=list(series)), meta)
    return info.value


def _renamed(s: pb.Series, symbol: str) -> pb.Series:
    out = pb.Series()
    out.CopyFrom(s)
    out.symbol = symbol
    return out


ROOTS = "the model knows the roots ES, NQ: send one of them or a contract of one (contract names are read as " \
    + CONTRACT_PATTERN + ")"
SPAN_SERIES = request_series("ES", SPAN, contracts=True)


@pytest.mark.parametrize(("series", "message", "field"), [
    (_renamed(SPAN_SERIES, "CLZ5"),
     f"series[0]: unknown symbol 'CLZ5' (a contract of root CL, which the model was not trained on); {ROOTS}",
     "series[0].symbol"),
    (_renamed(SPAN_SERIES, "CL"), f"series[0]: unknown symbol 'CL'; {ROOTS}", "series[0].symbol"),
    (_renamed(SPAN_SERIES, "NQU5"), "series[0] (NQU5): contracts holds 'ESM5', a contract of root ES, not NQ; "
                                    "send only the bars of NQ's contracts", "series[0].contracts"),
], ids=["contract of an unknown root", "unknown root", "contracts of another root"])
def test_a_name_of_no_known_root_is_refused_naming_the_roots(series: pb.Series, message: str, field: str) -> None:
    error = _refusal(series)
    assert str(error) == message
    assert [f for f, _ in error.violations] == [field]


def test_contracts_of_the_wrong_count_are_refused() -> None:
    s = request_series("ES", SPAN, contracts=True)
    del s.contracts[-2:]
    error = _refusal(s)
    assert str(error) == (f"series[0] (ES): contracts has {len(SPAN) - 2} names, timestamp_ns has {len(SPAN)} bars; "
                          "send one contract name per bar (or none: the bars are then one continuous series)")
    assert [f for f, _ in error.violations] == ["series[0].contracts"]


def test_a_root_comes_once_per_request_whatever_it_is_named() -> None:
    own = as_bars(ES, np.flatnonzero(ES["symbol"] == "ESU5")[-20:])
    error = _refusal(request_series("ES", SPAN, True), request_series("ESU5", own, False))
    assert str(error) == ("series[1]: symbol 'ESU5' (root ES) already appears in series[0]; send each root at most "
                          "once per request")


def test_a_roll_rule_error_is_the_requests_one_line() -> None:
    """`--roll none` takes the bars as continuous: two contracts at one bar is front_rows' error, as the request's."""
    meta = dataclasses.replace(META, feature_config=dataclasses.replace(FC, contracts=ContractConfig(roll="none")))
    error = _refusal(SPAN_SERIES, meta=meta)
    assert str(error) == ("series[0] (ES): root ES at 2025-04-09 14:00 UTC: ESM5 and ESU5 both claim the bar as "
                          "front, and --roll none takes the file as continuous already; choose the front with --roll "
                          "volume or --roll calendar:N")
    assert "\n" not in str(error) and [f for f, _ in error.violations] == ["series[0].contracts"]


def test_each_contracts_bars_must_increase() -> None:
    s = request_series("ES", SPAN, contracts=True)
    at = [i for i, c in enumerate(s.contracts) if c == "ESU5"][:2]
    s.timestamp_ns[at[1]] = s.timestamp_ns[at[0]]
    error = _refusal(s)
    assert str(error).startswith("series[0] (ES), contract 'ESU5': column 'timestamp_ns', row 1")
    assert "duplicate timestamp" in str(error)


def test_a_plain_model_refuses_contracts_and_serves_as_before() -> None:
    plain = dataclasses.replace(META, feature_config=dataclasses.replace(FC, contracts=None))
    assert "this model was not trained on futures contracts" in str(_refusal(SPAN_SERIES, meta=plain))
    own = request_series("ESU5", as_bars(ES, np.flatnonzero(ES["symbol"] == "ESU5")[-20:]), False)
    assert str(_refusal(own, meta=plain)) == "series[0]: unknown symbol 'ESU5'; the model knows ES, NQ"
    assert len(parse_request(pb.PredictRequest(series=[_renamed(own, "ES")]), plain)[0]) == plain.bars_required


def test_make_series_sends_one_contract_per_bar() -> None:
    s = request_series("ES", SPAN, contracts=True)
    assert list(pb.Series.FromString(s.SerializeToString()).contracts) == SPAN.symbol.tolist()
    with pytest.raises(ValueError, match=rf"contracts has shape \(2,\), timestamp_ns has {len(SPAN)} bars; give one "
                                         "contract name per bar"):
        make_series("ES", SPAN.timestamp_ns, SPAN.open, SPAN.high, SPAN.low, SPAN.close, SPAN.volume,
                    contracts=["ESM5", "ESU5"])


# ---- a real model and server ----------------------------------------------------------------------------------
@dataclass
class Live:
    model: Path
    meta: ModelMeta
    es: dict[str, np.ndarray]  # every ES contract's bars, those after training included
    server: LiveServer


@pytest.fixture(scope="module")
def live(contracts_model: ContractsModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:  # noqa: F811
    """The shared model trained on ESH5, ESM5, NQH5 and NQM5 bars (tests.live_server), served."""
    m = contracts_model
    for server in serving(m.model, tmp_path_factory.mktemp("serving_contracts") / "server.log"):
        yield Live(m.model, m.meta, m.es, server)


def _predict(s: Live, series: pb.Series) -> pb.Forecast:
    return s.server.stub.Predict(pb.PredictRequest(series=[series]), timeout=30).forecasts[0]


def test_live_model_forecasts_roots_and_says_how_it_rolls(live: Live) -> None:
    assert live.meta.symbols == ("ES", "NQ")
    info = live.server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.symbols) == ["ES", "NQ"]
    assert info.contract_pattern == CONTRACT_PATTERN
    assert info.roll_rule == ("roll volume, adjust none, volume front; contract names -> roots by "
                              + CONTRACT_PATTERN)
    loaded = load_model(live.model, "cpu", threads=1)
    plain = dataclasses.replace(loaded, meta=dataclasses.replace(loaded.meta, feature_config=dataclasses.replace(
        loaded.meta.feature_config, contracts=None)))
    limits = Limits(max_batch=8, max_message_bytes=4 << 20, max_concurrent=4)
    assert (model_info(plain, limits).contract_pattern, model_info(plain, limits).roll_rule) == ("", "")


def test_live_a_contract_never_trained_on_gets_its_roots_forecast(live: Live) -> None:
    own = as_bars(live.es, np.flatnonzero(live.es["symbol"] == "ESU5")[-2 * live.meta.bars_required:])
    by_contract = _predict(live, request_series("ESU5", own, contracts=False))
    by_root = _predict(live, request_series("ES", own, contracts=False))
    assert by_contract.symbol == "ESU5" and by_contract.last_close == own.close[-1]
    np.testing.assert_array_equal(forecast_arrays(by_contract).log_return, forecast_arrays(by_root).log_return)


def test_live_bars_spanning_a_roll_equal_the_ratio_adjusted_series(live: Live) -> None:
    """Both contracts' bars with their contract names give the forecast of the same bars rolled and ratio
    back-adjusted by features.rolls, sent as one series; prices are the front's own."""
    span = as_bars(live.es, window_rows(live.es, LIVE_PER_DAY, last_bar=9))
    rolled, rolls = continuous(span, live.meta.feature_config)
    assert [(r.old, r.new) for r in rolls] == [("ESM5", "ESU5")] and rolled.contract is not None
    assert set(rolled.contract[-live.meta.bars_required:]) == {"ESM5", "ESU5"}  # the window spans the roll
    with_contracts = forecast_arrays(_predict(live, request_series("ES", span, contracts=True)))
    flat = forecast_arrays(_predict(live, request_series("ES", adjusted(span, live.meta.feature_config), False)))
    assert np.allclose(with_contracts.log_return, flat.log_return, rtol=1e-5, atol=1e-7)
    last = span.close[span.symbol == "ESU5"][-1]
    assert with_contracts.last_close == last
    np.testing.assert_allclose(with_contracts.price, last * np.exp(with_contracts.log_return), rtol=1e-12)


def test_live_an_unknown_root_or_a_miscounted_contracts_column_is_invalid_argument(live: Live) -> None:
    span = as_bars(live.es, window_rows(live.es, LIVE_PER_DAY, last_bar=9))
    short = request_series("ES", span, contracts=True)
    del short.contracts[-1]
    for series, message in ((_renamed(request_series("ES", span, False), "CLZ5"),
                             "series[0]: unknown symbol 'CLZ5' (a contract of root CL, which the model was not "
                             f"trained on); {ROOTS}"),
                            (short, f"series[0] (ES): contracts has {len(span) - 1} names, timestamp_ns has "
                                    f"{len(span)} bars; send one contract name per bar")):
        with pytest.raises(grpc.RpcError) as err:
            _predict(live, series)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
