"""Hostile input on a request's fields, each in the shape that once failed: limits refused INVALID_ARGUMENT before
any array is built (naming the field, the limit and the value), every column length-checked, the model's or not,
no silent aliasing of names, bounded warnings, undecodable bytes as the caller's error, and a non-finite output
traced to the inputs that caused it."""

from __future__ import annotations

import dataclasses
import threading
import tracemalloc
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from features.model_meta import ModelMeta
from serving.errors import RequestError
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.gen.foxhunt.tft.v1 import forecaster_pb2_grpc as pb_grpc
from serving.limits import MAX_COLUMNS, MAX_TEXT_CHARS
from serving.preprocess import nonfinite_output_problem, prepare
from serving.servicer import decode_request
from serving.validation import parse_request
from tests.futures_bars import LIVE_PER_DAY, as_bars, request_series, window_rows
from tests.live_server import ContractsModel, LiveServer, contracts_model, serving  # noqa: F401  (fixture)
from tests.test_serving_contracts import ES
from tests.test_serving_contracts import META as FUTURES_META
from tests.test_serving_covariates import META as COVARIATES_META
from tests.test_serving_units import META as PLAIN_META
from tests.test_serving_units import series as plain_series
from tests.worst_requests import crowded_contracts_request

H = COVARIATES_META.horizon
MiB = 1 << 20


def covariates_series(n: int = COVARIATES_META.bars_required) -> pb.Series:
    """n valid bars with every column the covariates model reads."""
    s = plain_series(n=n)  # with the observed real 'spread'
    s.user_features.add(name="event", values=[0.0] * n)
    s.future_features.add(name="event", values=[0.0] * H)
    s.categorical_features.add(name="regime", values=["calm"] * n)
    s.categorical_features.add(name="session", values=["us"] * n)
    s.future_categorical_features.add(name="session", values=["us"] * H)
    s.static_features["scale"] = 1.25
    s.static_categorical_features["exchange"] = "CME"
    return s


def contract_series(n: int = 50) -> pb.Series:
    """n valid bars of one contract, ESM5, each named in `contracts`."""
    return request_series("ES", as_bars(ES, np.flatnonzero(ES["symbol"] == "ESM5")[-n:]), contracts=True)


def refusal(series: pb.Series, meta: ModelMeta) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(pb.PredictRequest(series=[series]), meta)
    return info.value


def peak_bytes_refused(series: pb.Series, meta: ModelMeta) -> tuple[RequestError, int]:
    """The refusal of `series` and the most memory its parsing held at once (tracemalloc counts numpy's too)."""
    request = pb.PredictRequest(series=[series])
    tracemalloc.start()
    try:
        with pytest.raises(RequestError) as info:
            parse_request(request, meta)
        error = info.value
        return error, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_well_formed_requests_these_tests_break_are_served() -> None:
    assert len(parse_request(pb.PredictRequest(series=[covariates_series(200)]), COVARIATES_META)[0]) \
        == COVARIATES_META.bars_required
    assert len(parse_request(pb.PredictRequest(series=[contract_series()]), FUTURES_META)[0]) \
        == FUTURES_META.bars_required


def test_thirty_thousand_labels_and_one_of_four_million_characters_build_no_array() -> None:
    """A categorical_features list of 30,000 short strings and one of 3.9 million characters once asked numpy for
    30,000 x 3.9e6 x 4 bytes: refused by its count before any array."""
    s = covariates_series()
    labels = ["calm"] * 30_000
    labels[17_000] = "x" * 3_900_000
    s.categorical_features[0].values[:] = labels
    error, peak = peak_bytes_refused(s, COVARIATES_META)
    assert str(error) == (f"series[0] (ES): categorical_features column 'regime' has 30000 labels; it needs exactly "
                          f"{COVARIATES_META.bars_required} labels, one per bar sent (len(timestamp_ns))")
    assert error.violations[0][0] == "series[0].categorical_features"
    assert peak < MiB


@pytest.mark.parametrize("field", ["categorical_features", "contracts"])
def test_a_label_or_contract_name_of_a_million_characters_is_refused_by_the_limit(field: str) -> None:
    """A 10^6-character label on 200 bars once held 1.15 GB; a contract name alike held the server 11 s."""
    if field == "contracts":
        s, meta, what = contract_series(100), FUTURES_META, "contract name (value 99)"
        s.contracts[-1] = "ESM5" + "x" * 999_996
    else:
        s, meta, what = covariates_series(200), COVARIATES_META, "categorical_features 'regime' label (value 199)"
        s.categorical_features[0].values[-1] = "x" * 1_000_000
    error, peak = peak_bytes_refused(s, meta)
    head = "'ESM5xxxxxxxxxxxx'" if field == "contracts" else "'xxxxxxxxxxxxxxxx'"
    assert str(error).startswith(f"series[0] (ES): {what} {head}... is 1000000 characters; the limit is "
                                 f"{MAX_TEXT_CHARS} (GetModelInfo.max_text_chars)")
    assert error.violations[0][0] == f"series[0].{field}" and len(str(error)) < 400
    assert peak < MiB


