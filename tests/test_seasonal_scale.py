"""The seasonal volatility scale: a log-volatility profile of the calendar, fitted on the training bars and
folded into the model, so that an untrained model forecasts in the units of a seasonal GARCH."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.calibrate import SCALE_INPUTS, CalibratedModel
from export.fp16 import convert_to_fp16
from export.onnx_export import export_model, input_names
from export.options import ExportOptions
from export.parity import check_parity, make_cases
from export.pipeline import fp32_initializers
from features.calendar import HOUR_NS, NS_PER_DAY, known_features
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL
from tests.conftest import write_parquet
from trainer.config import TrainConfig
from trainer.data import Profile, fit_profile, prepare, training_profile
from trainer.loop import parameter_groups
from trainer.model_config import ModelConfig
from trainer.modeling import (
    LOG_RANGE,
    LOG_RETURN,
    N_PROFILE_TERMS,
    SCALE_LR_FACTOR,
    TemporalFusionTransformer,
    profile_terms,
)

WEEK = 7 * 24  # hourly bars
MONDAY_NS = 19_723 * NS_PER_DAY  # 2024-01-01, a Monday
L, H = 24, 6


def planted_log_profile(ts: np.ndarray) -> np.ndarray:
    """A smooth log profile of the hour of week: a busy midnight, a quiet noon, quieter weekends."""
    cal = known_features(ts).astype(np.float64)  # [..., 4]
    return 0.6 * cal[..., 1] + 0.2 * (2 * cal[..., 0] * cal[..., 1]) + 0.15 * cal[..., 3]


def hourly_bars(weeks: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Timestamps [n] and 1-bar log returns [n] whose spread at each hour of week is the planted profile's."""
    ts = MONDAY_NS + np.arange(weeks * WEEK, dtype=np.int64) * HOUR_NS
    r = 1e-3 * np.exp(planted_log_profile(ts)) * np.random.default_rng(seed).standard_normal(ts.size)
    return ts, r


def log_profile_of(profile: Profile, ts: np.ndarray) -> np.ndarray:
    """The fitted log profile at `ts`, as numpy computes the model's terms."""
    cal = known_features(ts).astype(np.float64)
    terms = np.stack(profile_terms(*np.moveaxis(cal, -1, 0)), axis=-1)  # [n, P]
    log_p = terms @ profile.coefficients[1:].astype(np.float64) + profile.coefficients[0]
    return np.clip(log_p, *profile.bounds.astype(np.float64))


def test_the_fit_recovers_a_planted_hour_of_week_profile() -> None:
    ts, r = hourly_bars(weeks=150)
    profile = fit_profile(r, ts, "UTC", HOUR_NS)
    week = ts[:WEEK]
    planted = planted_log_profile(week)
    planted -= 0.5 * np.log(np.mean(np.exp(2 * planted)))  # unit RMS, as the fit normalises
    np.testing.assert_allclose(log_profile_of(profile, week), planted, atol=0.08)
    assert np.mean(np.exp(2 * log_profile_of(profile, ts))) == pytest.approx(1.0, abs=0.03)


def test_daily_bars_or_too_few_slots_give_a_flat_profile() -> None:
    ts, r = hourly_bars(weeks=150)
    daily = fit_profile(r[::24], ts[::24], "UTC", NS_PER_DAY)
    few = fit_profile(r[:200], ts[:200], "UTC", HOUR_NS)  # no slot holds 20 returns
    for profile in (daily, few):
        assert not profile.coefficients.any() and not profile.bounds.any()


