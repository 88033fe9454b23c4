"""Training epochs at a fixed micro-batch, alone or as a rank under torchrun; each rank's results to a file.

    python tests/ddp_epoch.py BARS OUTDIR --micro-batch 2 [--val-batch 5,7] [--oom-rank R] [--loss-oom-rank R]
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_epoch.py BARS OUTDIR --micro-batch 2

A `--vram-budget` plan sets the micro-batch on a CUDA card only; this sets it on the CPU, so the
tests can give ranks unequal numbers of micro-steps, unequal validation batches (as cards with
different free memory plan) and out-of-memory errors on one rank alone, and compare with one
process. Writes OUTDIR/rank{R}.pt: the weights, the validation losses and the RNG state.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import trainer.loop
from trainer.config import TrainConfig
from trainer.distributed import shutdown
from trainer.loop import Trainer
from trainer.modeling import TemporalFusionTransformer
from trainer.plan import TrainPlan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("bars", type=Path)
    p.add_argument("outdir", type=Path)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--val-batch", default="", help="validation batch of each rank, comma-separated")
    p.add_argument("--oom-rank", type=int, default=-1, help="this rank's first micro-step runs out of memory")
    p.add_argument("--loss-oom-rank", type=int, default=-1,
                   help="this rank runs out of memory in its first loss, after the model's forward")
    args = p.parse_args()
    cfg = TrainConfig.from_dict(dict(hidden_size=8, attention_heads=2, encoder_length=20, horizon=3,
                                     batch_size=args.batch_size, epochs=args.epochs, max_steps_per_epoch=4,
                                     max_val_windows=50, threads=1, device="cpu", dropout=0.0, warmup_steps=0))
    val_batches = [int(v) for v in args.val_batch.split(",")] if args.val_batch else []

    def plan_fn(model: TemporalFusionTransformer, data: object, device: torch.device, precision: str) -> TrainPlan:
        val = val_batches[rank] if val_batches else cfg.batch_size
        return TrainPlan(args.micro_batch, cfg.batch_size, False, precision, val)

    rank = int(os.environ.get("RANK", "0"))  # torchrun's
    args.outdir.mkdir(parents=True, exist_ok=True)
    t = Trainer(args.bars, cfg, args.outdir / "ckpt.pt", progress=False, plan_fn=plan_fn)
    if t.dist.rank == args.oom_rank:
        real_step = t.micro_step

        def first_step_runs_out(anchors: torch.Tensor, weight: float) -> float:
            t.micro_step = real_step  # type: ignore[method-assign]
            raise torch.OutOfMemoryError("injected: out of memory")

        t.micro_step = first_step_runs_out  # type: ignore[method-assign]
    if t.dist.rank == args.loss_oom_rank:
        real_loss = trainer.loop.normalized_loss

        def first_loss_runs_out(*a: object, **kw: object) -> torch.Tensor:
            trainer.loop.normalized_loss = real_loss
            raise torch.OutOfMemoryError("injected: out of memory in the loss")

        trainer.loop.normalized_loss = first_loss_runs_out  # type: ignore[assignment]
    result = t.run()
    torch.save({"model": t.model.state_dict(), "val_loss": [r["val_loss"] for r in result.history],
                "rng": torch.get_rng_state()}, args.outdir / f"rank{t.dist.rank}.pt")
    shutdown(t.dist)


if __name__ == "__main__":
    main()