def test_an_unused_label_column_of_another_length_is_refused_on_a_contract_model() -> None:
    """50 bars of one contract with `contracts`, and an empty categorical_features column the model does not read:
    once an IndexError (INTERNAL) when the bars were rolled."""
    s = contract_series(50)
    s.categorical_features.add(name="regime", values=[])
    error = refusal(s, FUTURES_META)
    assert str(error) == ("series[0] (ES): categorical_features column 'regime' has 0 labels; it needs exactly 50 "
                          "labels, one per bar sent (len(timestamp_ns))")


@pytest.mark.parametrize(("field", "values"), [("user_features", []), ("future_features", [1.0] * (H + 1)),
                                               ("future_categorical_features", ["a"] * (H - 1))])
def test_every_column_of_every_field_is_counted_read_or_not(field: str, values: list[float] | list[str]) -> None:
    s = plain_series()
    getattr(s, field).add(name="unread", values=values)
    count = len(values)
    error = refusal(s, PLAIN_META)
    assert f"{field} column 'unread' has {count}" in str(error)
    assert error.violations[0][0] == f"series[0].{field}"


def test_unread_columns_are_served_and_named_in_the_warnings_as_a_short_prefix() -> None:
    s = covariates_series()
    s.user_features.add(name="imbalance", values=[0.5] * len(s.timestamp_ns))
    s.static_categorical_features["y" * MAX_TEXT_CHARS] = "z"
    notes = prepare(parse_request(pb.PredictRequest(series=[s]), COVARIATES_META), COVARIATES_META).notes[0]
    assert notes == (
        "user_features column(s) 'imbalance' not read by this model, ignored (GetModelInfo.features lists the "
        "columns it reads)",
        f"static_categorical_features column(s) {'y' * 24!r}... (64 characters) not read by this model, ignored "
        "(GetModelInfo.features lists the columns it reads)")


def test_an_unseen_label_is_quoted_as_a_short_prefix() -> None:
    s = covariates_series()
    s.categorical_features[0].values[-1] = "w" * MAX_TEXT_CHARS
    notes = prepare(parse_request(pb.PredictRequest(series=[s]), COVARIATES_META), COVARIATES_META).notes[0]
    assert notes == (f"categorical feature 'regime': {'w' * 24!r}... (64 characters) not seen in training; forecast "
                     "with the unknown category",)


@pytest.mark.parametrize(("where", "value", "code"), [
    ("static_categorical_features", "CME\x00", "U+0000"),
    ("categorical_features", "calm\x00", "U+0000"),
    ("contracts", "ESM5\x00", "U+0000"),
    ("symbol", "ES\u202e", "U+202E"),
    ("categorical_features", "calm\u2028", "U+2028"),
])
def test_a_name_or_label_with_a_character_that_is_not_printable_is_refused(where: str, value: str,
                                                                           code: str) -> None:
    """"CME\\x00" was read as CME: numpy's fixed-width strings drop trailing NULs."""
    s, meta = (contract_series(), FUTURES_META) if where == "contracts" else (covariates_series(), COVARIATES_META)
    if where == "static_categorical_features":
        s.static_categorical_features["exchange"] = value
    elif where == "categorical_features":
        s.categorical_features[0].values[3] = value
    elif where == "contracts":
        s.contracts[7] = value
    else:
        s.symbol = value
    error = refusal(s, meta)
    assert f"holds {code}, which is not printable: send names and labels of at most {MAX_TEXT_CHARS} printable " \
           "characters" in str(error)
    assert error.violations[0][0] == f"series[0].{where}" if where != "symbol" else "series[0]"


@pytest.mark.parametrize("name", ["ESM４", "ESM٤", "ＥSM4"])
def test_a_contract_name_with_digits_of_another_script_names_no_root(name: str) -> None:
    """Full-width and Arabic-Indic digits were read as ESM4: names are compared exactly, a year is ASCII digits."""
    s = contract_series()
    s.contracts[7] = name
    assert f"contracts holds {name!r}, which names no root" in str(refusal(s, FUTURES_META))
    s = contract_series()
    s.symbol = name
    assert str(refusal(s, FUTURES_META)).startswith(f"series[0]: unknown symbol {name!r}; the model knows the roots")


