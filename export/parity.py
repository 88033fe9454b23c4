"""Parity: ONNX Runtime against PyTorch eager on real windows and random batches of 1, 7 and 64.

Per output over the batch: max abs err, max rel err (abs / max |torch|) and the scaled err the
gate compares with the tolerance: for quantiles |onnx - torch| / target_scale[h] (units of the
target's std, whatever the asset's volatility); weights as they are. A shape mismatch or a
non-finite value fails whatever the tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from export.onnx_export import input_names
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, QUANTILES, STATIC_CATEGORICAL, STATIC_REAL
from trainer.modeling import TemporalFusionTransformer

TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}  # on the scaled error
RANDOM_BATCHES = (1, 7, 64)
NOISE = 0.5  # random batches: real windows resampled, plus this many feature stds of Gaussian noise


@dataclass(frozen=True)
class Case:
    name: str
    inputs: dict[str, np.ndarray]  # canonical input name -> array with a leading batch axis, in the model's order

    @property
    def batch(self) -> int:
        return int(self.inputs[STATIC_CATEGORICAL].shape[0])


@dataclass(frozen=True)
class Row:
    case: str
    batch: int
    output: str
    max_abs: float
    max_rel: float
    scaled: float
    tolerance: float
    passed: bool
    note: str = ""


@dataclass
class ParityReport:
    precision: str
    provider: str
    tolerance: float
    rows: list[Row] = field(default_factory=list)
    provider_options: dict[str, str] = field(default_factory=dict)  # what the checked session was given
    real_windows: str = ""  # where the "real windows" case came from: the checkpoint's sample, or --bars
    inputs: list[str] = field(default_factory=list)  # the model inputs every case feeds

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        worst = max((r.scaled for r in self.rows), default=float("nan"))
        return {"passed": self.passed, "precision": self.precision, "provider": self.provider,
                "provider_options": self.provider_options, "tolerance": self.tolerance, "max_scaled_error": worst,
                "real_windows": self.real_windows, "inputs": self.inputs,
                "scaled_error": "quantiles: |onnx - torch| / target_scale[h]; weights: |onnx - torch|",
                "rows": [asdict(r) for r in self.rows]}

    def table(self) -> str:
        head = (f"parity: ONNX Runtime ({self.provider}) vs PyTorch eager (CPU, fp32); model {self.precision}, "
                f"tolerance {self.tolerance:g} on the scaled error; every case feeds {', '.join(self.inputs)}")
        cols = f"{'case':<22} {'batch':>5}  {'output':<16} {'max abs err':>11}  {'max rel err':>11}  " \
               f"{'scaled err':>10}  {'tolerance':>9}  pass"
        rows = [f"{r.case:<22} {r.batch:>5}  {r.output:<16} {r.max_abs:>11.2e}  {r.max_rel:>11.2e}  {r.scaled:>10.2e}  "
                f"{r.tolerance:>9.0e}  {'yes' if r.passed else 'NO'}{'  ' + r.note if r.note else ''}"
                for r in self.rows]
        return "\n".join([head, cols, "-" * len(cols), *rows, f"parity {'passed' if self.passed else 'FAILED'}: "
                          f"{len(self.rows) - len(self.failures())}/{len(self.rows)} rows within tolerance"])


def make_cases(windows: Mapping[str, Tensor | np.ndarray], model: TemporalFusionTransformer,
               batches: Sequence[int] = RANDOM_BATCHES, seed: int = 0) -> list[Case]:
    """Real windows, then random batches: real windows resampled with noise on the reals, random category ids."""
    real = {name: np.ascontiguousarray(np.asarray(windows[name])) for name in input_names(model.cfg)}
    rng = np.random.default_rng(seed)
    return [Case("real windows", real), *(Case(f"random batch {b}", _random_batch(real, model, b, rng))
                                          for b in batches)]


def _random_batch(real: dict[str, np.ndarray], model: TemporalFusionTransformer, b: int, rng: np.random.Generator
                  ) -> dict[str, np.ndarray]:
    """`b` real windows drawn with replacement: reals plus NOISE stds of Gaussian noise; every categorical column
    (the static ids, the last columns of the time-varying inputs) redrawn uniformly from its vocabulary."""
    cfg = model.cfg
    idx = rng.integers(0, real[STATIC_CATEGORICAL].shape[0], size=b)

    def noisy(name: str, std: Tensor, cards: tuple[int, ...] = ()) -> np.ndarray:
        x = real[name][idx]  # [b, ..., V]
        x = (x + NOISE * std.detach().cpu().numpy() * rng.standard_normal(x.shape)).astype(np.float32)
        if cards:  # ids as exact integers, one column per categorical variable
            x[..., x.shape[-1] - len(cards):] = random_ids(rng, x.shape[:-1], cards)  # exact in float32
        return x

    out = {
        STATIC_CATEGORICAL: random_ids(rng, (b,), cfg.static_cardinalities),  # [b, n_static]
        ENCODER_OBSERVED: noisy(ENCODER_OBSERVED, model.observed_std, cfg.observed_cardinalities),  # [b, L, n_obs]
        ENCODER_KNOWN: noisy(ENCODER_KNOWN, model.known_std, cfg.known_cardinalities),  # [b, L, n_known]
        DECODER_KNOWN: noisy(DECODER_KNOWN, model.known_std, cfg.known_cardinalities),  # [b, H, n_known]
    }
    if cfg.n_static_real:
        out[STATIC_REAL] = noisy(STATIC_REAL, model.static_std)  # [b, n_static_real]
    return out


def random_ids(rng: np.random.Generator, shape: tuple[int, ...], cardinalities: Sequence[int]) -> np.ndarray:
    """int64 [*shape, len(cardinalities)]: ids drawn uniformly from [0, cardinality) of each column."""
    cards = np.asarray(cardinalities, dtype=np.int64)
    return rng.integers(0, 1 << 30, size=(*shape, cards.size)) % cards


def reference_outputs(model: nn.Module, case: Case, explain: bool) -> list[np.ndarray]:
    """PyTorch eager, fp32, CPU: the truth the ONNX model must reproduce."""
    with torch.inference_mode():
        out = model(*(torch.from_numpy(x) for x in case.inputs.values()))
    tensors = list(out) if explain else [out.quantiles]
    return [t.detach().cpu().float().numpy() for t in tensors]


def compare(case: Case, names: Sequence[str], expected: Sequence[np.ndarray], got: Sequence[np.ndarray],
            target_scale: np.ndarray, tolerance: float) -> list[Row]:
    rows = []
    for name, e, g in zip(names, expected, got, strict=True):
        if g.shape != e.shape:
            rows.append(Row(case.name, case.batch, name, float("inf"), float("inf"), float("inf"), tolerance, False,
                            f"shape {list(g.shape)} != torch {list(e.shape)}"))
            continue
        if not (np.isfinite(g).all() and np.isfinite(e).all()):
            rows.append(Row(case.name, case.batch, name, float("nan"), float("nan"), float("nan"), tolerance, False,
                            f"non-finite values (onnx {int((~np.isfinite(g)).sum())}, "
                            f"torch {int((~np.isfinite(e)).sum())})"))
            continue
        diff = np.abs(g.astype(np.float64) - e.astype(np.float64))
        scaled = diff / target_scale[None, :, None] if name == QUANTILES else diff
        max_abs = float(diff.max(initial=0.0))
        max_rel = max_abs / max(float(np.abs(e).max(initial=0.0)), float(np.finfo(np.float32).tiny))
        worst = float(scaled.max(initial=0.0))
        rows.append(Row(case.name, case.batch, name, max_abs, max_rel, worst, tolerance, worst <= tolerance))
    return rows


def check_parity(model: TemporalFusionTransformer, reference: nn.Module, session: Any, cases: Sequence[Case],
                 precision: str) -> ParityReport:
    """ONNX Runtime's `session` against `reference`, the module exported (`model` or its CalibratedModel)."""
    names = [o.name for o in session.get_outputs()]
    tolerance = TOLERANCE[precision]
    target_scale = model.target_scale.detach().cpu().numpy().astype(np.float64)
    report = ParityReport(precision, session.get_providers()[0], tolerance, inputs=list(cases[0].inputs))
    for case in cases:
        expected = reference_outputs(reference, case, explain=len(names) > 1)
        report.rows.extend(compare(case, names, expected, session.run(names, case.inputs), target_scale, tolerance))
    return report
