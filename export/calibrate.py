"""`--calibrate`: conformalised quantile regression (CQR) on the run's validation split, folded into the graph.

For each horizon step h and quantile level q, the offset is a finite-sample conformal quantile of the
validation residuals in units of the model's forecast scale s (the encoder bars' volatility, or the fixed
per-step scale): r = (y - q_hat[h, q]) / s[h], sorted ascending r_(1) <= ... <= r_(n):

    q >= 0.5: offset = r_(k), k = ceil((n + 1) q)              so P(y <= q_hat + offset) >= q
    q <  0.5: offset = r_(k), k = n + 1 - ceil((n + 1)(1 - q))  so P(y >= q_hat + offset) >= 1 - q

with k clipped to 1..n. The calibrated forecast is q_hat + offset * s with a running maximum over the
quantile axis, so the quantiles still never cross. Scaled offsets widen with the window's volatility: a
validation split in a turbulent period does not leave a calm one's intervals too wide. CalibratedModel
does this inside the exported graph: the server and `serving.score` apply it with no code of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from export.errors import UsageError
from export.onnx_export import input_names
from features.bars import BarDataError, ColumnMap
from features.config import FeatureConfig
from features.metrics import inside, quantile_coverage
from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL
from trainer.config import TrainConfig
from trainer.data import Normalization, PreparedData, ReadBars, prepare
from trainer.modeling import TemporalFusionTransformer, TFTOutput

METHOD = "cqr"  # conformalised quantile regression, one additive offset per horizon step and quantile
OFFSETS = "calibration_offsets"  # the offsets' initializer in the ONNX graph
BATCH = 1024  # validation windows per forward
OFFSET_UNITS = "the model's forecast scale of each window (TemporalFusionTransformer.forecast_scale)"
SCALE_INPUTS = (ENCODER_OBSERVED, ENCODER_KNOWN, DECODER_KNOWN, STATIC_CATEGORICAL)  # forecast_scale's inputs


def non_crossing(q: Tensor) -> Tensor:
    """Running maximum over the last (quantile) axis, unrolled: [..., Q] -> [..., Q]."""
    cols = [q[..., 0]]
    for j in range(1, q.shape[-1]):
        cols.append(torch.maximum(cols[-1], q[..., j]))
    return torch.stack(cols, dim=-1)


class CalibratedModel(nn.Module):
    """The TFT with its quantiles shifted by per-(step, quantile) offsets times its forecast scale, kept
    non-crossing: every exported graph; an uncalibrated one's offsets are zero, which leaves the TFT's
    quantiles (already non-crossing) as they are."""

    def __init__(self, model: TemporalFusionTransformer, offsets: np.ndarray) -> None:
        super().__init__()
        self.model = model
        self.register_buffer(OFFSETS, torch.as_tensor(offsets, dtype=torch.float32))  # [H, Q]

    def adjust(self, quantiles: Tensor, scale: Tensor) -> Tensor:
        """quantiles [B, H, Q], scale [B or 1, H, 1] -> [B, H, Q]."""
        offsets: Tensor = getattr(self, OFFSETS)
        return non_crossing(quantiles + offsets * scale)  # [B, H, Q]

    def forward(self, static_categorical: Tensor, encoder_observed: Tensor, encoder_known: Tensor,
                decoder_known: Tensor, static_real: Tensor | None = None) -> TFTOutput:
        out: TFTOutput = self.model(static_categorical, encoder_observed, encoder_known, decoder_known, static_real)
        scale = self.model.forecast_scale(encoder_observed, encoder_known, decoder_known,
                                          static_categorical)  # [B or 1, H, 1]
        return out._replace(quantiles=self.adjust(out.quantiles, scale))


def conformal_rank(n: int, q: float) -> int:
    """The 1-based rank of the residual taken as the offset of level `q` among `n` (see the module's docstring)."""
    eps = 1e-9  # (n + 1) q that is an integer in exact arithmetic stays that integer
    k = math.ceil((n + 1) * q - eps) if q >= 0.5 else n + 1 - math.ceil((n + 1) * (1 - q) - eps)
    return min(max(k, 1), n)


def conformal_offsets(pred: np.ndarray, target: np.ndarray, quantiles: Sequence[float], scale: np.ndarray
                      ) -> np.ndarray:
    """pred [W, H, Q], target [W, H], scale [W, H, 1] -> offsets float32 [H, Q], in units of the scale."""
    residuals = np.sort((target[..., None].astype(np.float64) - pred) / scale, axis=0)  # [W, H, Q]
    ranks = [conformal_rank(residuals.shape[0], q) for q in quantiles]
    return np.stack([residuals[k - 1, :, j] for j, k in enumerate(ranks)], axis=-1).astype(np.float32)  # [H, Q]


def coverage(pred: np.ndarray, target: np.ndarray, quantiles: Sequence[float]) -> dict[str, float]:
    """Share of targets below each quantile ("0.1": ..., a tie counting half) and inside [lowest, highest]
    ("interval"), by features.metrics."""
    levels = quantile_coverage(pred, target)  # [Q]
    return {**{f"{q:g}": float(v) for q, v in zip(quantiles, levels, strict=True)},
            "interval": float(inside(pred, target).mean())}


@dataclass(frozen=True)
class Calibration:
    offsets: np.ndarray  # float32 [H, Q], in return units
    windows: int  # validation windows fitted on
    quantiles: tuple[float, ...]
    before: dict[str, float]  # coverage() of the uncalibrated model on the validation windows
    after: dict[str, float]  # coverage() of the calibrated model on the same windows
    bars: str  # the bars the validation split was rebuilt from (logged; a local path, kept out of the metadata)

    @property
    def nominal(self) -> dict[str, float]:
        """What each coverage should be: the level, and for the interval the outer levels' difference."""
        return {**{f"{q:g}": q for q in self.quantiles}, "interval": round(self.quantiles[-1] - self.quantiles[0], 12)}

    def to_dict(self) -> dict[str, Any]:
        """ModelMeta.calibration."""
        return {"method": METHOD, "offsets": self.offsets.astype(float).tolist(), "offset_units": OFFSET_UNITS,
                "validation_windows": self.windows,
                "nominal": self.nominal, "coverage_before": self.before, "coverage_after": self.after}

    def table(self) -> str:
        lines = [f"calibration ({METHOD}) on {self.windows} validation windows of {self.bars}: coverage "
                 "(share of targets below each quantile, a tie counting half; inside the outer interval)",
                 f"{'quantile':<10} {'nominal':>7}  {'before':>6}  {'after':>6}",
                 *(f"{key:<10} {self.nominal[key]:>7.3f}  {self.before[key]:>6.3f}  {self.after[key]:>6.3f}"
                   for key in self.before)]
        return "\n".join(lines)


def validation_data(ckpt: dict[str, Any], bars: Path | ReadBars | None, column_flags: dict[str, str]
                    ) -> PreparedData:
    """The run's data rebuilt with the trainer's own code: same bars (refused otherwise), split and normalisation.
    `bars`: --bars, or the run's bars in memory (a backtest fold's); None: the checkpoint's data_source."""
    source = bars if bars is not None else Path(str(ckpt["data_source"]))
    flag = f"--bars {source}" if isinstance(bars, Path) else f"the run's bars {source}"
    if isinstance(source, Path) and bars is None and not source.exists():
        raise UsageError(f"--calibrate: the run's bars {source} (the checkpoint's data_source) are not there; pass "
                         "--bars with the bars the run trained on")
    cfg = TrainConfig.from_dict(ckpt["train_config"])
    columns = ColumnMap.from_dict({**ckpt["column_map"], **column_flags})
    try:  # the trainer's own reading (every feature column) and digest of the bars read
        data = prepare(source, cfg, columns, [str(s) for s in ckpt["symbols"]],
                       Normalization.from_dict(ckpt["normalization"]), FeatureConfig.from_dict(ckpt["feature_config"]))
    except BarDataError as exc:
        raise UsageError(f"--calibrate: {flag}: {'; '.join(exc.lines()[:3])}") from None
    except ValueError as exc:  # DataError, or features the bars cannot give (a static column that varies)
        raise UsageError(f"--calibrate: {flag}: {exc}") from None
    if data.bars_digest != ckpt["bars_digest"]:
        raise UsageError(f"--calibrate: {flag} are not the bars the checkpoint's run trained on (its bars: "
                         f"{ckpt['data_source']}): their symbols, rows or values differ; calibrate with the run's bars")
    return data


@torch.inference_mode()
def predict(model: TemporalFusionTransformer, data: PreparedData, anchors: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """The model's quantiles [W, H, Q] and forecast scale [W, H, 1] on the windows ending at `anchors`."""
    quantiles, scales = [], []
    for chunk in torch.from_numpy(anchors).split(BATCH):
        batch = data.tensors.batch(chunk)
        quantiles.append(model(*(batch[name] for name in input_names(model.cfg))).quantiles.float().numpy())
        scale = model.forecast_scale(*(batch[name] for name in SCALE_INPUTS))
        scales.append(scale.expand(chunk.numel(), -1, -1).float().numpy())
    return np.concatenate(quantiles), np.concatenate(scales)


def calibrate(ckpt: dict[str, Any], model: TemporalFusionTransformer, bars: Path | ReadBars | None,
              column_flags: dict[str, str], log: Callable[[str], None], median: bool = False) -> Calibration:
    """--calibrate: rebuild the run's validation split, fit the offsets to its residuals and log the coverage on
    its windows before and after. The median's offset stays 0 unless `median`: a drift of the validation split's
    returns shifts it, and that drift rarely holds in the next period."""
    data = validation_data(ckpt, bars, column_flags)
    anchors = data.val_anchors
    quantiles = tuple(model.cfg.quantiles)
    pred, scale = predict(model, data, anchors)  # [W, H, Q], [W, H, 1]
    target = data.frame.targets[anchors]  # [W, H]
    offsets = conformal_offsets(pred, target, quantiles, scale)  # [H, Q]
    if not median:
        offsets[:, np.isclose(quantiles, 0.5)] = 0.0
    after = CalibratedModel(model, offsets).adjust(torch.from_numpy(pred), torch.from_numpy(scale)).numpy()
    source = str(bars if bars is not None else ckpt["data_source"])
    calibration = Calibration(offsets, int(anchors.size), quantiles, coverage(pred, target, quantiles),
                              coverage(after, target, quantiles), source)
    log(calibration.table())
    return calibration
