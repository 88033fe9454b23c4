"""`python -m serving.score`: forecasts for every bar of a history, run as a user runs it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from features.files import umask
from serving.model import load_model
from serving.preprocess import prepare
from serving.request_from_bars import series_from_bars
from serving.validation import columns_from_proto
from tests.artifacts import REPO, run
from tests.artifacts import run_score as score  # in-process
from tests.live_server import Model, tiny_model  # noqa: F401  (the shared fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scored(tiny_model: Model, tmp_path_factory: pytest.TempPathFactory) -> pa.Table:  # noqa: F811
    """The real command over the tiny model's bars (the other tests run its main in this process: score)."""
    out = tmp_path_factory.mktemp("score") / "forecasts.parquet"
    done = run(["-m", "serving.score", "--model", str(tiny_model.model), "--parquet", str(tiny_model.bars_path),
                "--out", str(out), "--threads", "1", "--batch", "100"])
    assert done.returncode == 0, done.stderr
    assert "windows: " in done.stderr and "realised return inside [q0.1, q0.9]" in done.stderr
    return pq.read_table(out)


def test_every_bar_with_its_warm_up_is_an_origin_with_one_row_per_horizon_step(tiny_model: Model,  # noqa: F811
                                                                              scored: pa.Table) -> None:
    meta, bars = tiny_model.meta, tiny_model.bars
    h = meta.horizon
    for symbol, rows in bars.series_slices().items():
        mine = scored.filter(pa.compute.equal(scored["symbol"], symbol))
        origins = bars.timestamp_ns[rows][meta.bars_required - 1:]  # the first origin has bars_required bars
        assert mine.num_rows == origins.size * h
        got = mine["origin"].cast(pa.int64()).to_numpy()
        np.testing.assert_array_equal(got, origins.repeat(h))
        np.testing.assert_array_equal(mine["h"].to_numpy(), np.tile(np.arange(1, h + 1), origins.size))
        np.testing.assert_array_equal(mine["time"].cast(pa.int64()).to_numpy(),
                                      got + mine["h"].to_numpy().astype(np.int64) * meta.bar_interval_ns)
        close = bars.close[rows][meta.bars_required - 1:]
        np.testing.assert_array_equal(mine["close"].to_numpy(), close.repeat(h))
        # the realised return to the h-th next bar of the file, NaN past its end
        later = np.concatenate([bars.close[rows], np.full(h, np.nan)])[meta.bars_required - 1:]
        want = np.log(np.stack([later[k:k + origins.size] for k in range(1, h + 1)], axis=1) / close[:, None])
        np.testing.assert_allclose(mine["actual_ret"].to_numpy(), want.ravel(), rtol=1e-6, atol=1e-7)
        assert np.isnan(mine["actual_ret"].to_numpy()[-1]) and np.isfinite(mine["actual_ret"].to_numpy()[0])
        # the bar actual_ret reaches, null past the end; across a session close later than the nominal `time`
        stamps = np.concatenate([bars.timestamp_ns[rows], np.zeros(h, np.int64)])[meta.bars_required - 1:]
        reached = np.stack([stamps[k:k + origins.size] for k in range(1, h + 1)], axis=1).ravel()
        actual_time = mine["actual_time"]
        assert actual_time.null_count == h * (h + 1) // 2  # the last h origins lack 1..h future bars
        valid = ~np.isnan(want.ravel())
        np.testing.assert_array_equal(actual_time.cast(pa.int64()).to_numpy(zero_copy_only=False)[valid],
                                      reached[valid])
        nominal = mine["time"].cast(pa.int64()).to_numpy()
        assert (reached[valid] >= nominal[valid]).all() and (reached[valid] > nominal[valid]).any()  # sessions
        for q in meta.quantiles:
            np.testing.assert_allclose(mine[f"price_q{q:g}"].to_numpy(),
                                       mine["close"].to_numpy() * np.exp(mine[f"ret_q{q:g}"].to_numpy()), rtol=1e-12)


