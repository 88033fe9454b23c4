"""`make demo`'s steps end to end (scripts/demo.py, tiny model): trained on two quarters' contracts, the live
server forecasts the next quarter's contract, which the training bars never held."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import onnx
import pyarrow.parquet as pq
import pytest

from features.model_meta import ModelMeta
from tests.artifacts import REPO, run


def test_demo_runs_every_stage_and_prints_a_forecast_from_the_live_server(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "scripts/demo.py", "--out", str(out), "--tiny"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout
    for stage in ("1/7", "2/7", "3/7", "4/7", "5/7", "6/7", "7/7"):
        assert f"==> {stage}" in text
    meta = ModelMeta.from_props({p.key: p.value for p in onnx.load(out / "model.onnx").metadata_props})
    # the client's table names the model version the server answered with, and has one row per horizon step
    assert re.search(rf"^ESU5\s+model {re.escape(meta.model_version)}\s+last bar", text, re.M), text[-2000:]
    assert meta.symbols == ("ES", "NQ") and "ESH5 -> ESM5" in text  # roots, and the roll the check printed
    training = pq.read_table(out / "train.parquet", columns=["symbol"]).column("symbol").to_pylist()
    assert "ESU5" not in training and "ESU5" in pq.read_table(out / "bars.parquet").column("symbol").to_pylist()
    number = r"([-+]\d\.\d+)"
    rows = re.findall(rf"^(\d)\s+\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\s+{number}\s+{number}\s+{number}", text, re.M)
    assert [int(h) for h, *_ in rows] == list(range(1, meta.horizon + 1))
    for _, lo, mid, hi in rows:
        assert float(lo) <= float(mid) <= float(hi)
    assert "health: SERVING" in text and "drained" in text and "server stopped (exit status 0)" in text
    # the server's warm-up is reported before the forecast it made possible, and the demo ends with what to run
    assert text.index("health: SERVING") < text.index("==> 6/7") and "warmed up" in text[:text.index("==> 6/7")]
    assert "python -m serving --model" in text.splitlines()[-2] and "serving.client" in text.splitlines()[-1]
    assert "realised return inside [q0.1, q0.9]" in r.stderr  # the offline forecasts' summary
    for name in ("bars.parquet", "train.parquet", "ckpt.pt", "ckpt.last.pt", "ckpt.metrics.jsonl", "ckpt.report.png",
                 "model.onnx", "forecasts.parquet"):
        assert (out / name).is_file(), name


@pytest.mark.parametrize(("command", "shortened"), [
    (["trainer", "--parquet", "bars.parquet"], "--hidden"),  # for --hidden-size
    (["export", "ckpt.pt", "model.onnx"], "--require"),  # for --require-device
    (["serving", "--model", "model.onnx"], "--metrics"),  # for --metrics-port
    (["serving.client", "--target", "127.0.0.1:1", "--parquet", "bars.parquet", "--symbol", "ES"], "--expl"),
    (["features.check", "bars.parquet"], "--time"),  # for --time-col
])
def test_a_shortened_flag_is_refused_not_guessed(command: list[str], shortened: str) -> None:
    """argparse would take `--hidden 8` for `--hidden-size 8`: with this many similar flags (`--feature` for
    `--features`) a typo then runs with a setting the user did not name. Every command takes full names only."""
    r = run(["-m", *command, shortened, "8"], timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"unrecognized arguments: {shortened} 8" in r.stderr, r.stderr[-2000:]
