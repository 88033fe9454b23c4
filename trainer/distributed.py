"""`torchrun --nproc_per_node=N -m trainer ...`: DistributedDataParallel, NCCL on GPUs, gloo on the CPU.
A plain `python -m trainer` runs as a world of one with no process group."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints, metrics, the report and the progress bar."""
        return self.rank == 0

    def device_spec(self, spec: str) -> str:
        """Each rank takes its own GPU: `cuda` becomes `cuda:LOCAL_RANK` under torchrun."""
        use_own = self.enabled and spec in ("cuda", "auto") and torch.cuda.is_available()
        return f"cuda:{self.local_rank}" if use_own else spec

    def from_main(self, compute: Callable[[], T]) -> T:
        """`compute()` run on rank 0 alone, its result on every rank."""
        if not self.enabled:
            return compute()
        box: list[Any] = [compute() if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return cast(T, box[0])

    def mean(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def shard(self, items: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of one step's windows (the distributed sampler)."""
        return items.tensor_split(self.world_size)[self.rank] if self.enabled else items


def init_from_env(device_spec: str) -> DistContext:
    """Join the process group torchrun describes, or return a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    ctx = DistContext(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        use_nccl = device_spec != "cpu" and torch.cuda.is_available()
        if use_nccl:
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group("nccl" if use_nccl else "gloo", timeout=datetime.timedelta(minutes=10))
    return ctx


def shutdown(ctx: DistContext) -> None:
    """Tear the process group down once every rank is done with it (a rank that leaves early aborts gloo)."""
    if ctx.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
