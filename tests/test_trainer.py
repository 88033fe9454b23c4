"""The trainer as a user runs it: `python -m trainer`, its files, resume, and every refusal. The command's main runs
in the test's process (tests.artifacts.run_main) except where the process is under test: signals, torchrun, imports."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import astuple, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from features.metrics import forecast_metrics
from features.normalize import NormStats
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    MODEL_INPUTS,
    MODEL_OUTPUTS,
    STATIC_CATEGORICAL,
    TARGET,
)
from tests.artifacts import REPO, TINY_TRAIN_FLAGS, exit_and_imports, make_bars, run, run_main
from trainer.checkpoint import FORMAT, file_sha256, load_checkpoint, save_atomic
from trainer.config import ConfigError, TrainConfig, resumed_config
from trainer.data import (
    ROW_INPUTS,
    ROW_KNOWN,
    ROW_OBSERVED,
    ROW_WINDOW,
    WINDOW_ROWS,
    DataError,
    PreparedData,
    prepare,
)
from trainer.loop import Trainer, TrainingDiverged, lr_lambda_factory, steps_per_epoch
from trainer.modeling import TemporalFusionTransformer

# Enough training for the model to learn the planted volatility clustering (about 20 s on one thread).
LEARN_FLAGS = ("--hidden-size", "16", "--encoder-length", "30", "--horizon", "3", "--batch-size", "64",
               "--epochs", "5", "--max-steps-per-epoch", "40", "--learning-rate", "3e-3", "--dropout", "0",
               "--patience", "0", "--threads", "1", "--device", "cpu", "--no-progress")


@pytest.fixture(scope="module")
def bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bars(tmp_path_factory.mktemp("trainer") / "bars.parquet", bars=4000)


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory: pytest.TempPathFactory, bars: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("learn") / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *LEARN_FLAGS])
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def tiny_cfg(**kw: object) -> TrainConfig:
    base = dict(hidden_size=8, attention_heads=2, encoder_length=20, horizon=3, batch_size=32, epochs=3,
                max_steps_per_epoch=4, max_val_windows=100, threads=1, device="cpu", dropout=0.1)
    base.update(kw)
    return TrainConfig.from_dict(base)


def test_loss_falls_and_model_beats_climatology(learned_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, r = learned_run
    records = [json.loads(line) for line in out.with_suffix(".metrics.jsonl").read_text().splitlines()]
    assert [rec["epoch"] for rec in records] == [1, 2, 3, 4, 5]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    best = min(records, key=lambda rec: rec["val_loss"])
    assert best["val"]["pinball_mean"] < best["baseline"]["pinball_mean"], (best["val"], best["baseline"])
    for rec in records:  # per-quantile pinball and q-risk for model and baseline, and coverage
        for side in ("val", "baseline"):
            assert set(rec[side]["pinball"]) == set(rec[side]["q_risk"]) == {"0.1", "0.5", "0.9"}
            assert 0.0 <= rec[side]["coverage"] <= 1.0
        assert rec["peak_memory"]["train"]["bytes"] > 0 and rec["peak_memory"]["val"]["bytes"] > 0
    assert "resolved config" in r.stderr and '"hidden_size": 16' in r.stderr
    assert "pinball model/baseline" in r.stderr and "coverage model" in r.stderr


@pytest.mark.parametrize(("quantiles", "labels"), [
    ((0.1, 0.5, 0.9), ["P10-P90", "P50", "realised"]),
    ((0.05, 0.95), ["P5-P95", "realised"]),  # no centre line: the band's edges are not its centre
    ((0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.98), ["P2-P98", "P50", "realised"]),
    ((0.1, 0.3, 0.9), ["P10-P90", "P30", "realised"]),  # the inner level nearest the median
    ((0.5,), ["P50", "realised"]),  # one level: a line, no band
])
def test_the_fan_chart_draws_the_band_and_its_centre(quantiles: tuple[float, ...], labels: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.report import _fan_chart

    fig, ax = plt.subplots()
    rng = np.random.default_rng(0)
    q = np.sort(rng.normal(size=(30, 2, len(quantiles))), axis=-1)
    _fan_chart(ax, q, rng.normal(size=(30, 2)), quantiles)
    assert ax.get_legend_handles_labels()[1] == labels
    plt.close(fig)


def test_run_writes_checkpoints_report_and_nothing_half_written(
        learned_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = learned_run
    files = sorted(p.name for p in out.parent.iterdir())
    assert files == ["ckpt.last.pt", "ckpt.metrics.jsonl", "ckpt.pt", "ckpt.report.png"]
    assert out.with_suffix(".report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_loads_weights_only_with_everything_export_needs(
        learned_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = learned_run
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    assert ckpt["format"] == FORMAT
    for key in ("model_state", "optimizer_state", "scheduler_state", "scaler_state", "epoch", "step", "rng",
                "train_config", "model_config", "feature_schema", "normalization", "symbols", "metrics_history",
                "peak_memory", "validation_sample", "bar_interval_ns"):
        assert key in ckpt, key
    assert ckpt["symbols"] == ["ES", "NQ"]
    assert ckpt["train_config"]["hidden_size"] == 16
    assert len(ckpt["peak_memory"]) == len(ckpt["metrics_history"]) == ckpt["epoch"]
    assert ckpt["bar_interval_ns"] == 60_000_000_000
    last = torch.load(out.with_suffix(".last.pt"), map_location="cpu", weights_only=True)
    assert last["epoch"] == 5
    best_epoch = min(ckpt["metrics_history"], key=lambda r: r["val_loss"])["epoch"]
    assert ckpt["epoch"] == best_epoch == ckpt["best_epoch"]


def test_split_is_chronological_purged_and_normalised_on_train_only(bars: Path) -> None:
    cfg = tiny_cfg(val_fraction=0.2, test_fraction=0.1)
    data = prepare(bars, cfg)
    f, h, L = data.frame, cfg.horizon, cfg.encoder_length
    for s, e in f.series_bounds:
        tr = data.train_anchors[(data.train_anchors >= s) & (data.train_anchors < e)]
        va = data.val_anchors[(data.val_anchors >= s) & (data.val_anchors < e)]
        te = data.test_anchors[(data.test_anchors >= s) & (data.test_anchors < e)]
        assert tr.size and va.size and te.size
        # windows stay inside their series and out of the warm-up
        for a in (tr, va, te):
            assert a.min() - L + 1 >= s + cfg.volatility_window and a.max() + h <= e - 1
        # no target of one split reaches the next split's first target, with at least H bars between
        assert va.min() - (tr.max() + h) >= h
        assert te.min() - (va.max() + h) >= h
        assert f.timestamp_ns[tr.max() + h] < data.split_times_ns[0] <= f.timestamp_ns[va.min()]
    train_rows = np.concatenate([np.arange(s, s + np.searchsorted(f.timestamp_ns[s:e], data.split_times_ns[0]))
                                 for s, e in f.series_bounds])
    expected = NormStats.fit(f.observed, train_rows)
    np.testing.assert_allclose(data.normalization.observed.mean, expected.mean, rtol=1e-6)
    all_rows = NormStats.fit(f.observed)
    assert not np.allclose(data.normalization.observed.mean, all_rows.mean, rtol=1e-6)


def test_batches_are_windows_taken_by_index(bars: Path) -> None:
    cfg = tiny_cfg()
    data = prepare(bars, cfg)
    a = data.train_anchors[[0, 17, -1]]
    b = data.tensors.batch(torch.from_numpy(a))
    from features.windows import gather_windows

    ref = gather_windows(data.frame, a, cfg.encoder_length)
    for name, value in ref.items():
        np.testing.assert_allclose(b[name].numpy(), value, rtol=0, atol=0, err_msg=name)


@pytest.mark.parametrize("tz", ["America/Chicago", "Australia/Lord_Howe", "America/St_Johns"])
def test_decoder_calendar_features_per_batch_equal_the_zones_own_across_its_changes(tz: str) -> None:
    """Training computes each batch's future calendar features from offsets looked up once for the run: the
    very values known_features gives in the zone, for anchors over two years whose horizons cross changes."""
    from features.calendar import future_timestamps, known_features
    from features.compute import FeatureFrame
    from features.config import FeatureConfig
    from trainer.data import WindowTensors

    minute = 60 * 10**9
    ts = 1_700_000_000 * 10**9 + np.arange(0, 2 * 365 * 24 * 60, 13, dtype=np.int64) * minute  # every 13 min, 2 y
    n, h = ts.size, 6
    frame = FeatureFrame(config=FeatureConfig(horizon=h, calendar_tz=tz), symbols=["A"], timestamp_ns=ts,
                         series_id=np.zeros(n, np.int64), series_bounds=np.array([[0, n]]),
                         observed=np.zeros((n, 1), np.float32), known=np.zeros((n, 4), np.float32),
                         close=np.ones(n), targets=np.zeros((n, h), np.float32), bar_interval_ns=13 * minute)
    tensors = WindowTensors(frame, 3)
    rng = np.random.default_rng(1)
    for anchors in (rng.integers(0, n, 300), np.arange(n)):
        want = known_features(future_timestamps(ts[anchors], 13 * minute, h), tz)  # [B, H, 4]
        np.testing.assert_array_equal(tensors.future_known(torch.from_numpy(anchors)).numpy(), want)
    assert not np.array_equal(want, known_features(future_timestamps(ts, 13 * minute, h)))  # the zone mattered


def overlapping_anchors(data: PreparedData) -> torch.Tensor:
    """16 consecutive windows (overlapping), two far apart, and the other symbol's last three."""
    t = data.train_anchors
    return torch.from_numpy(np.concatenate([t[10:26], t[[200, 900]], t[-3:]]))


