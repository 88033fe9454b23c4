"""Pinball (quantile) loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def pinball_loss(pred: Tensor, target: Tensor, quantiles: Tensor | Sequence[float]) -> Tensor:
    """Mean pinball loss per quantile: pred [B, H, Q], target [B, H] -> [Q]."""
    q = torch.as_tensor(quantiles, dtype=pred.dtype, device=pred.device)  # [Q]
    err = target.unsqueeze(-1) - pred  # [B, H, Q]; > 0 when the quantile is below the target
    return torch.maximum(q * err, (q - 1) * err).mean(dim=(0, 1))  # [Q]


class QuantileLoss(nn.Module):
    """Pinball loss with the quantile levels in a buffer; forward gives the mean over quantiles."""

    quantiles: Tensor

    def __init__(self, quantiles: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("quantiles", torch.tensor(list(quantiles), dtype=torch.float32))  # [Q]

    def per_quantile(self, pred: Tensor, target: Tensor) -> Tensor:
        return pinball_loss(pred, target, self.quantiles)  # [Q]

    def forward(self, pred: Tensor, target: Tensor) -> Tensor:
        return self.per_quantile(pred, target).mean()  # scalar
