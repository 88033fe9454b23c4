"""Serving's pure parts without a server: stubs, request validation, features of a batch, batching."""

from __future__ import annotations

import asyncio
import dataclasses
import filecmp
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from features.config import FeatureConfig
from features.model_meta import ModelMeta
from features.schema import STATIC_CATEGORICAL
from serving.batcher import MicroBatcher
from serving.errors import NotReady, QueueDeadlineExceeded, RequestError, status_of
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.model import batch_buckets
from serving.postprocess import price_quantiles
from serving.preprocess import prepare
from serving.validation import columns_from_proto, parse_request
from tests.artifacts import REPO

FC = FeatureConfig(horizon=3, volatility_window=5, user_columns=("spread",))
META = ModelMeta(
    model_config={}, feature_config=FC, feature_schema=FC.schema(), quantiles=(0.1, 0.5, 0.9), horizon=3,
    encoder_length=4, bar_interval_ns=60_000_000_000, symbols=("ES", "NQ"), checkpoint_sha256="0" * 64,
    model_version="unit", explain=True, precision="fp32",
)
NEED = META.bars_required  # 5 warm-up + 4 encoder bars


def series(symbol: str = "ES", n: int = NEED, seed: int = 0, start_ns: int = 1_704_103_200_000_000_000) -> pb.Series:
    rng = np.random.default_rng(seed)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 1e-3, n)))
    open_ = np.concatenate([[close[0]], close[:-1]])
    high = np.maximum(open_, close) * (1 + rng.uniform(0, 1e-3, n))
    low = np.minimum(open_, close) * (1 - rng.uniform(0, 1e-3, n))
    return pb.Series(symbol=symbol, timestamp_ns=(start_ns + 60_000_000_000 * np.arange(n)).tolist(),
                     open=open_.tolist(), high=high.tolist(), low=low.tolist(), close=close.tolist(),
                     volume=rng.uniform(10, 1000, n).tolist(),
                     user_features=[pb.Column(name="spread", values=rng.uniform(0.1, 0.5, n).tolist())])


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--out", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fresh, committed = tmp_path / "serving" / "gen", REPO / "serving" / "gen"
    names = sorted(str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.suffix in (".py", ".pyi"))
    assert names == sorted(str(p.relative_to(committed)) for p in committed.rglob("*") if p.suffix in (".py", ".pyi"))
    assert any(n.endswith("forecaster_pb2.pyi") for n in names)
    _, mismatch, errors = filecmp.cmpfiles(fresh, committed, names, shallow=False)
    assert not mismatch and not errors, f"stale stubs {mismatch}: run `python scripts/gen_protos.py`"