def test_row_batches_hold_each_shared_bar_once_and_rebuild_every_window(bars: Path) -> None:
    cfg = tiny_cfg()
    data = prepare(bars, cfg)
    a = overlapping_anchors(data)
    rows, windows = data.tensors.row_batch(a), data.tensors.batch(a)
    bars_used = torch.unique(a[:, None] + data.tensors.offsets).numel()
    assert rows[ROW_OBSERVED].shape[0] == rows[ROW_KNOWN].shape[0] == bars_used < a.numel() * cfg.encoder_length
    for row_name, window_name in ((ROW_OBSERVED, ENCODER_OBSERVED), (ROW_KNOWN, ENCODER_KNOWN)):
        torch.testing.assert_close(rows[row_name][rows[WINDOW_ROWS]], windows[window_name], rtol=0, atol=0)
    for name in (STATIC_CATEGORICAL, DECODER_KNOWN, TARGET):
        assert torch.equal(rows[name], windows[name]), name
    holds = [(rows[WINDOW_ROWS] == r).any(dim=1).nonzero().flatten() for r in range(bars_used)]
    assert rows[ROW_WINDOW].tolist() == [int(h[0]) for h in holds]  # the first window holding each bar
    unshared = data.tensors.row_batch(a, share_bars=False)  # what the VRAM planner measures
    assert unshared[ROW_OBSERVED].shape[0] == a.numel() * cfg.encoder_length
    torch.testing.assert_close(unshared[ROW_OBSERVED][unshared[WINDOW_ROWS]], windows[ENCODER_OBSERVED],
                               rtol=0, atol=0)


def test_shared_bar_forward_equals_the_per_window_forward_and_its_gradients(bars: Path) -> None:
    """forward_rows (training, validation) against forward (export, serving) on the same windows:
    equal outputs, and without dropout equal gradients (a shared bar's gradient sums its windows')."""
    cfg = tiny_cfg(dropout=0.0)
    data = prepare(bars, cfg)
    schema, n = data.frame.schema, data.normalization
    torch.manual_seed(0)
    model = TemporalFusionTransformer(cfg.model_config(len(schema.observed), len(schema.known),
                                                       len(data.frame.symbols)))
    model.set_normalization(n.observed.mean, n.observed.std, n.known.mean, n.known.std, n.target_scale)
    a = overlapping_anchors(data)
    rows, windows = data.tensors.row_batch(a), data.tensors.batch(a)

    def by_rows() -> object:
        return model.forward_rows(*(rows[k] for k in ROW_INPUTS))

    def by_windows() -> object:
        return model(*(windows[k] for k in MODEL_INPUTS))

    model.eval()
    with torch.no_grad():
        got, want = by_rows(), by_windows()
    for name, g, w in zip(MODEL_OUTPUTS, got, want, strict=True):  # type: ignore[call-overload]
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    model.train()
    grads = []
    for forward in (by_rows, by_windows):
        model.zero_grad(set_to_none=True)
        out = forward()
        (out.quantiles.square().mean() + out.encoder_weights.square().mean()).backward()  # type: ignore[attr-defined]
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for k, g in grads[1].items():
        torch.testing.assert_close(grads[0][k], g, rtol=1e-4, atol=1e-7, msg=k)


def test_the_automatic_window_block_keeps_8_stretches_of_time_in_a_batch() -> None:
    assert [tiny_cfg(batch_size=b).block_windows for b in (256, 1024, 64, 20, 8)] == [16, 16, 8, 2, 1]
    assert tiny_cfg(batch_size=8, window_block=32).block_windows == 32  # an explicit block is kept


def test_epoch_shuffles_blocks_of_consecutive_windows_and_visits_each_once(tmp_path: Path, bars: Path) -> None:
    k = 8
    t = Trainer(bars, tiny_cfg(max_steps_per_epoch=0, window_block=k), tmp_path / "c.pt", progress=False)
    train = torch.from_numpy(t.data.train_anchors)
    assert bool((train[1:] > train[:-1]).all())
    order = t._epoch_anchors()
    assert torch.equal(order.sort().values, train)  # every window once per epoch
    pos = torch.searchsorted(train, order)  # index of each window in the training anchors
    block = pos // k
    same = block[1:] == block[:-1]
    assert int((~same).sum()) + 1 == -(-train.numel() // k)  # each block of k is one run of the order ...
    assert bool((pos[1:] - pos[:-1])[same].eq(1).all())  # ... in consecutive windows
    assert not torch.equal(order[: 4 * k], train[: 4 * k])  # the blocks are shuffled
    t.epoch = 1
    assert not torch.equal(t._epoch_anchors(), order)  # differently each epoch


def test_resume_after_interruption_gives_the_same_weights(tmp_path: Path, bars: Path) -> None:
    torch.set_num_threads(1)
    cfg = tiny_cfg(epochs=3)
    full = Trainer(bars, cfg, tmp_path / "a" / "ckpt.pt", progress=False)
    full.run()
    part = Trainer(bars, cfg, tmp_path / "b" / "ckpt.pt", progress=False)
    assert part.run(stop_after_epochs=1).epochs_run == 1
    del part
    resumed = Trainer(bars, cfg, tmp_path / "b" / "ckpt.pt", resume=tmp_path / "b" / "ckpt.last.pt", progress=False)
    assert resumed.epoch == 1
    assert resumed.run().epochs_run == 2
    for (name, p1), p2 in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p1, p2), name
    assert [r["val_loss"] for r in full.history] == [r["val_loss"] for r in resumed.history]
    # the same bars and more (a longer file): the split moves, so the run's held-out bars would be trained on
    longer = make_bars(tmp_path / "longer.parquet", bars=5000)
    with pytest.raises(DataError) as info:
        Trainer(longer, cfg, tmp_path / "c" / "ckpt.pt", resume=tmp_path / "b" / "ckpt.last.pt", progress=False)
    message = str(info.value)
    assert "--resume: these bars split as validation from" in message and "the checkpoint's run split as" in message
    assert str(bars) in message and "without --resume" in message
    assert not (tmp_path / "c" / "ckpt.pt").exists() and not (tmp_path / "c" / "ckpt.last.pt").exists()
    # bars that split at the same times but are not the run's: other prices on the same calendar, or one
    # symbol of the run's file (its validation loss would be compared with the two symbols' best)
    for other in (make_bars(tmp_path / "reseeded.parquet", bars=4000, seed=8),
                  make_bars(tmp_path / "es.parquet", bars=4000, symbols="ES")):
        with pytest.raises(DataError) as info:
            Trainer(other, cfg, tmp_path / "c" / "ckpt.pt", resume=tmp_path / "b" / "ckpt.last.pt", progress=False)
        assert f"--resume: these bars are not the ones the checkpoint's run read (its bars: {bars}): they split at " \
            "the same times, but their symbols, rows or values differ" in str(info.value), str(info.value)
        assert not (tmp_path / "c" / "ckpt.pt").exists()