@pytest.fixture(scope="module")
def swapped_bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hourly bars of one symbol whose profile flips (busy noon, quiet midnight) after the first 60% of them."""
    ts, r = hourly_bars(weeks=60, seed=1)
    late = np.arange(ts.size) >= int(0.6 * ts.size)
    r = np.where(late, r * np.exp(-2 * 0.6 * known_features(ts)[:, 1]), r)
    close = 100.0 * np.exp(np.cumsum(r))
    opens = np.concatenate([[100.0], close[:-1]])
    return write_parquet(tmp_path_factory.mktemp("seasonal") / "bars.parquet", {
        "timestamp": ts, "symbol": ["ES"] * ts.size, "open": opens, "high": np.maximum(opens, close) * 1.0001,
        "low": np.minimum(opens, close) * 0.9999, "close": close, "volume": np.full(ts.size, 100.0)})


def test_the_fit_reads_the_training_rows_only(swapped_bars: Path) -> None:
    cfg = TrainConfig(encoder_length=L, horizon=H, val_fraction=0.4, threads=1, device="cpu", seasonal_scale=True)
    data = prepare(swapped_bars, cfg)
    assert data.profile is not None
    train_rows = np.arange(int(np.searchsorted(data.frame.timestamp_ns, data.split_times_ns[0])))
    expected = training_profile(data.frame, train_rows)
    np.testing.assert_array_equal(data.profile.coefficients, expected.coefficients)
    midnight, noon = MONDAY_NS + np.array([0, 12 * HOUR_NS])
    busy, quiet = log_profile_of(symbol_profile(data.profile, 0), np.array([midnight, noon]))
    assert busy - quiet == pytest.approx(1.2, abs=0.15)  # the training bars' profile, not the flipped one
    everything = training_profile(data.frame, np.arange(len(data.frame)))
    assert np.diff(log_profile_of(symbol_profile(everything, 0), np.array([midnight, noon])))[0] > -0.8


def symbol_profile(profile: Profile, symbol: int) -> Profile:
    """One symbol's row of a training profile."""
    return Profile(profile.coefficients[symbol], profile.bounds[symbol], profile.level[symbol],
                   profile.ranged[symbol])


def tiny_model(seasonal: bool, seed: int = 0) -> TemporalFusionTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(n_observed=5, n_known=4, static_cardinalities=(2,), hidden_size=8, attention_heads=2,
                      encoder_length=L, horizon=H, seasonal_scale=seasonal)
    return TemporalFusionTransformer(cfg).eval()


def windows(last_ns: np.ndarray, deseasonalised: np.ndarray, log_profile: np.ndarray) -> dict[str, torch.Tensor]:
    """Windows whose encoder bars end at `last_ns` [B], with returns deseasonalised [B, L] times the profile."""
    enc_ts = last_ns[:, None] + np.arange(-L + 1, 1) * HOUR_NS  # [B, L]
    dec_ts = last_ns[:, None] + np.arange(1, H + 1) * HOUR_NS  # [B, H]
    observed = np.zeros((last_ns.size, L, 5), np.float32)
    observed[..., LOG_RETURN] = deseasonalised * np.exp(log_profile)
    return {STATIC_CATEGORICAL: torch.zeros(last_ns.size, 1, dtype=torch.int64),
            ENCODER_OBSERVED: torch.from_numpy(observed),
            ENCODER_KNOWN: torch.from_numpy(known_features(enc_ts)),
            DECODER_KNOWN: torch.from_numpy(known_features(dec_ts))}


def normalized(model: TemporalFusionTransformer) -> TemporalFusionTransformer:
    """`model` with returns' statistics of about 1e-3 a bar, so that no scale sits at its floor."""
    model.set_normalization(np.full(5, 1e-4), np.full(5, 2e-3), np.full(4, 0.1), np.full(4, 0.7),
                            1e-3 * np.sqrt(np.arange(1, H + 1)))
    return model


def planted_model() -> tuple[TemporalFusionTransformer, Profile]:
    """An untrained seasonal model with log p = 0.5 cos(time-of-day angle): busy at midnight, quiet at noon."""
    coefficients = np.zeros(1 + N_PROFILE_TERMS, np.float32)
    coefficients[2] = 0.5  # the time of day's first cosine
    profile = Profile(coefficients, np.array([-0.5, 0.5], np.float32), np.array(0.0, np.float32),
                      np.array(0.0, np.float32))
    model = normalized(tiny_model(seasonal=True))
    flat = Profile.flat()  # symbol 1's; neither has a long-run level
    model.set_profile(np.stack([profile.coefficients, flat.coefficients]), np.stack([profile.bounds, flat.bounds]),
                      np.zeros(2), np.zeros(2))  # no level; close-only bars (no ranges)
    return model, profile


