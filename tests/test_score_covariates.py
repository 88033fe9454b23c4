"""Known, static and categorical user features where bars are read outside the trainer: `serving.score` and
`serving.client`. The model is a small hand-built ONNX graph with a foxhunt model's metadata, so these run
without a trained model: every input it takes moves its output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from onnx import TensorProto, helper, numpy_helper

from features.bars import read_bars
from features.compute import build_frame
from features.config import FeatureConfig
from features.model_meta import FORMAT, PREFIX, ModelMeta, graph_digest
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    QUANTILES,
    STATIC_CATEGORICAL,
    STATIC_REAL,
)
from features.synth import generate
from features.windows import anchor_rows, gather_windows
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.preprocess import prepare
from serving.request_from_bars import Refused, request_from_bars
from serving.validation import columns_from_proto
from tests.artifacts import run_main, run_score
from tests.live_server import LiveServer

L, H, N_BARS = 8, 3, 120
QUANTILE_LEVELS = (0.1, 0.5, 0.9)
CONFIG = FeatureConfig(
    horizon=H, volatility_window=4, user_columns=("regime",), calendar_tz="UTC",
    known_columns=("event", "session"), static_columns=("vol_scale", "exchange"),
    categorical_columns=("regime", "session", "exchange"),
    vocabularies=(("regime", ("calm", "storm")), ("session", ("am", "pm")), ("exchange", ("CME",))))


def covariate_bars(path: Path) -> Path:
    """Synthetic ES and NQ bars with a known real `event` (a scheduled flag every 7th bar), a known categorical
    `session`, a static real `vol_scale`, a static categorical `exchange` (NQ's 'ICE' unseen in training) and an
    observed categorical `regime` (NQ's last bars 'panic', unseen)."""
    table = generate(["ES", "NQ"], N_BARS, seed=3)
    es = pc.equal(table["symbol"], "ES").to_numpy(zero_copy_only=False)
    row = np.arange(table.num_rows) % N_BARS
    regime = np.where(row % 10 < 6, "calm", "storm").astype(object)
    regime[~es & (row >= N_BARS - 5)] = "panic"
    columns = {"event": (row % 7 == 0).astype(np.float64),
               "session": np.where(row % 60 < 30, "am", "pm"),
               "vol_scale": np.where(es, 1.0, 2.5),
               "exchange": np.where(es, "CME", "ICE"),
               "regime": regime.astype(str)}
    for name, values in columns.items():
        table = table.append_column(name, pa.array(values))
    pq.write_table(table, path)
    return path


def _graph_weights(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).uniform(0.5, 1.5, (n, 1)) * 1e-3).astype(np.float32)


def write_model(path: Path, config: FeatureConfig = CONFIG, symbols: tuple[str, ...] = ("ES", "NQ"),
                interval_ns: int = 60 * 10**9) -> ModelMeta:
    """An ONNX model of `config`'s inputs whose quantiles are a weighted sum of every input value plus fixed
    offsets, with the metadata export writes; returns the metadata."""
    schema = config.schema()
    n_static, n_obs, n_known = 1 + len(config.static_categoricals), len(schema.observed), len(schema.known)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(STATIC_CATEGORICAL, i64, ["B", n_static]),
              helper.make_tensor_value_info(ENCODER_OBSERVED, f32, ["B", L, n_obs]),
              helper.make_tensor_value_info(ENCODER_KNOWN, f32, ["B", L, n_known]),
              helper.make_tensor_value_info(DECODER_KNOWN, f32, ["B", H, n_known])]
    weights = {"w_s": _graph_weights(n_static, 1), "w_o": _graph_weights(n_obs, 2), "w_ek": _graph_weights(n_known, 3),
               "w_dk": _graph_weights(n_known, 4), "axis1": np.array([1], np.int64),
               "offsets": np.array([-0.01, 0.0, 0.01], np.float32)}
    nodes = [helper.make_node("Cast", [STATIC_CATEGORICAL], ["s_f"], to=f32),
             helper.make_node("MatMul", ["s_f", "w_s"], ["t_s"]),  # [B, 1]
             helper.make_node("ReduceSum", [ENCODER_OBSERVED, "axis1"], ["o_sum"], keepdims=0),
             helper.make_node("MatMul", ["o_sum", "w_o"], ["t_o"]),
             helper.make_node("ReduceSum", [ENCODER_KNOWN, "axis1"], ["ek_sum"], keepdims=0),
             helper.make_node("MatMul", ["ek_sum", "w_ek"], ["t_ek"]),
             helper.make_node("Sum", ["t_s", "t_o", "t_ek"], ["t_static"]),
             helper.make_node("Unsqueeze", ["t_static", "axis1"], ["t_b11"]),  # [B, 1, 1]
             helper.make_node("MatMul", [DECODER_KNOWN, "w_dk"], ["t_dk"]),  # [B, H, 1]
             helper.make_node("Add", ["t_dk", "t_b11"], ["t_all"])]
    if config.static_reals:
        inputs.append(helper.make_tensor_value_info(STATIC_REAL, f32, ["B", len(config.static_reals)]))
        weights["w_r"] = _graph_weights(len(config.static_reals), 5)
        nodes += [helper.make_node("MatMul", [STATIC_REAL, "w_r"], ["t_r"]),
                  helper.make_node("Unsqueeze", ["t_r", "axis1"], ["t_r11"]),
                  helper.make_node("Add", ["t_all", "t_r11"], ["t_sum"])]
    nodes.append(helper.make_node("Add", ["t_sum" if config.static_reals else "t_all", "offsets"], [QUANTILES]))
    graph = helper.make_graph(nodes, "covariates", inputs,
                              [helper.make_tensor_value_info(QUANTILES, f32, ["B", H, len(QUANTILE_LEVELS)])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    meta = ModelMeta(model_config={}, feature_config=config, feature_schema=schema, quantiles=QUANTILE_LEVELS,
                     horizon=H, encoder_length=L, bar_interval_ns=interval_ns, symbols=symbols,
                     checkpoint_sha256="0" * 64, model_version="covariates", explain=False, precision="fp32",
                     training={"first_bar_ns": None, "validation_from_ns": 0, "test_from_ns": None,
                               "last_bar_ns": None},
                     graph_sha256=graph_digest(model.SerializeToString()))
    assert meta.to_props()[PREFIX + "format"] == FORMAT
    helper.set_model_props(model, meta.to_props())
    onnx.save(model, path)
    return meta


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ModelMeta]:
    root = tmp_path_factory.mktemp("covariates")
    bars = covariate_bars(root / "bars.parquet")
    meta = write_model(root / "model.onnx")
    return bars, root / "model.onnx", meta


def test_score_forecasts_each_origin_with_the_known_values_of_the_bars_after_it(
        files: tuple[Path, Path, ModelMeta], tmp_path: Path) -> None:
    bars_path, model, meta = files
    out = tmp_path / "f.parquet"
    done = run_score("--model", model, "--parquet", bars_path, "--out", out, "--threads", "1", "--batch", "16")
    assert done.returncode == 0, done.stderr
    # the last H bars of each symbol hold no future known values: skipped, and said so
    for symbol in ("ES", "NQ"):
        assert (f"skipped {H} origin(s) of {symbol}: within {H} bars of its last bar, where the file holds no "
                "future values of the known feature(s) event, session that the model reads") in done.stderr
    per_symbol = N_BARS - meta.bars_required + 1 - H
    # unseen labels are forecast with the unknown category and noted, with the windows that read them
    assert ("note: categorical feature 'exchange': 'ICE' not seen in training; forecast with the unknown category "
            f"({per_symbol:,} of {2 * per_symbol:,} windows)") in done.stderr
    assert "categorical feature 'regime': 'panic' not seen in training" in done.stderr
    scored = pq.read_table(out)
    assert scored.num_rows == 2 * per_symbol * H

    bars = read_bars(bars_path, None, CONFIG.real_columns, label_columns=CONFIG.categorical_columns)
    frame = build_frame(bars, meta.feature_config, list(meta.symbols), meta.bar_interval_ns)
    anchors = anchor_rows(frame, L, require_targets=False)
    windows = gather_windows(frame, anchors, L)
    # the decoder reads the file's `event` of the H bars after each origin (column 4: after the calendar's)
    after = anchors[:, None] + 1 + np.arange(H)  # [W, H]
    np.testing.assert_array_equal(windows[DECODER_KNOWN][:, :, 4], bars.user["event"][after])
    assert windows[STATIC_CATEGORICAL][:, 1].tolist() == [1 if s == "ES" else 0 for s in bars.symbol[anchors]]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == [STATIC_CATEGORICAL, ENCODER_OBSERVED, ENCODER_KNOWN, DECODER_KNOWN, STATIC_REAL]
    direct = session.run([QUANTILES], {n: windows[n] if n == STATIC_CATEGORICAL else
                                       np.nan_to_num(windows[n].astype(np.float32)) for n in names})[0]
    got = np.stack([scored[f"ret_q{q:g}"].to_numpy() for q in QUANTILE_LEVELS], axis=-1).reshape(direct.shape)
    np.testing.assert_allclose(got, direct, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(scored["origin"].cast(pa.int64()).to_numpy()[::H], bars.timestamp_ns[anchors])


def with_column(table: pa.Table, path: Path, name: str, values: np.ndarray) -> Path:
    pq.write_table(table.set_column(table.schema.get_field_index(name), name, pa.array(values)), path)
    return path


def test_score_names_a_static_feature_that_varies_within_a_series(files: tuple[Path, Path, ModelMeta],
                                                                   tmp_path: Path) -> None:
    bars_path, model, _ = files
    table = pq.read_table(bars_path)
    scale = table["vol_scale"].to_numpy().copy()
    scale[50] = 9.0
    bad = with_column(table, tmp_path / "bad.parquet", "vol_scale", scale)
    done = run_score("--model", model, "--parquet", bad, "--out", tmp_path / "f.parquet")
    assert done.returncode == 2
    when = str(table.column("timestamp")[50].as_py())[:19]  # the bar where it changes, in UTC
    assert "error: static feature 'vol_scale' varies within series ES (" in done.stderr
    assert f"9.0 at {when} UTC" in done.stderr
    assert not (tmp_path / "f.parquet").exists()


# ---- the client: what a request carries ----------------------------------------------------------------------


def model_info(meta: ModelMeta) -> pb.ModelInfo:
    """What GetModelInfo answers for `meta` (the parts a request is built from)."""
    from serving.servicer import features_info

    return pb.ModelInfo(bars_required=meta.bars_required, bar_interval_ns=meta.bar_interval_ns,
                        encoder_length=meta.encoder_length, horizon=meta.horizon, quantiles=list(meta.quantiles),
                        features=features_info(meta), symbols=list(meta.symbols),
                        user_feature_columns=list(meta.feature_config.series_reals), bar_columns=meta.column_map)


def iso(ns: int) -> str:
    return str(np.datetime64(int(ns), "ns"))


def test_the_client_sends_labels_static_values_and_the_known_values_after_the_origin(
        files: tuple[Path, Path, ModelMeta]) -> None:
    """--origin inside the file: the decoder's known values come from the bars after it, and the server's
    preprocessing of the request gives the scorer's window at that bar."""
    bars_path, _, meta = files
    bars = read_bars(bars_path, None, CONFIG.real_columns, label_columns=CONFIG.categorical_columns)
    es = bars.series_slices()["ES"]
    origin = es.start + 60  # a row with H bars after it
    request = request_from_bars(bars_path, model_info(meta), "ES", origin=iso(bars.timestamp_ns[origin]))
    series = request.series[0]
    sent = slice(origin + 1 - meta.bars_required, origin + 1)
    assert list(series.timestamp_ns) == bars.timestamp_ns[sent].tolist()
    after = slice(origin + 1, origin + 1 + H)
    assert [(c.name, list(c.values)) for c in series.future_features] == [("event", bars.user["event"][after].tolist())]
    assert [(c.name, list(c.values)) for c in series.future_categorical_features] == [
        ("session", bars.labels["session"][after].tolist())]
    assert [(c.name, list(c.values)) for c in series.categorical_features] == [
        ("regime", bars.labels["regime"][sent].tolist()), ("session", bars.labels["session"][sent].tolist())]
    assert dict(series.static_features) == {"vol_scale": 1.0}
    assert dict(series.static_categorical_features) == {"exchange": "CME"}

    served = prepare([columns_from_proto(series)], meta).inputs
    frame = build_frame(bars, meta.feature_config, list(meta.symbols), meta.bar_interval_ns)
    scored = gather_windows(frame, np.array([origin]), L)
    assert set(served) == {STATIC_CATEGORICAL, ENCODER_OBSERVED, ENCODER_KNOWN, DECODER_KNOWN, STATIC_REAL}
    for name, value in served.items():
        np.testing.assert_array_equal(value, np.nan_to_num(scored[name]), err_msg=name)


def test_the_client_reads_the_future_known_values_from_the_future_file(files: tuple[Path, Path, ModelMeta],
                                                                        tmp_path: Path) -> None:
    """Bars that end at the origin: --future names a file of the bars after it (other symbols', later rows and
    other columns are left); without it, one line names the column, the count needed and the flag."""
    bars_path, _, meta = files
    table = pq.read_table(bars_path)
    es = pc.equal(table["symbol"], "ES").to_numpy(zero_copy_only=False)
    row = np.arange(table.num_rows) % N_BARS
    cut = 60
    pq.write_table(table.filter(pa.array(row <= cut)), past := tmp_path / "past.parquet")
    ahead = table.filter(pa.array(row > cut)).select(["timestamp", "symbol", "session", "event", "close"])
    pq.write_table(ahead.take(np.random.default_rng(0).permutation(ahead.num_rows)), future := tmp_path / "f.parquet")
    info = model_info(meta)
    origin = iso(table["timestamp"].cast(pa.int64())[cut].as_py())
    from_file = request_from_bars(bars_path, info, "ES", origin=origin).series[0]
    given = request_from_bars(past, info, "ES", future=future).series[0]
    assert given.future_features == from_file.future_features and len(given.future_features[0].values) == H
    assert given.future_categorical_features == from_file.future_categorical_features
    assert given == from_file
    assert list(given.future_features[0].values) == table["event"].to_numpy()[es][cut + 1:cut + 1 + H].tolist()

    with pytest.raises(Refused) as refused:
        request_from_bars(past, info, "ES")
    assert str(refused.value) == (
        f"known feature 'event': the model needs its values for the {H} bars after 2024-01-02 15:30:00 UTC (the "
        f"forecast's {H} steps), and {past} has 0 ES bar(s) after it: give them with --future FILE (symbol, "
        f"timestamp and event, session of the next {H} bars)")
    pq.write_table(ahead.slice(0, 2), short := tmp_path / "short.parquet")
    with pytest.raises(Refused, match=rf"--future {short} has 2 ES row\(s\) after it: give event, session of the "
                                      rf"next {H} bars"):
        request_from_bars(past, info, "ES", future=short)


def run_client(target: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """`python -m serving.client`, as its main in this process (run_main)."""
    return run_main(["-m", "serving.client", "--target", target, *map(str, args)])


def test_the_client_command_forecasts_from_a_real_server_with_the_future_from_either_source(
        files: tuple[Path, Path, ModelMeta], tmp_path: Path) -> None:
    """One forecast, asked with the known values from the bars after --origin and from --future; NQ's exchange
    is unseen in training: served with a warning."""
    bars_path, model, _ = files
    table = pq.read_table(bars_path)
    row = np.arange(table.num_rows) % N_BARS
    pq.write_table(table.filter(pa.array(row <= 60)), past := tmp_path / "past.parquet")
    pq.write_table(table.filter(pa.array(row > 60)).select(["timestamp", "symbol", "event", "session"]),
                   future := tmp_path / "future.parquet")
    server = LiveServer(model, tmp_path / "server.log")
    try:
        server.wait_serving()
        inside = run_client(server.target, "--parquet", bars_path, "--symbol", "NQ", "--origin", "2024-01-02T15:30")
        given = run_client(server.target, "--parquet", past, "--symbol", "NQ", "--future", future)
        missing = run_client(server.target, "--parquet", past, "--symbol", "NQ")
    finally:
        server.kill()
    assert inside.returncode == 0 and given.returncode == 0, inside.stderr + given.stderr
    assert inside.stdout == given.stdout and "last bar 2024-01-02 15:30:00 UTC" in inside.stdout
    assert given.stderr == ("warning: series[0] (NQ): categorical feature 'exchange': 'ICE' not seen in training; "
                            "forecast with the unknown category\n")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == (f"error: known feature 'event': the model needs its values for the {H} bars after "
                              f"2024-01-02 15:30:00 UTC (the forecast's {H} steps), and {past} has 0 NQ bar(s) after "
                              f"it: give them with --future FILE (symbol, timestamp and event, session of the next "
                              f"{H} bars)\n")


def test_a_backtest_folds_training_bars_keep_every_user_column(files: tuple[Path, Path, ModelMeta]) -> None:
    from backtest.folds import bars_before

    bars = read_bars(files[0], None, CONFIG.real_columns, label_columns=CONFIG.categorical_columns)
    cut = int(bars.timestamp_ns[50])
    back = bars_before(bars, cut)
    keep = bars.timestamp_ns < cut
    assert len(back) == int(keep.sum())
    for name in CONFIG.real_columns:
        np.testing.assert_array_equal(back.user[name], bars.user[name][keep])
    for name in CONFIG.categorical_columns:
        assert back.labels[name].tolist() == bars.labels[name][keep].tolist()


def test_score_skips_the_origins_whose_windows_or_next_bars_hold_an_unusable_known_value(
        files: tuple[Path, Path, ModelMeta], tmp_path: Path) -> None:
    """A NaN `event` at ES's bar r: the windows that read it in their encoder bars (origins r .. r + bars_required
    - 1) and those whose decoder reads it among the H bars after them (origins r - H .. r - 1)."""
    bars_path, model, meta = files
    table = pq.read_table(bars_path)
    event = table["event"].to_numpy().copy()
    event[60] = np.nan  # an ES bar
    holed = with_column(table, tmp_path / "holed.parquet", "event", event)
    done = run_score("--model", model, "--parquet", holed, "--out", tmp_path / "f.parquet")
    assert done.returncode == 0, done.stderr
    assert (f"skipped {H + meta.bars_required} origin(s) of ES: their windows' user feature values include NaN"
            in done.stderr), done.stderr
    scored = pq.read_table(tmp_path / "f.parquet")
    origins = scored.filter(pc.equal(scored["symbol"], "ES"))["origin"].cast(pa.int64()).to_numpy()[::H]
    ts = table["timestamp"].cast(pa.int64()).to_numpy()
    assert not np.isin(ts[60 - H:60 + meta.bars_required], origins).any() and np.isin(ts[60 - H - 1], origins)