def test_a_resume_with_more_epochs_keeps_the_runs_schedule_and_trains_on_at_its_floor(
        tmp_path: Path, bars: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--epochs raised on resume must not stretch the cosine over the new length: that would put the learning
    rate back up towards its peak in the middle of a run whose weights had settled at the floor."""
    torch.set_num_threads(1)
    cfg = tiny_cfg(epochs=2, warmup_steps=2, learning_rate=1e-3)
    Trainer(bars, cfg, tmp_path / "ckpt.pt", progress=False).run()
    with caplog.at_level("WARNING", logger="trainer"):
        longer = Trainer(bars, replace(cfg, epochs=4), tmp_path / "ckpt.pt", resume=tmp_path / "ckpt.last.pt",
                         progress=False)
    assert "--epochs 4 goes past the resumed run's learning-rate schedule (2 epochs, 8 optimizer steps)" \
        in caplog.text and "0.0001 (10% of the peak)" in caplog.text
    longer.run()
    lrs = [r["lr"] for r in longer.history]  # the rate each epoch ended at
    # 4 steps an epoch, the schedule over 8: epoch 2 ended on its last step, at 10% of the peak, and so on after
    assert lrs[1] == pytest.approx(1e-4) and lrs[2] == pytest.approx(1e-4) and lrs[3] == pytest.approx(1e-4), lrs
    assert max(lrs[2:]) <= lrs[1] * (1 + 1e-9)
    saved = torch.load(tmp_path / "ckpt.last.pt", weights_only=True)
    assert (saved["schedule_steps"], saved["schedule_epochs"]) == (8, 2)
    again = Trainer(bars, replace(cfg, epochs=6), tmp_path / "ckpt.pt", resume=tmp_path / "ckpt.last.pt",
                    progress=False)  # the schedule stays the first run's through any number of resumes
    assert again.schedule_steps == 8 and again.scheduler.get_last_lr()[0] == pytest.approx(1e-4)


def test_a_run_resumed_into_another_out_keeps_its_own_best_model(tmp_path: Path, bars: Path) -> None:
    """--resume into a directory other than the run's: the run's best checkpoint is copied there from beside the
    resumed file, so the report, the test split and export take this run's model, never another run's file
    that happens to be there; with the best nowhere to be found, they are skipped with a warning."""
    flags = [f for f in TINY_TRAIN_FLAGS if f != "--no-report"] + ["--test-fraction", "0.1"]
    train = ["-m", "trainer", "--parquet", str(bars)]
    for name, seed, epochs in (("a", "1", "2"), ("b", "2", "1")):
        r = run_main([*train, "--out", str(tmp_path / name / "ckpt.pt"), *flags, "--seed", seed, "--epochs", epochs])
        assert r.returncode == 0, r.stderr[-3000:]
    a_test = json.loads((tmp_path / "a" / "ckpt.test.json").read_text())
    a_best = load_checkpoint(tmp_path / "a" / "ckpt.pt")["epoch"]
    assert file_sha256(tmp_path / "b" / "ckpt.pt") != file_sha256(tmp_path / "a" / "ckpt.pt")
    # run a, resumed into b's directory (no epoch left to run, as when no new epoch beats the best)
    resume = [*train, "--threads", "1", "--no-progress", "--resume"]
    r = run_main([*resume, str(tmp_path / "a" / "ckpt.last.pt"), "--out", str(tmp_path / "b" / "ckpt.pt")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"copied the run's best checkpoint (epoch {a_best})" in r.stderr
    assert "nothing to train: the run is at epoch 2 of --epochs 2; to train on, resume with --epochs above 2" \
        in r.stderr
    assert file_sha256(tmp_path / "b" / "ckpt.pt") == file_sha256(tmp_path / "a" / "ckpt.pt")
    assert json.loads((tmp_path / "b" / "ckpt.test.json").read_text())["test_loss"] == a_test["test_loss"]
    assert (tmp_path / "b" / "ckpt.report.png").stat().st_size > 0
    # an --out not ending in .pt: the best is e/model.ckpt beside e/model.last.pt
    r = run_main([*train, "--out", str(tmp_path / "e" / "model.ckpt"), *TINY_TRAIN_FLAGS])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_main([*resume, str(tmp_path / "e" / "model.last.pt"), "--out", str(tmp_path / "f" / "ckpt.pt"),
                  "--no-report"])
    assert r.returncode == 0 and "copied the run's best checkpoint (epoch 1) from" in r.stderr, r.stderr[-3000:]
    assert file_sha256(tmp_path / "f" / "ckpt.pt") == file_sha256(tmp_path / "e" / "model.ckpt")
    # a last checkpoint copied alone, its run's best at an earlier epoch: no best to use, and none borrowed; the
    # run stopped early (3 epochs without improvement, its --patience), so more --epochs alone train nothing
    last = load_checkpoint(tmp_path / "a" / "ckpt.last.pt")
    last.update(best_epoch=1, best_val_loss=last["metrics_history"][0]["val_loss"], epochs_without_improvement=3)
    save_atomic(last, tmp_path / "c" / "saved.pt")
    (tmp_path / "d").mkdir()
    for other in ("ckpt.test.json", "ckpt.report.png"):  # another run's judgments, left in d
        (tmp_path / "d" / other).write_text("another run's")
    r = run_main([*resume, str(tmp_path / "c" / "saved.pt"), "--out", str(tmp_path / "d" / "ckpt.pt"), "--epochs", "3"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("nothing to train: the run stopped early at epoch 2, after 3 epochs without validation improvement "
            "(--patience 3); to train on, resume with a --patience above 3 (0: never stop early)") in r.stderr
    assert "is not beside" in r.stderr and "skipped the report and the test split" in r.stderr
    assert "they judge a model that is not this run's best" in r.stderr
    assert not (tmp_path / "d" / "ckpt.pt").exists() and not (tmp_path / "d" / "ckpt.test.json").exists()
    assert not (tmp_path / "d" / "ckpt.report.png").exists()
    # a stopping rule may change on resume: a higher --patience trains on
    r = run_main([*resume, str(tmp_path / "c" / "saved.pt"), "--out", str(tmp_path / "g" / "ckpt.pt"), "--epochs", "3",
                  "--patience", "5", "--no-report"])
    assert r.returncode == 0 and "resume: patience 3 -> 5" in r.stderr, r.stderr[-3000:]
    assert "nothing to train" not in r.stderr and load_checkpoint(tmp_path / "g" / "ckpt.last.pt")["epoch"] == 3
    # resumed from an earlier epoch than the run's latest beside --out: said, before that latest is replaced
    r = run_main([*resume, str(tmp_path / "c" / "saved.pt"), "--out", str(tmp_path / "g" / "ckpt.pt"), "--epochs", "3",
                  "--patience", "5", "--no-report"])
    assert r.returncode == 0 and (f"resuming from epoch 2, but {tmp_path / 'g' / 'ckpt.last.pt'} is at epoch 3 and "
                                  "this run replaces it") in r.stderr, r.stderr[-3000:]
    # a fresh run into b with no report and no test split: the earlier run's report and test scores go
    r = run_main([*train, "--out", str(tmp_path / "b" / "ckpt.pt"), *TINY_TRAIN_FLAGS])
    assert r.returncode == 0 and "ckpt.test.json" in r.stderr and "from an earlier run" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "b" / "ckpt.test.json").exists() and not (tmp_path / "b" / "ckpt.report.png").exists()


def test_the_files_beside_out_are_named_from_it_less_a_checkpoints_suffix_only() -> None:
    """A sweep's --out lr0.001 and lr0.003 (or run.v2 and run.v3) each get their own files beside them."""
    from trainer.paths import RunPaths

    def names(out: str) -> list[str]:
        return [p.name for p in astuple(RunPaths.for_out(Path("runs") / out))]

    assert names("ckpt.pt") == ["ckpt.pt", "ckpt.last.pt", "ckpt.metrics.jsonl", "ckpt.report.png", "ckpt.test.json"]
    assert names("model.ckpt")[1:3] == ["model.last.pt", "model.metrics.jsonl"]
    assert names("lr0.001")[1:] == ["lr0.001.last.pt", "lr0.001.metrics.jsonl", "lr0.001.report.png",
                                    "lr0.001.test.json"]
    assert set(names("lr0.001")).isdisjoint(names("lr0.003")) and set(names("run.v2")).isdisjoint(names("run.v3"))


def test_a_fresh_run_that_saves_no_epoch_leaves_the_earlier_runs_judgments(tmp_path: Path, bars: Path) -> None:
    """The report and test scores beside --out judge the earlier run's ckpt.pt: they go when this run's first
    best checkpoint replaces it, not at its start (here its first epoch diverges, and nothing is replaced)."""
    out = tmp_path / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "a" / "b" / "ckpt.pt"),
                  *TINY_TRAIN_FLAGS, "--learning-rate", "1e9", "--grad-clip", "0"])
    assert r.returncode == 2 and not (tmp_path / "a").exists(), r.stderr[-2000:]  # and no empty directories
    earlier = {name: f"the earlier run's {name}" for name in ("ckpt.test.json", "ckpt.report.png")}
    for name, text in earlier.items():
        (tmp_path / name).write_text(text)
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *TINY_TRAIN_FLAGS, "--learning-rate",
                  "1e9", "--grad-clip", "0"])
    assert r.returncode == 2 and "training diverged" in r.stderr, r.stderr[-2000:]
    assert {name: (tmp_path / name).read_text() for name in earlier} == earlier and not out.exists()


