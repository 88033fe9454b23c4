"""One micro-batch on the inference thread: the features of every series at once, one model run.
One call never fails another: a call whose features or outputs are not finite gets its own RequestError,
and if the batch fails as a whole, each call runs alone."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from features.model_meta import ModelMeta
from serving.errors import RequestError
from serving.metrics import StepTimes
from serving.model import LoadedModel
from serving.preprocess import Prepared, nonfinite_output_problem, nonfinite_problem, prepare
from serving.validation import SeriesColumns

log = logging.getLogger("serving")


@dataclass
class Result:
    """One call's windows and the model's outputs for them, row-aligned."""

    prepared: Prepared
    outputs: dict[str, np.ndarray]  # output name -> [n, ...]


def run_batch(model: LoadedModel, calls: Sequence[Sequence[SeriesColumns]], steps: StepTimes | None = None
              ) -> list[Result | Exception]:
    """Per call, in order: its Result, or the RequestError that says what to fix in it; step times go to `steps`."""
    steps = steps or StepTimes()
    try:
        return _run_together(model, calls, steps)
    except Exception:
        if len(calls) == 1:
            raise
        log.exception("a batch of %d calls failed; running each alone so that only the one at fault fails",
                      len(calls))
    results: list[Result | Exception] = []
    for call in calls:
        try:
            results.append(_run_together(model, [call], steps)[0])
        except Exception as exc:
            results.append(exc)
    return results


def _nonfinite_output(outputs: dict[str, np.ndarray], prepared: Prepared, call: Sequence[SeriesColumns],
                      meta: ModelMeta) -> RequestError | None:
    """An error, never a NaN or infinite forecast, for a call whose bars drive the model out of range."""
    for name, out in outputs.items():
        bad = ~np.isfinite(out.reshape(out.shape[0], -1)).all(axis=1)  # [n]
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            return nonfinite_output_problem(prepared, b, call[b], name, meta)
    return None


def _finite(arrays: dict[str, np.ndarray]) -> bool:
    return all(bool(np.isfinite(a).all()) for a in arrays.values())


def _run_together(model: LoadedModel, calls: Sequence[Sequence[SeriesColumns]], steps: StepTimes
                  ) -> list[Result | Exception]:
    start = time.perf_counter()
    sizes = [len(c) for c in calls]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    prepared = prepare([s for c in calls for s in c], model.meta)
    per_call = [prepared.rows(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
    # the batch is checked as a whole; only when something is not finite is it traced to its call
    problems: list[RequestError | None] = [None] * len(calls)
    if not _finite(prepared.inputs):
        problems = [nonfinite_problem(p, c, model.meta) for p, c in zip(per_call, calls, strict=True)]
    good = [i for i, p in enumerate(problems) if p is None]
    results: list[Result | Exception] = [p if p is not None else Exception() for p in problems]
    inputs = prepared.inputs
    if good and len(good) < len(calls):  # leave the bad calls' rows out of the run
        rows = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in good])
        inputs = {k: v[rows] for k, v in inputs.items()}
    ran = time.perf_counter()
    steps.add("features", ran - start)
    if not good:
        return results
    outputs = model.run(inputs)
    steps.add("run", time.perf_counter() - ran)
    all_finite = _finite(outputs)
    offset = 0
    for i in good:
        n = sizes[i]
        mine = {k: v[offset:offset + n] for k, v in outputs.items()}
        problem = None if all_finite else _nonfinite_output(mine, per_call[i], calls[i], model.meta)
        results[i] = problem or Result(per_call[i], mine)
        offset += n
    return results
