"""One training epoch at a fixed micro-batch, alone or as a rank under torchrun; the weights to a file.

    python tests/ddp_epoch.py BARS OUT --micro-batch 2 [--oom-rank R]
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_epoch.py BARS OUT --micro-batch 2

A `--vram-budget` plan sets the micro-batch on a CUDA card only; this sets it on the CPU, so the
tests can give ranks unequal numbers of micro-steps (and, with `--oom-rank`, an out-of-memory
halving on one rank alone) and compare the weights with one process's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trainer.config import TrainConfig
from trainer.distributed import shutdown
from trainer.loop import Trainer
from trainer.modeling import TemporalFusionTransformer
from trainer.plan import TrainPlan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bars", type=Path)
    p.add_argument("out", type=Path, help="rank 0 saves the model's state_dict here")
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--oom-rank", type=int, default=-1, help="this rank's first micro-step runs out of memory")
    args = p.parse_args()
    cfg = TrainConfig.from_dict(dict(hidden_size=8, attention_heads=2, encoder_length=20, horizon=3,
                                     batch_size=args.batch_size, epochs=1, max_steps_per_epoch=4,
                                     max_val_windows=50, threads=1, device="cpu", dropout=0.0))

    def plan_fn(model: TemporalFusionTransformer, data: object, device: torch.device, precision: str) -> TrainPlan:
        return TrainPlan(args.micro_batch, cfg.batch_size, False, precision, cfg.batch_size)

    t = Trainer(args.bars, cfg, args.out.with_name("unused.pt"), progress=False, plan_fn=plan_fn)
    if t.dist.rank == args.oom_rank:
        real = t.micro_step

        def first_runs_out(anchors: torch.Tensor, weight: float) -> float:
            t.micro_step = real  # type: ignore[method-assign]
            raise torch.OutOfMemoryError("injected: out of memory")

        t.micro_step = first_runs_out  # type: ignore[method-assign]
    t.train_epoch()
    if t.dist.is_main:
        torch.save(t.model.state_dict(), args.out)
    shutdown(t.dist)


if __name__ == "__main__":
    main()