def test_sigterm_leaves_last_good_checkpoint_and_resume_finishes(tmp_path: Path, bars: Path) -> None:
    """SIGTERM once the first epoch's metrics line is written (after its checkpoints): no epoch limit or early
    stop can end the run first, however slow or fast the machine."""
    out = tmp_path / "ckpt.pt"
    flags = [f for f in TINY_TRAIN_FLAGS]
    flags[flags.index("--epochs") + 1] = "100000"
    flags += ["--patience", "0"]
    with (tmp_path / "stderr.txt").open("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", "--parquet", str(bars), "--out", str(out), *flags],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            metrics = out.with_suffix(".metrics.jsonl")
            while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        finally:
            proc.kill()
        log.seek(0)
        err = log.read()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted: the last epoch's checkpoint is intact; continue with `python -m " \
        f"trainer --parquet {bars} --out {out} {' '.join(flags)} --resume {out.with_suffix('.last.pt')}`" in err, \
        err[-2000:]
    last = load_checkpoint(out.with_suffix(".last.pt"))
    assert last["epoch"] >= 1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    resume = ["-m", "trainer", "--parquet", str(bars), "--out", str(out), "--resume", str(out.with_suffix(".last.pt"))]
    # the command says what machine the plan is for; the recipe stays the checkpoint's
    r = run_main([*resume, "--plan-only", "--device", "cuda", "--vram-budget", "4GiB"])
    assert r.returncode == 0 and "planned for a CUDA card" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = run_main([*resume, "--hidden-size", "16"])
    assert r.returncode == 2 and "changes --hidden-size 16 (the checkpoint's: 8)" in r.stderr, r.stderr[-2000:]
    r = run_main([*resume, "--epochs", str(last["epoch"] + 1), "--no-progress", "--no-report"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_checkpoint(out.with_suffix(".last.pt"))["epoch"] == last["epoch"] + 1
    assert f'"epochs": {last["epoch"] + 1}' in r.stderr and '"hidden_size": 8' in r.stderr  # the config it ran


def test_an_interrupted_run_names_the_command_that_continues_it_and_resume_writes_where_its_run_did(
        tmp_path: Path, bars: Path) -> None:
    import argparse

    from trainer.__main__ import _stat, _where_to_continue, continue_command, default_out

    assert default_out(None) == Path("ckpt.pt")
    assert default_out(Path("runs/ckpt.last.pt")) == Path("runs/ckpt.pt")  # not ckpt.pt in the working directory
    assert default_out(Path("runs/model.pt")) is None  # a copy's run is unknown: --out must say, not the copy
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--resume", str(tmp_path / "keep-epoch3.pt")])
    assert r.returncode == 2 and "--resume " in r.stderr and ": give --out" in r.stderr, r.stderr[-2000:]
    # the run's own command, machine flags and all, from the last checkpoint it wrote; quoted for a shell
    command = ["python", "-m", "trainer", "--parquet", "my bars.parquet", "--out", "r/ckpt.pt", "--device", "cpu",
               "--resume=old.pt", "--threads", "1"]
    assert continue_command(command, Path("r/ckpt.last.pt")) == (
        "python -m trainer --parquet 'my bars.parquet' --out r/ckpt.pt --device cpu --threads 1 --resume "
        "r/ckpt.last.pt")
    out, last = tmp_path / "ckpt.pt", tmp_path / "ckpt.last.pt"
    args = argparse.Namespace(out=out, resume=None, command=["python", "-m", "trainer", "--out", str(out)])
    assert _where_to_continue(args, None).startswith("no epoch finished, so nothing was saved (files already")
    last.write_bytes(b"an earlier run's")
    before = _stat(last)
    assert "start again" in _where_to_continue(args, before)  # there before this run: not one to continue from
    resumed = argparse.Namespace(out=out, resume=last, command=[*args.command, "--resume", str(last)])
    assert _where_to_continue(resumed, before) == (
        f"no epoch finished, so nothing was saved; {last} is as it was: continue with `python -m trainer --out {out} "
        f"--resume {last}`")
    last.write_bytes(b"this run's first epoch")  # replaced, as save_atomic does
    assert _where_to_continue(args, before) == ("the last epoch's checkpoint is intact; continue with `python -m "
                                                f"trainer --out {out} --resume {last}`")


def test_a_resumed_run_keeps_its_recipe_and_takes_its_machine_from_the_command() -> None:
    stored = TrainConfig(hidden_size=8, attention_heads=2, epochs=3, device="cuda", vram_budget="4GiB",
                         learning_rate=3e-4)
    now = TrainConfig(hidden_size=8, attention_heads=2, device="cpu")  # epochs and learning rate left at defaults
    resumed = resumed_config(stored, now, {"hidden_size", "attention_heads", "device", "vram_budget"})
    assert (resumed.device, resumed.vram_budget) == ("cpu", "")  # this machine's, given or not
    assert resumed.epochs == 3 and resumed.learning_rate == 3e-4  # the run's own, not the defaults
    assert resumed_config(stored, replace(now, epochs=5), {"epochs"}).epochs == 5
    assert resumed.patience == stored.patience == 3  # the stopping rules: the run's own unless given
    assert resumed_config(replace(stored, patience=2), replace(now, patience=6), {"patience"}).patience == 6
    with pytest.raises(ConfigError) as info:
        resumed_config(stored, replace(now, hidden_size=16, learning_rate=1.0), {"hidden_size", "learning_rate"})
    assert "hidden_size 16 (the checkpoint's: 8); learning_rate 1.0 (the checkpoint's: 0.0003)" in str(info.value)


def test_flags_override_config_file(tmp_path: Path, bars: Path) -> None:
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text("[model]\nhidden_size = 12\nattention_heads = 2\n[data]\nhorizon = 4\n")
    flags = [f for f in TINY_TRAIN_FLAGS]
    flags[flags.index("--horizon") : flags.index("--horizon") + 2] = []
    flags[flags.index("--hidden-size") : flags.index("--hidden-size") + 2] = []
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "c.pt"), "--config", str(cfg_file),
                  "--hidden-size", "6", *flags])
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert ckpt["model_config"]["hidden_size"] == 6  # flag wins over the file
    assert ckpt["model_config"]["horizon"] == 4  # the file wins over the default


