"""Every field of Series and PredictRequest mutated, on three real models: bars only, every covariate role (observed,
known, static; real and categorical), and per-contract futures bars.

For each model one real `python -m serving` subprocess (--threads 1, --max-message-bytes 8 MiB, so that the
largest hostile requests reach the server) takes a CI-sized sample of tests.request_fuzz's mutants, one at a time,
after 20 well-formed calls of warm-up. What a hardened server shows after them: no INTERNAL and no UNKNOWN answer,
health SERVING, 20 well-formed calls all OK, no ERROR line and no traceback in its log, and a peak RSS (its
high-water mark from the end of warm-up, and the RSS after every call) at most 1.5x its RSS after warm-up.
`python -m benchmarks.fuzz_fields` runs the same with 2,000 or more mutants per model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import DecodeError

from serving.gen.foxhunt.tft.v1 import forecaster_pb2 as pb
from tests.live_server import LiveServer, contracts_model, covariates_model, tiny_model  # noqa: F401  (fixtures)
from tests.request_fuzz import (
    MAX_MESSAGE,
    OPS,
    Answer,
    Mutant,
    Report,
    Target,
    contracts_target,
    covariates_target,
    fuzz,
    run_mutants,
    shapes,
    tiny_target,
)
from tests.test_serving_covariates import META, series_at, unit_bars

EXAMPLES = 200  # per model: the benchmark sends 2,000

TARGETS: dict[str, tuple[str, Callable[[Any], Target]]] = {
    "tiny": ("tiny_model", tiny_target),
    "covariates": ("covariates_model", covariates_target),
    "contracts": ("contracts_model", contracts_target),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TARGETS))
def test_every_field_mutated_leaves_the_server_serving(name: str, request: pytest.FixtureRequest,
                                                       tmp_path: Path) -> None:
    fixture, make = TARGETS[name]
    target = make(request.getfixturevalue(fixture))
    server = LiveServer(target.model, tmp_path / "server.log", "--max-message-bytes", str(MAX_MESSAGE))
    try:
        server.wait_serving()
        report = fuzz(server, target, EXAMPLES)
    finally:
        server.kill()
    print("\n" + report.describe())
    assert report.sent >= EXAMPLES * 0.9 or report.ended, report.describe()
    assert report.codes["OK"] and report.codes["INVALID_ARGUMENT"], report.describe()  # both sides were reached
    assert set(report.by_op) >= set(OPS), report.describe()
    assert report.failures() == [], report.describe()


def _unit_target() -> Target:
    """The unit model of the covariates tests (no model file): enough to draw mutants."""
    base = pb.PredictRequest(series=[series_at(unit_bars(), "ES", 20)])
    return Target("unit", Path("unused"), META, (base,), base, ("calm", "wild"))


def test_mutants_are_the_same_on_every_run() -> None:
    target = _unit_target()

    def draw() -> list[bytes]:
        out: list[bytes] = []
        for op in OPS:
            run_mutants(target, (op,), 3, lambda m: out.append(m.data()))
        return out

    first = draw()
    assert len(first) >= 3 * len(OPS) and len(set(first)) > len(OPS)
    assert draw() == first
    assert [m.data() for m in shapes(target)] == [m.data() for m in shapes(target)]


def test_strings_that_are_no_utf8_reach_the_wire() -> None:
    mutant = Mutant(("not_utf8",), pb.PredictRequest(series=[pb.Series(symbol="\x0e\x10\x0f")]),
                    [(b"\x0e\x10\x0f", b"\xff\xfe\xfd")])
    assert b"\xff\xfe\xfd" in mutant.data()
    with pytest.raises(DecodeError):
        pb.PredictRequest.FromString(mutant.data())


def test_a_report_names_each_way_a_run_falls_short() -> None:
    good = Report("m", sent=10, rss_warm_kib=100_000, rss_peak_kib=150_000, health="SERVING", after_ok=20)
    assert good.failures() == []
    bad = Report("m", sent=10, rss_warm_kib=100_000, rss_peak_kib=150_001, health="NOT_SERVING", after_ok=19,
                 log_problems=["2025-01-01 00:00:00,000 ERROR serving answered INTERNAL: MemoryError"],
                 ended="the server exited -9 after long_label")
    bad.codes.update({"INTERNAL": 2, "UNKNOWN": 1, "OK": 7})
    bad.never.append(Answer("INTERNAL", ("long_label",), "internal error (MemoryError)", 0.5))
    failures = bad.failures()
    assert failures[:2] == ["2 INTERNAL answer(s)", "1 UNKNOWN answer(s)"]
    assert len(failures) == 7, failures
    assert "1.50x" in failures[-1] and "long_label" in bad.describe()
