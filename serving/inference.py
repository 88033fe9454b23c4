"""One micro-batch, end to end, on the inference thread: features of every series at once, one model run.

Feature computation has a fixed cost per call of `build_frame` that dwarfs its cost per
bar, so the batch computes the features of all its calls' series in one call, then runs
the model once, then splits the rows back per call. Each call's rows depend on its own
bars only, so the split equals what running the call alone gives.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serving.model import LoadedModel
from serving.preprocess import Prepared, nonfinite_problem, prepare
from serving.validation import SeriesColumns


@dataclass
class Result:
    """One call's windows and the model's outputs for them, row-aligned."""

    prepared: Prepared
    outputs: dict[str, np.ndarray]  # output name -> [n, ...]


def run_batch(model: LoadedModel, calls: Sequence[Sequence[SeriesColumns]]) -> list[Result | Exception]:
    """Per call, in order: its Result, or the RequestError that says what to fix in it."""
    sizes = [len(c) for c in calls]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    prepared = prepare([s for c in calls for s in c], model.meta)
    per_call = [prepared.rows(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
    problems = [nonfinite_problem(p, c, model.meta) for p, c in zip(per_call, calls, strict=True)]
    good = [i for i, p in enumerate(problems) if p is None]
    results: list[Result | Exception] = [p if p is not None else Exception() for p in problems]
    if not good:
        return results
    if len(good) == len(calls):
        inputs = prepared.inputs
    else:  # leave the bad calls' rows out of the run
        rows = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in good])
        inputs = {k: v[rows] for k, v in prepared.inputs.items()}
    outputs = model.run(inputs)
    offset = 0
    for i in good:
        n = sizes[i]
        results[i] = Result(per_call[i], {k: v[offset:offset + n] for k, v in outputs.items()})
        offset += n
    return results