def test_a_config_file_that_cannot_be_read_or_holds_a_boolean_for_a_number_is_a_config_error(tmp_path: Path) -> None:
    """One message naming the file, never a traceback: a directory, a file that is not UTF-8, and TOML's
    true given for a number (Python counts a bool as an int, so it would have become 1 epoch)."""
    from trainer.config import load_toml, merge

    (tmp_path / "latin1.toml").write_bytes("# caf\xe9\nepochs = 2\n".encode("latin-1"))
    for path, message in ((tmp_path, "cannot read it as TOML"), (tmp_path / "latin1.toml", "cannot read it as TOML")):
        with pytest.raises(ConfigError) as info:
            load_toml(path)
        assert str(info.value).startswith(f"--config {path}: {message}"), info.value
    for key, value in (("epochs", True), ("learning_rate", False)):
        with pytest.raises(ConfigError) as info:
            merge(TrainConfig(), {key: value}, "--config cfg.toml")
        assert f"{key} (--config cfg.toml): cannot use {value!r}" in str(info.value)


def test_a_bad_setting_is_named_where_it_was_set_with_its_value(tmp_path: Path) -> None:
    """A flag by its flag, a key of the --config file by its key and file, each with the value it has."""
    from trainer.__main__ import build_parser
    from trainer.config import config_from_args

    cfg = tmp_path / "cfg.toml"
    cfg.write_text("[model]\nhidden_size = 10\n[train]\nprecision = 'bf17'\n")
    for argv, message in (
            (["--attention-heads", "3", "--precision", "fp32"],
             f"hidden_size (--config {cfg}) 10 must be divisible by --attention-heads 3"),
            ([], f"precision (--config {cfg}) must be auto, fp32, bf16 or fp16, got 'bf17'"),
            (["--precision", "fp32", "--hidden-size", "12", "--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
            (["--precision", "fp32"],  # a default the file does not set is named by its flag
             f"hidden_size (--config {cfg}) 10 must be divisible by --attention-heads 4")):
        with pytest.raises(ConfigError) as info:
            config_from_args(build_parser().parse_args(["--parquet", "b.parquet", "--config", str(cfg), *argv]))
        assert str(info.value) == message


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "CUDA is not available"),
        (["--epochs", "abc"], "error: --epochs: cannot use 'abc' (expected int)"),
        (["--hidden-size", "10", "--attention-heads", "3"],
         "error: --hidden-size 10 must be divisible by --attention-heads 3"),
        (["--quantiles", "0.9,0.1"],
         "error: --quantiles must be non-empty, strictly increasing, in (0, 1); got 0.9, 0.1"),
        (["--device", "gpu"], "error: --device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["--encoder-length", "5000"], "no training windows"),
        (["--val-fraction", "0.001"], "no validation windows"),
        (["--features", "nope"], "user feature column 'nope' is missing"),
        (["--resume", "missing.pt"], "no such checkpoint file"),
        (["--parquet", "gone/bars.parquet"], "error: --parquet gone/bars.parquet: no such file or directory"),
        (["--precision", "fp16", "--device", "cpu"], "needs CUDA"),
        (["--window-block", "-1"], "--window-block must be >= 0"),
        (["--threads", "-2"], "--threads must be >= 0, got -2"),
        (["--device", "cudax"], "error: --device must be auto, cpu, cuda or cuda:N, got 'cudax'"),
        (["--learning-rate", "1e9", "--grad-clip", "0"], "training diverged"),  # a NaN loss: one message, exit 2
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path, bars: Path, args: list[str], message: str) -> None:
    out = tmp_path / "ckpt.pt"
    base = [f for f in TINY_TRAIN_FLAGS if f not in ("--device", "cpu")]
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *base, *args])
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not out.exists()
    if "--parquet" in args:  # before the resolved config and the device choice, which would bury it
        assert r.stderr.startswith("error: --parquet"), r.stderr[-2000:]


def test_help_and_a_bad_flag_answer_before_torch_is_imported(bars: Path) -> None:
    """--help and a flag or config the run cannot take are answered before torch's seconds of import."""
    for args, code in ((["--help"], 0), (["--parquet", str(bars), "--epochs", "0"], 2),
                       (["--parquet", str(bars), "--hidden-size", "10", "--attention-heads", "3"], 2)):
        r, last = exit_and_imports("trainer", args, ("torch",))
        assert last == f"exit {code} torch=False", (args, r.stdout[-500:], r.stderr[-2000:])
    if not torch.cuda.is_available():  # a run that starts does import it, to find no CUDA
        r, last = exit_and_imports("trainer", ["--parquet", str(bars), "--device", "cuda"], ("torch",))
        assert last == "exit 2 torch=True" and "CUDA is not available" in r.stderr, r.stderr[-2000:]


def test_a_model_too_big_for_the_hosts_memory_exits_3_naming_it(tmp_path: Path, bars: Path) -> None:
    """1 PiB for one layer, past what a process can address (128 TiB on x86-64, 256 TiB on 48-bit arm64), so no
    allocator grants it, overcommit or not; the run says so, exit 3 as for a card's memory, not a traceback."""
    out = tmp_path / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), "--hidden-size", "16777216",
                  "--attention-heads", "1", "--epochs", "1", "--device", "cpu", "--no-progress"])
    assert r.returncode == 3 and "error: out of host memory: DefaultCPUAllocator: can't allocate memory" in r.stderr \
        and "Shrink the model" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("weight_decay", -1.0, "weight_decay must be >= 0"),
    ("warmup_steps", -5, "warmup_steps must be >= 0"),
    ("grad_clip", -1.0, "grad_clip must be >= 0"),
    ("max_steps_per_epoch", -1, "max_steps_per_epoch must be >= 0"),
    ("max_val_windows", -1, "max_val_windows must be >= 0"),
    ("features", ("imbalance", "spread", "imbalance"), "features lists a column more than once (imbalance)"),
    ("features", ("imbalance", "log_return"), "features names log_return, the name of a built-in feature (built "
                                              "in: symbol, log_return,"),
    ("calendar_tz", "CST", "calendar time zone 'CST' is not an IANA time zone name (e.g. UTC, America/Chicago"),
])
def test_config_refuses_what_it_cannot_train_with(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({field: value}).validate()
    assert message in str(info.value)


def test_unknown_config_key_and_bad_bars_exit_2(tmp_path: Path) -> None:
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text("hiden_size = 12\n")
    bars = make_bars(tmp_path / "bars.parquet", bars=500)
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--config", str(cfg_file)])
    assert r.returncode == 2 and "unknown config key(s) hiden_size" in r.stderr
    import pyarrow.parquet as pq

    t = pq.read_table(bars)
    close = t.column("close").to_numpy().copy()
    close[10] = -1.0
    t = t.set_column(t.schema.get_field_index("close"), "close", [close])
    pq.write_table(t, tmp_path / "bad.parquet")
    r = run_main(["-m", "trainer", "--parquet", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "new" / "x.pt")])
    assert r.returncode == 2
    assert "column 'close', row 10" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "new").exists()  # a refused run leaves nothing behind, not even --out's directory
    pq.write_table(t.slice(0, 0), tmp_path / "empty.parquet")  # the columns, no rows
    r = run_main(["-m", "trainer", "--parquet", str(tmp_path / "empty.parquet"), "--out", str(tmp_path / "x.pt")])
    assert r.returncode == 2 and "no bars (the file holds no rows)" in r.stderr and "Traceback" not in r.stderr
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--resume", str(corrupt), "--out", str(tmp_path / "r.pt")])
    assert r.returncode == 2 and "not a readable checkpoint" in r.stderr


