"""Pinball (quantile) loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pinball_loss(pred: Tensor, target: Tensor, quantiles: Tensor | Sequence[float]) -> Tensor:
    """Mean pinball loss per quantile: pred [B, H, Q], target [B, H] -> [Q]."""
    q = torch.as_tensor(quantiles, dtype=pred.dtype, device=pred.device)  # [Q]
    err = target.unsqueeze(-1) - pred  # [B, H, Q]; > 0 when the quantile is below the target
    return torch.maximum(q * err, (q - 1) * err).mean(dim=(0, 1))  # [Q]

