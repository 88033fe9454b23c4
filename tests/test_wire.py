"""serving.wire: numpy columns to a request Series and a Forecast back to arrays, and the README's example
of calling Predict from one's own code, run as it stands against a real server."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.request_from_bars import series_from_bars
from serving.validation import parse_request
from serving.wire import forecast_arrays, make_series
from tests.artifacts import REPO
from tests.live_server import LiveServer, Model, serving, tiny_model  # noqa: F401  (the shared fixture)
from tests.test_serving_units import META, NEED


def bars(n: int = NEED, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 1e-3, n)))
    open_ = np.concatenate([[close[0]], close[:-1]])
    return {"timestamp_ns": 1_704_103_200_000_000_000 + 60_000_000_000 * np.arange(n, dtype=np.int64),
            "open": open_, "high": np.maximum(open_, close) * 1.001, "low": np.minimum(open_, close) * 0.999,
            "close": close, "volume": rng.uniform(10, 1000, n), "spread": rng.uniform(0.1, 0.5, n)}


def test_a_series_from_numpy_reads_back_as_the_same_columns_packed_or_plain() -> None:
    b = bars()
    parsed = []
    for packed in (True, False):
        s = make_series("ES", b["timestamp_ns"], b["open"], b["high"], b["low"], b["close"], b["volume"],
                        {"spread": b["spread"]}, packed=packed)
        assert bool(s.user_features_raw) == packed and bool(s.user_features) != packed
        parsed.append(parse_request(pb.PredictRequest(series=[s]), META)[0])
    for got in parsed:
        for name in ("timestamp_ns", "open", "high", "low", "close", "volume"):
            np.testing.assert_array_equal(getattr(got, name), b[name])
        np.testing.assert_array_equal(got.user_matrix(("spread",))[0], b["spread"])


def test_a_series_takes_lists_and_float32_and_sends_float64() -> None:
    b = bars()
    s = make_series("NQ", b["timestamp_ns"].tolist(), b["open"].astype(np.float32), b["high"], b["low"], b["close"],
                    b["volume"])
    assert list(s.open) == b["open"].astype(np.float32).astype(np.float64).tolist()
    assert list(s.timestamp_ns) == b["timestamp_ns"].tolist() and not s.user_feature_names


@pytest.mark.parametrize(("change", "message"), [
    (lambda b: b.update(close=b["close"][:-1]), "close has shape (8,), timestamp_ns has 9 bars"),
    (lambda b: b.update(spread=b["spread"][1:]), "user feature 'spread' has shape (8,), timestamp_ns has 9 bars"),
    (lambda b: b.update(volume=b["volume"][:, None]), "volume has shape (9, 1)"),
    (lambda b: b.update(timestamp_ns=b["timestamp_ns"].astype("datetime64[ns]")),
     "timestamp_ns has dtype datetime64[ns]; give int64 UTC nanoseconds"),
    (lambda b: b.update(timestamp_ns=b["timestamp_ns"][None, :]), "timestamp_ns has shape (1, 9)"),
    (lambda b: b.update(close=["x"] * 9), "close is not numeric (could not convert string to float: 'x'); give "
                                          "numbers, one per bar"),
    (lambda b: b.update(spread=np.array(["1.5"] * 8 + ["n/a"])), "user feature 'spread' is not numeric"),
])
def test_a_column_that_cannot_be_sent_is_named(change: Callable[[dict[str, np.ndarray]], None], message: str
                                                 ) -> None:
    b = bars()
    change(b)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_series("ES", b["timestamp_ns"], b["open"], b["high"], b["low"], b["close"], b["volume"],
                    {"spread": b["spread"]})


def test_a_forecast_reads_back_as_horizon_by_quantile_arrays() -> None:
    levels, horizon = [0.1, 0.5, 0.9], 2
    f = pb.Forecast(symbol="ES", horizon=horizon, quantile_levels=levels, timestamp_ns=[7, 8], last_close=100.0,
                    log_return=[-0.1, 0.0, 0.1, -0.2, 0.0, 0.2], price=[90, 100, 110, 80, 100, 120],
                    model_version="v1", last_timestamp_ns=6)
    a = forecast_arrays(f)
    np.testing.assert_array_equal(a.price, [[90, 100, 110], [80, 100, 120]])  # row h, column q
    np.testing.assert_array_equal(a.log_return[:, a.quantile(0.9)], [0.1, 0.2])
    assert a.timestamp_ns.dtype == np.int64 and a.timestamp_ns.tolist() == [7, 8]
    assert (a.symbol, a.model_version, a.last_timestamp_ns, a.last_close) == ("ES", "v1", 6, 100.0)
    with pytest.raises(ValueError, match=re.escape("quantile 0.25 is not among the model's levels [0.1, 0.5, 0.9]")):
        a.quantile(0.25)


def readme_example(heading: str = "**Calling Predict from your own code.**") -> str:
    """The Python block under one of README's headings."""
    text = (REPO / "README.md").read_text()
    start = text.index(heading)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"the README's example block under {heading} is missing"
    return m.group(1)