def test_device_auto_says_which_device_it_chose(tmp_path: Path, bars: Path) -> None:
    flags = [f for f in TINY_TRAIN_FLAGS if f not in ("--device", "cpu")]
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "a.pt"), "--device", "auto", *flags])
    assert r.returncode == 0, r.stderr[-2000:]
    expected = "training on the CPU" if not torch.cuda.is_available() else "training on cuda"
    assert expected in r.stderr


def test_forecast_metrics_match_hand_computation() -> None:
    target = np.array([[1.0], [-2.0]])  # [W=2, H=1]
    pred = np.array([[[0.0, 0.5, 2.0]], [[-1.0, 0.0, 1.0]]])  # [W, H, Q]
    m = forecast_metrics(pred, target, (0.1, 0.5, 0.9))
    # q=0.1: errors 1 -> 0.1, -1 -> 0.9 ; q=0.5: 0.5 -> 0.25, -2 -> 1.0 ; q=0.9: -1 -> 0.1, -3 -> 0.3
    assert m["pinball"] == pytest.approx({"0.1": 0.5, "0.5": 0.625, "0.9": 0.2})
    assert m["q_risk"] == pytest.approx({"0.1": 2 * 1.0 / 3, "0.5": 2 * 1.25 / 3, "0.9": 2 * 0.4 / 3})
    assert m["coverage"] == 0.5


def test_torchrun_two_gloo_processes_match_one_process(tmp_path: Path, bars: Path) -> None:
    """DDP on 2 CPU ranks (gloo): shared vocabulary/normalisation, sharded batches, averaged
    gradients, rank 0 alone writing files — the same weights as one process, within float error."""
    flags = [*TINY_TRAIN_FLAGS, "--dropout", "0", "--epochs", "2"]
    one = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "one" / "ckpt.pt"), *flags])
    assert one.returncode == 0, one.stderr[-2000:]
    two = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainer",
               "--parquet", str(bars), "--out", str(tmp_path / "two" / "ckpt.pt"), *flags])
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stderr.count("resolved config:") == 1 and two.stderr.count("best validation loss") == 1  # rank 0's
    a = load_checkpoint(tmp_path / "one" / "ckpt.last.pt")
    b = load_checkpoint(tmp_path / "two" / "ckpt.last.pt")
    assert a["epoch"] == b["epoch"] == 2
    assert a["symbols"] == b["symbols"] and a["normalization"] == b["normalization"]
    for name, value in a["model_state"].items():
        torch.testing.assert_close(b["model_state"][name], value, atol=1e-5, rtol=1e-4, msg=name)
    lines = (tmp_path / "two" / "ckpt.metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # written once, by rank 0
    # an epoch whose last step has one window, fewer than the ranks: dropped (rank 1 would have none to step on);
    # and the report, drawn by rank 0 alone (another rank, done first, looked for a checkpoint not yet there)
    n = prepare(bars, tiny_cfg()).train_anchors.size
    flags[flags.index("--batch-size") + 1] = str(n - 1)
    flags[flags.index("--max-steps-per-epoch") + 1] = "0"  # every step of the epoch
    with_report = [f for f in flags if f != "--no-report"]
    four = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainer",
                "--parquet", str(bars), "--out", str(tmp_path / "four" / "ckpt.pt"), *with_report, "--epochs", "1"])
    assert four.returncode == 0, four.stderr[-3000:]
    assert load_checkpoint(tmp_path / "four" / "ckpt.last.pt")["step"] == 1  # the full step; not the lone window
    assert (tmp_path / "four" / "ckpt.report.png").is_file() and not list((tmp_path / "four").glob(".*.tmp*"))
    # a batch smaller than the ranks could give none of its steps a window for every rank: refused up front, as
    # every ConfigError is (exit 2, "error: ..." on stderr)
    with pytest.raises(ConfigError, match="--batch-size 1 is smaller than the 2 processes torchrun started"):
        steps_per_epoch(tiny_cfg(batch_size=1), n, 2)


