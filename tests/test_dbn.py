"""Databento's DBN files as bars: written by databento-dbn, read by every command as the same bars in parquet."""

from __future__ import annotations

import datetime as dt
import io
from pathlib import Path
from types import SimpleNamespace

import databento_dbn as dbn
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from features.bars import BarDataError, ColumnMap, read_bars
from tests.artifacts import run_main
from tests.test_trainer_contracts import FLAGS, contract_bars
from trainer.checkpoint import load_checkpoint

PRICE_SCALE = 10**9  # DBN prices are fixed-point integers of 1e-9


def write_dbn(path: Path, table: pa.Table, schema: str = "ohlcv-1m", stype_in: str = "raw_symbol") -> Path:
    """The bars of `table` (ts_event, symbol, open, high, low, close, volume) as a DBN file of `schema`, each
    contract an instrument mapped to its raw symbol; zstd-compressed when `path` ends in .zst."""
    ts = table.column("ts_event").cast(pa.int64()).to_numpy()
    symbols = table.column("symbol").to_pylist()
    names = sorted(set(symbols))
    days = [dt.datetime.fromtimestamp(int(t) // 10**9, dt.UTC).date() for t in (ts.min(), ts.max())]
    mappings = [SimpleNamespace(raw_symbol=name, intervals=[SimpleNamespace(
        start_date=days[0], end_date=days[1] + dt.timedelta(days=1), symbol=str(1000 + i))])
        for i, name in enumerate(names)]
    metadata = dbn.Metadata(dataset="GLBX.MDP3", start=int(ts.min()), end=int(ts.max()) + 1,
                            stype_in=dbn.SType.from_str(stype_in), stype_out=dbn.SType.INSTRUMENT_ID,
                            schema=dbn.Schema.from_str(schema), symbols=names, mappings=mappings)
    price = {p: np.round(table.column(p).to_numpy() * PRICE_SCALE).astype(np.int64)
             for p in ("open", "high", "low", "close")}
    volume = table.column("volume").to_numpy().astype(np.int64)
    rtype = int(dbn.RType.from_schema(dbn.Schema.from_str(schema)))
    records = b"".join(bytes(dbn.OHLCVMsg(rtype, 1, 1000 + names.index(s), int(t), *(int(price[p][i]) for p in price),
                                          int(volume[i]))) for i, (t, s) in enumerate(zip(ts, symbols, strict=True)))
    data = metadata.encode() + records
    if path.name.endswith(".zst"):
        out = io.BytesIO()
        transcoder = dbn.Transcoder(out, dbn.Encoding.from_str("dbn"), dbn.Compression.from_str("zstd"))
        transcoder.write(data)
        transcoder.finish()
        data = out.getvalue()
    path.write_bytes(data)
    return path


def as_decoded(table: pa.Table) -> pa.Table:
    """`table` with its prices as a DBN file gives them back: fixed-point integers of 1e-9, as decimals."""
    for name in ("open", "high", "low", "close"):
        fixed = np.round(table.column(name).to_numpy() * PRICE_SCALE).astype(np.int64)
        table = table.set_column(table.column_names.index(name), name, pa.array(fixed / PRICE_SCALE))
    return table


def test_a_dbn_file_trains_to_the_same_checkpoint_as_its_bars_in_parquet(tmp_path: Path) -> None:
    table = as_decoded(pq.read_table(contract_bars(tmp_path / "raw.parquet")))
    parquet = tmp_path / "bars.parquet"
    pq.write_table(table, parquet)
    for name in ("bars.dbn", "bars.dbn.zst"):
        write_dbn(tmp_path / name, table)
    runs = {}
    for name in ("bars.parquet", "bars.dbn.zst"):
        r = run_main(["-m", "trainer", "--parquet", str(tmp_path / name), "--out", str(tmp_path / f"{name}.pt"),
                      *FLAGS])
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = load_checkpoint(tmp_path / f"{name}.pt")
    a, b = runs.values()
    assert a["bars_digest"] == b["bars_digest"] and a["rolls"] == b["rolls"]
    assert a["model_state_sha256"] == b["model_state_sha256"]  # the same checkpoint
    # every column Databento's parquet has, the symbols raw, the times UTC
    read = read_bars(tmp_path / "bars.dbn", ColumnMap(timestamp="ts_event"))
    assert read.symbols == ["ESH5", "ESM5", "NQH5", "NQM5"] and not read.notes
    assert np.array_equal(read.close, read_bars(parquet, ColumnMap(timestamp="ts_event")).close)
    r = run_main(["-m", "features.check", str(tmp_path / "bars.dbn"), "--time-col", "ts_event"])
    assert r.returncode == 0 and "no problems found" in r.stdout, r.stderr[-2000:]
    assert "contracts: 1680 bars of 4 contract(s)" in r.stdout


@pytest.mark.parametrize(("schema", "stype_in", "says"), [
    ("trades", "raw_symbol", "its records are trades, not bars: give a file of an ohlcv schema"),
    ("ohlcv-1m", "parent", "its symbols are parent symbols"),
])
def test_a_dbn_file_of_other_records_or_parent_symbols_is_refused_by_name(tmp_path: Path, schema: str,
                                                                        stype_in: str, says: str) -> None:
    table = as_decoded(pq.read_table(contract_bars(tmp_path / "raw.parquet")))
    path = write_dbn(tmp_path / "bars.dbn", table, schema=schema, stype_in=stype_in)
    with pytest.raises(BarDataError) as exc:
        read_bars(path, ColumnMap(timestamp="ts_event"))
    assert f"{path}: cannot be read as DBN ({says}" in str(exc.value)
