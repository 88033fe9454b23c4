"""Serving a model with known, static and categorical user features: the request's new fields, their checks, the
model inputs built from them (equal to training's windows), unseen labels as warnings, and GetModelInfo."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from features.bars import Bars
from features.compute import FeatureFrame, build_frame
from features.config import FeatureConfig
from features.model_meta import ModelMeta
from features.schema import (
    DECODER_KNOWN,
    ENCODER_OBSERVED,
    MODEL_INPUTS,
    QUANTILES,
    STATIC_CATEGORICAL,
    STATIC_REAL,
    TARGET,
)
from features.windows import anchor_rows, gather_windows
from serving.errors import RequestError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.model import dummy_inputs
from serving.postprocess import build_response
from serving.preprocess import prepare
from serving.servicer import features_info
from serving.validation import parse_request
from serving.wire import forecast_arrays, make_series
from tests.live_server import CovariatesModel, LiveServer, covariates_model, covariates_series, serving  # noqa: F401  (fixture)
from tests.test_serving_units import META as PLAIN_META

H, L, INTERVAL = 3, 4, 60_000_000_000
FC = FeatureConfig(
    horizon=H, volatility_window=5, user_columns=("spread", "regime"), known_columns=("event", "session"),
    static_columns=("scale", "exchange"), categorical_columns=("regime", "session", "exchange"),
    vocabularies=(("regime", ("calm", "wild")), ("session", ("asia", "us")), ("exchange", ("CME", "EUREX"))))
META = ModelMeta(
    model_config={}, feature_config=FC, feature_schema=FC.schema(), quantiles=(0.1, 0.5, 0.9), horizon=H,
    encoder_length=L, bar_interval_ns=INTERVAL, symbols=("ES", "NQ"), checkpoint_sha256="0" * 64,
    model_version="unit", explain=False, precision="fp32",
)
NEED = META.bars_required  # 5 warm-up + 4 encoder bars
PER_SYMBOL = 30
EXCHANGE = {"ES": "CME", "NQ": "EUREX"}
SCALE = {"ES": 1.25, "NQ": 0.7}


def unit_bars(seed: int = 0) -> Bars:
    """30 one-minute bars of ES then NQ with every kind of user column."""
    rng = np.random.default_rng(seed)
    n, symbols = PER_SYMBOL, ("ES", "NQ")
    close = 100 * np.exp(np.cumsum(rng.normal(0, 1e-3, 2 * n)))
    open_ = np.concatenate([[close[0]], close[:-1]])
    ts = np.tile(1_704_103_200_000_000_000 + INTERVAL * np.arange(n, dtype=np.int64), 2)
    symbol = np.repeat(np.array(symbols, dtype=object), n)
    return Bars(ts, symbol, open_, np.maximum(open_, close) * 1.001, np.minimum(open_, close) * 0.999, close,
                rng.uniform(10, 1000, 2 * n),
                user={"spread": rng.uniform(0.1, 0.5, 2 * n), "event": (rng.random(2 * n) < 0.3).astype(np.float64),
                      "scale": np.repeat([SCALE[s] for s in symbols], n)},
                labels={"regime": rng.choice(np.array(["calm", "wild"], dtype=object), 2 * n),
                        "session": rng.choice(np.array(["asia", "us"], dtype=object), 2 * n),
                        "exchange": np.repeat(np.array([EXCHANGE[s] for s in symbols], dtype=object), n)})


def series_at(bars: Bars, symbol: str, row: int, packed: bool = True) -> pb.Series:
    """The request for the window at `row` of `symbol`'s bars: its last NEED bars, and the H bars after it as the
    known columns' future values."""
    start = bars.series_slices()[symbol].start
    past, future = slice(start + row - NEED + 1, start + row + 1), slice(start + row + 1, start + row + 1 + H)
    return make_series(
        symbol, bars.timestamp_ns[past], bars.open[past], bars.high[past], bars.low[past], bars.close[past],
        bars.volume[past], {"spread": bars.user["spread"][past], "event": bars.user["event"][past]}, packed=packed,
        future={"event": bars.user["event"][future]},
        labels={"regime": bars.labels["regime"][past], "session": bars.labels["session"][past]},
        future_labels={"session": bars.labels["session"][future]},
        static={"scale": SCALE[symbol], "exchange": EXCHANGE[symbol]})


