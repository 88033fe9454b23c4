"""How a run uses its device: micro-batch, accumulation, gradient checkpointing, precision. The loop obeys
`TrainPlan`; `trainer.planner` derives it from a VRAM budget, else it is the config taken literally."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TrainPlan:
    micro_batch: int  # windows per forward/backward
    batch_size: int  # effective windows per optimizer step (the config's batch_size)
    grad_checkpointing: bool  # recompute LSTM/attention/GRN activations in the backward pass
    precision: str  # fp32 | bf16 | fp16
    val_batch: int  # windows per validation forward (no activations are stored)
    budget_bytes: int = 0  # the VRAM budget this plan was made for (0 = none)
    estimate_bytes: int = 0  # predicted peak device memory of training (0 = not planned)
    notes: tuple[str, ...] = ()  # how the plan was reached, for the log

    @property
    def accumulation(self) -> int:
        return math.ceil(self.batch_size / self.micro_batch)

    def halved(self) -> TrainPlan:
        """The out-of-memory fallback: half the micro-batch, same effective batch."""
        mb = max(1, self.micro_batch // 2)
        return TrainPlan(mb, self.batch_size, self.grad_checkpointing, self.precision, max(1, self.val_batch // 2),
                         self.budget_bytes, self.estimate_bytes, (*self.notes, f"out of memory: micro-batch -> {mb}"))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes), "accumulation": self.accumulation}


def literal_plan(batch_size: int, grad_checkpointing: str, precision: str) -> TrainPlan:
    """No budget: the whole batch at once, checkpointing only if asked for."""
    return TrainPlan(batch_size, batch_size, grad_checkpointing == "on", precision, batch_size)
