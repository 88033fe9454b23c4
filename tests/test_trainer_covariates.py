"""The trainer with user known, static and categorical features: flags, vocabularies, tensors, checkpoint, refusals."""

from __future__ import annotations

import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from features.bars import bars_digest, read_bars
from features.calendar import NS_PER_DAY, NS_PER_SECOND
from features.config import FeatureConfig
from features.schema import MODEL_INPUTS, STATIC_CATEGORICAL, STATIC_REAL
from features.synth import SESSION_OPEN_NS, generate
from features.windows import gather_windows
from tests.artifacts import TINY_TRAIN_FLAGS, run_main
from trainer.__main__ import main
from trainer.config import ConfigError, TrainConfig
from trainer.data import DataError, prepare, row_inputs
from trainer.loop import Trainer, build_model

# observed categorical regime, known real event and known integer categorical phase, static categorical exchange
# and static real scale
ROLES = {"features": ("regime",), "known_features": ("event", "phase"), "static_features": ("exchange", "scale"),
         "categorical_features": ("exchange", "regime", "phase")}
FLAGS = ("--features", "regime", "--known-features", "event,phase", "--static-features", "exchange,scale",
         "--categorical-features", "exchange,regime,phase")


def covariate_table(n: int = 1500) -> pa.Table:
    """Synthetic bars of ES and NQ with the ROLES columns; the regime 'halted' appears only in the last 5% of
    the bars' times (after the training split)."""
    t = generate(["ES", "NQ"], n, seed=3)
    ts = t.column("timestamp").cast(pa.int64()).to_numpy()
    symbol = t.column("symbol").to_numpy(zero_copy_only=False).astype(str)
    minute = ((ts - SESSION_OPEN_NS) % NS_PER_DAY) // (60 * NS_PER_SECOND)
    late = ts >= np.quantile(ts, 0.95)
    return (t.append_column("event", pa.array((minute % 30 == 0).astype(np.float64)))
            .append_column("phase", pa.array((minute // 130).astype(np.int64)))
            .append_column("regime", pa.array(np.where(late, "halted", np.where(minute < 120, "open", "mid"))))
            .append_column("exchange", pa.array(np.where(symbol == "ES", "CME", "CBOT")))
            .append_column("scale", pa.array(np.where(symbol == "ES", 1.0, 2.5))))


@pytest.fixture(scope="module")
def bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("covariates") / "bars.parquet"
    pq.write_table(covariate_table(), path)
    return path


def tiny_cfg(**kw: object) -> TrainConfig:
    base: dict[str, object] = dict(hidden_size=8, attention_heads=2, encoder_length=20, horizon=3, batch_size=32,
                                   epochs=1, max_steps_per_epoch=2, max_val_windows=64, threads=1, device="cpu")
    return TrainConfig.from_dict({**base, **kw})


def test_a_run_with_every_kind_of_user_feature_stores_vocabularies_and_roles(tmp_path: Path, bars: Path) -> None:
    out = tmp_path / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *TINY_TRAIN_FLAGS, *FLAGS])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    fc = FeatureConfig.from_dict(ckpt["feature_config"])
    # fitted on the training split: 'halted' comes later, so it is not a category the model knows
    assert dict(fc.vocabularies) == {"exchange": ("CBOT", "CME"), "regime": ("mid", "open"), "phase": ("0", "1", "2")}
    assert (fc.known_columns, fc.static_columns) == (("event", "phase"), ("exchange", "scale"))
    roles = {(f["name"], f["role"], f["kind"]) for f in ckpt["feature_schema"] if f["source"] == "user"}
    assert roles == {("regime", "observed", "categorical"), ("event", "known", "real"),
                     ("phase", "known", "categorical"), ("exchange", "static", "categorical"),
                     ("scale", "static", "real")}
    m = ckpt["model_config"]
    assert m["static_cardinalities"] == [2, 3] and m["n_static_real"] == 1  # symbols; CBOT, CME + unknown
    assert m["observed_cardinalities"] == [3] and m["known_cardinalities"] == [4]
    assert (m["n_observed"], m["n_known"]) == (6, 6)  # 5 built in + regime; 4 calendar + event, phase
    norm = ckpt["normalization"]
    assert (norm["observed"]["mean"][-1], norm["observed"]["std"][-1]) == (0.0, 1.0)  # regime ids enter raw
    assert (norm["known"]["mean"][-1], norm["known"]["std"][-1]) == (0.0, 1.0)  # phase ids
    assert norm["static"]["std"][0] > 0  # scale: 1.0 and 2.5
    sample = ckpt["validation_sample"]
    assert sample[STATIC_CATEGORICAL].shape[1] == 2 and sample[STATIC_REAL].shape[1] == 1


def test_the_batches_are_the_features_layers_windows(bars: Path) -> None:
    """Every model input of a batch, static reals and the decoder's future known values included, equals
    features.windows.gather_windows, which the server's and the scorer's windows equal."""
    cfg = tiny_cfg(**ROLES)
    data = prepare(bars, cfg)
    anchors = np.concatenate([data.train_anchors[:40], data.val_anchors[-40:]])
    batch = data.tensors.batch(torch.from_numpy(anchors))
    want = gather_windows(data.frame, anchors, cfg.encoder_length)
    assert set(want) - set(batch) == set() and STATIC_REAL in batch
    for name in (*MODEL_INPUTS, STATIC_REAL):
        np.testing.assert_array_equal(batch[name].numpy(), want[name], err_msg=name)
    assert data.frame.unseen["regime"][anchors].any()  # 'halted' windows: the unknown id, 0
    model = build_model(cfg, data, torch.device("cpu")).eval()
    with torch.no_grad():
        whole = model(*(batch[name] for name in MODEL_INPUTS), batch[STATIC_REAL]).quantiles
        for share_bars in (True, False):  # training's rows, and the VRAM planner's
            rows = data.tensors.row_batch(torch.from_numpy(anchors), share_bars)
            torch.testing.assert_close(model.forward_rows(*row_inputs(rows)).quantiles, whole)
    np.testing.assert_array_equal(model.static_mean.numpy(), data.normalization.static.mean)  # type: ignore[union-attr]


def test_a_resumed_run_takes_its_checkpoints_vocabularies_and_static_scale(tmp_path: Path, bars: Path) -> None:
    out = tmp_path / "ckpt.pt"
    first = Trainer(bars, tiny_cfg(**ROLES), out, progress=False)
    first.run()
    resumed = Trainer(bars, tiny_cfg(**ROLES, epochs=2), out, resume=out.with_suffix(".last.pt"), progress=False)
    assert resumed.data.frame.config == first.data.frame.config
    assert resumed.data.normalization.to_dict() == first.data.normalization.to_dict()
    assert [r["epoch"] for r in resumed.run().history] == [1, 2]


def test_the_report_names_every_user_variable(tmp_path: Path, bars: Path) -> None:
    from matplotlib.figure import Figure

    from trainer.report import _importances

    trainer = Trainer(bars, tiny_cfg(**ROLES), tmp_path / "ckpt.pt", progress=False)
    schema = trainer.data.frame.schema
    ax = Figure().subplots()
    _importances(ax, trainer.predict(trainer.data.val_anchors[:16]), schema.observed, schema.known, schema.static)
    bars_shown = {label.get_text() for label in ax.get_yticklabels()}
    assert {"enc:regime", "enc:event", "enc:phase", "dec:event", "dec:phase"} <= bars_shown
    assert "symbol=" in ax.get_title() and "exchange=" in ax.get_title() and "scale=" in ax.get_title()


def test_a_resumed_run_keeps_its_vocabularies(bars: Path) -> None:
    cfg = tiny_cfg(**ROLES)
    fitted = prepare(bars, cfg).frame.config
    stored = replace(fitted, vocabularies=(("exchange", ("CME",)), ("regime", ("mid", "open")),
                                           ("phase", ("0", "1", "2"))))
    again = prepare(bars, cfg, features=stored)
    assert again.frame.config.vocabularies == stored.vocabularies
    assert set(again.tensors.static_categorical[:, 1].unique().tolist()) == {0, 1}  # CBOT now unknown


def test_a_model_without_user_covariates_keeps_todays_checkpoint(tmp_path: Path, bars: Path) -> None:
    trainer = Trainer(bars, tiny_cfg(features=["scale"]), tmp_path / "ckpt.pt", progress=False)
    state = trainer.state()
    assert set(state["feature_config"]) == {"horizon", "volatility_window", "user_columns", "calendar_tz"}
    assert "static" not in state["normalization"]
    assert set(state["validation_sample"]) == {*MODEL_INPUTS, "target"}
    assert trainer.data.bars_digest == bars_digest(read_bars(bars, None, ("scale",)), ("scale",))


def test_constant_categoricals_are_not_warned_about_but_a_flat_known_real_is(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = covariate_table().append_column("flat", pa.array(np.zeros(3000)))
    table = table.append_column("mood", pa.array(np.full(3000, "calm")))
    pq.write_table(table, tmp_path / "bars.parquet")
    cfg = tiny_cfg(features=["mood"], known_features=["flat"], categorical_features=["mood"])
    with caplog.at_level("WARNING", logger="trainer"):
        prepare(tmp_path / "bars.parquet", cfg)
    flagged = [r.getMessage() for r in caplog.records if "never change" in r.getMessage()]
    assert flagged == [
        "known feature(s) flat never change over the training bars: the model learns nothing from them; check the "
        "column(s) or drop them from --known-features"], caplog.text


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What `python -m trainer argv` (run in this process) prints from its first error line on, after checking
    that it exits 2."""
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(argv) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # main's handler, for this process's later tests
    err = capsys.readouterr().err.splitlines()
    return err[next(i for i, line in enumerate(err) if line.startswith("error:")):]


@pytest.mark.parametrize(("flags", "message"), [
    (("--features", "regime", "--static-features", "regime"),
     "error: user feature 'regime' is given to --features and --static-features: a column has one role; keep it "
     "in one of them"),
    (("--features", "event", "--categorical-features", "regime"),
     "error: --categorical-features regime: not given a role; add each to --features, --known-features or "
     "--static-features too"),
    (("--known-features", "event,log_return"), "error: --known-features names log_return, the name of a built-in"),
])
def test_a_column_in_two_roles_or_none_is_refused_before_the_bars_are_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str) -> None:
    not_bars = tmp_path / "bars.parquet"
    not_bars.write_text("not parquet: a run that read it would say so")
    lines = _refusal(["--parquet", str(not_bars), "--out", str(tmp_path / "x.pt"), *flags], capsys)
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_the_toml_keys_take_the_same_lists(tmp_path: Path) -> None:
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text('known_features = ["event"]\nstatic_features = "exchange, scale"\n'
                        'categorical_features = ["exchange"]\n')
    from trainer.__main__ import build_parser
    from trainer.config import config_from_args

    cfg = config_from_args(build_parser().parse_args(["--parquet", "x", "--config", str(cfg_file)]))
    fc = cfg.feature_config()
    assert (fc.known_columns, fc.static_columns, fc.categorical_columns) == (("event",), ("exchange", "scale"),
                                                                             ("exchange",))
    with pytest.raises(ConfigError, match="static_features lists a column more than once"):
        TrainConfig.from_dict({"static_features": ["scale", "scale"]}).validate()


def test_bad_covariate_columns_are_one_line_each_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = covariate_table()
    scale = table.column("scale").to_numpy().copy()
    scale[1700] = 3.0  # NQ's scale changes within its series
    table = table.set_column(table.column_names.index("scale"), "scale", pa.array(scale))
    pq.write_table(table.append_column("ratio", pa.array(np.linspace(0.0, 1.0, 3000))), tmp_path / "bars.parquet")
    common = ["--parquet", str(tmp_path / "bars.parquet"), "--out", str(tmp_path / "x.pt"), *TINY_TRAIN_FLAGS]
    lines = _refusal([*common, "--static-features", "scale"], capsys)
    assert len(lines) == 1 and lines[0].startswith("error: static feature 'scale' varies within series NQ ("), lines
    when = str(table.column("timestamp")[1700].as_py())[:19]  # the bar where it changes, in UTC
    assert f"3.0 at {when} UTC" in lines[0] and "--known-features or --features instead" in lines[0]
    lines = _refusal([*common, "--features", "ratio", "--categorical-features", "ratio"], capsys)
    assert [line for line in lines if "ratio" in line] == [lines[-1]] and "has type double" in lines[-1], lines
    assert "leave it out of --categorical-features to use it as a real" in lines[-1]
    assert not (tmp_path / "x.pt").exists()


def test_prepare_refuses_a_varying_static_column_as_a_data_error(tmp_path: Path) -> None:
    table = covariate_table()
    exchange = table.column("exchange").to_numpy(zero_copy_only=False).copy()
    exchange[10] = "ICE"
    pq.write_table(table.set_column(table.column_names.index("exchange"), "exchange", pa.array(exchange)),
                   tmp_path / "bars.parquet")
    with pytest.raises(DataError, match="static feature 'exchange' varies within series ES"):
        prepare(tmp_path / "bars.parquet", tiny_cfg(static_features=["exchange"], categorical_features=["exchange"]))
