"""Known contract features of a `calendar:N` model: sessions to the front's expiration and the roll-session flag,
known ahead from the rule and the expirations, the same in training rows, in a server's decoder and in its
encoder."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from features.bars import Bars
from features.compute import build_frame, latest_windows
from features.config import BUILTIN_KNOWN, CONTRACT_KNOWN, FeatureConfig
from features.contracts import ContractConfig
from features.model_meta import ModelMeta
from features.rolls import continuous, contract_known
from features.schema import DECODER_KNOWN, ENCODER_KNOWN
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.preprocess import prepare
from serving.validation import parse_request
from serving.wire import make_series

HOUR = 3_600_000_000_000
EXPIRATIONS = (("ESH5", "2025-03-14"), ("ESM5", "2025-06-20"))
CALENDAR = ContractConfig(roll="calendar:2", expirations=EXPIRATIONS)
FC = FeatureConfig(horizon=3, volatility_window=5, contracts=CALENDAR)
ROLL_DAY = "2025-03-12"  # two weekday sessions (03-12, 03-13) left to ESH5's expiration: not more than 2


def day_ns(day: str) -> int:
    return int(np.datetime64(day, "ns").astype(np.int64))


def weekday_bars(first: str, last: str) -> Bars:
    """Hourly bars (every hour of each weekday, UTC) of both ESH5 and ESM5, ESM5 priced 3% over ESH5."""
    days = np.arange(np.datetime64(first), np.datetime64(last) + 1)
    days = days[np.is_busday(days)]
    ts = (days.astype("datetime64[ns]").astype(np.int64)[:, None] + HOUR * np.arange(24)).reshape(-1)  # [n]
    close = 5000.0 * np.exp(np.cumsum(np.random.default_rng(0).normal(0, 1e-3, ts.size)))
    ts2, names = np.repeat(ts, 2), np.tile(np.array(["ESH5", "ESM5"], dtype=object), ts.size)
    c = np.repeat(close, 2) * np.where(names == "ESM5", 1.03, 1.0)
    return Bars(ts2, names, c, c * 1.001, c * 0.999, c, np.full(c.size, 100.0))


def test_only_a_calendar_rolled_model_has_the_contract_features() -> None:
    assert FC.schema().known == [*BUILTIN_KNOWN, *CONTRACT_KNOWN]
    plain = FeatureConfig(horizon=3, volatility_window=5)
    for other in (plain, dataclasses.replace(FC, contracts=ContractConfig()),
                  dataclasses.replace(FC, contracts=ContractConfig(roll="none", contract_column="contract"))):
        assert other.schema() == plain.schema()


def test_values_at_and_around_the_roll() -> None:
    bars, rolls = continuous(weekday_bars("2025-03-07", "2025-03-17"), FC)
    assert [(r.old, r.new, r.timestamp_ns) for r in rolls] == [("ESH5", "ESM5", day_ns(ROLL_DAY))]
    frame = build_frame(bars, FC)
    day = frame.timestamp_ns.astype("datetime64[ns]").astype("datetime64[D]").astype(str)
    per_day = {d: frame.known[day == d][:, 4:] for d in np.unique(day).tolist()}
    assert all((v == v[0]).all() for v in per_day.values())  # one value per session
    got = {d: v[0].tolist() for d, v in per_day.items()}
    assert got == {"2025-03-07": [5.0, 0.0], "2025-03-10": [4.0, 0.0], "2025-03-11": [3.0, 0.0],
                   "2025-03-12": [72.0, 1.0],  # ESM5's 72 weekdays to 2025-06-20, the new front's first session
                   "2025-03-13": [71.0, 0.0], "2025-03-14": [70.0, 0.0], "2025-03-17": [69.0, 0.0]}
    assert frame.known.shape[1] == len(FC.schema().known)


def test_a_weekend_bar_belongs_to_the_weekday_session_it_opens() -> None:
    """Under calendar:4, ESH5 (expiring Friday 2025-03-14) leaves the front on Monday 03-10; Saturday's and Sunday's
    bars (a Sunday evening open) count as Monday's session."""
    cfg = dataclasses.replace(CALENDAR, roll="calendar:4")
    days = ["2025-03-07", "2025-03-08", "2025-03-09", "2025-03-10", "2025-03-11"]
    got = contract_known(np.array([day_ns(d) + 22 * HOUR for d in days]), np.array(["ES"]), cfg, "UTC")
    assert got.tolist() == [[5.0, 0.0], [74.0, 1.0], [74.0, 1.0], [74.0, 1.0], [73.0, 0.0]]