@pytest.fixture(scope="module")
def server(tiny_model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    yield from serving(tiny_model.model, tmp_path_factory.mktemp("log") / "server.log")


@pytest.mark.slow
def test_the_readme_example_runs_as_it_stands_against_a_real_server(tiny_model: Model,  # noqa: F811
                                                                   server: LiveServer) -> None:
    code = readme_example()
    assert code.count("127.0.0.1:50051") == 1
    b = tiny_model.bars
    rows = b.series_slices()["ES"]
    names = {"ts": b.timestamp_ns[rows], "o": b.open[rows], "h": b.high[rows], "l": b.low[rows],
             "c": b.close[rows], "v": b.volume[rows], "user": {u: b.user[u][rows] for u in b.user}}
    scope = dict(names)
    exec(compile(code.replace("127.0.0.1:50051", server.target), "README.md", "exec"), scope)
    exec(compile(readme_example("**Calling PredictStream from your own code.**"), "README.md", "exec"), scope)
    assert scope["answers"].code() == grpc.StatusCode.OK  # the None ended the stream, read to its end; the block
    with pytest.raises(ValueError):  # closed the channel itself (a script that ends there exits at once)
        scope["stub"].GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    np.testing.assert_allclose(scope["streamed"].price, scope["f"].price, rtol=1e-12)  # the stream's = Predict's
    # the same forecast as the request the CLI client builds from the file
    want = server.stub.Predict(pb.PredictRequest(series=[series_from_bars(b, "ES", tiny_model.meta.bars_required)]),
                               timeout=10).forecasts[0]
    price = np.asarray(want.price).reshape(want.horizon, len(want.quantile_levels))
    np.testing.assert_array_equal(scope["median"], price[:, list(want.quantile_levels).index(0.5)])
    np.testing.assert_array_equal(scope["band"], price[:, [0, -1]])
    assert scope["median"].shape == (tiny_model.meta.horizon,)
    assert (scope["band"][:, 0] <= scope["median"]).all() and (scope["median"] <= scope["band"][:, 1]).all()



@pytest.mark.slow
def test_an_explained_forecast_reads_back_as_attention_and_weight_arrays(tiny_model: Model,  # noqa: F811
                                                                        server: LiveServer) -> None:
    meta = tiny_model.meta
    series = series_from_bars(tiny_model.bars, "NQ", meta.bars_required)
    plain, explained = (server.stub.Predict(pb.PredictRequest(series=[series], explain=e), timeout=10).forecasts[0]
                        for e in (False, True))
    assert forecast_arrays(plain).explanation is None
    got = forecast_arrays(explained)
    e = got.explanation
    assert e is not None
    L, H = meta.encoder_length, meta.horizon
    assert e.attention.shape == (H, L + H)
    np.testing.assert_array_equal(e.attention.ravel(), np.asarray(explained.explanation.attention, np.float32))
    np.testing.assert_array_equal(e.attention_timestamp_ns[L:], got.timestamp_ns)  # the future bars' columns
    assert e.attention_timestamp_ns[L - 1] == got.last_timestamp_ns
    schema = meta.feature_schema
    for weights, steps, names in ((e.static, 1, schema.static), (e.encoder, L, schema.observed + schema.known),
                                  (e.decoder, H, schema.known)):
        assert weights.variables == tuple(names) and weights.weights.shape == (steps, len(names))
        np.testing.assert_allclose(weights.weights.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(got.price, forecast_arrays(plain).price)


class NoTruthValue(dict[str, np.ndarray]):
    """A mapping that refuses `bool()`, as a pandas DataFrame of columns does."""

    def __bool__(self) -> bool:
        raise ValueError("the truth value of a DataFrame is ambiguous")


def test_user_columns_may_come_as_a_mapping_without_a_truth_value() -> None:
    b = bars()
    for user in (NoTruthValue(spread=b["spread"]), NoTruthValue()):
        s = make_series("ES", b["timestamp_ns"], b["open"], b["high"], b["low"], b["close"], b["volume"], user)
        assert list(s.user_feature_names) == list(user)


def test_unsigned_timestamps_are_sent_as_int64() -> None:
    b = bars()
    ts = b["timestamp_ns"].astype(np.uint64)
    assert list(make_series("ES", ts, b["open"], b["high"], b["low"], b["close"], b["volume"]).timestamp_ns) == \
        b["timestamp_ns"].tolist()