def test_served_windows_equal_the_trainers_bit_for_bit() -> None:
    """prepare() on requests gives exactly what build_frame + gather_windows give the trainer at those bars, every
    input the model takes (static ids and reals, categorical ids, known values of the future bars), alone and in a
    batch, packed or not."""
    bars = unit_bars()
    frame = build_frame(bars, FC, symbols=list(META.symbols), bar_interval_ns=INTERVAL)
    rows = [("ES", NEED - 1), ("NQ", 17), ("ES", PER_SYMBOL - 1 - H)]
    anchors = np.array([bars.series_slices()[s].start + r for s, r in rows])
    trained = gather_windows(frame, anchors, L)
    assert set(trained) - {TARGET} == set(META.feature_schema.model_inputs) == {*MODEL_INPUTS, STATIC_REAL}
    calls = [parse_request(pb.PredictRequest(series=[series_at(bars, s, r, packed=i % 2 == 0)]), META)
             for i, (s, r) in enumerate(rows)]  # one call per window (a symbol comes once per request)
    batch = prepare([s for call in calls for s in call], META)  # the calls of one micro-batch
    assert set(batch.inputs) == set(META.feature_schema.model_inputs)
    for name, value in batch.inputs.items():
        assert value.dtype == trained[name].dtype, name
        np.testing.assert_array_equal(value, trained[name], err_msg=name)
    for i, call in enumerate(calls):
        for name, value in prepare(call, META).inputs.items():
            np.testing.assert_array_equal(value[0], trained[name][i], err_msg=name)
    assert batch.inputs[STATIC_CATEGORICAL].tolist() == [[0, 1], [1, 2], [0, 1]]  # symbol, then exchange (id k + 1)
    assert batch.notes == [(), (), ()]


def test_an_unseen_label_gets_the_unknown_id_and_a_warning() -> None:
    bars = unit_bars()
    s = series_at(bars, "NQ", 20)
    s.categorical_features[0].values[-1] = "storm"  # regime of the last bar
    s.future_categorical_features[0].values[1] = "europe"  # session of the second future bar
    s.static_categorical_features["exchange"] = "ICE"
    s.categorical_features[0].values[0] = "flood"  # a warm-up bar's: the model does not read it, nothing to say
    prepared = prepare(parse_request(pb.PredictRequest(series=[series_at(bars, "ES", 20), s]), META), META)
    observed, known = META.feature_schema.observed, META.feature_schema.known
    assert prepared.inputs[ENCODER_OBSERVED][1, -1, observed.index("regime")] == 0
    assert prepared.inputs[DECODER_KNOWN][1, 1, known.index("session")] == 0
    assert prepared.inputs[STATIC_CATEGORICAL][1].tolist() == [1, 0]
    outputs = {"quantiles": np.zeros((2, H, 3), dtype=np.float32)}
    forecasts = build_response(prepared, outputs, META, "unit", explain=False).forecasts
    assert list(forecasts[0].warnings) == []
    assert list(forecasts[1].warnings) == [
        "series[1] (NQ): categorical feature 'regime': 'storm' not seen in training; forecast with the unknown "
        "category",
        "series[1] (NQ): categorical feature 'session': 'europe' not seen in training; forecast with the unknown "
        "category",
        "series[1] (NQ): categorical feature 'exchange': 'ICE' not seen in training; forecast with the unknown "
        "category"]


def _broken(change: Callable[[pb.Series], object]) -> pb.PredictRequest:
    s = series_at(unit_bars(), "ES", 20)
    change(s)
    return pb.PredictRequest(series=[s])


def _drop(field_name: str, name: str) -> Callable[[pb.Series], object]:
    def change(s: pb.Series) -> None:
        items = getattr(s, field_name)
        kept = [x for x in items if x.name != name]
        del items[:]
        items.extend(kept)
    return change


def _without_packed_row(s: pb.Series, name: str) -> pb.Series:
    names = list(s.user_feature_names)
    block = np.frombuffer(s.user_features_raw, dtype="<f8").reshape(len(names), -1)
    keep = [i for i, n in enumerate(names) if n != name]
    del s.user_feature_names[:]
    s.user_feature_names.extend(names[i] for i in keep)
    s.user_features_raw = block[keep].tobytes()
    return s