def test_a_label_in_another_script_is_a_label_unseen_in_training() -> None:
    s = covariates_series()
    s.categorical_features[0].values[-1] = "ｃａｌｍ"  # full-width: not 'calm'
    notes = prepare(parse_request(pb.PredictRequest(series=[s]), COVARIATES_META), COVARIATES_META).notes[0]
    assert notes == ("categorical feature 'regime': 'ｃａｌｍ' not seen in training; forecast with the unknown "
                     "category",)


def test_more_columns_in_a_field_than_the_limit_are_refused_before_their_values_are_read() -> None:
    s = covariates_series()
    s.user_feature_names.extend(f"c{k}" for k in range(MAX_COLUMNS + 1))
    error = refusal(s, COVARIATES_META)
    assert str(error).startswith(f"series[0] (ES): user_feature_names holds {MAX_COLUMNS + 1} columns; the limit is "
                                 f"{MAX_COLUMNS} per field (GetModelInfo.max_columns)")


def test_more_series_than_symbols_stop_at_the_first_repeated_one() -> None:
    request = pb.PredictRequest(series=[plain_series("ES")] * 100_000)
    with pytest.raises(RequestError, match=r"^series\[1\]: symbol 'ES' already appears in series\[0\]"):
        parse_request(request, PLAIN_META)


@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x05\x0a\x03ES", b"\x12\x80"])
def test_bytes_that_are_not_a_predict_request_are_the_callers_error(data: bytes) -> None:
    with pytest.raises(RequestError) as info:
        decode_request(data)
    assert str(info.value).startswith(f"the request's {len(data)} bytes are not a foxhunt.tft.v1.PredictRequest (")
    assert str(info.value).endswith("send one serialised from foxhunt/tft/v1/forecaster.proto")


def test_a_non_finite_output_names_the_inputs_far_outside_their_training_range() -> None:
    """3.4e38 in a known feature's future value is within float32's range, so it is served, and the model's output
    overflows: the error names that column, not only the series."""
    schema = COVARIATES_META.feature_schema
    stats = {"observed": {"mean": [0.0] * len(schema.observed), "std": [1.0] * len(schema.observed)},
             "known": {"mean": [0.0] * len(schema.known), "std": [2.0] * len(schema.known)},
             "static": {"mean": [1.0], "std": [0.5]}}
    meta = dataclasses.replace(COVARIATES_META, input_stats=stats)
    s = covariates_series()
    s.future_features[0].values[1] = 3.4e38
    series = parse_request(pb.PredictRequest(series=[s]), meta)
    error = nonfinite_output_problem(prepare(series, meta), 0, series[0], "quantiles", meta)
    assert str(error) == ("series[0] (ES): the model's output 'quantiles' is not finite for these bars: input(s) "
                          "'event' lie orders of magnitude (over 1000 standard deviations) outside the training "
                          "range; check those columns")
    unknown = dataclasses.replace(COVARIATES_META, input_stats={})  # a model exported without the statistics
    assert "check the bars for extreme prices" in str(nonfinite_output_problem(prepare(series, unknown), 0,
                                                                               series[0], "quantiles", unknown))


# ---- a live server ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def contracts_server(contracts_model: ContractsModel,  # noqa: F811
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from serving(contracts_model.model, tmp_path_factory.mktemp("limits") / "server.log")


@pytest.mark.slow
def test_the_worst_request_the_limits_allow_leaves_well_formed_calls_answered(
        contracts_model: ContractsModel, contracts_server: LiveServer) -> None:  # noqa: F811
    """4 MiB of valid bars over 1,200 contracts, sent again and again beside well-formed calls: each is answered
    OK (how much longer the others wait: benchmarks.worst_request, BENCHMARKS.md)."""
    m, server = contracts_model, contracts_server
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (info.max_text_chars, info.max_columns) == (MAX_TEXT_CHARS, MAX_COLUMNS)
    worst = crowded_contracts_request("ES", info.max_message_bytes)
    good = pb.PredictRequest(series=[request_series(
        "ES", as_bars(m.es, window_rows(m.es, LIVE_PER_DAY, last_bar=9)), contracts=True)])
    answered, stop, codes = threading.Event(), threading.Event(), list[str]()

    def hammer() -> None:
        with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            stub = pb_grpc.ForecasterStub(channel)
            while not stop.is_set():
                try:
                    codes.append("OK" if stub.Predict(worst, timeout=60).forecasts else "empty")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
                answered.set()

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        assert answered.wait(60)
        answers = [server.stub.Predict(good, timeout=30) for _ in range(20)]
    finally:
        stop.set()
        thread.join(60)
    assert all(len(a.forecasts) == 1 for a in answers) and set(codes) == {"OK"}, codes
    assert server.alive() and "Traceback" not in server.log_text()