def test_an_untrained_models_scale_follows_the_profile_on_future_bars() -> None:
    model, profile = planted_model()
    busy_next, quiet_next = MONDAY_NS + 23 * HOUR_NS, MONDAY_NS + 11 * HOUR_NS  # the next bars: midnight, noon
    last = np.array([busy_next, quiet_next], dtype=np.int64)
    enc_ts = last[:, None] + np.arange(-L + 1, 1) * HOUR_NS
    signs = np.where(np.arange(L) % 2, 1.0, -1.0)
    batch = windows(last, 1e-3 * np.tile(signs, (2, 1)), log_profile_of(profile, enc_ts))
    with torch.no_grad():
        scale = model.forecast_scale(*(batch[n] for n in SCALE_INPUTS))
        quantiles = model(*(batch[n] for n in input_names(model.cfg))).quantiles  # [2, H, Q]
    dec_ts = last[:, None] + np.arange(1, H + 1) * HOUR_NS
    expected = 1e-3 * np.sqrt(np.cumsum(np.exp(2 * log_profile_of(profile, dec_ts)), axis=1))  # [2, H]
    np.testing.assert_allclose(scale[..., 0].numpy(), expected, rtol=1e-4)
    assert float(scale[0, 0, 0] / scale[1, 0, 0]) == pytest.approx(math.e, rel=1e-4)  # e^0.5 / e^-0.5
    spread = (quantiles[:, 0, -1] - quantiles[:, 0, 0]).numpy()  # the first future bar's 10%..90%
    assert spread[0] / spread[1] == pytest.approx(math.e, rel=0.05)


def test_a_flat_profile_no_level_and_no_range_compute_the_plain_volatility_scale() -> None:
    plain, seasonal = normalized(tiny_model(seasonal=False)), tiny_model(seasonal=True)
    seasonal.load_state_dict(plain.state_dict(), strict=False)  # the same weights; the profile stays flat
    rng = np.random.default_rng(3)
    last = MONDAY_NS + rng.integers(0, WEEK, 8) * HOUR_NS
    batch = windows(last, 1e-3 * rng.standard_normal((8, L)), np.zeros((8, L)))
    inputs = [batch[n] for n in input_names(plain.cfg)]
    with torch.no_grad():
        torch.testing.assert_close(plain(*inputs).quantiles, seasonal(*inputs).quantiles, rtol=1e-6, atol=0)
        torch.testing.assert_close(plain.forecast_scale(batch[ENCODER_OBSERVED]),
                                   seasonal.forecast_scale(*(batch[n] for n in SCALE_INPUTS)), rtol=1e-6, atol=0)


def test_configs_stored_without_the_switch_load_with_the_plain_scale() -> None:
    stored = tiny_model(seasonal=False).cfg.to_dict()
    del stored["seasonal_scale"]
    assert ModelConfig.from_dict(stored).seasonal_scale is False
    assert TrainConfig.from_dict({"hidden_size": 8}).seasonal_scale is False
    assert TrainConfig(seasonal_scale=True).model_config(5, 4, 1).seasonal_scale is True
    assert TrainConfig(seasonal_scale=True, quantile_scale="fixed").model_config(5, 4, 1).seasonal_scale is False
    assert TemporalFusionTransformer(ModelConfig.from_dict(stored)).state_dict().keys() == \
        tiny_model(seasonal=False).state_dict().keys()


def test_the_seasonal_scale_exports_with_parity_in_fp32_and_fp16() -> None:
    model, profile = planted_model()
    rng = np.random.default_rng(5)
    last = MONDAY_NS + rng.integers(0, WEEK, 4) * HOUR_NS
    enc_ts = last[:, None] + np.arange(-L + 1, 1) * HOUR_NS
    batch = windows(last, 1e-3 * rng.standard_normal((4, L)), log_profile_of(profile, enc_ts))
    example = {n: batch[n] for n in input_names(model.cfg)}
    net = CalibratedModel(model, np.zeros((model.cfg.horizon, len(model.cfg.quantiles)), np.float32))  # as exported
    proto = export_model(net, example, ExportOptions(Path(), Path()).opset, explain=False)
    cases = make_cases({n: batch[n].numpy() for n in input_names(model.cfg)}, model, batches=(3,))
    kept = fp32_initializers(model.cfg)
    keep = [t.name for t in proto.graph.initializer if t.name.rsplit(".", 1)[-1] in kept]
    assert len(keep) == len(kept)
    for precision, graph in (("fp32", proto), ("fp16", convert_to_fp16(proto, keep))):
        session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
        report = check_parity(model, net, session, cases, precision)
        assert report.passed, report.table()