CASES: list[tuple[str, Callable[[pb.Series], object], str, str]] = [
    ("future value missing", _drop("future_features", "event"),
     f"series[0] (ES): future_features column(s) 'event' missing; this model needs exactly {H} values, one per "
     "future bar (GetModelInfo.horizon), for each of event", "series[0].future_features"),
    ("H + 1 future values", lambda s: s.future_features[0].values.append(0.0),
     f"series[0] (ES): future_features column 'event' has {H + 1} values; it needs exactly {H} values, one per "
     "future bar (GetModelInfo.horizon)", "series[0].future_features"),
    ("H - 1 future values", lambda s: s.future_features[0].values.pop(),
     f"future_features column 'event' has {H - 1} values; it needs exactly {H} values", "series[0].future_features"),
    ("NaN future value", lambda s: s.future_features[0].values.__setitem__(2, float("nan")),
     "series[0] (ES): future_features column 'event', value 2: nan is not a finite number within float32's range",
     "series[0].future_features"),
    ("categorical missing", _drop("categorical_features", "regime"),
     f"series[0] (ES): categorical_features column(s) 'regime' missing; this model needs exactly {NEED} labels, one "
     "per bar sent (len(timestamp_ns)), for each of regime, session", "series[0].categorical_features"),
    ("a label short", lambda s: s.categorical_features[1].values.pop(),
     f"categorical_features column 'session' has {NEED - 1} labels; it needs exactly {NEED} labels, one per bar "
     "sent", "series[0].categorical_features"),
    ("future labels missing", _drop("future_categorical_features", "session"),
     f"future_categorical_features column(s) 'session' missing; this model needs exactly {H} labels, one per future "
     "bar (GetModelInfo.horizon)", "series[0].future_categorical_features"),
    ("a future label too many", lambda s: s.future_categorical_features[0].values.append("us"),
     f"future_categorical_features column 'session' has {H + 1} labels; it needs exactly {H} labels",
     "series[0].future_categorical_features"),
    ("static real missing", lambda s: s.static_features.clear(),
     "series[0] (ES): static_features lacks 'scale'; this model needs the series' value of each of scale there",
     "series[0].static_features"),
    ("static real infinite", lambda s: s.static_features.__setitem__("scale", float("inf")),
     "static_features column 'scale': inf is not a finite number", "series[0].static_features"),
    ("static label missing", lambda s: s.static_categorical_features.clear(),
     "static_categorical_features lacks 'exchange'", "series[0].static_categorical_features"),
    ("known real's bars missing", lambda s: _without_packed_row(s, "event"),
     "user feature column(s) 'event' missing; this model needs user_features spread, event",
     "series[0].user_feature_names"),
    ("a future column twice", lambda s: s.future_features.add(name="event", values=[0.0] * H),
     "future_features column 'event' is sent twice; send each column once", "series[0].future_features"),
]


@pytest.mark.parametrize(("name", "change", "message", "field"), CASES, ids=[c[0] for c in CASES])
def test_a_missing_or_miscounted_value_names_the_column_and_the_count(
        name: str, change: Callable[[pb.Series], object], message: str, field: str) -> None:
    request = _broken(change)
    with pytest.raises(RequestError) as info:
        parse_request(request, META)
    assert message in str(info.value)
    assert [f for f, _ in info.value.violations] == [field]


def test_a_model_without_user_covariates_serves_the_new_fields_ignored_with_a_warning() -> None:
    """Old clients keep working; the new fields sent to a model without such features change no input, and each
    field's columns are named in the forecast's warnings."""
    from tests.test_serving_units import series as plain_series

    s = plain_series()
    before = prepare(parse_request(pb.PredictRequest(series=[s]), PLAIN_META), PLAIN_META)
    s.future_features.add(name="event", values=[1.0] * PLAIN_META.horizon)
    s.categorical_features.add(name="regime", values=["x"] * len(s.timestamp_ns))
    s.static_features["scale"] = 2.0
    after = prepare(parse_request(pb.PredictRequest(series=[s]), PLAIN_META), PLAIN_META)
    assert set(after.inputs) == set(MODEL_INPUTS)
    assert after.notes == [tuple(f"{field} column(s) {name!r} not read by this model, ignored (GetModelInfo.features "
                                 "lists the columns it reads)" for field, name in (
                                     ("future_features", "event"), ("categorical_features", "regime"),
                                     ("static_features", "scale")))]
    for name, value in before.inputs.items():
        np.testing.assert_array_equal(after.inputs[name], value)