def test_torchrun_ranks_with_unequal_micro_steps_match_one_process(tmp_path: Path, bars: Path) -> None:
    """Steps of 5 windows on 2 ranks (3 + 2) at micro-batch 2, rank 0 halving to 1 on an out-of-memory error,
    and validation batches of 5 and 7 (as two cards with different free memory plan): rank 0 makes 3 micro-steps
    a step, rank 1 one. Gradients are exchanged once a step, each window weighted as in one process, so the
    weights match one process's at micro-batch 2 (they ran out of sync, or hung, when every micro-step's backward
    exchanged gradients); every rank takes rank 0's validation figures, so they decide the best epoch and early
    stopping alike; and each rank draws its own dropout masks."""
    worker = str(REPO / "tests" / "ddp_epoch.py")
    one = run([worker, str(bars), str(tmp_path / "one"), "--micro-batch", "2", "--epochs", "2"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker, str(bars),
               str(tmp_path / "two"), "--micro-batch", "2", "--epochs", "2", "--oom-rank", "0", "--val-batch", "5,7"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "out of memory: micro-batch halved to 1" in two.stderr
    a = torch.load(tmp_path / "one" / "rank0.pt")
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt") for r in (0, 1)]
    for b in ranks:
        assert a["model"].keys() == b["model"].keys()
        for name, value in a["model"].items():
            torch.testing.assert_close(b["model"][name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert len(ranks[0]["val_loss"]) == 2 and ranks[0]["val_loss"] == ranks[1]["val_loss"]  # the very same floats
    assert not torch.equal(ranks[0]["rng"], ranks[1]["rng"])
    untrained = Trainer(bars, tiny_cfg(batch_size=5, dropout=0.0), tmp_path / "u.pt", progress=False)
    moved = [n for n, v in untrained.model.state_dict().items() if not torch.equal(v, a["model"][n])]
    assert moved  # the epochs trained: the comparison is of weights that moved
    # out of memory after DDP's forward readied the exchange: not retried (the ranks would fall out of step)
    three = run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker, str(bars),
                 str(tmp_path / "three"), "--micro-batch", "5", "--loss-oom-rank", "0"])
    assert three.returncode != 0
    assert "whose backward exchanges gradients between the 2 ranks" in three.stderr, three.stderr[-3000:]
    assert "micro-batch halved" not in three.stderr


def test_every_config_field_has_a_flag_with_its_description() -> None:
    from dataclasses import fields

    from trainer.config import field_comments

    comments = field_comments()
    assert set(comments) == {f.name for f in fields(TrainConfig)}
    r = run_main(["-m", "trainer", "--help"])
    assert r.returncode == 0
    for f in fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in r.stdout
    assert "past bars the encoder sees" in r.stdout


def test_predict_keeps_the_outputs_asked_for_and_out_of_memory_halves_the_batch(tmp_path: Path, bars: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    torch.set_num_threads(1)
    t = Trainer(bars, tiny_cfg(epochs=1), tmp_path / "c.pt", progress=False)
    anchors = t.data.val_anchors[:50]
    every = t.predict(anchors, batch=32)
    assert set(every) == set(MODEL_OUTPUTS) and all(len(v) == 50 for v in every.values())
    expected = every["quantiles"]
    # validation keeps the quantiles alone (each window's explanations would dwarf them), and the same ones
    only = t.predict(anchors, batch=32, outputs=("quantiles",))
    assert list(only) == ["quantiles"] and np.array_equal(only["quantiles"], expected)
    real = t._forward
    injected: list[int] = []

    def flaky(batch: dict[str, torch.Tensor], net: torch.nn.Module | None = None) -> object:
        if not injected and batch["target"].shape[0] == 32:
            injected.append(1)
            raise torch.OutOfMemoryError("injected")
        return real(batch, net)

    t._forward = flaky  # type: ignore[method-assign,assignment]
    got = t.predict(anchors, batch=32)["quantiles"]
    assert injected and "validation batch halved to 16" in caplog.text
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_a_diverging_run_stops_with_a_message_and_saves_nothing_of_that_epoch(tmp_path: Path, bars: Path) -> None:
    out = tmp_path / "ckpt.pt"
    good = Trainer(bars, tiny_cfg(epochs=1), out, progress=False)
    good.run()
    kept = out.with_suffix(".last.pt").read_bytes()
    metrics = out.with_suffix(".metrics.jsonl").read_text()
    # a learning rate no model survives: the loss leaves the floats in the first epoch
    t = Trainer(bars, tiny_cfg(epochs=2, learning_rate=1e9, grad_clip=0.0), out, progress=False)
    with pytest.raises(TrainingDiverged) as info:
        t.run()
    message = str(info.value)
    assert "training diverged in epoch 1" in message and "no checkpoint was written" in message
    assert "Lower --learning-rate (now 1e+09) or set --grad-clip (now 0: no clipping; e.g. 1.0), and check" in message
    assert "--precision" not in message  # fp32 already: not advice
    assert out.with_suffix(".last.pt").read_bytes() == kept  # the earlier run's files are left alone, and
    assert out.with_suffix(".metrics.jsonl").read_text() == metrics  # the metrics of its checkpoints with them
    assert not list(tmp_path.glob(".*.tmp"))


def test_only_the_checkpoint_writers_own_temp_files_are_cleared(tmp_path: Path) -> None:
    from trainer.checkpoint import remove_stale_temp_files, save_atomic

    save_atomic({"x": 1}, tmp_path / "ckpt.pt")
    killed = tmp_path / ".ckpt.pt.k1ll3d_x.tmp"  # what a SIGKILL mid-write leaves (mkstemp's 8 characters)
    others = [tmp_path / ".ckpt.pt.my notes.tmp", tmp_path / ".ckpt.last.pt.k1ll3d_x.tmp", tmp_path / "ckpt.pt.tmp"]
    for p in (killed, *others):
        p.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path / "ckpt.pt") == [killed]
    assert all(p.exists() for p in others) and (tmp_path / "ckpt.pt").exists()


def test_an_out_that_is_a_link_becomes_a_file_and_what_it_named_is_kept(
        tmp_path: Path, bars: Path, learned_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """ckpt.pt -> releases/v1.pt trained over: the release stays as it was, the run's checkpoint takes the link's
    place."""
    release = tmp_path / "releases" / "v1.pt"
    release.parent.mkdir()
    shutil.copy(learned_run[0], release)
    kept = file_sha256(release)
    out = tmp_path / "ckpt.pt"
    out.symlink_to(release)
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *TINY_TRAIN_FLAGS])
    assert r.returncode == 0, r.stderr[-3000:]
    assert not out.is_symlink() and load_checkpoint(out)["epoch"] == 1
    assert file_sha256(release) == kept


def test_an_out_over_the_bars_a_file_or_a_directory_is_refused_before_training(tmp_path: Path, bars: Path) -> None:
    own = tmp_path / "own.parquet"  # --out naming the bars themselves would replace them with the checkpoint
    shutil.copy(bars, own)
    r = run_main(["-m", "trainer", "--parquet", str(own), "--out", str(own), *TINY_TRAIN_FLAGS])
    assert r.returncode == 2 and f"--out {own}: {own} is the bars file {own} itself" in r.stderr, r.stderr[-2000:]
    assert own.read_bytes() == bars.read_bytes() and "epoch 1" not in r.stderr
    notes = tmp_path / "notes.txt"  # a file of the user's, not a checkpoint: never replaced
    notes.write_text("mine")
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(notes), *TINY_TRAIN_FLAGS])
    assert r.returncode == 2 and f"{notes} exists and is not a PyTorch checkpoint" in r.stderr, r.stderr[-2000:]
    assert notes.read_text() == "mine"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path), *TINY_TRAIN_FLAGS])
    assert r.returncode == 2 and f"--out {tmp_path} is a directory" in r.stderr, r.stderr[-2000:]