def test_each_symbol_gets_its_own_profile_and_a_short_one_the_pooled(tmp_path: Path) -> None:
    """ES busy at midnight, HE busy at noon (a day-session future); NQ's few bars fit nothing of their own."""
    ts, r = hourly_bars(weeks=60, seed=2)
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("timestamp", "symbol", "close")}
    for symbol, sign, n in (("ES", 1.0, ts.size), ("HE", -1.0, ts.size), ("NQ", 1.0, 200)):
        returns = r[:n] * np.exp((sign - 1.0) * 0.6 * known_features(ts[:n])[:, 1])  # HE: the profile flipped
        columns["timestamp"].append(ts[:n])
        columns["symbol"].append(np.array([symbol] * n))
        columns["close"].append(100.0 * np.exp(np.cumsum(returns)))
    close = np.concatenate(columns["close"])
    path = write_parquet(tmp_path / "bars.parquet", {
        "timestamp": np.concatenate(columns["timestamp"]), "symbol": np.concatenate(columns["symbol"]),
        "open": close, "high": close * 1.0001, "low": close * 0.9999, "close": close,
        "volume": np.full(close.size, 100.0)})
    cfg = TrainConfig(encoder_length=L, horizon=H, val_fraction=0.2, threads=1, device="cpu", seasonal_scale=True)
    data = prepare(path, cfg)
    assert data.profile is not None
    ids = {name: data.frame.symbols.index(name) for name in ("ES", "HE", "NQ")}
    midnight, noon = MONDAY_NS + np.array([0, 12 * HOUR_NS])

    def busy_minus_quiet(symbol: str) -> float:
        busy, quiet = log_profile_of(symbol_profile(data.profile, ids[symbol]), np.array([midnight, noon]))
        return float(busy - quiet)

    assert busy_minus_quiet("ES") == pytest.approx(1.2, abs=0.15)
    assert busy_minus_quiet("HE") == pytest.approx(-1.2, abs=0.15)
    train_rows = np.flatnonzero(data.frame.timestamp_ns < data.split_times_ns[0])
    pooled = fit_profile(data.frame.observed[train_rows, LOG_RETURN], data.frame.timestamp_ns[train_rows], "UTC",
                         HOUR_NS)
    np.testing.assert_array_equal(data.profile.coefficients[ids["NQ"]], pooled.coefficients)
    es = data.frame.observed[train_rows[data.frame.series_id[train_rows] == ids["ES"]], LOG_RETURN]
    assert data.profile.level[ids["ES"]] == pytest.approx(np.sqrt(np.nanmean(es.astype(np.float64) ** 2)))


def test_a_window_takes_its_own_symbols_profile() -> None:
    model, _ = planted_model()  # symbol 0: the planted profile; symbol 1: flat
    rng = np.random.default_rng(4)
    last = MONDAY_NS + rng.integers(0, WEEK, 6) * HOUR_NS
    batch = windows(last, 1e-3 * rng.standard_normal((6, L)), np.zeros((6, L)))
    batch[STATIC_CATEGORICAL] = torch.tensor([[0], [1]] * 3)
    plain = normalized(tiny_model(seasonal=False))
    with torch.no_grad():
        scale = model.forecast_scale(*(batch[n] for n in SCALE_INPUTS))  # [6, H, 1]
        flat = plain.forecast_scale(batch[ENCODER_OBSERVED])
    torch.testing.assert_close(scale[1::2], flat[1::2])
    assert not torch.allclose(scale[0::2], flat[0::2], rtol=1e-2)