def test_make_series_sends_each_kind_of_value_in_its_field() -> None:
    ts = 1_704_103_200_000_000_000 + INTERVAL * np.arange(3)
    prices = np.array([100.0, 100.5, 101.0])
    s = make_series("ES", ts, prices, prices + 1, prices - 1, prices, np.ones(3), {"spread": [0.1, 0.2, 0.3]},
                    future={"event": [0, 1]}, labels={"regime": np.array([3, 3, 12])},
                    future_labels={"session": ["us", "asia"]}, static={"scale": 2, "exchange": "CME"})
    back = pb.Series.FromString(s.SerializeToString())
    assert [(c.name, list(c.values)) for c in back.future_features] == [("event", [0.0, 1.0])]
    assert [(c.name, list(c.values)) for c in back.categorical_features] == [("regime", ["3", "3", "12"])]
    assert [(c.name, list(c.values)) for c in back.future_categorical_features] == [("session", ["us", "asia"])]
    assert dict(back.static_features) == {"scale": 2.0} and dict(back.static_categorical_features) == {
        "exchange": "CME"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"labels": {"regime": ["a", "b"]}}, "labels 'regime' has shape (2,), timestamp_ns has 3 bars; give one label "
                                         "per bar"),
    ({"labels": {"regime": [1.5, 2.0, 3.0]}}, "labels 'regime' holds 1.5 (float); give labels as str or integers"),
    ({"future": {"event": [[1.0]]}}, "future feature 'event' has shape (1, 1); give a 1-D array"),
    ({"static": {"scale": None}}, "static feature 'scale' is None; give a number (a static real) or a str"),
])
def test_make_series_refuses_values_it_cannot_send(kwargs: dict[str, object], message: str) -> None:
    prices = np.array([100.0, 100.5, 101.0])
    with pytest.raises(ValueError) as info:
        make_series("ES", np.arange(3), prices, prices, prices, prices, np.ones(3), **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_warm_up_inputs_match_the_models_input_list() -> None:
    inputs = dummy_inputs(META, 5)
    assert tuple(inputs) == META.feature_schema.model_inputs
    assert inputs[STATIC_CATEGORICAL].shape == (5, 2) and inputs[STATIC_CATEGORICAL][:, 0].tolist() == [0, 1, 0, 1, 0]
    assert inputs[STATIC_REAL].shape == (5, 1)
    assert tuple(dummy_inputs(PLAIN_META, 2)) == MODEL_INPUTS


def test_model_info_lists_each_feature_with_its_role_and_vocabulary() -> None:
    got = {f.name: (f.role, f.kind, f.source, list(f.vocabulary)) for f in features_info(META)}
    assert got["symbol"] == (pb.FEATURE_ROLE_STATIC, "categorical", "builtin", [])
    assert got["exchange"] == (pb.FEATURE_ROLE_STATIC, "categorical", "user", ["CME", "EUREX"])
    assert got["scale"] == (pb.FEATURE_ROLE_STATIC, "real", "user", [])
    assert got["regime"] == (pb.FEATURE_ROLE_OBSERVED, "categorical", "user", ["calm", "wild"])
    assert got["event"] == (pb.FEATURE_ROLE_KNOWN, "real", "user", [])
    assert got["session"] == (pb.FEATURE_ROLE_KNOWN, "categorical", "user", ["asia", "us"])
    assert got["tod_sin"] == (pb.FEATURE_ROLE_KNOWN, "real", "builtin", [])


# ---- a real model and server ----------------------------------------------------------------------------------
@dataclass
class Live:
    model: Path
    meta: ModelMeta
    bars: Bars
    frame: FeatureFrame
    server: LiveServer


@pytest.fixture(scope="module")
def live(covariates_model: CovariatesModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:  # noqa: F811
    """The shared model with every kind of user input (tests.live_server), served."""
    m = covariates_model
    frame = build_frame(m.bars, m.meta.feature_config, list(m.meta.symbols), m.meta.bar_interval_ns)
    for server in serving(m.model, tmp_path_factory.mktemp("serving_covariates") / "server.log"):
        yield Live(m.model, m.meta, m.bars, frame, server)


def _last_window(s: Live, symbol: str) -> int:
    """The frame row of `symbol`'s last window whose H future bars are in the file."""
    anchors = anchor_rows(s.frame, s.meta.encoder_length, require_targets=False)
    return int(anchors[s.frame.series_id[anchors] == s.meta.symbols.index(symbol)][-1])


def _direct(s: Live, windows: dict[str, np.ndarray]) -> np.ndarray:
    """ONNX Runtime's quantiles [B, H, Q] for the windows, run on the model file without the server."""
    session = ort.InferenceSession(str(s.model), providers=["CPUExecutionProvider"])
    return session.run([QUANTILES], {name: windows[name] for name in s.meta.feature_schema.model_inputs})[0]


def _request(s: Live, anchor: int, **override: object) -> pb.Series:
    """The request for the window at frame row `anchor`, every value from the bars file; `override` replaces one
    of make_series' arguments."""
    return covariates_series(s.meta, s.bars, anchor, **override)


def test_live_model_has_every_input_gated_and_listed(live: Live) -> None:
    session = ort.InferenceSession(str(live.model), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    assert list(inputs) == list(live.meta.feature_schema.model_inputs)
    assert inputs[STATIC_REAL].type == "tensor(float)" and inputs[STATIC_REAL].shape[1] == 1
    assert inputs[STATIC_CATEGORICAL].shape[1] == 2  # the symbol and the exchange
    assert live.meta.parity["passed"] and live.meta.placement  # export's gates ran on these inputs
    assert STATIC_REAL in next((live.model.parent / "triton").rglob("config.pbtxt")).read_text()
    info = live.server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    roles = {f.name: (f.role, f.kind, f.source) for f in info.features}
    assert roles["exchange"] == (pb.FEATURE_ROLE_STATIC, "categorical", "user")
    assert roles["scale"] == (pb.FEATURE_ROLE_STATIC, "real", "user")
    assert roles["event"] == (pb.FEATURE_ROLE_KNOWN, "real", "user")
    assert roles["regime"] == (pb.FEATURE_ROLE_OBSERVED, "categorical", "user")


def test_live_predict_equals_a_direct_onnx_run_of_the_same_windows(live: Live) -> None:
    anchors = np.array([_last_window(live, "ES"), _last_window(live, "NQ")])
    expected = _direct(live, gather_windows(live.frame, anchors, live.meta.encoder_length))  # [2, H, Q]
    response = live.server.stub.Predict(pb.PredictRequest(series=[_request(live, int(a)) for a in anchors]),
                                        timeout=30)
    for forecast, want in zip(response.forecasts, expected, strict=True):
        np.testing.assert_allclose(forecast_arrays(forecast).log_return, want, rtol=1e-6, atol=1e-7)
        assert not list(forecast.warnings)
    info = live.server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert list(info.user_feature_columns) == ["event"]
    assert {f.name: list(f.vocabulary) for f in info.features if f.vocabulary} == {
        "exchange": ["CBOT", "CME"], "regime": ["busy", "calm"], "session": ["close", "open"]}


def test_live_unseen_labels_are_served_as_the_unknown_category_with_warnings(live: Live) -> None:
    anchor, n, h = _last_window(live, "NQ"), live.meta.bars_required, live.meta.horizon
    b = live.bars
    regime = b.labels["regime"][anchor - n + 1:anchor + 1].copy()
    regime[-1] = "storm"
    session = b.labels["session"][anchor + 1:anchor + 1 + h].copy()
    session[0] = "night"
    series = _request(live, anchor, labels={"regime": regime, "session": b.labels["session"][anchor - n + 1:
                                                                                               anchor + 1]},
                      future_labels={"session": session}, static={"scale": 2.5, "exchange": "ICE"})
    forecast = live.server.stub.Predict(pb.PredictRequest(series=[series]), timeout=30).forecasts[0]
    assert list(forecast.warnings) == [
        f"series[0] (NQ): categorical feature {name!r}: {label!r} not seen in training; forecast with the unknown "
        "category" for name, label in (("regime", "storm"), ("session", "night"), ("exchange", "ICE"))]
    windows = gather_windows(live.frame, np.array([anchor]), live.meta.encoder_length)
    schema = live.meta.feature_schema
    windows[ENCODER_OBSERVED][0, -1, schema.observed.index("regime")] = 0  # the unknown id
    windows[DECODER_KNOWN][0, 0, schema.known.index("session")] = 0
    windows[STATIC_CATEGORICAL][0, 1] = 0
    np.testing.assert_allclose(forecast_arrays(forecast).log_return, _direct(live, windows)[0], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize(("future", "message"), [
    ({}, "future_features column(s) 'event' missing; this model needs exactly {h} values, one per future bar"),
    ({"event": np.zeros(4)}, "future_features column 'event' has 4 values; it needs exactly {h} values"),
    ({"event": np.zeros(2)}, "future_features column 'event' has 2 values; it needs exactly {h} values"),
])
def test_live_a_missing_or_miscounted_future_value_is_invalid_argument(live: Live, future: dict[str, np.ndarray],
                                                                       message: str) -> None:
    assert live.meta.horizon == 3  # the counts above are H + 1 and H - 1
    series = _request(live, _last_window(live, "ES"), future=future)
    with pytest.raises(grpc.RpcError) as err:
        live.server.stub.Predict(pb.PredictRequest(series=[series]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message.format(h=live.meta.horizon) in (err.value.details() or "")