def test_symbols_the_model_cannot_learn_or_space_rightly_are_warned_about(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from features.synth import generate

    table = generate(["ES", "NQ", "CL"], 1500, seed=3)  # 1,500 one-minute bars each, symbol after symbol
    symbol, row = table.column("symbol"), pa.array(np.arange(table.num_rows))
    keep = pc.or_(pc.equal(symbol, "ES"),
                  pc.or_(pc.and_(pc.equal(symbol, "NQ"), pc.equal(pc.bit_wise_and(row, 3), 0)),  # every 4th bar
                         pc.and_(pc.equal(symbol, "CL"), pc.less(row, 2 * 1500 + 10))))  # CL's first 10 bars
    daily = generate(["GC"], 390 * 40, seed=4)  # 40 sessions of GC, of which the first bar each: daily bars
    daily = daily.filter(pc.equal(pc.bit_wise_and(pa.array(np.arange(daily.num_rows) % 390), 1023), 0))
    pq.write_table(pa.concat_tables([table.filter(keep), daily.cast(table.schema)]), tmp_path / "bars.parquet")
    with caplog.at_level("WARNING", logger="trainer"):
        prepare(tmp_path / "bars.parquet", tiny_cfg())
    text = caplog.text
    assert "symbol CL has no training window (10 bars" in text
    assert "symbol NQ: its bars are mostly 240 s apart, the run's bar interval is 60 s" in text
    assert "symbol GC: its bars are mostly 86400 s apart" in text and "if they are daily bars" in text
    assert "symbol ES" not in text


def test_the_best_model_is_scored_once_on_the_held_out_test_split(tmp_path: Path, bars: Path) -> None:
    from trainer.run import test_best

    t = Trainer(bars, tiny_cfg(epochs=2, test_fraction=0.15), tmp_path / "ckpt.pt", progress=False)
    t.run()
    result = test_best(t)
    written = json.loads((tmp_path / "ckpt.test.json").read_text())
    assert written["epoch"] == t.best_epoch and written["test_windows"] == t.data.test_anchors.size > 0
    assert written["test_loss"] == pytest.approx(result["test_loss"]) and np.isfinite(written["test_loss"])
    assert set(written["test"]) >= {"coverage", "q_risk", "pinball"} and "baseline" in written
    # the test windows come after the validation windows in time: never seen by training nor by model choice
    frame = t.data.frame
    assert frame.timestamp_ns[t.data.test_anchors].min() > frame.timestamp_ns[t.data.val_anchors].max()


def test_a_config_file_key_set_in_two_sections_is_refused(tmp_path: Path) -> None:
    from trainer.config import load_toml

    cfg = tmp_path / "cfg.toml"
    cfg.write_text("epochs = 2\n[model]\nhidden_size = 12\n[data]\nhorizon = 4\n")
    assert load_toml(cfg) == {"epochs": 2, "hidden_size": 12, "horizon": 4}
    cfg.write_text("[model]\nhidden_size = 12\n[train]\nhidden_size = 16\n")
    with pytest.raises(ConfigError) as info:
        load_toml(cfg)
    assert "'hidden_size' is set in [model] and in [train]; set it once" in str(info.value)


def test_a_step_that_overflows_alone_is_counted_not_taken_for_divergence(tmp_path: Path, bars: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16's gradient scaler skips a step whose loss overflowed and leaves the weights as they were: the
    run goes on; the epoch's loss is that of its other steps, and the skipped one is counted."""
    t = Trainer(bars, tiny_cfg(epochs=1), tmp_path / "ckpt.pt", progress=False)
    real, seen = t._optimizer_step, []

    def first_overflows(anchors: torch.Tensor, step_windows: int) -> float:
        loss = real(anchors, step_windows)
        seen.append(loss)
        return float("inf") if len(seen) == 1 else loss

    monkeypatch.setattr(t, "_optimizer_step", first_overflows)
    [record] = t.run().history
    assert record["nonfinite_steps"] == 1 and record["train_loss"] == pytest.approx(float(np.mean(seen[1:])))


def test_a_training_split_whose_price_never_moves_is_refused_and_q_risk_is_undefined_on_zero_targets(
        tmp_path: Path, bars: Path) -> None:
    """Bars whose close never changes (an illiquid contract's carried price) leave every training target 0: the
    model would forecast in a made-up unit of a 100% move. Refused, naming why; and q-risk (over sum |y|) is
    reported as undefined, not as 1e14, where every target is 0."""
    from features.metrics import forecast_metrics, format_q_risk

    table = pq.read_table(bars)
    flat = {name: pa.array(np.full(table.num_rows, 100.0)) for name in ("open", "high", "low", "close")}
    for name, column in flat.items():
        table = table.set_column(table.column_names.index(name), name, column)
    pq.write_table(table, tmp_path / "flat.parquet")
    with pytest.raises(DataError) as info:
        prepare(tmp_path / "flat.parquet", tiny_cfg())
    assert "the training split's closes never move" in str(info.value)
    m = forecast_metrics(np.zeros((4, 3, 3)) + np.array([-0.1, 0.0, 0.1]), np.zeros((4, 3)), (0.1, 0.5, 0.9))
    assert m["q_risk"] == {"0.1": None, "0.5": None, "0.9": None} and m["pinball_mean"] > 0
    assert format_q_risk(m["q_risk"], m["q_risk"]) == "q0.1=n/a/n/a q0.5=n/a/n/a q0.9=n/a/n/a"  # type: ignore[arg-type]


def test_an_observed_feature_that_never_changes_in_training_is_warned_about(
        tmp_path: Path, bars: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A user column filled with one value normalises to zero everywhere: the run says so, naming it."""
    table = pq.read_table(bars)
    rng = np.random.default_rng(3)
    table = table.append_column("const", pa.array(np.full(table.num_rows, 7.0)))
    table = table.append_column("noisy", pa.array(rng.normal(size=table.num_rows)))
    pq.write_table(table, tmp_path / "bars.parquet")
    with caplog.at_level("WARNING", logger="trainer"):
        prepare(tmp_path / "bars.parquet", tiny_cfg(features=["const", "noisy"]))
    flagged = [r.getMessage() for r in caplog.records if "never change over the training bars" in r.getMessage()]
    assert len(flagged) == 1 and "const" in flagged[0] and "noisy" not in flagged[0], caplog.text
    assert flagged[0].startswith("user feature(s) const never change") and "drop them from --features" in flagged[0]
    # close-only bars (open, high and low mapped to the close): built-in features, not --features, never change;
    # a decimal user column is read as the prices are
    close = table.column("close")
    for name in ("open", "high", "low"):
        table = table.set_column(table.column_names.index(name), name, close)
    table = table.append_column("dec", pc.cast(table.column("noisy"), pa.decimal128(12, 6)))
    pq.write_table(table, tmp_path / "close_only.parquet")
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"):
        prepare(tmp_path / "close_only.parquet", tiny_cfg(features=["dec"]))
    flagged = [r.getMessage() for r in caplog.records if "never change over the training bars" in r.getMessage()]
    assert len(flagged) == 1 and flagged[0].startswith("built-in feature(s) log_range, log_body never change")
    assert "close-only data" in flagged[0] and "--features" not in flagged[0], caplog.text
    assert "volume" not in flagged[0]
    # a feed without volume: log_volume alone, blamed on the volume, not on close-only prices
    table = pq.read_table(tmp_path / "bars.parquet")
    table = table.set_column(table.column_names.index("volume"), "volume", pa.array(np.zeros(table.num_rows)))
    pq.write_table(table, tmp_path / "no_volume.parquet")
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer"):
        prepare(tmp_path / "no_volume.parquet", tiny_cfg())
    flagged = [r.getMessage() for r in caplog.records if "never change over the training bars" in r.getMessage()]
    assert len(flagged) == 1 and flagged[0].startswith("built-in feature(s) log_volume never change"), caplog.text
    assert "(harmless). A volume that never changes (a feed without volume, all zero) does it for log_volume" \
        in flagged[0]
    assert "close-only" not in flagged[0]


def test_train_memory_benchmark_runs_two_checkouts_and_compares_their_peaks(tmp_path: Path) -> None:
    """benchmarks/train_memory at a small size: both builds (here the same checkout) train on one file, each
    run's peak RSS and the trainer's own peaks are reported, and their validation losses agree."""
    cmd = [sys.executable, "-m", "benchmarks.train_memory", "--a", str(REPO), "--bars", "1500", "--symbols", "ES,NQ",
           "--steps", "1", "--repeats", "1", "--trainer-arg=--hidden-size=8", "--trainer-arg=--batch-size=32"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [line for line in done.stdout.splitlines() if " run 1: peak RSS " in line]
    assert len(runs) == 2 and {line.split()[0] for line in runs} == {"A", "B"}, done.stdout
    assert "| peak RSS, MiB (whole child) |" in done.stdout and "(differ" not in done.stdout, done.stdout
    refused = subprocess.run([*cmd[:4], str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "not a checkout holding trainer/__main__.py" in refused.stderr


def test_cli_startup_benchmark_times_every_command_against_importing_torch(tmp_path: Path) -> None:
    """benchmarks/cli_startup, one round: every case ends as it must (--help 0, a bad flag 2) and gets its row,
    beside the peers; an --a that is no checkout is refused."""
    cmd = [sys.executable, "-m", "benchmarks.cli_startup", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ") and " s |" not in line]
    assert rows == ["| trainer --help", "| trainer: a bad flag (--seed out of range)", "| export --help",
                    "| export: no such checkpoint", "| serving --help", "| serving.client --help",
                    "| serving.score --help", "| features.check --help", "| peer: python -c pass",
                    "| peer: python -c 'import torch'"], done.stdout
    refused = subprocess.run([*cmd, "--a", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "not a checkout holding trainer/__main__.py" in refused.stderr


# ---- the learning-rate schedule and early stopping of a fresh run ---------------------------------------
def test_warm_up_then_cosine_decay_to_a_tenth_of_the_peak() -> None:
    f = lr_lambda_factory(10, 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # linear warm-up over 10 steps
    assert f(10) == pytest.approx(1.0)  # the peak, then the cosine
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))  # half way: 0.55
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)  # the floor, held


def test_a_run_stops_after_patience_epochs_without_improvement(tmp_path: Path, bars: Path) -> None:
    cfg = tiny_cfg(epochs=8, max_steps_per_epoch=2, max_val_windows=50, patience=2)
    t = Trainer(bars, cfg, tmp_path / "ckpt.pt", progress=False)
    losses = iter([1.0, 0.9, 0.95, 0.9, 0.5, 0.4, 0.3, 0.2])
    real = t.validate

    def scripted() -> dict[str, Any]:
        stats = real()
        stats["val_loss"] = next(losses)
        return stats

    t.validate = scripted  # type: ignore[method-assign]
    result = t.run()
    # epochs 1 and 2 improve; 3 (0.95) and 4 (0.9, a tie: not an improvement) do not: patience 2 is spent
    assert (result.epochs_run, result.stopped_early) == (4, True)
    assert load_checkpoint(tmp_path / "ckpt.pt")["epoch"] == 2  # the best checkpoint is epoch 2's
    assert load_checkpoint(tmp_path / "ckpt.last.pt")["epoch"] == 4
