"""From parsed arguments to a finished run: plan, train, report."""

from __future__ import annotations

import argparse
import logging

from features.bars import ColumnMap
from trainer.config import TrainConfig
from trainer.loop import Trainer
from trainer.report import write_report

log = logging.getLogger("trainer")

REPORT_WINDOWS = 512


def run_training(args: argparse.Namespace, cfg: TrainConfig) -> int:
    trainer = Trainer(args.parquet, cfg, args.out, ColumnMap.from_args(args), resume=args.resume,
                      progress=not args.no_progress)
    result = trainer.run()
    if not args.no_report and result.history:
        _report(trainer)
    log.info("best validation loss %.5f at epoch %d; checkpoint %s (resume from %s), metrics %s%s",
             trainer.best_val, trainer.best_epoch, result.paths.best, result.paths.last, result.paths.metrics,
             "" if args.no_report else f", report {result.paths.report}")
    return 0


def _report(trainer: Trainer) -> None:
    """The report shows the best model, as exported, on consecutive validation windows."""
    from trainer.checkpoint import load_checkpoint

    best = load_checkpoint(trainer.paths.best)
    trainer.model.load_state_dict(best["model_state"])
    anchors = trainer.data.val_anchors[:REPORT_WINDOWS]
    outputs = trainer.predict(anchors)
    schema = trainer.data.frame.schema
    write_report(trainer.paths.report, trainer.history, outputs, trainer.data.frame.targets[anchors],
                 tuple(trainer.cfg.quantiles), schema.observed, schema.known, schema.static)