def test_the_forecast_at_each_last_bar_is_the_servers(tiny_model: Model, scored: pa.Table) -> None:  # noqa: F811
    """Two paths to one window: the server's (request columns, latest_windows) and the scorer's (build_frame,
    gather_windows) give one forecast; batches of other sizes may differ in float32's last bits."""
    meta = tiny_model.meta
    model = load_model(tiny_model.model, "cpu", 1, max_batch=64)
    levels = [f"ret_q{q:g}" for q in meta.quantiles]
    for symbol in meta.symbols:
        series = columns_from_proto(series_from_bars(tiny_model.bars, symbol, meta.bars_required))
        server = model.run(prepare([series], meta).inputs)["quantiles"][0]  # [H, Q]
        mine = scored.filter(pa.compute.equal(scored["symbol"], symbol))
        last = mine.slice(mine.num_rows - meta.horizon)
        got = np.stack([last[c].to_numpy() for c in levels], axis=1)  # [H, Q]
        np.testing.assert_allclose(got, server, rtol=1e-5, atol=1e-7)


def test_symbols_and_a_time_range_choose_the_origins(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    bars, meta = tiny_model.bars, tiny_model.meta
    nq = bars.timestamp_ns[bars.series_slices()["NQ"]]
    start, end = nq[meta.bars_required + 10], nq[meta.bars_required + 30]
    iso = [np.datetime_as_string(np.datetime64(int(t), "ns"), unit="m") for t in (start, end)]
    out = tmp_path / "nq.parquet"
    done = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", out, "--symbols", "NQ",
                 "--start", iso[0], "--end", iso[1])
    assert done.returncode == 0, done.stderr
    t = pq.read_table(out)
    origins = np.unique(t["origin"].cast(pa.int64()).to_numpy())
    assert set(t["symbol"].to_pylist()) == {"NQ"}
    np.testing.assert_array_equal(origins, nq[(nq >= start) & (nq < end)])