def test_the_forecast_variance_reverts_from_the_recent_to_the_long_run_level() -> None:
    """As a GARCH forecasts: after a quiet spell each future bar's variance rises toward the symbol's long-run
    level, after a busy one it falls, and it lies between the encoder's recent variance and that level."""
    model, _ = planted_model()
    level = 1e-3
    flat = Profile.flat()
    model.set_profile(np.stack([flat.coefficients] * 2), np.stack([flat.bounds] * 2), np.full(2, level), np.zeros(2))
    last = MONDAY_NS + np.array([0, 0]) * HOUR_NS
    signs = np.where(np.arange(L) % 2, 1.0, -1.0)
    batch = windows(last, np.stack([1e-4 * signs, 1e-2 * signs]), np.zeros((2, L)))  # quiet, busy
    with torch.no_grad():
        per_bar = np.diff(model.forecast_scale(*(batch[n] for n in SCALE_INPUTS))[..., 0].double().numpy() ** 2,
                          prepend=0.0)  # [2, H] each future bar's variance
    quiet, busy = per_bar
    assert np.all((quiet > 1e-4**2) & (quiet < level**2)) and np.all(np.diff(quiet) > 0)
    assert np.all((level**2 < busy) & (busy < 1e-2**2)) and np.all(np.diff(busy) < 0)


def test_a_bars_range_enters_its_variance_as_parkinsons_estimator() -> None:
    """Ranges of sqrt(4 ln 2) times the bars' absolute returns (Parkinson's expectation for a random walk) give
    the scale the returns alone give; wider ranges, a wider scale; a symbol of close-only bars ignores them."""
    model, profile = planted_model()
    rng = np.random.default_rng(6)
    last = MONDAY_NS + rng.integers(0, WEEK, 4) * HOUR_NS
    batch = windows(last, 1e-3 * rng.standard_normal((4, L)), np.zeros((4, L)))
    returns = batch[ENCODER_OBSERVED][..., LOG_RETURN]
    with torch.no_grad():
        alone = model.forecast_scale(*(batch[n] for n in SCALE_INPUTS))
        batch[ENCODER_OBSERVED][..., LOG_RANGE] = 3.0 * returns.abs()
        torch.testing.assert_close(model.forecast_scale(*(batch[n] for n in SCALE_INPUTS)), alone)  # not ranged
        flat = Profile.flat()
        model.set_profile(np.stack([profile.coefficients, flat.coefficients]),
                          np.stack([profile.bounds, flat.bounds]), np.zeros(2), np.ones(2))
        for factor, wider in ((1.0, False), (3.0, True)):
            batch[ENCODER_OBSERVED][..., LOG_RANGE] = factor * math.sqrt(4 * math.log(2)) * returns.abs()
            both = model.forecast_scale(*(batch[n] for n in SCALE_INPUTS))
            if wider:
                assert torch.all(both > 1.5 * alone)
            else:
                torch.testing.assert_close(both, alone)


def test_the_scales_scalars_train_at_their_own_rate_without_decay() -> None:
    cfg = TrainConfig(learning_rate=2e-3, weight_decay=0.1)
    seasonal, plain = tiny_model(seasonal=True), tiny_model(seasonal=False)
    network, scale = parameter_groups(seasonal, cfg)
    assert {id(p) for p in scale["params"]} == {id(p) for p in seasonal.scale_parameters()} and scale["params"]
    assert scale["lr"] == pytest.approx(2e-3 * SCALE_LR_FACTOR) and scale["weight_decay"] == 0.0
    assert len(network["params"]) + len(scale["params"]) == len(list(seasonal.parameters()))
    assert [g["params"] for g in parameter_groups(plain, cfg)] == [list(plain.parameters())]


def test_ranges_count_where_the_bars_have_them() -> None:
    ts, r = hourly_bars(weeks=30)
    ranged = fit_profile(r, ts, "UTC", HOUR_NS, np.abs(r) * 1.5)
    close_only = fit_profile(r, ts, "UTC", HOUR_NS, np.zeros_like(r))
    assert ranged.ranged == 1.0 and close_only.ranged == 0.0
    fixed = fit_profile(r, ts, "UTC", HOUR_NS, np.full_like(r, 2e-4))  # a feed's high and low at close +- a tick
    assert fixed.ranged == 0.0