def test_a_clients_own_stubs_from_protos_import_beside_the_servers(tmp_path: Path) -> None:
    """A client compiling protos/ itself gets the file name the server's stubs and reflection use, so both
    sets of stubs share Python's descriptor pool (with another name, the second import fails: duplicate
    symbols)."""
    from grpc_tools import protoc

    assert protoc.main(["protoc", f"-I{REPO / 'protos'}", f"--python_out={tmp_path}",
                        str(REPO / "protos" / "foxhunt" / "tft" / "v1" / "forecaster.proto")]) == 0
    code = ("import sys; from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as ours; "
            "sys.path.insert(0, sys.argv[1]); from foxhunt.tft.v1 import forecaster_pb2 as theirs; "
            "print(ours.DESCRIPTOR.name, theirs.PredictRequest.FromString("
            "ours.PredictRequest(explain=True).SerializeToString()).explain)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["foxhunt/tft/v1/forecaster.proto", "True"]


# ---- validation ---------------------------------------------------------------------------------------
def _req(*s: pb.Series) -> pb.PredictRequest:
    return pb.PredictRequest(series=list(s))


def _with(field: str, i: int, value: float) -> pb.Series:
    s = series()
    getattr(s, field)[i] = value
    return s


def _without_user() -> pb.Series:
    s = series()
    del s.user_features[:]
    return s


def _short_user() -> pb.Series:
    s = series()
    s.user_features[0].values.pop()
    return s


CASES: list[tuple[str, Callable[[], pb.PredictRequest], str]] = [
    ("empty", lambda: _req(), "empty request: PredictRequest.series is empty; send at least one series with its "
                              f"most recent {NEED} bars"),
    ("too few", lambda: _req(series(n=NEED - 1)), f"series[0] (ES): {NEED - 1} bars sent, the model needs at least "
                                                  f"{NEED} (5 warm-up bars for the rolling features + 4 encoder bars)"),
    ("one bar", lambda: _req(series(n=1)), f"series[0] (ES): 1 bar sent, the model needs at least {NEED} "),
    ("a symbol alone", lambda: _req(pb.Series(symbol="ES")), f"series[0] (ES): 0 bars sent, the model needs at "
                                                            f"least {NEED} "),  # not "user column missing"
    ("unknown", lambda: _req(series("CL")), "series[0]: unknown symbol 'CL'; the model knows ES, NQ"),
    ("no symbol", lambda: _req(series("")), "series[0]: symbol is empty"),
    ("twice", lambda: _req(series("NQ"), series("ES"), series("NQ")), "series[2]: symbol 'NQ' already appears in "
                                                                      "series[0]"),
    ("missing user column", lambda: _req(_without_user()), "series[0] (ES): user feature column(s) 'spread' missing"),
    ("short user column", lambda: _req(_short_user()), "series[0] (ES): user_features column 'spread' has 8 values; "
                                                       "it needs exactly 9 values, one per bar sent"),
    ("inf price", lambda: _req(_with("close", 2, float("inf"))), "series[0] (ES): column 'close', row 2: close is "
                                                                 "infinite"),
    ("NaN volume", lambda: _req(_with("volume", 0, float("nan"))), "column 'volume', row 0: volume is NaN"),
    ("low above open", lambda: _req(_with("low", 5, 1e9)), "row 5: high < low"),
    ("timestamp past 2262", lambda: _req(_late()), "series[0] (ES): column 'timestamp_ns', row 2: "
                                                   f"{2**63 - 1} is past the last time this model can forecast from"),
    ("NaN user", lambda: _req(series(), _user_nan()), "series[1] (NQ): column 'spread', row 3: user feature "
                                                      "'spread' is NaN or infinite. Fix: send a finite value within "
                                                      "float32's range for every bar"),
    ("user beyond float32", lambda: _req(_user_nan(1e39)), "series[0] (NQ): column 'spread', row 3: user feature "
                                                            "'spread' is beyond float32's range"),
    ("duplicate timestamp", lambda: _req(_with("timestamp_ns", 3, 1_704_103_200_000_000_000 + 2 * 60 * 10**9)),
     "series[0] (ES): column 'timestamp_ns', row 3: duplicate timestamp (rule: strictly increasing). Fix: send "
     "the bars oldest first, one per timestamp"),
    ("swapped timestamps", lambda: _req(_swapped(3)), "series[0] (ES): column 'timestamp_ns', row 4: timestamps "
                                                      "decrease (rule: strictly increasing). Fix: send the bars "
                                                      "oldest first, one per timestamp"),
    ("placeholder close", lambda: _req(_with("close", 5, float(2**63 - 1))),
     "series[0] (ES): column 'close', row 5: close is beyond 2^53, most likely a feed's placeholder for a missing "
     "value (INT64_MAX or UINT64_MAX as a float). Fix: send the bar's real close"),
    ("placeholder volume", lambda: _req(_with("volume", 2, float(2**64 - 1))),
     "column 'volume', row 2: volume is beyond 2^53"),
    ("NaN close", lambda: _req(_with("close", 4, float("nan"))), "series[0] (ES): column 'close', row 4: close is "
                                                                 "NaN. Fix: send a finite close for every bar"),
    ("negative open", lambda: _req(_with("open", 1, -2.0)), "column 'open', row 1: open is not positive (prices must "
                                                            "be > 0). Fix: send positive prices"),
    ("prices in two units", lambda: _req(_rescaled(6, 1e9)), "is 1e+09 times the previous bar's close of ES, "
                                                             "100.0565033: a change of price units, not a market "
                                                             "move (rule: a close within 100x of the previous one). "
                                                             "Fix: send every bar's prices in one unit"),
    ("seconds sent as nanoseconds", lambda: _req(_spaced(series("NQ"), 1_704_103_200, 60)),
     f"series[0] (NQ): bars are 60 ns apart (the median gap of the last {NEED} bars), but this model's bars are "
     "1 min apart (GetModelInfo.bar_interval_ns = 60000000000); these look like seconds: multiply them by "
     "1,000,000,000; send timestamp_ns in UTC nanoseconds"),
    ("milliseconds sent as nanoseconds", lambda: _req(_spaced(series(), 1_704_103_200_000, 60_000)),
     f"bars are 60 µs apart (the median gap of the last {NEED} bars), but this model's bars are 1 min apart "
     "(GetModelInfo.bar_interval_ns = 60000000000); these look like milliseconds: multiply them by 1,000,000;"),
    ("daily bars to a 1-minute model", lambda: _req(_spaced(series(), 1_704_103_200 * 10**9, 86_400 * 10**9)),
     f"series[0] (ES): bars are 1 d apart (the median gap of the last {NEED} bars), but this model's bars are 1 min "
     "apart (GetModelInfo.bar_interval_ns = 60000000000); send bars of the model's size"),
    ("bars finer than the model's", lambda: _req(series("NQ"), _spaced(series(), 1_704_103_200 * 10**9, 20 * 10**9)),
     f"series[1] (ES): bars are 20 s apart (the median gap of the last {NEED} bars), but this model's bars are 1 min "
     "apart (GetModelInfo.bar_interval_ns = 60000000000); send bars of the model's size (resample these to 1 min "
     "bars)"),  # no unit to blame (times of this era): bars of another size
]


def _spaced(s: pb.Series, start: int, gap: int) -> pb.Series:
    """The series with timestamps start, start + gap, ...: another unit than nanoseconds, or finer bars."""
    s.timestamp_ns[:] = (start + gap * np.arange(len(s.timestamp_ns))).tolist()
    return s


def _swapped(row: int) -> pb.Series:
    s = series()
    ts = list(s.timestamp_ns)
    ts[row], ts[row + 1] = ts[row + 1], ts[row]
    s.timestamp_ns[:] = ts
    return s


def _rescaled(row: int, factor: float) -> pb.Series:
    """Every price from `row` on in other units (dollars, then 1e-9 fixed point): each bar is consistent."""
    s = series()
    for name in ("open", "high", "low", "close"):
        values = list(getattr(s, name))
        getattr(s, name)[:] = values[:row] + [x * factor for x in values[row:]]
    return s


def _late() -> pb.Series:
    s = series()
    s.timestamp_ns[2] = 2**63 - 1  # the int64 limit: no future bar time fits after it
    return s


def _user_nan(value: float = float("nan")) -> pb.Series:
    s = series("NQ")
    s.user_features[0].values[3] = value
    return s


@pytest.mark.parametrize(("name", "make", "message"), CASES, ids=[c[0] for c in CASES])
def test_each_broken_rule_has_a_precise_message(name: str, make: Callable[[], pb.PredictRequest],
                                                message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(make(), META)
    assert message in str(info.value)


def test_the_fast_bar_check_agrees_with_the_contract_on_random_breakages() -> None:
    """features.bars.rules_hold (a few vectorised passes) accepts a series exactly when features.bars.validate
    finds nothing wrong, for values set to NaN, inf, zero, negative or out of the bar's range."""
    from serving.validation import _looks_valid, _value_problems

    rng = np.random.default_rng(7)
    columns = ("open", "high", "low", "close", "volume", "spread")
    values = (np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -1.0, 1e-9, 1e9, float(2**53), float(2**63 - 1))
    verdicts = set()
    for trial in range(400):
        s = columns_from_proto(series(seed=trial))
        for _ in range(int(rng.integers(0, 3))):  # none, one or two breakages
            col, row = columns[int(rng.integers(len(columns)))], int(rng.integers(NEED))
            target = s.user["spread"] if col == "spread" else getattr(s, col)
            target[row] = values[int(rng.integers(len(values)))]
        if rng.random() < 0.2:  # a price just outside its bar's range, which breaks no other rule
            row, col = int(rng.integers(NEED)), ("open", "close")[int(rng.integers(2))]
            getattr(s, col)[row] = s.low[row] * (1 - 1e-3) if rng.random() < 0.5 else s.high[row] * (1 + 1e-3)
        if rng.random() < 0.1:
            s.timestamp_ns[3] = s.timestamp_ns[2]  # a duplicate timestamp
        if rng.random() < 0.15:  # prices in other units from some bar on: refused a hundredfold off, served at 50x
            row, factor = int(rng.integers(1, NEED)), (1e9, 1e-9, 100.0, 50.0)[int(rng.integers(4))]
            for name in ("open", "high", "low", "close"):
                getattr(s, name)[row:] *= factor
        fast = _looks_valid(s, ("spread",))
        contract = not _value_problems(0, s, ("spread",))
        assert fast == contract, (trial, s)
        verdicts.add(fast)
    assert verdicts == {True, False}


def packed(s: pb.Series) -> pb.Series:
    """The same series with its user columns as one little-endian float64 block."""
    out = pb.Series()
    out.CopyFrom(s)
    out.ClearField("user_features")
    out.user_feature_names.extend(c.name for c in s.user_features)
    out.user_features_raw = np.asarray([list(c.values) for c in s.user_features], dtype="<f8").tobytes()
    return out


def test_packed_user_features_equal_columns() -> None:
    """user_feature_names + user_features_raw give the model exactly what user_features give."""
    plain = [series("ES", n=NEED + 7, seed=3), series("NQ", seed=4)]
    for sent in (plain, plain[:1]):  # a lone series takes its columns as they are (read-only views)
        a = parse_request(_req(*sent), META)
        b = parse_request(_req(*(packed(s) for s in sent)), META)
        for x, y in zip(a, b, strict=True):
            assert list(y.user) == ["spread"]
            np.testing.assert_array_equal(x.user["spread"], y.user["spread"])
        pa, pb_ = prepare(a, META), prepare(b, META)
        for name, value in pa.inputs.items():
            np.testing.assert_array_equal(value, pb_.inputs[name])


def test_a_packed_block_in_the_models_order_is_used_as_sent() -> None:
    """User columns packed in exactly the model's order are checked and trimmed as the request's own block
    (no copy per column); another order, a subset, or the repeated-field form give the same rows by copy."""
    n, rng = 12, np.random.default_rng(8)
    values = {"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.normal(size=n)}

    def wire(names: list[str], pack: bool) -> pb.Series:
        s = pb.Series(symbol="ES", timestamp_ns=list(range(n)))
        if pack:
            s.user_feature_names.extend(names)
            s.user_features_raw = np.array([values[u] for u in names], dtype="<f8").tobytes()
        else:
            s.user_features.extend(pb.Column(name=u, values=values[u].tolist()) for u in names)
        return pb.Series.FromString(s.SerializeToString())

    packed_ab = columns_from_proto(wire(["a", "b"], True))
    assert packed_ab.user_matrix(["a", "b"]) is packed_ab.user.block  # the request's bytes, as sent
    plain = columns_from_proto(wire(["a", "b", "c"], False))
    assert not hasattr(plain.user, "block")
    for s, names in ((packed_ab, ["b", "a"]), (packed_ab, ["b"]), (plain, ["c", "a"])):
        got = s.user_matrix(names)
        assert got is not getattr(s.user, "block", None)
        np.testing.assert_array_equal(got, np.array([values[u] for u in names]))
    for s in (packed_ab, plain):
        cut = s.tail(5, ["b", "a"])
        assert list(cut.user) == ["b", "a"] and cut.user.block.shape == (2, 5)
        for row, u in zip(cut.user.block, ["b", "a"], strict=True):  # the block's rows are the columns
            np.testing.assert_array_equal(row, values[u][-5:])
            assert np.shares_memory(row, cut.user[u])


def test_the_client_packs_user_columns_as_the_server_reads_them() -> None:
    from features.bars import Bars
    from serving.request_from_bars import series_from_bars

    n, rng = 30, np.random.default_rng(5)
    close = 100 + np.cumsum(rng.normal(0, 0.1, n))
    bars = Bars(1_704_103_200_000_000_000 + 60_000_000_000 * np.arange(n), np.full(n, "ES", dtype=object), close,
                close + 1, close - 1, close, np.ones(n), {"a": rng.normal(size=n), "b": rng.normal(size=n)})
    columns = FeatureConfig(user_columns=("b", "a"))
    plain = columns_from_proto(series_from_bars(bars, "ES", 12, columns))
    wire = series_from_bars(bars, "ES", 12, columns, packed=True)
    assert not wire.user_features and list(wire.user_feature_names) == ["b", "a"]
    got = columns_from_proto(pb.Series.FromString(wire.SerializeToString()))
    for name in ("a", "b"):
        np.testing.assert_array_equal(got.user[name], bars.user[name][-12:])
        np.testing.assert_array_equal(got.user[name], plain.user[name])


def _packed_with(**change: object) -> pb.PredictRequest:
    s = packed(series())
    for field_name, value in change.items():
        if field_name == "user_features":
            s.user_features.add(name="spread", values=[0.2] * NEED)
        elif field_name == "user_feature_names":
            del s.user_feature_names[:]
            s.user_feature_names.extend(value)  # type: ignore[call-overload]
        else:
            setattr(s, field_name, value)
    return _req(s)


PACKED_CASES = [
    ("both forms", lambda: _packed_with(user_features=True), "sends both user_features and user_feature_names"),
    ("block without names", lambda: _packed_with(user_feature_names=[]), "user_feature_names is empty"),
    ("name twice", lambda: _packed_with(user_feature_names=["spread", "spread"]), "'spread' is named twice"),
    ("short block", lambda: _packed_with(user_features_raw=b"\0" * (8 * NEED - 8)),
     f"user_features_raw has {8 * NEED - 8} bytes; 1 name(s) x {NEED} bars (len(timestamp_ns)) need {8 * NEED}"),
    ("block of another column", lambda: _packed_with(user_feature_names=["depth"]),
     "user feature column(s) 'spread' missing"),
    ("NaN in the block", lambda: _req(packed(_user_nan())), "column 'spread', row 3: user feature 'spread' is NaN"),
]


@pytest.mark.parametrize(("name", "make", "message"), PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_a_broken_packed_block_has_a_precise_message(name: str, make: Callable[[], pb.PredictRequest],
                                                     message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(make(), META)
    assert message in str(info.value)


def test_a_valid_request_is_trimmed_to_the_bars_the_model_reads() -> None:
    got = parse_request(_req(series("NQ", n=NEED + 30, seed=1), series("ES")), META)
    assert [s.symbol for s in got] == ["NQ", "ES"] and all(len(s) == NEED for s in got)
    full = columns_from_proto(series("NQ", n=NEED + 30, seed=1))
    assert np.array_equal(got[0].close, full.close[-NEED:]) and list(got[0].user) == ["spread"]


def test_every_problem_of_a_series_is_listed() -> None:
    s = series()
    s.close[1] = -1.0
    s.volume[4] = -2.0
    with pytest.raises(RequestError) as info:
        parse_request(_req(s), META)
    assert "close is not positive" in str(info.value) and "volume is negative" in str(info.value)


# ---- features of a batch -------------------------------------------------------------------------------
def test_a_batch_with_repeated_symbols_has_the_features_of_each_call_alone() -> None:
    calls = [columns_from_proto(series(sym, seed=seed, start_ns=1_704_103_200_000_000_000 + seed * 7_000_000_000))
             for sym, seed in (("ES", 1), ("NQ", 2), ("ES", 3), ("ES", 4))]
    together = prepare(calls, META)
    for i, c in enumerate(calls):
        alone = prepare([c], META)
        for name, value in alone.inputs.items():
            assert np.array_equal(together.inputs[name][i], value[0]), name  # bit for bit
        assert np.array_equal(together.future_timestamp_ns[i], alone.future_timestamp_ns[0])
    assert together.inputs[STATIC_CATEGORICAL][:, 0].tolist() == [0, 1, 0, 0]
    assert together.future_timestamp_ns[0, 0] == calls[0].timestamp_ns[-1] + META.bar_interval_ns


def test_price_quantiles() -> None:
    q = np.array([[[-0.01, 0.0, 0.02]]], dtype=np.float32)
    np.testing.assert_allclose(price_quantiles(np.array([100.0]), q), 100 * np.exp(q.astype(np.float64)))


def test_batch_buckets() -> None:
    assert batch_buckets(64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert batch_buckets(10) == (1, 2, 3, 4, 6, 8, 10) and batch_buckets(1) == (1,)


# ---- the micro-batcher -----------------------------------------------------------------------------------
class Recorder:
    """A process function that doubles payloads and records each batch it ran, and on which thread.
    With `hold`, each run waits until the test sets it (set `started` tells the test a run began)."""

    def __init__(self, hold: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.threads: set[int] = set()
        self.active = self.most = 0
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, key: str, payloads: list[int]) -> list[int | Exception]:
        self.active += 1
        self.most = max(self.most, self.active)
        self.batches.append(list(payloads))
        self.threads.add(threading.get_ident())
        self.started.set()
        self.release.wait()
        self.active -= 1
        return [p * 2 if p >= 0 else ValueError(f"bad {p}") for p in payloads]

    async def running(self) -> None:
        """Until a run has begun on the worker."""
        await asyncio.get_running_loop().run_in_executor(None, self.started.wait)


class Observed:
    """A BatchObserver that records what the metrics would see."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int]] = []
        self.queue_times: list[float] = []
        self.expired = 0

    def on_batch(self, windows: int, calls: int, inference_s: float) -> None:
        self.batches.append((windows, calls))

    def on_queue_time(self, seconds: float) -> None:
        self.queue_times.append(seconds)

    def on_expired(self) -> None:
        self.expired += 1


HOUR = 3600.0  # a delay no test waits out: a batch that closes early closed for another reason


def batched(main: Callable[[MicroBatcher[str, int, int]], Awaitable[None]], rec: Recorder, max_batch: int,
            max_delay_s: float, wait: str = "adaptive", observer: Observed | None = None,
            run: Callable[[Awaitable[None]], None] = asyncio.run) -> None:
    """main(batcher) on a started batcher, closed after it (a minute at most: a hang fails the test)."""

    async def wrapped() -> None:
        b: MicroBatcher[str, int, int] = MicroBatcher(rec, max_batch, max_delay_s, wait, observer)
        b.start()
        try:
            await asyncio.wait_for(main(b), 60)
        finally:
            rec.release.set()
            await b.close()

    run(wrapped())


@pytest.mark.parametrize("wait", ["adaptive", "fixed"])
def test_concurrent_calls_share_batches_and_get_their_own_results(wait: str) -> None:
    rec = Recorder()

    async def main(b: MicroBatcher[str, int, int]) -> None:
        assert await asyncio.gather(*(b.submit("m", i, 1) for i in range(10))) == [2 * i for i in range(10)]

    batched(main, rec, max_batch=4, max_delay_s=0.05, wait=wait)
    assert rec.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_batches_run_one_at_a_time_on_one_worker_and_calls_arriving_meanwhile_form_the_next() -> None:
    rec = Recorder(hold=True)
    seen = Observed()

    async def main(b: MicroBatcher[str, int, int]) -> None:
        first = asyncio.ensure_future(b.submit("m", 1, 1))
        await rec.running()
        later = asyncio.gather(*(b.submit("m", i, 1) for i in (2, 3, 4)))
        await asyncio.sleep(0)  # they queue while the first batch runs
        rec.release.set()
        assert await first == 2 and await later == [4, 6, 8]

    batched(main, rec, max_batch=8, max_delay_s=HOUR, observer=seen)
    assert rec.batches == [[1], [2, 3, 4]] and rec.most == 1
    assert rec.threads and threading.get_ident() not in rec.threads and len(rec.threads) == 1
    assert seen.batches == [(1, 1), (3, 3)] and len(seen.queue_times) == 4


def test_a_lone_call_does_not_wait_for_company_and_errors_stay_with_their_call() -> None:
    rec = Recorder()

    async def main(b: MicroBatcher[str, int, int]) -> None:
        assert await b.submit("m", 3, 1) == 6  # a delay of an hour: wait_for's minute would fail a wait
        results = await asyncio.gather(b.submit("m", -1, 1), b.submit("m", 4, 1), return_exceptions=True)
        assert isinstance(results[0], ValueError) and results[1] == 8

    batched(main, rec, max_batch=64, max_delay_s=HOUR)
    assert rec.batches == [[3], [-1, 4]]


def test_a_call_a_loop_round_behind_joins_the_batch_but_a_full_batch_closes_at_once() -> None:
    """A call whose handler reaches submit a loop round after another's (its request was still being
    parsed) shares that call's batch; a batch that holds max_batch windows does not wait for more."""
    rec = Recorder()

    async def call(b: MicroBatcher[str, int, int], payload: int, rounds_late: int, n: int = 1) -> int:
        for _ in range(rounds_late):
            await asyncio.sleep(0)
        return await b.submit("m", payload, n)

    async def main(b: MicroBatcher[str, int, int]) -> None:
        assert await asyncio.gather(call(b, 5, 0), call(b, 6, 1)) == [10, 12]
        assert await asyncio.gather(call(b, 4, 0, n=4), call(b, 7, 0)) == [8, 14]
        assert await b.submit("m", 9, 5) == 18  # more windows than max_batch: a batch of its own

    batched(main, rec, max_batch=4, max_delay_s=HOUR)
    assert rec.batches == [[5, 6], [4], [7], [9]]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_fixed_wait_waits_its_whole_delay_on_either_event_loop(loop: str) -> None:
    """--batch-wait fixed holds a lone call for the full delay, even one shorter than the millisecond
    to which uvloop rounds its timers. A lower bound: a slow machine cannot break it."""
    import uvloop

    delay = 0.0004

    async def main(b: MicroBatcher[str, int, int]) -> None:
        for i in range(5):
            start = time.monotonic()
            assert await b.submit("m", i, 1) == 2 * i
            assert time.monotonic() - start >= delay

    batched(main, Recorder(), max_batch=64, max_delay_s=delay, wait="fixed", run=uvloop.run if loop == "uvloop"
            else asyncio.run)


def test_models_never_share_a_batch() -> None:
    rec = Recorder()

    async def main(b: MicroBatcher[str, int, int]) -> None:
        await asyncio.gather(*(b.submit("old" if i % 2 else "new", i, 1) for i in range(6)))

    batched(main, rec, max_batch=8, max_delay_s=0.05, wait="fixed")
    assert sorted(map(sorted, rec.batches)) == [[0, 2, 4], [1, 3, 5]]


def test_a_call_whose_deadline_passes_in_the_queue_is_answered_and_never_run() -> None:
    rec = Recorder(hold=True)
    seen = Observed()

    async def main(b: MicroBatcher[str, int, int]) -> None:
        first = asyncio.ensure_future(b.submit("m", 1, 1))
        await rec.running()  # the worker is busy: the next calls wait in the queue
        expired = asyncio.ensure_future(b.submit("m", 2, 1, deadline=time.monotonic()))
        cancelled = asyncio.ensure_future(b.submit("m", 3, 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        rec.release.set()
        with pytest.raises(QueueDeadlineExceeded, match="in the queue; not run"):
            await expired
        assert await first == 2 and await b.submit("m", 4, 1) == 8

    batched(main, rec, max_batch=4, max_delay_s=0.0, observer=seen)
    assert rec.batches == [[1], [4]] and seen.expired == 1  # neither the expired nor the cancelled call ran


def test_a_failed_run_fails_its_calls_and_the_batcher_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def process(key: str, payloads: list[int]) -> list[int | Exception]:
        if 0 in payloads:
            raise RuntimeError("the model failed")
        return [p * 2 for p in payloads]

    async def main() -> None:
        b: MicroBatcher[str, int, int] = MicroBatcher(process, 4, HOUR)
        b.start()
        try:
            results = await asyncio.gather(b.submit("m", 0, 1), b.submit("m", 1, 1), return_exceptions=True)
            assert [str(r) for r in results] == ["the model failed"] * 2
            assert await b.submit("m", 2, 1) == 4
        finally:
            await b.close()

    asyncio.run(main())
    assert "inference failed for a batch of 2 calls" in caplog.text


def test_a_call_after_the_batcher_closed_is_unavailable_so_the_caller_retries_elsewhere() -> None:
    async def main() -> None:
        b: MicroBatcher[str, int, int] = MicroBatcher(Recorder(), max_batch=4, max_delay_s=0.001)
        b.start()
        assert await b.submit("m", 1, 1) == 2
        await b.close()
        with pytest.raises(NotReady) as info:
            await b.submit("m", 2, 1)
        assert status_of(info.value)[0] == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_wait_serving_gives_up_after_its_timeout_when_nothing_listens() -> None:
    from serving.health_probe import wait_serving

    start = time.monotonic()
    assert wait_serving("127.0.0.1:1", timeout=0.3) is False  # port 1: nothing listens there
    assert time.monotonic() - start < 30  # it gives up: the timeout plus one 2 s health call, far from forever


def test_a_worker_gets_every_setting_of_its_supervisor() -> None:
    """--workers starts each worker with server_args(config): parsed back, it is the same config."""
    from serving.__main__ import build_parser, config_from_args
    from serving.server import ServerConfig
    from serving.workers import server_args

    config = ServerConfig(
        model_path=Path("-odd name.onnx"), host="::1", port=50123, reuse_port=True, stop_on_stdin_eof=True,
        device="cpu", device_id=2, threads=3, max_batch=48, max_delay_ms=1.5, batch_wait="fixed",
        max_concurrent=99, max_message_bytes=65536, metrics_port=9470, metrics_host="0.0.0.0", grace_s=2.5,
        drain_delay_s=1.5,
        tls_cert=Path("c.pem"), tls_key=Path("k.pem"), tls_client_ca=Path("ca.pem"), auth_token_file=Path("tokens"),
        event_loop="asyncio", max_connection_age_s=120.0)
    parser = build_parser()
    args = parser.parse_args(server_args(config, "WARNING"))
    assert config_from_args(parser, args) == config and args.log_level == "WARNING"
    plain = ServerConfig(model_path=Path("m.onnx"))
    assert config_from_args(parser, parser.parse_args(server_args(plain, "INFO"))) == plain


def test_connection_age_flag_takes_what_grpc_can(capsys: pytest.CaptureFixture[str]) -> None:
    """gRPC counts the age in int32 milliseconds: 0 is never, a fraction of a millisecond would age every
    connection out at once, and 35 days would overflow."""
    from serving.__main__ import build_parser, config_from_args
    from serving.server import connection_age_options

    parser = build_parser()

    def age(value: str) -> float:
        return config_from_args(parser, parser.parse_args(["--model", "m.onnx", f"--max-connection-age={value}"])
                                ).max_connection_age_s

    assert age("0") == 0.0 and connection_age_options(0.0) == []
    assert dict(connection_age_options(age("0.1005")))["grpc.max_connection_age_ms"] == 101  # rounded up
    assert dict(connection_age_options(age("2147483")))["grpc.max_connection_age_ms"] <= 2**31 - 1
    assert dict(connection_age_options(age("2147483")))["grpc.max_connection_age_grace_ms"] == 2**31 - 1
    # the grace outlasts the age itself: a PredictStream, which ends itself by then, is never cut by gRPC
    assert dict(connection_age_options(age("1800")))["grpc.max_connection_age_grace_ms"] == 1_830_000
    for bad in ("0.0004", "0.05", "3000000", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exc:
            age(bad)
        assert exc.value.code == 2 and "--max-connection-age must be 0 (never) or 0.1.." in capsys.readouterr().err



@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--max-batch", "4097", "--max-batch must be in 1..4096 (the warm-up runs every padded batch size up to it"),
    ("--max-batch", "0", "--max-batch must be in 1..4096"),
    ("--max-delay-ms", "1e9", "--max-delay-ms must be in 0..10000"),
    ("--max-delay-ms", "inf", "--max-delay-ms must be in 0..10000"),
    ("--threads", "100000", "--threads must be in 1..1024"),
    ("--grace", "inf", "--grace must be in 0..3600 seconds"),
    ("--grace", "-1", "--grace must be in 0..3600 seconds"),
])
def test_a_flag_value_that_would_stall_or_exhaust_the_server_is_refused(
        flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Values that start a server that cannot serve (a warm-up of a hundred million windows, a batch wait of
    days, a hundred thousand threads, a drain that never ends) exit 2 naming the bound."""
    from serving.__main__ import build_parser, config_from_args

    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        config_from_args(parser, parser.parse_args(["--model", "m.onnx", f"{flag}={value}"]))
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_metrics_port_that_would_take_the_grpc_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from serving.__main__ import build_parser, config_from_args

    parser = build_parser()
    for flags in (["--port", "50100", "--metrics-port", "50100"],
                  ["--port", "50101", "--metrics-port", "50100", "--workers", "2"]):
        with pytest.raises(SystemExit) as exc:
            config_from_args(parser, parser.parse_args(["--model", "m.onnx", *flags]))
        assert exc.value.code == 2 and "--metrics-port 50100 would take --port 5010" in capsys.readouterr().err
    ok = ["--model", "m.onnx", "--port", "50102", "--metrics-port", "50100", "--workers", "2"]
    assert config_from_args(parser, parser.parse_args(ok)).metrics_port == 50100

def test_bars_with_wider_gaps_or_a_few_short_ones_are_served() -> None:
    """Only bars mostly much closer than the model's, or mostly a day and 20 intervals apart, are refused: a
    quiet market's bars skip intervals (a training symbol may be mostly a few apart), a few short gaps (a
    session's odd first bar) are not a unit mistake, and a few long ones are nights and weekends."""
    sparse = _spaced(series(), 1_704_103_200 * 10**9, 5 * 60 * 10**9)  # 5-minute gaps
    few_short = series("NQ")
    few_short.timestamp_ns[3] = few_short.timestamp_ns[2] + 1  # one gap of 1 ns, one of 2 min - 1 ns
    assert [len(s) for s in parse_request(_req(sparse, few_short), META)] == [NEED, NEED]
    hours = _spaced(series(), 1_704_103_200 * 10**9, 3_600 * 10**9)  # 60 intervals apart, but under a day
    nights = series()
    ts = list(nights.timestamp_ns)
    nights.timestamp_ns[:] = [t + (k // 2) * 86_400 * 10**9 for k, t in enumerate(ts)]  # every other gap a day
    assert [len(s) for s in parse_request(_req(hours, series("NQ")), META)] == [NEED, NEED]
    assert [len(s) for s in parse_request(_req(nights), META)] == [NEED]
    thin = series()  # a thin market: a bar a day or two apart, at whatever minute it traded (as trained on)
    minutes = np.random.default_rng(3).integers(0, 1_440, NEED)
    thin.timestamp_ns[:] = [1_704_103_200 * 10**9 + (k * 1_440 * 3 // 2 + int(m)) * 60 * 10**9
                            for k, m in enumerate(minutes)]
    assert [len(s) for s in parse_request(_req(thin), META)] == [NEED]


def test_the_metrics_endpoint_stops_and_frees_its_port() -> None:
    """What a start that fails after the metrics endpoint is up relies on: nothing keeps listening."""
    import socket
    import urllib.request

    from serving.metrics import Metrics

    m = Metrics()
    port = m.serve_http("127.0.0.1", 0)
    assert b"foxhunt_requests" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    m.stop_http()
    m.stop_http()  # a second stop is a no-op
    with pytest.raises(ConnectionRefusedError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_two_user_columns_reach_the_model_in_its_order_whatever_order_they_are_sent_in() -> None:
    """A wide model's user columns are matched by name: sent in another order (as fields, as a packed block,
    one series or several), the model gets them in its own order, exactly as the shared feature code
    computes them from the columns in that order (which a test holds bit for bit to training's windows)."""
    from features.compute import latest_windows
    from features.schema import ENCODER_OBSERVED

    fc = FeatureConfig(horizon=3, volatility_window=5, user_columns=("spread", "depth"))
    meta = dataclasses.replace(META, feature_config=fc, feature_schema=fc.schema())
    sent = []
    for k, symbol in enumerate(("ES", "NQ")):
        s = series(symbol, seed=k)
        rng = np.random.default_rng(10 + k)
        del s.user_features[:]  # depth first, on another scale: an order mix-up cannot hide
        s.user_features.add(name="depth", values=rng.uniform(1e3, 5e3, NEED).tolist())
        s.user_features.add(name="spread", values=rng.uniform(0.1, 0.5, NEED).tolist())
        sent.append(s)

    def expected(chosen: list[pb.Series]) -> np.ndarray:
        cols = [np.array([getattr(s, c) for s in chosen], dtype=np.float64 if c != "timestamp_ns" else np.int64)
                for c in ("timestamp_ns", "open", "high", "low", "close", "volume")]
        by_name = [{c.name: np.asarray(c.values) for c in s.user_features} for s in chosen]
        user = [np.concatenate([u[name] for u in by_name]) for name in fc.user_columns]  # the model's order
        return latest_windows(*cols, user, fc, meta.encoder_length, meta.bar_interval_ns).encoder_observed

    for chosen in (sent[:1], sent):
        for form in (lambda s: s, packed):
            got = prepare([columns_from_proto(form(s)) for s in chosen], meta).inputs[ENCODER_OBSERVED]
            assert got.tobytes() == expected(chosen).tobytes(), (len(chosen), form)


def test_the_series_advice_of_a_response_too_large_always_fits() -> None:
    """'send at most k series' must hold for any k of them: a response of its k largest forecasts, with the
    model version beside them, stays within the limit, for every limit up to the whole response's size."""
    from serving.servicer import series_that_fit

    forecasts = [pb.Forecast(symbol=sym, log_return=[0.1] * 15, price=[1.0] * 15, model_version="abc123def456")
                 for sym in ("ES", "NQZ6", "CL", "RTYZ6")]  # one model's: the same shapes, symbols of any length
    response = pb.PredictResponse(forecasts=forecasts, model_version="abc123def456")
    largest = sorted(forecasts, key=lambda f: f.ByteSize(), reverse=True)
    for limit in range(1, response.ByteSize() + 1):
        k = series_that_fit(response, limit)
        if k:  # 0: not even one fits, and the advice is not given
            assert pb.PredictResponse(forecasts=largest[:k], model_version="abc123def456").ByteSize() <= limit, limit
    assert series_that_fit(response, response.ByteSize()) >= 3  # the advice is not needlessly small
    assert series_that_fit(pb.PredictResponse(), 100) == 0


# ---- rules at their boundaries: a close just below its low, forecast times just past int64 ---------------
def test_a_close_below_the_low_is_refused() -> None:
    s = series()
    s.close[5] = s.low[5] * 0.999  # within 100x of its neighbours: only the range rule is broken
    with pytest.raises(RequestError, match=r"column 'low', row 5: open or close below low"):
        parse_request(_req(s), META)


def test_a_series_whose_forecast_times_would_pass_int64_is_refused() -> None:
    step, h = META.bar_interval_ns, META.horizon  # 60 s, 3 steps
    for last, refused in ((2**63 - 1 - h * step, False), (2**63 - 1 - (h - 1) * step, True)):
        s = series()
        n = len(s.timestamp_ns)
        s.timestamp_ns[:] = [last - (n - 1 - i) * step for i in range(n)]
        if refused:  # last + step fits in int64, last + 3 steps does not
            with pytest.raises(RequestError, match="past the last time this model can forecast from"):
                parse_request(_req(s), META)
        else:  # last + 3 steps is exactly int64's largest value: it fits
            assert parse_request(_req(s), META)[0].timestamp_ns[-1] == last


def test_a_request_error_names_each_field_at_fault_and_its_details_fit_a_trailer() -> None:
    """INVALID_ARGUMENT carries google.rpc.BadRequest in grpc-status-details-bin, one field violation per problem
    the message lists; however long the message and the problems, the trailer stays within the 8 KiB of
    metadata a gRPC client accepts by default (past it the call fails with no status at all)."""
    import base64
    import urllib.parse

    from google.rpc import error_details_pb2, status_pb2

    from serving.errors import MAX_DETAILS_BYTES, status_details

    s = series()
    s.close[3] = float("nan")
    s.volume[5] = -1.0
    s.user_features[0].values[0] = float("inf")
    with pytest.raises(RequestError) as info:
        parse_request(_req(series("NQ"), s), META)
    code, message = status_of(info.value)
    [(key, value)] = status_details(info.value, code, message)
    sent = message
    status = status_pb2.Status.FromString(value)
    bad = error_details_pb2.BadRequest()
    assert key == "grpc-status-details-bin" and status.code == 3 and status.message == sent == message
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["series[1].close", "series[1].volume",
                                                      "series[1].user_features"], bad
    assert all(v.description in message for v in bad.field_violations)
    packed = series()  # the same user column sent packed: the field is the block it came in
    values = np.array(packed.user_features[0].values)
    values[2] = float("nan")
    del packed.user_features[:]
    packed.user_feature_names.append("spread")
    packed.user_features_raw = values.astype("<f8").tobytes()
    with pytest.raises(RequestError) as info:
        parse_request(_req(packed), META)
    assert [f for f, _ in info.value.violations] == ["series[0].user_features_raw"]
    assert status_details(NotReady("warming up"), grpc.StatusCode.UNAVAILABLE, "warming up") == ()
    # the longest messages: ASCII (a byte each on the wire) and non-ASCII (each byte percent-encoded: 3 characters)
    for text in ("x" * 5000, "é" * MAX_DETAILS_BYTES, "螺纹钢" * MAX_DETAILS_BYTES):
        huge = RequestError(text, violations=[(f"series[{i}].user_features", "y" * 5000) for i in range(5)])
        code, message = status_of(huge)
        [(_, value)] = status_details(huge, code, message)
        sent = message
        header = urllib.parse.quote(sent, safe="")
        assert len(header) + len(base64.b64encode(value)) + 64 < 8192, (len(header), len(value))
        assert status_pb2.Status.FromString(value).message == sent  # one message: from_call checks they agree
        assert message.startswith(sent.removesuffix(" ...")) and len(sent) > 100, sent


def test_only_windows_of_bars_mostly_further_apart_than_the_models_carry_a_warning() -> None:
    """A session break inside a window (one long gap) is no reason to warn; bars mostly 5 minutes apart sent to a
    1-minute model are (served all the same: the steps are still the model's bars)."""
    from serving.postprocess import spacing_warnings

    regular, broken, sparse = series("ES"), series("NQ"), series("ES")
    ts = np.asarray(broken.timestamp_ns)
    broken.timestamp_ns[:] = np.where(np.arange(NEED) >= NEED - 3, ts + 17 * 3_600 * 10**9, ts).tolist()  # overnight
    sparse.timestamp_ns[:] = (1_704_103_200 * 10**9 + 5 * 60 * 10**9 * np.arange(NEED)).tolist()
    prepared = prepare(parse_request(_req(regular, broken), META), META)
    assert spacing_warnings(prepared, META.bar_interval_ns) == {}
    prepared = prepare(parse_request(_req(broken, sparse), META), META)
    assert spacing_warnings(prepared, META.bar_interval_ns) == {1: (
        "series[1] (ES): the bars the model reads are mostly 5min apart, but the model's bar interval is 1min: its "
        "forecast steps are 1min bars, and it was trained on such bars; resample the bars to 1min, or use a model "
        "trained on this interval",)}


def test_overload_refusals_are_logged_at_once_then_counted_each_minute(caplog: pytest.LogCaptureFixture) -> None:
    from serving.errors import Overloaded
    from serving.metrics import Metrics
    from serving.servicer import Admission

    due: list[Callable[[], None]] = []  # what the event loop would run a minute later
    admission = Admission(1, Metrics(), schedule=lambda delay, fn: due.append(fn) or True)
    admission.take()

    def refuse(times: int) -> None:
        for _ in range(times):
            with pytest.raises(Overloaded, match="--max-concurrent 1"):
                admission.take()

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    with caplog.at_level("WARNING", logger="serving"):
        refuse(38)  # a burst: one line at once, naming the fix
        assert len(lines()) == 1 and lines()[0].startswith("overloaded: refusing calls RESOURCE_EXHAUSTED, "
                                                            "--max-concurrent 1 in flight") and len(due) == 1
        due.pop()()  # a minute on: the rest of the burst, counted
        assert lines()[-1].startswith("overloaded: refused 37 more call(s) RESOURCE_EXHAUSTED in the last 60 s")
        refuse(5)
        due.pop()()
        assert lines()[-1].startswith("overloaded: refused 5 more call(s)") and len(lines()) == 3
        due.pop()()  # a quiet minute: nothing to count, and the count stops
        assert len(lines()) == 3 and not due
        refuse(1)  # the next overload is news again
        assert len(lines()) == 4 and lines()[-1].startswith("overloaded: refusing calls") and len(due) == 1
    admission.give_back()
    admission.take()  # a slot again once one is given back
    alone = Admission(1, Metrics())  # no event loop to count on: each refusal is a line of its own, never silence
    alone.take()
    with caplog.at_level("WARNING", logger="serving"):
        caplog.clear()
        for _ in range(2):
            with pytest.raises(Overloaded):
                alone.take()
    assert [r.getMessage()[:30] for r in caplog.records] == ["overloaded: refusing calls RES"] * 2


class FakeContext:
    """A servicer context whose deadline is whatever the test says: `remaining` seconds (None: no deadline)."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def time_remaining(self) -> float | None:
        return self.remaining

    async def abort(self, code: grpc.StatusCode, message: str, details: object = ()) -> None:
        self.aborted = (code, message)
        raise RuntimeError("aborted")  # as grpc.aio's abort does, it ends the handler


@pytest.mark.parametrize(("outcome", "remaining", "counted", "sent"), [
    ("answer", 1.0, "OK", None),
    ("answer", 0.0, "DEADLINE_EXCEEDED", None),  # an answer after the deadline: nothing is sent
    ("bad request", 1.0, "INVALID_ARGUMENT", grpc.StatusCode.INVALID_ARGUMENT),
    ("bad request", -0.5, "DEADLINE_EXCEEDED", None),  # an error after the deadline: nothing is sent either
    ("expired in the queue", 1.0, "DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED),
    ("cancelled", 1.0, "CANCELLED", None),
    ("cancelled", 0.0, "DEADLINE_EXCEEDED", None),
    ("bug", None, "INTERNAL", grpc.StatusCode.INTERNAL),
])
def test_each_call_is_counted_once_by_its_code_and_nothing_is_sent_past_its_deadline(
        outcome: str, remaining: float | None, counted: str, sent: grpc.StatusCode | None) -> None:
    """The rpc decorator with the call's deadline injected: what the caller is sent and how it is counted."""
    from serving.metrics import Metrics
    from serving.servicer import rpc

    class Servicer:
        metrics = Metrics()

        @rpc("Predict")
        async def Predict(self, request: str, context: FakeContext) -> str:
            if outcome == "bad request":
                raise RequestError("series[0]: symbol is empty", "series[0].symbol")
            if outcome == "expired in the queue":
                raise QueueDeadlineExceeded("deadline exceeded after 3.0 ms in the queue; not run")
            if outcome == "cancelled":
                raise asyncio.CancelledError
            if outcome == "bug":
                raise KeyError("bug")
            return "forecast"

    context = FakeContext(remaining)
    try:
        got: object = asyncio.run(Servicer().Predict("request", context))  # type: ignore[arg-type]
    except (asyncio.CancelledError, RuntimeError) as exc:
        got = exc
    if outcome == "answer" and counted == "OK":
        assert got == "forecast"
    elif sent is None:
        assert isinstance(got, asyncio.CancelledError) and context.aborted is None
    else:
        assert context.aborted is not None and context.aborted[0] == sent
    counts = {code: Servicer.metrics.requests.labels("Predict", code)._value.get()
              for code in ("OK", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL")}
    assert counts == {code: 1.0 if code == counted else 0.0 for code in counts}