@pytest.mark.parametrize(("flags", "message"), [
    (("--symbols", "CL"), "--symbols CL: not the model's (it knows ES, NQ)"),
    (("--symbols", " , "), "--symbols ' , ' names no symbol"),
    (("--start", "2024-02-01", "--end", "2024-01-01"), "--end 2024-01-01 is not after --start 2024-02-01"),
    (("--start", "yesterday"), "--start 'yesterday': give an ISO 8601 date or time"),
    (("--start", "2300-01-01"), "--start '2300-01-01': bar times are int64 nanoseconds, which hold 1678 to 2261"),
    (("--end", "1600-01-01"), "--end '1600-01-01': bar times are int64 nanoseconds"),
    (("--start", "2030-01-01"), "no forecast origin inside --start/--end (the bars run from 2024-"),
])
def test_a_bad_choice_is_named_and_nothing_is_written(flags: tuple[str, ...], message: str,
                                                      tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "f.parquet"
    done = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", out, *flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []  # no output, no temporary file


def test_an_out_that_would_replace_or_join_the_bars_is_refused(tiny_model: Model,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    bars = data / "bars.parquet"
    bars.write_bytes(tiny_model.bars_path.read_bytes())
    done = score("--model", tiny_model.model, "--parquet", bars, "--out", bars)
    assert done.returncode == 2 and f"--out {bars} is the bars file {bars} itself" in done.stderr, done.stderr
    done = score("--model", tiny_model.model, "--parquet", data, "--out", data / "forecasts.parquet")
    assert done.returncode == 2 and "whose next read would take it as bars" in done.stderr, done.stderr
    notes = tmp_path / "notes.parquet"  # named as a parquet file, holding something else
    notes.write_text("the user's notes")
    done = score("--model", tiny_model.model, "--parquet", bars, "--out", notes)
    assert done.returncode == 2 and f"{notes} exists and is not a parquet file" in done.stderr, done.stderr
    assert notes.read_text() == "the user's notes"
    assert sorted(p.name for p in data.iterdir()) == ["bars.parquet"]
    assert bars.read_bytes() == tiny_model.bars_path.read_bytes()
    # bars further apart than the model's interval are scored, with a warning that says so
    table = pq.read_table(bars)
    pq.write_table(table.filter(pc.equal(pc.bit_wise_and(pa.array(np.arange(table.num_rows)), 3), 0)),
                   tmp_path / "fourth.parquet")
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "fourth.parquet", "--out", tmp_path / "f.parquet",
                 "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert "the ES bars are mostly 4min apart, but the model's bar interval is 1min" in done.stderr, done.stderr


def test_an_out_that_is_a_link_becomes_a_file_and_what_it_named_is_kept(tiny_model: Model,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """latest.parquet -> runs/monday.parquet scored over: Monday's forecasts stay, and the note says so."""
    monday = tmp_path / "runs" / "monday.parquet"
    monday.parent.mkdir()
    pq.write_table(pa.table({"kept": [1, 2, 3]}), monday)
    kept = monday.read_bytes()
    latest = tmp_path / "latest.parquet"
    latest.symlink_to(monday)
    done = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", latest, "--threads", "1",
                 "--symbols", tiny_model.meta.symbols[0], "--start", "2099-01-01T00:00:00")
    # no origin after --start: nothing is written, and the link is left as it was
    assert done.returncode == 2 and latest.is_symlink(), done.stderr
    done = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", latest, "--threads", "1",
                 "--symbols", tiny_model.meta.symbols[0])
    assert done.returncode == 0, done.stderr
    assert f"note: {latest} is a link to {monday}; it becomes a file of its own" in done.stderr, done.stderr
    assert not latest.is_symlink() and pq.read_table(latest).num_rows > 0
    assert monday.read_bytes() == kept


def test_the_scorer_never_imports_torch() -> None:
    r = subprocess.run([sys.executable, "-c", "import sys, serving.score; print('torch' in sys.modules)"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_a_symbol_named_twice_is_scored_once_and_an_offset_is_read_as_such(tiny_model: Model,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    es = tiny_model.bars.timestamp_ns[tiny_model.bars.series_slices()["ES"]]
    start = es[tiny_model.meta.bars_required + 5]
    local = np.datetime64(int(start) + 3_600_000_000_000, "ns").astype("datetime64[s]").item()  # 1 h ahead
    out = tmp_path / "es.PARQUET"
    done = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", out, "--symbols", "ES,ES",
                 "--start", local.isoformat() + "+01:00")
    assert done.returncode == 0, done.stderr
    origins = pq.read_table(out)["origin"].cast(pa.int64()).to_numpy()
    assert origins[0] == start and (np.diff(origins) >= 0).all()  # one series, in time order
    assert np.unique(origins).size == es[es >= start].size
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~umask())  # as any file the user writes


def test_symbols_the_model_cannot_forecast_are_skipped_with_a_warning(tiny_model: Model,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    bars = pq.read_table(tiny_model.bars_path)
    sym = bars["symbol"].to_numpy(zero_copy_only=False)
    es, nq = np.flatnonzero(sym == "ES"), np.flatnonzero(sym == "NQ")
    cl = bars.take(pa.array(es[:50])).set_column(bars.schema.get_field_index("symbol"), "symbol",
                                                 pa.array(["CL"] * 50))
    mixed = pa.concat_tables([bars.take(pa.array(es)), bars.take(pa.array(nq[-30:])), cl])
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "mixed.parquet", "--out", tmp_path / "f.parquet")
    assert done.returncode == 0, done.stderr
    assert "skipped CL: not one of the model's symbols (ES, NQ)" in done.stderr
    assert "skipped NQ: 30 bars, a forecast needs 40" in done.stderr
    assert set(pq.read_table(tmp_path / "f.parquet")["symbol"].to_pylist()) == {"ES"}
    close = bars["close"].to_numpy().copy()
    close[nq[5]] = np.nan  # a bad NQ bar stops a backtest of NQ, not one of ES alone
    pq.write_table(bars.set_column(bars.schema.get_field_index("close"), "close", pa.array(close)),
                   tmp_path / "nan.parquet")
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "nan.parquet", "--out", tmp_path / "es.parquet",
                 "--symbols", "ES")
    assert done.returncode == 0 and set(pq.read_table(tmp_path / "es.parquet")["symbol"].to_pylist()) == {"ES"}
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "nan.parquet", "--out", tmp_path / "all.parquet")
    assert done.returncode == 2 and f"column 'close', row {nq[5]}: close is NaN" in done.stderr, done.stderr
    # one market's bars without a symbol column: one series, whose name --default-symbol gives
    one = tmp_path / "es_only.parquet"
    pq.write_table(bars.take(pa.array(es)).drop_columns(["symbol"]), one)
    done = score("--model", tiny_model.model, "--parquet", one, "--out", tmp_path / "n.parquet")
    assert done.returncode == 2 and ("holds none of the model's symbols (ES, NQ); it holds SERIES; a file without a "
                                     "'symbol' column is one series, named by --default-symbol: give --default-symbol "
                                     "ES (or another of the model's symbols)") in done.stderr, done.stderr
    done = score("--model", tiny_model.model, "--parquet", one, "--out", tmp_path / "n.parquet",
                 "--default-symbol", "ES")
    assert done.returncode == 0 and set(pq.read_table(tmp_path / "n.parquet")["symbol"].to_pylist()) == {"ES"}


