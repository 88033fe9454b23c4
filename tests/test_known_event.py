"""A scheduled event given as a known-future input is used by the model: trained through `python -m trainer` on
sample bars whose volatility jumps at planted events, the decoder's variable selection weighs the event flag over
3x more on the future bars that hold an event than on the others (the same model untrained: about 2x or less).
The loss it saves is measured in benchmarks/known_event.py (BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from features.bars import read_bars
from features.compute import build_frame
from features.config import FeatureConfig
from features.schema import DECODER_KNOWN
from features.windows import anchor_rows, gather_windows
from tests.artifacts import run_main
from trainer.checkpoint import load_checkpoint, model_from_checkpoint

pytestmark = pytest.mark.slow

EVENTS = "15:00,15:45,16:30,17:15,18:00,18:45,19:30,20:15"  # every other session: no weekday tells them
TRAIN = ("--hidden-size", "32", "--attention-heads", "2", "--encoder-length", "20", "--horizon", "3",
         "--batch-size", "64", "--epochs", "6", "--max-steps-per-epoch", "200", "--max-val-windows", "200",
         "--seed", "2", "--threads", "1", "--device", "cpu", "--no-progress", "--no-report",
         "--seasonal-scale", "false")  # the events recur at set times of day, which a seasonal profile partly learns


def test_the_decoder_selects_the_event_flag_on_the_bars_that_hold_an_event(tmp_path: Path) -> None:
    bars = tmp_path / "bars.parquet"
    r = run_main(["-m", "features.synth", "--out", str(bars), "--symbols", "ES,NQ", "--bars", "4000", "--seed", "7",
                  "--event", EVENTS, "--event-every", "2", "--event-jump", "6"])
    assert r.returncode == 0, r.stderr
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), "--known-features",
                  "event", *TRAIN])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    model = model_from_checkpoint(ckpt).eval()
    config = FeatureConfig.from_dict(ckpt["feature_config"])
    frame = build_frame(read_bars(bars, None, config.real_columns), config, list(ckpt["symbols"]))
    anchors = anchor_rows(frame, model.cfg.encoder_length)
    windows = gather_windows(frame, anchors[::3], model.cfg.encoder_length)
    with torch.no_grad():
        out = model(*(torch.from_numpy(np.nan_to_num(windows[name])) for name in frame.schema.model_inputs))
    column = frame.schema.known.index("event")
    weight = out.decoder_weights.numpy()[..., column]  # [B, H]
    on_event = windows[DECODER_KNOWN][..., column] > 0.5  # [B, H] the future bars that hold an event
    assert on_event.sum() >= 50
    assert weight[on_event].mean() > 3 * weight[~on_event].mean(), (weight[on_event].mean(),
                                                                     weight[~on_event].mean())