def test_the_series_takes_its_rows_from_the_front_the_known_features_name() -> None:
    """One calendar rule for the series and its features: on every row the series' contract is the front whose
    expiration the features count to, weekend bars included (a Sunday open is Monday's session), and a deferred
    month that trades while the rule's front has no bars yet gives the series no rows."""
    cfg = ContractConfig(roll="calendar:4", expirations=(*EXPIRATIONS, ("ESU5", "2025-09-19")))
    fc = dataclasses.replace(FC, contracts=cfg)
    weekdays = weekday_bars("2025-03-05", "2025-03-14")
    sunday = day_ns("2025-03-09") + 22 * HOUR  # the rule's roll to ESM5 is Monday 03-10, and Sunday opens it
    esm5_from = day_ns("2025-03-11")  # ESM5 has no bars in the first session of its turn; ESU5 trades throughout
    keep = (weekdays.symbol == "ESH5") | (weekdays.timestamp_ns >= esm5_from)
    rows = [(t, n) for t, n in zip(weekdays.timestamp_ns[keep].tolist(), weekdays.symbol[keep].tolist(), strict=True)]
    rows += [(sunday, "ESH5"), (sunday, "ESM5")] + [(t, "ESU5") for t in np.unique(weekdays.timestamp_ns).tolist()]
    rows.sort(key=lambda r: (r[1], r[0]))
    ts, names = np.array([t for t, _ in rows]), np.array([n for _, n in rows], dtype=object)
    c = np.full(ts.size, 5000.0)
    series, _ = continuous(Bars(ts, names, c, c, c, c, np.full(ts.size, 100.0)), fc)
    expiry = dict(cfg.expirations)
    left = np.busday_count(series.timestamp_ns.astype("datetime64[ns]").astype("datetime64[D]"),
                           np.array([expiry[str(n)] for n in series.contract], dtype="datetime64[D]"))
    np.testing.assert_array_equal(build_frame(series, fc).known[:, 4], left)  # sessions to the row's own expiry
    day = series.timestamp_ns.astype("datetime64[ns]").astype("datetime64[D]").astype(str)
    assert {str(n) for n in series.contract} == {"ESH5", "ESM5"}  # ESU5 is never the front before June
    assert set(series.contract[day < "2025-03-09"]) == {"ESH5"} and "2025-03-10" not in day
    assert set(series.contract[day >= "2025-03-09"]) == {"ESM5"} and "2025-03-09" in day


def test_past_the_last_known_roll_is_one_line_naming_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        contract_known(np.array([day_ns("2025-06-18")]), np.array(["ES"]), CALENDAR, "UTC")
    assert str(info.value) == ("root ES: on 2025-06-18 no contract with a known expiration has more than 2 sessions "
                               "left (--roll calendar:2; its last known expiration is 2025-06-20); give the coming "
                               "contracts' expirations in the --roots file (contract,root,expiration) and retrain")


@pytest.mark.parametrize("tz", ["UTC", "America/Chicago"])
def test_a_servers_decoder_sees_the_roll_training_rows_hold(tz: str) -> None:
    """At an origin a few bars before the roll, latest_windows' decoder values (from the rule at the nominal future
    times) equal build_frame's rows t+1..t+H, across the roll; the encoder's equal rows t-L+1..t."""
    fc = dataclasses.replace(FC, calendar_tz=tz)
    bars, _ = continuous(weekday_bars("2025-03-05", "2025-03-14"), fc)
    frame = build_frame(bars, fc)
    L, H = 4, fc.horizon
    first_new = int(np.flatnonzero(bars.contract == "ESM5")[0])
    assert frame.known[first_new, 5] == 1.0 and frame.known[first_new - 1, 5] == 0.0
    for t in range(first_new - H, first_new + 1):  # the decoder spans the roll, then starts at it
        rows = np.arange(t - fc.warmup_bars - L + 1, t + 1)
        assert bars.log_offset is not None
        w = latest_windows(bars.timestamp_ns[None, rows], bars.open[None, rows], bars.high[None, rows],
                           bars.low[None, rows], bars.close[None, rows], bars.volume[None, rows], [], fc, L,
                           frame.bar_interval_ns, log_offset=bars.log_offset[None, rows], roots=["ES"])
        np.testing.assert_array_equal(w.decoder_known[0], frame.known[t + 1:t + H + 1])
        np.testing.assert_array_equal(w.encoder_known[0], frame.known[t - L + 1:t + 1])


META = ModelMeta(
    model_config={}, feature_config=FC, feature_schema=FC.schema(), quantiles=(0.1, 0.5, 0.9), horizon=3,
    encoder_length=4, bar_interval_ns=HOUR, symbols=("ES",), checkpoint_sha256="0" * 64, model_version="unit",
    explain=False, precision="fp32",
)


@pytest.mark.parametrize("after", [-2, 0, 2], ids=["decoder spans the roll", "origin at the roll",
                                                     "encoder spans the roll"])
def test_a_request_spanning_the_roll_gets_the_training_windows_known_values(after: int) -> None:
    """The server's known inputs for per-contract bars sent with their contracts (serving.preprocess.prepare)
    equal the training rows of the same bars rolled (continuous + build_frame) at that origin."""
    every = weekday_bars("2025-03-05", "2025-03-14")
    bars, _ = continuous(every, FC)
    frame = build_frame(bars, FC)
    t = int(np.flatnonzero(bars.contract == "ESM5")[0]) + after
    sent = every.timestamp_ns <= bars.timestamp_ns[t]
    sent &= every.timestamp_ns > bars.timestamp_ns[t - META.bars_required]
    series = make_series("ES", every.timestamp_ns[sent], every.open[sent], every.high[sent], every.low[sent],
                         every.close[sent], every.volume[sent], contracts=every.symbol[sent])
    served = prepare(parse_request(pb.PredictRequest(series=[series]), META), META)
    L, H = META.encoder_length, META.horizon
    np.testing.assert_array_equal(served.inputs[ENCODER_KNOWN][0], frame.known[t - L + 1:t + 1])
    np.testing.assert_array_equal(served.inputs[DECODER_KNOWN][0], frame.known[t + 1:t + H + 1])
    assert served.inputs[DECODER_KNOWN].shape == (1, H, len(META.feature_schema.known))