@pytest.mark.parametrize(("gap_s", "why", "none_left"), [
    (20, r"mostly closer than half the model's bar interval of 1min \(finer bars, or another time unit\)",
     "every window's bars are mostly closer than half the model's bar interval of 1min"),
    (86_400, r"daily bars \(mostly a day or more apart, at one or two times of day\) and the model's are 1min bars",
     "every window's bars are daily bars, and the model's are 1min bars"),
], ids=["finer", "daily"])
def test_windows_the_server_refuses_for_their_bar_size_are_skipped(
        tiny_model: Model, tmp_path: Path, gap_s: int, why: str, none_left: str) -> None:  # noqa: F811
    """20-second bars, or daily bars, to a 1-minute model would be read as the model's bars: the server refuses a
    request whose bars are mostly closer than half the model's interval, or daily bars to an intraday model, so
    a backtest skips exactly the origins whose windows are (by the server's own verdict on each window)."""
    from serving.errors import RequestError
    from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
    from serving.validation import parse_request
    from serving.wire import make_series

    bars = pq.read_table(tiny_model.bars_path)
    sym = bars["symbol"].to_numpy(zero_copy_only=False)
    nq = bars.take(pa.array(np.flatnonzero(sym == "NQ")))
    n, need = nq.num_rows, tiny_model.meta.bars_required
    start = int(nq["timestamp"].cast(pa.int64())[0].as_py())
    gaps = np.where(np.arange(n) < n // 2, gap_s, 60) * 10**9  # other bars, then the model's 1 min bars
    other = nq.set_column(nq.schema.get_field_index("timestamp"), "timestamp",
                          pa.array(start + np.concatenate([[0], np.cumsum(gaps[1:])]), pa.int64())).cast(bars.schema)
    pq.write_table(pa.concat_tables([bars.take(pa.array(np.flatnonzero(sym == "ES"))), other]),
                   tmp_path / "mixed.parquet")
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "mixed.parquet", "--out", tmp_path / "f.parquet")
    assert done.returncode == 0, done.stderr
    assert re.search(r"skipped [\d,]+ origin\(s\) of NQ: their windows' bars are " + why
                     + ", which the server refuses", done.stderr), done.stderr
    table = pq.read_table(tmp_path / "f.parquet")
    scored = set(table.filter(pc.equal(table["symbol"], "NQ"))["origin"].cast(pa.int64()).to_pylist())
    assert "ES" in table["symbol"].to_pylist()
    # exactly the origins the server serves: each NQ origin's last `need` bars, sent as a request
    cols = {name: other[name].cast(pa.int64() if name == "timestamp" else pa.float64()).to_numpy()
            for name in ("timestamp", "open", "high", "low", "close", "volume")}
    served = set()
    for end in range(need, n + 1):
        series = make_series("NQ", *(cols[name][end - need:end] for name in cols))
        try:
            parse_request(pb.PredictRequest(series=[series]), tiny_model.meta)
            served.add(int(cols["timestamp"][end - 1]))
        except RequestError as exc:
            assert "apart" in str(exc), exc
    assert scored == served and 0 < len(served) < n - need + 1
    pq.write_table(other.slice(0, n // 2), tmp_path / "other.parquet")
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "other.parquet", "--out", tmp_path / "g.parquet")
    assert done.returncode == 2 and f"error: no forecast origin left: {none_left}" in done.stderr, done.stderr
    assert not (tmp_path / "g.parquet").exists()


def test_sigterm_leaves_no_partial_file(tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    """SIGTERM once the scorer says it writes: exit 130 (or 0 had it finished first), `--out` absent or whole,
    never partial, and no temporary file left, at any speed."""
    out = tmp_path / "f.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "serving.score", "--model", str(tiny_model.model), "--parquet",
                             str(tiny_model.bars_path), "--out", str(out), "--batch", "1", "--threads", "1"],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = ""
    for line in proc.stderr:  # until the scorer has its temporary file and starts writing
        err += line
        if line.startswith("scoring "):
            break
    proc.send_signal(signal.SIGTERM)
    err += proc.stderr.read()
    code = proc.wait(timeout=300)
    assert code in (130, 0), err  # 0: every window was written before the signal landed
    assert [p.name for p in tmp_path.iterdir()] in ([], ["f.parquet"]), err
    if code == 0 or out.exists():
        meta, slices = tiny_model.meta, tiny_model.bars.series_slices().values()
        whole = sum(sl.stop - sl.start - meta.bars_required + 1 for sl in slices) * meta.horizon
        assert pq.read_table(out).num_rows == whole


def test_the_throughput_benchmark_runs_both_paths(tiny_model: Model) -> None:  # noqa: F811
    r = subprocess.run([sys.executable, "-m", "benchmarks.score_throughput", "--model", str(tiny_model.model),
                        "--parquet", str(tiny_model.bars_path), "--sample", "20"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| `serving.score` (batch 64, parquet written) | 2,922 |" in r.stdout  # every origin of both symbols
    assert "| per bar: prepare + run of one | 20 |" in r.stdout and "score / per bar: " in r.stdout


def test_each_origin_is_placed_in_the_models_training_run_and_in_sample_ones_are_named(
        tiny_model: Model, scored: pa.Table, tmp_path: Path) -> None:  # noqa: F811
    import torch

    meta, bars = tiny_model.meta, tiny_model.bars
    ckpt = torch.load(tiny_model.model.parent / "ckpt.pt", weights_only=True)
    assert meta.training == {"first_bar_ns": int(bars.timestamp_ns.min()), "last_bar_ns": int(bars.timestamp_ns.max()),
                             "validation_from_ns": int(ckpt["split_times_ns"][0]), "test_from_ns": None}
    origin = scored["origin"].cast(pa.int64()).to_numpy()
    want = np.where(origin >= meta.training["validation_from_ns"], "validation", "train")
    assert scored["split"].to_pylist() == want.tolist()
    # the warning names the in-sample origins; the bars are the run's own, so no --start can leave them out: it
    # says where bars the model has not seen begin
    done = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", tmp_path / "f.parquet",
                 "--symbols", "ES")
    m = re.search(r"([\d,]+) origin\(s\) lie in the bars the model was trained or chosen on .* "
                  r"these bars end by (\S+ \S+) UTC, the run's last bar: score bars that go on past it", done.stderr)
    assert done.returncode == 0 and m, done.stderr
    assert int(m.group(1).replace(",", "")) == scored.num_rows // meta.horizon // 2  # every ES origin
    refused = score("--model", tiny_model.model, "--parquet", tiny_model.bars_path, "--out", tmp_path / "g.parquet",
                    "--start", m.group(2).replace(" ", "T") + ".000001")
    assert refused.returncode == 2 and "no forecast origin" in refused.stderr  # no origin after the training bars
    # the same bars moved past the training run: every origin is "after", and nothing is called in-sample
    table = pq.read_table(tiny_model.bars_path)
    shift = (int(bars.timestamp_ns.max()) - int(bars.timestamp_ns.min())) // 86_400_000_000_000 + 7  # whole days
    ts = table.column("timestamp")
    moved = pc.add(ts.cast(pa.int64()), shift * 86_400_000_000_000).cast(ts.type)
    pq.write_table(table.set_column(table.schema.get_field_index("timestamp"), "timestamp", moved),
                   tmp_path / "later.parquet")
    done = score("--model", tiny_model.model, "--parquet", tmp_path / "later.parquet", "--out", tmp_path / "h.parquet")
    assert done.returncode == 0 and "in-sample" not in done.stderr, done.stderr
    assert set(pq.read_table(tmp_path / "h.parquet")["split"].to_pylist()) == {"after"}
    assert "after origins (2,922)" in done.stderr


def test_the_training_span_of_a_checkpoint_places_origins() -> None:
    from features.model_meta import training_span
    from serving.score import SPLITS, split_of

    new = training_span({"split_times_ns": [10, 20], "data_span_ns": [1, 30], "train_config": {"test_fraction": 0.1}})
    assert new == {"first_bar_ns": 1, "validation_from_ns": 10, "test_from_ns": 20, "last_bar_ns": 30}
    origins = np.array([0, 1, 9, 10, 19, 20, 30, 31])
    assert [SPLITS[i] for i in split_of(origins, new)] == ["before", "train", "train", "validation", "validation",
                                                            "test", "test", "after"]
    untested = training_span({"split_times_ns": [10, 31], "data_span_ns": [1, 30],
                              "train_config": {"test_fraction": 0.0}})
    assert untested["test_from_ns"] is None
    assert [SPLITS[i] for i in split_of(origins, untested)][-2:] == ["validation", "after"]


TRAINING_REFUSED = ("'foxhunt.training'", "training must map")


@pytest.mark.parametrize(("key", "value", "messages"), [
    ("training", '{"validation_from_ns": "2024"}', TRAINING_REFUSED),
    ("training", "[1, 2]", TRAINING_REFUSED),
    ("training", "not json", TRAINING_REFUSED),
    ("training", '{"first_bar_ns": 1, "validation_from_ns": 2.5, "test_from_ns": null, "last_bar_ns": 3}',
     TRAINING_REFUSED),
    # the training bars' column names and time unit, which the scorer reads bars with
    ("column_map", '{"time_unit": "fortnights"}', ("column_map: time unit 'fortnights': expected one of s, ms",)),
    ("column_map", '{"colour": "red"}', ("column_map: ",)),
])
def test_tampered_training_metadata_is_refused_by_name(key: str, value: str, messages: tuple[str, ...],
                                                         tiny_model: Model, tmp_path: Path) -> None:  # noqa: F811
    import onnx

    proto = onnx.load(str(tiny_model.model))
    for p in proto.metadata_props:
        if p.key == f"foxhunt.{key}":
            p.value = value
    bad = tmp_path / "bad.onnx"
    onnx.save(proto, str(bad))
    done = score("--model", bad, "--parquet", tiny_model.bars_path, "--out", tmp_path / "f.parquet")
    assert done.returncode == 2, done.stderr
    assert any(m in done.stderr for m in messages), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "f.parquet").exists()


def test_the_hint_keeps_a_test_split_and_the_span_is_checked_value_by_value() -> None:
    from features.model_meta import _span_ok
    from serving.score import out_of_sample_hint, parse_time

    tested = {"first_bar_ns": 1, "validation_from_ns": 10, "test_from_ns": 1_704_873_000_000_000_500,
              "last_bar_ns": 1_704_999_999_000_000_000}
    later = 1_705_000_000_000_000_000  # the scored bars go on past the run's
    hint = out_of_sample_hint(tested, later)  # the test split is out of sample: the hint starts there, not after
    assert hint == "--start 2024-01-10T07:50:00.000001Z keeps only the test and after origins"
    assert parse_time(hint.split()[1], "--start") == 1_704_873_000_000_001_000  # the first µs at or after it
    untested = dict(tested, test_from_ns=None)
    assert out_of_sample_hint(untested, later) == "--start 2024-01-11T19:06:39.000001Z keeps only the after origins"
    assert out_of_sample_hint(dict(untested, last_bar_ns=None), later) == "the split column marks them"
    # the run's own bars scored again: no --start keeps an origin, so none is offered
    own = out_of_sample_hint(untested, tested["last_bar_ns"])
    assert own == ("these bars end by 2024-01-11 19:06:39 UTC, the run's last bar: score bars that go on past it for "
                   "forecasts the model has not seen (the run neither trained nor chose on those)")
    assert out_of_sample_hint(tested, tested["test_from_ns"] - 1).startswith(
        "these bars end before 2024-01-10 07:50:00.0000005 UTC, where the run's test split begins: ")
    assert _span_ok(tested) and _span_ok(untested)
    changes: list[dict[str, object]] = [
        {"validation_from_ns": "10"}, {"last_bar_ns": 1.5e18}, {"first_bar_ns": True}, {"validation_from_ns": [10]},
        {"last_bar_ns": 2**70}, {"first_bar_ns": 11}, {"validation_from_ns": None}]
    for bad in [{**tested, **c} for c in changes] + [{k: v for k, v in tested.items() if k != "first_bar_ns"}]:
        assert not _span_ok(bad), bad


def test_the_summary_gives_coverage_of_an_interval_and_none_for_one_quantile() -> None:
    """The outer band [q_first, q_last] of a model with one quantile is a point: its coverage is n/a (as the
    trainer's epoch log says), not 0% of a nominal 0%."""
    from types import SimpleNamespace
    from typing import cast

    from features.compute import FeatureFrame
    from serving.score import Summary

    targets = np.array([[0.0], [0.2], [-0.3], [np.nan]], dtype=np.float32)  # [rows, H=1]; the last past the file
    frame = cast(FeatureFrame, SimpleNamespace(series_id=np.zeros(4, np.int64), symbols=["ES"], targets=targets))
    anchors, split = np.arange(4), np.full(4, -1)
    for quantiles, forecast, expected in (
            ((0.1, 0.5, 0.9), [-0.25, 0.0, 0.25],
             "realised return inside [q0.1, q0.9] 66.7% of the time (nominal 80%)"),
            ((0.5,), [0.0], "coverage n/a (one quantile: no interval)")):
        summary = Summary(quantiles)
        summary.add(frame, anchors, np.broadcast_to(np.array(forecast), (4, 1, len(quantiles))), split)
        [line] = [ln for ln in summary.lines() if ln.startswith("all origins")]
        assert line.startswith("all origins: 3 forecasts with their future in the file") and expected in line, line


@pytest.fixture(scope="module")
def indicator_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny model with one user column (f000, an indicator), trained and exported by the commands' mains."""
    from features.bars import read_bars
    from features.model_meta import ModelMeta
    from tests.artifacts import TINY_TRAIN_FLAGS, run_main

    work = tmp_path_factory.mktemp("indicator")
    r = run_main(["-m", "features.synth", "--out", str(work / "bars.parquet"), "--symbols", "ES,NQ", "--bars", "800",
                  "--seed", "5", "--extra-features", "1"])
    assert r.returncode == 0, r.stderr
    r = run_main(["-m", "trainer", "--parquet", str(work / "bars.parquet"), "--out", str(work / "ckpt.pt"),
                  "--features", "f000", *TINY_TRAIN_FLAGS])
    assert r.returncode == 0, r.stderr[-3000:]
    model = work / "model.onnx"
    r = run_main(["-m", "export", str(work / "ckpt.pt"), str(model), "--threads", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    meta = ModelMeta.from_props({p.key: p.value for p in onnx.load(str(model)).metadata_props})
    return Model(work / "bars.parquet", model, meta, read_bars(work / "bars.parquet", user_columns=("f000",)))


def test_an_indicators_warm_up_nan_stops_only_the_forecasts_that_read_it(
        indicator_model: Model, tmp_path: Path) -> None:
    """An indicator column starts with NaN while it warms up (a 30-bar average's first 29 rows). The server
    refuses a request whose bars hold one; the client, which sends the latest bars, still forecasts, and
    serving.score skips exactly the origins whose windows hold one, as the server refuses them."""
    from tests.live_server import LiveServer

    m = indicator_model
    table = pq.read_table(m.bars_path)
    es = np.flatnonzero(table["symbol"].to_numpy(zero_copy_only=False) == "ES")
    f000 = table["f000"].to_numpy().copy()
    f000[es[:30]] = np.nan  # ES's first 30 rows
    warm = tmp_path / "warm.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("f000"), "f000", pa.array(f000)), warm)
    done = score("--model", m.model, "--parquet", warm, "--out", tmp_path / "f.parquet", "--threads", "1")
    assert done.returncode == 0, done.stderr
    need = m.meta.bars_required
    # the origins at ES rows need - 1 .. 28 + need read a NaN (their windows start at rows 0 .. 29): 30 of them
    assert "skipped 30 origin(s) of ES: their windows' user feature values include NaN" in done.stderr, \
        done.stderr
    out = pq.read_table(tmp_path / "f.parquet")
    origins = np.unique(out.filter(pc.equal(out["symbol"], "ES"))["origin"].cast(pa.int64()).to_numpy())
    ts = table["timestamp"].cast(pa.int64()).to_numpy()[es]
    np.testing.assert_array_equal(origins, ts[30 + need - 1:])  # the first window without a NaN ends there
    server = LiveServer(m.model, tmp_path / "server.log")
    try:
        server.wait_serving()
        r = subprocess.run([sys.executable, "-m", "serving.client", "--target", server.target, "--parquet", str(warm),
                            "--symbol", "ES"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.startswith("ES  model "), r.stderr
        f000[es[-5]] = np.inf  # a bar the forecast sends
        pq.write_table(table.set_column(table.schema.get_field_index("f000"), "f000", pa.array(f000)), warm)
        r = subprocess.run([sys.executable, "-m", "serving.client", "--target", server.target, "--parquet", str(warm),
                            "--symbol", "ES"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and (f"user feature column(s) f000 NaN, infinite or past float32's range in 1 of "
                                      f"the latest {need} ES bars") in r.stderr, r.stderr
    finally:
        server.kill()
