"""The most work one request can ask of a server within its limits: a per-contract series filling the message
with valid bars spread over every contract name of one root (12 months x 100 two-digit years), so that each
contract's bars are checked on their own and the roll rule orders 1,200 contracts. Shared by the test that sends
it beside well-formed calls and by `benchmarks.worst_request`."""

from __future__ import annotations

import numpy as np

from features.contracts import MONTH_CODES
from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from serving.wire import make_series

BAR_BYTES = 58  # a bar on the wire: a 9-byte timestamp, 5 doubles and a 6-byte contract name with its tag
START_NS = int(np.datetime64("2025-03-03T00:00", "ns").astype(np.int64))
MINUTE = 60_000_000_000


def crowded_contracts_series(root: str, max_bytes: int) -> pb.Series:
    """Valid one-minute bars of `root`'s 1,200 contracts, one contract after another in turn, as many as fit in
    `max_bytes` with room for the message's other fields."""
    names = [f"{root}{m}{y:02d}" for y in range(100) for m in MONTH_CODES]
    n = (max_bytes - 4096) // BAR_BYTES
    rng = np.random.default_rng(0)
    close = 5000 * np.exp(np.cumsum(rng.normal(0, 1e-4, n)))
    open_ = np.concatenate([close[:1], close[:-1]])
    return make_series(root, START_NS + MINUTE * np.arange(n, dtype=np.int64), open_, np.maximum(open_, close) + 0.25,
                       np.minimum(open_, close) - 0.25, close, rng.uniform(1, 100, n),
                       contracts=[names[k % len(names)] for k in range(n)])


def crowded_contracts_request(root: str, max_bytes: int) -> pb.PredictRequest:
    request = pb.PredictRequest(series=[crowded_contracts_series(root, max_bytes)])
    assert request.ByteSize() <= max_bytes, request.ByteSize()
    return request
