"""Shared fixtures: real parquet files written with pyarrow (no pandas)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from features.synth import generate

SAMPLE_SYMBOLS = ("ES", "NQ")
SAMPLE_BARS = 3000  # per symbol: about 7.7 sessions of 390 one-minute bars


def write_parquet(path: Path, columns: Mapping[str, Sequence[Any] | np.ndarray | pa.Array]) -> Path:
    """Write a dict of columns (lists, numpy arrays or arrow arrays) to `path` as parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: v if isinstance(v, pa.Array | pa.ChunkedArray) else pa.array(v) for k, v in columns.items()}
    pq.write_table(pa.table(arrays), path)
    return path


@pytest.fixture(scope="session")
def sample_bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real sample parquet file: 2 symbols x 3000 one-minute bars from features.synth, seed 7."""
    path = tmp_path_factory.mktemp("sample") / "bars.parquet"
    pq.write_table(generate(list(SAMPLE_SYMBOLS), SAMPLE_BARS, seed=7), path)
    return path
