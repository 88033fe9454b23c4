"""Databento's DBN files (`.dbn`, `.dbn.zst`) as bar tables, read by databento-dbn's own transcoder.

A file of an ohlcv schema becomes the columns Databento's parquet and `to_df()` give: ts_event (UTC), rtype,
publisher_id, instrument_id, open, high, low, close (decimal prices, Databento's `pretty_px`), volume, and each
instrument's raw symbol from the file's symbology (`symbol`). The column flags map them as for a parquet file.
"""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

DBN_SUFFIXES = (".dbn", ".dbn.zst")
BAR_SCHEMAS = ("ohlcv-1s", "ohlcv-1m", "ohlcv-1h", "ohlcv-1d", "ohlcv-eod")


class DbnFileError(Exception):
    """A DBN file that holds no bars this project reads, or that databento-dbn cannot decode."""


def is_dbn(path: Path) -> bool:
    return path.name.lower().endswith(DBN_SUFFIXES)


def read_dbn(path: Path) -> pa.Table:
    """The bars of the DBN file at `path` (zstd-compressed when it ends in .zst); DbnFileError says why not."""
    import databento_dbn as dbn

    compression = "zstd" if path.name.lower().endswith(".zst") else None
    with pa.input_stream(str(path), compression=compression) as stream:
        data = stream.read()
    try:
        metadata = dbn.Metadata.decode(data)
        schema = str(metadata.schema) if metadata.schema is not None else "mixed"
        if schema not in BAR_SCHEMAS:
            raise DbnFileError(f"its records are {schema}, not bars: give a file of an ohlcv schema "
                               f"({', '.join(BAR_SCHEMAS)})")
        if metadata.stype_in != dbn.SType.RAW_SYMBOL:
            raise DbnFileError(f"its symbols are {metadata.stype_in} symbols ({', '.join(metadata.symbols[:3])}), "
                               "not each contract's own: request the bars with stype_in raw_symbol (the contracts' "
                               "names, e.g. ESH5,ESM5)")
        text = io.BytesIO()
        transcoder = dbn.Transcoder(text, dbn.Encoding.from_str("csv"), dbn.Compression.from_str("none"),
                                    pretty_px=True, pretty_ts=False, map_symbols=True)
        transcoder.write(data)
        transcoder.finish()
    except dbn.DBNError as exc:
        raise DbnFileError(f"databento-dbn cannot decode it ({exc})") from None
    table = pacsv.read_csv(pa.py_buffer(text.getvalue()), convert_options=pacsv.ConvertOptions(
        column_types={"ts_event": pa.int64(), "symbol": pa.string(), **{p: pa.float64() for p in
                                                                          ("open", "high", "low", "close")}}))
    return table.set_column(0, "ts_event", table.column("ts_event").cast(pa.timestamp("ns", tz="UTC")))
